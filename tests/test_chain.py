"""Chains of patches, squash, and anchors (patches from the empty checkpoint)."""

from __future__ import annotations

import filecmp

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from pulsediff import apply_patch, make_patch
from pulsediff.ops.apply import apply_chain
from pulsediff.codecs import SPARSE_CODECS
from pulsediff.errors import BaseMismatchError, ChainError, TensorMismatchError, UsageError
from pulsediff.ops.squash import squash_patches

from ckpt_factory import mutate, random_tensor, save, save_sharded


def series(tmp_path, rng, steps=4, sharded=False):
    """Checkpoints where values change, and a tensor is removed, re-added and reshaped on the way."""
    t = {"w": random_tensor(rng, "BF16", (64, 32)), "b": random_tensor(rng, "F32", (32,)), "flip": random_tensor(rng, "I8", (5,))}
    paths = []
    for k in range(steps + 1):
        if k:
            t = {**t, "w": mutate(rng, t["w"], 0.02), "b": mutate(rng, t["b"], 0.2)}
            if k == 2:
                t.pop("flip")
            if k == 3:
                t["flip"] = random_tensor(rng, "I8", (7,))
                t["b"] = t["b"].reshape(4, 8)
        if sharded:
            paths.append(save_sharded(dict(t), tmp_path / f"s{k}", 2))
        else:
            paths.append(save(dict(t), tmp_path / f"s{k}.safetensors"))
    return paths


def same(a, b):
    if a.is_dir():
        return sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir()) and all(
            filecmp.cmp(a / p.name, b / p.name, shallow=False) for p in b.iterdir())
    return filecmp.cmp(a, b, shallow=False)


@pytest.mark.parametrize("codec", SPARSE_CODECS)
@pytest.mark.parametrize("sharded", [False, True])
def test_chain_and_squash_equal_the_last_checkpoint(tmp_path, codec, sharded):
    rng = np.random.default_rng(31)
    ckpts = series(tmp_path, rng, sharded=sharded)
    links = []
    for k in range(len(ckpts) - 1):  # formats 2.0 and 1.5 in turn: a chain may mix them
        links.append(tmp_path / f"p{k}")
        make_patch(ckpts[k], ckpts[k + 1], links[-1], codec=codec, device="cpu", format_version=1 + (k % 2 == 0))
    assert [p.read_bytes()[8] for p in links] == [2, 1, 2, 1]
    out = tmp_path / ("out" if sharded else "out.safetensors")
    result = apply_chain(ckpts[0], links, out, device="cpu")
    assert result.links_applied == len(links) and same(out, ckpts[-1])
    # a base further along the chain starts from its own link
    out2 = tmp_path / ("out2" if sharded else "out2.safetensors")
    assert apply_chain(ckpts[2], links, out2, device="cpu").links_applied == 2
    assert same(out2, ckpts[-1])
    # squash: one patch, same effect, never larger than the sum of the links
    squashed = tmp_path / "sq"
    squash_patches(ckpts[0], links, squashed, codec=codec, device="cpu")
    assert squashed.stat().st_size <= sum(p.stat().st_size for p in links)
    assert squashed.read_bytes()[8] == 2  # written as today's format
    out3 = tmp_path / ("out3" if sharded else "out3.safetensors")
    apply_patch(ckpts[0], squashed, out3, device="cpu")
    assert same(out3, ckpts[-1])


def test_broken_chains_are_refused_before_writing(tmp_path):
    rng = np.random.default_rng(32)
    ckpts = series(tmp_path, rng, steps=3)
    links = [tmp_path / f"p{k}" for k in range(3)]
    for k, p in enumerate(links):
        make_patch(ckpts[k], ckpts[k + 1], p, device="cpu")
    out = tmp_path / "out.safetensors"
    with pytest.raises(ChainError, match="does not follow"):
        apply_chain(ckpts[0], [links[0], links[2]], out, device="cpu")
    with pytest.raises((BaseMismatchError, TensorMismatchError)):
        apply_chain(ckpts[3], [links[0], links[1]], out, device="cpu")  # ckpt 3 is no base of this chain
    with pytest.raises(UsageError, match="must be files"):
        apply_chain(ckpts[0], [links[0], "-"], out, device="cpu")
    assert not out.exists()
    # damage in a middle link is found, and nothing is written
    data = bytearray(links[1].read_bytes())
    data[-3] ^= 0x10
    links[1].write_bytes(bytes(data))
    with pytest.raises(Exception) as info:
        apply_chain(ckpts[0], links, out, device="cpu")
    assert "corrupt" in str(info.value) or "checksum" in str(info.value)
    assert not out.exists()


