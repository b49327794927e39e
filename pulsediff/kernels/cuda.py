"""CUDA kernels: Numba `@cuda.jit`, the GPU twin of `kernels.cpu`.

Same functions, same arguments, same results bit for bit. `tests/reference.py`
holds the plain NumPy oracle both backends are checked against (under
`NUMBA_ENABLE_CUDASIM=1` when there is no GPU).

Host arrays or device arrays (zero-copy)
----------------------------------------
Every entry point takes either host NumPy arrays or device arrays:

- NumPy in, NumPy out (the `kernels.Backend` contract): inputs are copied to
  the device, results copied back (into `out` for `scatter` and
  `apply_ranked`), within the call.
- Device arrays in, device arrays out: a Numba device array, or anything with
  `__cuda_array_interface__` (a torch CUDA tensor, a CuPy array), is used in
  place through `numba.cuda.as_cuda_array`, without a copy. Arrays the call
  makes (positions, values, ranks, starts, sizes) are returned as Numba device
  arrays, `out` is written on the device, and counts come back as Python ints
  (one small device-to-host read, which also waits for the kernels).

Where the result lives follows the main array: `old`/`new` for
`diff_compact`, `out` for `scatter` and `apply_ranked`, `gaps` for
`gaps_to_positions`, `base` for `chunk_class_starts` and `class_ranks`; a
host array among the other arguments is copied over. Device arrays must be
C-contiguous (a strided one could only be used through a copy). Kernels read
bit patterns: a device array of floats, or torch's bfloat16 (exported as the
void type `<V2`), is read as the unsigned integers of its width; a signed view
(torch has few unsigned types) is read as the same bits unsigned.

Compare and compact, prefix sums, scatter
-----------------------------------------
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

Base-context kernels (codec ctx-rans)
-------------------------------------
An element's class is `(int64(bits) >> shift) & mask` (the exponent, for
floats; read as a signed 64-bit value exactly as `kernels.cpu` does, which
matters for 8-byte elements with the top bit set), and a changed element is
named by its rank among the base elements of its class. All three kernels cut
the tensor into `rows` ranges of ceil(n / rows) elements, as `kernels.cpu`
does: `starts[row, class]`, the elements of the class before the range, says
by its row count how the tensor was cut, so either backend's `starts` works
with either backend's `apply_ranked`. This module picks
rows = min(n / (blockDim * ITEMS_PER_THREAD), CLASS_TILE_BUDGET / classes):
ranges of at least one tile's length, and a `starts` table of at most
CLASS_TILE_BUDGET int64 (4 MiB) whatever the tensor's size; one block walks
one range (grid-stride over ranges). A range is walked in rounds of blockDim
consecutive elements, aligned to a multiple of blockDim so that loads stay
coalesced when a range starts mid-segment.

This is the "local rank + global offset" decomposition of GPU radix sort's
scatter (Satish, Harris and Garland, "Designing Efficient Sorting Algorithms
for Manycore GPUs", IPDPS 2009; Merrill and Grimshaw, "High Performance and
Scalable Radix Sorting", Parallel Processing Letters 2011): per-block digit
histograms, an exclusive scan over blocks digit by digit, and a rank inside
the block. Here the "digits" are up to 4096 classes and only ~1% of the
elements need a rank, so the in-block part is driven by the listed elements
rather than by every element:

  chunk_class_starts  per range, a histogram in shared memory with atomic
          increments (Podlozhnyuk, "Histogram calculation in CUDA", NVIDIA
          2007), written as one row; then an exclusive scan down each class's
          column (Blelloch's reduce-then-scan: a block takes 8 adjacent columns,
          its threads sum runs of rows, one thread per column scans the run
          sums, the runs are rewritten), which also gives the class sizes.
  class_ranks  one pass over the base: each round, every thread stores its
          element's class in shared memory; the listed positions that fall in
          the round (a prefix of the remaining ones, positions being
          ascending) are taken one per thread, and each counts the elements of
          its class before it in the round, plus the range's running count of
          that class; `syncthreads_count` of the taken ones advances the list
          and is the barrier before every thread adds its element to the
          running counts. That gives ranks from the range's start and the
          range histograms together; after the column scan, one thread per
          position adds its range's start for its class, and counts positions
          that are not strictly ascending inside the tensor (then ValueError).
  apply_ranked  the inverse walk, rank to position. Per range and class, a
          binary search finds the first listed rank at or past the range's
          start; shared memory keeps, per class, the index of that entry and
          its distance (its rank minus the class's running count). Each round,
          every thread decrements its element's class's distance; after the
          barrier, a class gone negative has entries in this round, and of the
          threads holding an element of it the one whose compare-and-swap
          claims it places those entries: each by scanning the round's classes
          for the element with the matching count from the round's end
          ("select"), where it writes base + delta. Work beyond the copy is one
          shared read per element and a short scan per listed entry; the
          per-class setup is bounded by the size of `starts`. Shared memory:
          8 bytes per class (4096 classes: 32 KiB) plus 4 per thread.

Each round costs two barriers. Tables of counts within a range are int32:
ranges are kept under 2**30 elements.

`locate_ranked` on a device base (the live apply) does not walk in rounds:
`tile_locate_ranked` (its section below) counts per thread and per tile and
reads the base twice, with a fixed number of barriers per 4096 elements.

Hostile input to `apply_ranked` (entries of a decoded patch): an entry whose
rank is outside its class (>= the class size, or negative) is never written
and not counted, as on the CPU; an entry whose rank is not above the previous
entry's of its class is skipped and not counted, so a returned count equal to
the number of entries means every entry was valid and applied exactly once;
no input makes a kernel read or write outside its arrays.

Only shared memory, `cuda.syncthreads`, `cuda.syncthreads_count` and shared
atomics are used, no warp intrinsics, so the kernels also run under the Numba
CUDA simulator. Shared memory is the dynamic kind (sized at launch), so the
block size is a launch parameter and one compiled kernel serves every block
size.

`diff_ranks` (make's compare and class ranks together) is not fused on the
device yet: it is `diff_compact`, `class_ranks` on its positions, and one
gather of the changed elements for their zigzag differences and classes.
`class_major_order` (a counting sort of the changed elements' classes, make
side) stays on the host: it is the CPU kernel.

None of these kernels has yet run on a GPU, only under the simulator
(correctness, not speed): `scripts/bench_gpu.py` measures them where a GPU is
lent.

Importing this module needs no GPU; kernels compile on first call.
"""

from __future__ import annotations

import functools
import importlib
import threading
import warnings

import numpy as np
from numba import cuda, int32, int64, uint16, uint64

from pulsediff.errors import DeviceUnavailableError
from pulsediff.kernels.contract import KERNELS, first_line

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
# Most entries of a `starts` table (ranges x classes): bounds its size (4 MiB of
# int64) and the per-range setup of apply_ranked, while leaving 2048 ranges
# for the usual 256 classes, enough blocks for every SM of an H100 several times.
CLASS_TILE_BUDGET = 1 << 19

_SHARED_ITEM = 8  # bytes per shared-memory slot (int64)
# mask <= 4095 (ctx-rans' MAX_CLASS_BITS is 12): bounds the per-class tables in shared memory.
_MAX_CLASSES = 4096
# Ranges stay shorter than this, so per-range counts fit int32, and a class's distance to its
# next listed entry can be capped here: within one range it cannot count down that far.
_FAR = 1 << 30
_INT64_MAX = 0x7FFFFFFFFFFFFFFF
# A due class's distance while the thread that claimed it places its entries (not negative,
# so no other thread takes it; above _FAR, so no real distance equals it).
_CLAIMED = _FAR + 1
# Adjacent columns a block of the column scan takes at once (8 int64: 64 contiguous bytes).
_SCAN_WIDTH = 8
_UNSIGNED = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}


def _launch_config() -> tuple[int, int, int]:
    tpb, items, max_blocks = int(THREADS_PER_BLOCK), int(ITEMS_PER_THREAD), int(MAX_BLOCKS)
    if not (1 <= tpb <= 1024 and tpb & (tpb - 1) == 0):
        raise ValueError(f"THREADS_PER_BLOCK must be a power of two in [1, 1024], got {tpb}")
    if items < 1:
        raise ValueError(f"ITEMS_PER_THREAD must be >= 1, got {items}")
    if max_blocks < 1:
        raise ValueError(f"MAX_BLOCKS must be >= 1, got {max_blocks}")
    return tpb, items, max_blocks


# --- host and device arrays ----------------------------------------------------


def is_device_array(a) -> bool:
    """A Numba device array (real or simulated) or anything exporting `__cuda_array_interface__`."""
    return bool(getattr(a, "__cuda_ndarray__", False)) or hasattr(a, "__cuda_array_interface__")


