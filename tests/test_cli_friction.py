"""What a new user hits in their second hour with the command line (issue 24), one test per point."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cli_run import one_line_error, run
from ckpt_factory import mutate, random_tensor, save, save_series


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pair")
    rng = np.random.default_rng(24)
    base = {"w": random_tensor(rng, "BF16", (256, 64)), "b": random_tensor(rng, "F32", (64,))}
    target = {"w": mutate(rng, base["w"], 0.01), "b": base["b"]}
    return save(base, tmp / "old.safetensors"), save(target, tmp / "new.safetensors")


@pytest.fixture
def train(tmp_path) -> Path:
    folder = tmp_path / "train"
    folder.mkdir()
    save_series(folder, 2, seed=3, shape=(64, 32), tensors=2, density=0.02)
    return folder


# -- publish and a trainer's other folders ------------------------------------------------------------


def test_publish_passes_over_folders_that_hold_no_checkpoint(train, tmp_path):
    """logs2/ and events_v1/ end in a number, as step folders do, but hold no .safetensors: not checkpoints."""
    (train / "logs2").mkdir()
    (train / "logs2" / "run.log").write_text("loss 1.0\n")
    (train / "events_v1").mkdir()
    proc = run("publish", train, tmp_path / "out", "--settle", "0", "--anchor-every", "2")
    assert f"published steps 0 to 2 into {tmp_path / 'out'}: 3 patches and 2 anchors" in proc.stderr  # a skip 0 -> 2
    assert (tmp_path / "out" / "manifest.json").is_file()


def test_two_checkpoints_for_one_step_is_an_input_error_with_a_hint(train, tmp_path):
    """A folder that does hold a checkpoint and names the same step as a file: exit 1 (the input), not 2 (usage)."""
    step2 = train / "step2"
    step2.mkdir()
    (step2 / "model.safetensors").write_bytes((train / "step_000002.safetensors").read_bytes())
    line = one_line_error(run("publish", train, tmp_path / "out", "--settle", "0", check=False), 1)
    assert f"two checkpoints for step 2 in {train}: step2 and step_000002.safetensors" in line
    assert "--step-pattern" in line


# -- safe outputs, CLI and Python API alike -----------------------------------------------------------


def test_python_api_refuses_an_existing_output_unless_forced(pair, tmp_path):
    from pulsediff import apply_patch, make_patch
    from pulsediff.errors import OutputExistsError
    from pulsediff.ops.squash import squash_patches

    old, new = pair
    patch, out, squashed = tmp_path / "p", tmp_path / "out.safetensors", tmp_path / "s"
    for path in (patch, out, squashed):
        path.write_bytes(b"mine")
    with pytest.raises(OutputExistsError, match="force=True"):
        make_patch(old, new, patch, device="cpu")
    assert patch.read_bytes() == b"mine"
    make_patch(old, new, patch, device="cpu", force=True)
    with pytest.raises(OutputExistsError, match="force=True"):
        apply_patch(old, patch, out, device="cpu")
    assert out.read_bytes() == b"mine"
    assert apply_patch(old, patch, out, device="cpu", force=True).status == "applied"
    assert out.read_bytes() == new.read_bytes()
    with pytest.raises(OutputExistsError, match="force=True"):
        squash_patches(old, [patch], squashed, device="cpu")
    assert squashed.read_bytes() == b"mine"
    squash_patches(old, [patch], squashed, device="cpu", force=True)
    assert apply_patch(old, squashed, tmp_path / "again.safetensors", device="cpu").status == "applied"


@pytest.fixture
def published(train, tmp_path) -> Path:
    run("publish", train, tmp_path / "pub", "--settle", "0", "-q")
    return tmp_path / "pub"


def test_catch_up_output_that_exists_needs_force(train, published, tmp_path):
    worker, out = tmp_path / "worker.safetensors", tmp_path / "new.safetensors"
    worker.write_bytes((train / "step_000001.safetensors").read_bytes())
    out.write_bytes(b"mine")
    line = one_line_error(run("catch-up", worker, published, "-o", out, check=False), 1)
    assert f"{out} already exists; give -f/--force" in line
    assert out.read_bytes() == b"mine"
    proc = run("catch-up", worker, published, "-o", out, "-f")
    assert f"{out} is now at step 2" in proc.stderr
    assert out.read_bytes() == (train / "step_000002.safetensors").read_bytes()
    assert worker.read_bytes() == (train / "step_000001.safetensors").read_bytes()
    # the Python API says the same
    from pulsediff.errors import OutputExistsError
    from pulsediff.series.catch_up import catch_up

    with pytest.raises(OutputExistsError, match="force=True"):
        catch_up(worker, published, out)


def test_catch_up_says_what_it_wrote_when_the_worker_is_already_there(train, published, tmp_path):
    """A worker at the newest step with -o OUT: OUT is written (a checked copy), and the message says so."""
    worker, out = tmp_path / "worker.safetensors", tmp_path / "copy.safetensors"
    worker.write_bytes((train / "step_000002.safetensors").read_bytes())
    proc = run("catch-up", worker, published, "-o", out)
    assert proc.stderr == f"{worker} is already at step 2, and so now is {out}\n"
    assert out.read_bytes() == worker.read_bytes()
    out.write_bytes(b"stale")  # forced over a different file: rewritten, not called up to date
    proc = run("catch-up", worker, published, "-o", out, "-f")
    assert out.read_bytes() == worker.read_bytes()
    assert run("catch-up", worker, published).stderr == f"{worker} is already at step 2\n"


def test_catch_up_names_the_manifest_it_looked_for(tmp_path):
    line = one_line_error(run("catch-up", tmp_path / "w.safetensors", tmp_path / "nosuchdir", check=False), 1)
    assert line == f"pulsediff: error: manifest not found: {tmp_path / 'nosuchdir' / 'manifest.json'}"


# -- optional packages -------------------------------------------------------------------------------


def test_plot_without_matplotlib_says_how_to_install_it(train, tmp_path):
    """A right command on a machine that lacks an extra: exit 1 (not 2, a usage error) and the install line."""
    code = "import sys; sys.modules['matplotlib'] = None; from pulsediff.cli.main import main; main()"
    proc = subprocess.run([sys.executable, "-c", code, "stats", str(train), "--plot", str(tmp_path / "s.png")],
                          capture_output=True, text=True, timeout=300)
    line = one_line_error(proc, 1)
    assert "--plot needs matplotlib, which is not installed: pip install 'pulsediff[plot]'" in line
    assert not (tmp_path / "s.png").exists()


# -- apply: in place again, dry runs ---------------------------------------------------------------


def test_applying_again_in_place_says_up_to_date_without_a_warning(pair, tmp_path):
    old, new = pair
    base = tmp_path / "base.safetensors"
    base.write_bytes(old.read_bytes())
    run("make", old, new, "-o", tmp_path / "p", "-q")
    run("apply", base, tmp_path / "p", "--in-place", "-q")
    proc = run("apply", base, tmp_path / "p", "--in-place")
    assert proc.stderr.startswith(f"{base} is already up to date: it is the patch's target (xxh3tree:")
    assert "warning" not in proc.stderr and "swapped" not in proc.stderr
    assert base.read_bytes() == new.read_bytes()


def test_dry_run_needs_no_output_and_does_not_say_applied(pair, tmp_path):
    import json

    old, new = pair
    run("make", old, new, "-o", tmp_path / "p", "-q")
    before = sorted(tmp_path.iterdir())
    proc = run("apply", old, tmp_path / "p", "-n")
    assert proc.stderr.startswith("would rebuild the target (xxh3tree:") and "all checks passed" in proc.stderr
    report = json.loads(run("apply", old, tmp_path / "p", "-n", "--json").stdout)
    assert report["dry_run"] is True and report["status"] == "would-apply" and report["output"] is None
    report = json.loads(run("apply", old, tmp_path / "p", "-o", tmp_path / "out", "-n", "--json").stdout)
    assert report["status"] == "would-apply" and report["output"] == str(tmp_path / "out")
    assert sorted(tmp_path.iterdir()) == before
    # without -n, an output is still needed
    line = one_line_error(run("apply", old, tmp_path / "p", check=False), 2)
    assert "give -o OUT or --in-place" in line


# -- a patch where a checkpoint belongs --------------------------------------------------------------


def test_a_patch_given_as_a_checkpoint_is_recognised(pair, tmp_path):
    old, new = pair
    patch = tmp_path / "p.pulsediff"
    run("make", old, new, "-o", patch, "-q")
    for args in (("digest", patch), ("make", patch, new, "-o", tmp_path / "q"), ("make", old, patch, "-o", tmp_path / "q")):
        line = one_line_error(run(*args, check=False), 1)
        expected = f"{patch}: it is a pulsediff patch, not a checkpoint; apply it to its base (pulsediff apply BASE"
        assert expected in line, args
        assert "header length" not in line
    # and the other way round: apply's arguments swapped
    line = one_line_error(run("apply", patch, old, "-o", tmp_path / "out", check=False), 2)  # usage, as catch-up's
    assert f"{old} is a checkpoint, not a patch; the base comes first: pulsediff apply BASE PATCH -o OUT" in line
    assert not (tmp_path / "out").exists()


# -- stats on folders --------------------------------------------------------------------------------


def test_stats_on_a_single_file_model_folder_says_it_is_a_checkpoint(pair, tmp_path):
    """config.json + model.safetensors, no index: one checkpoint (make takes it), as a sharded folder is."""
    old, _ = pair
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(old.read_bytes())
    (folder / "config.json").write_text("{}")
    line = one_line_error(run("stats", folder, check=False), 2)
    assert f"{folder} is a checkpoint (a model folder), not a patch or a series folder; give OLD NEW" in line


def test_stats_on_a_folder_with_one_step_is_an_input_error(train, tmp_path):
    for p in train.iterdir():
        if p.name != "step_000001.safetensors":
            p.unlink()
    line = one_line_error(run("stats", train, check=False), 1)
    assert f"{train} holds 1 checkpoint with a step number in its name" in line


# -- smaller things -----------------------------------------------------------------------------------


def test_counts_are_said_in_the_singular_for_one(train, tmp_path):
    for p in train.iterdir():
        if p.name != "step_000000.safetensors":
            p.unlink()
    proc = run("publish", train, tmp_path / "out", "--settle", "0")
    assert proc.stderr == f"published step 0 into {tmp_path / 'out'}: 0 patches and 1 anchor\n"


def test_catch_up_says_what_it_applied_to_what(train, published, tmp_path):
    fresh = tmp_path / "fresh.safetensors"
    proc = run("catch-up", fresh, published)
    assert proc.stderr == (f"{fresh} is now at step 2: rebuilt from an anchor (anchor-00000000.pulsediff), then "
                           "1 patch (patch-00000000-00000002.pulsediff)\n")
    worker = tmp_path / "worker.safetensors"
    worker.write_bytes((train / "step_000001.safetensors").read_bytes())
    proc = run("catch-up", worker, published)
    assert proc.stderr == (f"{worker} is now at step 2: applied 1 patch to {worker} "
                           "(patch-00000001-00000002.pulsediff)\n")


def test_help_names_arguments_and_metavars_as_shown():
    stats_help = run("stats", "--help", env={"COLUMNS": "200"}).stdout
    assert "FIRST" not in stats_help and "when the first argument is OLD" in stats_help
    publish_help = run("publish", "--help", env={"COLUMNS": "200"}).stdout
    assert "--keep N" in " ".join(publish_help.split()) and "newest N anchors" in publish_help


def test_apply_result_repr_is_short(pair, tmp_path):
    from pulsediff import apply_patch, make_patch

    old, new = pair
    make_patch(old, new, tmp_path / "p", device="cpu")
    result = apply_patch(old, tmp_path / "p", tmp_path / "out.safetensors", device="cpu")
    assert repr(result).startswith("ApplyResult(status='applied', output=PosixPath(")
    assert "header" not in repr(result) and len(repr(result)) < 300


def test_progress_rate_waits_for_a_meaningful_average():
    from types import SimpleNamespace

    from pulsediff.cli.output import SPEED_AFTER_S, _average_speed_column

    column = _average_speed_column()
    assert str(column.render(SimpleNamespace(elapsed=0.001, completed=600 * 10**6))) == "?"  # was "600.0 GB/s"
    assert str(column.render(SimpleNamespace(elapsed=2 * SPEED_AFTER_S, completed=10**9))) == \
        f"{10**9 / (2 * SPEED_AFTER_S) / 10**9:.1f} GB/s"


def test_readme_runs_leave_nothing_git_would_list():
    """What README.md's blocks write in the repository's folder is in .gitignore."""
    root = Path(__file__).parent.parent
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    readme = (root / "README.md").read_text()
    made = ["train/", "outbox/", "inbox/", "s3root/", "s3.log", "cdn.log", "series.png", "model.safetensors",
            "worker1.safetensors", "worker2.safetensors"]
    for name in made:
        assert name.rstrip("/") in readme, name  # still made by a README block
        probe = name + "x" if name.endswith("/") else name  # a file inside the folder
        proc = subprocess.run(["git", "check-ignore", "-q", "--no-index", probe], cwd=root)
        assert proc.returncode == 0, f"{name} is not ignored"


def test_remote_series_without_obstore_says_how_to_install_it(tmp_path):
    code = ("import importlib.util as u; real = u.find_spec; "
            "u.find_spec = lambda name, *a: None if name == 'obstore' else real(name, *a); "
            "from pulsediff.cli.main import main; main()")
    proc = subprocess.run([sys.executable, "-c", code, "catch-up", str(tmp_path / "w.safetensors"),
                           "http://127.0.0.1:9/run"], capture_output=True, text=True, timeout=300)
    line = one_line_error(proc, 1)
    assert ("http://127.0.0.1:9/run (a remote series) needs obstore, which is not installed: "
            "pip install 'pulsediff[remote]'") in line
