"""Kernel backends and the one place that picks between them.

A backend is a module providing every function of the `Backend` contract
below, taking and returning NumPy arrays: `kernels.cpu` (serial Numba kernels
run on worker threads, see threads.py) and `kernels.cuda` (Numba CUDA, which
also takes device arrays and returns them, without copies). Codecs call kernels only through the backend
they are handed, never by importing one. Importing this package imports
neither backend, so `pulsediff --help` and CPU-only machines never pay for,
or fail on, CUDA.

`--device` (or the PULSEDIFF_DEVICE environment variable) chooses:
  auto  where the data lives: the CPU for files and CPU tensors (`get_backend`),
        CUDA for tensors in GPU memory (`backend_for_gpu_data`), falling back
        to the CPU, with a one-line notice, when the CUDA stack cannot run
  cpu   always the CPU kernels
  cuda  the CUDA kernels; one clear error when they cannot run
        (under NUMBA_ENABLE_CUDASIM=1 the simulator counts as usable, for tests)
"""

from __future__ import annotations

import os
import sys
import threading
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

from ..errors import DeviceUnavailableError, UsageError
from ..notices import notice

if TYPE_CHECKING:
    import numpy as np

DEVICES = ("auto", "cpu", "cuda")


class Backend(Protocol):
    """What every backend module provides (tests/test_kernels.py checks both against this list and
    against the plain references in tests/reference.py, bit for bit)."""

    def diff_compact(self, old: "np.ndarray", new: "np.ndarray") -> "tuple[np.ndarray, np.ndarray]":
        """Ascending positions where the bit patterns differ, and the new values there."""

    def scatter(self, out: "np.ndarray", positions: "np.ndarray", values: "np.ndarray") -> int:
        """out[positions] = values; returns how many positions were out of range (then nothing is trusted)."""

    def gaps_to_positions(self, gaps: "np.ndarray") -> "tuple[np.ndarray, int]":
        """Positions from gaps (inclusive prefix sum - 1), and the count of invalid gaps."""

    def chunk_class_starts(self, base: "np.ndarray", shift: int, mask: int) -> "tuple[np.ndarray, np.ndarray]":
        """Per chunk and class, the elements of that class before the chunk; and the class sizes."""

    def class_ranks(self, base: "np.ndarray", shift: int, mask: int,
                    positions: "np.ndarray") -> "tuple[np.ndarray, np.ndarray]":
        """Each position's rank within its base class; and the class sizes."""

    def apply_ranked(self, base: "np.ndarray", shift: int, mask: int, starts: "np.ndarray",
                     class_offsets: "np.ndarray", ranks: "np.ndarray", deltas: "np.ndarray",
                     out: "np.ndarray") -> int:
        """out = base with zigzag deltas added at the listed (class, rank) elements; returns how many applied."""

    def diff_ranks(self, old: "np.ndarray", new: "np.ndarray", shift: int,
                   mask: int) -> "tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]":
        """make's compare fused with class_ranks: per changed element in position order, the
        zigzag delta (old's dtype), base class (uint16) and rank in class (int64); class sizes."""

    def class_major_order(self, classes: "np.ndarray", ncls: int) -> "np.ndarray":
        """The stable permutation grouping indices by class."""

    def side_by_side(self) -> int:
        """How many tensors a caller may rebuild at once, each on a worker thread of its own
        (`threads.pool()`); 0: one at a time, each spread over the backend's own parallelism."""

    def resident(self, *arrays: "np.ndarray") -> tuple:
        """The arrays where the kernels use them without a copy (uploaded once to a device)."""

    def ranked_window(self, part: "np.ndarray", shift: int, mask: int, seen: "np.ndarray",
                      class_offsets: "np.ndarray", ranks: "np.ndarray", deltas: "np.ndarray",
                      out: "np.ndarray") -> int:
        """apply_ranked on one window of a host tensor; `seen` holds (and gets) the class counts before it."""

    # Patching live tensors in place (pulsediff.live): each reads or writes the tensor where it lives.
    def word_sum(self, data: "np.ndarray") -> int:
        """FORMAT.md §3.1's sum64 of the array's bytes: the base and target check of a live apply."""

    def ranked_positions(self, base: "np.ndarray", shift: int, mask: int, starts: "np.ndarray",
                         class_offsets: "np.ndarray", ranks: "np.ndarray") -> "tuple[np.ndarray, int]":
        """apply_ranked's walk, noting where each (class, rank) entry lies (-1: not found); and how many were."""

    def locate_ranked(self, base: "np.ndarray", shift: int, mask: int, class_offsets: "np.ndarray",
                      ranks: "np.ndarray") -> "tuple[np.ndarray, int, np.ndarray]":
        """chunk_class_starts then ranked_positions, as each backend does them best: the
        entries' positions (-1: not found), how many were found, and the base's class sizes."""

    def add_at(self, out: "np.ndarray", positions: "np.ndarray",
               deltas: "np.ndarray") -> "tuple[np.ndarray, int]":
        """out[positions] += un-zigzagged deltas in place; the old values (an undo log) and the out-of-range count."""


KERNELS = tuple(name for name in vars(Backend) if not name.startswith("_"))


