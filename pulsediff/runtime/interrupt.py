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

import contextlib
import os
import signal
import sys

# What an interrupted command says (after "pulsediff: "), wherever the interrupt landed.
MESSAGE = "interrupted; no partial output was left"

_seen = False
_previous: list = []  # (SIGINT handler, unraisable hook) to put back when the command is over
_deferring = 0  # inside `deferred()`: Ctrl-C is recorded, raised when the block is over
_committed: list = [None, 0, None]  # the first output this command made visible, how many, their folder


def _handler(signum, frame) -> None:
    global _seen
    _seen = True
    if not _deferring:
        raise KeyboardInterrupt


@contextlib.contextmanager
def deferred():
    """A block Ctrl-C must not cut in two (the renames that make outputs visible): an interrupt
    during it is recorded and raised by the next `check()`, once the block is whole."""
    global _deferring
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1


def committed(path: str) -> None:
    """An output is now visible in full: an interrupt from here on must not say otherwise."""
    folder = os.path.dirname(path)
    if _committed[0] is None:
        _committed[:] = [path, 0, folder]
    elif _committed[2] != folder:
        _committed[2] = None
    _committed[1] += 1


def message() -> str:
    """What an interrupted command says: nothing was left, or which outputs were already complete."""
    first, count, folder = _committed
    if first is None:
        return MESSAGE
    if count == 1:
        return f"interrupted after {first} was written in full (it is complete)"
    if folder:  # a sharded checkpoint's files, in place
        return f"interrupted after {folder} was updated in full ({count} files; it is complete)"
    return f"interrupted after {first} and {count - 1} more were written in full (they are complete)"


def _unraisable(info) -> None:
    if issubclass(info.exc_type, KeyboardInterrupt):
        return  # recorded by _handler; check() raises it where it cannot be swallowed
    sys.__unraisablehook__(info)


def install() -> None:
    """Record Ctrl-C (unless SIGINT is ignored, as under nohup) and keep swallowed ones quiet."""
    global _seen
    _seen = False
    _committed[:] = [None, 0, None]
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        _previous[:] = [signal.default_int_handler, sys.unraisablehook]
        signal.signal(signal.SIGINT, _handler)
        sys.unraisablehook = _unraisable


def check() -> None:
    """Raise KeyboardInterrupt if Ctrl-C was pressed, even if its first raise was swallowed."""
    if _seen:
        raise KeyboardInterrupt


def done(final: bool = False) -> None:
    """The command is over: put back what `install` replaced (the CLI also runs in-process, in tests).

    `final`: the process exits next, and a Ctrl-C from here on is ignored. Put back, Python's own
    handler would raise KeyboardInterrupt into the exit (a traceback), and once the interpreter's
    shutdown resets SIGINT to its default the signal itself would end the process (exit -2, no
    word) after the command had finished and said so. One call swaps our handler for SIG_IGN, so
    no moment is left between the two."""
    if _previous and signal.getsignal(signal.SIGINT) is _handler:
        handler, hook = _previous
        signal.signal(signal.SIGINT, signal.SIG_IGN if final else handler)
        sys.unraisablehook = hook
        _previous.clear()
