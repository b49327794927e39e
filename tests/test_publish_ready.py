"""publish --watch against trainers that write checkpoints in every common way.

A writer process writes each step's checkpoint in chunks with pauses between
them: sequentially, into a preallocated file, tail first, or under a temporary
name renamed at the end. The preallocating and tail-first writers make files
that parse (header present, sizes right) while their middle is still zeros;
a publisher that judged completeness by parsing published such steps. Here
every published entry must carry the true digest of its step, and a worker
that catches up must end byte-identical to the last step.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ckpt_factory import save_series
from pulsediff.io.atomic import TMP_SUFFIX
from pulsediff.ops.inspect import checkpoint_digest_of
from pulsediff.format.manifest import Manifest
from pulsediff.series.catch_up import catch_up
from pulsediff.series.publish import publish, publish_once

STEPS = 3
PULSEDIFF = [sys.executable, "-m", "pulsediff"]

WRITER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    mode, src, dst, marker = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4] == "marker"
    PAUSE, CHUNKS = 0.12, 5
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        n = -(-len(data) // CHUNKS)
        chunks = [(i, data[i:i + n]) for i in range(0, len(data), n)]
        out = dst / f.name
        if mode == "rename":
            tmp = dst / (".tmp-" + f.name)
            with open(tmp, "wb") as w:
                for _, c in chunks:
                    w.write(c); w.flush(); time.sleep(PAUSE)
            os.replace(tmp, out)
        elif mode == "sequential":
            with open(out, "wb") as w:
                for _, c in chunks:
                    w.write(c); w.flush(); time.sleep(PAUSE)
        else:  # preallocate: zeros first, then the bytes in order; tail-first: the same, last chunk first
            fd = os.open(out, os.O_CREAT | os.O_WRONLY, 0o644)
            os.ftruncate(fd, len(data))
            time.sleep(PAUSE)
            for off, c in (chunks if mode == "preallocate" else chunks[::-1]):
                os.pwrite(fd, c, off); time.sleep(PAUSE)
            os.close(fd)
        if marker:
            (dst / f.name.replace(".safetensors", ".done")).touch()
        time.sleep(0.3)
""")


@pytest.fixture(scope="module")
def steps(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("steps")
    save_series(src, STEPS, seed=7, shape=(128, 64), tensors=4, density=0.05)
    return src


@pytest.mark.parametrize("writer, ready", [
    ("sequential", "stable"), ("preallocate", "stable"), ("tail-first", "stable"), ("rename", "stable"),
    ("preallocate", "marker"), ("tail-first", "marker"),
])
def test_watch_publishes_only_complete_steps(steps, tmp_path, writer, ready):
    train, pub = tmp_path / "train", tmp_path / "pub"
    train.mkdir()
    (tmp_path / "writer.py").write_text(WRITER)
    publisher = subprocess.Popen([*PULSEDIFF, "publish", str(train), str(pub), "--watch", "--interval", "0.05",
                                  "--settle", "1.0", "--idle-exit", "2", "--ready", ready, "--anchor-every", "2", "-q"])
    try:
        subprocess.run([sys.executable, str(tmp_path / "writer.py"), writer, str(steps), str(train), ready],
                       check=True, timeout=120)
        assert publisher.wait(timeout=120) == 0
    finally:
        if publisher.poll() is None:
            publisher.kill()
    manifest = Manifest.load(pub)
    truth = {s: checkpoint_digest_of(steps / f"step_{s:06d}.safetensors") for s in range(STEPS + 1)}
    assert {e.step for e in manifest.entries} == set(truth)
    for e in manifest.entries:
        assert e.target == truth[e.step], f"{e.file} was made from a half-written step {e.step}"
    worker = tmp_path / "worker.safetensors"
    catch_up(worker, pub)
    assert worker.read_bytes() == (steps / f"step_{STEPS:06d}.safetensors").read_bytes()
    assert not [p for p in pub.iterdir() if p.name.endswith(TMP_SUFFIX)]


def test_one_shot_publish_waits_for_fresh_checkpoints_to_settle(steps, tmp_path):
    train, pub = tmp_path / "train", tmp_path / "pub"
    train.mkdir()
    for f in steps.iterdir():
        (train / f.name).write_bytes(f.read_bytes())
    t0 = time.monotonic()
    report = publish(train, pub, settle=0.8, interval=0.1)
    assert time.monotonic() - t0 >= 0.7  # it waited rather than skipping the fresh files
    assert not report.pending and report.anchors >= 1
    assert Manifest.load(pub).newest.step == STEPS


def test_marker_rule_waits_for_the_marker(steps, tmp_path):
    train, pub = tmp_path / "train", tmp_path / "pub"
    train.mkdir()
    for f in sorted(steps.iterdir())[:2]:
        (train / f.name).write_bytes(f.read_bytes())
    (train / "step_000000.done").touch()
    report = publish_once(train, pub, ready="marker")
    assert report.pending == {"step_000001.safetensors": "no step_000001.done yet"}
    assert Manifest.load(pub).newest.step == 0


def test_checkpoint_rewritten_while_read_is_not_published(steps, tmp_path, monkeypatch):
    """The second look: a checkpoint that changes while its patches are made is not published, and the
    patches made from it are not left in the folder."""
    import pulsediff.ops.make as make

    train, pub = tmp_path / "train", tmp_path / "pub"
    train.mkdir()
    for f in sorted(steps.iterdir())[:2]:
        (train / f.name).write_bytes(f.read_bytes())
    publish_once(train, pub, settle=0)
    (train / "step_000002.safetensors").write_bytes((steps / "step_000002.safetensors").read_bytes())
    real = make.make_patch

    def trainer_writes_again(old, new, out, **kw):
        header = real(old, new, out, **kw)
        Path(new).write_bytes((steps / "step_000003.safetensors").read_bytes())  # the trainer rewrote it
        return header

    monkeypatch.setattr(make, "make_patch", trainer_writes_again)
    report = publish_once(train, pub, settle=0)
    assert report.pending == {"step_000002.safetensors": "settling"} and report.patches == 0
    assert Manifest.load(pub).newest.step == 1
    assert sorted(p.name for p in pub.iterdir()) == sorted(
        ["manifest.json", "anchor-00000000.pulsediff", "patch-00000000-00000001.pulsediff"])


def test_settled_file_that_is_no_checkpoint_is_skipped(steps, tmp_path):
    train, pub = tmp_path / "train", tmp_path / "pub"
    train.mkdir()
    (train / "step_000000.safetensors").write_bytes((steps / "step_000000.safetensors").read_bytes())
    (train / "step_000001.safetensors").write_bytes(b"not a checkpoint")
    (train / "step_000002.safetensors").write_bytes((steps / "step_000002.safetensors").read_bytes())
    report = publish_once(train, pub, settle=0)
    assert report.skipped == {"step_000001.safetensors": "does not open as a checkpoint"}
    assert {e.step for e in Manifest.load(pub).entries} == {0, 2}
