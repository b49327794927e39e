"""Round trips: make then apply gives back the target, bit for bit (exact: byte for byte)."""

from __future__ import annotations

import filecmp
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from pulsediff import apply_patch, make_patch, read_patch_header
from pulsediff.codecs import SPARSE_CODECS
from pulsediff.errors import OutputExistsError
from pulsediff.ops.inspect import checkpoint_digest_of

from ckpt_factory import TORCH_DTYPES, folder_bytes, mutate, random_tensor, save, save_sharded

DTYPE_NAMES = sorted(TORCH_DTYPES)
DENSITIES = [0.0, 0.0005, 0.01, 0.5, 1.0]
shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)


def roundtrip_file(tmp: Path, old: Path, new: Path, **kw) -> Path:
    patch = tmp / "p.pulsediff"
    out = tmp / "out.safetensors"
    make_patch(old, new, patch, device="cpu", **kw)
    result = apply_patch(old, patch, out, device="cpu")
    assert result.status in ("applied", "up-to-date")
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(DTYPE_NAMES), shape=shapes, density=st.sampled_from(DENSITIES), seed=st.integers(0, 2**32 - 1),
       codec=st.sampled_from(SPARSE_CODECS))
def test_exact_roundtrip_every_dtype_shape_density(dtype, shape, density, seed, codec):
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        base = {"t": random_tensor(rng, dtype, shape), "other": random_tensor(rng, "BF16", (7,))}
        target = {"t": mutate(rng, base["t"], density), "other": base["other"]}
        old = save(base, tmp / "old.safetensors")
        new = save(target, tmp / "new.safetensors")
        out = roundtrip_file(tmp, old, new, codec=codec)
        assert filecmp.cmp(out, new, shallow=False)


@pytest.mark.parametrize("codec", SPARSE_CODECS)
@pytest.mark.parametrize("density", DENSITIES)
def test_exact_roundtrip_structural_changes(tmp_path, density, codec):
    """Values, added, removed, reshaped and retyped tensors, and metadata, all at once."""
    rng = np.random.default_rng(1)
    base = {
        "keep": random_tensor(rng, "BF16", (64, 33)),
        "change": random_tensor(rng, "F32", (100,)),
        "gone": random_tensor(rng, "I64", (5,)),
        "reshape": random_tensor(rng, "F16", (4, 6)),
        "retype": random_tensor(rng, "F32", (10,)),
        "empty": random_tensor(rng, "BF16", (0, 3)),
    }
    target = {
        "keep": base["keep"],
        "change": mutate(rng, base["change"], density),
        "reshape": base["reshape"].reshape(6, 4),
        "retype": base["retype"].double(),
        "empty": base["empty"],
        "added": random_tensor(rng, "U8", (9, 2)),
    }
    old = save(base, tmp_path / "old.safetensors", metadata={"step": "1"})
    new = save(target, tmp_path / "new.safetensors", metadata={"step": "2", "note": "ü"})
    out = roundtrip_file(tmp_path, old, new, codec=codec)
    assert filecmp.cmp(out, new, shallow=False)
    header = read_patch_header(tmp_path / "p.pulsediff")
    ops = {t.name: t.op for t in header.tensors}
    assert ops["keep"] == "same" and ops["empty"] == "same"
    assert ops["added"] == ops["reshape"] == ops["retype"] == "full"
    assert header.removed == ("gone",)


def test_identical_checkpoints_give_a_patch_of_same_ops(tmp_path):
    rng = np.random.default_rng(2)
    t = {"a": random_tensor(rng, "BF16", (300,))}
    old = save(t, tmp_path / "old.safetensors")
    new = save(t, tmp_path / "new.safetensors")
    out = roundtrip_file(tmp_path, old, new)
    assert filecmp.cmp(out, new, shallow=False)
    assert all(r.op == "same" for r in read_patch_header(tmp_path / "p.pulsediff").tensors)


def test_make_is_deterministic(tmp_path):
    rng = np.random.default_rng(3)
    base = {"w": random_tensor(rng, "BF16", (200, 50)), "b": random_tensor(rng, "F32", (50,))}
    target = {k: mutate(rng, v, 0.02) for k, v in base.items()}
    old = save(base, tmp_path / "old.safetensors")
    new = save(target, tmp_path / "new.safetensors")
    make_patch(old, new, tmp_path / "p1", device="cpu")
    make_patch(old, new, tmp_path / "p2", device="cpu")
    assert (tmp_path / "p1").read_bytes() == (tmp_path / "p2").read_bytes()


