"""The CUDA base-context kernels of ctx-rans against the CPU kernels and the plain
references in `tests/reference.py`, bit for bit; device arrays in and out (zero-copy);
the ctx-rans codec made on one backend and applied on the other; scripts/bench_gpu.py.

Without a GPU these run under Numba's CUDA simulator (conftest.py sets
NUMBA_ENABLE_CUDASIM=1), where every CUDA thread is a Python thread: inputs stay
small, and blocks are shrunk to 8 threads and 2 items so that a few hundred elements
still span many ranges, several rounds per range (a range starts anywhere, its first
round at the multiple of 8 below), and more ranges than blocks (the grid-stride loop).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuda_sim import SMALL_LAUNCH, fast_simulator, launch_config
from reference import (add_at_ref, apply_ranked_ref, chunk_class_starts_ref, class_ranks_ref, classes_ref,
                       diff_compact_ref, diff_ranks_ref, gaps_to_positions_ref, ranked_positions_ref, scatter_ref,
                       word_sum_ref, chunk_digests_ref, tree_hash_ref)

try:
    from numba import config as numba_config
    from numba import cuda as numba_cuda

    SIMULATED = bool(numba_config.ENABLE_CUDASIM)
except Exception:  # numba-cuda absent or broken
    numba_cuda = None
    SIMULATED = False

pytestmark = pytest.mark.skipif(numba_cuda is None,
                                reason="numba.cuda cannot be imported (install numba-cuda); CUDA backend not tested")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cuda_k():
    from pulsediff.kernels import cuda

    with launch_config(cuda.common, **SMALL_LAUNCH), fast_simulator():
        yield cuda


@pytest.fixture(scope="module")
def cpu_k():
    from pulsediff.kernels import cpu

    return cpu


# --- inputs ------------------------------------------------------------------------


def bf16_like(rng, n):
    """BF16 bit patterns of weights ~ N(0, 0.02): a few exponents hold most elements
    (neighbours share a class), most of the 256 classes are empty; some exact zeros."""
    w = (rng.standard_normal(n) * 0.02).astype(np.float32)
    w[rng.random(n) < 0.02] = 0.0
    return (w.view(np.uint32) >> 16).astype(np.uint16)


def f32_like(rng, n):
    return (rng.standard_normal(n) * 0.02).astype(np.float32).view(np.uint32)


def uniform(dtype):
    def make(rng, n):
        return rng.integers(0, np.iinfo(dtype).max, n, dtype=dtype, endpoint=True)

    return make


# (id, maker, shift, mask): ctx-rans' BF16 and F32 fields; every class of 256 hit;
# 8-byte patterns where the class takes the sign bit's extension (shift 62, mask 7:
# np.int64(bits) >> 62 is arithmetic); one class only (no float field).
CASES = [
    ("bf16", bf16_like, 7, 255),
    ("f32", f32_like, 23, 255),
    ("u16-uniform", uniform(np.uint16), 7, 255),
    ("u64-sign", uniform(np.uint64), 62, 7),
    ("u8-one-class", uniform(np.uint8), 0, 0),
]
CASE_IDS = [c[0] for c in CASES]


def tiered(slow: set[str], cases=CASES) -> list:
    """`cases` as parameters, those named in `slow` in the slow tier: each simulated case takes 10-15 s,
    so the default run keeps a set that covers every word width (1, 2, 4, 8 bytes) across the tests
    that share CASES, and `pytest -m slow` (.ci/run runs it) the rest."""
    return [pytest.param(c, id=c[0], marks=[pytest.mark.slow] if c[0] in slow else []) for c in cases]


def listed_entries(base, shift, mask, positions, ranks, rng, wide=False):
    """What ctx-rans decode hands apply_ranked: entries grouped by class (stable), the
    offsets of each class's entries, zigzag deltas (uint8, or uint64 with values that
    wrap the element); and the target the reference expects."""
    classes = np.array(classes_ref(base, shift, mask), np.int64)[positions] if positions.size else np.empty(0, np.int64)
    order = np.argsort(classes, kind="stable")
    offsets = np.zeros(mask + 2, np.int64)
    np.cumsum(np.bincount(classes, minlength=mask + 1), out=offsets[1:])
    if wide:
        deltas = rng.integers(0, np.iinfo(np.uint64).max, positions.size, dtype=np.uint64, endpoint=True)
    else:
        deltas = rng.integers(0, 6, positions.size).astype(np.uint8)  # mostly +-1 ULP, as in RL steps
    return offsets, ranks[order], deltas


def pick_positions(rng, n, density):
    if density == "all":
        return np.arange(n, dtype=np.int64)
    return np.flatnonzero(rng.random(n) < density).astype(np.int64)


# --- chunk_class_starts --------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_chunk_class_starts(cuda_k, cpu_k, case):
    _, make, shift, mask = case
    rng = np.random.default_rng(1)
    for n in (0, 1, 37, 301):
        base = make(rng, n)
        starts, sizes = cuda_k.chunk_class_starts(base, shift, mask)
        assert starts.dtype == sizes.dtype == np.int64 and starts.shape[1] == mask + 1
        assert starts.shape[0] == max(1, -(-n // 16))  # ranges of one 16-element tile each
        want_starts, want_sizes = chunk_class_starts_ref(base, shift, mask, starts.shape[0])
        np.testing.assert_array_equal(starts, want_starts)
        np.testing.assert_array_equal(sizes, want_sizes)
        cpu_starts, cpu_sizes = cpu_k.chunk_class_starts(base, shift, mask)
        np.testing.assert_array_equal(cpu_sizes, sizes)
        np.testing.assert_array_equal(cpu_starts, chunk_class_starts_ref(base, shift, mask, cpu_starts.shape[0])[0])


def test_range_count_is_bounded_by_the_budget(cuda_k):
    """A small budget makes few, long ranges (many rounds per range), the trailing ones
    empty when the length does not divide; starts stay consistent for every kernel."""
    rng = np.random.default_rng(2)
    base = bf16_like(rng, 203)
    positions = pick_positions(rng, base.size, 0.2)
    with launch_config(cuda_k.ranks, CLASS_TILE_BUDGET=256 * 3):
        starts, sizes = cuda_k.chunk_class_starts(base, 7, 255)
        assert starts.shape == (3, 256)
        np.testing.assert_array_equal(starts, chunk_class_starts_ref(base, 7, 255, 3)[0])
        ranks, _ = cuda_k.class_ranks(base, 7, 255, positions)
        want_ranks, want_sizes = class_ranks_ref(base, 7, 255, positions)
        np.testing.assert_array_equal(ranks, want_ranks)
        np.testing.assert_array_equal(sizes, want_sizes)
        offsets, ranks_cm, deltas = listed_entries(base, 7, 255, positions, ranks, rng)
        out = np.zeros_like(base)
        applied = cuda_k.apply_ranked(base, 7, 255, starts, offsets, ranks_cm, deltas, out)
        want, want_applied = apply_ranked_ref(base, 7, 255, offsets, ranks_cm, deltas)
        assert applied == want_applied == positions.size
        np.testing.assert_array_equal(out, want)
    # 9 elements in 4 ranges of 3: the last range is empty.
    small = bf16_like(rng, 9)
    with launch_config(cuda_k.ranks, CLASS_TILE_BUDGET=256 * 4), \
            launch_config(cuda_k.common, ITEMS_PER_THREAD=1, THREADS_PER_BLOCK=2):
        starts, _ = cuda_k.chunk_class_starts(small, 7, 255)
        assert starts.shape[0] == 4
        np.testing.assert_array_equal(starts, chunk_class_starts_ref(small, 7, 255, 4)[0])


def test_class_field_is_checked(cuda_k):
    base = np.zeros(4, np.uint16)
    with pytest.raises(ValueError, match="mask"):
        cuda_k.chunk_class_starts(base, 0, 4096)
    with pytest.raises(ValueError, match="shift"):
        cuda_k.class_ranks(base, 64, 0, np.zeros(0, np.int64))


# --- class_ranks -----------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_class_ranks(cuda_k, cpu_k, case):
    _, make, shift, mask = case
    rng = np.random.default_rng(3)
    for n, density in [(0, 0.5), (1, "all"), (120, 0.0), (301, 0.01), (301, 0.3), (77, "all")]:
        base = make(rng, n)
        positions = pick_positions(rng, n, density)
        ranks, sizes = cuda_k.class_ranks(base, shift, mask, positions)
        want_ranks, want_sizes = class_ranks_ref(base, shift, mask, positions)
        assert ranks.dtype == sizes.dtype == np.int64
        np.testing.assert_array_equal(ranks, want_ranks)
        np.testing.assert_array_equal(sizes, want_sizes)
        cpu_ranks, cpu_sizes = cpu_k.class_ranks(base, shift, mask, positions)
        np.testing.assert_array_equal(cpu_ranks, ranks)
        np.testing.assert_array_equal(cpu_sizes, sizes)


def test_class_ranks_most_classes(cuda_k):
    """mask 4095, the most classes ctx-rans allows: the shared-memory tables at their largest."""
    rng = np.random.default_rng(4)
    base = uniform(np.uint16)(rng, 90)
    positions = pick_positions(rng, base.size, 0.3)
    ranks, sizes = cuda_k.class_ranks(base, 4, 4095, positions)
    want_ranks, want_sizes = class_ranks_ref(base, 4, 4095, positions)
    np.testing.assert_array_equal(ranks, want_ranks)
    np.testing.assert_array_equal(sizes, want_sizes)
    starts, _ = cuda_k.chunk_class_starts(base, 4, 4095)
    offsets, ranks_cm, deltas = listed_entries(base, 4, 4095, positions, ranks, rng)
    out = base.copy()
    assert cuda_k.apply_ranked(out, 4, 4095, starts, offsets, ranks_cm, deltas, out) == positions.size
    np.testing.assert_array_equal(out, apply_ranked_ref(base, 4, 4095, offsets, ranks_cm, deltas)[0])


@pytest.mark.parametrize("positions", [[3, 2], [4, 4], [-1, 5], [5, 40]], ids=["descending", "duplicate",
                                                                               "negative", "past-the-end"])
def test_class_ranks_refuses_bad_positions(cuda_k, positions):
    with pytest.raises(ValueError, match="ascending positions inside the tensor"):
        cuda_k.class_ranks(np.arange(40, dtype=np.uint16), 7, 255, np.array(positions, np.int64))


# --- apply_ranked --------------------------------------------------------------------


# 8-byte elements wrap modulo 2**64 on purpose; the simulator's NumPy scalars warn of it.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("case", tiered({"f32", "u16-uniform"}))
def test_apply_ranked(cuda_k, cpu_k, case):
    _, make, shift, mask = case
    rng = np.random.default_rng(5)
    # 145 and 130 elements make ranges of 15: most start mid-round.
    for n, density, wide in [(1, "all", False), (130, 0.0, False), (301, 0.01, False), (145, 0.3, True),
                             (77, "all", True)]:
        base = make(rng, n)
        positions = pick_positions(rng, n, density)
        ranks, _ = class_ranks_ref(base, shift, mask, positions)
        offsets, ranks_cm, deltas = listed_entries(base, shift, mask, positions, ranks, rng, wide)
        want, want_applied = apply_ranked_ref(base, shift, mask, offsets, ranks_cm, deltas)
        assert want_applied == positions.size
        cuda_starts, _ = cuda_k.chunk_class_starts(base, shift, mask)
        cpu_starts, _ = cpu_k.chunk_class_starts(base, shift, mask)
        # Either backend's starts with either backend's apply: the rows say how the tensor is cut.
        for starts in (cuda_starts, cpu_starts):
            out = np.full_like(base, 0x5A)  # garbage: every element must be written
            assert cuda_k.apply_ranked(base, shift, mask, starts, offsets, ranks_cm, deltas, out) == want_applied
            np.testing.assert_array_equal(out, want)
            in_place = base.copy()
            assert cuda_k.apply_ranked(in_place, shift, mask, starts, offsets, ranks_cm, deltas,
                                       in_place) == want_applied
            np.testing.assert_array_equal(in_place, want)
        out = np.full_like(base, 0x5A)
        assert cpu_k.apply_ranked(base, shift, mask, cuda_starts, offsets, ranks_cm, deltas, out) == want_applied
        np.testing.assert_array_equal(out, want)


def test_apply_ranked_window_by_window(cuda_k, cpu_k):
    """How ctx-rans decodes a tensor window by window: each window's starts offset by the
    class counts of the windows before it, every entry given to every window; each
    window applies exactly its own entries."""
    rng = np.random.default_rng(12)
    base = bf16_like(rng, 290)
    positions = pick_positions(rng, base.size, 0.1)
    ranks, _ = class_ranks_ref(base, 7, 255, positions)
    offsets, ranks_cm, deltas = listed_entries(base, 7, 255, positions, ranks, rng)
    want, want_applied = apply_ranked_ref(base, 7, 255, offsets, ranks_cm, deltas)
    for k in (cuda_k, cpu_k):
        seen, applied, parts = np.zeros(256, np.int64), 0, []
        for lo in range(0, base.size, 100):
            part = base[lo:lo + 100]
            starts, sizes = k.chunk_class_starts(part, 7, 255)
            starts += seen
            out = np.empty_like(part)
            applied += k.apply_ranked(part, 7, 255, starts, offsets, ranks_cm, deltas, out)
            seen += sizes
            parts.append(out)
        assert applied == want_applied
        np.testing.assert_array_equal(np.concatenate(parts), want)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_ranked_window(cuda_k, cpu_k, case):
    """What apply does on files: a tensor window by window, entries made resident once; each
    backend's windows add up to the reference, and `seen` ends at the class sizes. Windows of
    uneven sizes, twice on the CUDA side (its pinned and device buffers are reused)."""
    _, make, shift, mask = case
    rng = np.random.default_rng(25)
    base = make(rng, 290)
    positions = pick_positions(rng, base.size, 0.1)
    ranks, sizes = class_ranks_ref(base, shift, mask, positions)
    offsets, ranks_cm, deltas = listed_entries(base, shift, mask, positions, ranks, rng, wide=base.itemsize == 8)
    want, want_applied = apply_ranked_ref(base, shift, mask, offsets, ranks_cm, deltas)
    for k in (cuda_k, cuda_k, cpu_k):
        resident = k.resident(offsets, ranks_cm, deltas)
        seen, applied, parts = np.zeros(mask + 1, np.int64), 0, []
        for lo, hi in [(0, 100), (100, 117), (117, 290)]:
            out = np.full(hi - lo, 0x5A, base.dtype)
            applied += k.ranked_window(base[lo:hi], shift, mask, seen, *resident, out)
            parts.append(out)
        assert applied == want_applied
        np.testing.assert_array_equal(np.concatenate(parts), want)
        np.testing.assert_array_equal(seen, sizes)


def test_apply_ranked_hostile_ranks_are_not_written(cuda_k, cpu_k):
    """Ranks past their class (== its size, beyond, 2**62), negative ones, and entries of a
    class the base does not have: never written, and the count falls short by exactly
    those, as on the CPU backend. Writes stay inside `out` (guard bands)."""
    rng = np.random.default_rng(6)
    base = bf16_like(rng, 301)
    shift, mask = 7, 255
    positions = pick_positions(rng, base.size, 0.1)
    ranks, sizes = class_ranks_ref(base, shift, mask, positions)
    offsets, ranks_cm, deltas = listed_entries(base, shift, mask, positions, ranks, rng)
    present = np.flatnonzero(sizes)
    k_big = int(present[np.argmax(sizes[present])])
    k_empty = int(np.flatnonzero(sizes == 0)[0])
    # Per class, extra entries in ascending order: a negative rank first, out-of-range ones last.
    extra = {k_big: ([-7], [int(sizes[k_big]), int(sizes[k_big]) + 3, 2**62]), k_empty: ([], [0, 5])}
    lists_r, lists_d, new_offsets = [], [], [0]
    for k in range(mask + 1):
        before, after = extra.get(k, ([], []))
        seg = ranks_cm[offsets[k]:offsets[k + 1]]
        lists_r.append(np.concatenate([np.array(before, np.int64), seg, np.array(after, np.int64)]))
        lists_d.append(np.concatenate([np.full(len(before), 3, np.uint8), deltas[offsets[k]:offsets[k + 1]],
                                       np.full(len(after), 3, np.uint8)]))
        new_offsets.append(new_offsets[-1] + lists_r[-1].size)
    h_ranks, h_deltas, h_offsets = np.concatenate(lists_r), np.concatenate(lists_d), np.array(new_offsets, np.int64)
    hostile = 6
    want, want_applied = apply_ranked_ref(base, shift, mask, h_offsets, h_ranks, h_deltas)
    assert want_applied == h_ranks.size - hostile == positions.size
    guard = 8
    for backend in (cuda_k, cpu_k):
        starts, _ = backend.chunk_class_starts(base, shift, mask)
        buf = np.full(base.size + 2 * guard, 0xA5A5, np.uint16)
        out = buf[guard:guard + base.size]
        applied = cuda_k.apply_ranked(base, shift, mask, starts, h_offsets, h_ranks, h_deltas, out)
        assert applied == want_applied
        np.testing.assert_array_equal(out, want)
        assert (buf[:guard] == 0xA5A5).all() and (buf[-guard:] == 0xA5A5).all()
        cpu_out = np.zeros_like(base)
        assert cpu_k.apply_ranked(base, shift, mask, starts, h_offsets, h_ranks, h_deltas, cpu_out) == want_applied
        np.testing.assert_array_equal(cpu_out, want)


def test_apply_ranked_unordered_ranks_fall_short(cuda_k, cpu_k):
    """Ranks that do not ascend strictly within a class (no decoder makes them) are never
    all applied: the count falls short on both backends, so the caller refuses the patch."""
    rng = np.random.default_rng(7)
    base = bf16_like(rng, 200)
    sizes = np.bincount(np.array(classes_ref(base, 7, 255)), minlength=256)
    k = int(np.argmax(sizes))
    offsets = np.zeros(257, np.int64)
    for bad in ([5, 5], [9, 2, 9], [3, 1]):
        offsets[k + 1:] = len(bad)
        ranks = np.array(bad, np.int64)
        deltas = np.full(len(bad), 2, np.uint8)
        for backend in (cuda_k, cpu_k):
            starts, _ = backend.chunk_class_starts(base, 7, 255)
            out = np.zeros_like(base)
            assert backend.apply_ranked(base, 7, 255, starts, offsets, ranks, deltas, out) < len(bad)


def test_apply_ranked_checks_its_arguments(cuda_k):
    base = np.zeros(10, np.uint16)
    starts, _ = cuda_k.chunk_class_starts(base, 7, 255)
    offsets = np.zeros(257, np.int64)
    with pytest.raises(ValueError, match="class_offsets"):
        cuda_k.apply_ranked(base, 7, 255, starts, offsets[:-1], np.zeros(0, np.int64), np.zeros(0, np.uint8), base)
    with pytest.raises(ValueError, match="columns"):
        cuda_k.apply_ranked(base, 7, 15, starts, offsets[:17], np.zeros(0, np.int64), np.zeros(0, np.uint8), base)
    with pytest.raises(ValueError, match="deltas"):
        cuda_k.apply_ranked(base, 7, 255, starts, offsets, np.zeros(2, np.int64), np.zeros(1, np.uint8), base)


def check_all_three(k, base, shift, mask, positions, rng):
    """chunk_class_starts, class_ranks and apply_ranked (into a new buffer and in place) of
    backend k against the references."""
    starts, sizes = k.chunk_class_starts(base, shift, mask)
    want_starts, want_sizes = chunk_class_starts_ref(base, shift, mask, starts.shape[0])
    np.testing.assert_array_equal(starts, want_starts)
    np.testing.assert_array_equal(sizes, want_sizes)
    ranks, sizes = k.class_ranks(base, shift, mask, positions)
    want_ranks, _ = class_ranks_ref(base, shift, mask, positions)
    np.testing.assert_array_equal(ranks, want_ranks)
    np.testing.assert_array_equal(sizes, want_sizes)
    offsets, ranks_cm, deltas = listed_entries(base, shift, mask, positions, ranks, rng)
    want, want_applied = apply_ranked_ref(base, shift, mask, offsets, ranks_cm, deltas)
    out = np.zeros_like(base)
    assert k.apply_ranked(base, shift, mask, starts, offsets, ranks_cm, deltas, out) == want_applied
    np.testing.assert_array_equal(out, want)
    in_place = base.copy()
    assert k.apply_ranked(in_place, shift, mask, starts, offsets, ranks_cm, deltas, in_place) == want_applied
    np.testing.assert_array_equal(in_place, want)


# 256 threads (the shipped default) and 1024 give the same results, but take 15 to 40 s
# each under the simulator: one thread, and a warp, stand for them here.
@pytest.mark.parametrize("threads, items, max_blocks, n", [(1, 1, 2, 40), (32, 2, 3, 301)])
def test_launch_shapes(cuda_k, threads, items, max_blocks, n):
    rng = np.random.default_rng(threads)
    with launch_config(cuda_k.common, THREADS_PER_BLOCK=threads, ITEMS_PER_THREAD=items, MAX_BLOCKS=max_blocks):
        base = bf16_like(rng, n)
        check_all_three(cuda_k, base, 7, 255, pick_positions(rng, n, 0.2), rng)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(0, 120), field=st.sampled_from([(7, 255), (0, 3), (4, 0), (12, 15)]),
       density=st.sampled_from([0.0, 0.05, 0.5, 1.0]), seed=st.integers(0, 2**32 - 1))
def test_property_class_kernels(cuda_k, n, field, density, seed):
    rng = np.random.default_rng(seed)
    check_all_three(cuda_k, bf16_like(rng, n), *field, pick_positions(rng, n, density), rng)


# --- diff_ranks (make's compare and class ranks) --------------------------------------------


# 8-byte differences wrap modulo 2**64 on purpose; the simulator's NumPy scalars warn of it.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("case", CASES[:2] + [("u64-f64", uniform(np.uint64), 52, 2047)], ids=["bf16", "f32", "u64"])
def test_diff_ranks(cuda_k, cpu_k, case):
    _, make, shift, mask = case
    rng = np.random.default_rng(13)
    for n, density in [(0, 0.5), (5, 1.0), (150, 0.0), (150, 0.1)]:
        old = make(rng, n)
        new = old.copy()
        hit = rng.random(n) < density
        new[hit] = make(rng, int(hit.sum()))
        if n >= 4:  # the extreme differences: +-1 and the wrap-around
            info = np.iinfo(old.dtype)
            new[:4] = old[:4] + np.array([1, info.max, info.max // 2 + 1, info.max // 2], old.dtype)
        got = cuda_k.diff_ranks(old, new, shift, mask)
        want = diff_ranks_ref(old, new, shift, mask)
        for g, w, c in zip(got, want, cpu_k.diff_ranks(old, new, shift, mask)):
            assert g.dtype == w.dtype == c.dtype
            np.testing.assert_array_equal(g, w)
            np.testing.assert_array_equal(g, c)
    with pytest.raises(ValueError):
        cuda_k.diff_ranks(np.zeros(4, np.uint16), np.zeros(5, np.uint16), 7, 255)
    with pytest.raises(ValueError):
        cuda_k.diff_ranks(np.zeros(4, np.uint16), np.zeros(4, np.uint32), 7, 255)


# --- zero-copy: device arrays in, device arrays out ------------------------------------


class CudaArrayExporter:
    """Stands for a torch CUDA tensor: only `__cuda_array_interface__` (under the simulator,
    whose device memory is host memory, the pointer is a host pointer)."""

    def __init__(self, host: np.ndarray, typestr: str | None = None):
        self.host = host  # keeps the memory alive
        self.__cuda_array_interface__ = {"data": (host.__array_interface__["data"][0], False),
                                         "shape": host.shape, "typestr": typestr or host.dtype.str,
                                         "strides": None, "version": 2}


def on_device(a) -> bool:
    return bool(getattr(a, "__cuda_ndarray__", False))


def test_device_arrays_stay_on_the_device(cuda_k):
    rng = np.random.default_rng(8)
    base = bf16_like(rng, 150)
    positions = pick_positions(rng, base.size, 0.2)
    d_base = numba_cuda.to_device(base)
    starts, sizes = cuda_k.chunk_class_starts(d_base, 7, 255)
    ranks, sizes2 = cuda_k.class_ranks(d_base, 7, 255, numba_cuda.to_device(positions))
    assert all(on_device(a) for a in (starts, sizes, ranks, sizes2))
    want_ranks, want_sizes = class_ranks_ref(base, 7, 255, positions)
    np.testing.assert_array_equal(ranks.copy_to_host(), want_ranks)
    np.testing.assert_array_equal(sizes.copy_to_host(), want_sizes)
    np.testing.assert_array_equal(starts.copy_to_host(), chunk_class_starts_ref(base, 7, 255, starts.shape[0])[0])
    offsets, ranks_cm, deltas = listed_entries(base, 7, 255, positions, want_ranks, rng)
    want, want_applied = apply_ranked_ref(base, 7, 255, offsets, ranks_cm, deltas)
    d_out = numba_cuda.device_array_like(base)
    assert cuda_k.apply_ranked(d_base, 7, 255, starts, offsets, numba_cuda.to_device(ranks_cm),
                               numba_cuda.to_device(deltas), d_out) == want_applied
    np.testing.assert_array_equal(d_out.copy_to_host(), want)
    np.testing.assert_array_equal(d_base.copy_to_host(), base)  # read, not written
    assert cuda_k.apply_ranked(d_base, 7, 255, starts, offsets, ranks_cm, deltas, d_base) == want_applied
    np.testing.assert_array_equal(d_base.copy_to_host(), want)


def test_device_arrays_for_the_other_kernels(cuda_k):
    rng = np.random.default_rng(9)
    old = bf16_like(rng, 100)
    new = old.copy()
    new[rng.random(old.size) < 0.2] ^= 1
    positions, values = cuda_k.diff_compact(numba_cuda.to_device(old), numba_cuda.to_device(new))
    assert on_device(positions) and on_device(values)
    want_p, want_v = diff_compact_ref(old, new)
    np.testing.assert_array_equal(positions.copy_to_host(), want_p)
    np.testing.assert_array_equal(values.copy_to_host(), want_v)
    d_out = numba_cuda.to_device(old)
    assert cuda_k.scatter(d_out, positions, values) == 0
    np.testing.assert_array_equal(d_out.copy_to_host(), new)
    gaps = np.diff(want_p, prepend=-1).astype(np.uint32)
    rebuilt, bad = cuda_k.gaps_to_positions(numba_cuda.to_device(gaps))
    assert on_device(rebuilt) and bad == gaps_to_positions_ref(gaps)[1] == 0
    np.testing.assert_array_equal(rebuilt.copy_to_host(), want_p)
    # Host scatter with hostile device positions: skipped and counted.
    host_out = old.copy()
    hostile = np.array([3, -1, 2**62, 7], np.int64)
    vals = np.array([1, 2, 3, 4], np.uint16)
    want_out = old.copy()
    assert cuda_k.scatter(host_out, numba_cuda.to_device(hostile), vals) == scatter_ref(want_out, hostile, vals) == 2
    np.testing.assert_array_equal(host_out, want_out)


@pytest.mark.skipif(not SIMULATED, reason="hands the kernels host memory dressed as device memory, which only "
                    "the simulator accepts (on a GPU: CUDA_ERROR_ILLEGAL_ADDRESS, which poisons the context)")
def test_cuda_array_interface_is_used_in_place(cuda_k):
    """An exporter of `__cuda_array_interface__` (a torch CUDA tensor) is patched in its own
    memory; bfloat16's typestr `<V2` (torch's) is read as uint16 bits."""
    rng = np.random.default_rng(10)
    base = bf16_like(rng, 120)
    memory = base.copy()
    tensor = CudaArrayExporter(memory, typestr="<V2")
    positions = pick_positions(rng, base.size, 0.1)
    ranks, _ = cuda_k.class_ranks(tensor, 7, 255, positions)
    np.testing.assert_array_equal(ranks.copy_to_host(), class_ranks_ref(base, 7, 255, positions)[0])
    starts, _ = cuda_k.chunk_class_starts(tensor, 7, 255)
    offsets, ranks_cm, deltas = listed_entries(base, 7, 255, positions, ranks.copy_to_host(), rng)
    want, want_applied = apply_ranked_ref(base, 7, 255, offsets, ranks_cm, deltas)
    assert cuda_k.apply_ranked(tensor, 7, 255, starts, offsets, ranks_cm, deltas, tensor) == want_applied
    np.testing.assert_array_equal(memory, want)  # written where the exporter's memory is: no copy
    with pytest.raises(ValueError, match="C-contiguous"):
        cuda_k.chunk_class_starts(numba_cuda.to_device(np.zeros((4, 4), np.uint16))[:, 1], 7, 255)


# --- live-tensor kernels: word_sum, ranked_positions, add_at ------------------------------


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_word_sum(cuda_k, cpu_k, dtype):
    """Sizes that leave every possible tail (0 to 7 bytes) and span many blocks (a block sums
    8 words with SMALL_LAUNCH, 4 blocks per sweep); an unaligned host view; a device array."""
    rng = np.random.default_rng(20)
    for n in [0, 1, 2, 3, 5, 7, 8, 9, 31, 67, 301]:
        a = rng.integers(0, np.iinfo(dtype).max, n, dtype=dtype, endpoint=True)
        want = word_sum_ref(a)
        assert cpu_k.word_sum(a) == want
        assert cuda_k.word_sum(a) == want
        assert cuda_k.word_sum(numba_cuda.to_device(a)) == want
    raw = rng.integers(0, 255, 8 * 40 + 1, dtype=np.uint8)
    assert cpu_k.word_sum(raw[1:]) == cuda_k.word_sum(raw[1:]) == word_sum_ref(raw[1:])
    # Device views that start off an 8-byte boundary take the element-wise kernel; aligned ones
    # read whole words: both must give the reference, every offset and tail.
    a = rng.integers(0, np.iinfo(dtype).max, 301, dtype=dtype, endpoint=True)
    d = numba_cuda.to_device(a)
    for start in range(0, 9):
        for stop in (start, start + 1, 150, 301):
            assert cuda_k.word_sum(d[start:stop]) == word_sum_ref(a[start:stop]), (start, stop)


def test_word_sum_large_on_cpu(cpu_k):
    rng = np.random.default_rng(21)
    a = rng.integers(0, 2**16, 3 * (1 << 16) + 7, dtype=np.uint16)  # several CPU ranges and a tail
    assert cpu_k.word_sum(a) == word_sum_ref(a)
    b = a.copy()
    b[12345] ^= 1
    assert cpu_k.word_sum(b) != cpu_k.word_sum(a)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_class_keys(cuda_k, case):
    """The fused key kernel of the class sort: the reference's classes, and torch's keys (the
    class sort's CPU path) byte for byte, for host arrays, device arrays and device views that
    start anywhere; as uint8 keys and as int16 ones."""
    import torch

    from pulsediff.kernels import class_sort

    _, make, shift, mask = case
    rng = np.random.default_rng(25)
    for n in (0, 1, 31, 130, 301):
        base = make(rng, n)
        want = np.array(classes_ref(base, shift, mask), np.int64)
        torch_keys = class_sort.class_keys(class_sort.signed_view(torch.from_numpy(base.copy())), shift, mask)
        for key_type in (np.uint8, np.int16):
            keys = np.full(n, 99, key_type)
            cuda_k.class_keys(base, shift, mask, keys)
            assert np.array_equal(keys.astype(np.int64), want), (n, key_type)
            d_keys = numba_cuda.to_device(np.zeros(n, key_type))
            cuda_k.class_keys(numba_cuda.to_device(base), shift, mask, d_keys)
            assert np.array_equal(d_keys.copy_to_host().astype(np.int64), want)
        assert np.array_equal(torch_keys.numpy().astype(np.int64), want)
    base = make(rng, 77)
    d = numba_cuda.to_device(base)
    for start in (1, 2, 5):
        keys = np.zeros(77 - start, np.uint8)
        cuda_k.class_keys(d[start:], shift, mask, keys)
        assert np.array_equal(keys.astype(np.int64), classes_ref(base[start:], shift, mask))
    with pytest.raises(ValueError):
        cuda_k.class_keys(base, shift, mask, np.zeros(76, np.uint8))
    with pytest.raises(ValueError):
        cuda_k.class_keys(base, shift, 4095, np.zeros(77, np.uint8))


@pytest.mark.parametrize("chunk", [256, 1024, 2048])
def test_chunk_digests(cuda_k, cpu_k, chunk):
    """XXH3-128 per chunk, a warp per chunk: every shape of XXH3's long path (a chunk of one
    partial 1 KiB block, whole blocks, blocks and a partial one with 0 to 15 stripes), last
    chunks short enough for the host's path (<= 240 bytes) and just long enough for the
    kernel's, more chunks than blocks (4 with SMALL_LAUNCH: grid-stride), element widths of 1
    to 8 bytes, host arrays, device arrays and device views that start off an 8-byte boundary."""
    rng = np.random.default_rng(23)
    sizes = {0, 1, 64, 240, 241, 255, 256, 300, 1023, 1024, 1025, 1088, 1089, 2047, 2048, 2049}
    sizes |= {chunk - 1, chunk, chunk + 1, chunk + 240, chunk + 241, 5 * chunk + 77, 5 * chunk + 1000}
    for nbytes in sorted(sizes):
        raw = rng.integers(0, 256, nbytes, dtype=np.uint8)
        want = chunk_digests_ref(raw, chunk)
        assert np.array_equal(cpu_k.chunk_digests(raw, chunk), want), nbytes
        assert np.array_equal(cuda_k.chunk_digests(raw, chunk), want), nbytes
        assert np.array_equal(cuda_k.chunk_digests(numba_cuda.to_device(raw), chunk), want), nbytes
    a = rng.integers(0, 2**16, 3 * chunk // 2 + 5, dtype=np.uint16)
    d = numba_cuda.to_device(a)
    for start in (0, 1, 3, 4):
        want = chunk_digests_ref(a[start:], chunk)
        assert np.array_equal(cuda_k.chunk_digests(d[start:], chunk), want), start
        assert np.array_equal(cpu_k.chunk_digests(a[start:], chunk), want), start
    for dtype in (np.uint32, np.uint64):
        b = rng.integers(0, np.iinfo(dtype).max, 3 * chunk // 8 + 3, dtype=dtype, endpoint=True)
        assert np.array_equal(cuda_k.chunk_digests(b, chunk), chunk_digests_ref(b, chunk))
    flipped = raw.copy()
    flipped[-1] ^= 1
    assert not np.array_equal(cuda_k.chunk_digests(flipped, chunk)[-1], cuda_k.chunk_digests(raw, chunk)[-1])
    with pytest.raises(ValueError):
        cuda_k.chunk_digests(raw, 100)


def test_tree_hash_on_both_backends(cuda_k, cpu_k):
    """format.digest.tree_hash: the reference's bytes, from the CPU's leaves and the device's (a
    device array read in place), with 1 KiB chunks so that the simulator spans several; a
    flipped bit in any chunk changes it."""
    from pulsediff.format.digest import tree_hash

    rng = np.random.default_rng(26)
    for n in (0, 1, 100, 512, 513, 1800):
        a = rng.integers(0, 2**16, n, dtype=np.uint16)
        want = tree_hash_ref(a, 1024)
        assert tree_hash(a, chunk=1024) == want == tree_hash(a, cuda_k, 1024), n
        assert tree_hash(numba_cuda.to_device(a), cuda_k, 1024) == want, n
    a = rng.integers(0, 2**16, 1800, dtype=np.uint16)
    seen = {tree_hash(a, chunk=1024)}
    for i in (0, 511, 512, 1799):
        b = a.copy()
        b[i] ^= 1
        seen.add(tree_hash(b, cuda_k, 1024))
    assert len(seen) == 5


def test_tree_hash_at_the_format_chunk_on_cpu():
    from pulsediff.format.digest import tree_hash

    rng = np.random.default_rng(27)
    a = rng.integers(0, 2**16, (3 << 17) + 5, dtype=np.uint16)  # three chunks and a short fourth
    assert tree_hash(a) == tree_hash_ref(a)


def test_chunk_digests_at_the_format_chunk_on_cpu(cpu_k):
    """The format's chunks across the worker threads, with a short last chunk and a long one."""
    rng = np.random.default_rng(24)
    for nbytes in (3 * cpu_k.DIGEST_CHUNK_BYTES + 100, 2 * cpu_k.DIGEST_CHUNK_BYTES + 4096):
        raw = rng.integers(0, 256, nbytes, dtype=np.uint8)
        assert np.array_equal(cpu_k.chunk_digests(raw), chunk_digests_ref(raw, cpu_k.DIGEST_CHUNK_BYTES))


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_ranked_positions(cuda_k, cpu_k, case):
    _, make, shift, mask = case
    rng = np.random.default_rng(22)
    for n, density in [(1, "all"), (130, 0.0), (301, 0.05), (145, 0.3), (77, "all")]:
        base = make(rng, n)
        positions = pick_positions(rng, n, density)
        ranks, _ = class_ranks_ref(base, shift, mask, positions)
        offsets, ranks_cm, _ = listed_entries(base, shift, mask, positions, ranks, rng)
        want, found = ranked_positions_ref(base, shift, mask, offsets, ranks_cm)
        assert found == positions.size
        assert sorted(want.tolist()) == positions.tolist()
        for starts in (cuda_k.chunk_class_starts(base, shift, mask)[0], cpu_k.chunk_class_starts(base, shift, mask)[0]):
            for k in (cuda_k, cpu_k):
                where, got = k.ranked_positions(base, shift, mask, starts, offsets, ranks_cm)
                assert got == found
                np.testing.assert_array_equal(where, want)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_locate_ranked(cuda_k, cpu_k, case):
    """Class sizes and positions together, host and device base (a device base takes the tile
    kernels; a host base the walk)."""
    _, make, shift, mask = case
    rng = np.random.default_rng(25)
    for n, density in [(1, "all"), (130, 0.0), (301, 0.05), (77, "all")]:
        base = make(rng, n)
        positions = pick_positions(rng, n, density)
        ranks, sizes = class_ranks_ref(base, shift, mask, positions)
        offsets, ranks_cm, _ = listed_entries(base, shift, mask, positions, ranks, rng)
        want, found = ranked_positions_ref(base, shift, mask, offsets, ranks_cm)
        for k, b in ((cpu_k, base), (cuda_k, base), (cuda_k, numba_cuda.to_device(base))):
            where, got, got_sizes = k.locate_ranked(b, shift, mask, offsets, ranks_cm)
            where = where.copy_to_host() if hasattr(where, "copy_to_host") else where
            assert got == found == positions.size
            np.testing.assert_array_equal(where, want)
            np.testing.assert_array_equal(got_sizes, sizes)


