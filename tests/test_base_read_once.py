"""apply reads the base once (issue 32): given patch files and a new output, it takes the base's
digest during the rebuild (BaseCheck) instead of in a pass of its own, and falls back to hashing
the base first when anything goes wrong. Every outcome must be the checked order's: the same
output bytes, the same error words, nothing written on a refusal."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import pulsediff.ops.apply as apply_mod
import pulsediff.ops.rebuild as rebuild_mod
from pulsediff import apply_patch, make_patch
from pulsediff.errors import BaseMismatchError, PulsediffError
from pulsediff.io.checkpoint import Checkpoint, TensorView
from pulsediff.ops.apply import apply_chain
from pulsediff.ops.inspect import tensor_ids

from ckpt_factory import mutate, random_tensor, save


def checked_ids(path, precision="exact"):
    with Checkpoint(path) as ckpt:
        return tensor_ids(TensorView(ckpt, precision))


def outcome(fn):
    """('ok', result) or (error type, its one line)."""
    try:
        return "ok", fn()
    except PulsediffError as error:
        return type(error).__name__, str(error)


@pytest.fixture
def steps(tmp_path, monkeypatch):
    """Three steps: a BF16 tensor large enough for windows (the window made small), a small F32
    one, one left alone, and one carried whole (every element new); patches 0->1 and 1->2."""
    monkeypatch.setattr(rebuild_mod, "WINDOW_ELEMENTS", 1 << 12)
    rng = np.random.default_rng(32)
    s0 = {"big": random_tensor(rng, "BF16", (160, 128)), "small": random_tensor(rng, "F32", (300,)),
          "same": random_tensor(rng, "BF16", (40,)), "whole": random_tensor(rng, "F32", (20,))}
    s1 = {"big": mutate(rng, s0["big"], 0.02), "small": mutate(rng, s0["small"], 0.1), "same": s0["same"],
          "whole": random_tensor(rng, "F32", (20,))}
    s2 = {"big": mutate(rng, s1["big"], 0.02), "small": mutate(rng, s1["small"], 0.1), "same": s0["same"],
          "whole": random_tensor(rng, "F32", (20,))}
    paths = [save(s, tmp_path / f"s{k}.safetensors") for k, s in enumerate((s0, s1, s2))]
    for k in (0, 1):
        make_patch(paths[k], paths[k + 1], tmp_path / f"p{k}{k + 1}", device="cpu")
    return tmp_path, paths


def test_a_right_base_is_never_hashed_in_a_pass_of_its_own(steps, monkeypatch):
    tmp, (s0, s1, s2) = steps

    def no_pass(*args, **kwargs):
        raise AssertionError("the base was hashed before the rebuild")

    monkeypatch.setattr(apply_mod, "tensor_ids", no_pass)
    result = apply_chain(s0, [tmp / "p01", tmp / "p12"], tmp / "out", device="cpu")
    assert result.status == "applied" and result.links_applied == 2
    assert (tmp / "out").read_bytes() == s2.read_bytes()
    apply_patch(s0, tmp / "p01", tmp / "out1", device="cpu")
    assert (tmp / "out1").read_bytes() == s1.read_bytes()


def wrong_bases(tmp, s0):
    """Bases that are not the first patch's, each in another way."""
    base = load_file(str(s0))
    out = {}
    for name, edit in {
        "windowed tensor": lambda t: t.update(big=t["big"].clone().view(-1).roll(1).view(160, 128)),
        "whole-decoded tensor": lambda t: t.update(small=t["small"] + 1),
        "tensor left alone": lambda t: t.update(same=t["same"] * 2),
        "tensor carried whole": lambda t: t.update(whole=t["whole"] + 1),
        "a tensor fewer": lambda t: t.pop("whole"),
        "a tensor more": lambda t: t.update(extra=t["small"].clone()),
        "a reshaped tensor": lambda t: t.update(big=t["big"].reshape(128, 160)),
    }.items():
        tensors = {k: v.clone() for k, v in base.items()}
        edit(tensors)
        out[name] = save(tensors, tmp / f"wrong-{len(out)}.safetensors")
    return out


