"""The command line as users run it: real subprocesses, exit codes, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ckpt_factory import mutate, random_tensor, save, save_sharded

PULSEDIFF = [sys.executable, "-m", "pulsediff"]


def run(*args, stdin=None, env=None, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run([*PULSEDIFF, *map(str, args)], input=stdin, capture_output=True,
                          env={**os.environ, **(env or {})}, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {proc.stderr.decode()}")
    return proc


def assert_one_line_error(proc, code=1, contains=""):
    err = proc.stderr.decode()
    assert proc.returncode == code, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("pulsediff: error:"), err
    assert contains in lines[0]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    rng = np.random.default_rng(11)
    base = {"w": random_tensor(rng, "BF16", (256, 64)), "b": random_tensor(rng, "F32", (64,))}
    target = {"w": mutate(rng, base["w"], 0.01), "b": base["b"]}
    return save(base, tmp / "old.safetensors"), save(target, tmp / "new.safetensors")


def test_make_apply_cmp(pair, tmp_path):
    old, new = pair
    run("make", old, new, "-o", tmp_path / "p", "-q")
    run("apply", old, tmp_path / "p", "-o", tmp_path / "out.safetensors", "-q")
    assert subprocess.run(["cmp", tmp_path / "out.safetensors", new]).returncode == 0


def test_stdout_stdin_pipeline(pair, tmp_path):
    old, new = pair
    patch = run("make", old, new, "-o", "-", "-q").stdout
    assert patch[:8] == b"PULSEDIF"
    run("apply", old, "-", "-o", tmp_path / "out.safetensors", "-q", stdin=patch)
    assert (tmp_path / "out.safetensors").read_bytes() == new.read_bytes()
    # the shell form of the same thing
    sh = f"{sys.executable} -m pulsediff make {old} {new} -o - -q | {sys.executable} -m pulsediff apply {old} - -o {tmp_path / 'o2'} -q"
    assert subprocess.run(sh, shell=True).returncode == 0
    assert (tmp_path / "o2").read_bytes() == new.read_bytes()


def test_apply_twice_reports_up_to_date(pair, tmp_path):
    old, new = pair
    base = tmp_path / "base.safetensors"
    base.write_bytes(old.read_bytes())
    run("make", old, new, "-o", tmp_path / "p", "-q")
    run("apply", base, tmp_path / "p", "--in-place")
    proc = run("apply", base, tmp_path / "p", "--in-place")
    assert "up to date" in proc.stderr.decode()
    assert base.read_bytes() == new.read_bytes()


def test_stats_table_and_json(pair, tmp_path):
    old, new = pair
    run("make", old, new, "-o", tmp_path / "p", "-q")
    table = run("stats", tmp_path / "p").stdout.decode()
    for word in ("density", "indices", "values", "bits per changed element", "ratio"):
        assert word in table
    from_patch = json.loads(run("stats", tmp_path / "p", "--json").stdout)
    from_pair = json.loads(run("stats", old, new, "--json").stdout)
    assert from_patch == from_pair
    assert from_patch["changed"] == sum(t["changed"] for t in from_patch["per_tensor"])
    assert from_patch["patch_bytes"] == (tmp_path / "p").stat().st_size
    assert from_patch["header_bytes"] + from_patch["index_bytes"] + from_patch["value_bytes"] == from_patch["patch_bytes"]
    w = next(t for t in from_patch["per_tensor"] if t["name"] == "w")
    assert 0.005 < w["density"] < 0.02


def test_digest_ignores_layout(tmp_path):
    rng = np.random.default_rng(12)
    tensors = {f"t{i}": random_tensor(rng, "BF16", (10, 3)) for i in range(4)}
    one = save(tensors, tmp_path / "one.safetensors", metadata={"a": "b"})
    sharded = save_sharded(tensors, tmp_path / "sharded", 2)
    d1 = run("digest", one).stdout.decode().strip()
    assert d1.startswith("xxh128:") and len(d1) == 7 + 32
    assert run("digest", sharded).stdout.decode().strip() == d1


def test_help_does_not_import_torch_or_numba():
    code = (
        "import sys; sys.argv=['pulsediff','--help']\n"
        "from pulsediff.cli.main import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "heavy=[m for m in ('torch','numba','zstandard','numpy') if m in sys.modules]\n"
        "print('HEAVY', heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60).stdout.decode()
    assert "HEAVY []" in out, out


@pytest.mark.parametrize("args,contains", [
    (("make", "missing.safetensors", "also-missing", "-o", "p"), "not found"),
    (("apply", "missing.safetensors", "p", "-o", "out"), "not found"),
    (("stats", "missing.pulsediff"), "not found"),
])
def test_missing_files(tmp_path, args, contains):
    proc = subprocess.run([*PULSEDIFF, *args], capture_output=True, cwd=tmp_path, timeout=120)
    assert_one_line_error(proc, contains=contains)


def test_bad_inputs_give_one_line(pair, tmp_path):
    old, new = pair
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\xff" * 100)
    assert_one_line_error(run("make", junk, new, "-o", tmp_path / "p", check=False), contains="not a valid safetensors")
    assert_one_line_error(run("apply", old, junk, "-o", tmp_path / "o", check=False), contains="not a pulsediff patch")
    assert_one_line_error(run("make", old, new, "-o", tmp_path / "p", "--device", "tpu", check=False), contains="unknown device")
    assert_one_line_error(run("make", old, new, "-o", tmp_path / "p", "--codec", "nope", check=False), contains="unknown codec")
    assert_one_line_error(run("apply", old, tmp_path / "p", check=False), contains="--in-place")
    # a patch from another base, and a truncated patch
    rng = np.random.default_rng(13)
    other = save({"w": random_tensor(rng, "BF16", (256, 64)), "b": random_tensor(rng, "F32", (64,))}, tmp_path / "x.safetensors")
    run("make", new, old, "-o", tmp_path / "rev", "-q")
    assert_one_line_error(run("apply", other, tmp_path / "rev", "-o", tmp_path / "o", check=False), contains="does not match")
    data = (tmp_path / "rev").read_bytes()
    (tmp_path / "cut").write_bytes(data[: len(data) // 2])
    assert_one_line_error(run("apply", new, tmp_path / "cut", "-o", tmp_path / "o", check=False), contains="truncated")
    assert not (tmp_path / "o").exists()
    assert not (tmp_path / "p").exists()


def test_cuda_without_gpu_is_a_clear_error(pair, tmp_path):
    old, new = pair
    env = {"NUMBA_ENABLE_CUDASIM": "0"}
    proc = run("make", old, new, "-o", tmp_path / "p", "--device", "cuda", env=env, check=False)
    assert_one_line_error(proc, contains="no CUDA GPU is usable")


def test_full_disk_leaves_nothing(pair, tmp_path):
    """/dev/full fails every write with ENOSPC."""
    old, new = pair
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    run("make", old, new, "-o", tmp_path / "p", "-q")
    patch = (tmp_path / "p").read_bytes()
    sh = f"{sys.executable} -m pulsediff make {old} {new} -o - -q > /dev/full"
    proc = subprocess.run(sh, shell=True, capture_output=True, timeout=120)
    assert_one_line_error(proc, contains="No space left on device")
    assert patch  # the earlier, complete patch is untouched by the failed run



def test_cli_default_codec_is_the_library_default():
    from pulsediff.cli.options import DEFAULT_CODEC
    from pulsediff.codecs import DEFAULT_SPARSE_CODEC

    assert DEFAULT_CODEC == DEFAULT_SPARSE_CODEC


def test_stats_shows_ulp_histogram(pair, tmp_path):
    old, new = pair
    run("make", old, new, "-o", tmp_path / "p", "-q", "--codec", "ctx-rans")
    s = json.loads(run("stats", tmp_path / "p", "--json").stdout)
    hist = s["ulp_histogram"]
    assert sum(hist.values()) == s["changed"]
    run("make", old, new, "-o", tmp_path / "g", "-q", "--codec", "gap-zstd")
    assert json.loads(run("stats", tmp_path / "g", "--json").stdout)["ulp_histogram"] is None


def test_stdin_patch_onto_a_base_that_already_is_the_target(pair, tmp_path):
    old, new = pair
    patch = run("make", old, new, "-o", "-", "-q").stdout
    proc = run("apply", new, "-", "-o", tmp_path / "out.safetensors", stdin=patch)
    assert "already held the target" in proc.stderr.decode()
    assert (tmp_path / "out.safetensors").read_bytes() == new.read_bytes()