@pytest.mark.parametrize("case", tiered({"u64-sign", "u16-uniform"}))
def test_tile_locate_ranked(cuda_k, case):
    """The tile kernels (a device base's rank-to-position map) against the reference: bases of
    several tiles with a short last one, sparse and dense entries, no entries; every class's size.
    A section listing more classes than a tile counts is left to the other paths (None)."""
    _, make, shift, mask = case
    rng = np.random.default_rng(31)
    for n, density in [(2 * cuda_k.TILE + 77, 0.02), (2 * cuda_k.TILE + 77, "all"), (300, "all"), (1, "all"),
                       (130, 0.0)]:
        base = make(rng, n)
        positions = pick_positions(rng, n, density)
        ranks, sizes = class_ranks_ref(base, shift, mask, positions)
        offsets, ranks_cm, _ = listed_entries(base, shift, mask, positions, ranks, rng)
        got = cuda_k.tile_locate_ranked(numba_cuda.to_device(base), shift, mask, offsets, ranks_cm)
        if np.count_nonzero(np.diff(offsets)) > cuda_k.TILE_LISTED:
            assert got is None
            continue
        want, found = ranked_positions_ref(base, shift, mask, offsets, ranks_cm)
        where, got_found, got_sizes = got
        assert got_found == found == positions.size
        np.testing.assert_array_equal(where.copy_to_host(), want)
        np.testing.assert_array_equal(got_sizes, sizes)