def _as_cuda_array(obj, sync: bool = True):
    """A Numba device array over an exporter's memory (no copy). Kernels read bit patterns, so
    a typestr that is not an integer (torch's bfloat16 `<V2`, floats) is imported as the
    unsigned integers of its width. `sync`: wait for the stream the exporter names (a host
    synchronisation), unless the caller orders its launches after that stream's work itself."""
    iface = dict(obj.__cuda_array_interface__)
    dtype = np.dtype(iface["typestr"])
    if dtype.kind not in "iu":
        iface["typestr"] = _bits_dtype(dtype).str
    if hasattr(cuda, "from_cuda_array_interface"):
        return cuda.from_cuda_array_interface(iface, owner=obj, sync=sync)
    # The simulator has none of this: its "device" memory is host memory, so the
    # interface's pointer is a host pointer, wrapped here as it is (no copy either).
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    class _Exported:
        __array_interface__ = {"data": iface["data"], "shape": tuple(iface["shape"]), "typestr": iface["typestr"],
                               "strides": iface.get("strides"), "version": 3}
        owner = obj  # keeps the exporter alive as long as the array

    return FakeCUDAArray(np.asarray(_Exported()))


def _device_view(a, sync: bool = True):
    """`a` (already on the device) as a flat Numba device array over the same memory."""
    d = a if getattr(a, "__cuda_ndarray__", False) else _as_cuda_array(a, sync)
    if d.size and not d.is_c_contiguous():
        raise ValueError("device arrays must be C-contiguous: a strided one could only be used through a copy")
    return d if d.ndim == 1 else d.ravel()


def _arg(a):
    """An array argument as something with NumPy's attributes: a flat device view of a device
    array (torch's `.size` is a method), else the host array itself."""
    return _device_view(a) if is_device_array(a) else np.asarray(a)


def device_bits(a):
    """A device array or `__cuda_array_interface__` exporter (a torch CUDA tensor viewed as
    integers) as a flat Numba device array of unsigned bit patterns over the same memory."""
    return _bits(a)


def _bits_dtype(dtype, signed64: bool = False) -> np.dtype:
    width = np.dtype(dtype).itemsize
    if width not in _UNSIGNED:
        raise ValueError(f"elements of {width} bytes have no bit-pattern type (1, 2, 4 or 8 bytes)")
    # 8-byte classes are computed as the CPU does, np.int64(bits) >> shift (arithmetic):
    # the kernel gets an int64 view, so the conversion is the identity.
    return np.dtype(np.int64) if signed64 and width == 8 else _UNSIGNED[width]


def _bits(a, signed64: bool = False):
    """`a`'s elements as bit patterns on the device: a view of a device array, a copy of a host one."""
    if is_device_array(a):
        d = _device_view(a)
        want = _bits_dtype(d.dtype, signed64)
        return d if d.dtype == want else d.view(want)
    h = np.ascontiguousarray(a).reshape(-1)
    return cuda.to_device(h.view(_bits_dtype(h.dtype, signed64)))


def _host_bits(a, signed64: bool = False) -> np.ndarray:
    """A flat host view (or a contiguous copy) of `a` with the kernels' bit-pattern dtype."""
    h = np.ascontiguousarray(a).reshape(-1)
    return h.view(_bits_dtype(h.dtype, signed64))


def _indices(a):
    """int64 indices on the device. uint64 is reinterpreted, so values >= 2**63 turn negative
    and count as out of range, as on the CPU backend."""
    if is_device_array(a):
        d = _device_view(a)
        if d.dtype.kind not in "iu" or d.dtype.itemsize != 8:
            raise ValueError(f"device index arrays must be int64, not {d.dtype}")
        return d if d.dtype == np.int64 else d.view(np.int64)
    h = np.ascontiguousarray(a).reshape(-1)
    h = h.view(np.int64) if h.dtype == np.uint64 else h.astype(np.int64, copy=False)
    return cuda.to_device(h)


def _table(a, ncols: int, what: str):
    """A 2-D int64 table (`starts`) on the device."""
    if is_device_array(a):
        d = a if getattr(a, "__cuda_ndarray__", False) else _as_cuda_array(a)
        if d.dtype != np.int64 or d.ndim != 2 or not d.is_c_contiguous():
            raise ValueError(f"{what} must be a C-contiguous 2-D int64 array")
    else:
        d = np.ascontiguousarray(a, dtype=np.int64)
        if d.ndim != 2:
            raise ValueError(f"{what} must be 2-D")
        d = cuda.to_device(d)
    if d.shape[1] != ncols:
        raise ValueError(f"{what} has {d.shape[1]} columns, the class mask gives {ncols} classes")
    return d


def _address(a) -> tuple[bool, int]:
    """(on the device, address of the first element): two arrays alias when both agree."""
    if is_device_array(a):
        iface = getattr(a, "__cuda_array_interface__", None)
        if iface is None:  # a simulated device array: host memory inside
            iface = a.__array_interface__
        return True, iface["data"][0]
    return False, np.asarray(a).__array_interface__["data"][0]


def _zeros(shape, dtype):
    return cuda.to_device(np.zeros(shape, dtype))


def _zigzag_deltas(deltas):
    """Zigzag-coded deltas on the device, as the kernels read them: unsigned integers, 8-byte
    ones as int64 (the kernels un-zigzag in int64: same bits)."""
    d = _device_view(deltas) if is_device_array(deltas) else cuda.to_device(np.ascontiguousarray(deltas).reshape(-1))
    if d.dtype.kind not in "iu":
        raise ValueError(f"deltas must be unsigned integers, not {d.dtype}")
    return d.view(np.int64) if d.dtype.itemsize == 8 and d.dtype != np.int64 else d


def _width_mask(width: int) -> int:
    """The mask that wraps int64 arithmetic to `width`-byte elements (-1: all 64 bits)."""
    return -1 if width == 8 else (1 << (8 * width)) - 1


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


