"""Running the CLI as a user does, in a process of its own, for the CLI tests."""

from __future__ import annotations

import os
import subprocess
import sys

PULSEDIFF = [sys.executable, "-m", "pulsediff"]


def run(*args, env=None, check=True, timeout: float = 300) -> subprocess.CompletedProcess:
    """`pulsediff ARGS` (each made a str), its output captured as text; with `check`, a non-zero
    exit is an AssertionError that shows stderr."""
    proc = subprocess.run([*PULSEDIFF, *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {proc.stderr}")
    return proc


def one_line_error(proc, code: int) -> str:
    """The one line an error prints (after checking there is exactly one and the exit code)."""
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("pulsediff: error:"), proc.stderr
    return lines[0]
