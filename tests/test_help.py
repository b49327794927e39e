"""Help as a user reads it on an 80-column terminal (issue 33, point 7): every command's
descriptions keep room to be read, nothing is cut off, and no help names an option its
command does not have."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_factory import save_series

COMMANDS = ["make", "apply", "stats", "digest", "squash", "publish", "catch-up", "keygen", "demo", "vllm-sync"]


def help_text(*args: str, columns: int = 80) -> str:
    env = {**os.environ, "COLUMNS": str(columns), "TERM": "dumb", "NO_COLOR": "1"}
    proc = subprocess.run([sys.executable, "-m", "pulsediff", *args, "--help"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def helps() -> dict[str, str]:
    return {name: help_text(name) for name in COMMANDS}


@pytest.mark.parametrize("name", COMMANDS)
def test_help_fits_80_columns_with_room_for_descriptions(helps, name):
    text = helps[name]
    lines = text.splitlines()
    assert max(map(len, lines)) <= 80, name
    assert "…" not in text, f"{name} --help cuts something off"
    # The description column starts where --help's "Show this message" does: far enough left
    # that descriptions get 32 columns or more (publish's got 23 before).
    row = next(line for line in lines if "Show this message" in line)
    assert row.index("Show this message") <= 46, row


@pytest.mark.parametrize("name", COMMANDS)
def test_help_names_only_options_the_command_has(helps, name):
    text = helps[name]
    has_output = re.search(r"--output\b", text) is not None
    if not has_output:
        assert "-o " not in text and "-o -" not in text, f"{name} --help mentions -o, which it does not have"
    assert not re.search(r"\w \.(\s|$)", text), f"{name} --help has a stray space before a full stop"


def test_keygen_help_does_not_mention_stdout(helps):
    assert "-o -" not in helps["keygen"]


def test_publish_no_skips_writes_no_skip_patches_and_skips_is_still_accepted(tmp_path):
    train = tmp_path / "train"
    train.mkdir()
    save_series(train, 4, seed=5, shape=(32, 16), tensors=2, density=0.02)
    written = {}
    for flag in ("--no-skips", "--skips", None):
        out = tmp_path / f"out{flag}"
        cmd = [sys.executable, "-m", "pulsediff", "publish", str(train), str(out), "--settle", "0", "-q",
               "--anchor-every", "10", *([flag] if flag else [])]
        subprocess.run(cmd, check=True, timeout=300)
        written[flag] = sorted(p.name for p in out.iterdir())
    # A skip patch spans more than one step: its two step numbers differ by more than 1.
    def skips(names):
        spans = [tuple(map(int, re.findall(r"\d+", n)[-2:])) for n in names if n.endswith(".pulsediff")]
        return [s for s in spans if len(s) == 2 and s[1] - s[0] > 1]
    assert skips(written[None]) and written["--skips"] == written[None]
    assert not skips(written["--no-skips"]) and set(written["--no-skips"]) < set(written[None])


def test_make_synthetic_pair_help_ends_its_sentences():
    script = Path(__file__).resolve().parents[1] / "scripts" / "make_synthetic_pair.py"
    text = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, check=True,
                          timeout=120).stdout
    for line in re.findall(r"^  -.*$", text, flags=re.M):
        assert not line.rstrip().endswith((" about", " of", " the", ",")), line


def test_command_descriptions_break_no_line_mid_sentence():
    """A docstring paragraph is one line: rich keeps the line breaks inside it, so a paragraph wrapped in the
    source broke mid-sentence on every terminal (make --help: "tokenizer files, ...),|so that ...")."""
    import inspect

    from pulsediff.cli.main import app

    for command in app.registered_commands:
        for paragraph in inspect.cleandoc(command.callback.__doc__ or "").split("\n\n"):
            assert "\n" not in paragraph.strip(), (command.callback.__name__, paragraph[:80])


@pytest.mark.parametrize("name", ["publish", "vllm-sync"])
def test_options_in_seconds_say_seconds(helps, name):
    for option in ("--interval", "--idle-exit", "--settle", "--prepare-ahead"):
        row = next((line for line in helps[name].splitlines() if re.match(rf"\W*{option}\s", line)), None)
        if row is not None:
            assert "SECONDS" in row, row


def test_publish_trust_state_help_says_sign_uses_it(helps):
    """The README's --sign recovery reads the record: its help said "With --trust" only."""
    lines = helps["publish"].splitlines()
    at = next(i for i, line in enumerate(lines) if re.match(r"\W*--trust-state\s", line))
    assert "--sign" in " ".join(lines[at:at + 3])
