"""CPU kernels: serial Numba kernels over ranges of a tensor, run in parallel on worker threads.

Every kernel is a `@njit(nogil=True)` function over one range [lo, hi) of a
tensor; `threads.parallel_map` runs the ranges of a tensor on the worker
threads with the GIL released (threads.py says why this and not Numba's own
`parallel=True`). Kernels work on bit patterns (unsigned integers of the
element's width), never on floating-point values. `tests/reference.py` holds
the plain NumPy oracle they are checked against, bit for bit.

Stream compaction (mask -> positions + values) is the classic count / scan /
write scheme made single-pass in the common case: each range writes into its
own buffer sized for a density of 1/32 and counts as it goes; only a range
denser than that (rare at RL learning rates) is read a second time into a
buffer of the counted size. Ranges are contiguous and concatenated in order,
so positions come out ascending with no sort.
"""

from __future__ import annotations

from functools import partial

import numpy as np
from numba import njit

from pulsediff.kernels.threads import Turns, num_threads, parallel_map, serial

# A tensor is cut into at least this many ranges per thread (so a thread the OS
# slows down simply takes fewer of them), each at least _MIN_CHUNK elements
# (to amortise a task's ~20 us) and at most _MAX_CHUNK (so ranks inside a
# range fit 32 bits and per-range buffers stay small).
_CHUNKS_PER_THREAD = 4
_MIN_CHUNK = 1 << 16
_MAX_CHUNK = 1 << 24
# Per-range output buffers hold 1/_SLOT_FRACTION of the range: 3% density (RL
# steps are ~1%) before a range needs its second read.
_SLOT_FRACTION = 32
# Unsigned index steps: Numba turns a signed index into a select for negative ones, which
# costs the four-element loops below up to a third of their time.
_U1 = np.uint64(1)
_U2 = np.uint64(2)
_U3 = np.uint64(3)