def cuda_usable() -> tuple[bool, str]:
    """(usable, reason) without raising: numba-cuda may be absent, broken, or find no driver.

    Usable means more than importable: the CUDA backend is imported and one small cached
    kernel is launched (`cuda_backend`), so a stack that imports but cannot compile or launch
    (a numpy numba-cuda does not support, a driver too old for the toolkit) is found here,
    before any work starts, not in the middle of it."""
    try:
        cuda_backend()
    except DeviceUnavailableError as exc:
        return False, exc.reason
    from numba import config

    return True, "simulator" if config.ENABLE_CUDASIM else "gpu"


_cuda_state: "tuple[ModuleType | None, str]" = (None, "")  # (backend, why not), once probed
_probe_lock = threading.Lock()


def cuda_backend() -> ModuleType:
    """The CUDA backend, proven able to compile and launch; DeviceUnavailableError naming the
    cause otherwise. Probed once per process: numba-cuda's import (~0.3 s), the context (~0.2 s)
    and the first kernel's load from the disk cache (~0.6 s) are paid here and only here, so
    nothing that stays on the CPU pays them."""
    global _cuda_state
    with _probe_lock:
        backend, reason = _cuda_state
        if backend is None and not reason:
            backend, reason = _probe_cuda()
            # A full device may have room again later: only lasting causes (no driver, a stack
            # that cannot import or compile) are remembered for the life of the process.
            if backend is not None or not _transient(reason):
                _cuda_state = (backend, reason)
    if backend is None:
        raise DeviceUnavailableError(reason)
    return backend


def _probe_cuda() -> "tuple[ModuleType | None, str]":
    try:
        from numba import cuda
    except Exception as exc:  # numba-cuda not installed, or broken at import
        return None, f"numba CUDA support is not importable ({_first_line(exc)})"
    from numba import config

    try:
        if not cuda.is_available():
            return None, "numba.cuda.is_available() is False (no driver or no GPU)"
    except Exception as exc:
        return None, _first_line(exc)
    try:
        from . import cuda as backend
    except Exception as exc:
        return None, f"pulsediff's CUDA kernels do not import ({_first_line(exc)})"
    if not config.ENABLE_CUDASIM:
        compile_notice(backend.__file__, "CUDA")
    try:
        backend.probe()  # compiles (first run on a machine) or loads one kernel and launches it
    except DeviceUnavailableError as exc:
        return None, exc.reason
    return backend, ""


def _transient(reason: str) -> bool:
    return "OUT_OF_MEMORY" in reason or "out of memory" in reason.lower()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{exc.__class__.__name__}: {text[0]}" if text else exc.__class__.__name__


def compile_notice(module_file: str, what: str) -> None:
    """Say once, on stderr, that Numba is about to compile `what` kernels, when the module's
    kernels have no entry in Numba's disk cache yet (the first run on a machine, or after an
    upgrade): the wait that follows is seconds, and a silent one looks like a hang. Only to a
    terminal: a pipe or a log gets no line it did not ask for (stderr stays one line per error)."""
    try:
        if not sys.stderr.isatty():
            return
    except (AttributeError, ValueError):
        return
    stem = os.path.splitext(os.path.basename(module_file))[0]
    # Numba caches beside the source, or only under NUMBA_CACHE_DIR when that is set.
    cache_dir = os.environ.get("NUMBA_CACHE_DIR")
    dirs = [cache_dir] if cache_dir else [os.path.join(os.path.dirname(module_file), "__pycache__")]
    for d in dirs:
        for _root, _sub, files in os.walk(d):
            if any(f.startswith(stem + ".") and f.endswith(".nbi") for f in files):
                return
    notice(f"compiling {what} kernels (the first run on this machine; they are cached for the next ones)")


def get_backend(device: str | None = None) -> "Backend | ModuleType":
    """The backend for work whose data lives in host memory (files, CPU tensors).

    `auto` is the CPU there: a CUDA compare or walk would first move every byte over PCIe
    and the results back, and measured through the CLI that made make and apply slower than
    the CPU (docs/BENCHMARKS.md, issue 27); nor does the CPU pay numba-cuda's start-up.
    `cuda` forces the CUDA kernels (DeviceUnavailableError, one line, when they cannot run).
    Work on tensors already in GPU memory chooses with `backend_for_gpu_data`."""
    device = parse_device(device)
    if device == "cuda":
        return cuda_backend()
    return cpu_backend()


_cpu_announced = False


def cpu_backend() -> ModuleType:
    """The CPU kernels; the first time in a process, a one-line notice if Numba has them in no
    disk cache yet (they then compile, seconds of silence otherwise)."""
    global _cpu_announced
    if not _cpu_announced:
        _cpu_announced = True
        compile_notice(os.path.join(os.path.dirname(__file__), "cpu.py"), "CPU")
    from . import cpu

    return cpu


def backend_for_gpu_data(device: str | None = None) -> "ModuleType | None":
    """The CUDA backend for tensors that live in GPU memory, or None where the caller must take
    its CPU way: `cpu` asked for, or `auto` with a CUDA stack that cannot run (said once, on
    stderr, with the cause). `cuda` with a stack that cannot run raises."""
    device = parse_device(device)
    if device == "cpu":
        return None
    try:
        return cuda_backend()
    except DeviceUnavailableError as exc:
        if device == "cuda":
            raise
        notice(f"CUDA kernels cannot run ({exc.reason}); using the CPU instead")
        return None


def parse_device(device: str | None) -> str:
    device = str(device or os.environ.get("PULSEDIFF_DEVICE") or "auto").strip().lower()
    if device not in DEVICES:
        raise UsageError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    return device
