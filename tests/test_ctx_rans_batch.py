"""Batched ctx-rans sections (codecs/ctx_rans_batch.py) against the per-section path.

The per-section path (`CtxRans.locate`, `add_at_summed`, a word sum) is the reference: on
random state dicts of many small tensors of every width, and on sections damaged behind
valid checksums, a batched apply must leave the same tensors, with the same error words, as
the same apply with batching switched off (BATCH_MAX_NUMEL = -1).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import pulsediff
from pulsediff.codecs import ctx_rans_batch
from pulsediff.errors import PulsediffError

from ckpt_factory import mutate, random_tensor
from fuzz_cases import assemble, mutate_bytes, split_patch

DTYPES = ("BF16", "F32", "F16", "F64", "U8", "I16")


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _state(seed: int, count: int = 40) -> tuple[dict, dict, dict]:
    """Three steps of a state dict of small tensors, mixed widths and densities (some with
    escapes: changes of more than a few units in the last place)."""
    rng = np.random.default_rng(seed)
    shapes = [(0,), (1,), (5,), (7, 3), (64, 33), (300,), (2, 3, 50)]
    steps = [{f"m.{i}.{dtype}": random_tensor(rng, dtype, shapes[i % len(shapes)])
              for i in range(count) for dtype in DTYPES[i % 3: i % 3 + 3]}]
    for _ in range(2):
        steps.append({k: mutate(rng, v, float(rng.choice([0.003, 0.05, 0.5]))) for k, v in steps[-1].items()})
    return tuple(steps)


def _apply(tensors: dict, patches, batched: bool, monkeypatch, check: str = "sums") -> tuple[dict, str | None]:
    """The tensors after apply_to_state_dict, and the error's words (or None)."""
    live = {k: v.clone() for k, v in tensors.items()}
    with monkeypatch.context() as m:
        if not batched:
            m.setattr(ctx_rans_batch, "BATCH_MAX_NUMEL", -1)
        try:
            pulsediff.apply_to_state_dict(live, patches, check=check)
            error = None
        except PulsediffError as exc:
            error = f"{type(exc).__name__}: {exc}"
    return {k: _bits(v) for k, v in live.items()}, error


@pytest.mark.parametrize("seed,check", [(0, "sums"), (1, "sums"), (2, "digests"), (3, "digests")])
def test_batched_chain_writes_the_target_as_the_per_section_path_does(seed, check, monkeypatch):
    a, b, c = _state(seed)
    patches = [pulsediff.make_patch_bytes(a, b), pulsediff.make_patch_bytes(b, c)]
    assert any(t["op"] == "patch" and t["section"]["codec"] == "ctx-rans"
               for t in split_patch(patches[0])["tensors"])
    batched, error = _apply(a, patches, True, monkeypatch, check)
    assert error is None
    assert batched == {k: _bits(v) for k, v in c.items()}
    assert _apply(a, patches, False, monkeypatch, check) == (batched, None)


def test_batches_fill_and_close_across_widths(monkeypatch):
    """Tiny batches (one tensor's elements close one) and many of them across the threads."""
    a, b, _ = _state(7, count=60)
    patch = pulsediff.make_patch_bytes(a, b)
    monkeypatch.setattr(ctx_rans_batch, "BATCH_ELEMENTS", 200)
    assert _apply(a, patch, True, monkeypatch) == ({k: _bits(v) for k, v in b.items()}, None)


def test_word_sums_of_equals_the_kernels_word_sum():
    from pulsediff.kernels import cpu_batch
    from pulsediff.kernels.cpu import word_sum

    rng = np.random.default_rng(3)
    arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in (0, 1, 7, 8, 9, 15, 16, 17, 1000, 4097)]
    arrays += [rng.integers(0, 1 << 16, n, dtype=np.uint16) for n in (1, 3, 5, 333)]
    assert ctx_rans_batch.word_sums_of(arrays, cpu_batch) == [word_sum(x) for x in arrays]