def diff_compact(old, new):
    """Positions (int64, ascending) where `new` differs from `old`, and `new`'s bits there.

    Device arrays in: both results stay on the device.
    """
    on_device = is_device_array(old) or is_device_array(new)
    old, new = _arg(old), _arg(new)
    if old.size != new.size:
        raise ValueError(f"old and new differ in size ({old.size} != {new.size})")
    n = new.size
    tpb, items, max_blocks = _launch_config()
    values_dtype = _bits_dtype(new.dtype) if on_device else np.dtype(new.dtype)
    if n == 0:
        empty = (np.empty(0, np.int64), np.empty(0, values_dtype))
        return tuple(cuda.to_device(a) for a in empty) if on_device else empty
    ntiles = -(-n // (tpb * items))
    grid = min(ntiles, max_blocks)
    shared = tpb * _SHARED_ITEM
    d_old, d_new = _bits(old), _bits(new)
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
    total = _block_sum(sh, bad)
    if cuda.threadIdx.x == 0:
        bad_per_block[cuda.blockIdx.x] = total


def _values_for(values, dtype: np.dtype):
    """`values` as elements of `out`'s bit type, on the device."""
    if is_device_array(values):
        d = _device_view(values)
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
    out, positions, values = _arg(out), _arg(positions), _arg(values)
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
    d_pos = _indices(positions)
    d_bad = cuda.device_array(grid, np.int64)
    if is_device_array(out):
        d_out = _bits(out)
        _scatter[grid, tpb, 0, tpb * _SHARED_ITEM](d_out, d_pos, _values_for(values, d_out.dtype), d_bad)
        return int(d_bad.copy_to_host().sum())
    # Work on a contiguous 1-D buffer; copy back into `out` only if it is not one.
    flat = out.reshape(-1) if out.flags.c_contiguous else np.ascontiguousarray(out).reshape(-1)
    d_out = cuda.to_device(flat)
    _scatter[grid, tpb, 0, tpb * _SHARED_ITEM](d_out, d_pos, _values_for(values, flat.dtype), d_bad)
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


def gaps_to_positions(gaps):
    """position[i] = sum(gaps[:i+1]) - 1, by a tiled reduce-then-scan.

    Returns (positions, number of gaps that are not >= 1). Sums are in int64
    and wrap on overflow, as on the CPU backend; a patch that overflows has
    bad gaps anyway. Device gaps in: positions stay on the device.
    """
    on_device = is_device_array(gaps)
    gaps = _arg(gaps)
    n = gaps.size
    if n == 0:
        empty = np.empty(0, np.int64)
        return (cuda.to_device(empty) if on_device else empty), 0
    if on_device:
        d_gaps = _device_view(gaps)
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
    tpb, items, max_blocks = _launch_config()
    ntiles = -(-n // (tpb * items))
    grid = min(ntiles, max_blocks)
    shared = tpb * _SHARED_ITEM
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


@cuda.jit(device=True)
def _lower_bound(values, lo, hi, target):
    """The first index in [lo, hi) of ascending `values` whose value is >= target (hi if none)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if values[mid] < target:
            lo = mid + 1
        else:
            hi = mid
    return lo


@cuda.jit(cache=True)
def _range_first_positions(positions, step, firsts):
    # firsts[r] = how many positions lie before range r (a lower bound per range).
    for r in range(cuda.grid(1), firsts.size, cuda.gridsize(1)):
        firsts[r] = _lower_bound(positions, 0, positions.size, r * step)


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
    total = _block_sum(sh, bad)
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
            x = _lower_bound(ranks, a, b, s)  # the class's first entry ranked at or past the range
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
                                    delta = ((z >> 1) & _INT64_MAX) ^ -(z & 1)  # un-zigzag
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


def _check_class_field(shift: int, mask: int) -> None:
    if not 0 <= shift <= 63:
        raise ValueError(f"class shift must be in [0, 63], got {shift}")
    if not 0 <= mask < _MAX_CLASSES:
        raise ValueError(f"class mask must be in [0, {_MAX_CLASSES - 1}], got {mask}")


def _class_ranges(n: int, ncls: int) -> tuple[int, int]:
    """(rows, step) for a tensor of n elements: see the module docstring."""
    tpb, items, _ = _launch_config()
    by_length = -(-n // (tpb * items))
    by_memory = max(1, int(CLASS_TILE_BUDGET) // ncls)
    rows = max(1, min(by_length, by_memory), -(-n // (_FAR - 1)))
    return rows, max(1, -(-n // rows))


def _class_grid(rows: int) -> int:
    _, _, max_blocks = _launch_config()
    return min(rows, max_blocks)


def _starts_from_histograms(hist, ncls: int, before=None):
    """In place: range histograms -> exclusive scan per class (plus `before`, a device array of
    class counts that precede the first range); returns the class sizes."""
    tpb, _, max_blocks = _launch_config()
    sizes = cuda.device_array(ncls, np.int64)
    if before is None:
        before = _zeros(ncls, np.int64)
    groups = -(-ncls // min(_SCAN_WIDTH, tpb))
    _scan_columns[min(groups, max_blocks), tpb, 0, tpb * _SHARED_ITEM](hist, sizes, before)
    return sizes


def chunk_class_starts(base, shift: int, mask: int):
    """(starts[range, class]: elements of that class before the range, sizes[class]).

    The number of rows fixes how `apply_ranked` cuts the tensor into ranges
    (ceil(n / rows) elements each, as on the CPU backend). Device base in: both
    results stay on the device.
    """
    _check_class_field(shift, mask)
    on_device = is_device_array(base)
    hist, sizes = _device_class_starts(_bits(base, signed64=True), shift, mask)
    if on_device:
        return hist, sizes
    return hist.copy_to_host(), sizes.copy_to_host()


def _device_class_starts(d_base, shift: int, mask: int, before=None):
    """chunk_class_starts on a device array; `before`: class counts preceding the array (device)."""
    ncls = mask + 1
    tpb, _, _ = _launch_config()
    rows, step = _class_ranges(d_base.size, ncls)
    hist = cuda.device_array((rows, ncls), np.int64)
    # Empty ranges (n == 0 included) write rows of zeros.
    _range_histograms[_class_grid(rows), tpb, 0, ncls * 4](d_base, shift, mask, step, hist)
    return hist, _starts_from_histograms(hist, ncls, before)


def class_ranks(base, shift: int, mask: int, positions):
    """Per changed position: its rank within its class (the base elements of its class before
    it). Also returns class sizes. Positions must be strictly ascending and inside the tensor
    (ValueError otherwise). Device base in: both results stay on the device.
    """
    _check_class_field(shift, mask)
    on_device = is_device_array(base)
    d_base = _bits(base, signed64=True)
    d_pos = _indices(positions)
    n, m, ncls = d_base.size, d_pos.size, mask + 1
    tpb, _, max_blocks = _launch_config()
    rows, step = _class_ranges(n, ncls)
    grid = _class_grid(rows)
    firsts = cuda.device_array(rows + 1, np.int64)
    _range_first_positions[min(-(-(rows + 1) // tpb), max_blocks), tpb](d_pos, step, firsts)
    ranks = cuda.device_array(m, np.int64)
    hist = cuda.device_array((rows, ncls), np.int64)
    _range_ranks[grid, tpb, 0, (ncls + tpb) * 4](d_base, shift, mask, step, d_pos, firsts, ranks, hist)
    sizes = _starts_from_histograms(hist, ncls)
    if m:
        fix_grid = min(-(-m // tpb), max_blocks)
        bad = cuda.device_array(fix_grid, np.int64)
        _globalise_ranks[fix_grid, tpb, 0, tpb * _SHARED_ITEM](d_base, shift, mask, step, d_pos, hist, ranks, bad)
        n_bad = int(bad.copy_to_host().sum())
        if n_bad:
            raise ValueError(f"class_ranks needs strictly ascending positions inside the tensor; "
                             f"{n_bad} of {m} are not")
    if on_device:
        return ranks, sizes
    return ranks.copy_to_host(), sizes.copy_to_host()


def _walk_tables(n: int, mask: int, starts, class_offsets, ranks):
    """apply_ranked's and ranked_positions' tables on the device, checked: (starts, step, offsets, ranks)."""
    ncls = mask + 1
    d_starts = _table(starts, ncls, "starts")
    rows = d_starts.shape[0]
    if rows < 1:
        raise ValueError("starts has no rows")
    step = -(-n // rows)
    if step >= _FAR:
        raise ValueError(f"ranges of {step} elements are too long for the CUDA kernels (at most {_FAR - 1}); "
                         "use this backend's chunk_class_starts")
    d_offsets = _indices(class_offsets)
    if d_offsets.size != ncls + 1:
        raise ValueError(f"class_offsets has {d_offsets.size} entries, the class mask needs {ncls + 1}")
    d_ranks = _indices(ranks)
    if d_ranks.size >= 1 << 31:
        raise ValueError("more than 2**31 - 1 entries: per-class indices are int32 in shared memory")
    return d_starts, step, d_offsets, d_ranks


def _walk(d_base, shift, mask, wmask, step, d_starts, d_offsets, d_ranks, d_deltas, d_out, copy, where):
    """Launch the ranked walk; returns the number of entries placed."""
    tpb, _, _ = _launch_config()
    grid = _class_grid(d_starts.shape[0])
    applied = _zeros(grid, np.int64)
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
    _check_class_field(shift, mask)
    out_on_device = is_device_array(out)
    base, out = _arg(base), _arg(out)
    n = base.size
    if out.size != n:
        raise ValueError(f"out has {out.size} elements, base {n}")
    if n == 0:
        return 0
    width = np.dtype(base.dtype).itemsize
    if np.dtype(out.dtype).itemsize != width:
        raise ValueError(f"out has {np.dtype(out.dtype).itemsize}-byte elements, base {width}-byte ones")
    d_starts, step, d_offsets, d_ranks = _walk_tables(n, mask, starts, class_offsets, ranks)
    d_deltas = _zigzag_deltas(deltas)
    if d_deltas.size != d_ranks.size:
        raise ValueError(f"{d_deltas.size} deltas for {d_ranks.size} ranks")

    in_place = _address(out) == _address(base)
    d_base = _bits(base, signed64=True)
    if in_place:  # one buffer on the device too; a host one is copied back below
        d_out = d_base
    else:
        d_out = _bits(out, signed64=True) if out_on_device else cuda.device_array(n, d_base.dtype)
    applied = _walk(d_base, shift, mask, _width_mask(width), step, d_starts, d_offsets, d_ranks, d_deltas, d_out,
                    not in_place, None)
    if not out_on_device:
        if out.flags.c_contiguous:
            d_out.copy_to_host(_host_bits(out, signed64=True))
        else:
            out[...] = d_out.copy_to_host().view(out.dtype).reshape(out.shape)
    return applied


def ranked_positions(base, shift: int, mask: int, starts, class_offsets, ranks):
    """Where each (class, rank) entry lies in `base`: int64 positions in entry order (-1 for
    an entry apply_ranked would not apply), and how many were found. Device base in: the
    positions stay on the device."""
    _check_class_field(shift, mask)
    on_device = is_device_array(base)
    d_base = _bits(base, signed64=True)
    n = d_base.size
    d_starts, step, d_offsets, d_ranks = _walk_tables(max(n, 1), mask, starts, class_offsets, ranks)
    where = cuda.to_device(np.full(d_ranks.size, -1, np.int64))
    found = 0
    if n and d_ranks.size:
        found = _walk(d_base, shift, mask, 0, step, d_starts, d_offsets, d_ranks, d_ranks, d_base, False, where)
    return (where if on_device else where.copy_to_host()), found


# --- rank to position by tiles: locate_ranked on a device base ------------------------------
#
# The live apply's rank-to-position map (issue 35's GPU path), written to its byte budget: the base
# read twice (2 x 2 B per BF16 element), nothing sorted, no atomics on the hot classes, and a fixed
# number of barriers per tile of TILE elements, against ~31 B per element for the class sort
# (class_sort.py) and two barriers per 256 elements for the round walk above. Only the classes that
# have entries ("listed", at most TILE_LISTED of them; BF16 steps list ~20-40) are counted per thread:
#
#   _tile_listed_counts  thread t counts its TILE_ITEMS consecutive elements into its own column of
#       a shared (class, thread) table of uint16 (no atomics: a column is one thread's), the
#       unlisted classes into a shared histogram (rare classes: few atomics) added to their sizes in
#       global memory; then each warp sums rows of the table, its lanes reading adjacent columns
#       (conflict-free), into counts[tile, listed class].
#   _scan_columns        (above) turns counts into each tile's first rank per listed class, and
#       gives the listed classes' sizes.
#   _tile_entry_bounds   per (tile, listed class), the first entry whose rank is at or past the
#       tile's first rank (a binary search in the class's ranks): a tile's entries of a class are
#       [bound[tile], bound[tile + 1]).
#   _tile_locate         counts again, scans each row of the table into the threads' first ranks
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
_UNLISTED = 255


@cuda.jit(device=True, inline=True)
def _class_slot(bits, i, shift, mask, lut):
    # Element i's class and its row in the tile's table (_UNLISTED: a class the patch does not list).
    k = (int64(bits[i]) >> shift) & mask
    return k, int64(lut[k])


@cuda.jit(device=True, inline=True)
def _count_items(bits, shift, mask, lut, first, t, table, words, hist_at, count_unlisted):
    # Thread t's TILE_ITEMS consecutive elements from `first` into its column of `table` (row slot:
    # table[slot * TILE_THREADS + t]); unlisted classes, if counted, into words[hist_at + class]. A
    # warp's loads cover 512 consecutive elements, each 32-byte sector fetched once, then read from L1.
    n = bits.size
    for j in range(TILE_ITEMS):
        i = first + j
        if i < n:
            k, slot = _class_slot(bits, i, shift, mask, lut)
            if slot != _UNLISTED:
                table[slot * TILE_THREADS + t] += 1
            elif count_unlisted:
                cuda.atomic.add(words, hist_at + k, 1)


def _tile_shared_layout(nlisted: int) -> tuple[int, int]:
    """(dynamic shared bytes, int32 index of the words after the table) for a tile kernel: the
    (listed class, thread) table of uint16, then TILE_THREADS int32 of histogram and 256 of run sums.
    Dynamic shared memory only: every thread of a block sees one buffer, also under the simulator
    (whose static shared arrays are made per thread when threads race to create them)."""
    at = -(-nlisted * TILE_THREADS * 2 // 4)
    return (at + TILE_THREADS + _WARPS * 32) * 4, at


@cuda.jit(cache=True)
def _tile_listed_counts(bits, shift, mask, lut, nlisted, at, counts, unlisted):
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
        _count_items(bits, shift, mask, lut, tile * TILE + t * TILE_ITEMS, t, table, words, hist_at, True)
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
def _tile_entry_bounds(firsts, class_lo, class_hi, ranks, bounds):
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
            bounds[tile, slot] = _lower_bound(ranks, class_lo[slot], class_hi[slot], firsts[tile, slot])


@cuda.jit(cache=True)
def _tile_locate(bits, shift, mask, lut, nlisted, at, firsts, bounds, ranks, where):
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
        _count_items(bits, shift, mask, lut, first, t, table, words, at, False)
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
                slot = _class_slot(bits, i, shift, mask, lut)[1]
                if slot != _UNLISTED:
                    before = table[slot * TILE_THREADS + t]
                    table[slot * TILE_THREADS + t] = before + 1
                    rank = firsts[tile, slot] + before
                    lo = bounds[tile, slot]
                    hi = bounds[tile + 1, slot]
                    p = _lower_bound(ranks, lo, hi, rank)
                    if p < hi and ranks[p] == rank:
                        where[p] = i
        cuda.syncthreads()  # the table is read out before the next tile clears it


@cuda.jit(cache=True)
def _fill_int64(out, value):
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = value


@cuda.jit(cache=True)
def _settle_found(ranks, class_lo, where, found):
    # An entry whose rank is not above the previous entry's of its class (a damaged patch) is not
    # found, as on the other paths, so that a count of every entry means every rank rose; the found
    # ones are counted per thread, summed in the block, and added with one atomic per block.
    sh = cuda.shared.array(0, int64)
    count = int64(0)
    for p in range(cuda.grid(1), ranks.size, cuda.gridsize(1)):
        stalled = False
        if p > 0 and ranks[p] <= ranks[p - 1]:
            c = _lower_bound(class_lo, 0, class_lo.size, p)
            stalled = c == class_lo.size or class_lo[c] != p  # not its class's first entry
        if stalled:
            where[p] = -1
        elif where[p] >= 0:
            count += 1
    block = _block_sum(sh, count)
    if cuda.threadIdx.x == 0:
        cuda.atomic.add(found, 0, block)


def _scan_tile_counts(counts, nlisted: int):
    """In place: counts[tile, slot] -> the listed class's elements before the tile; returns the
    listed classes' sizes (host). torch's cumsum (CUB's scan) on a real GPU: the column scan
    kernel above takes 8 columns per block, too few blocks for a table of every tile's counts.
    The scan runs along the innermost dimension of the transposed table: torch scans an outer
    dimension with one thread per column walking every row (a few dozen threads for the whole
    table), the innermost one with a block per row (issue 45; not yet timed on a GPU). Bytes:
    the table read and written twice more by the transposes, 16 bytes per tile and class."""
    if _sort_on_gpu(counts):
        return exclusive_scan_tiles(_torch_of(counts).view(counts.shape)).cpu().numpy()
    return _starts_from_histograms(counts, nlisted).copy_to_host()


def _scan_tile_counts_on_device(counts, nlisted: int):
    """_scan_tile_counts with the listed classes' sizes left on the device (no synchronisation)."""
    if _sort_on_gpu(counts):
        return _as_cuda_array(exclusive_scan_tiles(_torch_of(counts).view(counts.shape)), sync=False)
    return _starts_from_histograms(counts, nlisted)


def exclusive_scan_tiles(table):
    """In place on a torch (tile, slot) table of counts: each entry becomes the sum of its column
    above it; returns the column totals. The scan runs along the innermost dimension of the
    transposed table (see _scan_tile_counts)."""
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

    _check_class_field(shift, mask)
    ncls = mask + 1
    if ncls > 256:
        return None
    d_base = _bits(base, signed64=True)
    d_ranks = _indices(ranks)
    m = d_ranks.size
    offsets = check_offsets(_device_view(class_offsets).copy_to_host() if is_device_array(class_offsets)
                            else class_offsets, ncls, m)
    listed = np.flatnonzero(np.diff(offsets) > 0)
    if listed.size > TILE_LISTED:
        return None
    n = d_base.size
    tpb, _, max_blocks = _launch_config()
    where = cuda.device_array(m, np.int64)  # filled on the device: nothing of size m crosses the bus
    if m:
        _fill_int64[min(-(-m // tpb), max_blocks), tpb](where, -1)
    sizes = np.zeros(ncls, np.int64)
    if n == 0:
        return where, 0, sizes
    lut = np.full(ncls, _UNLISTED, np.uint8)
    lut[listed] = np.arange(listed.size)
    d_lut = cuda.to_device(lut)
    tiles = -(-n // TILE)
    nlisted = max(1, listed.size)  # a section with no entries still counts its (unlisted) sizes
    # Every cell is written where a class is listed (no copy of zeros over the bus); else one column of zeros.
    counts = cuda.device_array((tiles, nlisted), np.int64) if listed.size else _zeros((tiles, 1), np.int64)
    unlisted = _zeros(ncls, np.int64)
    grid = min(tiles, max_blocks)
    shared, at = _tile_shared_layout(listed.size)
    _tile_listed_counts[grid, TILE_THREADS, 0, shared](d_base, shift, mask, d_lut, listed.size, at, counts, unlisted)
    listed_sizes = _scan_tile_counts(counts, nlisted)  # counts -> each tile's first ranks
    sizes = unlisted.copy_to_host()
    sizes[listed] = listed_sizes[:listed.size]
    if not m:
        return where, 0, sizes
    bounds = cuda.device_array((tiles + 1, nlisted), np.int64)
    d_lo = cuda.to_device(np.ascontiguousarray(offsets[listed], np.int64))
    d_hi = cuda.to_device(np.ascontiguousarray(offsets[listed + 1], np.int64))
    _tile_entry_bounds[min(-(-(tiles + 1) * nlisted // tpb), max_blocks), tpb](counts, d_lo, d_hi, d_ranks, bounds)
    _tile_locate[grid, TILE_THREADS, 0, shared](d_base, shift, mask, d_lut, listed.size, at, counts, bounds, d_ranks,
                                                where)
    found = _zeros(1, np.int64)
    _settle_found[min(-(-m // tpb), max_blocks), tpb, 0, tpb * _SHARED_ITEM](d_ranks, d_lo, where, found)
    return where, int(found.copy_to_host()[0]), sizes


def _sort_on_gpu(*arrays) -> bool:
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


def _torch_of(a):
    """A device array (or exporter) as a torch CUDA tensor over the same memory, as signed
    integers of its width (torch's unsigned types support few operations)."""
    import torch

    d = _device_view(a)
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
    _check_class_field(shift, mask)
    if is_device_array(base):
        tiled = tile_locate_ranked(base, shift, mask, class_offsets, ranks)
        if tiled is not None:
            return tiled
    if _sort_on_gpu(base):
        from pulsediff.kernels import class_sort

        ranks_t = _torch_of(ranks) if is_device_array(ranks) else ranks
        offsets = _device_view(class_offsets).copy_to_host() if is_device_array(class_offsets) else class_offsets
        where, found, sizes = class_sort.locate_ranked(_torch_of(base), shift, mask, offsets, ranks_t,
                                                       keys_of=_torch_class_keys)
        return _as_cuda_array(where), found, sizes.cpu().numpy()
    starts, sizes = chunk_class_starts(base, shift, mask)
    where, found = ranked_positions(base, shift, mask, starts, class_offsets, ranks)
    return where, found, sizes.copy_to_host() if hasattr(sizes, "copy_to_host") else sizes


@cuda.jit(cache=True)
def _class_keys(bits, shift, mask, keys):
    # Element i to thread i of a round: a warp reads 32 consecutive elements and writes 32
    # consecutive keys. Signed 8-byte views (signed64) make the shift arithmetic, as defined.
    for i in range(cuda.grid(1), bits.size, cuda.gridsize(1)):
        keys[i] = (int64(bits[i]) >> shift) & mask


def _torch_class_keys(bits, shift: int, mask: int):
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
    _check_class_field(shift, mask)
    sync = stream == 0
    d = _device_view(bits, sync) if is_device_array(bits) else bits
    d = _bits(d, signed64=True)
    k = _device_view(keys, sync) if is_device_array(keys) else cuda.to_device(np.ascontiguousarray(keys))
    if k.size != d.size:
        raise ValueError("class_keys needs as many keys as elements")
    if mask >= 1 << (8 * np.dtype(k.dtype).itemsize - (np.dtype(k.dtype).kind == "i")):
        raise ValueError("class_keys: the mask does not fit the keys' type")
    if d.size:
        tpb, _, max_blocks = _launch_config()
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
    _check_class_field(shift, mask)
    on_device = is_device_array(old) or is_device_array(new)
    if _sort_on_gpu(old) and is_device_array(new):
        return _diff_ranks_sorted(old, new, shift, mask)
    o, nw = _arg(old), _arg(new)
    if o.size != nw.size or np.dtype(o.dtype).itemsize != np.dtype(nw.dtype).itemsize:
        raise ValueError("diff_ranks needs arrays of equal length and element width")
    width = np.dtype(o.dtype).itemsize
    d_old = _bits(o, signed64=True)
    d_new = _bits(nw, signed64=True)
    positions, values = diff_compact(d_old, d_new)
    ranks, sizes = class_ranks(d_old, shift, mask, positions)
    m = positions.size
    zigzag = cuda.device_array(m, d_old.dtype)
    classes = cuda.device_array(m, np.uint16)
    if m:
        tpb, _, max_blocks = _launch_config()
        wmask = _width_mask(width)
        half = 0 if width == 8 else 1 << (8 * width - 1)
        if width == 8:
            values = values.view(np.int64)  # the kernel works in int64: same bits
        _zigzag_and_classes[min(-(-m // tpb), max_blocks), tpb](d_old, positions, values, shift, mask, wmask, half,
                                                                zigzag, classes)
    zigzag = zigzag.view(_UNSIGNED[width]) if width == 8 else zigzag
    if on_device:
        return zigzag, classes, ranks, sizes
    return zigzag.copy_to_host(), classes.copy_to_host(), ranks.copy_to_host(), sizes.copy_to_host()


def _diff_ranks_sorted(old, new, shift: int, mask: int):
    """diff_ranks for two tensors in GPU memory, by kernels.class_sort (one compare, one sort of
    the base's class keys per window); results on the device, in diff_ranks' dtypes."""
    import torch

    from pulsediff.kernels import class_sort

    o = _torch_of(old)
    zigzag, classes, ranks, sizes = class_sort.diff_ranks(o, _torch_of(new), shift, mask, keys_of=_torch_class_keys)
    signed = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[o.element_size()]
    zz = _as_cuda_array(zigzag.to(signed)).view(_UNSIGNED[o.element_size()])
    cls = _as_cuda_array(classes.to(torch.int16)).view(np.uint16)
    return zz, cls, _as_cuda_array(ranks), _as_cuda_array(sizes)


# --- files on the device: one window of a tensor at a time ---------------------------------


class _Buffers(threading.local):
    """Per thread: pinned host staging and device window buffers, grown as needed and kept
    (page-locked allocations cost milliseconds: one per window would eat the gain)."""

    def __init__(self):
        self.pinned: dict = {}
        self.device: dict = {}

    def get(self, kind: str, role: str, n: int, dtype):
        cache = self.pinned if kind == "pinned" else self.device
        key = (role, np.dtype(dtype).str)
        buf = cache.get(key)
        if buf is None or buf.size < n:
            size = max(n, 1)
            buf = cuda.pinned_array(size, dtype) if kind == "pinned" else cuda.device_array(size, dtype)
            cache[key] = buf
        return buf[:n]


_buffers = _Buffers()


def side_by_side() -> int:
    """0: apply rebuilds tensors one at a time, each spread over the device."""
    return 0


def resident(*arrays):
    """The arrays on the device (host ones uploaded once), for kernels called on them again and
    again: a tensor's decoded entries, used by every window of it."""
    out = []
    for a in arrays:
        if is_device_array(a):
            out.append(_device_view(a))
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
    _check_class_field(shift, mask)
    h_part = _host_bits(part, signed64=True)
    n = h_part.size
    if n == 0:
        return 0
    pinned = _buffers.get("pinned", "window", n, h_part.dtype)
    pinned[:] = h_part
    d = _buffers.get("device", "window", n, h_part.dtype)
    d.copy_to_device(pinned)
    hist, sizes = _device_class_starts(d, shift, mask, cuda.to_device(np.ascontiguousarray(seen, np.int64)))
    d_starts, step, d_offsets, d_ranks = _walk_tables(n, mask, hist, class_offsets, ranks)
    applied = _walk(d, shift, mask, _width_mask(h_part.dtype.itemsize), step, d_starts, d_offsets, d_ranks,
                    _zigzag_deltas(deltas), d, False, None)
    d.copy_to_host(pinned)
    _host_bits(out, signed64=True)[:] = pinned
    seen += sizes.copy_to_host()
    return applied


# --- word sums and in-place updates: patching live tensors -----------------------------

# FORMAT.md §3.1's sum64, with kernels.cpu's constants (one definition of the format).
from pulsediff.kernels.cpu import (DIGEST_CHUNK_BYTES, WORD_SUM_M1, WORD_SUM_M2, WORD_SUM_PHI,  # noqa: E402
                                  check_digest_chunk, xxh3_leaf)

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
    block = _block_sum(sh, total)
    if cuda.threadIdx.x == 0:
        partial[cuda.blockIdx.x] = block


def word_sum(data) -> int:
    """FORMAT.md §3.1's sum64 of the array's bytes, as an int in [0, 2**64): one read of
    the array on the device, a sum per block, the block sums added on the host.

    Byte budget: the array's bytes read once, 8 bytes per block written. An array that starts
    on an 8-byte boundary (every allocation does) is read as whole uint64 words, one coalesced
    8-byte load per word; the element-wise kernel (per_word loads and shifts a word) is left
    for views that start elsewhere. Launch: MAX_BLOCKS blocks of THREADS_PER_BLOCK, grid-stride."""
    d = _bits(_arg(data))
    width = np.dtype(d.dtype).itemsize
    per_word = 8 // width
    nwords = -(-d.size // per_word)
    if nwords == 0:
        return 0
    full = d.size // per_word
    if width < 8 and full and _address(d)[1] % 8 == 0:
        # Whole words read as what they are, one 8-byte load per word and thread (a 2-byte
        # element type would take four loads and shifts per word); the zero-padded last word,
        # if any, is summed on the host from its few bytes.
        total = word_sum(d[:full * per_word].view(np.uint64))
        if full < nwords:
            from pulsediff.kernels.cpu import word_term

            total += word_term(d[full * per_word:].copy_to_host().view(np.uint8), full)
        return total & 0xFFFFFFFFFFFFFFFF
    tpb, _, max_blocks = _launch_config()
    grid = min(-(-nwords // tpb), max_blocks)
    partial = cuda.device_array(grid, np.uint64)
    _word_sums[grid, tpb, 0, tpb * _SHARED_ITEM](d, per_word, 8 * width, nwords, partial)
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
            delta = ((z >> 1) & _INT64_MAX) ^ -(z & 1)  # un-zigzag
            out[p] = (int64(v) + delta) & wmask  # wraps modulo 2**width
        else:
            bad += 1
    total = _block_sum(sh, bad)
    if cuda.threadIdx.x == 0:
        bad_per_block[cuda.blockIdx.x] = total


def add_at(out, positions, deltas):
    """out[positions] += un-zigzagged deltas (mod 2**width), in place; returns the old values
    (for an undo log; on the device when `out` is) and how many positions were out of
    range (skipped, their old value 0). Positions must be distinct."""
    out_on_device = is_device_array(out)
    out, positions, deltas = _arg(out), _arg(positions), _arg(deltas)
    if positions.size != deltas.size:
        raise ValueError(f"{deltas.size} deltas for {positions.size} positions")
    width = np.dtype(out.dtype).itemsize
    m = positions.size
    if out_on_device:
        d_out = _bits(out, signed64=True)
    else:
        if not out.flags.c_contiguous:
            raise ValueError("a host `out` must be C-contiguous")
        flat = out.reshape(-1)
        d_out = cuda.to_device(_host_bits(flat, signed64=True))
    old = cuda.to_device(np.zeros(m, d_out.dtype))
    bad = 0
    if m:
        tpb, _, max_blocks = _launch_config()
        grid = min(-(-m // tpb), max_blocks)
        d_bad = cuda.device_array(grid, np.int64)
        _add_at[grid, tpb, 0, tpb * _SHARED_ITEM](d_out, _indices(positions), _zigzag_deltas(deltas),
                                                  _width_mask(width), old, d_bad)
        bad = int(d_bad.copy_to_host().sum())
    unsigned = old.view(_UNSIGNED[width]) if width == 8 else old
    if out_on_device:
        return unsigned, bad
    d_out.copy_to_host(_host_bits(flat, signed64=True))
    return unsigned.copy_to_host(), bad



# --- a live apply's tensor with one host synchronisation -----------------------------------
#
# locate_ranked, add_at and two word_sums cost a live apply about ten small pageable uploads,
# a dozen allocations and six host synchronisations per tensor; on an H200 the device was busy
# 69 ms of a 600 ms apply (docs/BENCHMARKS.md, GPU). locate_add_summed runs the same kernels
# one after another on the default stream: the entries go up in one asynchronous copy from
# pinned staging, the tables live in per-thread device buffers, and the found count, the class
# sizes, the out-of-range count and both word sums' block partials land in one small array read
# back once. The base is read three times more than by the locate alone (two word sums, the
# add's gather): 0.4 ms per 134M BF16 elements each, against the milliseconds of host round trips.


@cuda.jit(cache=True)
def _copy_into(src, dst):
    for i in range(cuda.grid(1), src.size, cuda.gridsize(1)):
        dst[i] = src[i]


def located_buffers(count: int, dtype):
    """`where` (int64, every entry -1: not found) and `old` (uninitialised, `dtype`'s bit
    type) for locate_add_summed, in device memory. Only found entries' old values are
    written or read (a roll-back's scatter skips position -1)."""
    where = cuda.device_array(count, np.int64)
    if count:
        tpb, _, max_blocks = _launch_config()
        _fill_int64[min(-(-count // tpb), max_blocks), tpb](where, -1)
    return where, cuda.device_array(count, _bits_dtype(dtype))


def _whole_words(d) -> bool:
    """Whether a flat device array can be read as uint64 words: 8-byte aligned, whole words."""
    return d.size * d.dtype.itemsize % 8 == 0 and _address(d)[1] % 8 == 0


def _word_sum_launch(d, partial) -> None:
    """word_sum's kernel over whole uint64 words of `d` (_whole_words), block sums into
    `partial` (uint64, _word_sum_grid(d) of them)."""
    tpb, _, _ = _launch_config()
    words = d.view(np.uint64)
    _word_sums[partial.size, tpb, 0, tpb * _SHARED_ITEM](words, 1, 64, words.size, partial)


def _word_sum_grid(d) -> int:
    tpb, _, max_blocks = _launch_config()
    return max(1, min(-(-(d.size * d.dtype.itemsize // 8) // tpb), max_blocks))


def word_sums(arrays) -> list:
    """word_sum of each array, the device arrays' launched one after another and their block
    sums read back in one copy (one host synchronisation for all, not one each)."""
    views = [_bits(_arg(a)) if is_device_array(a) else None for a in arrays]
    batched = [i for i, d in enumerate(views) if d is not None and d.size and _whole_words(d)]
    sums = [None] * len(views)
    if batched:
        grids = [_word_sum_grid(views[i]) for i in batched]
        partial = cuda.device_array(sum(grids), np.uint64)
        at = 0
        for i, g in zip(batched, grids):
            _word_sum_launch(views[i], partial[at:at + g])
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

    _check_class_field(shift, mask)
    if not is_device_array(base):
        raise ValueError("the CUDA locate_add_summed writes a base in device memory")
    ncls = mask + 1
    d_base = _bits(base, signed64=True)
    d_where, d_old = _indices(where), _device_view(old)
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
    if ncls > 256 or listed.size > TILE_LISTED or m == 0 or not _whole_words(d_base):
        return _locate_add_separately(base, shift, mask, offsets, ranks, deltas, d_where, d_old)
    try:
        return _locate_add_tiled(d_base, shift, mask, offsets, listed, ranks, deltas, d_where, d_old)
    except BaseException:
        cuda.synchronize()  # the staging buffer is this thread's next upload: no copy may still read it
        raise


def _locate_add_separately(base, shift, mask, class_offsets, ranks, deltas, d_where, d_old):
    before = word_sum(base)
    located, found, sizes = locate_ranked(base, shift, mask, class_offsets, ranks)
    tpb, _, max_blocks = _launch_config()
    grid = max(1, min(-(-d_where.size // tpb), max_blocks))
    located = _indices(located)
    if located.size:
        _copy_into[grid, tpb](located, d_where)
        olds, _ = add_at(base, d_where, deltas)
        _copy_into[grid, tpb](_device_view(olds), d_old.view(_UNSIGNED[d_old.dtype.itemsize]))
    return found, (word_sum(base) - before) & 0xFFFFFFFFFFFFFFFF, sizes


def _locate_add_tiled(d_base, shift, mask, offsets, listed, ranks, deltas, d_where, d_old):
    ncls, m, nlisted, n = mask + 1, d_where.size, listed.size, d_base.size
    tpb, _, max_blocks = _launch_config()
    ranks = np.ascontiguousarray(ranks).reshape(-1)
    deltas = np.ascontiguousarray(deltas).reshape(-1)
    if deltas.dtype.kind not in "iu" or ranks.dtype.kind not in "iu":
        raise ValueError("ranks and deltas must be integers")
    # Pinned staging, int64 words: ranks | listed classes' first entries | their ends | the class
    # -> table row map (ncls bytes) | the deltas' bytes. One asynchronous copy takes it all up.
    lut_at = m + 2 * nlisted
    deltas_at = lut_at + -(-ncls // 8)
    words = deltas_at + -(-deltas.nbytes // 8)
    stage = _buffers.get("pinned", "locate-add", words, np.int64)
    stage[:m] = ranks.view(np.int64) if ranks.dtype == np.uint64 else ranks
    stage[m:m + nlisted] = offsets[listed]
    stage[m + nlisted:lut_at] = offsets[listed + 1]
    raw = stage.view(np.uint8)
    raw[8 * lut_at:8 * lut_at + ncls] = _UNLISTED
    raw[8 * lut_at + listed] = np.arange(nlisted, dtype=np.uint8)
    raw[8 * deltas_at:8 * deltas_at + deltas.nbytes] = deltas.view(np.uint8)
    d_stage = _buffers.get("device", "locate-add", words, np.int64)
    d_stage.copy_to_device(stage, stream=cuda.default_stream())
    d_ranks, d_lo, d_hi = d_stage[:m], d_stage[m:m + nlisted], d_stage[m + nlisted:lut_at]
    d_raw = d_stage.view(np.uint8)
    d_lut = d_raw[8 * lut_at:8 * lut_at + ncls]
    d_deltas = _zigzag_deltas(d_raw[8 * deltas_at:8 * deltas_at + deltas.nbytes].view(_UNSIGNED[deltas.itemsize]))

    # One int64 array comes back: unlisted class sizes | found | listed class sizes | the add's
    # out-of-range count per block | the word sum's block sums before | after.
    grid_m = min(-(-m // tpb), max_blocks)
    grid_w = _word_sum_grid(d_base)
    found_at, sizes_at = ncls, ncls + 1
    before_at = sizes_at + nlisted + grid_m
    after_at = before_at + grid_w
    result = _buffers.get("device", "locate-add-result", after_at + grid_w, np.int64)
    _fill_int64[max(1, min(-(-sizes_at // tpb), max_blocks)), tpb](result[:sizes_at], 0)
    _word_sum_launch(d_base, result[before_at:after_at].view(np.uint64))

    tiles = -(-n // TILE)
    counts = _buffers.get("device", "tile-counts", tiles * nlisted, np.int64).reshape(tiles, nlisted)
    shared, at = _tile_shared_layout(nlisted)
    grid_t = min(tiles, max_blocks)
    _tile_listed_counts[grid_t, TILE_THREADS, 0, shared](d_base, shift, mask, d_lut, nlisted, at, counts,
                                                         result[:ncls])
    totals = _scan_tile_counts_on_device(counts, nlisted)
    _copy_into[1, tpb](totals, result[sizes_at:sizes_at + nlisted])
    bounds = _buffers.get("device", "tile-bounds", (tiles + 1) * nlisted, np.int64).reshape(tiles + 1, nlisted)
    _tile_entry_bounds[min(-(-(tiles + 1) * nlisted // tpb), max_blocks), tpb](counts, d_lo, d_hi, d_ranks, bounds)
    _tile_locate[grid_t, TILE_THREADS, 0, shared](d_base, shift, mask, d_lut, nlisted, at, counts, bounds, d_ranks,
                                                  d_where)
    _settle_found[grid_m, tpb, 0, tpb * _SHARED_ITEM](d_ranks, d_lo, d_where, result[found_at:sizes_at])
    old = d_old.view(np.int64) if d_old.dtype.itemsize == 8 else d_old
    _add_at[grid_m, tpb, 0, tpb * _SHARED_ITEM](d_base, d_where, d_deltas, _width_mask(d_base.dtype.itemsize), old,
                                                result[sizes_at + nlisted:before_at])
    _word_sum_launch(d_base, result[after_at:].view(np.uint64))

    host = result.copy_to_host()  # the one synchronisation: every launch above has finished
    sizes = host[:ncls].copy()
    sizes[listed] = host[sizes_at:sizes_at + nlisted]
    before = int(host[before_at:after_at].view(np.uint64).sum(dtype=np.uint64))
    after = int(host[after_at:].view(np.uint64).sum(dtype=np.uint64))
    return int(host[found_at]), (after - before) & 0xFFFFFFFFFFFFFFFF, sizes

# --- chunk digests: XXH3-128 of each chunk, a warp per chunk ---------------------------
#
# The device twin of kernels.cpu.chunk_digests, for a digest the GPU computes where the
# tensors live. XXH3's long-input path (Collet, xxHash 0.8, doc/xxhash_spec.md) keeps eight
# 64-bit accumulators over 64-byte stripes, 16 stripes to a 1 KiB block, and scrambles them
# after each block. Within a block the stripes' contributions are plain sums, so they can be
# taken in any order: a warp reads a block as four rounds of 256 contiguous bytes (lane l
# reads word l % 8 of stripe 4r + l // 8; every load coalesced), each lane adds its own
# stripe's term and its neighbour's word (the XXH3 lane swap, through shared memory), the four
# stripe groups are summed, and each lane scrambles accumulator l % 8. The chunk's last stripe
# (64 bytes that may start anywhere) is read byte by byte; lane 0 merges the accumulators.
#
# Byte budget: every byte of the array read once (four independent 8-byte loads per lane per
# block, the next block's issued before this one's sums), 16 bytes written per chunk. Chunks of
# 240 bytes or less take XXH3's other paths; only a tensor's last chunk can be that short, and its
# few bytes are hashed on the host.
# Blocks are one warp, so that the block barrier is the warp's (and the simulator's) own.

_XXH_SECRET = bytes.fromhex(  # XXH3's default secret (xxhash.h, XXH3_kSecret)
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671fcb79e64eccc0e578825ad07dccff7221"
    "b8084674f743248ee03590e6813a264c3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364eac5ac8334d3ebc3c581a0fffa1363eb"
    "170ddd51b7f0da49d316552629d4689e2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")


def _secret_words(offset: int, count: int) -> np.ndarray:
    return np.frombuffer(_XXH_SECRET[offset:offset + 8 * count], "<u8").astype(np.uint64)


# Keys per use: [0, 24) stripe s, lane i: word s + i (bytes 8s + 8i); scramble: word 16 + i;
# [24, 32) the last stripe (byte 121); [32, 40) and [40, 48) the low and high merges (11, 117).
_XXH_KEYS = np.concatenate([_secret_words(0, 24), _secret_words(121, 8), _secret_words(11, 8),
                            _secret_words(117, 8)])
_XXH_INIT = np.array([0xC2B2AE3D, 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                      0x85EBCA77C2B2AE63, 0x85EBCA77, 0x27D4EB2F165667C5, 0x9E3779B1], np.uint64)
_XXH_P32_1 = np.uint64(0x9E3779B1)
_XXH_P64_1 = np.uint64(0x9E3779B185EBCA87)
_XXH_P64_2 = np.uint64(0xC2B2AE3D27D4EB4F)
_XXH_MX1 = np.uint64(0x165667919E3779F9)
_LO32 = np.uint64(0xFFFFFFFF)
_U32 = np.uint64(32)
_U37 = np.uint64(37)
_U47 = np.uint64(47)
_XXH_TABLES: list = []  # _XXH_KEYS and _XXH_INIT on the device, uploaded at the first call
_XXH_SHORT = 240  # XXH3 hashes inputs up to this length another way
_WARP = 32


@cuda.jit(device=True)
def _xxh_term(v, key):
    # A lane's own term: the low and high halves of v ^ key multiplied (32 x 32 -> 64 bits).
    k = v ^ key
    return (k & _LO32) * (k >> _U32)


@cuda.jit(device=True)
def _xxh_fold(a, b):
    # The 128-bit product a * b, its halves xored (XXH3's mul128_fold64), from 32-bit halves.
    a0, a1, b0, b1 = a & _LO32, a >> _U32, b & _LO32, b >> _U32
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> _U32) + (p01 & _LO32) + (p10 & _LO32)
    high = p11 + (p01 >> _U32) + (p10 >> _U32) + (mid >> _U32)
    low = (mid << _U32) | (p00 & _LO32)
    return low ^ high


@cuda.jit(device=True)
def _xxh_avalanche(h):
    h ^= h >> _U37
    h *= _XXH_MX1
    return h ^ (h >> _U32)


@cuda.jit(device=True)
def _xxh_block_words(words, w0, b, full, n, group, li):
    # The lane's four words of 1 KiB block b (stripes group, group + 4, ...), zeros past the
    # stripes the block has (the last, partial block); and how many stripes it has.
    stripes = 16 if b < full else ((n - 1) - 1024 * full) // 64
    first = w0 + b * 128 + group * 8 + li
    v0 = words[first] if group < stripes else uint64(0)
    v1 = words[first + 32] if group + 4 < stripes else uint64(0)
    v2 = words[first + 64] if group + 8 < stripes else uint64(0)
    v3 = words[first + 96] if group + 12 < stripes else uint64(0)
    return v0, v1, v2, v3, stripes


@cuda.jit(cache=True)
def _chunk_xxh3(words, raw, nbytes, chunk, keys, init, out):
    sh = cuda.shared.array(0, uint64)  # four words per lane: the round's reads, then sums
    lane = cuda.threadIdx.x
    group, li = lane // 8, lane % 8
    for c in range(cuda.blockIdx.x, out.shape[0], cuda.gridDim.x):
        start = c * chunk
        n = min(chunk, nbytes - start)
        if n <= _XXH_SHORT:
            continue  # the host's (only a last chunk is this short)
        acc = init[li]
        full = (n - 1) // 1024
        w0 = start // 8
        v0, v1, v2, v3, stripes = _xxh_block_words(words, w0, 0, full, n, group, li)
        for b in range(full + 1):
            # The next block's loads are issued before this block's sums: two in flight.
            n0, n1, n2, n3, next_stripes = _xxh_block_words(words, w0, b + 1, full, n, group, li) \
                if b < full else (uint64(0), uint64(0), uint64(0), uint64(0), 0)
            sh[4 * lane] = v0
            sh[4 * lane + 1] = v1
            sh[4 * lane + 2] = v2
            sh[4 * lane + 3] = v3
            cuda.syncthreads()
            mate = 4 * (lane ^ 1)
            part = uint64(0)
            if group < stripes:
                part += _xxh_term(v0, keys[group + li]) + sh[mate]
            if group + 4 < stripes:
                part += _xxh_term(v1, keys[group + 4 + li]) + sh[mate + 1]
            if group + 8 < stripes:
                part += _xxh_term(v2, keys[group + 8 + li]) + sh[mate + 2]
            if group + 12 < stripes:
                part += _xxh_term(v3, keys[group + 12 + li]) + sh[mate + 3]
            cuda.syncthreads()
            sh[lane] = part
            cuda.syncthreads()
            acc += sh[li] + sh[8 + li] + sh[16 + li] + sh[24 + li]
            cuda.syncthreads()
            if b < full:
                acc ^= acc >> _U47
                acc ^= keys[16 + li]
                acc *= _XXH_P32_1
            v0, v1, v2, v3, stripes = n0, n1, n2, n3, next_stripes
        p = start + n - 64 + 8 * li  # the last stripe
        v = uint64(0)
        for j in range(8):
            v |= uint64(raw[p + j]) << uint64(8 * j)
        sh[lane] = v
        cuda.syncthreads()
        acc += _xxh_term(v, keys[24 + li]) + sh[lane ^ 1]
        cuda.syncthreads()
        sh[lane] = acc
        cuda.syncthreads()
        if lane == 0:
            low = uint64(n) * _XXH_P64_1
            high = ~(uint64(n) * _XXH_P64_2)
            for i in range(4):
                a0, a1 = sh[2 * i], sh[2 * i + 1]
                low += _xxh_fold(a0 ^ keys[32 + 2 * i], a1 ^ keys[33 + 2 * i])
                high += _xxh_fold(a0 ^ keys[40 + 2 * i], a1 ^ keys[41 + 2 * i])
            out[c, 0] = _xxh_avalanche(low)
            out[c, 1] = _xxh_avalanche(high)
        cuda.syncthreads()


def chunk_digests(data, chunk: int = DIGEST_CHUNK_BYTES) -> np.ndarray:
    """kernels.cpu.chunk_digests on the device: XXH3-128 of each `chunk` bytes of the array's
    bytes, as host rows of (low, high) uint64. A device array is read where it lives; only a
    last chunk of at most 240 bytes comes to the host. Launch: one warp per block, up to
    MAX_BLOCKS blocks, each taking chunks grid-stride."""
    check_digest_chunk(chunk)
    d = _bits(_arg(data))  # on the device: a host array is copied over
    nbytes = d.size * np.dtype(d.dtype).itemsize
    m = -(-nbytes // chunk)
    if m == 0:
        return np.empty((0, 2), np.uint64)
    if _address(d)[1] % 8:
        copy = cuda.device_array(d.size, d.dtype)  # words need 8-byte alignment: an odd view is copied
        copy.copy_to_device(d)
        d = copy
    raw = d.view(np.uint8)
    words = raw[:nbytes // 8 * 8].view(np.uint64)
    short_tail = nbytes - (m - 1) * chunk <= _XXH_SHORT
    out = np.zeros((m, 2), np.uint64)
    if m > 1 or not short_tail:
        _, _, max_blocks = _launch_config()
        d_out = cuda.device_array((m, 2), np.uint64)
        if not _XXH_TABLES:
            _XXH_TABLES.extend((cuda.to_device(_XXH_KEYS), cuda.to_device(_XXH_INIT)))
        keys, init = _XXH_TABLES
        _chunk_xxh3[min(m, max_blocks), _WARP, 0, _WARP * 4 * 8](words, raw, nbytes, chunk, keys, init, d_out)
        out = d_out.copy_to_host()
    if short_tail:
        out[m - 1] = xxh3_leaf(raw[(m - 1) * chunk:].copy_to_host().tobytes())
    return out


# Not on the device: the counting sort of the changed elements' classes (small, make side).
from pulsediff.kernels.cpu import class_major_order  # noqa: E402

__all__ = ["diff_compact", "scatter", "gaps_to_positions", "chunk_class_starts", "class_ranks", "apply_ranked",
           "diff_ranks", "class_major_order", "word_sum", "ranked_positions", "add_at", "resident", "ranked_window",
           "chunk_digests", "class_keys", "is_device_array"]


# --- the boundary: warnings kept in, CUDA stack failures made one line -----------------


def probe() -> None:
    """Compile (or load from the disk cache) one kernel, launch it and check its result: a stack
    that imports but cannot compile or launch fails here, as DeviceUnavailableError."""
    data = np.arange(1, 1000, dtype=np.uint16)
    from pulsediff.kernels.cpu import word_sum as cpu_word_sum

    if word_sum(data) != cpu_word_sum(data):
        raise DeviceUnavailableError("a test kernel gave a wrong result")


# Top-level packages whose exceptions are the CUDA stack's, not pulsediff's own checks.
_STACK_PACKAGES = ("numba", "numba_cuda", "cuda", "cuda_core", "cuda_bindings", "llvmlite")


def _from_cuda_stack(exc: BaseException) -> bool:
    """Whether the exception is a failure of the CUDA stack (driver, compile, launch,
    allocation) rather than of this module's own checks: by its type (CudaAPIError,
    CudaSupportError, numba's compile errors; torch's out-of-memory and accelerator errors, and
    torch's "CUDA error" RuntimeErrors, from the class-sort path), or by the module of the frame
    that raised it (numba-cuda raising a built-in exception, e.g. numpy 2.5's AttributeError)."""
    kind = type(exc)
    if kind.__module__.split(".")[0] in _STACK_PACKAGES:
        return True
    if kind.__module__.split(".")[0] == "torch":  # torch.OutOfMemoryError, torch.AcceleratorError
        return True
    if isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError) and "CUDA" in str(exc)):
        return True
    tb = exc.__traceback__
    module = None
    while tb is not None:
        module = tb.tb_frame.f_globals.get("__name__", "")
        tb = tb.tb_next
    return bool(module) and module.split(".")[0] in _STACK_PACKAGES


_quiet_categories: tuple = ()
_guard_lock = threading.RLock()


def _warning_categories() -> tuple:
    """Numba's warning base classes (numba's own and numba-cuda's copy): what `_guarded` keeps in."""
    global _quiet_categories
    if not _quiet_categories:
        found = []
        for module in ("numba.core.errors", "numba.cuda.core.errors"):
            try:
                found.append(importlib.import_module(module).NumbaWarning)
            except (ImportError, AttributeError):
                pass
        _quiet_categories = tuple(found)
    return _quiet_categories


def _guarded(fn):
    """An entry point that no Numba warning leaves (low-occupancy grids on small tensors say
    nothing a user can act on) and whose CUDA stack failures become DeviceUnavailableError with
    the cause in one line (the CLI shows it and exits 1; `auto` callers fall back)."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        # catch_warnings swaps process-wide state: one guarded call at a time, so two threads'
        # exits cannot interleave and leave the filters installed (re-entrant: entry points
        # call each other).
        with _guard_lock, warnings.catch_warnings():
            for category in _warning_categories():
                warnings.simplefilter("ignore", category)
            # The simulator runs kernels as Python on NumPy scalars, whose wrap-around in the
            # hashes' uint64 arithmetic NumPy reports; on a GPU it is the defined arithmetic.
            warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                if isinstance(exc, DeviceUnavailableError) or not _from_cuda_stack(exc):
                    raise
                raise DeviceUnavailableError(first_line(exc)) from exc

    call.__wrapped_kernel__ = fn
    return call


def _guard_entry_points() -> None:
    for name in KERNELS + ("device_bits", "probe", "locate_add_summed", "located_buffers", "word_sums"):
        globals()[name] = _guarded(globals()[name])


_guard_entry_points()
