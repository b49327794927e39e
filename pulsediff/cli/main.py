"""Assembles the typer app and maps every failure to one line and an exit code.

Exit codes: 0 success, 1 an error pulsediff explains (bad input, mismatch,
I/O), 2 a usage error, 3 an internal error (a bug: please report it), 130
interrupted. Set PULSEDIFF_DEBUG=1 to see tracebacks.
"""

from __future__ import annotations

import os
import sys

import typer

from ..errors import PulsediffError
from . import apply_cmd, demo_cmd, digest_cmd, make_cmd, series_cmds, squash_cmd, stats_cmd

app = typer.Typer(
    name="pulsediff",
    help="Compact, lossless patches between consecutive model checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command("make", no_args_is_help=True)(make_cmd.make)
app.command("apply", no_args_is_help=True)(apply_cmd.apply)
app.command("squash", no_args_is_help=True)(squash_cmd.squash)
app.command("publish", no_args_is_help=True)(series_cmds.publish)
app.command("catch-up", no_args_is_help=True)(series_cmds.catch_up)
app.command("stats", no_args_is_help=True)(stats_cmd.stats)
app.command("digest", no_args_is_help=True)(digest_cmd.digest)
app.command("demo")(demo_cmd.demo)


def _version(value: bool) -> None:
    if value:
        from .. import __version__

        print(f"pulsediff {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    pass


def _fail(message: str, code: int) -> None:
    sys.stderr.write(f"pulsediff: error: {message}\n")
    sys.exit(code)


def main() -> None:
    if os.environ.get("PULSEDIFF_DEBUG") == "1":
        app(prog_name="pulsediff")
        return
    try:
        app(prog_name="pulsediff")
    except PulsediffError as exc:
        _fail(str(exc), 1)
    except KeyboardInterrupt:
        _fail("interrupted; nothing was written", 130)
    except BrokenPipeError:
        # The reader of our stdout went away (e.g. `| head`): not our error to report.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except MemoryError:
        _fail("out of memory", 1)
    except OSError as exc:
        where = f": {exc.filename}" if exc.filename else ""
        _fail(f"{exc.strerror or exc}{where}", 1)
    except Exception as exc:  # a bug: one line, and how to see more
        _fail(f"internal error ({exc.__class__.__name__}: {exc}); rerun with PULSEDIFF_DEBUG=1 for a traceback", 3)


if __name__ == "__main__":
    main()
