"""Memory that does not fault page by page.

On the VM these tools were measured on, fresh memory is expensive: filling
1 GiB of new `np.empty` memory page by page took 0.2 to 2.8 s (medians 1.0
and 1.9 s in two runs), against 0.5 s for a buffer whose pages were mapped in
one call (docs/benchmarks-log.md, "Memory
and writes"; scripts/bench_memory.py), and `cp` of a 1 GB checkpoint takes
0.37 s. Linux (5.14+) can map a whole range in one call
(MADV_POPULATE_WRITE / MADV_POPULATE_READ), and large anonymous buffers can
use 2 MiB pages (MADV_HUGEPAGE; but see fresh_buffer). For a file already in the page cache the
kernel maps pages around each fault anyway, so populating a mapped tensor
gains little (0.04 s against 0.01 s per GiB); it is kept because it costs
nothing. All are hints: where the kernel or the platform lacks them,
everything works as before, only slower.

- `populate_read(map, start, length)`: before a tensor of a memory-mapped
  checkpoint is read.
- `Scratch`: buffers kept from tensor to tensor, so each is faulted in once
  (in bulk) for the largest tensor instead of once per tensor.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np

# Numeric values from Linux's uapi/asm-generic/mman-common.h, for Pythons whose
# mmap module predates the constants.
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)

# Below this, malloc's memory is reused anyway and a map of its own is not worth it.
_MIN_MAPPED = 1 << 20


def _libc_madvise():
    """libc's madvise through ctypes (Linux only: the advice numbers above are Linux's), or None."""
    global _madvise
    if _madvise is None:
        _madvise = False
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(None, use_errno=True).madvise
                fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
                _madvise = fn
            except (OSError, AttributeError):
                pass
    return _madvise or None


_madvise = None


def _advise(mapped: mmap.mmap, advice: int, start: int = 0, length: int | None = None) -> None:
    # Called through ctypes, which lets go of the GIL for the call: mmap.madvise
    # holds it, and a MADV_POPULATE_READ that reads a tensor from disk then
    # stopped every other thread of the process for as long (measured: a thread
    # spinning in Python ran at 2% of its speed during a 2 GiB populate). make's
    # read-ahead thread did exactly that, so its hashing and compares waited on
    # the disk they were meant to overlap.
    if length is None:
        start, length = 0, len(mapped)
    if length <= 0:
        return
    madvise = _libc_madvise()
    if madvise is not None:
        view = np.frombuffer(mapped, np.uint8, count=length, offset=start)  # its address; no copy
        try:
            madvise(view.ctypes.data, length, advice)  # -1 on an older kernel: then it was only a hint
        finally:
            del view  # an exported buffer would keep the map from closing
        return
    if not hasattr(mapped, "madvise"):  # not a platform with madvise
        return
    try:
        mapped.madvise(advice, start, length)
    except (OSError, ValueError, OverflowError):
        pass  # an older kernel: the pages fault in one at a time, as without the hint


# Below this, a range is left to fault in: a few faults (the kernel maps 16 pages around each)
# cost less than the madvise call, about 20 us from Python (18k expert tensors: 0.35 s).
POPULATE_MIN_BYTES = 256 * 1024


def populate_read(mapped: mmap.mmap | None, start: int, length: int) -> None:
    """Map the pages of [start, start + length) of a read-only file mapping in one call (a range of
    less than POPULATE_MIN_BYTES faults in as it is read)."""
    if mapped is None or length < POPULATE_MIN_BYTES:
        return
    aligned = start - start % mmap.PAGESIZE
    end = min(len(mapped), start + length)
    if end > aligned:
        _advise(mapped, MADV_POPULATE_READ, aligned, end - aligned)


def unmap_pages(mapped: mmap.mmap | None, start: int, length: int) -> None:
    """Drop this process's mapping of the pages of [start, start + length) of a read-only file
    mapping (MADV_DONTNEED): they stay in the page cache, and a later access maps them again.

    A file streamed through a mapping keeps every page it touched mapped; on a
    pair larger than memory the kernel then reclaims mapped pages, which costs
    far more than reclaiming unmapped ones (make's hashing of the 7B pair: 11
    s of CPU with its pages dropped after use, against 17 s without).
    """
    if mapped is None or length <= 0:
        return
    aligned = start - start % mmap.PAGESIZE
    end = min(len(mapped), start + length)
    if end > aligned:
        _advise(mapped, MADV_DONTNEED, aligned, end - aligned)


def fresh_buffer(nbytes: int) -> np.ndarray:
    """A writable uint8 array of `nbytes`, its pages already mapped.

    The map is Python's default for anonymous memory, MAP_SHARED: shared
    memory (the process's RssShmem, not RssAnon), which Linux backs with 2 MiB
    pages only where shmem huge pages are on (commonly "never"), so the
    MADV_HUGEPAGE below is usually a no-op. A MAP_PRIVATE map does get huge
    pages and populates 6x faster (256 MiB in 0.022 against 0.135 s), but only
    once the process has some: the first one cost 0.48 to 0.57 s in every new
    process (compaction, machine C of docs/BENCHMARKS.md), more than a whole
    short apply saves, so the shared map stays.
    """
    if nbytes < _MIN_MAPPED:
        return np.empty(nbytes, np.uint8)
    mapped = mmap.mmap(-1, nbytes)
    _advise(mapped, MADV_HUGEPAGE)
    _advise(mapped, MADV_POPULATE_WRITE)
    return np.frombuffer(mapped, np.uint8)  # the array keeps the map alive


class Scratch:
    """Named buffers reused from tensor to tensor.

    Each `slot` holds one buffer, grown when a larger tensor needs it. What
    `take` returns stays valid until the next `take` of the same slot: use a
    slot per array that must live at the same time.
    """

    def __init__(self) -> None:
        self._bufs: dict[str, np.ndarray] = {}
        self._turn = 0  # which of `alternate`'s two buffers comes next

    def take(self, count: int, dtype, slot: str = "out") -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = count * dtype.itemsize
        buf = self._bufs.get(slot)
        if buf is None or buf.nbytes < nbytes:
            buf = self._bufs[slot] = fresh_buffer(nbytes)
        return buf[:nbytes].view(dtype)

    def alternate(self, count: int, dtype, slot: str) -> np.ndarray:
        """`take` from two buffers in turn: what one call returns stays valid through the next
        call (a writer may still be reading it while the next is filled)."""
        self._turn ^= 1
        return self.take(count, dtype, f"{slot}/{self._turn}")

    def take_copy(self, base: np.ndarray) -> np.ndarray:
        """A copy of `base` in the "out" slot; no copy at all when `base` already is that buffer
        (a chain decodes each link in place over the previous link's output)."""
        out = self.take(base.size, base.dtype)
        if out.__array_interface__["data"][0] != base.__array_interface__["data"][0]:
            np.copyto(out, base)
        return out
