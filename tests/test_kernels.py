"""Every kernel backend against the NumPy oracle in `tests/reference.py`, bit for bit.

The same tests run for `kernels.cpu` and `kernels.cuda`. Without a GPU the CUDA
backend runs under Numba's simulator (conftest.py sets NUMBA_ENABLE_CUDASIM=1),
which runs every CUDA thread as a Python thread: inputs stay small, and the
block size is shrunk so that they still span many tiles, and more tiles than
blocks (so the grid-stride loop over tiles runs too).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pulsediff.errors import UsageError
from pulsediff.kernels import get_backend

from cuda_sim import SMALL_LAUNCH, fast_simulator, launch_config
from reference import diff_compact_ref, gaps_to_positions_ref, scatter_ref

try:
    from numba import config as numba_config
    from numba import cuda as numba_cuda  # noqa: F401

    HAVE_NUMBA_CUDA = True
    SIMULATED = bool(numba_config.ENABLE_CUDASIM)
except Exception:  # numba-cuda absent or broken
    HAVE_NUMBA_CUDA = False
    SIMULATED = False

requires_numba_cuda = pytest.mark.skipif(
    not HAVE_NUMBA_CUDA, reason="numba.cuda cannot be imported (install numba-cuda); CUDA backend not tested"
)
requires_simulator = pytest.mark.skipif(
    not SIMULATED, reason="needs the Numba CUDA simulator (NUMBA_ENABLE_CUDASIM=1, set by conftest.py)"
)

UINTS = [np.uint8, np.uint16, np.uint32, np.uint64]
GAP_DTYPES = [np.uint32, np.uint64]
DENSITIES = ["zero", "one", 0.01, 0.5, 1.0]

# With SMALL_LAUNCH a tile is 16 elements and 4 blocks cover at most 64 of them
# per sweep: these sizes hit empty, single, tile-edge +-1, and several
# grid-stride sweeps.
SMALL_SIZES = [0, 1, 2, 15, 16, 17, 63, 65, 77, 130]
# The CPU kernels split work into chunks of at least 2**16 elements.
CPU_LARGE_SIZES = [3 * (1 << 16) + 7, 17 * (1 << 16) + 1]

# Out-of-range positions a hostile patch could carry.
HOSTILE_POSITIONS = [-1, -2, -(2**63), 2**62, 2**63 - 1]


@pytest.fixture(scope="module")
def cpu_backend():
    from pulsediff.kernels import cpu

    return cpu


@pytest.fixture(scope="module")
def cuda_backend():
    if not HAVE_NUMBA_CUDA:
        pytest.skip("numba.cuda cannot be imported (install numba-cuda); CUDA backend not tested")
    from pulsediff.kernels import cuda

    with launch_config(cuda.common, **SMALL_LAUNCH), fast_simulator():
        yield cuda


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=requires_numba_cuda)], scope="module")
def backend(request):
    return request.getfixturevalue(f"{request.param}_backend")


# --- input builders ------------------------------------------------------------


def random_uint(rng, dtype, size):
    return rng.integers(0, np.iinfo(dtype).max, size, dtype=dtype, endpoint=True)


def changed_mask(rng, size, density):
    if density == "zero":
        return np.zeros(size, bool)
    if density == "one":
        mask = np.zeros(size, bool)
        if size:
            mask[rng.integers(size)] = True
        return mask
    return rng.random(size) < density


def make_pair(rng, dtype, size, density):
    old = random_uint(rng, dtype, size)
    new = old.copy()
    mask = changed_mask(rng, size, density)
    # XOR with a non-zero pattern: every masked element really changes,
    # including to and from 0 and the all-ones value.
    flip = random_uint(rng, dtype, int(mask.sum()))
    flip[flip == 0] = 1
    new[mask] ^= flip
    return old, new


def assert_same(got, want):
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    np.testing.assert_array_equal(got, want)


def check_diff(backend, old, new):
    positions, values = backend.diff_compact(old, new)
    want_p, want_v = diff_compact_ref(old, new)
    assert_same(positions, want_p)
    assert_same(values, want_v)
    return positions, values


# --- diff_compact --------------------------------------------------------------


@pytest.mark.parametrize("density", DENSITIES, ids=str)
@pytest.mark.parametrize("dtype", UINTS, ids=lambda d: d.__name__)
def test_diff_compact_dtypes_and_densities(backend, dtype, density):
    rng = np.random.default_rng(1)
    for size in (0, 1, 77):
        check_diff(backend, *make_pair(rng, dtype, size, density))


@pytest.mark.parametrize("size", SMALL_SIZES)
def test_diff_compact_sizes(backend, size):
    rng = np.random.default_rng(size)
    check_diff(backend, *make_pair(rng, np.uint16, size, 0.5))
    # Only the last element changed: the tail of the last, partial tile.
    old = random_uint(rng, np.uint32, size)
    new = old.copy()
    if size:
        new[-1] ^= 1
    check_diff(backend, old, new)


@pytest.mark.parametrize("density", DENSITIES, ids=str)
@pytest.mark.parametrize("dtype", UINTS, ids=lambda d: d.__name__)
def test_cpu_diff_compact_many_chunks(cpu_backend, dtype, density):
    rng = np.random.default_rng(2)
    for size in CPU_LARGE_SIZES:
        check_diff(cpu_backend, *make_pair(rng, dtype, size, density))


def test_diff_compact_round_trip(backend):
    rng = np.random.default_rng(3)
    old, new = make_pair(rng, np.uint64, 130, 0.3)
    positions, values = backend.diff_compact(old, new)
    out = old.copy()
    assert backend.scatter(out, positions, values) == 0
    assert_same(out, new)
    # And positions survive the gap encoding the patch format stores.
    gaps = np.diff(positions, prepend=-1).astype(np.uint32)
    rebuilt, bad = backend.gaps_to_positions(gaps)
    assert bad == 0
    assert_same(rebuilt, positions)


# --- scatter -------------------------------------------------------------------


def make_scatter(rng, dtype, size, count, hostile=()):
    """Distinct in-range positions (duplicates have no defined winner on parallel
    backends), mixed with out-of-range ones, in random order."""
    inside = rng.permutation(size)[: min(count, size)].astype(np.int64)
    outside = list(hostile) + ([size, size + 5] if hostile else [])
    positions = rng.permutation(np.concatenate([inside, np.array(outside, np.int64)]))
    return positions, random_uint(rng, dtype, positions.size)


def check_scatter(backend, out_init, positions, values):
    # `out` is a view into a guarded buffer: a write that wraps around or runs
    # past either end would show up in the guard bands.
    guard = 8
    buf = np.full(out_init.size + 2 * guard, 0xA5, out_init.dtype)
    out = buf[guard : guard + out_init.size]
    out[...] = out_init
    want = out_init.copy()
    want_bad = scatter_ref(want, positions, values)
    bad = backend.scatter(out, positions, values)
    assert isinstance(bad, int)
    assert bad == want_bad
    assert_same(out, want)
    assert (buf[:guard] == 0xA5).all() and (buf[guard + out_init.size :] == 0xA5).all()


@pytest.mark.parametrize("dtype", UINTS, ids=lambda d: d.__name__)
def test_scatter_in_range(backend, dtype):
    rng = np.random.default_rng(4)
    for size, count in [(1, 1), (77, 0), (77, 1), (77, 40), (77, 77)]:
        positions, values = make_scatter(rng, dtype, size, count)
        check_scatter(backend, random_uint(rng, dtype, size), positions, values)


@pytest.mark.parametrize("dtype", UINTS, ids=lambda d: d.__name__)
def test_scatter_out_of_range_is_skipped_and_counted(backend, dtype):
    rng = np.random.default_rng(5)
    for size, count in [(77, 30), (17, 17), (1, 0)]:
        positions, values = make_scatter(rng, dtype, size, count, HOSTILE_POSITIONS)
        check_scatter(backend, random_uint(rng, dtype, size), positions, values)
    # Into an empty tensor nothing is in range.
    positions = np.array([0, -1, 3], np.int64)
    check_scatter(backend, np.empty(0, dtype), positions, random_uint(rng, dtype, 3))


def test_scatter_empty(backend):
    out = np.arange(5, dtype=np.uint8)
    assert backend.scatter(out, np.empty(0, np.int64), np.empty(0, np.uint8)) == 0
    assert_same(out, np.arange(5, dtype=np.uint8))


def test_cpu_scatter_large(cpu_backend):
    rng = np.random.default_rng(6)
    size = CPU_LARGE_SIZES[1]
    positions, values = make_scatter(rng, np.uint16, size, size // 3, HOSTILE_POSITIONS)
    check_scatter(cpu_backend, random_uint(rng, np.uint16, size), positions, values)


# --- gaps_to_positions -----------------------------------------------------------


def check_gaps(backend, gaps):
    positions, bad = backend.gaps_to_positions(gaps)
    want_p, want_bad = gaps_to_positions_ref(gaps)
    assert isinstance(bad, int)
    assert bad == want_bad
    assert_same(positions, want_p)


@pytest.mark.parametrize("size", SMALL_SIZES)
@pytest.mark.parametrize("dtype", GAP_DTYPES, ids=lambda d: d.__name__)
def test_gaps_to_positions_valid(backend, dtype, size):
    rng = np.random.default_rng(7 + size)
    check_gaps(backend, rng.integers(1, 1000, size).astype(dtype))


@pytest.mark.parametrize("dtype", GAP_DTYPES, ids=lambda d: d.__name__)
def test_gaps_to_positions_counts_zero_gaps(backend, dtype):
    rng = np.random.default_rng(8)
    for size in (1, 77):
        gaps = rng.integers(0, 3, size).astype(dtype)  # about a third are 0
        check_gaps(backend, gaps)
        check_gaps(backend, np.zeros(size, dtype))


# Sums of hostile gaps overflow int64; both sides wrap, and the simulator's
# NumPy scalars say so.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_gaps_to_positions_uint64_high_bit_is_bad(backend):
    rng = np.random.default_rng(9)
    gaps = rng.integers(1, 10, 77).astype(np.uint64)
    gaps[[0, 20, 40, 76]] = [2**63, 2**64 - 1, 2**63 + 5, 2**62]
    check_gaps(backend, gaps)
    check_gaps(backend, np.full(3, 2**62, np.uint64))  # no bad gap, but the sum wraps


def test_gaps_to_positions_uint32_max(backend):
    # uint32 gaps never wrap negative: the largest is a valid (if huge) gap.
    check_gaps(backend, np.full(40, 2**32 - 1, np.uint32))


@pytest.mark.parametrize("dtype", GAP_DTYPES, ids=lambda d: d.__name__)
def test_cpu_gaps_to_positions_many_chunks(cpu_backend, dtype):
    rng = np.random.default_rng(10)
    for size in CPU_LARGE_SIZES:
        check_gaps(cpu_backend, rng.integers(0, 50, size).astype(dtype))


# --- properties (hypothesis) -----------------------------------------------------


@st.composite
def array_pairs(draw, max_size):
    dtype = draw(st.sampled_from(UINTS))
    size = draw(st.integers(0, max_size))
    old = draw(hnp.arrays(dtype, size))
    changed = draw(hnp.arrays(np.bool_, size))
    other = draw(hnp.arrays(dtype, size))
    return old, np.where(changed, other, old).astype(dtype)


@st.composite
def gap_arrays(draw, max_size):
    dtype = draw(st.sampled_from(GAP_DTYPES))
    size = draw(st.integers(0, max_size))
    # Mostly small valid gaps, with the edge values mixed in.
    edge = [0, 1, int(np.iinfo(dtype).max)] + ([2**63] if dtype == np.uint64 else [])
    elements = st.one_of(st.integers(1, 100), st.sampled_from(edge))
    return np.array(draw(st.lists(elements, min_size=size, max_size=size)), dtype=dtype)


def _property_diff_and_round_trip(backend, pair):
    old, new = pair
    positions, values = check_diff(backend, old, new)
    out = old.copy()
    assert backend.scatter(out, positions, values) == 0
    assert_same(out, new)


@settings(max_examples=60, deadline=None)
@given(pair=array_pairs(max_size=300))
def test_property_cpu_diff_round_trip(cpu_backend, pair):
    _property_diff_and_round_trip(cpu_backend, pair)


@settings(max_examples=60, deadline=None)
@given(gaps=gap_arrays(max_size=300))
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_property_cpu_gaps(cpu_backend, gaps):
    check_gaps(cpu_backend, gaps)


# The simulator is slow: few, small examples.
@requires_numba_cuda
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pair=array_pairs(max_size=70))
def test_property_cuda_diff_round_trip(cuda_backend, pair):
    _property_diff_and_round_trip(cuda_backend, pair)


@requires_numba_cuda
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gaps=gap_arrays(max_size=70))
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_property_cuda_gaps(cuda_backend, gaps):
    check_gaps(cuda_backend, gaps)


# --- CUDA launch shapes ----------------------------------------------------------


@requires_numba_cuda
@pytest.mark.parametrize(
    "threads, items, max_blocks, size",
    [
        (1, 1, 2, 9),  # degenerate block: scans and reductions of one thread
        (32, 2, 3, 301),  # a warp-sized block, 5 tiles over 3 blocks
        (256, 8, 4096, 300),  # the shipped defaults, on a partial tile
    ],
)
def test_cuda_launch_shapes(cuda_backend, threads, items, max_blocks, size):
    rng = np.random.default_rng(threads)
    with launch_config(cuda_backend.common, THREADS_PER_BLOCK=threads, ITEMS_PER_THREAD=items, MAX_BLOCKS=max_blocks):
        check_diff(cuda_backend, *make_pair(rng, np.uint8, size, 0.3))
        check_gaps(cuda_backend, rng.integers(0, 4, size).astype(np.uint32))
        positions, values = make_scatter(rng, np.uint8, size, size // 2, HOSTILE_POSITIONS)
        check_scatter(cuda_backend, random_uint(rng, np.uint8, size), positions, values)


@requires_numba_cuda
@pytest.mark.parametrize(
    "setting, value", [("THREADS_PER_BLOCK", 24), ("THREADS_PER_BLOCK", 2048), ("ITEMS_PER_THREAD", 0)]
)
def test_cuda_rejects_bad_launch_settings(cuda_backend, setting, value):
    with launch_config(cuda_backend.common, **{setting: value}), pytest.raises(ValueError, match=setting):
        cuda_backend.diff_compact(np.zeros(4, np.uint8), np.ones(4, np.uint8))


def test_mismatched_lengths_rejected_by_cuda(cuda_backend):
    with pytest.raises(ValueError):
        cuda_backend.diff_compact(np.zeros(4, np.uint8), np.zeros(5, np.uint8))
    with pytest.raises(ValueError):
        cuda_backend.scatter(np.zeros(4, np.uint8), np.zeros(3, np.int64), np.zeros(2, np.uint8))


# --- backend selection -----------------------------------------------------------


def test_get_backend_cpu(cpu_backend):
    assert get_backend("cpu") is cpu_backend


def test_get_backend_rejects_unknown_device():
    with pytest.raises(UsageError):
        get_backend("bogus")


def test_get_backend_reads_environment(monkeypatch, cpu_backend):
    monkeypatch.setenv("PULSEDIFF_DEVICE", "cpu")
    assert get_backend() is cpu_backend
    monkeypatch.setenv("PULSEDIFF_DEVICE", "bogus")
    with pytest.raises(UsageError):
        get_backend()


@requires_simulator
def test_get_backend_cuda_under_simulator():
    from pulsediff.kernels import cuda

    assert get_backend("cuda") is cuda


@requires_simulator
def test_get_backend_auto_never_picks_simulator(cpu_backend):
    assert get_backend("auto") is cpu_backend


@requires_numba_cuda
def test_cuda_module_imports_without_gpu():
    # In a fresh interpreter with the simulator off: importing the CUDA backend
    # must work anywhere; asking for it where no GPU is usable must fail clearly.
    code = textwrap.dedent(
        """
        from numba import cuda
        import pulsediff.kernels.cuda
        from pulsediff.errors import DeviceUnavailableError
        from pulsediff.kernels import get_backend, cpu
        if not cuda.is_available():
            try:
                get_backend("cuda")
            except DeviceUnavailableError:
                pass
            else:
                raise SystemExit("get_backend('cuda') did not raise without a GPU")
            assert get_backend("auto") is cpu
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "PULSEDIFF_DEVICE")}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_every_backend_provides_the_whole_contract(backend):
    """One contract (pulsediff.kernels.Backend) for every backend: codecs call nothing else."""
    from pulsediff.kernels import KERNELS

    assert set(KERNELS) >= {"diff_compact", "scatter", "gaps_to_positions", "chunk_class_starts", "class_ranks",
                            "apply_ranked", "class_major_order", "word_sum", "ranked_positions", "add_at", "resident",
                            "ranked_window", "locate_ranked"}
    assert all(callable(getattr(backend, name, None)) for name in KERNELS)