@pytest.mark.parametrize("codec", SPARSE_CODECS)
@pytest.mark.parametrize("shards_old,shards_new", [(2, 2), (3, 2), (1, 3)])
def test_sharded_roundtrip(tmp_path, shards_old, shards_new, codec):
    rng = np.random.default_rng(4)
    base = {f"layer.{i}.w": random_tensor(rng, "BF16", (40, 17)) for i in range(6)}
    target = {k: mutate(rng, v, 0.01) for k, v in base.items()}
    old = save_sharded(base, tmp_path / "old", shards_old)
    new = save_sharded(target, tmp_path / "new", shards_new)
    patch = tmp_path / "p"
    make_patch(old, new, patch, device="cpu", codec=codec)
    out = tmp_path / "out"
    apply_patch(old, patch, out, device="cpu")
    assert folder_bytes(out) == folder_bytes(new)


def test_sharded_in_place_replaces_shards_and_drops_stale_ones(tmp_path):
    rng = np.random.default_rng(5)
    base = {f"t{i}": random_tensor(rng, "F16", (30,)) for i in range(6)}
    target = {k: mutate(rng, v, 0.1) for k, v in base.items()}
    old = save_sharded(base, tmp_path / "old", 3)
    new = save_sharded(target, tmp_path / "new", 2)
    (old / "config.json").write_text("{}")  # unchanged: stays
    (new / "config.json").write_text("{}")
    (old / "notes.txt").write_text("old")  # the target lacks it: goes
    (old / "tokenizer.json").write_text("a")  # changed: replaced
    (new / "tokenizer.json").write_text("b")
    make_patch(old, new, tmp_path / "p", device="cpu")
    apply_patch(old, tmp_path / "p", in_place=True, device="cpu")
    assert folder_bytes(old) == folder_bytes(new)


def test_in_place_file_and_applying_twice_is_harmless(tmp_path):
    rng = np.random.default_rng(6)
    base = {"w": random_tensor(rng, "BF16", (100, 10))}
    old = save(base, tmp_path / "old.safetensors")
    new = save({"w": mutate(rng, base["w"], 0.05)}, tmp_path / "new.safetensors")
    make_patch(old, new, tmp_path / "p", device="cpu")
    assert apply_patch(old, tmp_path / "p", in_place=True, device="cpu").status == "applied"
    assert filecmp.cmp(old, new, shallow=False)
    assert apply_patch(old, tmp_path / "p", in_place=True, device="cpu").status == "up-to-date"
    assert filecmp.cmp(old, new, shallow=False)
    out = tmp_path / "out.safetensors"
    apply_patch(tmp_path / "new.safetensors", tmp_path / "p", out, device="cpu")
    assert filecmp.cmp(out, new, shallow=False)
    with pytest.raises(OutputExistsError, match="force=True"):  # an existing output only with force
        apply_patch(tmp_path / "new.safetensors", tmp_path / "p", out, device="cpu")
    assert apply_patch(tmp_path / "new.safetensors", tmp_path / "p", out, device="cpu",
                       force=True).status == "up-to-date"


# -- bf16 (compute-visible) mode ------------------------------------------------------


def bf16_bits(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).view(torch.int16)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 3000), scale=st.sampled_from([1e-7, 1e-6, 1e-3]),
       codec=st.sampled_from(SPARSE_CODECS))
def test_bf16_mode_from_fp32_masters(seed, n, scale, codec):
    """Target is bf16(NEW) tensor for tensor; base may be the FP32 masters or their BF16 cast."""
    g = torch.Generator().manual_seed(seed)
    w0 = torch.randn(n, generator=g) * 0.02
    w1 = w0 + torch.randn(n, generator=g) * scale  # an optimizer step in FP32
    special = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40, 3.3895314e38])
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        old = save({"w": w0, "s": special, "ids": torch.arange(4)}, tmp / "old32.safetensors")
        new = save({"w": w1, "s": special, "ids": torch.arange(4) * 2}, tmp / "new32.safetensors")
        patch = tmp / "p"
        make_patch(old, new, patch, precision="bf16", device="cpu", codec=codec)
        header = read_patch_header(patch)
        changed_w = int((bf16_bits(w0) != bf16_bits(w1)).sum())
        assert {t.name: t.changed for t in header.tensors}["w"] == changed_w
        receiver = save({"w": w0.bfloat16(), "s": special.bfloat16(), "ids": torch.arange(4)}, tmp / "old16.safetensors")
        for base in (receiver, old):
            out = tmp / f"out-{base.stem}.safetensors"
            apply_patch(base, patch, out, device="cpu")
            got = load_file(str(out))
            assert got["w"].dtype == torch.bfloat16
            assert torch.equal(got["w"].view(torch.int16), bf16_bits(w1))
            assert torch.equal(got["s"].view(torch.int16), bf16_bits(special))
            assert torch.equal(got["ids"], torch.arange(4) * 2)
            assert checkpoint_digest_of(out) == checkpoint_digest_of(new, precision="bf16")


