"""publish given the wrong folder (issue 33): one model's folder, an empty one, checkpoints one level down.

Each refusal is one line and exit 1, with nothing created; a watch on a folder that never gets a checkpoint
ends with --idle-exit instead of looking forever.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

import cli_run
from cli_run import PULSEDIFF
from ckpt_factory import random_tensor, save_series, save_sharded
from pulsediff.errors import TrainingFolderError
from pulsediff.format.manifest import Manifest
from pulsediff.series.publish import publish, publish_once

def run(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    """The CLI, its exit code left to the test."""
    return cli_run.run(*args, check=False, timeout=timeout)


def one_line_error(proc) -> str:
    return cli_run.one_line_error(proc, 1)


def sharded_steps(root: Path, steps: int = 2) -> Path:
    """qwen/step0, qwen/step1, ...: one Hugging Face folder of 3 shards and an index per step."""
    rng = np.random.default_rng(33)
    state = {f"model.layers.{i}.weight": random_tensor(rng, "BF16", (64, 32)) for i in range(3)}
    for step in range(steps):
        save_sharded({k: v + step for k, v in state.items()}, root / f"step{step}", shards=3)
    return root


@pytest.fixture
def train(tmp_path) -> Path:
    folder = tmp_path / "train"
    folder.mkdir()
    save_series(folder, 2, seed=3, shape=(64, 32), tensors=2, density=0.02)
    return folder


# -- one model folder given as the training folder -------------------------------------------------


def test_a_sharded_model_folder_is_one_checkpoint_not_a_series(tmp_path):
    """Its shards' names (model-00001-of-00003) once read as two steps 3, with the advice to move one away."""
    qwen = sharded_steps(tmp_path / "qwen")
    line = one_line_error(run("publish", qwen / "step0", tmp_path / "out"))
    assert (f"{qwen / 'step0'} is one checkpoint (it holds model.safetensors.index.json), not a folder of steps; "
            f"give the folder that holds one checkpoint per step, e.g. {qwen}, where it is step 0") in line
    assert "move one away" not in line
    assert not (tmp_path / "out").exists()
    # shards without their index: the same, named by the shards
    (qwen / "step1" / "model.safetensors.index.json").unlink()
    line = one_line_error(run("publish", qwen / "step1", tmp_path / "out", "--watch", timeout=60))
    assert f"{qwen / 'step1'} is one checkpoint (it holds model-00001-of-00003.safetensors, " in line
    assert not (tmp_path / "out").exists()


def test_the_folder_above_the_shards_publishes_each_as_a_step(tmp_path):
    qwen = sharded_steps(tmp_path / "qwen")
    proc = run("publish", qwen, tmp_path / "out", "--settle", "0")
    assert proc.returncode == 0, proc.stderr
    assert [e.step for e in Manifest.load(tmp_path / "out").entries if e.kind == "anchor"] == [0]


def test_a_trainer_folder_with_the_final_model_beside_its_checkpoints(train, tmp_path):
    """Hugging Face's Trainer saves checkpoint-N/ folders and, at the end, the model's shards beside them:
    the shards are not steps (they were: 'two checkpoints for step 3')."""
    rng = np.random.default_rng(5)
    save_sharded({f"w{i}": random_tensor(rng, "F32", (8,)) for i in range(3)}, train, shards=3)
    proc = run("publish", train, tmp_path / "out", "--settle", "0")
    assert proc.returncode == 0, proc.stderr
    assert sorted({e.step for e in Manifest.load(tmp_path / "out").entries}) == [0, 1, 2]


# -- an empty or wrong training folder -------------------------------------------------------------


def test_an_empty_folder_is_an_error_not_up_to_date(tmp_path):
    (tmp_path / "empty").mkdir()
    line = one_line_error(run("publish", tmp_path / "empty", tmp_path / "out"))
    assert line == f"pulsediff: error: no checkpoints found in {tmp_path / 'empty'}; it is empty"
    assert not (tmp_path / "out").exists()
    line = one_line_error(run("publish", tmp_path / "empty", tmp_path / "out", "--dry-run"))
    assert "no checkpoints found" in line


def test_checkpoints_one_level_down_are_pointed_at(train, tmp_path):
    """run1/ ends in a number and holds .safetensors files: a step's folder by its name, which does not open."""
    deep = tmp_path / "deep"
    deep.mkdir()
    shutil.move(train, deep / "run1")
    line = one_line_error(run("publish", deep, tmp_path / "out"))
    assert line == (f"pulsediff: error: no checkpoints found in {deep}; found some one level down in "
                    f"{deep / 'run1'}: give that folder")
    assert not (tmp_path / "out").exists()


def test_what_a_folder_without_checkpoints_holds_is_said(tmp_path):
    folder = tmp_path / "run"
    (folder / "logs").mkdir(parents=True)
    line = one_line_error(run("publish", folder, tmp_path / "out"))
    assert f"no checkpoints found in {folder}; a checkpoint is a .safetensors file or a folder of them" in line
    (folder / "final.safetensors").write_bytes(b"")
    line = one_line_error(run("publish", folder, tmp_path / "out"))
    assert f"no checkpoints found in {folder}; no step number in the name of final.safetensors" in line
    (folder / "step_7.safetensors").write_bytes(b"not a checkpoint")
    line = one_line_error(run("publish", folder, tmp_path / "out", "--settle", "0"))
    assert f"no checkpoints found in {folder}; step_7.safetensors does not open as a checkpoint" in line
    assert not (tmp_path / "out").exists()