def test_the_codec_reads_the_kernels_statuses_and_columns_as_they_are():
    """The codec side keeps its own copy of the kernel's status numbers and meta columns (a codec
    imports no backend): the two must agree name for name."""
    from pulsediff.kernels import cpu_batch

    names = [n for n in vars(cpu_batch) if n.isupper() and isinstance(getattr(cpu_batch, n), int)]
    shared = [n for n in names if hasattr(ctx_rans_batch, n)]
    assert {"OK", "TARGET_SUM", "NOT_FOUND", "META_COLUMNS", "M_UNDO", "M_COUNT"} <= set(shared)
    assert all(getattr(ctx_rans_batch, n) == getattr(cpu_batch, n) for n in shared)
    # The statuses: neither the apply's meta columns nor make's row columns (R_*).
    statuses = [n for n in names if not n.startswith(("M", "R_", "ROW_")) and n != "OK"]
    assert sorted(getattr(cpu_batch, n) for n in statuses) == sorted(ctx_rans_batch._MESSAGES) + \
        [ctx_rans_batch.TARGET_SUM]


def _damaged(patch: bytes, rng: random.Random) -> bytes:
    """The patch with one ctx-rans section's bytes or params damaged, behind valid checksums."""
    header = split_patch(patch)
    refs = [t["section"] for t in header["tensors"] if t["op"] == "patch" and t["section"]["codec"] == "ctx-rans"]
    ref = rng.choice(refs)
    roll = rng.random()
    if roll < 0.6:  # bytes changed in place: the parts still add up, so the decoders meet the damage
        body = bytearray(ref["__body__"])
        for _ in range(rng.choice([1, 1, 2, 3])):
            i = rng.randrange(len(body))
            body[i] = body[i] ^ (1 << rng.randrange(8)) if rng.random() < 0.5 else rng.randrange(256)
        ref["__body__"] = bytes(body)
    elif roll < 0.8:
        ref["__body__"] = mutate_bytes(rng, ref["__body__"])
    else:
        key = rng.choice(sorted(ref["params"]))
        ref["params"][key] = rng.choice([0, 1, ref["params"][key] + 1, max(0, ref["params"][key] - 1), 2 ** 40])
    return assemble(header)


@pytest.mark.parametrize("check", ["sums", "digests"])
def test_damaged_sections_fail_alike_batched_or_not(check, monkeypatch):
    """Every damage the per-section path refuses is refused in the same words, every one it
    accepts gives the same tensors; either way the tensors are left as they were on failure."""
    a, b, _ = _state(11, count=12)
    patch = pulsediff.make_patch_bytes(a, b)
    rng = random.Random(5)
    refused = 0
    before = {k: _bits(v) for k, v in a.items()}
    for _ in range(240):
        bad = _damaged(patch, rng)
        got = _apply(a, bad, True, monkeypatch, check)
        assert got == _apply(a, bad, False, monkeypatch, check)
        if got[1] is not None:
            refused += 1
            assert got[0] == before
    assert refused > 150  # most damage is caught: the comparison is not between two passes


def test_a_failure_in_a_later_batch_puts_back_the_earlier_batches(monkeypatch):
    a, b, _ = _state(13, count=60)
    header = split_patch(pulsediff.make_patch_bytes(a, b))
    last = [t for t in header["tensors"] if t["op"] == "patch"][-1]
    last["target_sum"] = f"{(int(last['target_sum'], 16) + 1) % 2 ** 64:016x}"
    monkeypatch.setattr(ctx_rans_batch, "BATCH_ELEMENTS", 500)
    tensors, error = _apply(a, assemble(header), True, monkeypatch)
    assert error is not None and "does not rebuild to its recorded word sum" in error
    assert tensors == {k: _bits(v) for k, v in a.items()}


