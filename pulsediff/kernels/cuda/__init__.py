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

The kernels are proven under the simulator (correctness, not speed) and run on
H100 and H200 GPUs; `scripts/gpu_check.sh` tests and times them where a GPU is
lent (docs/BENCHMARKS.md, GPU).

Modules
-------
  common    launch settings (tests shrink them here), host and device arrays,
            block-wide primitives, per-thread staging buffers
  compact   diff_compact, scatter, gaps_to_positions
  ranks     the base-context kernels by ranges; a file's tensor by windows
  tiles     a device base's locate by tiles, the class sort path, diff_ranks
  inplace   word sums, add_at, locate_add_summed (live tensors)
  digests   XXH3-128 chunk digests
This package re-exports the `kernels.Backend` contract and guards each entry
point (the boundary below).

Importing this module needs no GPU; kernels compile on first call.
"""

from __future__ import annotations

import functools
import importlib
import threading
import warnings

import numpy as np

from pulsediff.errors import DeviceUnavailableError
from pulsediff.kernels.contract import KERNELS, first_line
from pulsediff.kernels.cpu import class_major_order  # make's counting sort of classes stays on the host
from pulsediff.kernels.cuda import inplace
from pulsediff.kernels.cuda.common import device_bits, is_device_array
from pulsediff.kernels.cuda.compact import diff_compact, gaps_to_positions, scatter
from pulsediff.kernels.cuda.digests import chunk_digests
from pulsediff.kernels.cuda.inplace import add_at, locate_add_summed, located_buffers, word_sum, word_sums
from pulsediff.kernels.cuda.ranks import (apply_ranked, chunk_class_starts, class_ranks, ranked_positions,
                                          ranked_window, resident, side_by_side)
from pulsediff.kernels.cuda.tiles import (TILE, TILE_LISTED, TILE_THREADS, class_keys, diff_ranks,
                                          exclusive_scan_tiles, locate_ranked, tile_locate_ranked)

__all__ = ["diff_compact", "scatter", "gaps_to_positions", "chunk_class_starts", "class_ranks", "apply_ranked",
           "diff_ranks", "class_major_order", "word_sum", "ranked_positions", "add_at", "resident", "ranked_window",
           "chunk_digests", "class_keys", "is_device_array", "side_by_side", "locate_ranked", "device_bits",
           "locate_add_summed", "located_buffers", "word_sums", "exclusive_scan_tiles", "tile_locate_ranked",
           "TILE", "TILE_LISTED", "TILE_THREADS", "CACHED_MODULE_FILE", "probe"]

# The module whose kernel `probe` compiles: its entry in Numba's disk cache says whether a first
# run here will compile (kernels.compile_notice).
CACHED_MODULE_FILE = inplace.__file__


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