def test_tile_locate_ranked_hostile_ranks(cuda_k):
    """Ranks past their class, negative, repeated, falling, in a class the base lacks: never all
    entries found, and every entry found is where its class and rank say."""
    rng = np.random.default_rng(32)
    base = bf16_like(rng, cuda_k.TILE + 500)
    classes = np.array(classes_ref(base, 7, 255), np.int64)
    sizes = np.bincount(classes, minlength=256)
    k_big, k_empty = int(np.argmax(sizes)), int(np.flatnonzero(sizes == 0)[0])
    k_next = int(np.argsort(sizes)[-2])
    per_class = {k_big: [-3, 0, 2, 2, 1, 5, int(sizes[k_big]) - 1, int(sizes[k_big]), 2**62],
                 k_next: [3, 700, 1], k_empty: [0, 4]}
    offsets = np.zeros(257, np.int64)
    ranks, owner = [], []
    for k in range(256):
        ranks += per_class.get(k, [])
        owner += [k] * len(per_class.get(k, []))
        offsets[k + 1] = len(ranks)
    ranks = np.array(ranks, np.int64)
    where, found, got_sizes = cuda_k.tile_locate_ranked(numba_cuda.to_device(base), 7, 255, offsets, ranks)
    where = where.copy_to_host()
    assert found == int((where >= 0).sum()) < ranks.size
    np.testing.assert_array_equal(got_sizes, sizes)
    for p in np.flatnonzero(where >= 0):
        i = where[p]
        assert classes[i] == owner[p] and int((classes[:i] == owner[p]).sum()) == ranks[p]
    big = offsets[k_big]
    assert (where[big:big + 3] >= 0).tolist() == [False, True, True]  # -3 never; 0 and 2 are there
    assert where[big + 3] == -1 and where[big + 4] == -1  # 2 again, then 1: not above the one before
    assert where[big + 7] == -1 and where[big + 8] == -1  # past the class
    assert (where[offsets[k_empty]:offsets[k_empty] + 2] == -1).all()
    assert where[offsets[k_next] + 2] == -1  # 1 after 700


