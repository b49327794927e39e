"""Rank to position by tiles (a device base's locate, the live apply's), the class sort path
beside it, and make's ranks on the device (diff_ranks)."""

from __future__ import annotations

import numpy as np
from numba import cuda, int32, int64, uint16

from pulsediff.kernels.cuda.common import (SHARED_ITEM, UNSIGNED, as_arg, as_bits, as_cuda_array, as_indices, block_sum,
                                           device_view, fill_int64, is_device_array, launch_config, lower_bound,
                                           width_mask, zeros)
from pulsediff.kernels.cuda.compact import diff_compact
from pulsediff.kernels.cuda.ranks import (check_class_field, chunk_class_starts, class_ranks, ranked_positions,
                                          starts_from_histograms)


# --- rank to position by tiles: locate_ranked on a device base ------------------------------
#
# The live apply's rank-to-position map (issue 35's GPU path), written to its byte budget: the base
# read twice (2 x 2 B per BF16 element), nothing sorted, no atomics on the hot classes, and a fixed
# number of barriers per tile of TILE elements, against ~31 B per element for the class sort
# (class_sort.py) and two barriers per 256 elements for the round walk above. Only the classes that
# have entries ("listed", at most TILE_LISTED of them; BF16 steps list ~20-40) are counted per thread:
#
#   tile_listed_counts  thread t counts its TILE_ITEMS consecutive elements into its own column of
#       a shared (class, thread) table of uint16 (no atomics: a column is one thread's), the
#       unlisted classes into a shared histogram (rare classes: few atomics) added to their sizes in
#       global memory; then each warp sums rows of the table, its lanes reading adjacent columns
#       (conflict-free), into counts[tile, listed class].
#   _scan_columns        (above) turns counts into each tile's first rank per listed class, and
#       gives the listed classes' sizes.
#   tile_entry_bounds   per (tile, listed class), the first entry whose rank is at or past the
#       tile's first rank (a binary search in the class's ranks): a tile's entries of a class are
#       [bound[tile], bound[tile + 1]).
#   tile_locate         counts again, scans each row of the table into the threads' first ranks
#       (warp-cooperative: lanes take runs of 8 columns, one lane scans the 32 run totals), then
#       each thread walks its elements: an element of listed class l has rank first + running
#       count, and a binary search among the tile's entries of l says whether it is listed.
#
# Byte budget (BF16, n elements, m entries, L listed classes): base 4n; tables 24 L per tile
# (4096 elements: ~0.2 B per element at L = 30); entries read from L1/L2 by the searches; where
# written 8m. Shared memory (dynamic): 512 B per listed class + 2 KiB, one tile per 256-thread block.

TILE_THREADS = 256
TILE_ITEMS = 16
TILE = TILE_THREADS * TILE_ITEMS
TILE_LISTED = 64  # listed classes a tile kernel counts; a section with more takes the other paths
_WARPS = TILE_THREADS // 32
UNLISTED = 255


@cuda.jit(device=True, inline=True)
def class_slot(bits, i, shift, mask, lut):
    # Element i's class and its row in the tile's table (UNLISTED: a class the patch does not list).
    k = (int64(bits[i]) >> shift) & mask
    return k, int64(lut[k])


@cuda.jit(device=True, inline=True)
def count_items(bits, shift, mask, lut, first, t, table, words, hist_at, count_unlisted):
    # Thread t's TILE_ITEMS consecutive elements from `first` into its column of `table` (row slot:
    # table[slot * TILE_THREADS + t]); unlisted classes, if counted, into words[hist_at + class]. A
    # warp's loads cover 512 consecutive elements, each 32-byte sector fetched once, then read from L1.
    n = bits.size
    for j in range(TILE_ITEMS):
        i = first + j
        if i < n:
            k, slot = class_slot(bits, i, shift, mask, lut)
            if slot != UNLISTED:
                table[slot * TILE_THREADS + t] += 1
            elif count_unlisted:
                cuda.atomic.add(words, hist_at + k, 1)


