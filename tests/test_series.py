"""Series folders that lie: hostile manifests, mislabelled files, huge manifests, stale temporaries.

Every case ends in a PulsediffError with the worker's checkpoint untouched, or
in a checkpoint that is byte-identical to the trainer's step that catch-up
reports. Checkpoints are small and made here (tests/ckpt_factory.py).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ckpt_factory import mutate, random_tensor, save, save_series
from pulsediff.io.atomic import TMP_SUFFIX, remove_stale_temporaries, temp_prefix
from pulsediff.errors import InvalidManifestError, PulsediffError
from pulsediff.ops.inspect import checkpoint_digest_of
from pulsediff.format.digest import FLAT, TREE
from pulsediff.format.manifest import MANIFEST, Manifest, parse_manifest
from pulsediff.series.steps import DEFAULT_STEP_PATTERN, step_in_name
from pulsediff.series.catch_up import catch_up, plan_catch_up
from pulsediff.series.publish import publish_once

STEPS = 7


@pytest.fixture(scope="module")
def series(tmp_path_factory):
    """A trainer folder of STEPS + 1 small checkpoints and its published folder (anchors at 0, 3, 6)."""
    root = tmp_path_factory.mktemp("series")
    train, pub = root / "train", root / "pub"
    train.mkdir()
    save_series(train, STEPS, seed=0, shape=(64, 32), tensors=3, density=0.02)
    publish_once(train, pub, anchor_every=3, settle=0)
    return train, pub


def ckpt(train: Path, step: int) -> Path:
    return train / f"step_{step:06d}.safetensors"


def copy_folder(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def write_manifest(folder: Path, obj) -> None:
    (folder / MANIFEST).write_text(json.dumps(obj) if not isinstance(obj, str) else obj)


# -- the manifest reader ---------------------------------------------------------


def good_manifest(pub: Path) -> dict:
    return json.loads((pub / MANIFEST).read_text())


def edited(pub: Path, edit) -> bytes:
    obj = good_manifest(pub)
    edit(obj)
    return json.dumps(obj).encode()


def set_field(i, key, value):
    def edit(obj):
        obj["entries"][i][key] = value
    return edit


HOSTILE = {
    "deep nesting": lambda pub: b"[" * 100_000 + b"]" * 100_000,
    "nested entry": lambda pub: edited(pub, set_field(1, "bytes", [[[[[[1]]]]]])),
    "not an object": lambda pub: b"[]",
    "version string": lambda pub: edited(pub, lambda o: o.update(version="1")),
    "version bool": lambda pub: edited(pub, lambda o: o.update(version=True)),
    "no entries": lambda pub: edited(pub, lambda o: o.pop("entries")),
    "entries object": lambda pub: edited(pub, lambda o: o.update(entries={})),
    "entry list": lambda pub: edited(pub, lambda o: o["entries"].__setitem__(0, [])),
    "unknown kind": lambda pub: edited(pub, set_field(1, "kind", "delta")),
    "step as string": lambda pub: edited(pub, set_field(1, "step", "3")),
    "step as bool": lambda pub: edited(pub, set_field(1, "step", True)),
    "step as float": lambda pub: edited(pub, set_field(1, "step", 3.0)),
    "huge step": lambda pub: edited(pub, set_field(1, "step", 9223372036854775808)),
    "negative bytes": lambda pub: edited(pub, set_field(1, "bytes", -5)),
    "negative target bytes": lambda pub: edited(pub, set_field(1, "target_bytes", -1)),
    "bytes as null": lambda pub: edited(pub, set_field(1, "bytes", None)),
    "self link": lambda pub: edited(pub, lambda o: o["entries"][1].update(from_step=o["entries"][1]["step"])),
    "backward link": lambda pub: edited(pub, lambda o: o["entries"][1].update(from_step=o["entries"][1]["step"] + 1)),
    "anchor with from_step": lambda pub: edited(pub, set_field(0, "from_step", 0)),
    "anchor from a checkpoint": lambda pub: edited(pub, lambda o: o["entries"][0].update(base=o["entries"][0]["target"])),
    "path in file": lambda pub: edited(pub, set_field(1, "file", "../patch.pulsediff")),
    "subfolder file": lambda pub: edited(pub, set_field(1, "file", "a/patch.pulsediff")),
    "hidden file": lambda pub: edited(pub, set_field(1, "file", ".patch.pulsediff")),
    "not a patch name": lambda pub: edited(pub, set_field(1, "file", "model.safetensors")),
    "file as number": lambda pub: edited(pub, set_field(1, "file", 7)),
    "lone surrogate in file": lambda pub: edited(pub, set_field(1, "file", "p\ud800.pulsediff")),  # crashed --keep
    "file name too long": lambda pub: edited(pub, set_field(1, "file", "p" * 300 + ".pulsediff")),
    "file listed twice": lambda pub: edited(pub, lambda o: o["entries"][2].update(file=o["entries"][1]["file"])),
    "bad digest": lambda pub: edited(pub, set_field(1, "target", "xxh3tree:nothex")),
    "two digests for a step": lambda pub: edited(pub, lambda o: o["entries"].append(
        {**o["entries"][0], "file": "anchor-x.pulsediff", "target": "xxh3tree:" + "0" * 32})),
    "base not the from_step's": lambda pub: edited(pub, lambda o: o["entries"][1].update(base="xxh3tree:" + "1" * 32)),
    # A chain never crosses schemes (format 1.4): the same weights have another digest under each.
    "digests of two schemes": lambda pub: edited(pub, lambda o: o["entries"][1].update(
        base=FLAT.prefix + o["entries"][1]["base"].split(":")[1], target=FLAT.prefix + o["entries"][1]["target"].split(":")[1])),
    "duplicate key": lambda pub: (pub / MANIFEST).read_bytes().replace(b'"version": 1', b'"version": 1, "version": 1', 1),
    "not utf-8": lambda pub: b'{"version": 1, "precision": "\xff"}',
    "unknown precision": lambda pub: edited(pub, lambda o: o.update(precision="fp8")),
    "empty checkpoint as a step": lambda pub: edited(pub, set_field(0, "target", TREE.empty)),
    "millions of objects": lambda pub: b'{"junk": [' + b"{}," * 300_000 + b'{}], "version": 1}',
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_manifest_is_refused_with_one_error(series, case, tmp_path):
    _, pub = series
    data = HOSTILE[case](pub)
    with pytest.raises(InvalidManifestError):
        parse_manifest(data, "m")
    folder = tmp_path / "pub"
    folder.mkdir()
    (folder / MANIFEST).write_bytes(data)
    worker = tmp_path / "w.safetensors"
    with pytest.raises(InvalidManifestError):
        catch_up(worker, folder)
    assert not worker.exists() and os.listdir(tmp_path) == ["pub"]


def test_published_manifest_is_valid_and_round_trips(series):
    _, pub = series
    manifest = Manifest.load(pub)
    assert manifest.to_json() == good_manifest(pub)
    assert [e.step for e in manifest.entries if e.kind == "anchor"] == [0, 3, 6]


def test_manifest_that_is_a_fifo_does_not_hang(tmp_path):
    os.mkfifo(tmp_path / MANIFEST)
    with pytest.raises(InvalidManifestError, match="not a regular file"):
        Manifest.load(tmp_path)


def test_manifest_that_is_a_directory_is_one_line_naming_it(tmp_path):
    """os.fdopen refused the directory with "Is a directory: 3" (the descriptor, not the path) and
    left the descriptor open, one per call (issue 23)."""
    (tmp_path / MANIFEST).mkdir()
    before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    for _ in range(20):
        with pytest.raises(InvalidManifestError) as caught:
            Manifest.load(tmp_path)
        assert str(tmp_path / MANIFEST) in str(caught.value) and "directory" in str(caught.value)
    if before is not None:
        assert len(os.listdir("/proc/self/fd")) == before
    worker = tmp_path / "worker"
    for args in (["catch-up", worker, tmp_path], ["catch-up", worker, tmp_path, "--plan"]):
        proc = subprocess.run([sys.executable, "-m", "pulsediff", *map(str, args)], capture_output=True, timeout=300)
        lines = proc.stderr.decode().splitlines()
        assert proc.returncode == 1 and len(lines) == 1, proc.stderr.decode()
        assert str(tmp_path / MANIFEST) in lines[0] and "directory" in lines[0]


# -- mislabelled files: digests decide, not labels ----------------------------------


def test_file_swapped_under_an_entry_stops_catch_up(series, tmp_path):
    """The manifest says the newest patch is patch-5-7; the file there is patch-5-6's (exit != 0, nothing written)."""
    train, pub = series
    folder = copy_folder(pub, tmp_path / "pub")
    swapped = folder / "patch-00000006-00000007.pulsediff"
    swapped.write_bytes((folder / "patch-00000005-00000006.pulsediff").read_bytes())
    obj = good_manifest(folder)  # a careful liar: the size agrees with the file
    next(e for e in obj["entries"] if e["file"] == swapped.name)["bytes"] = swapped.stat().st_size
    write_manifest(folder, obj)
    worker = tmp_path / "w.safetensors"
    worker.write_bytes(ckpt(train, 6).read_bytes())
    with pytest.raises(InvalidManifestError, match="does not match the file's own header"):
        catch_up(worker, folder)
    assert worker.read_bytes() == ckpt(train, 6).read_bytes()