def _cpu_and_cuda_locate_add(cuda_k, cpu_k, base, shift, mask, offsets, ranks, deltas):
    """locate_add_summed of the same entries on a host copy (kernels.cpu, checked against the
    references in test_kernels.py) and on a device copy (kernels.cuda): both results."""
    out = []
    for k in (cpu_k, cuda_k):
        if k is cpu_k:
            got = base.copy()
            where, old = np.full(ranks.size, -1, np.int64), np.zeros(ranks.size, base.dtype)
        else:
            got = numba_cuda.to_device(base)
            where, old = k.located_buffers(ranks.size, base.dtype)
        found, change, sizes = k.locate_add_summed(got, shift, mask, offsets, ranks, deltas, where, old)
        if k is cuda_k:
            got, where, old = got.copy_to_host(), where.copy_to_host(), old.copy_to_host()
        out.append((found, change, sizes, got, where, old))
    return out


@pytest.mark.parametrize("case", tiered({"f32"}, [c for c in CASES if c[0] != "u16-uniform"]))  # (u16's many
# classes take the separate kernels)
def test_locate_add_summed_on_the_device_is_the_cpus(cuda_k, cpu_k, case):
    """The live apply's one-synchronisation path (tile locate, add, word sums before and after,
    read back together) against the CPU's walk that writes as it finds, bit for bit: the tensor,
    where each entry went, the old values of those found, the class sizes, the sum's change and the
    found count. Tile-sized and odd-sized bases (an odd BF16 count is not whole words: the
    separate kernels), sparse, dense and no entries, and hostile ranks (fewer found)."""
    _, make, shift, mask = case
    rng = np.random.default_rng(41)
    # whole words of every width (the tiles), then an odd size and no entries (the separate kernels)
    sizes = [(2 * cuda_k.TILE + 80, 0.02)] if case[0] == "bf16" else [(cuda_k.TILE + 80, 0.02)]  # 3 or 2 tiles
    for n, density in sizes + [(600, "all"), (301, 0.3), (128, 0.0)]:
        base = make(rng, n)
        positions = pick_positions(rng, n, density)
        ranks, _ = class_ranks_ref(base, shift, mask, positions)
        offsets, ranks_cm, deltas = listed_entries(base, shift, mask, positions, ranks, rng)
        deltas = deltas.astype(base.dtype)
        cases = [ranks_cm]
        if ranks_cm.size:
            hostile = ranks_cm.copy()
            hostile[-1] += n  # past its class
            cases.append(hostile)
        for entries in cases:
            (cf, cc, cs, cg, cw, co), (gf, gc, gs, gg, gw, go) = _cpu_and_cuda_locate_add(
                cuda_k, cpu_k, base, shift, mask, offsets, entries, deltas)
            assert gf == cf and gc == cc
            np.testing.assert_array_equal(gs, cs)
            np.testing.assert_array_equal(gg, cg)
            np.testing.assert_array_equal(gw, cw)
            hit = cw >= 0
            np.testing.assert_array_equal(go[hit], co[hit])
            assert (cf == entries.size) == (entries is ranks_cm)


