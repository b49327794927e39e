"""Small inconsistencies a new user met (issue 33, point 8): outputs replaced without -f, a
table wider on a pipe than on the screen, unlabelled bars, one size under two names."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ckpt_factory import save_series

PULSEDIFF = [sys.executable, "-m", "pulsediff"]


def run(*args, env=None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*PULSEDIFF, *map(str, args)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})}, **kw)


@pytest.fixture(scope="module")
def train(tmp_path_factory):
    folder = tmp_path_factory.mktemp("consistency") / "train"
    folder.mkdir()
    # Millions of elements: with every column, the per-step table is wider than 80 columns.
    save_series(folder, 3, seed=8, shape=(512, 1024), tensors=4, density=0.02)
    return folder


def test_stats_plot_refuses_an_existing_png_without_force(train, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "mine.png"
    png.write_bytes(b"a plot the user keeps")
    proc = run("stats", train, "--plot", png, "-q")
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "already exists" in proc.stderr and "-f" in proc.stderr
    assert png.read_bytes() == b"a plot the user keeps"
    proc = run("stats", train, "--plot", png, "-q", "-f")
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_demo_does_not_replace_files_it_did_not_write(tmp_path):
    demo = tmp_path / "demo"
    demo.mkdir()
    (demo / "step.pulsediff").write_bytes(b"the first demo's patch")
    proc = run("demo", "--dir", demo)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "already exists; it was not written by a demo: give -f/--force" in proc.stderr
    assert (demo / "step.pulsediff").read_bytes() == b"the first demo's patch"
    assert sorted(p.name for p in demo.iterdir()) == ["step.pulsediff"]  # nothing trained or written


def test_piped_tables_are_laid_out_for_80_columns(train):
    env = {"COLUMNS": ""}  # no width given: a pipe
    piped = run("stats", train, env=env)
    assert piped.returncode == 0, piped.stderr
    assert max(map(len, piped.stdout.splitlines())) <= 80, piped.stdout
    wide = run("stats", train, env={"COLUMNS": "200"})
    assert wide.returncode == 0, wide.stderr
    # COLUMNS still widens it: the columns left out at 80 come back
    assert max(map(len, wide.stdout.splitlines())) > max(map(len, piped.stdout.splitlines()))


def test_make_and_stats_json_name_the_patch_size_alike(train, tmp_path):
    patch = tmp_path / "p.pulsediff"
    made = run("make", train / "step_000000.safetensors", train / "step_000001.safetensors", "-o", patch, "--json")
    assert made.returncode == 0, made.stderr
    made = json.loads(made.stdout)
    stats = json.loads(run("stats", patch, "--json").stdout)
    assert made["patch_bytes"] == stats["patch_bytes"] == patch.stat().st_size
    assert made["bytes"] == made["patch_bytes"]  # the old name, kept until 0.3


def test_series_stats_bars_say_which_step_they_make(train):
    from test_terminal import on_pty

    code, out = on_pty(["stats", train], columns=100)
    assert code == 0, out[-2000:]
    # Each step's bar is labelled with its place in the series, none with a bare "make".
    assert b"make 1/3" in out and b"make 3/3" in out, out[-3000:]