def test_entry_moved_to_another_step_is_caught(series, tmp_path):
    """Relabel the step-6 files as step 7 and drop the real step 7: the labels agree with each other, the files do not."""
    train, pub = series
    folder = copy_folder(pub, tmp_path / "pub")
    obj = good_manifest(folder)
    obj["entries"] = [e for e in obj["entries"] if e["step"] != 7]
    for e in obj["entries"]:
        if e["step"] == 6:
            e["step"] = 7
            e["target"] = "xxh3tree:" + "2" * 32
    write_manifest(folder, obj)
    worker = tmp_path / "w.safetensors"
    worker.write_bytes(ckpt(train, 5).read_bytes())
    with pytest.raises(InvalidManifestError):
        catch_up(worker, folder)
    assert worker.read_bytes() == ckpt(train, 5).read_bytes()


def test_mutated_manifests_never_report_a_step_they_did_not_rebuild(series, tmp_path):
    """Random edits of labels, digests, sizes and names: an error and nothing written, or the step reported
    is one whose recorded digest is the rebuilt checkpoint's and the bytes are that trainer step's."""
    train, pub = series
    truth = {s: ckpt(train, s).read_bytes() for s in range(STEPS + 1)}
    digests = [checkpoint_digest_of(ckpt(train, s)) for s in range(STEPS + 1)]
    rng = random.Random(1)
    outcomes = {"error": 0, "applied": 0}
    for trial in range(60):
        folder = tmp_path / f"pub{trial}"
        folder.mkdir()
        for p in pub.iterdir():
            os.link(p, folder / p.name)
        obj = good_manifest(pub)
        for _ in range(rng.randint(1, 3)):
            e = rng.choice(obj["entries"])
            key = rng.choice(["step", "from_step", "base", "target", "file", "bytes", "target_bytes"])
            other = rng.choice(obj["entries"])
            e[key] = rng.choice([other[key], rng.randint(0, STEPS + 2), rng.choice(digests), TREE.empty])
        (folder / MANIFEST).unlink()
        write_manifest(folder, obj)
        start = rng.randint(0, STEPS - 1)
        worker = tmp_path / f"w{trial}.safetensors"
        worker.write_bytes(truth[start])
        try:
            result = catch_up(worker, folder)
        except PulsediffError:
            assert worker.read_bytes() == truth[start]
            outcomes["error"] += 1
            continue
        rebuilt = checkpoint_digest_of(worker)
        manifest = Manifest.load(folder)
        assert any(e.step == result.step and e.target == rebuilt for e in manifest.entries)
        assert worker.read_bytes() in truth.values()
        outcomes["applied"] += 1
    assert outcomes["error"] and outcomes["applied"]  # both kinds of outcome were exercised