def test_word_sums_reads_back_once_and_equals_word_sum(cuda_k):
    """word_sums of device arrays of every width, odd sizes and an unaligned view among them (the
    ones that are not whole words go through word_sum alone): each equals the reference."""
    rng = np.random.default_rng(42)
    hosts = [bf16_like(rng, 4096), f32_like(rng, 33), uniform(np.uint64)(rng, 17), bf16_like(rng, 7),
             uniform(np.uint8)(rng, 64), bf16_like(rng, 0)]
    arrays = [numba_cuda.to_device(h) for h in hosts]
    hosts.append(hosts[0][1:])
    arrays.append(arrays[0][1:])  # starts 2 bytes into its allocation
    assert cuda_k.word_sums(arrays) == [word_sum_ref(h) for h in hosts]


def test_ranked_positions_hostile_ranks(cuda_k, cpu_k):
    """Ranks past their class, negative ranks, a class the base lacks: -1 and not counted."""
    rng = np.random.default_rng(23)
    base = bf16_like(rng, 200)
    sizes = np.bincount(np.array(classes_ref(base, 7, 255)), minlength=256)
    k_big, k_empty = int(np.argmax(sizes)), int(np.flatnonzero(sizes == 0)[0])
    per_class = {k_big: [-3, 0, 2, int(sizes[k_big]), 2**62], k_empty: [0, 4]}
    offsets = np.zeros(257, np.int64)
    ranks = []
    for k in range(256):
        ranks += per_class.get(k, [])
        offsets[k + 1] = len(ranks)
    ranks = np.array(ranks, np.int64)
    want, found = ranked_positions_ref(base, 7, 255, offsets, ranks)
    assert found == 2
    for k in (cuda_k, cpu_k):
        starts, _ = k.chunk_class_starts(base, 7, 255)
        where, got = k.ranked_positions(base, 7, 255, starts, offsets, ranks)
        assert got == found
        np.testing.assert_array_equal(where, want)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_add_at(cuda_k, cpu_k, dtype):
    """In place, wrapping modulo 2**width, old values returned for the undo log; out-of-range
    positions skipped and counted; host and device `out`."""
    rng = np.random.default_rng(24)
    base = rng.integers(0, np.iinfo(dtype).max, 301, dtype=dtype, endpoint=True)
    positions = rng.permutation(base.size)[:90].astype(np.int64)
    positions[[3, 40]] = [-1, 2**62]
    deltas = rng.integers(0, np.iinfo(np.uint64).max, positions.size, dtype=np.uint64, endpoint=True)
    want = base.copy()
    want_old, want_bad = add_at_ref(want, positions, deltas)
    assert want_bad == 2
    for k in (cuda_k, cpu_k):
        out = base.copy()
        old, bad = k.add_at(out, positions, deltas)
        assert bad == want_bad
        np.testing.assert_array_equal(out, want)
        np.testing.assert_array_equal(old, want_old)
        assert k.scatter(out, positions, old) == 2  # the undo log puts the tensor back
        np.testing.assert_array_equal(out, base)
    d_out = numba_cuda.to_device(base)
    old, bad = cuda_k.add_at(d_out, numba_cuda.to_device(positions), numba_cuda.to_device(deltas))
    assert on_device(old) and bad == want_bad
    np.testing.assert_array_equal(d_out.copy_to_host(), want)
    np.testing.assert_array_equal(old.copy_to_host(), want_old)


