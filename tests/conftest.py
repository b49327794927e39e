"""Test-session setup shared by every test module.

The CUDA kernels are tested on machines without a GPU through Numba's CUDA
simulator, which Numba reads from the environment once, when `numba` is first
imported. So this must run before anything imports numba, which is why it is
at the top level of conftest.py (pytest imports it before any test module).

`setdefault`, not assignment: a CI job with a real GPU can run the same tests
on the hardware with NUMBA_ENABLE_CUDASIM=0.
"""

import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
# Some sandboxes set PYTHONDONTWRITEBYTECODE: then every CLI a test starts compiles pulsediff from source again
# (tens of ms a process, hundreds of processes). The children here keep bytecode as a user's Python does.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

import signal

import pytest

# A test run started in the background by a non-interactive shell (`cmd &`, nohup) inherits SIGINT
# ignored, and so would every pulsediff it starts: the Ctrl-C tests would then test nothing but
# that. A handler here (not SIG_IGN) means children start with the default and install their own.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def fresh_pool(monkeypatch):
    """The worker pool made anew for this test, with as many threads as PULSEDIFF_THREADS says when
    the test first uses it (a pool already made keeps its size whatever the variable says later),
    and shut down after it."""
    from pulsediff.kernels import threads

    monkeypatch.setattr(threads, "_pool", None)
    yield
    if threads._pool is not None:
        threads._pool[1].shutdown()
