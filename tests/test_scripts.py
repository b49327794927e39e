"""The benchmarks the issues name still run: scripts/bench_core.py and bench_catchup.py, tiny.

A benchmark is not a test, but one that breaks unnoticed (a helper's return
value changed under its callers, say) leaves a speed claim that nobody can
measure again. This runs it end to end once, on a pair small enough to take
seconds, and checks that it says what its readers rely on.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
ROOT = SCRIPTS.parent


def test_bench_core_runs_and_reports_every_row(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_core.py"), "--gb", "0.002", "--density", "0.05",
                           "--repeats", "1", "--no-warmup", "--workdir", str(tmp_path / "w"), "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert r["cmp_ok"] and not r["cold"]
    assert set(r["ops"]) == {"startup", "cat OLD NEW", "cp NEW", "cp NEW + sync", "make", "apply"}
    assert all(op["median_s"] > 0 and len(op["times"]) == 1 for op in r["ops"].values())
    # pulsediff allocates: a sampled private memory of 0 would mean the sampler looked at the wrong process
    assert r["ops"]["make"]["peak_private_mib"] > 1 and r["ops"]["apply"]["peak_private_mib"] > 1
    assert "private MiB" in proc.stdout and "apply / cp+sync" in proc.stdout


def test_bench_catchup_runs_on_a_tiny_series(tmp_path):
    """Generate, publish, catch up, apply the chain, squash: every output checked by the script's cmp."""
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_catchup.py"), "--workdir", str(tmp_path / "w"),
                           "--gb", "0.002", "--steps", "2", "--anchor-every", "2", "--repeats", "1", "--links", "",
                           "--codecs", "ctx-rans", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert {"catch-up [ctx-rans]", "apply 2 [ctx-rans]", "squash 2 [ctx-rans]"} <= set(r["ops"])
    assert all(op["median_s"] > 0 for op in r["ops"].values())
    assert all(all(op["cmp_ok"]) for op in r["ops"].values() if op.get("cmp_ok") is not None)


def test_bench_variants_compares_thread_counts_and_devices(tmp_path):
    """Issue 27's benchmark: rows per PULSEDIFF_THREADS value (and per --device, auto and cpu here),
    each patch identical and each output cmp-identical, or the script fails."""
    for variants in (["--threads", "1", "2"], ["--devices", "cpu", "auto"]):
        proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_variants.py"), *variants, "--gb", "0.002",
                               "--repeats", "1", "--workdir", str(tmp_path / variants[0].strip("-"))],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        rows = [line for line in proc.stdout.splitlines() if line.startswith(f"| {variants[1]} |")
                or line.startswith(f"| {variants[2]} |")]
        assert len(rows) == 2 and rows[0].endswith("| 1.00 | 1.00 |"), proc.stdout


def test_bench_inprocess_alternates_trees_and_thread_counts(tmp_path):
    """scripts/bench_inprocess.py on a tiny pair: a row per tree, each make's bytes the same at
    every thread count, each apply's output NEW's bytes, or the script fails."""
    import numpy as np

    from ckpt_factory import mutate, random_tensor, save

    rng = np.random.default_rng(1)
    old = {"w": random_tensor(rng, "BF16", (64, 64))}
    old_path = save(old, tmp_path / "old.safetensors")
    new_path = save({"w": mutate(rng, old["w"], 0.02)}, tmp_path / "new.safetensors")
    for op in ("make", "apply"):
        proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_inprocess.py"), "--op", op, "--old", str(old_path),
                               "--new", str(new_path), "--rounds", "2", "--per-process", "1", "--src", str(ROOT),
                               "--src", str(ROOT)], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        rows = [line for line in proc.stdout.splitlines() if line.startswith(f"| {ROOT} |")]
        assert len(rows) == 2 and all(row.count(" s |") == 2 for row in rows), proc.stdout


def test_fuzz_campaign_trials_run_and_find_nothing(tmp_path):
    """The shrink and remote trials of scripts/fuzz_campaign.py, a few of each: they run, count every
    trial, and find no problem (the long campaign is run by hand; docs/benchmarks-log.md)."""
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "fuzz_campaign.py"), "--cases", "0", "--kill-trials", "0",
                           "--shrink-trials", "2", "--remote-trials", "4", "--root", str(tmp_path / "w"),
                           "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    for mode, result in r["shrink_trials"].items():
        assert result["problems"] == [], (mode, result)
        finished = result["counts"].get("finished (the shrink came after the reads)", 0)
        assert finished + result["counts"].get("refused", 0) == 2, (mode, result)
    remote = r["remote_trials"]
    assert remote["problems"] == [], remote
    assert sum(remote["counts"].values()) == 4 and sum(remote["patch_gets"].values()) >= 4, remote


def test_bench_digest_times_both_schemes(tmp_path):
    import torch
    from safetensors.torch import save_file

    path = tmp_path / "c.safetensors"
    save_file({"w": torch.arange(200_000, dtype=torch.int32)}, str(path))
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_digest.py"), str(path), "--repeats", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "| tree |" in proc.stdout and "| flat |" in proc.stdout and "tree / flat:" in proc.stdout


def test_bench_entropy_times_both_codecs_side_by_side():
    """scripts/bench_entropy.py: a row per codec, each with a positive rate (each mode also checks
    that the section it times decodes to the target)."""
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_entropy.py"), "--codec", "ctx-rans", "--codec",
                           "ctx-ac", "--elements", "200000", "--density", "0.02", "--repeats", "1"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split("|") for line in proc.stdout.splitlines() if line.startswith(f"| {ROOT} |")]
    assert [r[2].strip() for r in rows] == ["ctx-rans", "ctx-ac"]
    assert all(float(r[5]) > 0 and float(r[6]) > 0 for r in rows)