def test_up_to_date_copy_goes_through_a_checked_file(series, tmp_path):
    """A worker at the newest step asks for a copy with -o; the newest file is relabelled: nothing is written."""
    train, pub = series
    folder = copy_folder(pub, tmp_path / "pub")
    newest = Manifest.load(folder).newest
    (folder / newest.file).write_bytes((folder / "patch-00000005-00000006.pulsediff").read_bytes())
    obj = good_manifest(folder)
    next(e for e in obj["entries"] if e["file"] == newest.file)["bytes"] = (folder / newest.file).stat().st_size
    write_manifest(folder, obj)
    worker = tmp_path / "w.safetensors"
    worker.write_bytes(ckpt(train, STEPS).read_bytes())
    with pytest.raises(InvalidManifestError):
        catch_up(worker, folder, tmp_path / "copy.safetensors")
    assert not (tmp_path / "copy.safetensors").exists()


def test_many_wrong_sized_files_cost_no_searches(series, tmp_path):
    """Thousands of anchors for one step, each present with a size the manifest does not say: one stat each."""
    train, pub = series
    folder = copy_folder(pub, tmp_path / "pub")
    obj = good_manifest(folder)
    anchor = next(e for e in obj["entries"] if e["kind"] == "anchor" and e["step"] == 6)
    for i in range(4000):
        name = f"anchor-fake-{i}.pulsediff"
        (folder / name).write_bytes(b"x")
        obj["entries"].append({**anchor, "file": name, "bytes": 2 + i})
    write_manifest(folder, obj)
    worker = tmp_path / "w.safetensors"
    t0 = time.perf_counter()
    result = catch_up(worker, folder)
    assert time.perf_counter() - t0 < 10  # was a full search per bad file: minutes
    assert result.step == STEPS and worker.read_bytes() == ckpt(train, STEPS).read_bytes()


