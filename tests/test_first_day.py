"""A user's first day (issue 48): wrong shapes said plainly, paths read where they are meant, quiet caches."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import cli_run
from ckpt_factory import save_series


@pytest.fixture
def train(tmp_path) -> Path:
    folder = tmp_path / "train"
    folder.mkdir()
    save_series(folder, 2, seed=4, shape=(32, 16), tensors=2, density=0.05)
    return folder


def test_a_folder_of_step_files_given_as_a_checkpoint_is_named_as_such(train, tmp_path):
    patch = tmp_path / "p.pulsediff"
    cli_run.run("make", train / "step_000000.safetensors", train / "step_000001.safetensors", "-o", patch, "-q")
    line = cli_run.one_line_error(cli_run.run("apply", train, patch, "-o", tmp_path / "out", check=False), 1)
    assert line == (f"pulsediff: error: not a valid safetensors checkpoint: {train}: a folder of several checkpoints, "
                    f"not one (step_000000.safetensors and step_000001.safetensors both hold 'layers.0.weight'): give "
                    f"one of them, e.g. {train / 'step_000002.safetensors'}")
    assert not (tmp_path / "out").exists()


def test_a_folder_of_step_folders_given_as_a_checkpoint_names_one(train, tmp_path):
    steps = tmp_path / "steps"
    for step in (0, 1):
        (steps / f"step_{step}").mkdir(parents=True)
        shutil.copyfile(train / f"step_00000{step}.safetensors", steps / f"step_{step}" / "model.safetensors")
    line = cli_run.one_line_error(cli_run.run("digest", steps, check=False), 1)
    assert line.endswith(f"holds checkpoints in folders: give one of them, e.g. {steps / 'step_1'}")


def test_swapped_arguments_are_a_usage_mistake_for_apply_and_catch_up_alike(train, tmp_path):
    patch = tmp_path / "p.pulsediff"
    cli_run.run("make", train / "step_000000.safetensors", train / "step_000001.safetensors", "-o", patch, "-q")
    cli_run.run("publish", train, tmp_path / "out", "--settle", "0", "-q")
    apply = cli_run.run("apply", patch, train / "step_000000.safetensors", "-o", tmp_path / "x", check=False)
    catch_up = cli_run.run("catch-up", tmp_path / "out", train / "step_000000.safetensors", check=False)
    assert apply.returncode == catch_up.returncode == 2, (apply.stderr, catch_up.stderr)
    assert "comes first" in apply.stderr and "comes first" in catch_up.stderr


def test_a_relative_series_path_is_sent_to_the_engine_absolute(train, tmp_path, monkeypatch):
    """A server's workers read it from their own directory: 'no such patch file' on a path that exists here."""
    from pulsediff.engines.vllm_client import resolve_target

    cli_run.run("publish", train, tmp_path / "out", "--settle", "0", "-q")
    monkeypatch.chdir(tmp_path)
    target = resolve_target("out")
    assert target.request == {"source": str(tmp_path / "out"), "step": 2}
    assert resolve_target("http://127.0.0.1:1/x.pulsediff").request["source"] == "http://127.0.0.1:1/x.pulsediff"


LIGHT = """
import sys
from pulsediff.cli.main import main
try:
    main(sys.argv[1:])
finally:
    heavy = sorted(m for m in ("numba", "numpy", "torch") if m in sys.modules)
    print("loaded:", ",".join(heavy), file=sys.stderr)
"""


@pytest.mark.parametrize("args", [("stats", "PATCH"), ("stats", "PATCH", "--json"), ("publish", "--help"),
                                  ("catch-up", "--help"), ("make", "--help")])
def test_light_commands_load_no_kernels(train, tmp_path, args):
    """A header, a manifest or help needs neither Numba nor numpy: `stats PATCH` took 0.7-0.9 s for them.
    (Times: scripts/bench_light.py; this pins the cause.)"""
    import subprocess
    import sys

    patch = tmp_path / "p.pulsediff"
    cli_run.run("make", train / "step_000000.safetensors", train / "step_000001.safetensors", "-o", patch, "-q")
    argv = [str(patch) if a == "PATCH" else a for a in args]
    proc = subprocess.run([sys.executable, "-c", LIGHT, *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "loaded:", proc.stderr
