"""What every CUDA kernel module shares: the launch settings (module-level, so tests can shrink
them and make tiny inputs cross tile and block boundaries; read at every call), host and device
arrays as the kernels take them, block-wide primitives, and per-thread staging buffers."""

from __future__ import annotations

import threading

import numpy as np
from numba import cuda



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

SHARED_ITEM = 8  # bytes per shared-memory slot (int64)
INT64_MAX = 0x7FFFFFFFFFFFFFFF
UNSIGNED = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}


def launch_config() -> tuple[int, int, int]:
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


def as_cuda_array(obj, sync: bool = True):
    """A Numba device array over an exporter's memory (no copy). Kernels read bit patterns, so
    a typestr that is not an integer (torch's bfloat16 `<V2`, floats) is imported as the
    unsigned integers of its width. `sync`: wait for the stream the exporter names (a host
    synchronisation), unless the caller orders its launches after that stream's work itself."""
    iface = dict(obj.__cuda_array_interface__)
    dtype = np.dtype(iface["typestr"])
    if dtype.kind not in "iu":
        iface["typestr"] = bits_dtype(dtype).str
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


def device_view(a, sync: bool = True):
    """`a` (already on the device) as a flat Numba device array over the same memory."""
    d = a if getattr(a, "__cuda_ndarray__", False) else as_cuda_array(a, sync)
    if d.size and not d.is_c_contiguous():
        raise ValueError("device arrays must be C-contiguous: a strided one could only be used through a copy")
    return d if d.ndim == 1 else d.ravel()


def as_arg(a):
    """An array argument as something with NumPy's attributes: a flat device view of a device
    array (torch's `.size` is a method), else the host array itself."""
    return device_view(a) if is_device_array(a) else np.asarray(a)


def device_bits(a):
    """A device array or `__cuda_array_interface__` exporter (a torch CUDA tensor viewed as
    integers) as a flat Numba device array of unsigned bit patterns over the same memory."""
    return as_bits(a)


def bits_dtype(dtype, signed64: bool = False) -> np.dtype:
    width = np.dtype(dtype).itemsize
    if width not in UNSIGNED:
        raise ValueError(f"elements of {width} bytes have no bit-pattern type (1, 2, 4 or 8 bytes)")
    # 8-byte classes are computed as the CPU does, np.int64(bits) >> shift (arithmetic):
    # the kernel gets an int64 view, so the conversion is the identity.
    return np.dtype(np.int64) if signed64 and width == 8 else UNSIGNED[width]


def as_bits(a, signed64: bool = False):
    """`a`'s elements as bit patterns on the device: a view of a device array, a copy of a host one."""
    if is_device_array(a):
        d = device_view(a)
        want = bits_dtype(d.dtype, signed64)
        return d if d.dtype == want else d.view(want)
    h = np.ascontiguousarray(a).reshape(-1)
    return cuda.to_device(h.view(bits_dtype(h.dtype, signed64)))


def host_bits(a, signed64: bool = False) -> np.ndarray:
    """A flat host view (or a contiguous copy) of `a` with the kernels' bit-pattern dtype."""
    h = np.ascontiguousarray(a).reshape(-1)
    return h.view(bits_dtype(h.dtype, signed64))


def as_indices(a):
    """int64 indices on the device. uint64 is reinterpreted, so values >= 2**63 turn negative
    and count as out of range, as on the CPU backend."""
    if is_device_array(a):
        d = device_view(a)
        if d.dtype.kind not in "iu" or d.dtype.itemsize != 8:
            raise ValueError(f"device index arrays must be int64, not {d.dtype}")
        return d if d.dtype == np.int64 else d.view(np.int64)
    h = np.ascontiguousarray(a).reshape(-1)
    h = h.view(np.int64) if h.dtype == np.uint64 else h.astype(np.int64, copy=False)
    return cuda.to_device(h)


def as_table(a, ncols: int, what: str):
    """A 2-D int64 table (`starts`) on the device."""
    if is_device_array(a):
        d = a if getattr(a, "__cuda_ndarray__", False) else as_cuda_array(a)
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


def address_of(a) -> tuple[bool, int]:
    """(on the device, address of the first element): two arrays alias when both agree."""
    if is_device_array(a):
        iface = getattr(a, "__cuda_array_interface__", None)
        if iface is None:  # a simulated device array: host memory inside
            iface = a.__array_interface__
        return True, iface["data"][0]
    return False, np.asarray(a).__array_interface__["data"][0]


def zeros(shape, dtype):
    return cuda.to_device(np.zeros(shape, dtype))


def zigzag_deltas(deltas):
    """Zigzag-coded deltas on the device, as the kernels read them: unsigned integers, 8-byte
    ones as int64 (the kernels un-zigzag in int64: same bits)."""
    d = device_view(deltas) if is_device_array(deltas) else cuda.to_device(np.ascontiguousarray(deltas).reshape(-1))
    if d.dtype.kind not in "iu":
        raise ValueError(f"deltas must be unsigned integers, not {d.dtype}")
    return d.view(np.int64) if d.dtype.itemsize == 8 and d.dtype != np.int64 else d


def width_mask(width: int) -> int:
    """The mask that wraps int64 arithmetic to `width`-byte elements (-1: all 64 bits)."""
    return -1 if width == 8 else (1 << (8 * width)) - 1


# --- block-wide primitives ---------------------------------------------------
# Both must be called by every thread of the block (they contain barriers), and
# both end with a barrier so the caller may reuse `sh` straight away.


@cuda.jit(device=True)
def block_sum(sh, value):
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
def block_inclusive_scan(sh, value):
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


@cuda.jit(device=True)
def lower_bound(values, lo, hi, target):
    """The first index in [lo, hi) of ascending `values` whose value is >= target (hi if none)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if values[mid] < target:
            lo = mid + 1
        else:
            hi = mid
    return lo


@cuda.jit(cache=True)
def fill_int64(out, value):
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = value


# --- files on the device: one window of a tensor at a time ---------------------------------


class Buffers(threading.local):
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


buffers = Buffers()



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
def copy_into(src, dst):
    for i in range(cuda.grid(1), src.size, cuda.gridsize(1)):
        dst[i] = src[i]
