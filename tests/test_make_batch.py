"""make's batched path for small tensors (ops/make.py _PairBatch, kernels/cpu_batch.diff_encode_batch)
and the one-call section coder under both paths (kernels/ctx_rans_sections.encode_section): the same patch,
byte for byte, as the per-tensor path, on every kind of pair a checkpoint holds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_factory import random_tensor, save
from reference import encode_ranked_ref
from pulsediff.codecs.ctx_rans import CLASS_FIELDS, _encode_ranked
from pulsediff.kernels.cpu import diff_ranks
from pulsediff.ops import make as make_module
from pulsediff.ops.apply import apply_patch
from pulsediff.ops.make import make_patch_bytes

WIDTHS = {1: ("F8_E4M3", np.uint8), 2: ("BF16", np.uint16), 4: ("F32", np.uint32), 8: ("F64", np.uint64)}


def _stepped(rng: np.random.Generator, old: np.ndarray, density: float, far: float) -> np.ndarray:
    """`old` with about `density` of its elements moved one or two units, and a share `far` of
    those moved far (their deltas escape the value code)."""
    new = old.copy()
    moved = rng.random(old.size) < density
    new[moved] += rng.integers(1, 3, int(moved.sum())).astype(old.dtype)
    jumped = moved & (rng.random(old.size) < far)
    new[jumped] ^= old.dtype.type(0x5A)
    return new


@settings(max_examples=40, deadline=None)
@given(width=st.sampled_from(sorted(WIDTHS)), n=st.integers(1, 3000), density=st.sampled_from([0.001, 0.02, 0.3, 1.0]),
       far=st.sampled_from([0.0, 0.05, 1.0]), seed=st.integers(0, 2**32 - 1))
def test_encode_section_equals_the_plain_coder(width, n, density, far, seed):
    name, dtype = WIDTHS[width]
    shift, bits = CLASS_FIELDS[name]
    rng = np.random.default_rng(seed)
    old = rng.integers(0, np.iinfo(dtype).max, n, dtype=dtype, endpoint=True)
    new = _stepped(rng, old, density, far)
    zigzag, classes, ranks, _ = diff_ranks(old, new, shift, (1 << bits) - 1)
    if zigzag.size == 0:
        return
    assert _encode_ranked(classes, ranks, zigzag, shift, bits).parts == encode_ranked_ref(classes, ranks, zigzag, bits)


def _pair(rng: np.random.Generator):
    """A base and a target with every kind of tensor make meets, small ones in runs (batched)
    between ones the per-tensor path takes."""
    old, new = {}, {}

    def small(name, dtype, shape, density, far=0.02):
        t = random_tensor(rng, dtype, shape)
        raw = t.reshape(-1).view(torch.uint8).numpy().view(WIDTHS[t.element_size()][1]) if dtype != "BOOL" else None
        old[name] = t
        if raw is None:
            new[name] = t.clone()
            return
        new[name] = torch.from_numpy(_stepped(rng, raw, density, far)).view(t.dtype).reshape(shape)

    for i in range(12):
        small(f"experts.{i}.w", "BF16", (24, 40), 0.03)
    small("unchanged", "BF16", (50, 8), 0.0)
    small("dense", "BF16", (30, 30), 0.9)  # denser than a sparse section pays for: carried whole
    small("empty", "BF16", (0, 4), 0.0)
    for i in range(5):
        small(f"norm.{i}", "F32", (333,), 0.05)
    small("counts", "I64", (40,), 0.1)
    small("mask", "BOOL", (64,), 0.0)
    small("scale", "F16", (7, 9), 0.2)
    small("fp8", "F8_E4M3", (100,), 0.05)
    small("big", "BF16", (1024, 600), 0.01)  # over _PairBatch.MAX_BYTES: on its own
    for i in range(3):
        small(f"after.{i}", "BF16", (16, 16), 0.05)
    new["new_only"] = random_tensor(rng, "BF16", (10,))
    old["reshaped"] = random_tensor(rng, "BF16", (6, 4))
    new["reshaped"] = random_tensor(rng, "BF16", (4, 6))
    old["gone"] = random_tensor(rng, "F32", (5,))
    return old, new


@pytest.mark.parametrize("precision, digest", [("exact", "tree"), ("exact", "flat"), ("bf16", "tree")])
def test_batched_make_writes_the_per_tensor_paths_bytes(tmp_path, monkeypatch, precision, digest):
    old, new = _pair(np.random.default_rng(7))
    a, b = save(old, tmp_path / "a.safetensors"), save(new, tmp_path / "b.safetensors")
    batched = make_patch_bytes(a, b, precision=precision, digest=digest)
    runs = []
    real = make_module._encode_pairs
    monkeypatch.setattr(make_module, "_encode_pairs", lambda pairs, *rest: runs.append(len(pairs)) or real(pairs, *rest))
    assert make_patch_bytes(a, b, precision=precision, digest=digest) == batched
    assert sum(runs) >= 20 and max(runs) >= 12  # the small tensors did go in batches
    monkeypatch.setattr(make_module._PairBatch, "MAX_BYTES", 0)  # nothing batched: the per-tensor path
    assert make_patch_bytes(a, b, precision=precision, digest=digest) == batched
    patch = tmp_path / "p.pulsediff"
    patch.write_bytes(batched)
    out = tmp_path / "out.safetensors"
    apply_patch(a, patch, out)
    if precision == "exact":
        assert out.read_bytes() == b.read_bytes()


def test_a_batch_closes_when_full_and_on_a_dtype_change(tmp_path, monkeypatch):
    rng = np.random.default_rng(3)
    old = {f"t{i:02d}": random_tensor(rng, "BF16" if i < 10 else "F32", (64,)) for i in range(14)}
    new = {k: v.clone() for k, v in old.items()}
    for k in new:
        new[k].view(torch.uint8)[0] ^= 1
    a, b = save(old, tmp_path / "a.safetensors"), save(new, tmp_path / "b.safetensors")
    runs = []
    real = make_module._encode_pairs
    monkeypatch.setattr(make_module, "_encode_pairs", lambda pairs, *rest: runs.append(len(pairs)) or real(pairs, *rest))
    monkeypatch.setattr(make_module._PairBatch, "FULL_BYTES", 4 * 128)  # four BF16 tensors of 64
    patch = make_patch_bytes(a, b)
    assert sorted(runs) == [2, 2, 2, 4, 4]  # the F32 tensors (256 bytes each) fill a batch at two
    monkeypatch.setattr(make_module._PairBatch, "MAX_BYTES", 0)
    assert make_patch_bytes(a, b) == patch


def test_a_batch_grows_its_section_buffer_and_hashes_tensors_of_several_chunks(tmp_path, monkeypatch):
    """Sections that outgrow the batch's first buffer (grown mid-batch, earlier sections kept) and
    tensors over one tree-hash chunk (256 KiB): still the per-tensor path's bytes."""
    rng = np.random.default_rng(5)
    old = {f"block.{i}": random_tensor(rng, "BF16", (512, 512)) for i in range(6)}  # 512 KiB each, one batch
    old.update({f"small.{i}": random_tensor(rng, "BF16", (8, 8)) for i in range(3)})
    new = {}
    for name, t in old.items():
        raw = t.reshape(-1).view(torch.uint8).numpy().view(np.uint16)
        new[name] = torch.from_numpy(_stepped(rng, raw, 0.05, 0.02)).view(torch.bfloat16).reshape(t.shape)
    a, b = save(old, tmp_path / "a.safetensors"), save(new, tmp_path / "b.safetensors")
    runs = []
    real = make_module._encode_pairs
    monkeypatch.setattr(make_module, "_encode_pairs", lambda pairs, *rest: runs.append(len(pairs)) or real(pairs, *rest))
    monkeypatch.setattr(make_module._PairBatch, "FIRST_OUT_BYTES", 64)
    batched = make_patch_bytes(a, b)
    assert max(runs) >= 6
    monkeypatch.setattr(make_module._PairBatch, "MAX_BYTES", 0)
    assert make_patch_bytes(a, b) == batched