def test_no_codec_imports_a_backend():
    import pathlib
    import re

    import pulsediff.codecs

    for source in pathlib.Path(pulsediff.codecs.__file__).parent.glob("*.py"):
        text = source.read_text()
        assert not re.search(r"kernels import (cpu|cuda)|kernels\.(cpu|cuda)", text), source.name


def test_cpu_parallel_map_never_returns_while_a_task_still_runs(monkeypatch):
    """A Ctrl-C while waiting must not let parallel_map return early: its tasks write into the
    caller's buffers (found by review)."""
    import signal
    import threading
    import time

    from pulsediff.kernels import threads

    monkeypatch.setenv("PULSEDIFF_THREADS", "2")
    buf = np.zeros(4, np.int64)

    def task(i):
        time.sleep(0.4 if i == 0 else 0.05)
        buf[i] = 1

    # A real SIGINT (interrupt_main would only be seen once the wait returned by itself).
    threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        threads.parallel_map(task, [(i,) for i in range(4)])
        time.sleep(1)  # not reached if the interrupt landed in the wait, as intended
    assert buf.tolist() == [1, 1, 1, 1]


# --- locate_ranked on one thread (the whole-tensor walk without class counts) -----------------


@pytest.mark.parametrize("dtype,shift,mask", [(np.uint16, 7, 255), (np.uint32, 23, 255), (np.uint64, 52, 2047),
                                              (np.uint8, 3, 15), (np.uint16, 0, 0)])
