"""The --watch loop that catch-up and vllm-sync share (publish's is the library's own, series/publish.py).

Each look either reaches a step (one line, or a JSON line with --json), finds nothing new, or fails. A
failed look, or a look that stopped short, is said in one line, once until what it says changes, and
the next look tries again: the worker or engine stays where it is meanwhile. Refusals no later look can
change (`final`) end the watch; Ctrl-C or --idle-exit seconds without a new step end it too.
"""

from __future__ import annotations

import time
from typing import Callable

from pulsediff.cli.output import Output
from pulsediff.errors import PulsediffError


def follow(look: Callable[[float], tuple[dict | None, str]], out: Output, who: str, interval: float,
           idle_exit: float | None, final: tuple, failed: Callable[[PulsediffError], str],
           where: Callable[[], dict]) -> None:
    """Call `look(start)` every `interval` seconds. It returns the record of the step it reached (or None)
    and what to say of a look that stopped short (or ""); a PulsediffError it raises, unless in `final`,
    is said as `failed(exc)`. `where()` is what a problem's JSON line carries besides the time."""
    said = ""
    last_change = time.monotonic()
    while True:
        start = time.perf_counter()
        try:
            record, problem = look(start)
        except final:
            raise
        except PulsediffError as exc:
            record, problem = None, failed(exc)
        if record is not None:
            last_change = time.monotonic()
            out.step(who, record)
        if problem and problem != said:
            out.problem(who, problem, where())
        said = problem
        if idle_exit is not None and time.monotonic() - last_change >= idle_exit:
            return
        time.sleep(interval)
