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

from pulsediff.errors import DeviceUnavailableError, UsageError
from pulsediff.runtime.notices import notice
from pulsediff.kernels.contract import KERNELS, Backend, first_line  # noqa: F401 (re-exported: the contract's names)

DEVICES = ("auto", "cpu", "cuda")


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
        return None, f"numba CUDA support is not importable ({first_line(exc)})"
    from numba import config

    try:
        if not cuda.is_available():
            return None, "numba.cuda.is_available() is False (no driver or no GPU)"
    except Exception as exc:
        return None, first_line(exc)
    try:
        from pulsediff.kernels import cuda as backend
    except Exception as exc:
        return None, f"pulsediff's CUDA kernels do not import ({first_line(exc)})"
    if not config.ENABLE_CUDASIM:
        compile_notice(backend.CACHED_MODULE_FILE, "CUDA")
    try:
        backend.probe()  # compiles (first run on a machine) or loads one kernel and launches it
    except DeviceUnavailableError as exc:
        return None, exc.reason
    return backend, ""


def _transient(reason: str) -> bool:
    return "OUT_OF_MEMORY" in reason or "out of memory" in reason.lower()


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
    from pulsediff.kernels import cpu

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