def test_anchor_is_a_patch_from_the_empty_checkpoint(tmp_path):
    rng = np.random.default_rng(33)
    ckpts = series(tmp_path, rng, steps=1)
    anchor = tmp_path / "anchor"
    header = make_patch(None, ckpts[1], anchor, device="cpu")
    assert all(r.op == "full" for r in header.tensors) and header.base_tensors == 0
    out = tmp_path / "out.safetensors"
    apply_patch(None, anchor, out, device="cpu")
    assert same(out, ckpts[1])
    # its base is the empty checkpoint, not any checkpoint
    with pytest.raises(BaseMismatchError):
        apply_patch(ckpts[0], anchor, tmp_path / "x", device="cpu")


def test_make_from_a_source_that_reuses_its_buffer_encodes_each_tensor_before_the_next(tmp_path):
    """squash hands make tensors rebuilt in one reused buffer: make must not encode them
    side by side (it did: squashed patches that apply refused, found by the fuzz campaign)."""
    from pulsediff.ops.make import TargetSource, write_patch
    from pulsediff.io.checkpoint import TensorData, TensorView, open_checkpoint
    from pulsediff.io.dtypes import DTYPES
    from pulsediff.runtime.progress import SILENT

    rng = np.random.default_rng(5)
    names = [f"t{i}" for i in range(6)]
    base = {n: torch.from_numpy(rng.normal(0, 0.02, 1 << 18).astype(np.float32)).to(torch.bfloat16) for n in names}
    target = {n: t.clone() for n, t in base.items()}
    for t in target.values():
        t.view(torch.int16)[:: 37] += 1
    save_file(base, tmp_path / "base.safetensors")
    save_file(target, tmp_path / "target.safetensors")
    shared = np.empty(1 << 18, np.uint16)  # every get overwrites it, as squash's scratch does

    with open_checkpoint(tmp_path / "target.safetensors") as ckpt:
        view = TensorView(ckpt, "exact")
        source = TargetSource.of_view(view)

        def get(name):
            np.copyto(shared, view.get(name).bits)
            return TensorData(name, DTYPES["BF16"], (1 << 18,), shared)

        source.get, source.reuses_buffers = get, True
        write_patch(tmp_path / "base.safetensors", source, tmp_path / "p", codec="ctx-rans", device="cpu",
                    progress=SILENT)
    apply_patch(tmp_path / "base.safetensors", tmp_path / "p", tmp_path / "out.safetensors", device="cpu")
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "target.safetensors").read_bytes()


def test_a_base_said_to_be_the_target_is_still_checked_tensor_by_tensor(tmp_path):
    """apply_chain trusts the caller's `base_ids` for where the base stands (catch-up hashes the worker
    once, then applies): when they say the base already is the target, the base's tensors are what is
    written, and each must still match the target's record. A worker replaced between catch-up's two
    opens was written out unchecked and reported as the target (review of issue 23)."""
    from pulsediff.errors import CorruptPatchError
    from pulsediff.io.checkpoint import Checkpoint, TensorView
    from pulsediff.ops.inspect import tensor_ids

    rng = np.random.default_rng(41)
    paths = series(tmp_path, rng, steps=2)
    patches = [tmp_path / "p01.pulsediff", tmp_path / "p12.pulsediff"]
    for k, p in enumerate(patches):
        make_patch(paths[k], paths[k + 1], p, device="cpu")
    with Checkpoint(paths[2]) as target:
        target_ids = tensor_ids(TensorView(target, "exact"))
    out = tmp_path / "out.safetensors"
    with pytest.raises(CorruptPatchError, match="does not rebuild to its recorded hash"):
        apply_chain(paths[0], patches, out, device="cpu", base_ids=target_ids)  # the ids lie: the base is step 0
    assert not out.exists()
    result = apply_chain(paths[2], patches, out, device="cpu", base_ids=target_ids)  # ids that tell the truth
    assert result.status == "applied" and same(out, paths[2])
