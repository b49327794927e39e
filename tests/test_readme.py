"""README.md's Python snippets run as written, pasted into the interactive prompt as well as run as a script."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ckpt_factory import mutate, random_tensor, save

README = Path(__file__).parent.parent / "README.md"

# Feeds a snippet line by line to the interactive interpreter that `python` starts on a terminal (the
# classic one: 3.13's new prompt takes a paste whole). A compound statement then needs the blank line
# that ends it, and an error goes on to the next line instead of stopping: any error fails the run.
REPL = """
import code, sys
errors = []
class Console(code.InteractiveConsole):
    def showtraceback(self):
        errors.append(sys.exc_info()[1]); super().showtraceback()
    def showsyntaxerror(self, filename=None, **kwargs):
        errors.append(sys.exc_info()[1]); super().showsyntaxerror(filename, **kwargs)
console = Console()
more = False
for line in sys.stdin.read().splitlines():
    more = console.push(line)
if more:
    console.push("")
sys.exit(1 if errors else 0)
"""


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def paste(snippet: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", REPL], input=snippet, cwd=cwd, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture
def steps_41_42(tmp_path) -> Path:
    """The files the API snippet names."""
    rng = np.random.default_rng(42)
    base = {"w": random_tensor(rng, "BF16", (128, 64))}
    save(base, tmp_path / "step_41.safetensors")
    save({"w": mutate(rng, base["w"], 0.01)}, tmp_path / "step_42.safetensors")
    return tmp_path


def test_readme_has_the_snippets_these_tests_run():
    blocks = python_blocks()
    assert len(blocks) == 2, "a Python block was added or removed: give it a test here"
    assert "make_patch(" in blocks[0] and "apply_to_state_dict(" in blocks[1]


def test_api_snippet_pasted_into_the_prompt(steps_41_42):
    """It rebuilds step 42 beside its inputs, and does not write over either of them."""
    new_before = (steps_41_42 / "step_42.safetensors").read_bytes()
    proc = paste(python_blocks()[0], steps_41_42)
    assert proc.returncode == 0, proc.stderr
    assert (steps_41_42 / "step_42.safetensors").read_bytes() == new_before
    outputs = [p for p in steps_41_42.iterdir() if p.suffix == ".safetensors" and not p.name.startswith("step_4")]
    assert [p.read_bytes() for p in outputs] == [new_before]


@pytest.mark.parametrize("how", ["prompt", "script"])
def test_live_tensor_snippet_runs_as_written(how, tmp_path):
    snippet = python_blocks()[1]
    if how == "prompt":
        proc = paste(snippet, tmp_path)
    else:
        proc = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)
    assert proc.returncode == 0, proc.stderr
    # It printed its line, with elements written: the worker was behind, and the patch moved it.
    written = re.search(r"(\d+) bytes, (\d+) elements written", proc.stdout)
    assert written and int(written.group(2)) > 0, proc.stdout


# The demo's time on two busy cores, as README.md gives it; a README block may take 3 times that.
DEMO_SECONDS = 27


def shell_block(after_heading: str) -> str:
    """The first ``` block after a heading of README.md."""
    text = README.read_text()
    section = text[text.index(after_heading):]
    return re.search(r"```\n(.*?)```", section, re.S).group(1)


def block_lines(after_heading: str) -> list[str]:
    """A shell block's lines but its `pip install` line (the test environment has the extras; a test does not
    install packages)."""
    block = shell_block(after_heading)
    lines = [line for line in block.splitlines() if not line.startswith("pip install")]
    assert len(lines) == len(block.splitlines()) - 1
    return lines


def test_shell_blocks_run_in_sequence_in_one_folder(tmp_path):
    """The series, S3 and signed-series blocks, pasted into bash one after the other in one fresh folder, as a
    reader tries them: each block's own files (no block trips over another's train/ or outbox/), every line
    succeeds, each worker ends at step 4 bit for bit, and each block takes at most 3x the demo's time. The
    rclone servers the S3 block starts are stopped whatever happens; caches and the rollback record stay in
    the test's folder."""
    import socket

    pytest.importorskip("obstore")
    pytest.importorskip("cryptography")
    bin_dir = str(Path(sys.executable).parent)  # this interpreter's python and pulsediff come first
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env |= {"PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "XDG_CACHE_HOME": str(tmp_path / "cache"),
            "XDG_STATE_HOME": str(tmp_path / "state")}
    for tool in ("rsync", "rclone"):
        if shutil.which(tool, path=env["PATH"]) is None:
            pytest.skip(f"{tool} is not installed")
    for port in (9000, 8080):  # the S3 block's own addresses
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                pytest.skip(f"port {port} is in use")
    blocks = [("## Checkpoint series", "worker is at step 4, bit for bit"),
              ("## Series over S3 and HTTP", "both workers at step 4, bit for bit"),
              ("## Signed series", "worker is at step 4, signed by trainer.pub")]
    for heading, said in blocks:
        start = time.monotonic()
        proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", "\n".join(block_lines(heading))], cwd=tmp_path,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=10 * DEMO_SECONDS)
        finally:
            try:
                os.killpg(proc.pid, 9)  # rclone, if the block stopped before its `kill`
            except ProcessLookupError:
                pass
        took = time.monotonic() - start
        assert proc.returncode == 0, (heading, err)
        assert said in out, heading
        assert took <= 3 * DEMO_SECONDS, f"{heading}: {took:.0f} s"
    assert (tmp_path / "series.png").stat().st_size > 0
    assert (tmp_path / "signed" / "manifest.json.sig").is_file()
