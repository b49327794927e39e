"""CUDA kernels: Numba `@cuda.jit`, the GPU twin of `kernels.cpu`.

Same three functions, same arguments, same results bit for bit; inputs and
outputs are host NumPy arrays, copied to the device and back inside each call.
`tests/reference.py` holds the plain NumPy oracle both backends are checked
against (under `NUMBA_ENABLE_CUDASIM=1` when there is no GPU).

Stream compaction (`diff_compact`) is the two-pass tiled scheme of Billeter,
Olsson and Assarsson, "Efficient Stream Compaction on Wide SIMD Many-Core
Architectures" (HPG 2009), which is also the count / scan / write of
`kernels.cpu` with tiles in place of chunks:

  pass 1  each block reads a tile of blockDim * ITEMS_PER_THREAD elements and
          counts the changed ones (tree reduction in shared memory);
  host    an exclusive prefix sum of the per-tile counts gives each tile's
          output offset (NumPy; the counts are one int64 per tile);
  pass 2  each block reads its tile again and ranks its changed elements with
          a block-wide inclusive scan of the per-thread flags (Hillis and
          Steele, "Data Parallel Algorithms", CACM 1986; see also Harris,
          Sengupta and Owens, "Parallel Prefix Sum (Scan) with CUDA", GPU Gems
          3 ch. 39), so positions come out in ascending order with no sort.

A tile is read in ITEMS_PER_THREAD rounds of blockDim consecutive elements,
thread t taking element t of each round: every load is coalesced, and since
the rounds are contiguous and in order, scanning round by round and carrying
the round totals keeps the output ascending.

`gaps_to_positions` is the same machinery as a reduce-then-scan prefix sum:
per-tile sums (and counts of bad gaps) in pass 1, an exclusive scan of the
tile sums on the host, a block-level inclusive scan in pass 2.

Only shared memory and `cuda.syncthreads` are used, no warp intrinsics, so
the kernels also run under the Numba CUDA simulator. Shared memory is the
dynamic kind (sized at launch), so the block size is a launch parameter and
one compiled kernel serves every block size.

The base-context kernels of the ctx-rans codec (class histograms, class
ranks, the ranked apply) have no device version yet: this backend provides
them by running the CPU kernels on the host arrays (see the end of the
module), so every codec sees one contract. Moving them to the device is
issue 10's open part.

Importing this module needs no GPU; kernels compile on first call.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, int64

# Module-level so tests can shrink them and make tiny inputs cross tile and
# block boundaries. Read at every call.
# Power of two: the shared-memory tree reduction halves the block each step.
THREADS_PER_BLOCK = 256
# Elements per thread per tile: amortises the per-tile block scan and the
# per-tile entry of the host scan over more elements.
ITEMS_PER_THREAD = 8
# Grid cap; beyond it, blocks loop over tiles (grid-stride), which keeps
# the per-block partial arrays and the launch size bounded on huge tensors.
MAX_BLOCKS = 4096

_SHARED_ITEM = 8  # bytes per shared-memory slot (int64)


def _launch_config() -> tuple[int, int, int]:
    tpb, items, max_blocks = int(THREADS_PER_BLOCK), int(ITEMS_PER_THREAD), int(MAX_BLOCKS)
    if not (1 <= tpb <= 1024 and tpb & (tpb - 1) == 0):
        raise ValueError(f"THREADS_PER_BLOCK must be a power of two in [1, 1024], got {tpb}")
    if items < 1:
        raise ValueError(f"ITEMS_PER_THREAD must be >= 1, got {items}")
    if max_blocks < 1:
        raise ValueError(f"MAX_BLOCKS must be >= 1, got {max_blocks}")
    return tpb, items, max_blocks


# --- block-wide primitives ---------------------------------------------------
# Both must be called by every thread of the block (they contain barriers), and
# both end with a barrier so the caller may reuse `sh` straight away.


@cuda.jit(device=True)
def _block_sum(sh, value):
    tid = cuda.threadIdx.x
    sh[tid] = value
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if tid < s:
            sh[tid] += sh[tid + s]
        cuda.syncthreads()
        s //= 2
    total = sh[0]
    cuda.syncthreads()
    return total


@cuda.jit(device=True)
def _block_inclusive_scan(sh, value):
    # Hillis-Steele rather than Blelloch: as many barriers (2 * log2(blockDim))
    # and more adds, but adds are cheap next to barriers at block scale, and
    # there are no strided indices to cause shared-memory bank conflicts.
    # Read, barrier, write, barrier: in place, no double buffer needed.
    tid = cuda.threadIdx.x
    n = cuda.blockDim.x
    sh[tid] = value
    cuda.syncthreads()
    d = 1
    while d < n:
        v = sh[tid]
        if tid >= d:
            v += sh[tid - d]
        cuda.syncthreads()
        sh[tid] = v
        cuda.syncthreads()
        d *= 2
    inclusive = sh[tid]
    total = sh[n - 1]
    cuda.syncthreads()
    return inclusive, total


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
        total = _block_sum(sh, k)
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
            inclusive, total = _block_inclusive_scan(sh, flag)
            if flag:
                j = out + inclusive - 1
                positions[j] = i
                values[j] = new[i]
            out += total


def diff_compact(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions (int64, ascending) where `new` differs from `old`, and `new`'s bits there."""
    if old.size != new.size:
        raise ValueError(f"old and new differ in size ({old.size} != {new.size})")
    n = new.size
    if n == 0:
        return np.empty(0, np.int64), np.empty(0, new.dtype)
    tpb, items, max_blocks = _launch_config()
    ntiles = -(-n // (tpb * items))
    grid = min(ntiles, max_blocks)
    shared = tpb * _SHARED_ITEM
    d_old = cuda.to_device(np.ascontiguousarray(old).reshape(-1))
    d_new = cuda.to_device(np.ascontiguousarray(new).reshape(-1))
    d_counts = cuda.device_array(ntiles, np.int64)
    _count_changed[grid, tpb, 0, shared](d_old, d_new, items, d_counts)
    counts = d_counts.copy_to_host()
    offsets = np.zeros(ntiles, np.int64)
    np.cumsum(counts[:-1], out=offsets[1:])
    total = int(counts.sum())
    if total == 0:
        return np.empty(0, np.int64), np.empty(0, new.dtype)
    d_positions = cuda.device_array(total, np.int64)
    d_values = cuda.device_array(total, new.dtype)
    _write_changed[grid, tpb, 0, shared](d_old, d_new, items, cuda.to_device(offsets), d_positions, d_values)
    return d_positions.copy_to_host(), d_values.copy_to_host()


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
    total = _block_sum(sh, bad)
    if cuda.threadIdx.x == 0:
        bad_per_block[cuda.blockIdx.x] = total


def scatter(out: np.ndarray, positions: np.ndarray, values: np.ndarray) -> int:
    """out[positions] = values in place; returns the number of out-of-range positions (0 when valid).

    Positions are expected to be distinct (as `diff_compact` and
    `gaps_to_positions` produce them): with duplicates, which value lands is
    unspecified, as on the CPU backend.
    """
    if positions.size != values.size:
        raise ValueError(f"positions and values differ in size ({positions.size} != {values.size})")
    m = positions.size
    if m == 0:
        return 0
    if out.size == 0:
        return m
    tpb, _, max_blocks = _launch_config()
    grid = min(-(-m // tpb), max_blocks)
    # uint64 positions >= 2**63 become negative here and are rejected like
    # any other out-of-range position.
    pos = np.ascontiguousarray(positions).reshape(-1).astype(np.int64, copy=False)
    vals = np.ascontiguousarray(values).reshape(-1).astype(out.dtype, copy=False)
    # Work on a contiguous 1-D buffer; copy back into `out` only if it is not one.
    flat = out.reshape(-1) if out.flags.c_contiguous else np.ascontiguousarray(out).reshape(-1)
    d_out = cuda.to_device(flat)
    d_bad = cuda.device_array(grid, np.int64)
    _scatter[grid, tpb, 0, tpb * _SHARED_ITEM](d_out, cuda.to_device(pos), cuda.to_device(vals), d_bad)
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
        tile_sum = _block_sum(sh, s)
        tile_bad = _block_sum(sh, b)
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
            inclusive, total = _block_inclusive_scan(sh, g)
            if i < n:
                positions[i] = running + inclusive
            running += total


def gaps_to_positions(gaps: np.ndarray) -> tuple[np.ndarray, int]:
    """position[i] = sum(gaps[:i+1]) - 1, by a tiled reduce-then-scan.

    Returns (positions, number of gaps that are not >= 1). Sums are in int64
    and wrap on overflow, as on the CPU backend; a patch that overflows has
    bad gaps anyway.
    """
    n = gaps.size
    if n == 0:
        return np.empty(0, np.int64), 0
    g = np.ascontiguousarray(gaps).reshape(-1)
    if g.dtype == np.uint64:
        # Reinterpret, not convert: values >= 2**63 turn negative and count as
        # bad, and the kernel never mixes uint64 with int64 (Numba would
        # promote that to float64).
        g = g.view(np.int64)
    tpb, items, max_blocks = _launch_config()
    ntiles = -(-n // (tpb * items))
    grid = min(ntiles, max_blocks)
    shared = tpb * _SHARED_ITEM
    d_gaps = cuda.to_device(g)
    d_sums = cuda.device_array(ntiles, np.int64)
    d_bads = cuda.device_array(ntiles, np.int64)
    _tile_sums[grid, tpb, 0, shared](d_gaps, items, d_sums, d_bads)
    sums = d_sums.copy_to_host()
    starts = np.full(ntiles, -1, np.int64)
    starts[1:] += np.cumsum(sums[:-1])
    d_positions = cuda.device_array(n, np.int64)
    _scan_tiles[grid, tpb, 0, shared](d_gaps, items, cuda.to_device(starts), d_positions)
    return d_positions.copy_to_host(), int(d_bads.copy_to_host().sum())


# Not on the device yet (see the module docstring): the CPU kernels, on the same host arrays.
from .cpu import apply_ranked, chunk_class_starts, class_major_order, class_ranks  # noqa: E402

__all__ = ["diff_compact", "scatter", "gaps_to_positions", "chunk_class_starts", "class_ranks", "apply_ranked",
           "class_major_order"]
