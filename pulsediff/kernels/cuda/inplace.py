"""Patching live tensors in place: word sums, add_at with its undo log, and the whole tensor's
locate, add and sums with one host synchronisation (locate_add_summed)."""

from __future__ import annotations

import numpy as np
from numba import cuda, int64, uint64

from pulsediff.kernels.cpu import WORD_SUM_M1, WORD_SUM_M2, WORD_SUM_PHI
from pulsediff.kernels.cuda.common import (INT64_MAX, SHARED_ITEM, UNSIGNED, address_of, as_arg, as_bits, as_indices,
                                           bits_dtype, block_sum, buffers, copy_into, device_view, fill_int64,
                                           host_bits, is_device_array, launch_config, width_mask, zigzag_deltas)
from pulsediff.kernels.cuda.ranks import check_class_field
from pulsediff.kernels.cuda.tiles import TILE, TILE_LISTED, UNLISTED, count_tiles, locate_in_tiles, locate_ranked


_PHI = np.uint64(WORD_SUM_PHI)
_M1 = np.uint64(WORD_SUM_M1)
_M2 = np.uint64(WORD_SUM_M2)
_S33 = np.uint64(33)


@cuda.jit(cache=True)
def _word_sums(elems, per_word, width_bits, nwords, partial):
    # Word j is elements [j * per_word, (j + 1) * per_word), little-endian, zeros past the
    # end: adjacent threads read adjacent 8 bytes (coalesced), and the tail needs no copy.
    sh = cuda.shared.array(0, uint64)
    n = elems.size
    total = uint64(0)
    for j in range(cuda.grid(1), nwords, cuda.gridsize(1)):
        w = uint64(0)
        first = j * per_word
        for t in range(per_word):
            if first + t < n:
                w |= uint64(elems[first + t]) << uint64(width_bits * t)
        x = w ^ (uint64(j + 1) * _PHI)
        x ^= x >> _S33
        x *= _M1
        x ^= x >> _S33
        x *= _M2
        x ^= x >> _S33
        total += x
    block = block_sum(sh, total)
    if cuda.threadIdx.x == 0:
        partial[cuda.blockIdx.x] = block


