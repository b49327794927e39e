"""The base-context kernels of codec ctx-rans by ranges: class starts, ranks, the ranked walk
(apply_ranked, ranked_positions), and a file's tensor one window at a time (the package docstring
gives the scheme and its sources)."""

from __future__ import annotations

import numpy as np
from numba import cuda, int32, int64

from pulsediff.kernels.cuda.common import (INT64_MAX, SHARED_ITEM, address_of, as_arg, as_bits, as_indices, as_table,
                                           block_sum, buffers, device_view, host_bits, is_device_array, launch_config,
                                           lower_bound, width_mask, zeros, zigzag_deltas)


# Most entries of a `starts` table (ranges x classes): bounds its size (4 MiB of
# int64) and the per-range setup of apply_ranked, while leaving 2048 ranges
# for the usual 256 classes, enough blocks for every SM of an H100 several times.
CLASS_TILE_BUDGET = 1 << 19
# mask <= 4095 (ctx-rans' MAX_CLASS_BITS is 12): bounds the per-class tables in shared memory.
_MAX_CLASSES = 4096
# Ranges stay shorter than this, so per-range counts fit int32, and a class's distance to its
# next listed entry can be capped here: within one range it cannot count down that far.
_FAR = 1 << 30
# A due class's distance while the thread that claimed it places its entries (not negative,
# so no other thread takes it; above _FAR, so no real distance equals it).
_CLAIMED = _FAR + 1
# Adjacent columns a block of the column scan takes at once (8 int64: 64 contiguous bytes).
_SCAN_WIDTH = 8


# --- base-context kernels (codec ctx-rans) ----------------------------------------
#
# Ranges and rounds: range r is [r * step, min(n, (r + 1) * step)); it is walked
# in rounds of blockDim elements starting at the multiple of blockDim at or
# below its start. Thread t takes element round + t when that lies in the range,
# else class -1 (which no counter has).


@cuda.jit(cache=True)
def _range_histograms(base, shift, mask, step, hist):
    counts = cuda.shared.array(0, int32)
    tid = cuda.threadIdx.x
    tpb = cuda.blockDim.x
    n = base.size
    ncls = mask + 1
    for tile in range(cuda.blockIdx.x, hist.shape[0], cuda.gridDim.x):
        for k in range(tid, ncls, tpb):
            counts[k] = 0
        cuda.syncthreads()
        lo = tile * step
        hi = min(n, lo + step)
        # Aligned start: coalesced loads even when the range begins mid-segment.
        for i in range(lo - lo % tpb + tid, hi, tpb):
            if i >= lo:
                cuda.atomic.add(counts, (int64(base[i]) >> shift) & mask, 1)
        cuda.syncthreads()
        for k in range(tid, ncls, tpb):
            hist[tile, k] = counts[k]
        cuda.syncthreads()  # the row is read out before the next range clears the counts