def test_one_thread_locate_ranked_matches_the_range_walk_and_the_reference(dtype, shift, mask):
    """The CPU's locate_ranked on a worker thread (one walk, sizes from where the countdowns end)
    gives what its range-parallel form and the reference give, bit for bit, on real entries.
    On hostile ones (a rank past its class, a repeated, a falling and a negative rank) both
    find fewer than all (the caller refuses the patch), what they find is where it lies, and
    the sizes are still the base's class sizes. (After a falling rank the range walks may pick
    up the class again at a range's start, the one walk does not: both refuse.)"""
    from reference import classes_ref, diff_ranks_ref, ranked_positions_ref
    from test_class_sort import class_major, few_classes

    from pulsediff.kernels import cpu, threads

    rng = np.random.default_rng(int(np.dtype(dtype).itemsize * 100 + shift))
    for n in (1, 37, 5000):
        base = few_classes(rng, n, dtype, shift, mask)
        new = base.copy()
        pick = rng.random(n) < 0.05
        pick[rng.integers(0, n)] = True
        new[pick] = (base[pick] ^ dtype(1)).astype(dtype)
        _, classes, ranks, sizes = diff_ranks_ref(base, new, shift, mask)
        offsets, ranks_cm = class_major(classes, ranks, mask)
        true_sizes = np.bincount(classes_ref(base, shift, mask), minlength=mask + 1)
        cases = [ranks_cm]
        for edit in range(4):
            hostile = ranks_cm.copy()
            e = int(rng.integers(0, hostile.size))
            c = int(np.searchsorted(offsets, e, side="right") - 1)
            hostile[e] = [true_sizes[c] + 3, hostile[max(e - 1, offsets[c])], hostile[e] - 2, -1][edit]
            if edit == 2 and e + 1 < offsets[c + 1]:
                hostile[e] = hostile[e + 1] + 1  # falls back after its successor
            if not np.array_equal(hostile, ranks_cm):  # a repeat of a class's first entry is no edit
                cases.append(hostile)
        for case in cases:
            spread = cpu.locate_ranked(base, shift, mask, offsets, case)
            with threads.inline():
                assert threads.serial()
                one = cpu.locate_ranked(base, shift, mask, offsets, case)
            np.testing.assert_array_equal(one[2], true_sizes)
            np.testing.assert_array_equal(spread[2], true_sizes)
            valid = all((np.diff(case[offsets[k]:offsets[k + 1]]) > 0).all()
                        and (case[offsets[k]:offsets[k + 1]] >= 0).all()
                        and (case[offsets[k]:offsets[k + 1]] < true_sizes[k]).all() for k in range(mask + 1))
            if valid:  # the edit left a valid list (e.g. a first rank lowered)
                want, found = ranked_positions_ref(base, shift, mask, offsets, case)
                np.testing.assert_array_equal(one[0], want)
                np.testing.assert_array_equal(spread[0], want)
                assert one[1] == spread[1] == found == case.size
            else:  # refused either way (found short of the count); what is found is where it lies
                assert one[1] < case.size and spread[1] < case.size
                hit = one[0] >= 0
                assert int(hit.sum()) == one[1]
                np.testing.assert_array_equal(one[0][hit], spread[0][hit])


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_add_at_summed_matches_add_at_and_the_word_sums(dtype):
    """add_at_summed writes what add_at_ref writes, and its sum change is word_sum(after) -
    word_sum(before), bit for bit: with several writes in one word, in any order, in a last
    partial word, and with positions out of range (counted, skipped)."""
    from reference import add_at_ref

    from pulsediff.kernels import cpu

    rng = np.random.default_rng(np.dtype(dtype).itemsize)
    width = np.dtype(dtype).itemsize * 8
    for n in (1, 3, 7, 64, 1001):
        base = rng.integers(0, 1 << min(width, 63), n, dtype=np.uint64).astype(dtype)
        k = int(rng.integers(1, n + 1))
        positions = rng.permutation(n)[:k].astype(np.int64)  # distinct, in no order; neighbours share words
        if n > 3:
            positions = np.concatenate([positions, [n, n + 5]])  # out of range
        deltas = rng.integers(0, 1 << min(width, 62), positions.size, dtype=np.uint64).astype(dtype)
        want = base.copy()
        want_old, want_bad = add_at_ref(want, positions, deltas)
        got = base.copy()
        old, bad, change = cpu.add_at_summed(got, positions, deltas)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(old, want_old)
        assert bad == want_bad
        assert change == (cpu.word_sum(got) - cpu.word_sum(base)) % (1 << 64)