def test_a_folder_whose_steps_were_all_published_is_still_up_to_date(train, tmp_path):
    run("publish", train, tmp_path / "out", "--settle", "0", "-q")
    proc = run("publish", train, tmp_path / "out", "--settle", "0")
    assert proc.returncode == 0 and proc.stderr == f"{tmp_path / 'out'} is up to date with {train}\n"


# -- --watch and --idle-exit -----------------------------------------------------------------------


def test_watch_on_a_folder_that_never_gets_a_checkpoint_ends_with_idle_exit(tmp_path):
    """It looked forever (11 minutes in one trial): --idle-exit counts from the start while nothing is there."""
    (tmp_path / "empty").mkdir()
    t0 = time.monotonic()
    try:
        proc = run("publish", tmp_path / "empty", tmp_path / "out", "--watch", "--interval", "0.2", "--idle-exit", "2",
                   timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("publish --watch --idle-exit 2 on an empty folder did not end")
    assert time.monotonic() - t0 >= 2
    line = one_line_error(proc)
    assert line == (f"pulsediff: error: no checkpoints found in {tmp_path / 'empty'} in 2 s of --watch "
                    f"(--idle-exit); it is empty")
    assert not (tmp_path / "out").exists()


def test_watch_started_before_its_trainer_publishes_what_comes(train, tmp_path):
    """An empty folder is a watch's normal start: the first checkpoint that comes within --idle-exit is published."""
    feed = tmp_path / "feed"
    feed.mkdir()
    publisher = subprocess.Popen([*PULSEDIFF, "publish", str(feed), str(tmp_path / "out"), "--watch", "--interval",
                                  "0.1", "--settle", "0.2", "--idle-exit", "8", "-q"], stderr=subprocess.PIPE)
    try:
        time.sleep(1.0)
        for f in sorted(train.iterdir()):
            shutil.copy(f, feed / f".{f.name}")
            os.replace(feed / f".{f.name}", feed / f.name)
        assert publisher.wait(timeout=120) == 0, publisher.stderr.read().decode()
    finally:
        if publisher.poll() is None:
            publisher.kill()
    assert Manifest.load(tmp_path / "out").newest.step == 2


def test_library_watch_look_reports_an_empty_folder_and_refuses_a_model_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    assert publish_once(tmp_path / "empty", tmp_path / "out", empty_ok=True).found == 0
    with pytest.raises(TrainingFolderError, match="no checkpoints found"):
        publish_once(tmp_path / "empty", tmp_path / "out")
    with pytest.raises(TrainingFolderError, match="no checkpoints found .* in 0.3 s of --watch"):
        publish(tmp_path / "empty", tmp_path / "out", watch=True, interval=0.05, idle_exit=0.3)
    qwen = sharded_steps(tmp_path / "qwen", steps=1)
    with pytest.raises(TrainingFolderError, match="is one checkpoint"):
        publish_once(qwen / "step0", tmp_path / "out", empty_ok=True)
    assert not (tmp_path / "out").exists()


# -- progress ----------------------------------------------------------------------------------------


def test_publish_on_a_pipe_or_quiet_prints_no_progress(train, tmp_path):
    proc = run("publish", train, tmp_path / "out", "--settle", "0")
    assert proc.returncode == 0
    assert proc.stderr == f"published steps 0 to 2 into {tmp_path / 'out'}: 3 patches and 1 anchor\n"
    assert run("publish", train, tmp_path / "q", "--settle", "0", "-q").stderr == ""


def test_step_names_that_look_like_shards_but_are_not_are_steps(tmp_path):
    """Only Hugging Face's five-digit shard names (model-00001-of-00003) are parts of one checkpoint:
    a trainer's step-100-of-1000.safetensors is step 100."""
    train, out = tmp_path / "train", tmp_path / "out"
    train.mkdir()
    save_series(train, 2, seed=4, shape=(32, 16), tensors=2, density=0.02)
    for step in range(3):
        (train / f"step_{step:06d}.safetensors").rename(train / f"step-{100 * step}-of-1000.safetensors")
    proc = run("publish", train, out, "--settle", "0", "-q", "--step-pattern", r"step-(\d+)")
    assert proc.returncode == 0, proc.stderr
    assert [e.step for e in Manifest.load(out).entries if e.kind == "anchor"][:1] == [0]
    assert sorted({e.step for e in Manifest.load(out).entries}) == [0, 100, 200]


def test_an_emptied_training_folder_after_publishing_is_up_to_date(tmp_path):
    """A trainer that deletes what was published leaves an empty folder: with DEST already holding
    the steps, publish (and a watch's --idle-exit) is up to date, exit 0, not 'no checkpoints'."""
    train, out = tmp_path / "train", tmp_path / "out"
    train.mkdir()
    save_series(train, 2, seed=6, shape=(32, 16), tensors=2, density=0.02)
    assert run("publish", train, out, "--settle", "0", "-q").returncode == 0
    for p in train.iterdir():
        p.unlink()
    proc = run("publish", train, out, "--settle", "0")
    assert proc.returncode == 0, proc.stderr
    assert "up to date" in proc.stderr
    proc = run("publish", train, out, "--settle", "0", "--watch", "--idle-exit", "1", "--interval", "0.2", "-q")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert Manifest.load(out).newest.step == 2