def test_half_fetched_file_is_skipped_not_trusted(series, tmp_path):
    train, pub = series
    folder = copy_folder(pub, tmp_path / "pub")
    victim = folder / "patch-00000005-00000006.pulsediff"
    victim.write_bytes(victim.read_bytes()[:-10])
    worker = tmp_path / "w.safetensors"
    worker.write_bytes(ckpt(train, 5).read_bytes())
    result = catch_up(worker, folder)  # another chain: the anchor at 6, then 6 -> 7
    assert result.files == ["anchor-00000006.pulsediff", "patch-00000006-00000007.pulsediff"]
    assert result.step == STEPS and worker.read_bytes() == ckpt(train, STEPS).read_bytes()
    assert "manifest says" in result.problems[victim.name]


# -- bounded search -----------------------------------------------------------------


def fake_chain_manifest(folder: Path, n: int, *, missing_every: int = 1) -> list[str]:
    """n one-step patches after an anchor, with made-up digests; files exist for none of them."""
    digest = [f"xxh128:{i:032x}" for i in range(n + 1)]
    entries = [{"kind": "anchor", "file": "anchor-00000000.pulsediff", "step": 0, "from_step": None,
                "base": FLAT.empty, "target": digest[0], "bytes": 1000, "target_bytes": 1000}]
    for i in range(1, n + 1):
        entries.append({"kind": "patch", "file": f"patch-{i - 1:08d}-{i:08d}.pulsediff", "step": i, "from_step": i - 1,
                        "base": digest[i - 1], "target": digest[i], "bytes": 10, "target_bytes": 1000})
    write_manifest(folder, {"version": 1, "precision": "exact", "entries": entries})
    return [e["file"] for e in entries]


def test_20000_entry_manifest_plans_in_under_2_s(tmp_path):
    files = fake_chain_manifest(tmp_path, 20_000)
    t0 = time.perf_counter()
    plan = plan_catch_up(tmp_path / "worker.safetensors", tmp_path)
    elapsed = time.perf_counter() - t0
    assert plan.files == files and plan.from_anchor
    assert elapsed < 2.0, f"planning took {elapsed:.2f} s"


