"""What a new user hits in their second hour with the command line (issue 24), one test per point."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ckpt_factory import mutate, random_tensor, save, save_series

PULSEDIFF = [sys.executable, "-m", "pulsediff"]


def run(*args, env=None, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run([*PULSEDIFF, *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)
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


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pair")
    rng = np.random.default_rng(24)
    base = {"w": random_tensor(rng, "BF16", (256, 64)), "b": random_tensor(rng, "F32", (64,))}
    target = {"w": mutate(rng, base["w"], 0.01), "b": base["b"]}
    return save(base, tmp / "old.safetensors"), save(target, tmp / "new.safetensors")


@pytest.fixture
def train(tmp_path) -> Path:
    folder = tmp_path / "train"
    folder.mkdir()
    save_series(folder, 2, seed=3, shape=(64, 32), tensors=2, density=0.02)
    return folder


# -- publish and a trainer's other folders ------------------------------------------------------------


def test_publish_passes_over_folders_that_hold_no_checkpoint(train, tmp_path):
    """logs2/ and events_v1/ end in a number, as step folders do, but hold no .safetensors: not checkpoints."""
    (train / "logs2").mkdir()
    (train / "logs2" / "run.log").write_text("loss 1.0\n")
    (train / "events_v1").mkdir()
    proc = run("publish", train, tmp_path / "out", "--settle", "0", "--anchor-every", "2")
    assert "published 3 patches and 2 anchors" in proc.stderr  # steps 0 to 2, a skip patch 0 -> 2
    assert (tmp_path / "out" / "manifest.json").is_file()


def test_two_checkpoints_for_one_step_is_an_input_error_with_a_hint(train, tmp_path):
    """A folder that does hold a checkpoint and names the same step as a file: exit 1 (the input), not 2 (usage)."""
    step2 = train / "step2"
    step2.mkdir()
    (step2 / "model.safetensors").write_bytes((train / "step_000002.safetensors").read_bytes())
    line = one_line_error(run("publish", train, tmp_path / "out", "--settle", "0", check=False), 1)
    assert f"two checkpoints for step 2 in {train}: step2 and step_000002.safetensors" in line
    assert "--step-pattern" in line