def test_a_batched_rebuild_that_misses_its_hash_is_refused_before_any_write(monkeypatch):
    """The digests path: a section damaged in its escapes (the values only) decodes, and only its
    tensor's hash can tell; nothing is written."""
    a, b, _ = _state(17, count=30)
    header = split_patch(pulsediff.make_patch_bytes(a, b))
    escaped = [t for t in header["tensors"] if t["op"] == "patch" and t["section"]["params"]["escapes"]]
    sec = escaped[len(escaped) // 2]["section"]
    body = bytearray(sec["__body__"])
    body[-1] ^= 0x40  # the last escape's top byte
    sec["__body__"] = bytes(body)
    tensors, error = _apply(a, assemble(header), True, monkeypatch, "digests")
    assert error is not None and "does not rebuild to its recorded hash" in error
    assert tensors == {k: _bits(v) for k, v in a.items()}


def test_section_layout_takes_and_refuses_what_its_checks_one_by_one_do():
    """ctx_rans.section_layout's path of plain comparisons against the checks one by one, on
    params near and far from valid: the same layout, or the same error."""
    from pulsediff.codecs.base import SectionContext
    from pulsediff.codecs.ctx_rans import _checked_layout, section_layout
    from pulsediff.errors import CorruptPatchError

    keys = ("count", "class_shift", "class_bits", "escapes", "table_bytes", "position_bytes", "frequency_bytes",
            "value_bytes")
    rng = random.Random(0)
    odd = [-1, True, False, 1.0, "3", None, [1], 2 ** 70, 64, 13]
    accepted = 0
    for _ in range(20000):
        ctx = SectionContext("t", rng.randint(0, 30), rng.choice([1, 2, 4, 8]), "s")
        count = rng.randint(0, ctx.numel)
        escapes = rng.randint(0, count)
        lengths = [rng.randint(0, 9) for _ in range(4)]
        params = dict(zip(keys, [count, rng.randint(0, 9), rng.randint(0, 8), escapes, *lengths]))
        length = sum(lengths) + escapes * ctx.itemsize + rng.choice([0, 0, 0, 1, -1])
        for _ in range(rng.choice([0, 0, 1, 2])):
            params[rng.choice(keys)] = rng.choice(odd + [rng.randint(0, 40)])
        if rng.random() < 0.05:
            del params[rng.choice(keys)]

        def outcome(layout):
            try:
                return layout(params, ctx, length)
            except CorruptPatchError as exc:
                return str(exc)

        got = outcome(section_layout)
        assert got == outcome(_checked_layout), (params, ctx, length)
        accepted += not isinstance(got, str)
    assert 3000 < accepted < 17000


def _apply_file(base, patch: bytes, out, batched: bool, monkeypatch) -> tuple[dict | None, str | None]:
    """A file apply: the output's files (or None) and the error's words (or None)."""
    import shutil

    from pulsediff.ops.apply import apply_patch

    patch_path = out.parent / (out.name + ".pulsediff")
    patch_path.write_bytes(patch)
    with monkeypatch.context() as m:
        if not batched:
            m.setattr(ctx_rans_batch, "BATCH_MAX_NUMEL", -1)
        try:
            apply_patch(base, patch_path, out, device="cpu")
            error = None
        except PulsediffError as exc:
            error = f"{type(exc).__name__}: {exc}"
    files = {p.name: p.read_bytes() for p in sorted(out.iterdir())} if out.exists() else None
    shutil.rmtree(out, ignore_errors=True)
    return files, error


def test_file_apply_in_batches_writes_each_shard_as_the_per_section_path_does(tmp_path, monkeypatch):
    """Batches must not carry a tensor into another shard's file, nor lose one: every shard of a
    folder of small tensors of mixed widths, byte for byte; and damaged sections are refused in
    the same words, with no output left behind."""
    from ckpt_factory import save_sharded

    a, b, _ = _state(19, count=30)
    old, new = save_sharded(a, tmp_path / "old", 3), save_sharded(b, tmp_path / "new", 3)
    from pulsediff.ops.make import make_patch

    make_patch(old, new, tmp_path / "p", device="cpu")
    patch = (tmp_path / "p").read_bytes()
    files, error = _apply_file(old, patch, tmp_path / "out", True, monkeypatch)
    assert error is None and files == {p.name: p.read_bytes() for p in sorted(new.iterdir())}
    assert _apply_file(old, patch, tmp_path / "out", False, monkeypatch) == (files, None)
    rng = random.Random(23)
    refused = 0
    for _ in range(40):
        bad = _damaged(patch, rng)
        got = _apply_file(old, bad, tmp_path / "out", True, monkeypatch)
        want = _apply_file(old, bad, tmp_path / "out", False, monkeypatch)
        # The per-section file path walks a tensor alone without counting its classes (decode_alone),
        # so a rank past its class shows there as one not found: the same refusal in other words.
        assert got == want or (got[0] is want[0] is None
                               and got[1].replace("outside their class", "outside the tensor") == want[1])
        if got[1] is not None:
            refused += 1
            assert got[0] is None
    assert refused > 25
