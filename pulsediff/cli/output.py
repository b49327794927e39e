"""The one place the CLI writes to the terminal.

Results go to stdout (a rich table for people, JSON with --json); messages,
progress and errors go to stderr, so that `-o -` can stream a patch on stdout.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Sequence

from pulsediff.runtime.progress import SILENT, Progress


# Progress bars on the screen now. A bar hides the cursor and takes over sys.stderr until it is stopped;
# one left running by an interrupt or an error would keep the cursor hidden after the exit and redraw
# itself below the command's last line. restore_terminal() takes them all down.
_SHOWN: list = []


def _show(bar) -> None:
    _SHOWN.append(bar)
    bar.start()


def _hide(bar) -> None:
    if bar in _SHOWN:
        _SHOWN.remove(bar)
    bar.stop()


def restore_terminal() -> None:
    """Take down every progress bar still shown: the cursor visible again, the bar cleared, stderr given back.

    Called once the command is over, whatever its outcome, before its last line is written.
    """
    while _SHOWN:
        bar = _SHOWN.pop()
        try:
            bar.stop()
        except Exception:  # noqa: BLE001 - the terminal is restored as far as it can be; the outcome stands
            pass


class Output:
    def __init__(self, *, quiet: bool = False, as_json: bool = False):
        self.quiet = quiet
        self.as_json = as_json
        from pulsediff.runtime import notices

        notices.set_quiet(quiet)  # the library's one-line notices (a fallback, a first compile) obey -q too
        self._err = None
        self._out = None

    @property
    def err(self):
        if self._err is None:
            from rich.console import Console

            self._err = Console(stderr=True, highlight=False)
        return self._err

    @property
    def out(self):
        if self._out is None:
            from rich.console import Console

            # Piped, the tables are what an 80-column terminal shows (a pipe or a log has no width to
            # ask; 160 made `stats DIR | less` 90 columns wide, with a column the screen lacked),
            # unless COLUMNS says how wide to be. --json carries every field.
            sized = sys.stdout.isatty() or os.environ.get("COLUMNS", "").isdigit()
            self._out = Console(highlight=False, width=None if sized else 80)
        return self._out

    def info(self, message: str) -> None:
        if not self.quiet:
            self.err.print(message, soft_wrap=True, markup=False)  # a log line: never broken across lines

    def warn(self, message: str) -> None:
        """Something the user should know although the command succeeds (silenced by -q)."""
        if not self.quiet:
            self.err.print(f"pulsediff: warning: {message}", soft_wrap=True, markup=False)

    def line(self, text: str) -> None:
        """One plain line on stdout, for other programs to read (no markup, no wrapping)."""
        sys.stdout.write(text + "\n")

    def json(self, data: Any) -> None:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")

    def json_line(self, data: Any) -> None:
        """One compact JSON object on a line of its own, flushed: a --watch's record for monitoring."""
        sys.stdout.write(json.dumps(data, separators=(",", ":")) + "\n")
        sys.stdout.flush()

    def step(self, who: str, record: dict) -> None:
        """A --watch's line for one step reached (publish, catch-up, vllm-sync alike), or its JSON line."""
        if self.as_json:
            self.json_line(record)
        elif not self.quiet:
            pause = f", generation paused {record['pause']:.2f} s" if "pause" in record else ""
            lag = record["lag"]
            behind = "at the newest" if lag == 0 else f"{plural(lag, 'step')} behind the newest"
            self.err.print(f"{record['time']} {who} at step {record['step']}: {human_bytes(record['bytes'])} in "
                           f"{record['seconds']:.2f} s, {behind}{pause}", soft_wrap=True, markup=False)

    def problem(self, who: str, message: str, where: dict) -> None:
        """A --watch's look that failed and is tried again: one line (a JSON line with --json)."""
        if self.as_json:
            self.json_line({"time": now_stamp(), **where, "problem": message})
        elif not self.quiet:
            self.err.print(f"{now_stamp()} {who}: {message}", soft_wrap=True, markup=False)

    def table(self, title: str | None, columns: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = (),
              drop: Sequence[int] = ()) -> None:
        """A table that fits the terminal without cutting a value.

        While it is wider than the terminal, the columns in `drop` are left out, in that order; if it is still
        too wide, the first column (names) wraps onto more lines. Other cells are never cut or wrapped (a
        number cut to "1,475,2…" is worse than none). A table whose columns have no names has no header row.
        """
        from rich.cells import cell_len
        from rich.table import Table

        rows = [[str(c) for c in row] for row in rows]
        # Each column's natural width, measured once: rich's own measure of the whole table, taken again
        # after each dropped column, was most of a small command's time. Without outer edges or padding a
        # row is its cells plus " │ " between them (what rich measures, checked on random tables).
        widths = [max([cell_len(columns[k]) if any(columns) else 0] + [cell_len(row[k]) for row in rows])
                  for k in range(len(columns))]
        shown = list(range(len(columns)))
        for i in drop:
            if sum(widths[k] for k in shown) + 3 * (len(shown) - 1) <= self.out.width:
                break
            shown.remove(i)
        table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False, show_header=any(columns))
        for k in shown:
            table.add_column(columns[k], justify="right" if k in right else "left", no_wrap=(k != 0), overflow="fold")
        for row in rows:
            table.add_row(*(row[k] for k in shown))
        self.out.print(table)

    def progress(self) -> Progress:
        """A rich progress bar on stderr when it is a terminal, else nothing."""
        if self.quiet or not sys.stderr.isatty():
            return SILENT
        return _RichProgress(self.err)

    def steps(self, description: str, total: int, every: int = 10) -> "StepProgress":
        """Progress of a loop of `total` steps: a bar on a terminal, else a line every `every` steps; nothing with -q."""
        return StepProgress(self, description, total, every)


