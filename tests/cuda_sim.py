"""Shared by the CUDA kernel tests: small launches and a fast simulator.

Under NUMBA_ENABLE_CUDASIM=1 every CUDA thread is a Python thread, so the tests
shrink the launch settings (module-level in pulsediff.kernels.cuda.common) to make
small inputs span many tiles and blocks.
"""

from __future__ import annotations

import contextlib
import os
import sys

# With 8 threads and 2 items a tile is 16 elements, and 4 blocks cover at most
# 64 of them per sweep.
SMALL_LAUNCH = dict(THREADS_PER_BLOCK=8, ITEMS_PER_THREAD=2, MAX_BLOCKS=4)


@contextlib.contextmanager
def launch_config(module, **settings):
    """Set module-level launch settings for the block, then put the old values back."""
    saved = {k: getattr(module, k) for k in settings}
    for k, v in settings.items():
        setattr(module, k, v)
    try:
        yield module
    finally:
        for k, v in saved.items():
            setattr(module, k, v)


@contextlib.contextmanager
def fast_simulator():
    # The simulator's block manager busy-polls its threads at each barrier; with the
    # default 5 ms GIL switch interval every syncthreads costs milliseconds. A shorter
    # interval makes the CUDA tests several times faster.
    saved = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        yield
    finally:
        sys.setswitchinterval(saved)


def real_gpu_present() -> bool:
    """A GPU driver's device nodes exist (Linux /dev/nvidia*, WSL2 /dev/dxg): tests that expect
    `--device cuda` to fail for want of a GPU are skipped there. Needs no numba import."""
    try:
        return any(name.startswith("nvidia") or name == "dxg" for name in os.listdir("/dev"))
    except OSError:
        return False
