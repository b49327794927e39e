"""Compare and compact (`diff_compact`), `scatter`, and `gaps_to_positions`: make's side and the
writes of a decoded patch (the package docstring gives the scheme and its sources)."""

from __future__ import annotations

import numpy as np
from numba import cuda, int64

from pulsediff.kernels.cuda.common import (SHARED_ITEM, as_arg, as_bits, as_indices, bits_dtype, block_inclusive_scan,
                                           block_sum, device_view, is_device_array, launch_config)


# --- diff_compact ------------------------------------------------------------


@cuda.jit(cache=True)
def _count_changed(old, new, items, counts):
    sh = cuda.shared.array(0, int64)
    tid = cuda.threadIdx.x
    tpb = cuda.blockDim.x
    n = old.size
    tile_len = tpb * items
    # The loop bounds depend on the block only, so every thread of a block
    # runs the same iterations and reaches the same barriers.
    for tile in range(cuda.blockIdx.x, counts.size, cuda.gridDim.x):
        base = tile * tile_len
        k = 0
        for it in range(items):
            i = base + it * tpb + tid
            if i < n and old[i] != new[i]:
                k += 1
        total = block_sum(sh, k)
        if tid == 0:
            counts[tile] = total


@cuda.jit(cache=True)
def _write_changed(old, new, items, offsets, positions, values):
    sh = cuda.shared.array(0, int64)
    tid = cuda.threadIdx.x
    tpb = cuda.blockDim.x
    n = old.size
    tile_len = tpb * items
    for tile in range(cuda.blockIdx.x, offsets.size, cuda.gridDim.x):
        base = tile * tile_len
        out = offsets[tile]
        for it in range(items):
            round_base = base + it * tpb
            if round_base >= n:  # same for the whole block: safe to leave the barriers
                break
            i = round_base + tid
            flag = 0
            if i < n and old[i] != new[i]:
                flag = 1
            inclusive, total = block_inclusive_scan(sh, flag)
            if flag:
                j = out + inclusive - 1
                positions[j] = i
                values[j] = new[i]
            out += total