# --- ctx-rans across backends ------------------------------------------------------------


@pytest.mark.parametrize("dtype_name, make", [("BF16", bf16_like), ("F32", f32_like)], ids=["BF16", "F32"])
def test_ctx_rans_round_trip_across_backends(cuda_k, cpu_k, dtype_name, make):
    from pulsediff.codecs.base import SectionContext
    from pulsediff.codecs.ctx_rans import CtxRans
    from pulsediff.io.dtypes import DTYPES
    from pulsediff.io.memory import Scratch

    rng = np.random.default_rng(11)
    base = make(rng, 400)
    target = base.copy()
    changed = rng.random(base.size) < 0.05
    step = rng.choice(np.array([1, 1, 1, 2, np.iinfo(base.dtype).max], base.dtype), int(changed.sum()))  # -1 wraps
    target[changed] += step
    positions, values = diff_compact_ref(base, target)
    codec, dtype = CtxRans(), DTYPES[dtype_name]
    made = {name: codec.encode(base, target, positions, values, dtype=dtype, kernels=k)
            for name, k in (("cpu", cpu_k), ("cuda", cuda_k))}
    assert made["cpu"].parts == made["cuda"].parts and made["cpu"].params == made["cuda"].params
    for k in (cpu_k, cuda_k):  # make's path: compare and rank in one call (kernels.diff_ranks)
        count, paired = codec.encode_pair(base, target, dtype=dtype, kernels=k)
        assert count == positions.size and paired.parts == made["cpu"].parts and paired.params == made["cpu"].params
    payload, params = b"".join(made["cpu"].parts), made["cpu"].params
    ctx = SectionContext("w", base.size, base.dtype.itemsize, "<test>")
    for k in (cpu_k, cuda_k):
        rebuilt = codec.decode(base, payload, params, ctx, k, Scratch())
        np.testing.assert_array_equal(rebuilt.view(base.dtype), target)


