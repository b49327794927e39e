"""Assembles the typer app and maps every outcome to one line and an exit code.

Exit codes (README.md's table says the same; tests/test_cli.py checks both):
0 success, 1 an error pulsediff explains (bad input, mismatch, I/O), 2 a
usage error (ours or the command line parser's), 3 an internal error (a bug:
please report it), 4 a catch-up that reached a verified step short of the
newest (like rsync's 23 for a partial transfer), 130 interrupted. Set PULSEDIFF_DEBUG=1 to see tracebacks.

The app runs in click's non-standalone mode so that every outcome comes back
here: in standalone mode typer prints usage errors as a five-line box and turns
Ctrl-C into a silent exit 130 before this module could say a word.
"""

from __future__ import annotations

import copy
import gc
import os
import sys

import typer

from pulsediff.errors import PartialCatchUpError, PulsediffError, UsageError, as_out_of_memory
from pulsediff.cli import (apply_cmd, demo_cmd, digest_cmd, engine_cmds, keygen_cmd, make_cmd, series_cmds, squash_cmd,
                           stats_cmd)
from pulsediff.cli.output import restore_terminal

try:  # typer >= 0.20 ships its own copy of click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
except ImportError:  # pragma: no cover - older typer on top of click
    from click.exceptions import ClickException, NoArgsIsHelpError

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_BUG, EXIT_PARTIAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130

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
app.command("vllm-sync", no_args_is_help=True)(engine_cmds.vllm_sync)
app.command("stats", no_args_is_help=True)(stats_cmd.stats)
app.command("digest", no_args_is_help=True)(digest_cmd.digest)
app.command("keygen", no_args_is_help=True)(keygen_cmd.keygen)
app.command("demo")(demo_cmd.demo)