def chunk_count(n: int) -> int:
    """How many ranges a tensor of n elements is cut into."""
    want = max(num_threads() * _CHUNKS_PER_THREAD, -(-n // _MAX_CHUNK))
    return max(1, min(want, n // _MIN_CHUNK))


def chunk_ranges(n: int, nchunks: int) -> list[tuple[int, int]]:
    """[lo, hi) of each of nchunks equal ranges (the last ones may be shorter or empty)."""
    step = -(-n // nchunks) if nchunks else 0
    return [(min(n, c * step), min(n, (c + 1) * step)) for c in range(nchunks)]


def read_only(a: np.ndarray) -> np.ndarray:
    """`a`, or a view of it that cannot be written: what a kernel only reads is handed over read-only
    whatever its source (a mapped file's bytes are, a tensor's are not), because Numba compiles a
    kernel again for each combination of writable and read-only arrays (a cold run of the tests
    compiled _checked_diff_range 19 times, 24 s, where one per element width will do)."""
    if not a.flags.writeable:
        return a
    view = a.view()
    view.flags.writeable = False
    return view


def _slot_capacity(length: int) -> int:
    return max(16, length // _SLOT_FRACTION)


# -- compare and compact ----------------------------------------------------------


@njit(cache=True, nogil=True)
def _compact_range(old, new, lo, hi, positions, values):
    # Writes at most positions.size entries, counts them all: a caller seeing a
    # count above its buffer's size reads the range again into a bigger one.
    cap = positions.size
    k = 0
    for i in range(lo, hi):
        u = np.uint64(i)
        b = new[u]
        if old[u] != b:
            if k < cap:
                positions[np.uint64(k)] = i
                values[np.uint64(k)] = b
            k += 1
    return k


def _compact_chunk(old, new, lo, hi):
    positions = np.empty(_slot_capacity(hi - lo), np.int64)
    values = np.empty(positions.size, new.dtype)
    k = _compact_range(old, new, lo, hi, positions, values)
    if k > positions.size:
        positions, values = np.empty(k, np.int64), np.empty(k, new.dtype)
        _compact_range(old, new, lo, hi, positions, values)
    return positions[:k].copy(), values[:k].copy()  # copies: the range's buffer is freed now


def diff_compact(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions (int64, ascending) where `new` differs from `old`, and `new`'s bits there."""
    n = old.size
    if new.size != n:
        raise ValueError("diff_compact needs arrays of equal length")  # @njit does no bounds checks
    if n == 0:
        return np.empty(0, np.int64), np.empty(0, new.dtype)
    old, new = read_only(old), read_only(new)
    parts = parallel_map(_compact_chunk, [(old, new, lo, hi) for lo, hi in chunk_ranges(n, chunk_count(n))])
    return np.concatenate([p for p, _ in parts]), np.concatenate([v for _, v in parts])


# -- scatter and prefix sums ---------------------------------------------------------


@njit(cache=True, nogil=True)
def _scatter_range(out, positions, values, lo, hi):
    # Returns how many positions fall outside `out`; those are skipped, never written,
    # because a hostile patch must not be able to write past the buffer.
    n = np.uint64(out.size)
    bad = 0
    for k in range(lo, hi):
        u = np.uint64(k)
        p = np.uint64(positions[u])  # a negative position wraps to far past n: refused below too
        if p < n:
            out[p] = values[u]
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
    m = positions.size
    if m == 0:
        return 0
    ranges = chunk_ranges(m, chunk_count(m))
    return int(sum(parallel_map(_scatter_range, [(out, positions, values, lo, hi) for lo, hi in ranges])))


@njit(cache=True, nogil=True)
def _sum_range(gaps, lo, hi):
    s = 0
    for i in range(lo, hi):
        s += np.int64(gaps[np.uint64(i)])
    return s


@njit(cache=True, nogil=True)
def _gaps_to_positions_range(gaps, lo, hi, start, positions):
    # Every gap is at least 1 (positions strictly increase, the first counts from -1).
    # Count the gaps that break that so the caller can reject the patch.
    bad = 0
    p = start
    for i in range(lo, hi):
        u = np.uint64(i)
        g = np.int64(gaps[u])
        if g <= 0:
            bad += 1
        p += g
        positions[u] = p
    return bad


def gaps_to_positions(gaps: np.ndarray) -> tuple[np.ndarray, int]:
    """position[i] = sum(gaps[:i+1]) - 1, by a parallel scan.

    Per-range sums, an exclusive scan of those, then a running sum in each
    range. Returns (positions, number of gaps that are not >= 1).
    """
    n = gaps.size
    if n == 0:
        return np.empty(0, np.int64), 0
    ranges = chunk_ranges(n, chunk_count(n))
    sums = parallel_map(_sum_range, [(gaps, lo, hi) for lo, hi in ranges])
    starts = np.full(len(ranges), -1, np.int64)
    starts[1:] += np.cumsum(np.array(sums[:-1], np.int64))
    positions = np.empty(n, np.int64)
    bad = parallel_map(_gaps_to_positions_range,
                       [(gaps, lo, hi, int(s), positions) for (lo, hi), s in zip(ranges, starts)])
    return positions, int(sum(bad))


# -- base-context kernels (codec ctx-rans) ------------------------------------
#
# An element's *class* is a few bits of its base value, (bits >> shift) & mask
# (the exponent, for floats): the receiver knows it before decoding anything.
# Positions are coded as ranks inside a class: rank = how many base elements of
# the same class come before it. Both directions are a chunked scan: per-range
# class histograms, an exclusive scan over ranges, then a walk of each range
# with running per-class counters.
#
# Histograms count into four interleaved sub-tables: neighbouring weights mostly
# share an exponent, and one counter would serialise on its own store-to-load
# latency. The running count of class c before element i is the sum of the four.


@njit(cache=True, nogil=True)
def _class_histogram_range(base, lo, hi, shift, mask, hist):
    # Four separate 1-D tables: a 2-D table's index arithmetic made this twice as slow.
    ncls = mask + 1
    s0 = np.zeros(ncls, np.int64)
    s1 = np.zeros(ncls, np.int64)
    s2 = np.zeros(ncls, np.int64)
    s3 = np.zeros(ncls, np.int64)
    i = lo
    while i + 4 <= hi:
        u = np.uint64(i)  # unsigned indices: no negative-index selects (0.62 -> 0.39 ns per element)
        c0 = np.uint64((np.int64(base[u]) >> shift) & mask)
        c1 = np.uint64((np.int64(base[u + _U1]) >> shift) & mask)
        c2 = np.uint64((np.int64(base[u + _U2]) >> shift) & mask)
        c3 = np.uint64((np.int64(base[u + _U3]) >> shift) & mask)
        s0[c0] += 1
        s1[c1] += 1
        s2[c2] += 1
        s3[c3] += 1
        i += 4
    while i < hi:
        s0[(np.int64(base[i]) >> shift) & mask] += 1
        i += 1
    for k in range(ncls):
        hist[k] = s0[k] + s1[k] + s2[k] + s3[k]


def _exclusive_scan_rows(hist: np.ndarray) -> np.ndarray:
    starts = np.zeros_like(hist)
    np.cumsum(hist[:-1], axis=0, out=starts[1:])
    return starts


def chunk_class_starts(base: np.ndarray, shift: int, mask: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts[range, class]: elements of that class before the range, sizes[class]).

    The number of rows fixes how `apply_ranked` cuts the tensor into ranges.
    """
    n, base = base.size, read_only(base)
    ranges = chunk_ranges(n, chunk_count(n) * 4)  # apply_ranked's tasks: a few per chunk, for balance
    hist = np.zeros((len(ranges), mask + 1), np.int64)
    parallel_map(_class_histogram_range, [(base, lo, hi, shift, mask, hist[c]) for c, (lo, hi) in enumerate(ranges)])
    return _exclusive_scan_rows(hist), hist.sum(axis=0)


@njit(cache=True, nogil=True)
def _local_ranks_range(base, lo, hi, shift, mask, positions, j, ranks, hist):
    # Ranks counted from the range's start, for the ascending positions from
    # index j on that fall in the range; and the range's histogram.
    n_pos = positions.size
    nxt = positions[np.uint64(j)] if j < n_pos else hi
    for i in range(lo, hi):
        cls = np.uint64((np.int64(base[np.uint64(i)]) >> shift) & mask)
        r = hist[cls]
        hist[cls] = r + 1
        if i == nxt:
            ranks[np.uint64(j)] = r
            j += 1
            nxt = positions[np.uint64(j)] if j < n_pos else hi


def class_ranks(base: np.ndarray, shift: int, mask: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per changed position (ascending, in range): its rank within its class. Also returns class sizes."""
    n, base, positions = base.size, read_only(base), read_only(positions)
    ranges = chunk_ranges(n, chunk_count(n))
    hist = np.zeros((len(ranges), mask + 1), np.int64)
    ranks = np.zeros(positions.size, np.int64)
    firsts = np.searchsorted(positions, [lo for lo, _ in ranges] + [n])
    parallel_map(_local_ranks_range, [(base, lo, hi, shift, mask, positions, int(firsts[c]), ranks, hist[c])
                                      for c, (lo, hi) in enumerate(ranges)])
    if positions.size:
        starts = _exclusive_scan_rows(hist)
        classes = (base[positions].astype(np.int64) >> shift) & mask
        chunk_of = np.repeat(np.arange(len(ranges)), np.diff(firsts))
        ranks += starts[chunk_of, classes]
    return ranks, hist.sum(axis=0)


@njit(cache=True, nogil=True)
def diff_ranks_range(old, new, lo, hi, shift, mask, zigzag, classes, ranks, hist):
    # Compare, class histogram and class ranks in one read of the pair. Writes
    # at most zigzag.size entries and counts them all (like _compact_range).
    # Four lanes of counters (element i counts in lane i % 4): neighbouring
    # weights mostly share an exponent, and one counter would serialise on its
    # own store-to-load latency; the rank of a changed element is the sum of
    # the lanes. Groups of four without a change (~92% at 2% density) are
    # found with one test. The difference of bit patterns, new - old modulo
    # 2**width read as signed, is stored zigzag-mapped (0, -1, 1, -2 -> 0, 1,
    # 2, 3): a width-bit value.
    ncls = mask + 1
    width = old.itemsize * 8
    wmask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - width)
    top = np.uint64(width - 1)
    one = np.uint64(1)
    cap = zigzag.size
    s0 = np.zeros(ncls, np.int64)
    s1 = np.zeros(ncls, np.int64)
    s2 = np.zeros(ncls, np.int64)
    s3 = np.zeros(ncls, np.int64)
    k = 0
    i = lo
    while i + 4 <= hi:
        u = np.uint64(i)
        a0, a1, a2, a3 = old[u], old[u + _U1], old[u + _U2], old[u + _U3]
        x = (a0 ^ new[u]) | (a1 ^ new[u + _U1]) | (a2 ^ new[u + _U2]) | (a3 ^ new[u + _U3])
        c0 = np.uint64((np.int64(a0) >> shift) & mask)
        c1 = np.uint64((np.int64(a1) >> shift) & mask)
        c2 = np.uint64((np.int64(a2) >> shift) & mask)
        c3 = np.uint64((np.int64(a3) >> shift) & mask)
        if x == 0:
            s0[c0] += 1
            s1[c1] += 1
            s2[c2] += 1
            s3[c3] += 1
            i += 4
            continue
        for j in range(4):  # a group with a change: element by element, same lanes
            a = old[i]
            b = new[i]
            c = (np.int64(a) >> shift) & mask
            if a != b:
                if k < cap:
                    d = (np.uint64(b) - np.uint64(a)) & wmask
                    zigzag[k] = ((d << one) ^ (np.uint64(0) - (d >> top))) & wmask
                    classes[k] = c
                    ranks[k] = s0[c] + s1[c] + s2[c] + s3[c]
                k += 1
            if j == 0:
                s0[c] += 1
            elif j == 1:
                s1[c] += 1
            elif j == 2:
                s2[c] += 1
            else:
                s3[c] += 1
            i += 1
    # The tail repeats the group's step on purpose: one loop for both (or a helper
    # for both) measured 5 to 9% slower on the whole walk.
    while i < hi:
        a = old[i]
        b = new[i]
        c = (np.int64(a) >> shift) & mask
        if a != b:
            if k < cap:
                d = (np.uint64(b) - np.uint64(a)) & wmask
                zigzag[k] = ((d << one) ^ (np.uint64(0) - (d >> top))) & wmask
                classes[k] = c
                ranks[k] = s0[c] + s1[c] + s2[c] + s3[c]
            k += 1
        s0[c] += 1
        i += 1
    for c in range(ncls):
        hist[c] = s0[c] + s1[c] + s2[c] + s3[c]
    return k


def _ranked_entries(length: int, dtype, fill):
    """A range's (zigzag, classes, ranks) from `fill(zigzag, classes, ranks)`, a kernel call that
    writes at most the buffers' size and returns how many it found (-1: the range has no change,
    then None); read again into buffers of the counted size when it is denser than they are."""
    cap = _slot_capacity(length)
    while True:
        zigzag, classes, ranks = np.empty(cap, dtype), np.empty(cap, np.uint16), np.empty(cap, np.int64)
        k = fill(zigzag, classes, ranks)
        if k < 0:
            return None
        if k <= cap:  # copies: the range's buffer is freed now, not when the whole tensor is done
            return zigzag[:k].copy(), classes[:k].copy(), ranks[:k].copy()
        cap = k


def _joined_ranks(parts: list, hist: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ranges' entries (None: a range without a change) as one tensor's, in position order:
    each range's ranks, counted from its start, offset by the class counts before it (`hist`,
    one row per range)."""
    kept = [(c, p) for c, p in enumerate(parts) if p is not None]
    if not kept:
        return np.empty(0, dtype), np.empty(0, np.uint16), np.empty(0, np.int64)
    starts = _exclusive_scan_rows(hist)
    for c, (_, classes, ranks) in kept:
        if ranks.size and c:
            ranks += starts[c][classes]
    return tuple(np.concatenate([p[i] for _, p in kept]) for i in range(3))


def _diff_ranks_chunk(old, new, lo, hi, shift, mask, hist):
    return _ranked_entries(hi - lo, old.dtype, lambda zigzag, classes, ranks: diff_ranks_range(
        old, new, lo, hi, shift, mask, zigzag, classes, ranks, hist))


def diff_ranks(old: np.ndarray, new: np.ndarray, shift: int,
               mask: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """In one read of the pair, for each element whose bits differ (in position order):
    the zigzag-mapped difference new - old (old's dtype), its base class (uint16)
    and its rank within that class (int64); and the class sizes."""
    n = old.size
    if new.size != n or old.dtype != new.dtype:
        raise ValueError("diff_ranks needs arrays of equal length and dtype")  # @njit does no bounds checks
    if not 0 <= mask < (1 << 16):
        raise ValueError("diff_ranks needs a class mask below 2**16")
    old, new = read_only(old), read_only(new)
    ranges = chunk_ranges(n, chunk_count(n)) if n else []
    hist = np.zeros((max(1, len(ranges)), mask + 1), np.int64)
    parts = parallel_map(_diff_ranks_chunk, [(old, new, lo, hi, shift, mask, hist[c])
                                             for c, (lo, hi) in enumerate(ranges)])
    return (*_joined_ranks(parts, hist, old.dtype), hist.sum(axis=0))


# -- make's one read of a pair: compare, class ranks, word sums and hashes --------------
#
# make needs, for each tensor with a base, both sides' XXH3-128 hash and word sum and the
# compare. Taken as separate passes, each byte crossed the memory bus twice (hash and sum in
# one pass, the compare in another); here each range of the pair is compared, ranked and
# summed in one read and then, mostly still in cache, fed to the two hashers. A hash is
# sequential, so for that step the ranges take turns in order, each side on its own
# (threads.Turns: the old side of range c+1 can be hashed while the new side of range c is);
# the compare, which is most of the work, runs side by side. On machine C (2 cores) the
# compare's arithmetic dominates and this measured a few percent; where many threads share
# one memory bus, the second pass is what binds.

_CHECKED_RANGE_BYTES = 1 << 21  # per side: 2 MiB ranges measured best (docs/benchmarks-log.md, "One read")
_SAME_BLOCK = 256


@njit(cache=True, nogil=True)
def same_range(old, new, lo, hi):
    # Blocks without an early exit inside, so that LLVM vectorises the compare; a changed
    # range is found at its first changed block (at 1% density, within the first few).
    i = lo
    while i + _SAME_BLOCK <= hi:
        x = old[i] ^ new[i]
        for j in range(i + 1, i + _SAME_BLOCK):
            x |= old[j] ^ new[j]
        if x != 0:
            return False
        i += _SAME_BLOCK
    for j in range(i, hi):
        if old[j] != new[j]:
            return False
    return True


@njit(cache=True, nogil=True)
def _checked_diff_range(old, new, lo, hi, shift, mask, zigzag, classes, ranks, hist,
                        old_words, new_words, wlo, whi, sums):
    # Both sides' word-sum terms for words [wlo, whi), then the compare and ranks of elements
    # [lo, hi) (as diff_ranks_range); -1, and no histogram, for a range without a change:
    # an unchanged tensor needs none, and a changed one counts such ranges afterwards.
    sums[0] = word_sum_range(old_words, wlo, whi)
    sums[1] = word_sum_range(new_words, wlo, whi)
    if same_range(old, new, lo, hi):
        return -1
    return diff_ranks_range(old, new, lo, hi, shift, mask, zigzag, classes, ranks, hist)


def _checked_ranges(n: int, itemsize: int) -> list[tuple[int, int]]:
    """Ranges of _CHECKED_RANGE_BYTES per side, each starting on a whole word (8 bytes)."""
    step = max(8, _CHECKED_RANGE_BYTES // itemsize // 8 * 8)
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)]


def diff_ranks_checked(old: np.ndarray, new: np.ndarray, shift: int, mask: int, old_hasher,
                       new_hasher) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """diff_ranks' first three results, and in the same read of the pair each side's word sum
    (as word_sum) and each side's bytes fed, in order, to its hasher (anything with
    `update(buffer)`, such as an xxhash state): (zigzag, classes, ranks, old's sum, new's sum).
    The bytes are those of the arrays in C order."""
    n = old.size
    if new.size != n or old.dtype != new.dtype:
        raise ValueError("diff_ranks_checked needs arrays of equal length and dtype")  # @njit does no bounds checks
    if not 0 <= mask < (1 << 16):
        raise ValueError("diff_ranks_checked needs a class mask below 2**16")
    old, new = read_only(np.ascontiguousarray(old).reshape(-1)), read_only(np.ascontiguousarray(new).reshape(-1))
    isz = old.dtype.itemsize
    old_raw, new_raw = old.view(np.uint8), new.view(np.uint8)
    nwords = old_raw.size // 8
    old_words, new_words = old_raw[:8 * nwords].view(np.uint64), new_raw[:8 * nwords].view(np.uint64)
    ranges = _checked_ranges(n, isz)
    hist = np.zeros((max(1, len(ranges)), mask + 1), np.int64)
    sums = np.zeros((max(1, len(ranges)), 2), np.uint64)
    old_turns, new_turns = Turns(), Turns()

    def one_range(c: int, lo: int, hi: int):
        done = False
        try:
            part = _ranked_entries(hi - lo, old.dtype, lambda zigzag, classes, ranks: _checked_diff_range(
                old, new, lo, hi, shift, mask, zigzag, classes, ranks, hist[c], old_words, new_words,
                lo * isz // 8, min(nwords, hi * isz // 8), sums[c]))
            done = True
            return part
        finally:
            # Both turns are taken even by a range that failed (the call then fails whole), or
            # the ranges after it would wait forever.
            try:
                old_turns.take(c, partial(old_hasher.update, old_raw[lo * isz:hi * isz]) if done else None)
            finally:
                new_turns.take(c, partial(new_hasher.update, new_raw[lo * isz:hi * isz]) if done else None)

    parts = parallel_map(one_range, [(c, lo, hi) for c, (lo, hi) in enumerate(ranges)])
    old_sum, new_sum = (int(s) for s in sums.sum(axis=0, dtype=np.uint64))
    if old_raw.size % 8:
        old_sum += _word_sum_tail(old_raw, nwords)
        new_sum += _word_sum_tail(new_raw, nwords)
    # Ranges without a change before the last changed one still count toward later ranks.
    last = max((c for c, p in enumerate(parts) if p is not None), default=0)
    parallel_map(_class_histogram_range, [(old, ranges[c][0], ranges[c][1], shift, mask, hist[c])
                                          for c in range(last) if parts[c] is None])
    m64 = 0xFFFFFFFFFFFFFFFF
    return (*_joined_ranks(parts, hist, old.dtype), old_sum & m64, new_sum & m64)


# The ranked apply walks each range with a countdown per class: how many more
# elements of that class to pass before the next listed one (_NEVER once the
# class has none left); a listed element is the one whose countdown reads 0.
# One element at a time, with unsigned indices: Numba guards every signed index
# with a select for negative ones, and that, not the countdowns' store-to-load
# chain, was what the walk spent its time on. Measured on machine C (AMD EPYC),
# one thread, 20M BF16 elements alternating in one process: 0.78-0.92 ns per
# element at 1-2% listed against 1.82-2.17 for the walk before (groups of four
# with their countdowns corrected for same-class neighbours, signed indices)
# and 1.35-1.63 for countdowns in byte lanes of two registers (tried this
# round); 2.26 against 4.53 at 14% listed. Machine A (Intel Xeon) had measured
# the grouped walk 1.6x faster than one element at a time, both with signed
# indices: on a CPU without fast store-to-load forwarding the chain may matter
# again (scripts/bench_entropy.py's walk column says).
_NEVER = 1 << 62


@njit(cache=True, nogil=True)
def _class_countdowns(counter, class_offsets, ranks, ncls):
    """Per class: its first listed entry at or past the counter, and how many elements of the
    class come before that entry's (_NEVER: none left)."""
    ptr = np.empty(ncls, np.int64)
    down = np.empty(ncls, np.int64)
    for k in range(ncls):
        a = class_offsets[k]
        b = class_offsets[k + 1]
        p = a + np.searchsorted(ranks[a:b], counter[k])
        ptr[k] = p
        down[k] = ranks[p] - counter[k] if p < b else _NEVER
    return ptr, down


@njit(cache=True, nogil=True)
def _apply_ranked_range(base, lo, hi, shift, mask, counter, class_offsets, ranks, deltas, out, in_place):
    # Into another buffer, every element of `out` is written (the copy of the base
    # rides along with the walk instead of being a pass of its own); in place, only
    # the changed ones (rewriting the rest would double the memory traffic). Ranks
    # that do not rise (a damaged patch) leave a negative countdown, which never
    # reads 0: those entries stay unapplied, and the caller's count says so.
    ptr, down = _class_countdowns(counter, class_offsets, ranks, mask + 1)
    done = 0
    for i in range(lo, hi):
        u = np.uint64(i)
        v = base[u]
        if not in_place:
            out[u] = v
        k = np.uint64((np.int64(v) >> shift) & mask)
        e = down[k]
        down[k] = e - 1
        if e == 0:  # element i is the listed one of its class: base + delta, then the next's countdown
            p = ptr[k]
            z = np.uint64(deltas[p])
            r = ranks[p]
            p += 1
            ptr[k] = p
            down[k] = ranks[p] - r - 1 if p < class_offsets[k + _U1] else _NEVER
            out[u] = v + ((z >> _U1) ^ (np.uint64(0) - (z & _U1)))  # un-zigzag; wraps mod 2**width
            done += 1
    return done


def apply_ranked(base, shift, mask, starts, class_offsets, ranks, deltas, out) -> int:
    """Write base + deltas into `out` (every element: `out` need not be initialised, or may be
    `base` itself); returns how many (class, rank) entries were applied.

    `starts` comes from `chunk_class_starts` on the same base: its rows say
    how the tensor is cut into ranges (either backend's rows will do).
    """
    if base.size == 0:
        return 0
    in_place = out.__array_interface__["data"][0] == base.__array_interface__["data"][0]
    ranges = chunk_ranges(base.size, starts.shape[0])
    return int(sum(parallel_map(_apply_ranked_range, [
        (base, lo, hi, shift, mask, starts[c], class_offsets, ranks, deltas, out, in_place)
        for c, (lo, hi) in enumerate(ranges) if hi > lo])))


def side_by_side() -> int:
    """Tensors apply may rebuild at once, one per worker thread: a kernel called from a worker
    runs inline on it (threads.parallel_map), so each such tensor is walked on one thread."""
    n = num_threads()
    return n if n > 1 else 0


def resident(*arrays):
    """The arrays where this backend's kernels use them without a copy: here, as they are."""
    return arrays


def ranked_window(part, shift, mask, seen, class_offsets, ranks, deltas, out) -> int:
    """apply_ranked on one window of a tensor: `seen` (int64, updated in place) holds the class
    counts of the windows before it. Returns the entries applied in this window."""
    starts, sizes = chunk_class_starts(part, shift, mask)
    starts += seen
    applied = apply_ranked(part, shift, mask, starts, class_offsets, ranks, deltas, out)
    seen += sizes
    return applied


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


# -- word sums (FORMAT.md §3.1): the per-tensor check a device can afford ------------

# sum64 of a tensor's bytes: zero-padded to whole 8-byte little-endian words w_j,
# sum over j of mix(w_j ^ (j + 1) * PHI) mod 2**64, mix being MurmurHash3's 64-bit
# finalizer (Appleby), a bijection: so one changed word always changes the sum, and
# a change of k elements touches at most k terms.
WORD_SUM_PHI = 0x9E3779B97F4A7C15
WORD_SUM_M1 = 0xFF51AFD7ED558CCD
WORD_SUM_M2 = 0xC4CEB9FE1A85EC53
_PHI = np.uint64(WORD_SUM_PHI)
_M1 = np.uint64(WORD_SUM_M1)
_M2 = np.uint64(WORD_SUM_M2)
_S33 = np.uint64(33)


@njit(cache=True, nogil=True)
def word_sum_range(words, lo, hi):
    # Over a slice, with the key computed from the index: LLVM vectorises this form (1.5x
    # faster in cache than a loop over [lo, hi) carrying the key from word to word).
    sub = words[lo:hi]
    first = np.uint64(lo + 1)
    total = np.uint64(0)
    for j in range(sub.size):
        x = sub[j] ^ ((first + np.uint64(j)) * _PHI)
        x ^= x >> _S33
        x *= _M1
        x ^= x >> _S33
        x *= _M2
        x ^= x >> _S33
        total += x
    return total


def _word_sum_tail(data: np.ndarray, nwords: int) -> int:
    """The last, zero-padded word's term (Python ints: exact mod 2**64)."""
    return word_term(data[8 * nwords:], nwords)


def word_term(tail: np.ndarray, index: int) -> int:
    """The term of word `index` when it holds these bytes (at most 8), zero-padded."""
    x = int.from_bytes(bytes(tail) + bytes(8 - tail.size), "little") ^ ((index + 1) * WORD_SUM_PHI & 0xFFFFFFFFFFFFFFFF)
    for mult in (WORD_SUM_M1, WORD_SUM_M2):
        x ^= x >> 33
        x = x * mult & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 33)


def word_sum_part(raw: np.ndarray, start: int, stop: int) -> int:
    """The terms of bytes [start, stop) of `raw` (uint8, contiguous) in its word sum, one thread:
    `start` a multiple of 8, `stop` too or the end. Parts add up (mod 2**64) to the sum, so a
    caller can take it block by block while each block is in cache for another pass."""
    nwords = raw.size // 8
    words = raw[:8 * nwords].view(np.uint64)
    total = int(word_sum_range(words, start // 8, min(stop // 8, nwords)))
    if stop >= raw.size and raw.size % 8:
        total += _word_sum_tail(raw, nwords)
    return total & 0xFFFFFFFFFFFFFFFF


def word_sum(data: np.ndarray) -> int:
    """FORMAT.md §3.1's sum64 of the array's bytes (C order), as an int in [0, 2**64)."""
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    nwords = raw.size // 8
    words = raw[:8 * nwords].view(np.uint64)
    ranges = chunk_ranges(nwords, chunk_count(nwords))
    total = sum(int(s) for s in parallel_map(word_sum_range, [(words, lo, hi) for lo, hi in ranges]))
    if raw.size % 8:
        total += _word_sum_tail(raw, nwords)
    return total & 0xFFFFFFFFFFFFFFFF


# -- chunk digests: the leaves of a digest computed in parallel -------------------------
#
# XXH3-128 is sequential over a buffer: a tensor's hash takes one core (or one GPU warp)
# however large it is. Hashes of fixed chunks are independent, so every thread, and on a GPU
# every warp, takes chunks of its own; a digest over the chunk hashes (the root) then costs 16
# bytes per chunk. At 256 KiB the host's hasher runs as fast as on whole buffers (41 GB/s
# from cache on machine D, as at 1 MiB; 64 KiB chunks cost 15%, 16 KiB 46%), and a 32 MiB
# tensor still gives a GPU 128 warps.

DIGEST_CHUNK_BYTES = 1 << 18


def check_digest_chunk(chunk: int) -> None:
    """Chunks of whole 64-byte stripes (so every chunk starts on a word), long enough for XXH3's
    long path: both backends' chunk_digests take no other."""
    if chunk < 256 or chunk % 64:
        raise ValueError("chunk_digests needs a chunk of at least 256 bytes and a multiple of 64")


def xxh3_leaf(buffer) -> tuple[int, int]:
    """XXH3-128 of a buffer as (low 64 bits, high 64 bits): one row of chunk_digests."""
    import xxhash  # releases the GIL over large buffers: chunks hash side by side

    value = xxhash.xxh3_128_intdigest(buffer)
    return value & 0xFFFFFFFFFFFFFFFF, value >> 64


def chunk_digests(data: np.ndarray, chunk: int = DIGEST_CHUNK_BYTES) -> np.ndarray:
    """XXH3-128 of each `chunk` bytes of the array's bytes (C order; the last chunk may be
    shorter), as rows of (low 64 bits, high 64 bits), uint64; no rows for an empty array."""
    check_digest_chunk(chunk)
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    m = -(-raw.size // chunk)
    out = np.empty((m, 2), np.uint64)

    def leaves(lo: int, hi: int) -> None:
        for c in range(lo, hi):
            out[c] = xxh3_leaf(raw[c * chunk:(c + 1) * chunk])

    parallel_map(leaves, chunk_ranges(m, min(m, num_threads())) if m else [])
    return out


# -- ranked positions and in-place updates: patching live tensors --------------------


@njit(cache=True, nogil=True)
def _countdown_walk(base, lo, hi, shift, mask, ptr, down, class_offsets, ranks, where):
    # The countdown walk of apply_ranked over [lo, hi), recording where each listed (class,
    # rank) entry lies instead of writing the element (written out again rather than shared
    # with apply_ranked: a call per listed element would cost its arrays' reference counts).
    # `ptr` and `down` (from _class_countdowns) are left where the walk ends.
    done = 0
    for i in range(lo, hi):
        k = np.uint64((np.int64(base[np.uint64(i)]) >> shift) & mask)
        e = down[k]
        down[k] = e - 1
        if e == 0:
            p = ptr[k]
            where[p] = i
            r = ranks[p]
            p += 1
            ptr[k] = p
            down[k] = ranks[p] - r - 1 if p < class_offsets[k + _U1] else _NEVER
            done += 1
    return done


@njit(cache=True, nogil=True)
def _ranked_positions_range(base, lo, hi, shift, mask, counter, class_offsets, ranks, where):
    ptr, down = _class_countdowns(counter, class_offsets, ranks, mask + 1)
    return _countdown_walk(base, lo, hi, shift, mask, ptr, down, class_offsets, ranks, where)


@njit(cache=True, nogil=True)
def locate_whole(base, shift, mask, class_offsets, ranks, where, sizes):
    # The countdown walk of the whole tensor from zero counts, on one thread: no class
    # histogram first (that pass only lets ranges start mid-tensor). The class sizes come
    # from where each countdown ended: a class's count before its next listed entry is that
    # entry's rank minus what is left of the countdown (also for ranks that do not rise).
    ncls = mask + 1
    ptr, down = _class_countdowns(np.zeros(ncls, np.int64), class_offsets, ranks, ncls)
    first = ptr.copy()
    done = _countdown_walk(base, 0, base.size, shift, mask, ptr, down, class_offsets, ranks, where)
    _sizes_from_countdowns(ptr, down, first, class_offsets, ranks, sizes)
    return done


@njit(cache=True, nogil=True)
def _sizes_from_countdowns(ptr, down, first, class_offsets, ranks, sizes):
    # Class sizes from where a walk of the whole tensor from zero counts left its countdowns.
    for k in range(sizes.size):
        p = ptr[k]
        if p < class_offsets[k + 1]:
            sizes[k] = ranks[p] - down[k]
        elif p > first[k]:  # past the last listed entry, at rank ranks[p - 1]
            sizes[k] = ranks[p - 1] + 1 + (_NEVER - down[k])
        else:
            sizes[k] = _NEVER - down[k]


def locate_ranked(base, shift, mask, class_offsets, ranks) -> tuple[np.ndarray, int, np.ndarray]:
    """The entries' positions (-1: not found), how many were found, and the class sizes.

    Spread over the worker threads: class counts per range, then the ranges' walks. On one
    thread (a caller that runs tensors side by side, each on a worker: threads.serial()):
    one walk of the whole tensor, without the counting pass."""
    if serial() and base.size:
        where = np.full(ranks.size, -1, np.int64)
        sizes = np.zeros(mask + 1, np.int64)
        found = locate_whole(base, shift, mask, class_offsets, ranks, where, sizes)
        return where, int(found), sizes
    starts, sizes = chunk_class_starts(base, shift, mask)
    where, found = ranked_positions(base, shift, mask, starts, class_offsets, ranks)
    return where, found, sizes


def ranked_positions(base, shift, mask, starts, class_offsets, ranks) -> tuple[np.ndarray, int]:
    """Where each (class, rank) entry lies in `base`: positions in entry order (-1 for an entry
    whose rank is outside its class or not above the previous one's), and how many were found.

    `starts` comes from either backend's `chunk_class_starts` of this base.
    """
    where = np.full(ranks.size, -1, np.int64)
    if base.size == 0:
        return where, 0
    ranges = chunk_ranges(base.size, starts.shape[0])
    tasks = [(base, lo, hi, shift, mask, starts[c], class_offsets, ranks, where)
             for c, (lo, hi) in enumerate(ranges) if hi > lo]
    return where, int(sum(parallel_map(_ranked_positions_range, tasks)))


@njit(cache=True, nogil=True)
def _locate_add_range(base, lo, hi, shift, mask, counter, class_offsets, ranks, deltas, where, old):
    ptr, down = _class_countdowns(counter, class_offsets, ranks, mask + 1)
    return _countdown_add(base, lo, hi, shift, mask, ptr, down, class_offsets, ranks, deltas, where, old)


@njit(cache=True, nogil=True)
def _locate_add_whole(base, shift, mask, class_offsets, ranks, deltas, where, old, sizes):
    # The whole tensor from zero counts on one thread: no class histogram first (as locate_whole).
    ncls = mask + 1
    ptr, down = _class_countdowns(np.zeros(ncls, np.int64), class_offsets, ranks, ncls)
    first = ptr.copy()
    done, change = _countdown_add(base, 0, base.size, shift, mask, ptr, down, class_offsets, ranks, deltas, where,
                                  old)
    _sizes_from_countdowns(ptr, down, first, class_offsets, ranks, sizes)
    return done, change


@njit(cache=True, nogil=True)
def _countdown_add(base, lo, hi, shift, mask, ptr, down, class_offsets, ranks, deltas, where, old):
    # The countdown walk of [lo, hi) (_countdown_walk) that also writes each listed element as it
    # finds it, in place: base + delta, with its old value in `old` and its position in `where`
    # (entry order). Returns (entries found, the change of the word sum): _add_at_summed's
    # telescoping terms, race-free because ranges begin and end on word boundaries. So the
    # walk, the add and the sum after take one read of the tensor, not three.
    width = base.itemsize
    per = 8 // width
    bits = 8 * width
    done = 0
    change = np.uint64(0)
    for i in range(lo, hi):
        u = np.uint64(i)
        v = base[u]
        k = np.uint64((np.int64(v) >> shift) & mask)
        e = down[k]
        down[k] = e - 1
        if e == 0:
            p = ptr[k]
            where[p] = i
            old[p] = v
            j = i // per
            before = word_term_at(base, j, per, bits)
            z = np.uint64(deltas[p])
            base[u] = v + ((z >> _U1) ^ (np.uint64(0) - (z & _U1)))  # un-zigzag; wraps mod 2**width
            change += word_term_at(base, j, per, bits) - before
            r = ranks[p]
            p += 1
            ptr[k] = p
            down[k] = ranks[p] - r - 1 if p < class_offsets[k + _U1] else _NEVER
            done += 1
    return done, change


def locate_add_summed(base, shift, mask, class_offsets, ranks, deltas, where, old) -> tuple[int, int, np.ndarray]:
    """locate_ranked and add_at_summed in one read of `base`, spread over the worker threads: each
    listed (class, rank) entry found is written in place (base + its zigzag delta), its position
    put in `where` (int64, filled with -1 by the caller: -1 stays for an entry not found) and its
    old value in `old`. Returns (entries found, the word sum's change (after - before) mod 2**64,
    the class sizes). A caller that finds fewer than it listed puts the found ones back."""
    n = base.size
    if serial() and n:  # on one thread: one walk from zero counts, no histogram pass
        sizes = np.zeros(mask + 1, np.int64)
        found, change = _locate_add_whole(base, shift, mask, class_offsets, ranks, deltas, where, old, sizes)
        return int(found), int(change), sizes
    per = 8 // base.itemsize
    nchunks = max(1, chunk_count(n) * 4)  # a few per thread, for balance (as chunk_class_starts)
    step = -(-(-(-n // nchunks)) // per) * per  # whole words per range
    ranges = [(lo, min(n, lo + step)) for lo in range(0, n, step)] if n else []
    hist = np.zeros((len(ranges), mask + 1), np.int64)
    counted = read_only(base)  # the count only reads (the walk after it writes `base`)
    parallel_map(_class_histogram_range, [(counted, lo, hi, shift, mask, hist[c]) for c, (lo, hi) in enumerate(ranges)])
    starts = _exclusive_scan_rows(hist)
    parts = parallel_map(_locate_add_range, [(base, lo, hi, shift, mask, starts[c], class_offsets, ranks, deltas,
                                              where, old) for c, (lo, hi) in enumerate(ranges)])
    found = sum(int(f) for f, _ in parts)
    change = sum(int(c) for _, c in parts) & 0xFFFFFFFFFFFFFFFF
    return found, change, hist.sum(axis=0)


@njit(cache=True, nogil=True)
def _add_at_range(out, positions, deltas, old, lo, hi):
    n = np.uint64(out.size)
    bad = 0
    for e in range(lo, hi):
        u = np.uint64(e)
        p = np.uint64(positions[u])  # a negative position wraps to far past n: refused below too
        if p < n:
            v = out[p]
            old[u] = v
            z = np.uint64(deltas[u])
            out[p] = v + ((z >> np.uint64(1)) ^ (np.uint64(0) - (z & np.uint64(1))))  # un-zigzag, wraps
        else:
            bad += 1
    return bad


@njit(cache=True, nogil=True, inline="always")
def word_term_at(out, j, per, bits):
    # FORMAT.md 3.1's term of word j: its elements (zero past the end) little-endian, keyed by j.
    x = np.uint64(0)
    lo = j * per
    for e in range(lo, min(lo + per, out.size)):
        x |= np.uint64(out[np.uint64(e)]) << np.uint64(bits * (e - lo))
    x ^= np.uint64(j + 1) * _PHI
    x ^= x >> _S33
    x *= _M1
    x ^= x >> _S33
    x *= _M2
    x ^= x >> _S33
    return x


@njit(cache=True, nogil=True)
def _add_at_summed(out, positions, deltas, old):
    # add_at on one thread, with each write's change to the word sum: the term of the word
    # holding the element before and after it. Summed over the writes in the order they
    # happen, the changes telescope to (sum after - sum before) however many writes share a
    # word; on one thread only (another thread's write into the same word would break that).
    n = np.uint64(out.size)
    width = out.itemsize
    per = 8 // width
    bits = 8 * width
    bad = 0
    change = np.uint64(0)
    for e in range(positions.size):
        u = np.uint64(e)
        p = np.uint64(positions[u])
        if p < n:
            j = np.int64(p) // per
            before = word_term_at(out, j, per, bits)
            v = out[p]
            old[u] = v
            z = np.uint64(deltas[u])
            out[p] = v + ((z >> np.uint64(1)) ^ (np.uint64(0) - (z & np.uint64(1))))  # un-zigzag, wraps
            change += word_term_at(out, j, per, bits) - before
        else:
            bad += 1
    return bad, change


def add_at_summed(out, positions, deltas) -> tuple[np.ndarray, int, int]:
    """add_at on the calling thread alone, also returning how the array's word sum changed
    ((after - before) mod 2**64, from the written words only): a caller that knows the sum
    before checks the sum after without reading the array again. Positions must be distinct."""
    if deltas.size != positions.size:
        raise ValueError("add_at needs as many deltas as positions")
    old = np.zeros(positions.size, out.dtype)
    if positions.size == 0:
        return old, 0, 0
    bad, change = _add_at_summed(out, positions, deltas, old)
    return old, int(bad), int(change)


def add_at(out, positions, deltas) -> tuple[np.ndarray, int]:
    """out[positions] += un-zigzagged deltas (mod 2**width), in place; returns the old values
    (for an undo log) and how many positions were out of range (skipped, their old value 0).
    Positions must be distinct."""
    if deltas.size != positions.size:
        raise ValueError("add_at needs as many deltas as positions")
    old = np.zeros(positions.size, out.dtype)
    m = positions.size
    if m == 0:
        return old, 0
    ranges = chunk_ranges(m, chunk_count(m))
    bad = sum(parallel_map(_add_at_range, [(out, positions, deltas, old, lo, hi) for lo, hi in ranges]))
    return old, int(bad)
