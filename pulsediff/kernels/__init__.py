"""Kernel backends and the one place that picks between them.

A backend is a module with the same three functions (`diff_compact`,
`scatter`, `gaps_to_positions`) taking and returning NumPy arrays:
`kernels.cpu` (Numba parallel CPU) and `kernels.cuda` (Numba CUDA). Importing
this package imports neither, so `pulsediff --help` and CPU-only machines
never pay for, or fail on, CUDA.

`--device` (or the PULSEDIFF_DEVICE environment variable) chooses:
  auto  CUDA when a real GPU is usable, else CPU
  cpu   always the CPU kernels
  cuda  the CUDA kernels; a clear error when no GPU is usable
        (under NUMBA_ENABLE_CUDASIM=1 the simulator counts as usable, for tests)
"""

from __future__ import annotations

import os
from types import ModuleType

from ..errors import DeviceUnavailableError, UsageError

DEVICES = ("auto", "cpu", "cuda")


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


def get_backend(device: str | None = None) -> ModuleType:
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
