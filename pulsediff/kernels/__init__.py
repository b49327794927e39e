"""Kernel backends and the one place that picks between them.

A backend is a module providing every function of the `Backend` contract
below, taking and returning NumPy arrays: `kernels.cpu` (serial Numba kernels
run on worker threads, see threads.py) and `kernels.cuda` (Numba CUDA, which
also takes device arrays and returns them, without copies). Codecs call kernels only through the backend
they are handed, never by importing one. Importing this package imports
neither backend, so `pulsediff --help` and CPU-only machines never pay for,
or fail on, CUDA.

`--device` (or the PULSEDIFF_DEVICE environment variable) chooses:
  auto  CUDA when a real GPU is usable, else CPU
  cpu   always the CPU kernels
  cuda  the CUDA kernels; a clear error when no GPU is usable
        (under NUMBA_ENABLE_CUDASIM=1 the simulator counts as usable, for tests)
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

from ..errors import DeviceUnavailableError, UsageError

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

    def add_at(self, out: "np.ndarray", positions: "np.ndarray",
               deltas: "np.ndarray") -> "tuple[np.ndarray, int]":
        """out[positions] += un-zigzagged deltas in place; the old values (an undo log) and the out-of-range count."""


KERNELS = tuple(name for name in vars(Backend) if not name.startswith("_"))


def cuda_usable() -> tuple[bool, str]:
    """(usable, reason) without raising: numba-cuda may be absent or the driver missing."""
    try:
        from numba import cuda
    except Exception as exc:  # numba-cuda not installed, or broken
        return False, f"numba CUDA support is not importable ({exc.__class__.__name__})"
    from numba import config

    simulated = bool(config.ENABLE_CUDASIM)  # numba reads the variable once, at import
    try:
        if cuda.is_available():
            return True, "simulator" if simulated else "gpu"
    except Exception as exc:
        return False, str(exc)
    return False, "numba.cuda.is_available() is False (no driver or no GPU)"


def _no_gpu_visible() -> bool:
    """Cheap check that spares CPU-only machines the ~0.8 s import of numba.cuda under --device auto."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0") or os.name != "posix" or not os.path.isdir("/dev"):
        return False
    # Linux drivers create /dev/nvidia*; WSL2 exposes GPUs as /dev/dxg.
    return not any(name.startswith("nvidia") or name == "dxg" for name in os.listdir("/dev"))


def get_backend(device: str | None = None) -> "Backend | ModuleType":
    device = str(device or os.environ.get("PULSEDIFF_DEVICE") or "auto").strip().lower()
    if device not in DEVICES:
        raise UsageError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    if device == "cpu" or (device == "auto" and _no_gpu_visible()):
        from . import cpu

        return cpu
    usable, reason = cuda_usable()
    if device == "cuda":
        if not usable:
            raise DeviceUnavailableError(reason)
        from . import cuda as cuda_backend

        return cuda_backend
    # auto: the simulator is for tests, never picked on its own.
    if usable and reason == "gpu":
        from . import cuda as cuda_backend

        return cuda_backend
    from . import cpu

    return cpu