def word_sum(data) -> int:
    """FORMAT.md §3.1's sum64 of the array's bytes, as an int in [0, 2**64): one read of
    the array on the device, a sum per block, the block sums added on the host.

    Byte budget: the array's bytes read once, 8 bytes per block written. An array that starts
    on an 8-byte boundary (every allocation does) is read as whole uint64 words, one coalesced
    8-byte load per word; the element-wise kernel (per_word loads and shifts a word) is left
    for views that start elsewhere. Launch: MAX_BLOCKS blocks of THREADS_PER_BLOCK, grid-stride."""
    d = as_bits(as_arg(data))
    width = np.dtype(d.dtype).itemsize
    per_word = 8 // width
    nwords = -(-d.size // per_word)
    if nwords == 0:
        return 0
    full = d.size // per_word
    if width < 8 and full and address_of(d)[1] % 8 == 0:
        # Whole words read as what they are, one 8-byte load per word and thread (a 2-byte
        # element type would take four loads and shifts per word); the zero-padded last word,
        # if any, is summed on the host from its few bytes.
        total = word_sum(d[:full * per_word].view(np.uint64))
        if full < nwords:
            from pulsediff.kernels.cpu import word_term

            total += word_term(d[full * per_word:].copy_to_host().view(np.uint8), full)
        return total & 0xFFFFFFFFFFFFFFFF
    tpb, _, max_blocks = launch_config()
    grid = min(-(-nwords // tpb), max_blocks)
    partial = cuda.device_array(grid, np.uint64)
    _word_sums[grid, tpb, 0, tpb * SHARED_ITEM](d, per_word, 8 * width, nwords, partial)
    return int(partial.copy_to_host().sum(dtype=np.uint64))


@cuda.jit(cache=True)
def _add_at(out, positions, deltas, wmask, old, bad_per_block):
    sh = cuda.shared.array(0, int64)
    n = out.size
    bad = 0
    for e in range(cuda.grid(1), positions.size, cuda.gridsize(1)):
        p = positions[e]
        if p >= 0 and p < n:  # a hostile patch must not write past the tensor
            v = out[p]
            old[e] = v
            z = int64(deltas[e])
            delta = ((z >> 1) & INT64_MAX) ^ -(z & 1)  # un-zigzag
            out[p] = (int64(v) + delta) & wmask  # wraps modulo 2**width
        else:
            bad += 1
    total = block_sum(sh, bad)
    if cuda.threadIdx.x == 0:
        bad_per_block[cuda.blockIdx.x] = total


def add_at(out, positions, deltas):
    """out[positions] += un-zigzagged deltas (mod 2**width), in place; returns the old values
    (for an undo log; on the device when `out` is) and how many positions were out of
    range (skipped, their old value 0). Positions must be distinct."""
    out_on_device = is_device_array(out)
    out, positions, deltas = as_arg(out), as_arg(positions), as_arg(deltas)
    if positions.size != deltas.size:
        raise ValueError(f"{deltas.size} deltas for {positions.size} positions")
    width = np.dtype(out.dtype).itemsize
    m = positions.size
    if out_on_device:
        d_out = as_bits(out, signed64=True)
    else:
        if not out.flags.c_contiguous:
            raise ValueError("a host `out` must be C-contiguous")
        flat = out.reshape(-1)
        d_out = cuda.to_device(host_bits(flat, signed64=True))
    old = cuda.to_device(np.zeros(m, d_out.dtype))
    bad = 0
    if m:
        tpb, _, max_blocks = launch_config()
        grid = min(-(-m // tpb), max_blocks)
        d_bad = cuda.device_array(grid, np.int64)
        _add_at[grid, tpb, 0, tpb * SHARED_ITEM](d_out, as_indices(positions), zigzag_deltas(deltas),
                                                  width_mask(width), old, d_bad)
        bad = int(d_bad.copy_to_host().sum())
    unsigned = old.view(UNSIGNED[width]) if width == 8 else old
    if out_on_device:
        return unsigned, bad
    d_out.copy_to_host(host_bits(flat, signed64=True))
    return unsigned.copy_to_host(), bad


def located_buffers(count: int, dtype):
    """`where` (int64, every entry -1: not found) and `old` (uninitialised, `dtype`'s bit
    type) for locate_add_summed, in device memory. Only found entries' old values are
    written or read (a roll-back's scatter skips position -1)."""
    where = cuda.device_array(count, np.int64)
    if count:
        tpb, _, max_blocks = launch_config()
        fill_int64[min(-(-count // tpb), max_blocks), tpb](where, -1)
    return where, cuda.device_array(count, bits_dtype(dtype))


def whole_words(d) -> bool:
    """Whether a flat device array can be read as uint64 words: 8-byte aligned, whole words."""
    return d.size * d.dtype.itemsize % 8 == 0 and address_of(d)[1] % 8 == 0


def word_sum_launch(d, partial) -> None:
    """word_sum's kernel over whole uint64 words of `d` (whole_words), block sums into
    `partial` (uint64, word_sum_grid(d) of them)."""
    tpb, _, _ = launch_config()
    words = d.view(np.uint64)
    _word_sums[partial.size, tpb, 0, tpb * SHARED_ITEM](words, 1, 64, words.size, partial)


def word_sum_grid(d) -> int:
    tpb, _, max_blocks = launch_config()
    return max(1, min(-(-(d.size * d.dtype.itemsize // 8) // tpb), max_blocks))


def word_sums(arrays) -> list:
    """word_sum of each array, the device arrays' launched one after another and their block
    sums read back in one copy (one host synchronisation for all, not one each)."""
    views = [as_bits(as_arg(a)) if is_device_array(a) else None for a in arrays]
    batched = [i for i, d in enumerate(views) if d is not None and d.size and whole_words(d)]
    sums = [None] * len(views)
    if batched:
        grids = [word_sum_grid(views[i]) for i in batched]
        partial = cuda.device_array(sum(grids), np.uint64)
        at = 0
        for i, g in zip(batched, grids):
            word_sum_launch(views[i], partial[at:at + g])
            at += g
        host, at = partial.copy_to_host(), 0
        for i, g in zip(batched, grids):
            sums[i] = int(host[at:at + g].sum(dtype=np.uint64))
            at += g
    return [word_sum(a) if total is None else total for a, total in zip(arrays, sums)]


def locate_add_summed(base, shift: int, mask: int, class_offsets, ranks, deltas, where, old):
    """kernels.cpu.locate_add_summed on a base in device memory: each listed (class, rank) entry
    found is written in place (base + its zigzag delta), its position put in `where` and its old
    value in `old` (device arrays from located_buffers). Returns (entries found, the word sum's
    change (after - before) mod 2**64, the class sizes on the host). A caller that finds fewer
    than it listed puts the found ones back.

    By the tile kernels with one host synchronisation (the section above). Where they do not
    apply (more than TILE_LISTED classes listed, classes wider than a byte, a tensor that is not
    whole 8-byte words, entries already on the device, none at all), the separate kernels, each
    synchronising on its own."""
    from pulsediff.kernels.class_sort import check_offsets

    check_class_field(shift, mask)
    if not is_device_array(base):
        raise ValueError("the CUDA locate_add_summed writes a base in device memory")
    ncls = mask + 1
    d_base = as_bits(base, signed64=True)
    d_where, d_old = as_indices(where), device_view(old)
    m = d_where.size
    if d_old.size != m or len(ranks) != m or len(deltas) != m:
        raise ValueError(f"{m} positions for {len(ranks)} ranks, {len(deltas)} deltas and {d_old.size} old values")
    if d_old.dtype.itemsize != d_base.dtype.itemsize:
        raise ValueError("old values must have the base's element width")
    host_entries = not (is_device_array(class_offsets) or is_device_array(ranks) or is_device_array(deltas))
    if not host_entries:
        return _locate_add_separately(base, shift, mask, class_offsets, ranks, deltas, d_where, d_old)
    offsets = check_offsets(class_offsets, ncls, m)
    listed = np.flatnonzero(np.diff(offsets) > 0)
    if ncls > 256 or listed.size > TILE_LISTED or m == 0 or not whole_words(d_base):
        return _locate_add_separately(base, shift, mask, offsets, ranks, deltas, d_where, d_old)
    try:
        return _locate_add_tiled(d_base, shift, mask, offsets, listed, ranks, deltas, d_where, d_old)
    except BaseException:
        cuda.synchronize()  # the staging buffer is this thread's next upload: no copy may still read it
        raise


def _locate_add_separately(base, shift, mask, class_offsets, ranks, deltas, d_where, d_old):
    before = word_sum(base)
    located, found, sizes = locate_ranked(base, shift, mask, class_offsets, ranks)
    tpb, _, max_blocks = launch_config()
    grid = max(1, min(-(-d_where.size // tpb), max_blocks))
    located = as_indices(located)
    if located.size:
        copy_into[grid, tpb](located, d_where)
        olds, _ = add_at(base, d_where, deltas)
        copy_into[grid, tpb](device_view(olds), d_old.view(UNSIGNED[d_old.dtype.itemsize]))
    return found, (word_sum(base) - before) & 0xFFFFFFFFFFFFFFFF, sizes


def _locate_add_tiled(d_base, shift, mask, offsets, listed, ranks, deltas, d_where, d_old):
    ncls, m, nlisted, n = mask + 1, d_where.size, listed.size, d_base.size
    tpb, _, max_blocks = launch_config()
    ranks = np.ascontiguousarray(ranks).reshape(-1)
    deltas = np.ascontiguousarray(deltas).reshape(-1)
    if deltas.dtype.kind not in "iu" or ranks.dtype.kind not in "iu":
        raise ValueError("ranks and deltas must be integers")
    # Pinned staging, int64 words: ranks | listed classes' first entries | their ends | the class
    # -> table row map (ncls bytes) | the deltas' bytes. One asynchronous copy takes it all up.
    lut_at = m + 2 * nlisted
    deltas_at = lut_at + -(-ncls // 8)
    words = deltas_at + -(-deltas.nbytes // 8)
    stage = buffers.get("pinned", "locate-add", words, np.int64)
    stage[:m] = ranks.view(np.int64) if ranks.dtype == np.uint64 else ranks
    stage[m:m + nlisted] = offsets[listed]
    stage[m + nlisted:lut_at] = offsets[listed + 1]
    raw = stage.view(np.uint8)
    raw[8 * lut_at:8 * lut_at + ncls] = UNLISTED
    raw[8 * lut_at + listed] = np.arange(nlisted, dtype=np.uint8)
    raw[8 * deltas_at:8 * deltas_at + deltas.nbytes] = deltas.view(np.uint8)
    d_stage = buffers.get("device", "locate-add", words, np.int64)
    d_stage.copy_to_device(stage, stream=cuda.default_stream())
    d_ranks, d_lo, d_hi = d_stage[:m], d_stage[m:m + nlisted], d_stage[m + nlisted:lut_at]
    d_raw = d_stage.view(np.uint8)
    d_lut = d_raw[8 * lut_at:8 * lut_at + ncls]
    d_deltas = zigzag_deltas(d_raw[8 * deltas_at:8 * deltas_at + deltas.nbytes].view(UNSIGNED[deltas.itemsize]))

    # One int64 array comes back: unlisted class sizes | found | listed class sizes | the add's
    # out-of-range count per block | the word sum's block sums before | after.
    grid_m = min(-(-m // tpb), max_blocks)
    grid_w = word_sum_grid(d_base)
    found_at, sizes_at = ncls, ncls + 1
    before_at = sizes_at + nlisted + grid_m
    after_at = before_at + grid_w
    result = buffers.get("device", "locate-add-result", after_at + grid_w, np.int64)
    fill_int64[max(1, min(-(-sizes_at // tpb), max_blocks)), tpb](result[:sizes_at], 0)
    word_sum_launch(d_base, result[before_at:after_at].view(np.uint64))

    tiles = -(-n // TILE)
    counts = buffers.get("device", "tile-counts", tiles * nlisted, np.int64).reshape(tiles, nlisted)
    totals = count_tiles(d_base, shift, mask, d_lut, nlisted, counts, result[:ncls])
    copy_into[1, tpb](totals, result[sizes_at:sizes_at + nlisted])
    bounds = buffers.get("device", "tile-bounds", (tiles + 1) * nlisted, np.int64).reshape(tiles + 1, nlisted)
    locate_in_tiles(d_base, shift, mask, d_lut, nlisted, counts, bounds, d_lo, d_hi, d_ranks, d_where,
                    result[found_at:sizes_at])
    old = d_old.view(np.int64) if d_old.dtype.itemsize == 8 else d_old
    _add_at[grid_m, tpb, 0, tpb * SHARED_ITEM](d_base, d_where, d_deltas, width_mask(d_base.dtype.itemsize), old,
                                                result[sizes_at + nlisted:before_at])
    word_sum_launch(d_base, result[after_at:].view(np.uint64))

    host = result.copy_to_host()  # the one synchronisation: every launch above has finished
    sizes = host[:ncls].copy()
    sizes[listed] = host[sizes_at:sizes_at + nlisted]
    before = int(host[before_at:after_at].view(np.uint64).sum(dtype=np.uint64))
    after = int(host[after_at:].view(np.uint64).sum(dtype=np.uint64))
    return int(host[found_at]), (after - before) & 0xFFFFFFFFFFFFFFFF, sizes