class StepProgress:
    """`update(done, note)` after each step; use as a context manager so that the bar is taken down."""

    def __init__(self, out: Output, description: str, total: int, every: int):
        import time

        self._out, self._total, self._every = out, total, max(1, every)
        self._description = description
        self._start = time.monotonic()
        self._bar = None
        if not out.quiet and sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            from rich.progress import Progress as Bar

            self._bar = Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
                            TextColumn("{task.fields[note]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                            console=out.err, transient=True)
            _show(self._bar)
            self._task = self._bar.add_task(description, total=total, note="")

    def update(self, done: int, note: str = "") -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=done, note=note)
        elif done % self._every == 0 or done == self._total:
            import time

            self._out.info(f"{self._description}: step {done}/{self._total}{', ' + note if note else ''} "
                           f"({time.monotonic() - self._start:.0f} s)")

    def close(self) -> None:
        if self._bar is not None:
            _hide(self._bar)
            self._bar = None

    def __enter__(self) -> "StepProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _RichProgress(Progress):
    def __init__(self, console):
        self.console = console
        self._bar = None

    def begin(self, description, total_bytes, total_tensors, unit="tensors"):
        from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as Bar

        self.end()
        if not total_bytes and not total_tensors:
            return  # nothing to show (hashing the empty base of an anchor): no bar that says 0/0
        self._bar = Bar(TextColumn("{task.description:<12}"), BarColumn(), DownloadColumn(), _average_speed_column(),
                        TextColumn("{task.fields[tensors]}/{task.fields[total_tensors]} " + unit), TimeRemainingColumn(),
                        console=self.console, transient=True)
        _show(self._bar)
        self._task = self._bar.add_task(description, total=total_bytes, tensors=0, total_tensors=total_tensors)
        self._tensors = 0

    def advance(self, nbytes, tensors=1):
        if self._bar is not None:
            self._tensors += tensors
            self._bar.update(self._task, advance=nbytes, tensors=self._tensors)

    def end(self):
        if self._bar is not None:
            _hide(self._bar)
            self._bar = None


# Below this many seconds into a bar, its rate is not shown: the first sample, one tensor read from the page
# cache in a few microseconds, said "597.3 GB/s".
SPEED_AFTER_S = 0.5


def _average_speed_column():
    """Bytes per second since the bar began (rich's own column divides the last samples, which the first
    tensors make absurd), shown once the bar has run SPEED_AFTER_S."""
    from rich.filesize import decimal
    from rich.progress import TransferSpeedColumn
    from rich.text import Text

    class AverageSpeedColumn(TransferSpeedColumn):
        def render(self, task) -> Text:
            elapsed = task.elapsed
            if not elapsed or elapsed < SPEED_AFTER_S:
                return Text("?", style="progress.data.speed")
            return Text(f"{decimal(int(task.completed / elapsed))}/s", style="progress.data.speed")

    return AverageSpeedColumn()


def plural(n: int, word: str, words: str | None = None) -> str:
    """'1 anchor', '2 anchors', '1 patch', '3 patches'."""
    return f"{n:,} {word if n == 1 else words or word + 's'}"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def now_stamp() -> str:
    """The time for a --watch line: UTC, to the second, ISO 8601 ("2026-11-28T14:50:01Z")."""
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def step_record(step: int, nbytes: int, seconds: float, lag: int, **extra) -> dict:
    """What a --watch says of one step reached: when, which, bytes moved, the time it took, steps behind."""
    return {"time": now_stamp(), "step": step, "bytes": nbytes, "seconds": round(seconds, 3), "lag": lag, **extra}