def test_a_wrong_base_is_refused_in_the_checked_orders_words(steps):
    tmp, (s0, s1, s2) = steps
    for what, wrong in wrong_bases(tmp, s0).items():
        for chain in ([tmp / "p01"], [tmp / "p01", tmp / "p12"]):
            before = wrong.read_bytes()
            fast = outcome(lambda: apply_chain(wrong, chain, tmp / "out", device="cpu"))
            checked = outcome(lambda: apply_chain(wrong, chain, tmp / "out", device="cpu",
                                                  base_ids=checked_ids(wrong)))
            assert fast == checked and fast[0] in ("BaseMismatchError", "TensorMismatchError"), (what, fast)
            assert not (tmp / "out").exists() and wrong.read_bytes() == before
            assert sorted(p.name for p in tmp.iterdir() if p.name.startswith(".")) == []  # no temporaries


def test_a_base_further_along_the_chain_or_already_the_target(steps):
    tmp, (s0, s1, s2) = steps
    result = apply_chain(s1, [tmp / "p01", tmp / "p12"], tmp / "out", device="cpu")
    assert result.links_applied == 1 and (tmp / "out").read_bytes() == s2.read_bytes()
    result = apply_chain(s2, [tmp / "p01", tmp / "p12"], tmp / "out2", device="cpu")
    assert result.base_is_target and (tmp / "out2").read_bytes() == s2.read_bytes()
    inplace = save(load_file(str(s1)), tmp / "inplace.safetensors")
    before = inplace.read_bytes()
    result = apply_patch(inplace, tmp / "p01", in_place=True, device="cpu")
    assert result.status == "up-to-date" and inplace.read_bytes() == before
    assert apply_patch(inplace, tmp / "p12", in_place=True, device="cpu").status == "applied"
    assert inplace.read_bytes() == s2.read_bytes()


def test_a_damaged_patch_over_the_right_base_fails_once_with_its_own_error(steps, monkeypatch):
    """Every byte flip of a patch file: the error (or, where a flip is harmless, the output) is the
    one a stream (which is never read speculatively) gives; a failure over the right base is
    raised again without a second rebuild."""
    tmp, (s0, s1, s2) = steps
    patch = (tmp / "p01").read_bytes()
    damaged = tmp / "damaged"
    tries, rebuilds = [], []
    real_apply, real_write = apply_mod._apply, apply_mod._write_target

    def counted(*args, **kwargs):
        tries.append(kwargs.get("speculation") is not None)
        return real_apply(*args, **kwargs)

    def counted_write(*args, **kwargs):
        rebuilds.append(1)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(apply_mod, "_apply", counted)
    monkeypatch.setattr(apply_mod, "_write_target", counted_write)
    rng = np.random.default_rng(5)
    for i in sorted(rng.choice(len(patch), min(len(patch), 400), replace=False)):
        data = bytearray(patch)
        data[i] ^= 1 << int(rng.integers(8))
        damaged.write_bytes(bytes(data))
        tries.clear()
        rebuilds.clear()
        fast = outcome(lambda: apply_patch(s0, damaged, tmp / "out", device="cpu"))
        fast_out = (tmp / "out").read_bytes() if (tmp / "out").exists() else None
        (tmp / "out").unlink(missing_ok=True)
        assert tries[:1] == [True] and len(tries) <= 2 and len(rebuilds) <= 1
        stream = outcome(lambda: apply_patch(s0, io.BytesIO(bytes(data)), tmp / "out", device="cpu"))
        stream_out = (tmp / "out").read_bytes() if (tmp / "out").exists() else None
        (tmp / "out").unlink(missing_ok=True)
        same_words = fast[0] == "ok" or fast[1].replace(str(damaged), "<stream>") == stream[1]
        assert fast[0] == stream[0] and same_words, (i, fast, stream)
        assert fast_out == stream_out
        if fast[0] == "ok":
            assert fast_out == s1.read_bytes()


