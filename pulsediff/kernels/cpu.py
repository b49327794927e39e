"""CPU kernels: Numba `@njit(parallel=True)`, one chunk of the tensor per thread.

Both kernels work on bit patterns (unsigned integers of the element's width),
never on floating-point values. `tests/reference.py` holds the plain NumPy
oracle they are checked against.

Stream compaction (mask -> positions + values) is the classic two-pass scheme
(count per chunk, exclusive prefix sum, write), made single-pass in the common
case: each chunk first writes speculatively into its own slot of a buffer
sized for a density of 1/16, counting as it goes; when every chunk fits, the
slots are concatenated and the input was read once. Only a chunk denser than
that (rare at RL learning rates) sends the tensor through the second pass,
which reuses the counts. Chunks are contiguous, so positions come out in
ascending order with no sort.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

# Chunks per thread: more than one evens out the load when some chunks are
# denser than others; each is still long enough to amortise the loop setup.
_CHUNKS_PER_THREAD = 8
_MIN_CHUNK = 1 << 16


def _num_chunks(n: int) -> int:
    return max(1, min(numba.get_num_threads() * _CHUNKS_PER_THREAD, n // _MIN_CHUNK))


# Slot capacity per chunk, as a fraction of its length: 1/16 covers densities up
# to 6.25% (RL steps are ~1%) for a buffer of ~n/16 positions and values.
_SLOT_FRACTION = 16


@njit(parallel=True, cache=True, nogil=True)
def _compact_into_slots(old, new, nchunks, cap, slot_positions, slot_values):
    n = old.size
    step = (n + nchunks - 1) // nchunks
    counts = np.zeros(nchunks, np.int64)
    for c in prange(nchunks):
        lo = c * step
        hi = min(n, lo + step)
        base = c * cap
        k = 0
        for i in range(lo, hi):
            if old[i] != new[i]:
                if k < cap:
                    slot_positions[base + k] = i
                    slot_values[base + k] = new[i]
                k += 1
        counts[c] = k
    return counts


@njit(parallel=True, cache=True, nogil=True)
def _gather_slots(counts, offsets, cap, slot_positions, slot_values, positions, values):
    for c in prange(counts.size):
        src = c * cap
        dst = offsets[c]
        for k in range(counts[c]):
            positions[dst + k] = slot_positions[src + k]
            values[dst + k] = slot_values[src + k]


@njit(parallel=True, cache=True, nogil=True)
def _write_changed(old, new, offsets, positions, values):
    n = old.size
    nchunks = offsets.size
    step = (n + nchunks - 1) // nchunks
    for c in prange(nchunks):
        lo = c * step
        hi = min(n, lo + step)
        j = offsets[c]
        for i in range(lo, hi):
            if old[i] != new[i]:
                positions[j] = i
                values[j] = new[i]
                j += 1


def diff_compact(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions (int64, ascending) where `new` differs from `old`, and `new`'s bits there."""
    n = old.size
    if new.size != n:
        raise ValueError("diff_compact needs arrays of equal length")  # @njit does no bounds checks
    if n == 0:
        return np.empty(0, np.int64), np.empty(0, new.dtype)
    nchunks = _num_chunks(n)
    step = (n + nchunks - 1) // nchunks
    cap = max(16, step // _SLOT_FRACTION)
    slot_positions = np.empty(nchunks * cap, np.int64)
    slot_values = np.empty(nchunks * cap, new.dtype)
    counts = _compact_into_slots(old, new, nchunks, cap, slot_positions, slot_values)
    offsets = np.zeros(nchunks, np.int64)
    np.cumsum(counts[:-1], out=offsets[1:])
    total = int(counts.sum())
    positions = np.empty(total, np.int64)
    values = np.empty(total, new.dtype)
    if total == 0:
        return positions, values
    if counts.max() <= cap:
        _gather_slots(counts, offsets, cap, slot_positions, slot_values, positions, values)
    else:
        _write_changed(old, new, offsets, positions, values)  # the counts are already known
    return positions, values


@njit(parallel=True, cache=True, nogil=True)
def _scatter(out, positions, values):
    # Returns how many positions fall outside `out`; those are skipped, never written,
    # because a hostile patch must not be able to write past the buffer.
    n = out.size
    bad = 0
    for k in prange(positions.size):
        p = positions[k]
        if p >= 0 and p < n:
            out[p] = values[k]
        else:
            bad += 1
    return bad


def scatter(out: np.ndarray, positions: np.ndarray, values: np.ndarray) -> int:
    """out[positions] = values in place; returns the number of out-of-range positions (0 when valid).

    Positions must be distinct (valid patches have strictly increasing ones):
    with duplicates, which value wins is unspecified on every backend.
    """
    if values.size != positions.size:
        raise ValueError("scatter needs as many values as positions")  # @njit does no bounds checks
    if positions.size == 0:
        return 0
    return int(_scatter(out, positions, values))


@njit(parallel=True, cache=True, nogil=True)
def _chunk_sums(gaps, nchunks):
    n = gaps.size
    step = (n + nchunks - 1) // nchunks
    sums = np.zeros(nchunks, np.int64)
    for c in prange(nchunks):
        lo = c * step
        hi = min(n, lo + step)
        s = 0
        for i in range(lo, hi):
            s += np.int64(gaps[i])
        sums[c] = s
    return sums


@njit(parallel=True, cache=True, nogil=True)
def _gaps_to_positions(gaps, starts, positions):
    # Every gap is at least 1 (positions strictly increase, the first counts from -1).
    # Count the gaps that break that so the caller can reject the patch.
    n = gaps.size
    nchunks = starts.size
    step = (n + nchunks - 1) // nchunks
    bad = 0
    for c in prange(nchunks):
        lo = c * step
        hi = min(n, lo + step)
        p = starts[c]
        for i in range(lo, hi):
            g = np.int64(gaps[i])
            if g <= 0:
                bad += 1
            p += g
            positions[i] = p
    return bad


def gaps_to_positions(gaps: np.ndarray) -> tuple[np.ndarray, int]:
    """position[i] = sum(gaps[:i+1]) - 1, by a parallel scan.

    Per-chunk sums, an exclusive scan of those, then a running sum in each
    chunk. Returns (positions, number of gaps that are not >= 1).
    """
    n = gaps.size
    if n == 0:
        return np.empty(0, np.int64), 0
    nchunks = _num_chunks(n)
    sums = _chunk_sums(gaps, nchunks)
    starts = np.full(nchunks, -1, np.int64)
    starts[1:] += np.cumsum(sums[:-1])
    positions = np.empty(n, np.int64)
    bad = _gaps_to_positions(gaps, starts, positions)
    return positions, int(bad)


# -- base-context kernels (codec ctx-rans) ------------------------------------
#
# An element's *class* is a few bits of its base value, (bits >> shift) & mask
# (the exponent, for floats): the receiver knows it before decoding anything.
# Positions are coded as ranks inside a class: rank = how many base elements of
# the same class come before it. Both directions are a chunked scan: per-chunk
# class histograms, an exclusive scan over chunks, then a walk of each chunk
# with running per-class counters.


@njit(parallel=True, cache=True, nogil=True)
def _class_histograms(base, shift, mask, nchunks):
    # Four interleaved sub-histograms: neighbouring weights mostly share an
    # exponent, and one counter would serialise on its own store-to-load latency.
    n = base.size
    step = (n + nchunks - 1) // nchunks
    ncls = mask + 1
    hist = np.zeros((nchunks, ncls), np.int64)
    for c in prange(nchunks):
        lo = c * step
        hi = min(n, lo + step)
        sub = np.zeros((4, ncls), np.int64)
        i = lo
        while i + 4 <= hi:
            sub[0, (np.int64(base[i]) >> shift) & mask] += 1
            sub[1, (np.int64(base[i + 1]) >> shift) & mask] += 1
            sub[2, (np.int64(base[i + 2]) >> shift) & mask] += 1
            sub[3, (np.int64(base[i + 3]) >> shift) & mask] += 1
            i += 4
        while i < hi:
            sub[0, (np.int64(base[i]) >> shift) & mask] += 1
            i += 1
        for k in range(ncls):
            hist[c, k] = sub[0, k] + sub[1, k] + sub[2, k] + sub[3, k]
    return hist


def chunk_class_starts(base: np.ndarray, shift: int, mask: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts[chunk, class]: elements of that class before the chunk, sizes[class])."""
    hist = _class_histograms(base, shift, mask, _num_chunks(base.size))
    starts = np.zeros_like(hist)
    np.cumsum(hist[:-1], axis=0, out=starts[1:])
    return starts, hist.sum(axis=0)


@njit(parallel=True, cache=True, nogil=True)
def _local_class_ranks(base, shift, mask, positions, nchunks, ranks, chunk_of):
    # One pass: ranks counted from the chunk's start, and the chunk's histogram.
    n = base.size
    step = (n + nchunks - 1) // nchunks
    hist = np.zeros((nchunks, mask + 1), np.int64)
    for c in prange(nchunks):
        lo = c * step
        hi = min(n, lo + step)
        counter = hist[c]
        j = np.searchsorted(positions, lo)
        nxt = positions[j] if j < positions.size else n
        for i in range(lo, hi):
            cls = (np.int64(base[i]) >> shift) & mask
            r = counter[cls]
            counter[cls] = r + 1
            if i == nxt:
                ranks[j] = r
                chunk_of[j] = c
                j += 1
                nxt = positions[j] if j < positions.size else n
    return hist


def class_ranks(base: np.ndarray, shift: int, mask: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per changed position (ascending): its rank within its class. Also returns class sizes.

    Ranks are counted from each chunk's start in the same pass that builds the
    chunk histograms; adding the scanned histograms of earlier chunks makes them global.
    """
    nchunks = _num_chunks(base.size)
    ranks = np.zeros(positions.size, np.int64)
    chunk_of = np.zeros(positions.size, np.int64)
    hist = _local_class_ranks(base, shift, mask, positions, nchunks, ranks, chunk_of)
    starts = np.zeros_like(hist)
    np.cumsum(hist[:-1], axis=0, out=starts[1:])
    if positions.size:
        classes = (base[positions].astype(np.int64) >> shift) & mask
        ranks += starts[chunk_of, classes]
    return ranks, hist.sum(axis=0)


@njit(parallel=True, cache=True, nogil=True)
def _apply_ranked(base, shift, mask, starts, class_offsets, ranks, deltas, out, in_place):
    # Into another buffer, every element of `out` is written (the copy of the base
    # rides along with the walk instead of being a pass of its own); in place, only
    # the changed ones (rewriting the rest would double the memory traffic).
    n = base.size
    nchunks = starts.shape[0]
    step = (n + nchunks - 1) // nchunks
    ncls = mask + 1
    applied = np.zeros(nchunks, np.int64)
    for c in prange(nchunks):
        lo = c * step
        hi = min(n, lo + step)
        counter = starts[c].copy()
        ptr = np.empty(ncls, np.int64)
        nxt = np.empty(ncls, np.int64)  # rank of the next listed element of each class, -1 if none
        for k in range(ncls):
            a = class_offsets[k]
            b = class_offsets[k + 1]
            ptr[k] = a + np.searchsorted(ranks[a:b], counter[k])
            nxt[k] = ranks[ptr[k]] if ptr[k] < b else -1
        done = 0
        for i in range(lo, hi):
            v = base[i]
            cls = (np.int64(v) >> shift) & mask
            r = counter[cls]
            counter[cls] = r + 1
            if r == nxt[cls]:
                p = ptr[cls]
                z = np.uint64(deltas[p])
                d = (z >> np.uint64(1)) ^ (np.uint64(0) - (z & np.uint64(1)))  # un-zigzag, mod 2**64
                v = v + d  # wraps modulo 2**width: exact integer arithmetic on bit patterns
                p += 1
                ptr[cls] = p
                nxt[cls] = ranks[p] if p < class_offsets[cls + 1] else -1
                done += 1
                out[i] = v
            elif not in_place:
                out[i] = v
        applied[c] = done
    return applied.sum()


def apply_ranked(base, shift, mask, starts, class_offsets, ranks, deltas, out) -> int:
    """Write base + deltas into `out` (every element: `out` need not be initialised, or may be
    `base` itself); returns how many (class, rank) entries were applied."""
    if base.size == 0:
        return 0
    in_place = out.__array_interface__["data"][0] == base.__array_interface__["data"][0]
    return int(_apply_ranked(base, shift, mask, starts, class_offsets, ranks, deltas, out, in_place))


@njit(cache=True, nogil=True)
def class_major_order(classes, ncls):
    """A stable counting sort's permutation: indices grouped by class, ascending within."""
    counts = np.zeros(ncls + 1, np.int64)
    for i in range(classes.size):
        counts[classes[i] + 1] += 1
    for k in range(ncls):
        counts[k + 1] += counts[k]
    order = np.empty(classes.size, np.int64)
    for i in range(classes.size):
        k = classes[i]
        order[counts[k]] = i
        counts[k] += 1
    return order
