"""The command line on a terminal (a pty): what a user's screen is left with."""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
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


# -- tables at 80 columns ----------------------------------------------------------------------------

ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")


def screen_lines(out: bytes) -> list[str]:
    return re.split(r"\r\n|\r|\n", ANSI.sub(b"", out).decode())  # a bar redraws its line after a \r


@pytest.fixture(scope="module")
def series(tmp_path_factory):
    """A small Llama-shaped series: Hugging Face's long tensor names, numbers with separators."""
    from pulsediff.example import make_example_series

    folder = tmp_path_factory.mktemp("series")
    make_example_series(folder, steps=2, d_model=64, n_heads=4, n_layers=2, vocab=512, warmup_steps=3)
    return folder


def assert_fits(lines: list[str], width: int = 80) -> None:
    assert all(len(line) <= width for line in lines), "\n".join(line for line in lines if len(line) > width)
    assert not any("\u2026" in line for line in lines), "\n".join(lines)  # nothing cut short with an ellipsis


def test_patch_tables_fit_80_columns_with_every_value_whole(series, tmp_path):
    patch = tmp_path / "p"
    assert on_pty(["make", series / "step_000000.safetensors", series / "step_000001.safetensors", "-o", patch,
                   "-q"])[0] == 0
    code, out = on_pty(["stats", patch, "--top", "3"], columns=80)
    assert code == 0
    lines = screen_lines(out)
    assert_fits(lines)
    assert not any(re.fullmatch(r"[ ┃]*┃[ ┃]*", line) for line in lines)  # no header row without names
    stats = json.loads(subprocess.run([*PULSEDIFF, "stats", str(patch), "--json"], capture_output=True,
                                      check=True).stdout)
    text = "\n".join(lines)
    top = sorted(stats["per_tensor"], key=lambda t: (-(t["index_bytes"] + t["value_bytes"]), t["name"]))[:3]
    for t in top:  # each listed tensor on one line with its name and its count of changed elements whole
        assert re.search(rf"^{re.escape(t['name'])} .* {t['changed']:,} ", text, re.M), text
    assert f"{stats['changed']:,} of {stats['elements']:,}" in text


def test_series_tables_fit_80_columns_with_every_value_whole(series):
    code, out = on_pty(["stats", series], columns=80)
    assert code == 0
    lines = screen_lines(out)
    assert_fits(lines)
    stats = json.loads(subprocess.run([*PULSEDIFF, "stats", str(series), "--json"], capture_output=True,
                                      check=True).stdout)
    text = "\n".join(lines)
    for d in stats["step_density"]:
        assert re.search(rf"^{d['from']} -> {d['to']} .* {d['changed']:,} .* {100 * d['density']:.4f}% .* "
                         rf"{d['bits_per_changed']:.2f}$", text, re.M), text


def test_a_fresh_worker_shows_no_empty_bar(tmp_path):
    """catch-up from an anchor hashes the empty checkpoint first: no 'hash 0/0' bar for that."""
    from ckpt_factory import save_series

    train = tmp_path / "train"
    train.mkdir()
    save_series(train, 1, seed=4, shape=(64, 32), tensors=2, density=0.02)
    assert subprocess.run([*PULSEDIFF, "publish", str(train), str(tmp_path / "pub"), "--settle", "0", "-q"]).returncode == 0
    code, out = on_pty(["catch-up", tmp_path / "fresh.safetensors", tmp_path / "pub"])
    assert code == 0, out
    text = "\n".join(screen_lines(out))
    assert "is now at step 1" in text
    assert " 0/0 " not in text, text


def test_publish_shows_a_bar_per_file_on_a_terminal(tmp_path):
    """An anchor of a big model takes minutes: publish shows make's bar, named for the file it writes."""
    from ckpt_factory import save_series

    train = tmp_path / "train"
    train.mkdir()
    save_series(train, 1, seed=4, shape=(64, 32), tensors=2, density=0.02)
    code, out = on_pty(["publish", train, tmp_path / "pub", "--settle", "0"])
    assert code == 0, out
    assert out.count(HIDE) >= 1 and out.count(SHOW) == out.count(HIDE), out[-2000:]
    text = "\n".join(screen_lines(out))
    for name in ("anchor 0", "patch 0 to 1", "check 1"):
        assert name in text, text
    assert " 0/0 " not in text, text  # no bar for hashing an anchor's empty base
    assert text.rstrip().endswith(f"published steps 0 to 1 into {tmp_path / 'pub'}: 1 patch and 1 anchor"), text
