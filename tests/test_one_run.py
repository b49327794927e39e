"""A series belongs to one run, and nothing moves a checkpoint or an engine onto another run's weights,
or back to an earlier step, unless asked (issue 48, items 1 and 2)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import cli_run
from ckpt_factory import save_series
from pulsediff.errors import NotInSeriesError, OtherRunError
from pulsediff.format.manifest import MANIFEST
from pulsediff.ops.inspect import checkpoint_digest_of
from pulsediff.series.publish import publish_once


def two_runs(root: Path, steps_a: int = 4, steps_b: int = 4) -> tuple[Path, Path]:
    """Runs A and B (other seeds: other weights from step 0 on), steps 0..n each."""
    a, b = root / "A", root / "B"
    a.mkdir()
    b.mkdir()
    save_series(a, steps_a, seed=1, shape=(48, 32), tensors=2, density=0.02)
    save_series(b, steps_b, seed=2, shape=(48, 32), tensors=2, density=0.02)
    return a, b


def folder_bytes(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("steps_b", [2, 4, 6])  # fewer steps, as many, more: each once passed or half did
def test_publish_refuses_another_runs_folder(tmp_path, steps_b):
    a, b = two_runs(tmp_path, 4, steps_b)
    out = tmp_path / "out"
    publish_once(a, out, settle=0)
    before = folder_bytes(out)
    proc = cli_run.run("publish", b, out, "--settle", "0", check=False)
    line = cli_run.one_line_error(proc, 1)
    step0 = b / "step_000000.safetensors"
    assert (f"{b} is not the run published in {out}: its step 0 ({step0.name}) is {checkpoint_digest_of(step0)}, "
            f"the series' step 0 is {checkpoint_digest_of(a / step0.name)}; a series belongs to one run") in line
    assert folder_bytes(out) == before  # nothing written


def test_publish_names_the_first_step_where_runs_part(tmp_path):
    """Two runs from one base model: step 0 is shared, they part at step 1."""
    a, b = two_runs(tmp_path, 3, 3)
    shutil.copyfile(a / "step_000000.safetensors", b / "step_000000.safetensors")
    out = tmp_path / "out"
    publish_once(a, out, settle=0)
    with pytest.raises(OtherRunError, match=r"its step 1 \(step_000001.safetensors\) is "):
        publish_once(b, out, settle=0)


def test_publish_of_the_same_run_again_is_up_to_date_and_reads_once_per_change(tmp_path, monkeypatch):
    a, _ = two_runs(tmp_path, 2, 1)
    out = tmp_path / "out"
    publish_once(a, out, settle=0)
    import pulsediff.ops.inspect as inspect

    reads = []
    real = inspect.checkpoint_digest_of
    monkeypatch.setattr(inspect, "checkpoint_digest_of", lambda path, *a, **k: reads.append(path) or real(path, *a, **k))
    for _ in range(3):  # a watch's looks: the newest published checkpoint is read once, until it changes
        assert publish_once(a, out, settle=0).steps == []
    assert reads == [a / "step_000002.safetensors"]
    other = tmp_path / "other"
    other.mkdir()
    save_series(other, 2, seed=9, shape=(48, 32), tensors=2, density=0.02)
    shutil.copyfile(other / "step_000002.safetensors", a / "step_000002.safetensors")  # rewritten in place
    with pytest.raises(OtherRunError, match="its step 2"):
        publish_once(a, out, settle=0)


# -- an engine (its host state) is never moved across runs, nor back, unless asked --------------------------


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    """Run A (4 steps, its series, and a series of its steps 0-1 only) and run B (4 steps), qwen2-shaped."""
    from engine_series import make_series, publish

    root = tmp_path_factory.mktemp("engine-runs")
    train_a = make_series("qwen2", root / "A", 3, seed=0)
    train_b = make_series("qwen2", root / "B", 3, seed=5)
    early = root / "A-early"
    early.mkdir()
    for step in (0, 1):
        shutil.copytree(train_a / f"step_{step:06d}", early / f"step_{step:06d}")
    return train_a, train_b, publish(train_a, root / "seriesA"), publish(early, root / "seriesA01")


def bits_of(state) -> dict:
    return {n: t.contiguous().view(-1).view(dtype=__import__("torch").int16).numpy().copy() for n, t in
            state.tensors.items()}


def assert_same(a: dict, b: dict) -> None:
    import numpy as np

    assert a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("case", ["another run", "a series without its step"])
def test_an_engine_is_not_moved_onto_weights_the_series_does_not_list(engine_runs, case):
    from pulsediff.engines.state import load_host_state

    train_a, train_b, series_a, series_a01 = engine_runs
    at, source, newest = ((train_b / "step_000003", series_a, 3) if case == "another run"
                          else (train_a / "step_000003", series_a01, 1))
    state = load_host_state(at)
    before, digest = bits_of(state), state.digest
    with pytest.raises(NotInSeriesError) as info:
        state.advance(str(source))
    assert str(info.value) == (
        f"the engine's weights ({digest}) are not a step of the series in {source} (the manifest lists no step "
        f"with their digest: another run or model, or a step older than those the series keeps); give force (vllm-sync -f, "
        f"update_info \"force\": true, force=True) to replace them with step {newest}, rebuilt from an anchor")
    assert_same(bits_of(state), before)
    assert state.digest == digest
    advance = state.advance(str(source), force=True)  # asked: replaced from the anchor
    assert advance.step == newest
    assert state.digest == checkpoint_digest_of(train_a / f"step_{newest:06d}")


def test_an_engine_goes_back_to_a_listed_step_when_that_step_is_asked_for(engine_runs):
    from pulsediff.engines.state import load_host_state

    train_a, _, series_a, _ = engine_runs
    state = load_host_state(train_a / "step_000000")
    assert state.advance(str(series_a)).step == 3
    assert state.advance(str(series_a), 1).step == 1
    assert state.digest == checkpoint_digest_of(train_a / "step_000001")


def test_update_info_takes_force_as_a_boolean_only():
    from pulsediff.engines.state import parse_update_request
    from pulsediff.errors import UsageError

    assert parse_update_request({"source": "s", "force": True}).force is True
    assert parse_update_request({"source": "s"}).force is False
    with pytest.raises(UsageError, match="'force' must be true or false"):
        parse_update_request({"source": "s", "force": 1})


def test_a_published_checkpoint_gone_or_unreadable_is_no_verdict(tmp_path):
    """A trainer that deletes (or is rewriting) the newest published checkpoint while publish looks: nothing is
    refused on that look; an unreadable one is no evidence of another run either."""
    a, _ = two_runs(tmp_path, 2, 1)
    out = tmp_path / "out"
    publish_once(a, out, settle=0)
    (a / "step_000002.safetensors").write_bytes(b"cut short")  # the newest published step, now unreadable
    assert publish_once(a, out, settle=0).steps == []
    (a / "step_000002.safetensors").unlink()
    assert publish_once(a, out, settle=0).steps == []  # step 1 is checked now, and is the run's