def test_bench_live_apply_reports_ratio_and_break_even(tmp_path):
    """Issue 45's harness on a tiny MoE-shaped state dict: its row has the ratios to index_copy_ and
    B* for both checks (the script exits non-zero if an apply is not bit for bit); --save-moe
    writes the pair as files for bench_core.py."""
    script = str(SCRIPTS / "bench_live_apply.py")
    proc = subprocess.run([sys.executable, script, "--cases", "moe", "--moe-tensors", "40", "--rounds", "1"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.startswith("moe "))
    assert row.split()[1] == "40" and row.count("x ") == 2 and row.count("Gb/s") == 2, proc.stdout
    proc = subprocess.run([sys.executable, script, "--moe-tensors", "40", "--save-moe", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "old.safetensors").stat().st_size == (tmp_path / "new.safetensors").stat().st_size > 40 * 32768


def test_bench_light_times_every_light_command_beside_version():
    """Issue 48's harness, one round: a row for --version, stats (header only, --json, --values), digest and
    every command's help, each with its ratio to --version."""
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_light.py"), "--rounds", "1"], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = {line[:24].strip(): line[24:].split() for line in proc.stdout.splitlines()[2:]}
    assert {"version", "stats PATCH", "stats --json", "stats --values", "digest CKPT", "help make",
            "help vllm-sync"} <= set(rows), proc.stdout
    assert rows["version"][1] == "1.00" and all(float(v[0]) > 0 for v in rows.values())


def test_profile_gpu_live_tiny_runs_and_checks_bit_for_bit():
    """scripts/profile_gpu_live.py (issue 45's GPU profile), toy sizes under the simulator: it applies,
    checks the result bit for bit and prints cProfile's two tables (torch.profiler's only on a GPU)."""
    import os

    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    proc = subprocess.run([sys.executable, str(SCRIPTS / "profile_gpu_live.py"), "--tiny", "--repeats", "1"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "bit for bit: yes" in proc.stdout
    assert "### cProfile by tottime" in proc.stdout and "### cProfile by cumtime" in proc.stdout


def test_every_script_is_a_listed_benchmark_or_a_helper_and_bench_list_prints_them():
    """Issue 47: one list of the benchmarks (`bench.py --list`); a new script must say which it is."""
    sys.path.insert(0, str(SCRIPTS))
    import benchlib

    listed = [b.script for b in benchlib.BENCHMARKS]
    on_disk = {p.name for p in SCRIPTS.iterdir() if p.suffix in (".py", ".sh")}
    assert len(set(listed)) == len(listed) and set(listed).isdisjoint(benchlib.HELPERS)
    assert set(listed) | set(benchlib.HELPERS) == on_disk
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench.py"), "--list"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert all(f"{name}  " in proc.stdout for name in listed)


def test_alternate_runs_every_case_once_per_round_in_turn():
    """benchlib.alternate: case order within each round, round 0 untimed, a fresh setup value per call,
    and a case that returns a number times itself."""
    sys.path.insert(0, str(SCRIPTS))
    import benchlib

    calls, made = [], []

    def setup():
        made.append(len(made))
        return made[-1]

    cases = {"a": lambda v: calls.append(("a", v)), "b": lambda v: (calls.append(("b", v)), 7.5)[1]}
    times = benchlib.alternate(cases, 3, setup=setup)
    assert [c for c, _ in calls] == ["a", "b"] * 4 and [v for _, v in calls] == list(range(8))
    assert len(times["a"]) == len(times["b"]) == 3 and times["b"] == [7.5] * 3 and all(0 <= t < 1 for t in times["a"])
    assert benchlib.ratio_rows(times, "b")[1] == ("b", 7.5, 1.0, 7.5)
    assert len(benchlib.alternate({"a": lambda: None}, 2, warmup=False)["a"]) == 2


def test_soak_rl_summary_reports_medians_worst_steps_and_fails_on_memory_growth_or_a_failed_check():
    """scripts/soak_rl.py's table from the loop's records (the loop itself needs vLLM: tests/test_rl_loop.py)."""
    sys.path.insert(0, str(SCRIPTS))
    from soak_rl import summary

    def record(step, rss, checked=None):
        r = {"step": step, "changes": 100, "elements": 10_000, "patch_bytes": 90 + step % 3, "trl_bytes": 600,
             "pause_s": 0.02, "prepare_s": 0.01, "trl_decode_s": 0.001, "rollout_s": 0.1, "train_s": 0.03,
             "worker_rss_kib": rss}
        return r if checked is None else {**r, "checked": checked}

    steady = [record(s, 1000 * 1024 + s % 7, checked=True if s % 25 == 0 else None) for s in range(1, 101)]
    table, failed = summary(steady)
    assert failed == []
    assert "| pulsediff patch, bits per changed element | 7.28 | 7.36 | 100 |" in table  # 91 B median, 92 worst
    assert "| TRL's format re-created, bits per changed element | 48.0 | 48.0 | 100 |" in table
    assert "checks against a fresh engine and the trainer's digest: 4 of 4 equal" in table
    grown = steady[:60] + [record(s, 1080 * 1024) for s in range(61, 101)]
    assert summary(grown)[1] == ["the worker's memory grew 8.0% after step 50"]
    assert summary(steady[:-1] + [record(100, 1000 * 1024, checked=False)])[1] == [
        "a check against a fresh engine or the trainer's digest differed"]