def test_bf16_mode_reads_the_base_once_too(tmp_path, monkeypatch):
    rng = np.random.default_rng(33)
    old = {"w": random_tensor(rng, "F32", (64, 32)), "b": random_tensor(rng, "BF16", (256,))}
    visible = torch.from_numpy(rng.random((64, 32)) < 0.05)
    new = {"w": torch.where(visible, old["w"] * 1.05, old["w"]), "b": mutate(rng, old["b"], 0.2)}
    old_path, new_path = save(old, tmp_path / "old.safetensors"), save(new, tmp_path / "new.safetensors")
    make_patch(old_path, new_path, tmp_path / "p", device="cpu", precision="bf16")
    with Checkpoint(old_path) as ckpt, Checkpoint(new_path) as ckpt_new:  # the patch changes something
        assert tensor_ids(TensorView(ckpt, "bf16")) != tensor_ids(TensorView(ckpt_new, "bf16"))
    # reference bytes, in the checked order (a stream is never read speculatively)
    apply_patch(old_path, io.BytesIO((tmp_path / "p").read_bytes()), tmp_path / "checked", device="cpu")
    monkeypatch.setattr(apply_mod, "tensor_ids", lambda *a, **k: (_ for _ in ()).throw(AssertionError("hashed")))
    apply_patch(old_path, tmp_path / "p", tmp_path / "out", device="cpu")
    assert (tmp_path / "out").read_bytes() == (tmp_path / "checked").read_bytes()
    other = dict(old, w=old["w"] * 2)
    monkeypatch.undo()
    with pytest.raises(BaseMismatchError):
        apply_patch(save(other, tmp_path / "other.safetensors"), tmp_path / "p", tmp_path / "out2", device="cpu")
    assert not (tmp_path / "out2").exists()


def test_headers_that_allow_another_start_keep_the_checked_order(tmp_path, monkeypatch):
    """Review of the first version: a patch whose base digest is its target's (only metadata
    changed), and a chain that comes back to its base (A -> B, B -> A, A -> C), must start where
    the checked order starts: "up-to-date" in place, and only the last link."""
    rng = np.random.default_rng(34)
    a = {"w": random_tensor(rng, "BF16", (64, 16)), "b": random_tensor(rng, "F32", (32,))}
    b = {"w": mutate(rng, a["w"], 0.05), "b": mutate(rng, a["b"], 0.2)}
    c = {"w": mutate(rng, a["w"], 0.05), "b": a["b"]}
    pa, pb, pc = (save(t, tmp_path / f"{k}.safetensors") for k, t in zip("abc", (a, b, c)))
    relabelled = save(a, tmp_path / "a2.safetensors", metadata={"step": "2"})
    make_patch(pa, relabelled, tmp_path / "meta", device="cpu")
    for src, dst, name in ((pa, pb, "ab"), (pb, pa, "ba"), (pa, pc, "ac")):
        make_patch(src, dst, tmp_path / name, device="cpu")
    inplace = save(a, tmp_path / "inplace.safetensors")
    before = inplace.read_bytes()
    assert apply_patch(inplace, tmp_path / "meta", in_place=True, device="cpu").status == "up-to-date"
    assert inplace.read_bytes() == before
    result = apply_chain(pa, [tmp_path / "ab", tmp_path / "ba", tmp_path / "ac"], tmp_path / "out", device="cpu")
    assert result.links_applied == 1 and (tmp_path / "out").read_bytes() == pc.read_bytes()


def test_a_failure_after_the_base_was_verified_is_not_retried(steps, monkeypatch):
    """An error from the commit itself (after BaseCheck.finish found the base right) is the
    error: no second try hashes the base and reports something else."""
    from pulsediff.errors import OutputError
    from pulsediff.io.atomic import StagedFiles

    tmp, (s0, s1, s2) = steps
    tries = []
    real_apply = apply_mod._apply

    def counted(*args, **kwargs):
        tries.append(kwargs.get("speculation") is not None)
        return real_apply(*args, **kwargs)

    def failing_commit(self):
        raise OutputError("cannot finish writing (injected)")

    monkeypatch.setattr(apply_mod, "_apply", counted)
    monkeypatch.setattr(StagedFiles, "commit", failing_commit)
    with pytest.raises(OutputError, match="injected"):
        apply_patch(s0, tmp / "p01", tmp / "out", device="cpu")
    assert tries == [True] and not (tmp / "out").exists()
