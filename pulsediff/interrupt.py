"""Ctrl-C that cannot be lost on the way to a commit.

Python raises SIGINT as KeyboardInterrupt in whatever frame runs; when that
frame is a finalizer (weakref.finalize, __del__, a GC callback) the exception
is swallowed with an "Exception ignored in ..." message and the work goes on,
to finish and commit its output as if nothing happened. The CLI's handler
therefore also records the interrupt here, and every commit point
(atomic.StagedFiles.commit) calls `check()`, so an interrupt swallowed on
the way still stops the command before its output becomes visible.
"""

from __future__ import annotations

import signal
import sys

# What an interrupted command says (after "pulsediff: "), wherever the interrupt landed.
MESSAGE = "interrupted; no partial output was left"

_seen = False
_previous: list = []  # (SIGINT handler, unraisable hook) to put back when the command is over


def _handler(signum, frame) -> None:
    global _seen
    _seen = True
    raise KeyboardInterrupt


def _unraisable(info) -> None:
    if issubclass(info.exc_type, KeyboardInterrupt):
        return  # recorded by _handler; check() raises it where it cannot be swallowed
    sys.__unraisablehook__(info)


def install() -> None:
    """Record Ctrl-C (unless SIGINT is ignored, as under nohup) and keep swallowed ones quiet."""
    global _seen
    _seen = False
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        _previous[:] = [signal.default_int_handler, sys.unraisablehook]
        signal.signal(signal.SIGINT, _handler)
        sys.unraisablehook = _unraisable


def check() -> None:
    """Raise KeyboardInterrupt if Ctrl-C was pressed, even if its first raise was swallowed."""
    if _seen:
        raise KeyboardInterrupt


def done() -> None:
    """The command is over: put back what `install` replaced (the CLI also runs in-process, in tests)."""
    if _previous and signal.getsignal(signal.SIGINT) is _handler:
        handler, hook = _previous
        signal.signal(signal.SIGINT, handler)
        sys.unraisablehook = hook
        _previous.clear()