def _version(value: bool) -> None:
    if value:
        from pulsediff.version import __version__

        print(f"pulsediff {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    pass


# What the help shows after an option's name, by the Python type typer inferred.
_METAVARS = {"int": "N", "float": "NUMBER", "str": "TEXT", "text": "TEXT", "Path": "PATH", "path": "PATH"}


def _tidy_help(command, parent=None) -> None:
    """Help in the usual shape: `-o PATH`, `--precision exact|bf16`, flags bare, arguments by name.

    typer labels every parameter with its Python type (`<bool>` on a flag,
    `<list[str]>` on a list of files), which tells a user nothing the name and
    the help do not. An explicit metavar wins; arguments show none (their name
    is their metavar).
    """
    from typer.core import TyperArgument, TyperOption

    ctx = command.context_class(command, parent=parent, **command.context_settings)
    for sub in getattr(command, "commands", {}).values():
        _tidy_help(sub, ctx)
    help_option = command.get_help_option(ctx)  # made once per command and kept: tidy it too
    for param in [*command.params, *([help_option] if help_option is not None else [])]:
        if isinstance(param, TyperArgument):
            if param.metavar is None:
                param.metavar = param.name.upper()
            param.display_type_rich = lambda ctx: None  # the rich help's type column (typer 0.29)
            param.display_type = lambda ctx: ""  # the plain help's (TYPER_USE_RICH=0)
            if getattr(param, "type", None) is not None:  # typer < 0.29 asks the type (maybe shared: STRING)
                param.type = copy.copy(param.type)
                param.type.get_metavar = lambda *args, **kwargs: ""
        elif isinstance(param, TyperOption) and param.metavar is None:
            desc = getattr(param, "type_descriptor", None)  # typer 0.29; before, the click type says
            click_type = getattr(param, "type", None)
            choices = desc.choices if desc is not None and desc.is_choice else getattr(click_type, "choices", None)
            if param.is_flag or param.count:
                param.metavar = ""
            elif choices:
                # A short list of choices is its own metavar; a long one would take the help
                # text's room at 80 columns, so it is named, and the help lists the choices.
                listed = "|".join(str(getattr(c, "value", c)) for c in choices)
                param.metavar = listed if len(listed) <= 12 else param.name.upper()
            else:
                annotation = getattr(desc, "annotation", None)
                name = getattr(annotation, "__name__", "") if desc is not None else getattr(click_type, "name", "")
                param.metavar = _METAVARS.get(name, "VALUE")


def _say(line: str) -> None:
    sys.stderr.write(f"pulsediff: {line}\n")
    sys.stderr.flush()


def _usage_line(exc: ClickException) -> str:
    """A parser error as one line, with where to read more."""
    message = " ".join(exc.format_message().split()).rstrip(".")
    message = message.replace(": Value error, ", ": ")  # pydantic's prefix on a bad choice
    ctx = getattr(exc, "ctx", None)
    if ctx is not None:
        message += f" (see '{ctx.command_path} --help')"
    return message


def _silence_stdout() -> None:
    """Nothing more reaches stdout: what is still buffered goes to /dev/null at exit.

    After a write to stdout failed (disk full, a closed pipe), Python would try
    to flush the same buffer again at exit, fail again and print "Exception
    ignored ..." with exit code 120: the result would depend on how much was
    still buffered.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def _flush_stdout() -> None:
    """Flush what an earlier, successful part of the command printed; silence stdout if that fails."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        _silence_stdout()


def _run(argv: list[str] | None) -> int:
    """Run the command line; return the exit code. Errors are reported here, as one line on stderr."""
    debug = os.environ.get("PULSEDIFF_DEBUG") == "1"
    from pulsediff.runtime import interrupt

    interrupt.install()
    try:
        try:
            command = typer.main.get_command(app)
            _tidy_help(command)
            code = command.main(args=argv, prog_name="pulsediff", standalone_mode=False)
            interrupt.check()  # a Ctrl-C swallowed by a finalizer on the way still counts
        finally:
            try:
                interrupt.done(final=argv is None)  # the process's own command line: it exits next
            finally:  # a Ctrl-C raised as the handler is swapped (it checks pending signals first)
                restore_terminal()  # a bar left by an error or Ctrl-C: down before the last line, cursor shown
    except NoArgsIsHelpError:
        return EXIT_USAGE  # the help is printed already
    except ClickException as exc:
        _say(f"error: {_usage_line(exc)}")
        return exc.exit_code
    except UsageError as exc:
        _say(f"error: {exc}")
        return EXIT_USAGE
    except PartialCatchUpError as exc:
        _report(exc)
        return EXIT_PARTIAL
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    except typer.Abort:  # typer's answer to EOF on a prompt; pulsediff has none
        _say("error: aborted")
        return EXIT_ERROR
    except SystemExit as exc:  # typer's own exit on a broken pipe
        if exc.code not in (0, None):
            _silence_stdout()
        raise
    except Exception as exc:
        if debug:
            raise
        if not isinstance(exc, PulsediffError):
            exc = as_out_of_memory(exc) or exc  # e.g. numba failing to load: not a bug, not a broken install
        _report(exc)
        return EXIT_BUG if not isinstance(exc, (PulsediffError, OSError, MemoryError)) else EXIT_ERROR
    if code == EXIT_INTERRUPTED:  # typer turned Ctrl-C into Exit(130)
        _silence_stdout()  # a half-written patch on stdout is not worth another error
        _say(interrupt.message())  # "no partial output was left", or which output was already complete
        return EXIT_INTERRUPTED
    return code or EXIT_OK


def _report(exc: BaseException) -> None:
    if isinstance(exc, BrokenPipeError):
        _silence_stdout()  # the reader of our stdout went away (e.g. `| head`): not our error to report
        return
    if isinstance(exc, OSError):
        _silence_stdout()
    else:
        _flush_stdout()
    if isinstance(exc, PulsediffError):
        _say(f"error: {exc}")
    elif isinstance(exc, MemoryError):
        _say("error: out of memory")
    elif isinstance(exc, OSError):
        where = f": {exc.filename}" if exc.filename else ""
        _say(f"error: {exc.strerror or exc}{where}")
    else:  # a bug: one line, and how to see more
        _say(f"error: internal error ({exc.__class__.__name__}: {exc}); "
             "rerun with PULSEDIFF_DEBUG=1 for a traceback, and please report it")


def main(argv: list[str] | None = None) -> None:
    code = _run(argv)
    if argv is None:  # the process's own command line: it ends next
        # Python's shutdown collects the cycles among the ~10^5 objects Numba
        # made while loading kernels: 0.2 to 0.3 s per command (measured),
        # paid again by every link of a chain and every catch-up. Everything
        # the command wrote is closed by now, so let the exit skip that scan.
        gc.freeze()
        if code == EXIT_INTERRUPTED:
            # Ctrl-C can land inside concurrent.futures between starting a worker thread and
            # registering it for shutdown; Python's exit then waits forever for that thread
            # (seen in CI and reproduced: make never exited after Ctrl-C). The command has cleaned
            # up by now and no task runs, so leave without joining threads (stdout is
            # silenced and the one stderr line flushed already).
            _flush_stdout()
            os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    main()