@cuda.jit(cache=True)
def _scan_columns(table, totals, offsets):
    # In place: each column becomes its exclusive prefix sum plus offsets[column] (the class
    # counts of earlier windows, or zeros); totals[column] its sum.
    # A block takes _SCAN_WIDTH adjacent columns at a time, its threads laid out as
    # _SCAN_WIDTH columns x (blockDim / _SCAN_WIDTH) runs of rows: each thread sums its
    # run (each row read is 8 adjacent int64, 64 contiguous bytes), one thread per
    # column scans the run sums in shared memory, and the runs are rewritten.
    sh = cuda.shared.array(0, int64)
    tid = cuda.threadIdx.x
    width = min(_SCAN_WIDTH, cuda.blockDim.x)
    runs = cuda.blockDim.x // width  # both powers of two: every thread has a (column, run)
    c = tid % width
    s = tid // width
    rows = table.shape[0]
    cols = table.shape[1]
    per = (rows + runs - 1) // runs
    lo = s * per
    hi = min(rows, lo + per)
    for group in range(cuda.blockIdx.x, (cols + width - 1) // width, cuda.gridDim.x):
        col = group * width + c
        t = int64(0)
        if col < cols:
            for r in range(lo, hi):
                t += table[r, col]
        sh[tid] = t
        cuda.syncthreads()
        if s == 0 and col < cols:
            run = offsets[col]
            for q in range(runs):
                v = sh[q * width + c]
                sh[q * width + c] = run
                run += v
            totals[col] = run - offsets[col]
        cuda.syncthreads()
        if col < cols:
            run = sh[tid]
            for r in range(lo, hi):
                v = table[r, col]
                table[r, col] = run
                run += v
        cuda.syncthreads()  # before the next group overwrites `sh`


@cuda.jit(cache=True)
def _range_first_positions(positions, step, firsts):
    # firsts[r] = how many positions lie before range r (a lower bound per range).
    for r in range(cuda.grid(1), firsts.size, cuda.gridsize(1)):
        firsts[r] = lower_bound(positions, 0, positions.size, r * step)


@cuda.jit(cache=True)
def _range_ranks(base, shift, mask, step, positions, firsts, ranks, hist):
    # Ranks from the range's start for the positions listed in the range, and the
    # range's histogram, in one read of the base (see the module docstring).
    sh = cuda.shared.array(0, int32)
    tid = cuda.threadIdx.x
    tpb = cuda.blockDim.x
    ncls = mask + 1
    counts = sh[:ncls]  # per class: elements of the range before this round
    classes = sh[ncls:ncls + tpb]  # this round's classes
    n = base.size
    for tile in range(cuda.blockIdx.x, hist.shape[0], cuda.gridDim.x):
        for k in range(tid, ncls, tpb):
            counts[k] = 0
        lo = tile * step
        hi = min(n, lo + step)
        j = firsts[tile]
        jend = firsts[tile + 1]
        rnd = lo - lo % tpb
        while rnd < hi:  # the same for every thread of the block: barriers stay matched
            i = rnd + tid
            c = -1
            if i >= lo and i < hi:
                c = (int64(base[i]) >> shift) & mask
            classes[tid] = c
            cuda.syncthreads()
            # The positions of this round are a prefix of those left (they ascend):
            # thread t takes the t-th.
            e = j + tid
            taken = 0
            if e < jend:
                off = positions[e] - rnd
                if off >= 0 and off < tpb:
                    taken = 1
                    k = classes[off]
                    r = int64(-1)  # a position outside the tensor: flagged later
                    if k >= 0:
                        r = int64(counts[k])
                        for q in range(off):
                            if classes[q] == k:
                                r += 1
                    ranks[e] = r
            # Counts the taken ones, and is the barrier between reading `counts` above
            # and adding this round's elements below.
            j += cuda.syncthreads_count(taken)
            if c >= 0:
                cuda.atomic.add(counts, c, 1)
            rnd += tpb
        cuda.syncthreads()
        for k in range(tid, ncls, tpb):
            hist[tile, k] = counts[k]
        cuda.syncthreads()


@cuda.jit(cache=True)
def _globalise_ranks(base, shift, mask, step, positions, starts, ranks, bad_per_block):
    # Adds each position's range start for its class; counts positions that are not
    # strictly ascending inside the tensor (whose ranks mean nothing: the caller refuses).
    sh = cuda.shared.array(0, int64)
    n = base.size
    bad = 0
    for e in range(cuda.grid(1), positions.size, cuda.gridsize(1)):
        p = positions[e]
        if p < 0 or p >= n or (e > 0 and positions[e - 1] >= p):
            bad += 1
        else:
            ranks[e] += starts[p // step, (int64(base[p]) >> shift) & mask]
    total = block_sum(sh, bad)
    if cuda.threadIdx.x == 0:
        bad_per_block[cuda.blockIdx.x] = total


@cuda.jit(device=True)
def _class_segment(class_offsets, k, m):
    # The entries of class k, clamped into the ranks array (offsets are the caller's).
    a = min(max(class_offsets[k], 0), m)
    b = min(max(class_offsets[k + 1], a), m)
    return a, b


@cuda.jit(device=True)
def _nth_from_end(classes, k, back):
    # Index in the round of the element of class k with `back` others of its class
    # after it in the round; -1 if there is none.
    seen = 0
    for off in range(classes.size - 1, -1, -1):
        if classes[off] == k:
            if seen == back:
                return off
            seen += 1
    return -1


@cuda.jit(cache=True)
def _apply_ranges(base, shift, mask, wmask, step, starts, class_offsets, ranks, deltas, out, copy, record, where,
                  applied):
    # record: note each entry's position in `where` instead of writing `out` (ranked_positions).
    sh = cuda.shared.array(0, int32)
    tid = cuda.threadIdx.x
    tpb = cuda.blockDim.x
    ncls = mask + 1
    # Per class: its next listed entry (index from the class's first entry), and that
    # entry's distance: its rank minus the class's count so far (capped at _FAR).
    nxt = sh[:ncls]
    dist = sh[ncls:2 * ncls]
    classes = sh[2 * ncls:2 * ncls + tpb]
    n = base.size
    m = ranks.size
    done = 0
    for tile in range(cuda.blockIdx.x, starts.shape[0], cuda.gridDim.x):
        lo = tile * step
        hi = min(n, lo + step)
        for k in range(tid, ncls, tpb):
            a, b = _class_segment(class_offsets, k, m)
            s = starts[tile, k]
            x = lower_bound(ranks, a, b, s)  # the class's first entry ranked at or past the range
            nxt[k] = x - a
            dist[k] = min(ranks[x] - s, _FAR) if x < b else _FAR
        cuda.syncthreads()
        rnd = lo - lo % tpb
        while rnd < hi:  # the same for every thread of the block: barriers stay matched
            i = rnd + tid
            c = -1
            if i >= lo and i < hi:
                v = base[i]
                c = (int64(v) >> shift) & mask
                cuda.atomic.add(dist, c, -1)
                if copy:
                    out[i] = v
            classes[tid] = c
            cuda.syncthreads()
            # A class gone negative has entries in this round, and so has elements in it:
            # of the threads holding one, the one whose compare-and-swap claims the class
            # places its entries.
            if c >= 0:
                d = dist[c]
                if d < 0 and cuda.atomic.cas(dist, c, d, int32(_CLAIMED)) == d:  # d < 0: never capped, exact
                    a, b = _class_segment(class_offsets, c, m)
                    e = a + nxt[c]
                    s = starts[tile, c]
                    # Ranks below `limit` are due: the class's count up to the end of this round.
                    limit = ranks[e] - d
                    while e < b and ranks[e] < limit:
                        r = ranks[e]
                        # Valid entries ascend strictly within a class; one that does not,
                        # or that lies before the range, is skipped and not counted.
                        if r >= s and (e == a or ranks[e - 1] < r):
                            off = _nth_from_end(classes, c, limit - 1 - r)
                            if off >= 0:
                                pos = rnd + off
                                if record:
                                    where[e] = pos
                                else:
                                    z = int64(deltas[e])
                                    delta = ((z >> 1) & INT64_MAX) ^ -(z & 1)  # un-zigzag
                                    # Wraps modulo 2**width: exact integer arithmetic on bit patterns.
                                    out[pos] = (int64(base[pos]) + delta) & wmask
                                done += 1
                        e += 1
                    nxt[c] = e - a
                    dist[c] = min(ranks[e] - limit, _FAR) if e < b else _FAR
            cuda.syncthreads()  # before the next round overwrites `classes` and counts down `dist`
            rnd += tpb
    if done > 0:
        cuda.atomic.add(applied, cuda.blockIdx.x, done)


def check_class_field(shift: int, mask: int) -> None:
    if not 0 <= shift <= 63:
        raise ValueError(f"class shift must be in [0, 63], got {shift}")
    if not 0 <= mask < _MAX_CLASSES:
        raise ValueError(f"class mask must be in [0, {_MAX_CLASSES - 1}], got {mask}")


def _class_ranges(n: int, ncls: int) -> tuple[int, int]:
    """(rows, step) for a tensor of n elements: see the module docstring."""
    tpb, items, _ = launch_config()
    by_length = -(-n // (tpb * items))
    by_memory = max(1, int(CLASS_TILE_BUDGET) // ncls)
    rows = max(1, min(by_length, by_memory), -(-n // (_FAR - 1)))
    return rows, max(1, -(-n // rows))


def _class_grid(rows: int) -> int:
    _, _, max_blocks = launch_config()
    return min(rows, max_blocks)


def starts_from_histograms(hist, ncls: int, before=None):
    """In place: range histograms -> exclusive scan per class (plus `before`, a device array of
    class counts that precede the first range); returns the class sizes."""
    tpb, _, max_blocks = launch_config()
    sizes = cuda.device_array(ncls, np.int64)
    if before is None:
        before = zeros(ncls, np.int64)
    groups = -(-ncls // min(_SCAN_WIDTH, tpb))
    _scan_columns[min(groups, max_blocks), tpb, 0, tpb * SHARED_ITEM](hist, sizes, before)
    return sizes


def chunk_class_starts(base, shift: int, mask: int):
    """(starts[range, class]: elements of that class before the range, sizes[class]).

    The number of rows fixes how `apply_ranked` cuts the tensor into ranges
    (ceil(n / rows) elements each, as on the CPU backend). Device base in: both
    results stay on the device.
    """
    check_class_field(shift, mask)
    on_device = is_device_array(base)
    hist, sizes = device_class_starts(as_bits(base, signed64=True), shift, mask)
    if on_device:
        return hist, sizes
    return hist.copy_to_host(), sizes.copy_to_host()


def device_class_starts(d_base, shift: int, mask: int, before=None):
    """chunk_class_starts on a device array; `before`: class counts preceding the array (device)."""
    ncls = mask + 1
    tpb, _, _ = launch_config()
    rows, step = _class_ranges(d_base.size, ncls)
    hist = cuda.device_array((rows, ncls), np.int64)
    # Empty ranges (n == 0 included) write rows of zeros.
    _range_histograms[_class_grid(rows), tpb, 0, ncls * 4](d_base, shift, mask, step, hist)
    return hist, starts_from_histograms(hist, ncls, before)


def class_ranks(base, shift: int, mask: int, positions):
    """Per changed position: its rank within its class (the base elements of its class before
    it). Also returns class sizes. Positions must be strictly ascending and inside the tensor
    (ValueError otherwise). Device base in: both results stay on the device.
    """
    check_class_field(shift, mask)
    on_device = is_device_array(base)
    d_base = as_bits(base, signed64=True)
    d_pos = as_indices(positions)
    n, m, ncls = d_base.size, d_pos.size, mask + 1
    tpb, _, max_blocks = launch_config()
    rows, step = _class_ranges(n, ncls)
    grid = _class_grid(rows)
    firsts = cuda.device_array(rows + 1, np.int64)
    _range_first_positions[min(-(-(rows + 1) // tpb), max_blocks), tpb](d_pos, step, firsts)
    ranks = cuda.device_array(m, np.int64)
    hist = cuda.device_array((rows, ncls), np.int64)
    _range_ranks[grid, tpb, 0, (ncls + tpb) * 4](d_base, shift, mask, step, d_pos, firsts, ranks, hist)
    sizes = starts_from_histograms(hist, ncls)
    if m:
        fix_grid = min(-(-m // tpb), max_blocks)
        bad = cuda.device_array(fix_grid, np.int64)
        _globalise_ranks[fix_grid, tpb, 0, tpb * SHARED_ITEM](d_base, shift, mask, step, d_pos, hist, ranks, bad)
        n_bad = int(bad.copy_to_host().sum())
        if n_bad:
            raise ValueError(f"class_ranks needs strictly ascending positions inside the tensor; "
                             f"{n_bad} of {m} are not")
    if on_device:
        return ranks, sizes
    return ranks.copy_to_host(), sizes.copy_to_host()


def walk_tables(n: int, mask: int, starts, class_offsets, ranks):
    """apply_ranked's and ranked_positions' tables on the device, checked: (starts, step, offsets, ranks)."""
    ncls = mask + 1
    d_starts = as_table(starts, ncls, "starts")
    rows = d_starts.shape[0]
    if rows < 1:
        raise ValueError("starts has no rows")
    step = -(-n // rows)
    if step >= _FAR:
        raise ValueError(f"ranges of {step} elements are too long for the CUDA kernels (at most {_FAR - 1}); "
                         "use this backend's chunk_class_starts")
    d_offsets = as_indices(class_offsets)
    if d_offsets.size != ncls + 1:
        raise ValueError(f"class_offsets has {d_offsets.size} entries, the class mask needs {ncls + 1}")
    d_ranks = as_indices(ranks)
    if d_ranks.size >= 1 << 31:
        raise ValueError("more than 2**31 - 1 entries: per-class indices are int32 in shared memory")
    return d_starts, step, d_offsets, d_ranks


def walk_ranges(d_base, shift, mask, wmask, step, d_starts, d_offsets, d_ranks, d_deltas, d_out, copy, where):
    """Launch the ranked walk; returns the number of entries placed."""
    tpb, _, _ = launch_config()
    grid = _class_grid(d_starts.shape[0])
    applied = zeros(grid, np.int64)
    record = where is not None
    if where is None:
        where = d_offsets  # not written when not recording
    _apply_ranges[grid, tpb, 0, (2 * (mask + 1) + tpb) * 4](d_base, shift, mask, wmask, step, d_starts, d_offsets,
                                                           d_ranks, d_deltas, d_out, copy, record, where, applied)
    return int(applied.copy_to_host().sum())


def apply_ranked(base, shift: int, mask: int, starts, class_offsets, ranks, deltas, out) -> int:
    """Write base + deltas into `out` (every element: `out` need not be initialised, or may be
    `base` itself); returns how many (class, rank) entries were applied.

    `starts` is either backend's `chunk_class_starts` of this base: its rows say how
    the tensor is cut into ranges. Entries are grouped by class (`class_offsets`,
    mask + 2 ascending offsets into `ranks` and `deltas`), ranks ascending within a
    class; deltas are zigzag-coded bit-pattern differences. An entry whose rank is
    outside its class, or not above the previous entry's, is not applied and not
    counted. A device `out` is written on the device.
    """
    check_class_field(shift, mask)
    out_on_device = is_device_array(out)
    base, out = as_arg(base), as_arg(out)
    n = base.size
    if out.size != n:
        raise ValueError(f"out has {out.size} elements, base {n}")
    if n == 0:
        return 0
    width = np.dtype(base.dtype).itemsize
    if np.dtype(out.dtype).itemsize != width:
        raise ValueError(f"out has {np.dtype(out.dtype).itemsize}-byte elements, base {width}-byte ones")
    d_starts, step, d_offsets, d_ranks = walk_tables(n, mask, starts, class_offsets, ranks)
    d_deltas = zigzag_deltas(deltas)
    if d_deltas.size != d_ranks.size:
        raise ValueError(f"{d_deltas.size} deltas for {d_ranks.size} ranks")

    in_place = address_of(out) == address_of(base)
    d_base = as_bits(base, signed64=True)
    if in_place:  # one buffer on the device too; a host one is copied back below
        d_out = d_base
    else:
        d_out = as_bits(out, signed64=True) if out_on_device else cuda.device_array(n, d_base.dtype)
    applied = walk_ranges(d_base, shift, mask, width_mask(width), step, d_starts, d_offsets, d_ranks, d_deltas, d_out,
                    not in_place, None)
    if not out_on_device:
        if out.flags.c_contiguous:
            d_out.copy_to_host(host_bits(out, signed64=True))
        else:
            out[...] = d_out.copy_to_host().view(out.dtype).reshape(out.shape)
    return applied


def ranked_positions(base, shift: int, mask: int, starts, class_offsets, ranks):
    """Where each (class, rank) entry lies in `base`: int64 positions in entry order (-1 for
    an entry apply_ranked would not apply), and how many were found. Device base in: the
    positions stay on the device."""
    check_class_field(shift, mask)
    on_device = is_device_array(base)
    d_base = as_bits(base, signed64=True)
    n = d_base.size
    d_starts, step, d_offsets, d_ranks = walk_tables(max(n, 1), mask, starts, class_offsets, ranks)
    where = cuda.to_device(np.full(d_ranks.size, -1, np.int64))
    found = 0
    if n and d_ranks.size:
        found = walk_ranges(d_base, shift, mask, 0, step, d_starts, d_offsets, d_ranks, d_ranks, d_base, False, where)
    return (where if on_device else where.copy_to_host()), found


def side_by_side() -> int:
    """0: apply rebuilds tensors one at a time, each spread over the device."""
    return 0


def resident(*arrays):
    """The arrays on the device (host ones uploaded once), for kernels called on them again and
    again: a tensor's decoded entries, used by every window of it."""
    out = []
    for a in arrays:
        if is_device_array(a):
            out.append(device_view(a))
        else:
            h = np.ascontiguousarray(a).reshape(-1)
            out.append(cuda.to_device(h.view(np.int64) if h.dtype == np.uint64 else h))
    return tuple(out)


def ranked_window(part, shift: int, mask: int, seen, class_offsets, ranks, deltas, out) -> int:
    """apply_ranked on one window of a tensor read from a file: `part` (host) holds the window's
    base elements, `seen` (host int64, updated in place) the class counts of the windows before
    it; the rebuilt window goes to `out` (host). Returns the entries applied in this window.

    The window crosses the bus once each way, through pinned buffers; its class counts, the
    scan that offsets them by `seen`, and the ranked walk (in place on the device copy) run on
    the device; entries made `resident` stay there for every window of the tensor.
    """
    check_class_field(shift, mask)
    h_part = host_bits(part, signed64=True)
    n = h_part.size
    if n == 0:
        return 0
    pinned = buffers.get("pinned", "window", n, h_part.dtype)
    pinned[:] = h_part
    d = buffers.get("device", "window", n, h_part.dtype)
    d.copy_to_device(pinned)
    hist, sizes = device_class_starts(d, shift, mask, cuda.to_device(np.ascontiguousarray(seen, np.int64)))
    d_starts, step, d_offsets, d_ranks = walk_tables(n, mask, hist, class_offsets, ranks)
    applied = walk_ranges(d, shift, mask, width_mask(h_part.dtype.itemsize), step, d_starts, d_offsets, d_ranks,
                    zigzag_deltas(deltas), d, False, None)
    d.copy_to_host(pinned)
    host_bits(out, signed64=True)[:] = pinned
    seen += sizes.copy_to_host()
    return applied
