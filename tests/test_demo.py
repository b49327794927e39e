"""The demo and the example model it trains: fast enough to run, realistic in what it shows, deterministic."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys

import pytest

from pulsediff.cli.output import Output
from pulsediff.example import (DEMO_RECIPE, fp32_path_for, make_example_fp32_pair, make_example_pair,
                               make_example_series, unchanged_fraction)

PULSEDIFF = [sys.executable, "-m", "pulsediff"]
TINY = dict(d_model=32, n_layers=1, n_heads=2, vocab=256, warmup_steps=6, batch=2, seq_len=8)


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_demo_end_to_end(tmp_path):
    """The real demo, as a user runs it: progress while training, a bit-identical rebuild, realistic numbers."""
    d = tmp_path / "demo"
    proc = subprocess.run([*PULSEDIFF, "demo", "--dir", str(d)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    total = DEMO_RECIPE["warmup_steps"] + 1
    # stderr is not a terminal here: a line every 10 steps and one for the last (the RL step).
    steps = [int(m) for m in re.findall(rf"training: step (\d+)/{total}", proc.stderr)]
    assert steps == [*range(10, total, 10), total]
    assert f"step {total}/{total}, RL step, loss" in proc.stderr
    assert (d / "rebuilt.safetensors").read_bytes() == (d / "step_000001.safetensors").read_bytes()
    # The numbers the demo prints are those of the files it left, computed again independently.
    unchanged = unchanged_fraction(d / "step_000000.safetensors", d / "step_000001.safetensors")
    assert f"{100 * unchanged:.2f}% unchanged" in proc.stdout
    assert 0.98 <= unchanged <= 0.995  # RL-like: ~99% of BF16 elements bit-identical after one step at lr 1e-6
    bits = float(re.search(r"bits per changed element\s*│\s*([\d.]+)", proc.stdout).group(1))
    assert 6.5 <= bits <= 9.0
    ratio = float(re.search(r"([\d.]+)x smaller", proc.stdout).group(1))
    patch = (d / "step.pulsediff").stat().st_size
    assert ratio == pytest.approx((d / "step_000001.safetensors").stat().st_size / patch, rel=0.01)
    assert ratio >= 100


def test_demo_quiet_prints_only_the_result_and_runs_again(tmp_path, monkeypatch):
    """-q: no progress lines; the result table still goes to stdout (in-process, with a tiny recipe). A
    second demo in the same folder replaces the first one's files, without -f."""
    from typer.testing import CliRunner

    from pulsediff.cli.main import app

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # the demo sets it; undone after the test
    for key, value in {**TINY, "warmup_steps": 3}.items():
        monkeypatch.setitem(DEMO_RECIPE, key, value)
    result = CliRunner().invoke(app, ["demo", "--dir", str(tmp_path / "q"), "-q"])
    assert result.exit_code == 0, result.output
    assert "training" not in result.output and "[1/4]" not in result.output
    assert "bit-identical" in result.output
    (tmp_path / "q" / "step.pulsediff").write_bytes(b"stale")
    again = CliRunner().invoke(app, ["demo", "--dir", str(tmp_path / "q"), "-q", "--lr", "2e-6"])
    assert again.exit_code == 0, again.output
    assert (tmp_path / "q" / "rebuilt.safetensors").read_bytes() == (tmp_path / "q" / "step_000001.safetensors").read_bytes()
    assert (tmp_path / "q" / "step.pulsediff").read_bytes()[:4] != b"stal"
    loud = CliRunner().invoke(app, ["demo", "--dir", str(tmp_path / "loud")])
    assert loud.exit_code == 0 and "training: step 4/4, RL step, loss" in loud.output


@pytest.mark.parametrize("given, spin", [(None, "0"), ("ACTIVE", "30000000000")])
def test_example_module_makes_openmp_wait_passively(given, spin):
    """Importing pulsediff.example (the README's series line) makes torch's OpenMP threads wait passively, as the
    demo does: spinning threads made that line 45-63 s instead of 11-16 s on shared cores. A user's setting wins.

    libgomp prints the spin count it settled on (0: passive; 300000 when unset; 3e10 for ACTIVE) when it loads.
    """
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"
    if given:
        env["OMP_WAIT_POLICY"] = given
    proc = subprocess.run([sys.executable, "-c", "import pulsediff.example"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"GOMP_SPINCOUNT = '{spin}'" in proc.stderr


def test_example_series_is_deterministic_and_reports_each_step(tmp_path):
    seen = []
    a = make_example_series(tmp_path / "a", steps=2, on_step=lambda *args: seen.append(args), **TINY)
    b = make_example_series(tmp_path / "b", steps=2, **TINY)
    assert [p.name for p in a] == ["step_000000.safetensors", "step_000001.safetensors", "step_000002.safetensors"]
    assert [sha(p) for p in a] == [sha(p) for p in b]
    assert [(done, total) for done, total, _ in seen] == [(i, 8) for i in range(1, 9)]
    assert all(loss > 0 for _, _, loss in seen)
    assert len({sha(p) for p in a}) == 3  # each step changed something


def test_example_pair_signatures_keep_working(tmp_path):
    old, new = make_example_pair(tmp_path / "p", **TINY)
    assert (old.name, new.name) == ("step_000000.safetensors", "step_000001.safetensors")
    old32, new32 = make_example_fp32_pair(tmp_path / "f", **TINY)
    assert old32 == fp32_path_for(tmp_path / "f" / "step_000000.safetensors") and new32.exists()
    with pytest.raises(ValueError):
        make_example_pair(tmp_path / "z", steps=0, **TINY)


def test_step_progress_lines(capsys):
    with Output().steps("training", 25, every=10) as bar:
        for i in range(1, 26):
            bar.update(i, f"loss {i}")
    err = capsys.readouterr().err
    assert re.findall(r"step (\d+)/25, loss \d+", err) == ["10", "20", "25"]
    with Output(quiet=True).steps("training", 25) as bar:
        for i in range(1, 26):
            bar.update(i)
    assert capsys.readouterr().err == ""


def test_example_model_folders_ship_a_tokenizer_that_transformers_loads(tmp_path):
    """A server of the example model can be asked in text (issue 48: vllm serve died on a missing tokenizer)."""
    transformers = pytest.importorskip("transformers")
    make_example_series(tmp_path / "t", steps=1, **{**TINY, "warmup_steps": 1}, model_folders=True)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "t" / "step_000001")
    assert tok("w1 w2 w255").input_ids == [1, 2, 255]
    assert tok.decode([0, 7, 255]) == "w0 w7 w255" and tok.all_special_ids == []
    assert len(tok) == TINY["vocab"]
