"""A worker that follows by itself (issue 48, item 7): catch-up --step and --watch, and the --watch lines
that publish, catch-up and vllm-sync share (timestamp, step, bytes, time, lag; --json lines)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import cli_run
from ckpt_factory import save_series
from pulsediff.format.manifest import MANIFEST
from pulsediff.ops.inspect import checkpoint_digest_of

STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"


@pytest.fixture
def steps(tmp_path) -> Path:
    folder = tmp_path / "all"
    folder.mkdir()
    save_series(folder, 3, seed=8, shape=(48, 32), tensors=2, density=0.03)
    return folder


def feed(steps: Path, train: Path, upto: int) -> Path:
    train.mkdir(exist_ok=True)
    for s in range(upto + 1):
        if not (train / f"step_00000{s}.safetensors").exists():
            shutil.copyfile(steps / f"step_00000{s}.safetensors", train / f"step_00000{s}.safetensors")
    return train


def test_catch_up_to_a_step_asked_for_earlier_ones_too(steps, tmp_path):
    out = tmp_path / "out"
    cli_run.run("publish", steps, out, "--settle", "0", "-q")
    worker = tmp_path / "w.safetensors"
    shutil.copyfile(steps / "step_000000.safetensors", worker)
    proc = cli_run.run("catch-up", worker, out, "--step", "2", "--json")
    assert json.loads(proc.stdout)["step"] == 2 and checkpoint_digest_of(worker) == checkpoint_digest_of(
        steps / "step_000002.safetensors")
    back = json.loads(cli_run.run("catch-up", worker, out, "--step", "1", "--json").stdout)  # asked: allowed
    assert back["step"] == 1 and back["from_anchor"]
    assert worker.read_bytes() == (steps / "step_000001.safetensors").read_bytes()
    plan = json.loads(cli_run.run("catch-up", worker, out, "--plan", "--step", "3", "--json").stdout)
    assert plan["step"] == 3 and plan["files"]
    line = cli_run.one_line_error(cli_run.run("catch-up", worker, out, "--step", "7", check=False), 1)
    assert line.endswith(f"step not found: step 7 in {out} (it has steps 0-3)")


@pytest.mark.parametrize("args, said", [(("--watch", "--step", "1"), "--watch follows the newest step"),
                                        (("--watch", "--plan"), "--plan looks once"),
                                        (("--idle-exit", "1"), "--idle-exit is for --watch")])
def test_catch_up_watch_refuses_what_does_not_go_with_it(steps, tmp_path, args, said):
    proc = cli_run.run("catch-up", tmp_path / "w.safetensors", steps, *args, check=False)
    assert said in cli_run.one_line_error(proc, 2)


class Lines:
    """A --watch's stdout, line by line, with a time limit per line."""

    def __init__(self, proc):
        import queue
        import threading

        self.proc, self.queue = proc, queue.Queue()
        threading.Thread(target=lambda: [self.queue.put(line) for line in proc.stdout], daemon=True).start()

    def next(self, timeout: float = 60) -> dict:
        return json.loads(self.queue.get(timeout=timeout))


def test_catch_up_watch_follows_says_a_failed_look_once_and_goes_on(steps, tmp_path):
    train = feed(steps, tmp_path / "train", 1)
    out = tmp_path / "out"
    cli_run.run("publish", train, out, "--settle", "0", "-q")
    worker = tmp_path / "w.safetensors"
    shutil.copyfile(steps / "step_000000.safetensors", worker)
    proc = subprocess.Popen([*cli_run.PULSEDIFF, "catch-up", str(worker), str(out), "--watch", "--interval", "0.2",
                             "--idle-exit", "6", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = Lines(proc)
    try:
        first = lines.next()
        assert re.fullmatch(STAMP, first.pop("time"))
        assert first.pop("seconds") > 0 and first == {"step": 1, "bytes": (out / "patch-00000000-00000001.pulsediff")
                                                      .stat().st_size, "lag": 0,
                                                      "files": ["patch-00000000-00000001.pulsediff"]}
        (out / MANIFEST).rename(tmp_path / "kept")  # the series is not whole: the worker stays, says so once
        problem = lines.next()
        assert problem["step"] == 1 and "manifest not found" in problem["problem"]
        time.sleep(1.0)  # several looks fail meanwhile: said once
        (tmp_path / "kept").rename(out / MANIFEST)
        cli_run.run("publish", feed(steps, train, 3), out, "--settle", "0", "-q")
        reached = lines.next()
        if reached["step"] == 2:  # a look between publish's two manifest writes: step 2, then 3
            reached = lines.next()
        assert reached["step"] == 3 and reached["lag"] == 0
        assert proc.wait(timeout=60) == 0  # --idle-exit
        assert lines.queue.empty()
    finally:
        proc.kill()
    assert worker.read_bytes() == (steps / "step_000003.safetensors").read_bytes()
    assert proc.stderr.read() == ""


def test_catch_up_watch_stops_on_another_runs_checkpoint(steps, tmp_path):
    out = tmp_path / "out"
    cli_run.run("publish", steps, out, "--settle", "0", "-q")
    other = tmp_path / "other"
    other.mkdir()
    save_series(other, 0, seed=99, shape=(48, 32), tensors=2, density=0.03)
    proc = cli_run.run("catch-up", other / "step_000000.safetensors", out, "--watch", "--idle-exit", "5", check=False,
                       timeout=60)
    assert "is not a step of the series" in cli_run.one_line_error(proc, 1)


def test_publish_watch_prints_a_line_per_step(steps, tmp_path):
    train = feed(steps, tmp_path / "train", 2)
    proc = cli_run.run("publish", train, tmp_path / "out", "--watch", "--interval", "0.1", "--settle", "0",
                       "--idle-exit", "1")
    lines = proc.stderr.splitlines()
    assert [re.fullmatch(rf"{STAMP} {re.escape(str(tmp_path / 'out'))} at step (\d): \S+ \S*B in [\d.]+ s, "
                         rf"(at the newest|\d steps? behind the newest)", line).group(1) for line in lines] == ["0", "1", "2"]
    assert lines[0].endswith("2 steps behind the newest") and lines[2].endswith("at the newest")
