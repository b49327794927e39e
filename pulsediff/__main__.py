"""The entry point of `pulsediff` (the console script) and of `python -m pulsediff`."""

import sys


def main() -> None:
    """Run the command line. A Ctrl-C while its modules are still importing (typer: ~0.04 s) ends
    with the same one line and exit code as one during a command, not a traceback; nothing has been
    written yet."""
    try:
        from pulsediff.cli.main import main as run
    except KeyboardInterrupt:
        sys.stderr.write("pulsediff: interrupted; no partial output was left\n")
        raise SystemExit(130) from None
    run()


if __name__ == "__main__":
    main()
