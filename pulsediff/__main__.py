"""The entry point of `pulsediff` (the console script) and of `python -m pulsediff`."""

import sys

from pulsediff.runtime.interrupt import MESSAGE


def main() -> None:
    """Run the command line. A Ctrl-C while its modules are still importing (typer: ~0.04 s) ends
    with the same one line and exit code as one during a command, not a traceback; nothing has been
    written yet."""
    try:
        from pulsediff.cli.main import main as run
    except KeyboardInterrupt:
        sys.stderr.write(f"pulsediff: {MESSAGE}\n")
        raise SystemExit(130) from None
    except Exception as exc:  # memory ran out while the CLI's modules loaded: the same one line as later
        from pulsediff.errors import as_out_of_memory

        oom = as_out_of_memory(exc)
        if oom is None:
            raise
        sys.stderr.write(f"pulsediff: error: {oom}\n")
        raise SystemExit(1) from None
    run()


if __name__ == "__main__":
    main()