def test_20000_entry_manifest_plans_in_bounded_memory(tmp_path):
    import tracemalloc

    fake_chain_manifest(tmp_path, 20_000)
    tracemalloc.start()
    try:
        plan_catch_up(tmp_path / "worker.safetensors", tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"planning peaked at {peak >> 20} MiB"  # paths as copied lists took gigabytes


def test_20000_entries_with_missing_files_fail_fast(tmp_path):
    fake_chain_manifest(tmp_path, 20_000)
    t0 = time.perf_counter()
    with pytest.raises(PulsediffError, match="no intact chain"):
        catch_up(tmp_path / "worker.safetensors", tmp_path)
    assert time.perf_counter() - t0 < 2.0
    assert not (tmp_path / "worker.safetensors").exists()


def test_negative_cost_cycle_is_refused_not_looped(tmp_path):
    a, b = "xxh128:" + "a" * 32, "xxh128:" + "b" * 32
    entries = [{"kind": "anchor", "file": "anchor-1.pulsediff", "step": 1, "from_step": None, "base": FLAT.empty,
                "target": a, "bytes": 10, "target_bytes": 10},
               {"kind": "patch", "file": "p-1-2.pulsediff", "step": 2, "from_step": 1, "base": a, "target": b,
                "bytes": -100, "target_bytes": 10},
               {"kind": "patch", "file": "p-2-1.pulsediff", "step": 1, "from_step": 2, "base": b, "target": a,
                "bytes": -100, "target_bytes": 10}]
    write_manifest(tmp_path, {"version": 1, "precision": "exact", "entries": entries})
    with pytest.raises(InvalidManifestError):
        plan_catch_up(tmp_path / "w.safetensors", tmp_path)


# -- step numbers in names ------------------------------------------------------------


@pytest.mark.parametrize("name, step", [
    ("step_000005.safetensors", 5), ("fp32_step0", 0), ("step5_bf16", 5), ("global_step120", 120),
    ("checkpoint-500", 500), ("model_v2_step-30.safetensors", 30), ("run3_ckpt_17", 17), ("final", None),
])
def test_default_step_pattern(name, step):
    assert step_in_name(name, re.compile(DEFAULT_STEP_PATTERN)) == step


# -- stale temporary files -----------------------------------------------------------


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_temporaries_of_dead_writers_are_removed_live_ones_kept(tmp_path):
    final = tmp_path / "model.safetensors"
    ours = tmp_path / f"{temp_prefix(final)}abcd1234{TMP_SUFFIX}"
    dead = tmp_path / f"{temp_prefix(final).replace(f'-{os.getpid()}.', f'-{dead_pid()}.')}abcd1234{TMP_SUFFIX}"
    alive_proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        alive = tmp_path / f"{temp_prefix(final).replace(f'-{os.getpid()}.', f'-{alive_proc.pid}.')}x{TMP_SUFFIX}"
        huge_pid = tmp_path / f"{temp_prefix(final).replace(f'-{os.getpid()}.', '-' + '9' * 30 + '.')}y{TMP_SUFFIX}"
        huge_pid.write_bytes(b"x")  # no crash (OverflowError in os.kill before), and kept: not provably dead
        legacy_old = tmp_path / f".model.safetensors.k3j4h5{TMP_SUFFIX}"
        legacy_new = tmp_path / f".other.safetensors.zz9{TMP_SUFFIX}"
        unrelated = tmp_path / ".model.safetensors.keep"
        for p in (ours, dead, alive, legacy_old, legacy_new, unrelated):
            p.write_bytes(b"x")
        os.utime(legacy_old, (time.time() - 2 * 86400,) * 2)
        removed = remove_stale_temporaries(tmp_path, force=True)
        assert sorted(removed) == sorted([dead, legacy_old])
        assert all(p.exists() for p in (ours, alive, legacy_new, unrelated, huge_pid))
    finally:
        alive_proc.kill()
        alive_proc.wait()


def test_killed_apply_leaves_temporaries_the_next_apply_removes(series, tmp_path):
    """SIGKILL an apply while its output is half written; the next apply into that folder cleans up."""
    train, pub = series
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    # A bigger pair, so that the apply is still writing when we look.
    rng = np.random.default_rng(3)
    old = {f"w{i}": random_tensor(rng, "BF16", (1024, 1024)) for i in range(24)}
    new = {k: mutate(rng, v, 0.01) for k, v in old.items()}
    save(old, tmp_path / "old.safetensors")
    save(new, tmp_path / "new.safetensors")
    patch = tmp_path / "p.pulsediff"
    subprocess.run([sys.executable, "-m", "pulsediff", "make", str(tmp_path / "old.safetensors"),
                    str(tmp_path / "new.safetensors"), "-o", str(patch), "-q"], check=True)
    env = {**os.environ, "PULSEDIFF_BUFFERED_WRITES": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pulsediff", "apply", str(tmp_path / "old.safetensors"), str(patch),
                             "-o", str(out_dir / "new.safetensors"), "-q"], env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(p.name.endswith(TMP_SUFFIX) for p in out_dir.iterdir()):
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = [p.name for p in out_dir.iterdir()]
    if not left:
        pytest.skip("the apply finished or had not started its output when killed")
    assert all(n.endswith(TMP_SUFFIX) for n in left), left  # never a partial output under the real name
    subprocess.run([sys.executable, "-m", "pulsediff", "apply", str(tmp_path / "old.safetensors"), str(patch),
                    "-o", str(out_dir / "new.safetensors"), "-q"], check=True)
    assert [p.name for p in out_dir.iterdir()] == ["new.safetensors"]
    assert (out_dir / "new.safetensors").read_bytes() == (tmp_path / "new.safetensors").read_bytes()


def test_cli_json_for_publish_plan_and_catch_up(series, tmp_path):
    train, pub = series
    cli = [sys.executable, "-m", "pulsediff"]
    worker = tmp_path / "w.safetensors"
    worker.write_bytes(ckpt(train, 5).read_bytes())
    plan = json.loads(subprocess.run([*cli, "catch-up", str(worker), str(pub), "--plan", "--json"],
                                     capture_output=True, check=True).stdout)
    done = subprocess.run([*cli, "catch-up", str(worker), str(pub), "--json"], capture_output=True, check=True)
    result = json.loads(done.stdout)
    assert result["status"] == "applied" and result["step"] == STEPS and result["files"] == plan["files"]
    assert done.stderr == b"" and worker.read_bytes() == ckpt(train, STEPS).read_bytes()
    again = json.loads(subprocess.run([*cli, "publish", str(train), str(pub), "--json", "--settle", "0"],
                                      capture_output=True, check=True).stdout)
    assert again == {"out_dir": str(pub), "steps": [], "patches": 0, "anchors": 0, "pruned": 0, "pending": {},
                     "skipped": {}}


def test_publish_dry_run_writes_nothing_and_lists_what_a_real_run_writes(tmp_path):
    import json as _json
    import subprocess
    import sys

    from ckpt_factory import save_series

    train, out = tmp_path / "train", tmp_path / "out"
    train.mkdir()
    save_series(train, 5, seed=3, shape=(32, 16), tensors=2, density=0.02)
    cli = [sys.executable, "-m", "pulsediff.cli.main", "publish", str(train), str(out), "--settle", "0",
           "--anchor-every", "2"]
    dry = subprocess.run(cli + ["--dry-run", "--json"], capture_output=True, text=True, check=True)
    planned = _json.loads(dry.stdout)["would_write"]
    assert not out.exists()  # nothing made, not even the folder
    subprocess.run(cli + ["-q"], check=True)
    assert sorted(planned) == sorted(p.name for p in out.iterdir() if p.name != "manifest.json")
    before = sorted(p.name for p in out.iterdir())
    dry = subprocess.run(cli + ["-n", "--keep", "1", "--json"], capture_output=True, text=True, check=True)
    would_prune = _json.loads(dry.stdout)["would_prune"]
    assert sorted(p.name for p in out.iterdir()) == before and would_prune
    subprocess.run(cli + ["-q", "--keep", "1"], check=True)
    assert sorted(set(before) - {p.name for p in out.iterdir()}) == sorted(would_prune)
    watch = subprocess.run(cli + ["-n", "--watch"], capture_output=True, text=True)
    assert watch.returncode == 2 and "--watch" in watch.stderr