# --- scripts/bench_gpu.py ------------------------------------------------------------------


@pytest.mark.skipif(not SIMULATED, reason="runs the benchmark's --tiny mode under the simulator")
@pytest.mark.slow  # 45 s under the simulator; gpu_check.sh runs the script itself on a GPU
def test_bench_gpu_tiny_runs_under_the_simulator():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_gpu.py"), "--tiny"], env=env,
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    out = result.stdout
    assert "| what |" in out and "simulator" in out
    for row in ("device-to-device copy", "pinned host-to-device copy", "| diff_compact |", "| scatter |",
                "| gaps_to_positions", "| chunk_class_starts |", "| class_ranks |", "| apply_ranked in place |",
                "dense copy from pinned host memory", "chunk_class_starts + apply_ranked in place",
                "apply_to_state_dict` end to end"):
        assert row in out, row
    assert "kernel results bit for bit: yes" in out and "patched tensors bit for bit: yes" in out


@pytest.mark.parametrize("tiles,slots", [(1, 1), (5, 3), (1000, 17), (0, 4)])
def test_tile_scan_is_the_column_exclusive_scan(tiles, slots):
    """The GPU path's scan of the (tile, class) count table (torch, along the innermost dimension
    of its transpose), run here on torch CPU tensors: each entry becomes its column's sum above
    it, and the totals come back; against NumPy's cumsum."""
    import torch

    from pulsediff.kernels.cuda import exclusive_scan_tiles

    rng = np.random.default_rng(tiles + slots)
    counts = rng.integers(0, 4097, (tiles, slots), dtype=np.int64)
    table = torch.from_numpy(counts.copy())
    totals = exclusive_scan_tiles(table)
    np.testing.assert_array_equal(totals.numpy(), counts.sum(axis=0))
    np.testing.assert_array_equal(table.numpy(), np.cumsum(counts, axis=0) - counts)
