"""The command line on a terminal (a pty): what a user's screen is left with."""

from __future__ import annotations

import os
import select
import sys
import time

import numpy as np
import pytest

from ckpt_factory import mutate, random_tensor, save

pty = pytest.importorskip("pty")

PULSEDIFF = [sys.executable, "-m", "pulsediff"]
HIDE, SHOW = b"\x1b[?25l", b"\x1b[?25h"


def on_pty(args, *, ctrl_c_after: bytes | None = None, columns: int = 100, timeout: float = 120) -> tuple[int, bytes]:
    """Run pulsediff with stdin, stdout and stderr on a new terminal; return (exit code, all it wrote).

    With `ctrl_c_after`, type ^C (the terminal sends SIGINT, as for a user) 0.1 s after that output appears.
    """
    env = {**os.environ, "COLUMNS": str(columns), "LINES": "40", "TERM": "xterm-256color"}
    pid, fd = pty.fork()
    if pid == 0:  # pragma: no cover - the child
        os.execvpe(sys.executable, [*PULSEDIFF, *map(str, args)], env)
    out, seen, typed = b"", None, False
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if ctrl_c_after is not None and not typed and ctrl_c_after in out:
                seen = seen or time.monotonic()
                if time.monotonic() - seen >= 0.1:
                    os.write(fd, b"\x03")
                    typed = True
            if select.select([fd], [], [], 0.05)[0]:
                try:
                    chunk = os.read(fd, 1 << 16)
                except OSError:  # EIO: the child is gone and the terminal closed
                    break
                if not chunk:
                    break
                out += chunk
        else:
            os.kill(pid, 9)
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    assert ctrl_c_after is None or typed, f"never saw {ctrl_c_after!r}: {out[-2000:]!r}"
    return os.waitstatus_to_exitcode(status), out


@pytest.fixture(scope="module")
def big_pair(tmp_path_factory):
    """64 MiB a side: make and apply show a bar for long enough to be interrupted under it."""
    tmp = tmp_path_factory.mktemp("big")
    rng = np.random.default_rng(21)
    base = {f"w{i}": random_tensor(rng, "BF16", (1024, 4096)) for i in range(8)}
    target = {k: mutate(rng, v, 0.01) for k, v in base.items()}
    return save(base, tmp / "old.safetensors"), save(target, tmp / "new.safetensors")


def assert_terminal_restored(code: int, out: bytes) -> None:
    assert code == 130, out[-2000:]
    assert out.count(HIDE) >= 1, "no progress bar was shown: the test interrupted nothing"
    assert out.count(SHOW) == out.count(HIDE), out[-2000:]  # the cursor is visible again
    # The one line is the last thing on the screen: no bar redrawn after it, and the prompt starts a line.
    assert out.endswith(b"pulsediff: interrupted; no partial output was left\r\n"), out[-2000:]


def test_ctrl_c_during_make_restores_the_terminal(big_pair, tmp_path):
    old, new = big_pair
    code, out = on_pty(["make", old, new, "-o", tmp_path / "p"], ctrl_c_after=HIDE)
    assert_terminal_restored(code, out)
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_during_apply_restores_the_terminal(big_pair, tmp_path):
    old, new = big_pair
    code, _ = on_pty(["make", old, new, "-o", tmp_path / "p", "-q"])
    assert code == 0
    code, out = on_pty(["apply", old, tmp_path / "p", "-o", tmp_path / "out"], ctrl_c_after=HIDE)
    assert_terminal_restored(code, out)
    assert not (tmp_path / "out").exists()