def diff_compact(old, new):
    """Positions (int64, ascending) where `new` differs from `old`, and `new`'s bits there.

    Device arrays in: both results stay on the device.
    """
    on_device = is_device_array(old) or is_device_array(new)
    old, new = as_arg(old), as_arg(new)
    if old.size != new.size:
        raise ValueError(f"old and new differ in size ({old.size} != {new.size})")
    n = new.size
    tpb, items, max_blocks = launch_config()
    values_dtype = bits_dtype(new.dtype) if on_device else np.dtype(new.dtype)
    if n == 0:
        empty = (np.empty(0, np.int64), np.empty(0, values_dtype))
        return tuple(cuda.to_device(a) for a in empty) if on_device else empty
    ntiles = -(-n // (tpb * items))
    grid = min(ntiles, max_blocks)
    shared = tpb * SHARED_ITEM
    d_old, d_new = as_bits(old), as_bits(new)
    if d_old.dtype != d_new.dtype:
        raise ValueError(f"old and new differ in element width ({old.dtype} != {new.dtype})")
    d_counts = cuda.device_array(ntiles, np.int64)
    _count_changed[grid, tpb, 0, shared](d_old, d_new, items, d_counts)
    counts = d_counts.copy_to_host()
    offsets = np.zeros(ntiles, np.int64)
    np.cumsum(counts[:-1], out=offsets[1:])
    total = int(counts.sum())
    d_positions = cuda.device_array(total, np.int64)
    d_values = cuda.device_array(total, d_new.dtype)
    if total:
        _write_changed[grid, tpb, 0, shared](d_old, d_new, items, cuda.to_device(offsets), d_positions, d_values)
    if on_device:
        return d_positions, d_values
    return d_positions.copy_to_host(), d_values.copy_to_host().view(values_dtype)


# --- scatter -------------------------------------------------------------------


@cuda.jit(cache=True)
def _scatter(out, positions, values, bad_per_block):
    sh = cuda.shared.array(0, int64)
    n = out.size
    bad = 0
    # Consecutive threads read consecutive positions/values (coalesced); the
    # writes into `out` go wherever the positions say.
    for k in range(cuda.grid(1), positions.size, cuda.gridsize(1)):
        p = positions[k]
        # A hostile patch must not be able to write past the buffer.
        if p >= 0 and p < n:
            out[p] = values[k]
        else:
            bad += 1
    total = block_sum(sh, bad)
    if cuda.threadIdx.x == 0:
        bad_per_block[cuda.blockIdx.x] = total


def _values_for(values, dtype: np.dtype):
    """`values` as elements of `out`'s bit type, on the device."""
    if is_device_array(values):
        d = device_view(values)
        if d.dtype.itemsize != dtype.itemsize:
            raise ValueError(f"values are {d.dtype.itemsize}-byte elements, out has {dtype.itemsize}-byte ones")
        return d if d.dtype == dtype else d.view(dtype)
    # A host array converts as the CPU backend's assignment would.
    return cuda.to_device(np.ascontiguousarray(values).reshape(-1).astype(dtype, copy=False))


def scatter(out, positions, values) -> int:
    """out[positions] = values in place; returns the number of out-of-range positions (0 when valid).

    Positions are expected to be distinct (as `diff_compact` and
    `gaps_to_positions` produce them): with duplicates, which value lands is
    unspecified, as on the CPU backend. A device `out` is written on the device.
    """
    out, positions, values = as_arg(out), as_arg(positions), as_arg(values)
    if positions.size != values.size:
        raise ValueError(f"positions and values differ in size ({positions.size} != {values.size})")
    m = positions.size
    if m == 0:
        return 0
    if out.size == 0:
        return m
    tpb, _, max_blocks = launch_config()
    grid = min(-(-m // tpb), max_blocks)
    # uint64 positions >= 2**63 become negative here and are rejected like
    # any other out-of-range position.
    d_pos = as_indices(positions)
    d_bad = cuda.device_array(grid, np.int64)
    if is_device_array(out):
        d_out = as_bits(out)
        _scatter[grid, tpb, 0, tpb * SHARED_ITEM](d_out, d_pos, _values_for(values, d_out.dtype), d_bad)
        return int(d_bad.copy_to_host().sum())
    # Work on a contiguous 1-D buffer; copy back into `out` only if it is not one.
    flat = out.reshape(-1) if out.flags.c_contiguous else np.ascontiguousarray(out).reshape(-1)
    d_out = cuda.to_device(flat)
    _scatter[grid, tpb, 0, tpb * SHARED_ITEM](d_out, d_pos, _values_for(values, flat.dtype), d_bad)
    d_out.copy_to_host(flat)
    if not out.flags.c_contiguous:
        out[...] = flat.reshape(out.shape)
    return int(d_bad.copy_to_host().sum())


# --- gaps_to_positions ---------------------------------------------------------


@cuda.jit(cache=True)
def _tile_sums(gaps, items, sums, bads):
    sh = cuda.shared.array(0, int64)
    tid = cuda.threadIdx.x
    tpb = cuda.blockDim.x
    n = gaps.size
    tile_len = tpb * items
    for tile in range(cuda.blockIdx.x, sums.size, cuda.gridDim.x):
        base = tile * tile_len
        s = int64(0)
        b = 0
        for it in range(items):
            i = base + it * tpb + tid
            if i < n:
                g = int64(gaps[i])
                s += g
                # Every gap is at least 1 (positions strictly increase, the
                # first counts from -1); the caller rejects the patch otherwise.
                if g <= 0:
                    b += 1
        tile_sum = block_sum(sh, s)
        tile_bad = block_sum(sh, b)
        if tid == 0:
            sums[tile] = tile_sum
            bads[tile] = tile_bad


@cuda.jit(cache=True)
def _scan_tiles(gaps, items, starts, positions):
    sh = cuda.shared.array(0, int64)
    tid = cuda.threadIdx.x
    tpb = cuda.blockDim.x
    n = gaps.size
    tile_len = tpb * items
    for tile in range(cuda.blockIdx.x, starts.size, cuda.gridDim.x):
        base = tile * tile_len
        running = starts[tile]
        for it in range(items):
            round_base = base + it * tpb
            if round_base >= n:  # same for the whole block: safe to leave the barriers
                break
            i = round_base + tid
            g = int64(0)
            if i < n:
                g = int64(gaps[i])
            inclusive, total = block_inclusive_scan(sh, g)
            if i < n:
                positions[i] = running + inclusive
            running += total


def gaps_to_positions(gaps):
    """position[i] = sum(gaps[:i+1]) - 1, by a tiled reduce-then-scan.

    Returns (positions, number of gaps that are not >= 1). Sums are in int64
    and wrap on overflow, as on the CPU backend; a patch that overflows has
    bad gaps anyway. Device gaps in: positions stay on the device.
    """
    on_device = is_device_array(gaps)
    gaps = as_arg(gaps)
    n = gaps.size
    if n == 0:
        empty = np.empty(0, np.int64)
        return (cuda.to_device(empty) if on_device else empty), 0
    if on_device:
        d_gaps = device_view(gaps)
        if d_gaps.dtype.kind not in "iu":
            raise ValueError(f"gaps must be integers, not {d_gaps.dtype}")
        if d_gaps.dtype == np.uint64:
            d_gaps = d_gaps.view(np.int64)
    else:
        g = np.ascontiguousarray(gaps).reshape(-1)
        if g.dtype == np.uint64:
            # Reinterpret, not convert: values >= 2**63 turn negative and count as
            # bad, and the kernel never mixes uint64 with int64 (Numba would
            # promote that to float64).
            g = g.view(np.int64)
        d_gaps = cuda.to_device(g)
    tpb, items, max_blocks = launch_config()
    ntiles = -(-n // (tpb * items))
    grid = min(ntiles, max_blocks)
    shared = tpb * SHARED_ITEM
    d_sums = cuda.device_array(ntiles, np.int64)
    d_bads = cuda.device_array(ntiles, np.int64)
    _tile_sums[grid, tpb, 0, shared](d_gaps, items, d_sums, d_bads)
    sums = d_sums.copy_to_host()
    starts = np.full(ntiles, -1, np.int64)
    starts[1:] += np.cumsum(sums[:-1])
    d_positions = cuda.device_array(n, np.int64)
    _scan_tiles[grid, tpb, 0, shared](d_gaps, items, cuda.to_device(starts), d_positions)
    bad = int(d_bads.copy_to_host().sum())
    return (d_positions if on_device else d_positions.copy_to_host()), bad