@pytest.mark.parametrize("dtype,shift,mask", [(np.uint16, 7, 255), (np.uint32, 23, 255), (np.uint64, 52, 2047),
                                              (np.uint8, 3, 15), (np.uint16, 0, 0)])
def test_locate_add_summed_writes_what_the_reference_locates_and_adds(dtype, shift, mask, monkeypatch):
    """The walk that writes as it finds (one read for locate, add and the sum after) against the
    references: positions where ranked_positions_ref puts them, the tensor as add_at_ref leaves
    it, the old values, the class sizes, and a sum change of word_sum(after) - word_sum(before),
    across many word-aligned ranges (chunks shrunk); on hostile ranks it finds fewer, and what
    it found it wrote where it lies. Both forms: ranges on the threads, and one walk on a worker."""
    from reference import add_at_ref, classes_ref, diff_ranks_ref, ranked_positions_ref
    from test_class_sort import class_major, few_classes

    import contextlib

    from pulsediff.kernels import cpu, threads

    monkeypatch.setattr(cpu, "_MIN_CHUNK", 8)  # many ranges even on small tensors
    rng = np.random.default_rng(int(np.dtype(dtype).itemsize * 10 + shift))
    width = np.dtype(dtype).itemsize * 8
    for n in (1, 37, 5001):
        base = few_classes(rng, n, dtype, shift, mask)
        new = base.copy()
        pick = rng.random(n) < 0.2
        pick[rng.integers(0, n)] = True
        new[pick] = rng.integers(0, 1 << min(width, 63), int(pick.sum()), dtype=np.uint64).astype(dtype)
        _, classes, ranks, _ = diff_ranks_ref(base, new, shift, mask)
        offsets, ranks_cm = class_major(classes, ranks, mask)
        true_sizes = np.bincount(classes_ref(base, shift, mask), minlength=mask + 1)
        deltas = rng.integers(0, 1 << min(width, 62), ranks_cm.size, dtype=np.uint64).astype(dtype)
        hostile = ranks_cm.copy()
        hostile[-1] = true_sizes[int(np.searchsorted(offsets, hostile.size - 1, side="right") - 1)] + 2
        for case, alone in [(ranks_cm, False), (hostile, False), (ranks_cm, True), (hostile, True)]:
            got = base.copy()
            where = np.full(case.size, -1, np.int64)
            old = np.zeros(case.size, dtype)
            with threads.inline() if alone else contextlib.nullcontext():  # one walk, or ranges on threads
                found, change, sizes = cpu.locate_add_summed(got, shift, mask, offsets, case, deltas, where, old)
            np.testing.assert_array_equal(sizes, true_sizes)
            assert change == (cpu.word_sum(got) - cpu.word_sum(base)) % (1 << 64)
            hit = where >= 0
            np.testing.assert_array_equal(old[hit], base[where[hit]])
            want = base.copy()
            add_at_ref(want, where[hit], deltas[hit])
            np.testing.assert_array_equal(got, want)
            if case is ranks_cm:
                np.testing.assert_array_equal(where, ranked_positions_ref(base, shift, mask, offsets, case)[0])
                assert found == case.size
            else:
                assert found < case.size and found == int(hit.sum())