def tile_shared_layout(nlisted: int) -> tuple[int, int]:
    """(dynamic shared bytes, int32 index of the words after the table) for a tile kernel: the
    (listed class, thread) table of uint16, then TILE_THREADS int32 of histogram and 256 of run sums.
    Dynamic shared memory only: every thread of a block sees one buffer, also under the simulator
    (whose static shared arrays are made per thread when threads race to create them)."""
    at = -(-nlisted * TILE_THREADS * 2 // 4)
    return (at + TILE_THREADS + _WARPS * 32) * 4, at


@cuda.jit(cache=True)
def tile_listed_counts(bits, shift, mask, lut, nlisted, at, counts, unlisted):
    table = cuda.shared.array(0, uint16)
    words = cuda.shared.array(0, int32)  # the same buffer: [at, at + 256) histogram, then run sums
    t = cuda.threadIdx.x
    warp = t // 32
    lane = t % 32
    hist_at = at
    part_at = at + TILE_THREADS
    tiles = counts.shape[0]
    for tile in range(cuda.blockIdx.x, tiles, cuda.gridDim.x):
        for slot in range(nlisted):
            table[slot * TILE_THREADS + t] = 0
        words[hist_at + t] = 0
        cuda.syncthreads()
        count_items(bits, shift, mask, lut, tile * TILE + t * TILE_ITEMS, t, table, words, hist_at, True)
        cuda.syncthreads()
        if words[hist_at + t] != 0:
            cuda.atomic.add(unlisted, t, int64(words[hist_at + t]))
        for r in range((nlisted + _WARPS - 1) // _WARPS):
            slot = r * _WARPS + warp
            total = int32(0)
            if slot < nlisted:
                for u in range(lane, TILE_THREADS, 32):  # adjacent columns: conflict-free
                    total += table[slot * TILE_THREADS + u]
            words[part_at + warp * 32 + lane] = total
            cuda.syncthreads()
            if lane == 0 and slot < nlisted:
                total = int32(0)
                for q in range(32):
                    total += words[part_at + warp * 32 + q]
                counts[tile, slot] = total
            cuda.syncthreads()


@cuda.jit(cache=True)
def tile_entry_bounds(firsts, class_lo, class_hi, ranks, bounds):
    # bounds[tile, slot]: the first entry of listed class `slot` whose rank is >= firsts[tile, slot];
    # bounds[tiles, slot] = the class's end. Entries are class-major: class_lo/hi[slot] delimit them.
    tiles = firsts.shape[0]
    nlisted = firsts.shape[1]
    for q in range(cuda.grid(1), (tiles + 1) * nlisted, cuda.gridsize(1)):
        tile = q // nlisted
        slot = q % nlisted
        if tile == tiles:
            bounds[tile, slot] = class_hi[slot]
        else:
            bounds[tile, slot] = lower_bound(ranks, class_lo[slot], class_hi[slot], firsts[tile, slot])


@cuda.jit(cache=True)
def tile_locate(bits, shift, mask, lut, nlisted, at, firsts, bounds, ranks, where):
    table = cuda.shared.array(0, uint16)
    words = cuda.shared.array(0, int32)  # the same buffer: run sums at [at + 256, at + 512)
    t = cuda.threadIdx.x
    warp = t // 32
    lane = t % 32
    part_at = at + TILE_THREADS
    n = bits.size
    tiles = firsts.shape[0]
    for tile in range(cuda.blockIdx.x, tiles, cuda.gridDim.x):
        for slot in range(nlisted):
            table[slot * TILE_THREADS + t] = 0
        cuda.syncthreads()
        first = tile * TILE + t * TILE_ITEMS
        count_items(bits, shift, mask, lut, first, t, table, words, at, False)
        cuda.syncthreads()
        # Each row to exclusive prefixes over the threads (position order): lane i takes columns
        # [8i, 8i + 8) (4-way bank conflicts), lane 0 scans the 32 run totals. At most 4096 < 2**16.
        for r in range((nlisted + _WARPS - 1) // _WARPS):
            slot = r * _WARPS + warp
            run = int32(0)
            if slot < nlisted:
                for u in range(lane * 8, lane * 8 + 8):
                    v = int32(table[slot * TILE_THREADS + u])
                    table[slot * TILE_THREADS + u] = run
                    run += v
            words[part_at + warp * 32 + lane] = run
            cuda.syncthreads()
            if lane == 0:
                acc = int32(0)
                for q in range(32):
                    v = words[part_at + warp * 32 + q]
                    words[part_at + warp * 32 + q] = acc
                    acc += v
            cuda.syncthreads()
            if slot < nlisted:
                add = words[part_at + warp * 32 + lane]
                for u in range(lane * 8, lane * 8 + 8):
                    table[slot * TILE_THREADS + u] += add
            cuda.syncthreads()
        for j in range(TILE_ITEMS):
            i = first + j
            if i < n:
                slot = class_slot(bits, i, shift, mask, lut)[1]
                if slot != UNLISTED:
                    before = table[slot * TILE_THREADS + t]
                    table[slot * TILE_THREADS + t] = before + 1
                    rank = firsts[tile, slot] + before
                    lo = bounds[tile, slot]
                    hi = bounds[tile + 1, slot]
                    p = lower_bound(ranks, lo, hi, rank)
                    if p < hi and ranks[p] == rank:
                        where[p] = i
        cuda.syncthreads()  # the table is read out before the next tile clears it


@cuda.jit(cache=True)
def settle_found(ranks, class_lo, where, found):
    # An entry whose rank is not above the previous entry's of its class (a damaged patch) is not
    # found, as on the other paths, so that a count of every entry means every rank rose; the found
    # ones are counted per thread, summed in the block, and added with one atomic per block.
    sh = cuda.shared.array(0, int64)
    count = int64(0)
    for p in range(cuda.grid(1), ranks.size, cuda.gridsize(1)):
        stalled = False
        if p > 0 and ranks[p] <= ranks[p - 1]:
            c = lower_bound(class_lo, 0, class_lo.size, p)
            stalled = c == class_lo.size or class_lo[c] != p  # not its class's first entry
        if stalled:
            where[p] = -1
        elif where[p] >= 0:
            count += 1
    block = block_sum(sh, count)
    if cuda.threadIdx.x == 0:
        cuda.atomic.add(found, 0, block)


def scan_tile_counts(counts, nlisted: int):
    """In place: counts[tile, slot] -> the listed class's elements before the tile; returns the
    listed classes' sizes, left on the device (no synchronisation). torch's cumsum (CUB's scan) on
    a real GPU: the column scan kernel above takes 8 columns per block, too few blocks for a table
    of every tile's counts. The scan runs along the innermost dimension of the transposed table:
    torch scans an outer dimension with one thread per column walking every row (a few dozen
    threads for the whole table), the innermost one with a block per row (issue 45). Bytes: the
    table read and written twice more by the transposes, 16 bytes per tile and class."""
    if sort_on_gpu(counts):
        return as_cuda_array(exclusive_scan_tiles(torch_of(counts).view(counts.shape)), sync=False)
    return starts_from_histograms(counts, nlisted)


def count_tiles(d_base, shift: int, mask: int, d_lut, nlisted: int, counts, unlisted):
    """Launches, no synchronisation: each tile's counts of the `nlisted` listed classes into
    `counts` (then scanned: each tile's first rank per listed class), the unlisted classes'
    sizes added into `unlisted`. Returns the listed classes' sizes on the device."""
    _, _, max_blocks = launch_config()
    shared, at = tile_shared_layout(nlisted)
    tile_listed_counts[min(counts.shape[0], max_blocks), TILE_THREADS, 0, shared](
        d_base, shift, mask, d_lut, nlisted, at, counts, unlisted)
    return scan_tile_counts(counts, counts.shape[1])


def locate_in_tiles(d_base, shift: int, mask: int, d_lut, nlisted: int, counts, bounds, d_lo, d_hi, d_ranks,
                    where, found) -> None:
    """Launches, no synchronisation, after count_tiles: each tile's entry bounds into `bounds`,
    the entries' positions into `where` (filled with -1 beforehand), and the settle of entries
    whose ranks do not rise; the entries found are added into found[0]."""
    tpb, _, max_blocks = launch_config()
    tiles = counts.shape[0]
    shared, at = tile_shared_layout(nlisted)
    m = d_ranks.size
    tile_entry_bounds[min(-(-(tiles + 1) * nlisted // tpb), max_blocks), tpb](counts, d_lo, d_hi, d_ranks, bounds)
    tile_locate[min(tiles, max_blocks), TILE_THREADS, 0, shared](d_base, shift, mask, d_lut, nlisted, at, counts,
                                                                  bounds, d_ranks, where)
    settle_found[min(-(-m // tpb), max_blocks), tpb, 0, tpb * SHARED_ITEM](d_ranks, d_lo, where, found)


def exclusive_scan_tiles(table):
    """In place on a torch (tile, slot) table of counts: each entry becomes the sum of its column
    above it; returns the column totals. The scan runs along the innermost dimension of the
    transposed table (see scan_tile_counts)."""
    import torch

    # (slot, tile): each class's tiles innermost; a copy always (contiguous() of a transpose with a
    # dimension of 1 is the table itself, which the copy_ below would overwrite while read)
    by_class = table.t().clone(memory_format=torch.contiguous_format)
    table.copy_((by_class.cumsum(1) - by_class).t())
    return by_class.sum(1)


def tile_locate_ranked(base, shift: int, mask: int, class_offsets, ranks):
    """locate_ranked by tiles (the kernels above) on a base in device memory: (where on the
    device, found, sizes on the host: every class's, as the other paths give them), or None where the section lists more than TILE_LISTED classes or the class
    field is wider than a byte (the caller takes another path)."""
    from pulsediff.kernels.class_sort import check_offsets

    check_class_field(shift, mask)
    ncls = mask + 1
    if ncls > 256:
        return None
    d_base = as_bits(base, signed64=True)
    d_ranks = as_indices(ranks)
    m = d_ranks.size
    offsets = check_offsets(device_view(class_offsets).copy_to_host() if is_device_array(class_offsets)
                            else class_offsets, ncls, m)
    listed = np.flatnonzero(np.diff(offsets) > 0)
    if listed.size > TILE_LISTED:
        return None
    n = d_base.size
    tpb, _, max_blocks = launch_config()
    where = cuda.device_array(m, np.int64)  # filled on the device: nothing of size m crosses the bus
    if m:
        fill_int64[min(-(-m // tpb), max_blocks), tpb](where, -1)
    sizes = np.zeros(ncls, np.int64)
    if n == 0:
        return where, 0, sizes
    lut = np.full(ncls, UNLISTED, np.uint8)
    lut[listed] = np.arange(listed.size)
    d_lut = cuda.to_device(lut)
    tiles = -(-n // TILE)
    nlisted = max(1, listed.size)  # a section with no entries still counts its (unlisted) sizes
    # Every cell is written where a class is listed (no copy of zeros over the bus); else one column of zeros.
    counts = cuda.device_array((tiles, nlisted), np.int64) if listed.size else zeros((tiles, 1), np.int64)
    unlisted = zeros(ncls, np.int64)
    listed_sizes = count_tiles(d_base, shift, mask, d_lut, listed.size, counts, unlisted).copy_to_host()
    sizes = unlisted.copy_to_host()
    sizes[listed] = listed_sizes[:listed.size]
    if not m:
        return where, 0, sizes
    bounds = cuda.device_array((tiles + 1, nlisted), np.int64)
    d_lo = cuda.to_device(np.ascontiguousarray(offsets[listed], np.int64))
    d_hi = cuda.to_device(np.ascontiguousarray(offsets[listed + 1], np.int64))
    found = zeros(1, np.int64)
    locate_in_tiles(d_base, shift, mask, d_lut, listed.size, counts, bounds, d_lo, d_hi, d_ranks, where, found)
    return where, int(found.copy_to_host()[0]), sizes


def sort_on_gpu(*arrays) -> bool:
    """Whether the class-sort path (kernels.class_sort, torch on the GPU) takes these arrays:
    a real GPU (not the simulator, whose device memory torch cannot see), a CUDA build of
    torch, and the main array already on the device."""
    from numba import config

    if config.ENABLE_CUDASIM or not is_device_array(arrays[0]):
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def torch_of(a):
    """A device array (or exporter) as a torch CUDA tensor over the same memory, as signed
    integers of its width (torch's unsigned types support few operations)."""
    import torch

    d = device_view(a)
    signed = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[np.dtype(d.dtype).itemsize]
    return torch.as_tensor(d.view(signed), device="cuda")


def locate_ranked(base, shift: int, mask: int, class_offsets, ranks):
    """The entries' positions in `base` (-1: not found), how many were found, and the base's
    class sizes. For a base in device memory, by tiles (`tile_locate_ranked`: two reads of the
    base, nothing sorted); where a section lists more classes than a tile counts, on a real GPU
    by a stable sort of the class keys (kernels.class_sort: CUB's radix sort through torch, one
    digit pass for BF16); otherwise by `chunk_class_starts` and the rank walk of
    `ranked_positions`. Positions stay on the device when the base is there; sizes come back to
    the host (a few KiB)."""
    check_class_field(shift, mask)
    if is_device_array(base):
        tiled = tile_locate_ranked(base, shift, mask, class_offsets, ranks)
        if tiled is not None:
            return tiled
    if sort_on_gpu(base):
        from pulsediff.kernels import class_sort

        ranks_t = torch_of(ranks) if is_device_array(ranks) else ranks
        offsets = device_view(class_offsets).copy_to_host() if is_device_array(class_offsets) else class_offsets
        where, found, sizes = class_sort.locate_ranked(torch_of(base), shift, mask, offsets, ranks_t,
                                                       keys_of=torch_class_keys)
        return as_cuda_array(where), found, sizes.cpu().numpy()
    starts, sizes = chunk_class_starts(base, shift, mask)
    where, found = ranked_positions(base, shift, mask, starts, class_offsets, ranks)
    return where, found, sizes.copy_to_host() if hasattr(sizes, "copy_to_host") else sizes


@cuda.jit(cache=True)
def _class_keys(bits, shift, mask, keys):
    # Element i to thread i of a round: a warp reads 32 consecutive elements and writes 32
    # consecutive keys. Signed 8-byte views (signed64) make the shift arithmetic, as defined.
    for i in range(cuda.grid(1), bits.size, cuda.gridsize(1)):
        keys[i] = (int64(bits[i]) >> shift) & mask


def torch_class_keys(bits, shift: int, mask: int):
    """kernels.class_sort's keys of a torch CUDA tensor by the fused kernel, launched on torch's
    current stream (so after the work that made `bits`, with no host synchronisation)."""
    import torch

    keys = torch.empty(bits.numel(), dtype=torch.uint8 if mask <= 255 else torch.int16, device=bits.device)
    handle = torch.cuda.current_stream(bits.device).cuda_stream
    class_keys(bits, shift, mask, keys, cuda.external_stream(handle) if handle else cuda.default_stream())
    return keys


def class_keys(bits, shift: int, mask: int, keys, stream=0) -> None:
    """keys[i] = (int64(bits[i]) >> shift) & mask, written into `keys` (uint8 or int16, as many
    as bits): kernels.class_sort's sort keys in one fused kernel. Byte budget per element: the
    element read once (2 B for BF16), its key written once (1 B), where torch's shift, mask and
    narrowing read and write 11 B. Device arrays (torch CUDA tensors) are used in place; with a
    `stream` (the caller's, e.g. torch's current stream through cuda.external_stream) the
    kernel is ordered after that stream's work without a host synchronisation. Host arrays are
    copied in and out. Launch: THREADS_PER_BLOCK threads, up to MAX_BLOCKS blocks, grid-stride."""
    check_class_field(shift, mask)
    sync = stream == 0
    d = device_view(bits, sync) if is_device_array(bits) else bits
    d = as_bits(d, signed64=True)
    k = device_view(keys, sync) if is_device_array(keys) else cuda.to_device(np.ascontiguousarray(keys))
    if k.size != d.size:
        raise ValueError("class_keys needs as many keys as elements")
    if mask >= 1 << (8 * np.dtype(k.dtype).itemsize - (np.dtype(k.dtype).kind == "i")):
        raise ValueError("class_keys: the mask does not fit the keys' type")
    if d.size:
        tpb, _, max_blocks = launch_config()
        _class_keys[min(-(-d.size // tpb), max_blocks), tpb, stream](d, shift, mask, k)
    if not is_device_array(keys):
        keys[...] = k.copy_to_host().reshape(keys.shape)


@cuda.jit(cache=True)
def _zigzag_and_classes(old, positions, values, shift, mask, wmask, half, zigzag, classes):
    # Per changed element: new - old modulo 2**width as a signed value, zigzag-coded
    # (0, -1, 1, -2 -> 0, 1, 2, 3), and the base class. All in int64: 8-byte
    # elements come as int64 views (half 0: already signed), narrower ones
    # zero-extended and sign-extended here from bit width - 1.
    for e in range(cuda.grid(1), positions.size, cuda.gridsize(1)):
        p = positions[e]
        a = int64(old[p])
        d = (int64(values[e]) - a) & wmask
        if half > 0 and d >= half:
            d -= 2 * half
        zigzag[e] = ((d << 1) ^ (d >> 63)) & wmask
        classes[e] = (a >> shift) & mask


def diff_ranks(old, new, shift: int, mask: int):
    """For each element whose bits differ (in position order): the zigzag-coded difference
    new - old (old's bits dtype), its base class (uint16) and its rank within that class
    (int64); and the class sizes.

    Not fused on the device yet: `diff_compact`, then `class_ranks` on its positions, then
    one gather of the changed elements (the base is read three times, the target twice,
    where the CPU backend reads the pair once). Device arrays in: results on the device.
    """
    check_class_field(shift, mask)
    on_device = is_device_array(old) or is_device_array(new)
    if sort_on_gpu(old) and is_device_array(new):
        return _diff_ranks_sorted(old, new, shift, mask)
    o, nw = as_arg(old), as_arg(new)
    if o.size != nw.size or np.dtype(o.dtype).itemsize != np.dtype(nw.dtype).itemsize:
        raise ValueError("diff_ranks needs arrays of equal length and element width")
    width = np.dtype(o.dtype).itemsize
    d_old = as_bits(o, signed64=True)
    d_new = as_bits(nw, signed64=True)
    positions, values = diff_compact(d_old, d_new)
    ranks, sizes = class_ranks(d_old, shift, mask, positions)
    m = positions.size
    zigzag = cuda.device_array(m, d_old.dtype)
    classes = cuda.device_array(m, np.uint16)
    if m:
        tpb, _, max_blocks = launch_config()
        wmask = width_mask(width)
        half = 0 if width == 8 else 1 << (8 * width - 1)
        if width == 8:
            values = values.view(np.int64)  # the kernel works in int64: same bits
        _zigzag_and_classes[min(-(-m // tpb), max_blocks), tpb](d_old, positions, values, shift, mask, wmask, half,
                                                                zigzag, classes)
    zigzag = zigzag.view(UNSIGNED[width]) if width == 8 else zigzag
    if on_device:
        return zigzag, classes, ranks, sizes
    return zigzag.copy_to_host(), classes.copy_to_host(), ranks.copy_to_host(), sizes.copy_to_host()


def _diff_ranks_sorted(old, new, shift: int, mask: int):
    """diff_ranks for two tensors in GPU memory, by kernels.class_sort (one compare, one sort of
    the base's class keys per window); results on the device, in diff_ranks' dtypes."""
    import torch

    from pulsediff.kernels import class_sort

    o = torch_of(old)
    zigzag, classes, ranks, sizes = class_sort.diff_ranks(o, torch_of(new), shift, mask, keys_of=torch_class_keys)
    signed = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[o.element_size()]
    zz = as_cuda_array(zigzag.to(signed)).view(UNSIGNED[o.element_size()])
    cls = as_cuda_array(classes.to(torch.int16)).view(np.uint16)
    return zz, cls, as_cuda_array(ranks), as_cuda_array(sizes)
