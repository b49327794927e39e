"""One-line notices to the user on stderr, from the library: a fallback taken, kernels compiling.

Not warnings: a notice says what pulsediff is doing, once, in one line, and the CLI's
`-q` silences it (`set_quiet`). Each distinct text is said once per process."""

from __future__ import annotations

import sys
import threading

_quiet = False
_said: set[str] = set()
_lock = threading.Lock()


def set_quiet(quiet: bool) -> None:
    global _quiet
    _quiet = bool(quiet)


def notice(text: str) -> None:
    with _lock:
        if _quiet or text in _said:
            return
        _said.add(text)
    try:
        sys.stderr.write(f"pulsediff: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed: a notice is never worth failing for
        pass