def test_bf16_mode_sharded_index_total_size(tmp_path):
    torch.manual_seed(0)
    base = {f"w{i}": torch.randn(50) for i in range(4)}
    target = {k: v + 1e-3 for k, v in base.items()}
    old = save_sharded(base, tmp_path / "old", 2)
    new = save_sharded(target, tmp_path / "new", 2)
    make_patch(old, new, tmp_path / "p", precision="bf16", device="cpu")
    out = tmp_path / "out"
    apply_patch(old, tmp_path / "p", out, device="cpu")
    import json

    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 4 * 50 * 2
    for name, fname in index["weight_map"].items():
        got = load_file(str(out / fname))[name]
        assert torch.equal(got.view(torch.int16), bf16_bits(target[name]))


@pytest.mark.parametrize("threads,split", [("1", 16 << 20), ("3", 16 << 20), ("3", 0), ("2", 0)])
def test_make_writes_the_same_patch_however_its_tensors_are_read(tmp_path, monkeypatch, fresh_pool, threads, split):
    """make compares each pair in one read (ranges cut to 4 KiB here, so each tensor spans
    several), on its encoding thread alone or spread over the kernel threads (split: the
    largest tensor compared alone): the patch bytes are those of the separate passes (checks,
    then compare) that came before, every kind of record included, and they rebuild the
    target bit for bit."""
    import pulsediff.ops.make as make_mod
    from pulsediff.codecs.ctx_rans import CtxRans
    from pulsediff.kernels import cpu, threads as threads_mod

    from ckpt_factory import mutate, random_tensor, save

    rng = np.random.default_rng(27)
    old = {"big": random_tensor(rng, "BF16", (300, 100)), "f32": random_tensor(rng, "F32", (4000,)),
           "same": random_tensor(rng, "BF16", (50, 90)), "dense": random_tensor(rng, "BF16", (3000,)),
           "retyped": random_tensor(rng, "F16", (500,)), "tiny": random_tensor(rng, "BF16", (3,))}
    new = {"big": mutate(rng, old["big"], 0.02), "f32": mutate(rng, old["f32"], 0.001), "same": old["same"].clone(),
           "dense": mutate(rng, old["dense"], 0.9), "retyped": old["retyped"].to(torch.float32),
           "tiny": mutate(rng, old["tiny"], 1.0)}
    old_path, new_path = save(old, tmp_path / "old.safetensors"), save(new, tmp_path / "new.safetensors")
    reference = tmp_path / "reference.pulsediff"
    with monkeypatch.context() as separate:  # the separate passes: hashes and sums, then the compare
        separate.setattr(CtxRans, "fuses_checks", lambda self, kernels: False)
        make_patch(old_path, new_path, reference)

    monkeypatch.setenv("PULSEDIFF_THREADS", threads)
    if threads_mod._pool is not None:  # the reference's pool has the default size
        threads_mod._pool[1].shutdown()
    monkeypatch.setattr(threads_mod, "_pool", None)
    monkeypatch.setattr(cpu, "_CHECKED_RANGE_BYTES", 4096)
    monkeypatch.setattr(make_mod, "SPLIT_BYTES", split)
    patch = tmp_path / "p.pulsediff"
    header = make_patch(old_path, new_path, patch)
    assert threads_mod.pool()._max_workers == int(threads)
    assert patch.read_bytes() == reference.read_bytes()
    assert {r.name: r.op for r in header.tensors} == {"big": "patch", "f32": "patch", "same": "same", "dense": "full",
                                                      "retyped": "full", "tiny": "full"}
    out = tmp_path / "out.safetensors"
    apply_patch(old_path, patch, out)
    assert out.read_bytes() == new_path.read_bytes()
