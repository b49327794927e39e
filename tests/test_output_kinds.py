"""`make` and `apply` where a new user's arguments go astray (issue 33): an output of the wrong kind
(a file name for a model folder, a folder for a patch), arguments swapped, two unrelated checkpoints.

Every refusal is one line, decided from the headers before any work, and creates nothing; none advises
-f/--force where -f would fail."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from cli_run import PULSEDIFF, one_line_error, run
from ckpt_factory import mutate, random_tensor, save, save_sharded


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two steps of one model as 3-shard folders and as single files, their patches, and a third folder
    (same tensors, other values) that is not the patches' base."""
    tmp = tmp_path_factory.mktemp("models")
    rng = np.random.default_rng(33)
    base = {f"layers.{i}.weight": random_tensor(rng, "BF16", (96, 32)) for i in range(4)}
    target = {k: mutate(rng, v, 0.02) for k, v in base.items()}
    other = {k: mutate(rng, v, 0.5) for k, v in base.items()}
    m = {
        "old": save_sharded(base, tmp / "old", 3), "new": save_sharded(target, tmp / "new", 3),
        "other": save_sharded(other, tmp / "other", 3),
        "old_file": save(base, tmp / "old.safetensors"), "new_file": save(target, tmp / "new.safetensors"),
    }
    run("make", m["old"], m["new"], "-o", tmp / "folders.pulsediff", "-q")
    run("make", m["old_file"], m["new_file"], "-o", tmp / "files.pulsediff", "-q")
    return {**m, "folder_patch": tmp / "folders.pulsediff", "file_patch": tmp / "files.pulsediff"}


# -- apply: the output's kind follows the patch --------------------------------------------------------


def test_a_file_name_for_a_model_folder_is_refused_before_any_work(models, tmp_path):
    """`apply -o x.safetensors` of a patch that rebuilds a 3-shard folder made a folder named x.safetensors."""
    out = tmp_path / "x.safetensors"
    for extra in ((), ("-f",), ("-n",)):
        line = one_line_error(run("apply", models["old"], models["folder_patch"], "-o", out, *extra, check=False), 2)
        assert line.endswith(f"this patch rebuilds a model folder (3 shards); give a folder name, not {out}"), line
    # decided from the headers, before the base is hashed: a base that is not the patch's is not even looked at
    line = one_line_error(run("apply", models["other"], models["folder_patch"], "-o", out, check=False), 2)
    assert "give a folder name" in line and "base" not in line
    with open(models["folder_patch"], "rb") as stdin:  # a patch on stdin says the same
        proc = subprocess.run([*PULSEDIFF, "apply", str(models["old"]), "-", "-o", str(out)], stdin=stdin,
                              capture_output=True, text=True, timeout=300)
    assert "this patch rebuilds a model folder (3 shards)" in one_line_error(proc, 2)
    assert listing(tmp_path) == []
    run("apply", models["old"], models["folder_patch"], "-o", tmp_path / "x", "-q")  # a folder name: fine
    assert listing(tmp_path / "x") == listing(models["new"])


def test_a_folder_for_a_single_file_is_refused_without_advising_force(models, tmp_path):
    folder = tmp_path / "existing"
    folder.mkdir()
    for extra in ((), ("-f",)):
        line = one_line_error(run("apply", models["old_file"], models["file_patch"], "-o", folder, *extra,
                                  check=False), 2)
        assert line.endswith(f"{folder} is a folder, but this patch rebuilds a single .safetensors file; give a "
                             f"file name, such as {folder}/model.safetensors"), line
        assert "force" not in line
    line = one_line_error(run("apply", models["old_file"], models["file_patch"], "-o", f"{tmp_path}/new/",
                              check=False), 2)
    assert line.endswith(f"{tmp_path}/new/ names a folder, but this patch rebuilds a single .safetensors file; "
                         f"give a file name, such as {tmp_path}/new/model.safetensors"), line
    assert listing(tmp_path) == ["existing"]


def test_an_existing_file_for_a_model_folder_is_refused_without_advising_force(models, tmp_path):
    existing = tmp_path / "out"
    existing.write_bytes(b"mine")
    for extra in ((), ("-f",)):
        line = one_line_error(run("apply", models["old"], models["folder_patch"], "-o", existing, *extra,
                                  check=False), 2)
        assert line.endswith(f"{existing} is a file, but this patch rebuilds a model folder (3 shards); give a new "
                             "folder name"), line
    assert existing.read_bytes() == b"mine"
    # in place, the same mismatch says why and what to do instead
    base = tmp_path / "worker.safetensors"
    base.write_bytes(models["old_file"].read_bytes())
    line = one_line_error(run("apply", base, models["folder_patch"], "--in-place", check=False), 2)
    assert "is a file, but this patch rebuilds a model folder (3 shards), so it cannot be replaced in place" in line
    assert base.read_bytes() == models["old_file"].read_bytes()


def test_an_existing_output_of_the_right_kind_still_advises_force(models, tmp_path):
    """-f is advised where it works, and works."""
    folder = tmp_path / "out"
    folder.mkdir()
    line = one_line_error(run("apply", models["old"], models["folder_patch"], "-o", folder, check=False), 1)
    assert line == f"pulsediff: error: {folder} already exists; give -f/--force to overwrite it"
    run("apply", models["old"], models["folder_patch"], "-o", folder, "-f", "-q")
    assert listing(folder) == listing(models["new"])


def test_python_api_refuses_an_output_of_the_wrong_kind_whatever_force(models, tmp_path):
    from pulsediff import apply_patch, make_patch
    from pulsediff.errors import UsageError

    with pytest.raises(UsageError, match="give a folder name, not"):
        apply_patch(models["old"], models["folder_patch"], tmp_path / "x.safetensors", force=True, device="cpu")
    with pytest.raises(UsageError, match="names a folder, but this patch rebuilds a single"):
        apply_patch(models["old_file"], models["file_patch"], f"{tmp_path}/y/", force=True, device="cpu")
    with pytest.raises(UsageError, match="is a folder, but a patch is a single file"):
        make_patch(models["old"], models["new"], tmp_path, force=True, device="cpu")
    assert listing(tmp_path) == []


# -- apply: arguments swapped --------------------------------------------------------------------------


def test_a_patch_then_a_model_folder_says_the_base_comes_first(models, tmp_path):
    line = one_line_error(run("apply", models["folder_patch"], models["old"], "-o", tmp_path / "out", check=False), 2)
    assert "the base comes first: pulsediff apply BASE PATCH -o OUT" in line, line
    assert "is a folder, not a patch file" not in line
    # a folder of something else after a real base is still just not a patch
    (tmp_path / "patches").mkdir()
    line = one_line_error(run("apply", models["old"], tmp_path / "patches", "-o", tmp_path / "out", check=False), 1)
    assert line.endswith("is a folder, not a patch file")
    assert listing(tmp_path) == ["patches"]


# -- make, squash, keygen: a folder where one file goes --------------------------------------------------


def test_a_folder_for_a_patch_is_refused_without_advising_force(models, tmp_path):
    """`make -o EXISTING_FOLDER` advised -f, which then failed with "Is a directory"."""
    folder = tmp_path / "outbox"
    folder.mkdir()
    for extra in ((), ("-f",)):
        line = one_line_error(run("make", models["old"], models["new"], "-o", folder, *extra, check=False), 2)
        assert line.endswith(f"{folder} is a folder, but a patch is a single file; give a file name, such as "
                             f"{folder}/new.pulsediff"), line
        line = one_line_error(run("squash", models["old"], models["folder_patch"], "-o", folder, *extra,
                                  check=False), 2)
        assert line.endswith(f"such as {folder}/squashed.pulsediff"), line
    line = one_line_error(run("make", models["old"], models["new"], "-o", f"{tmp_path}/new/", check=False), 2)
    assert line.endswith(f"{tmp_path}/new/ names a folder, but a patch is a single file; give a file name, such "
                         f"as {tmp_path}/new/new.pulsediff"), line
    assert listing(tmp_path) == ["outbox"]


def test_keygen_into_a_folder_is_refused_without_advising_force(tmp_path):
    pytest.importorskip("cryptography")
    for extra in ((), ("-f",)):
        line = one_line_error(run("keygen", tmp_path, *extra, check=False), 2)
        assert line.endswith(f"{tmp_path} is a folder, but a key is a single file; give a file name, such as "
                             f"{tmp_path}/signing.key"), line
    assert listing(tmp_path) == []


# -- make: unrelated checkpoints --------------------------------------------------------------------------


def test_unrelated_checkpoints_are_warned_about_and_still_patched(models, tmp_path):
    rng = np.random.default_rng(7)
    alien = save({"x": random_tensor(rng, "F32", (64, 32))}, tmp_path / "alien.safetensors")
    patch = tmp_path / "p"
    proc = run("make", alien, models["new"], "-o", patch)
    warning = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert warning == [f"pulsediff: warning: {alien} and {models['new']} look like unrelated checkpoints: they have "
                       "no tensor in common (same name, shape and dtype), so the patch carries the target whole"]
    run("apply", alien, patch, "-o", tmp_path / "rebuilt", "-q")  # still a valid patch
    assert listing(tmp_path / "rebuilt") == listing(models["new"])
    # -q silences it, as every warning; --json says it in a field too
    assert run("make", alien, models["new"], "-o", patch, "-f", "-q").stderr == ""
    proc = run("make", alien, models["new"], "-o", patch, "-f", "--json")
    assert json.loads(proc.stdout)["looks_unrelated"] is True and "unrelated checkpoints" in proc.stderr


def test_a_mostly_unshared_pair_says_how_much_is_shared(tmp_path):
    """Same names, but the largest tensor's shape differs: only what is left can be built on."""
    rng = np.random.default_rng(8)
    small = {"embed": random_tensor(rng, "BF16", (300, 32)), "norm": random_tensor(rng, "BF16", (100, 32))}
    large = {"embed": random_tensor(rng, "BF16", (310, 32)), "norm": mutate(rng, small["norm"], 0.01)}
    old, new = save(small, tmp_path / "a.safetensors"), save(large, tmp_path / "b.safetensors")
    proc = run("make", old, new, "-o", tmp_path / "p")
    assert "look like unrelated checkpoints: only 24% of the target's elements are in tensors the base has too" \
        in proc.stderr


def test_a_normal_pair_gets_no_warning(models, tmp_path):
    for old, new in ((models["old"], models["new"]), (models["old_file"], models["new_file"])):
        proc = run("make", old, new, "-o", tmp_path / "p", "-f", "--json")
        assert json.loads(proc.stdout)["looks_unrelated"] is False
        assert proc.stderr == ""


def test_dense_changes_of_a_related_pair_are_not_unrelated(tmp_path):
    """Consecutive FP32 steps change nearly every element (each tensor carried whole): still one model."""
    from pulsediff import make_patch
    from pulsediff.ops.make import unrelated_reason

    rng = np.random.default_rng(9)
    base = {"w": random_tensor(rng, "F32", (64, 32)), "b": random_tensor(rng, "F32", (32,))}
    step = {k: mutate(rng, v, 1.0) for k, v in base.items()}
    old, new = save(base, tmp_path / "a.safetensors"), save(step, tmp_path / "b.safetensors")
    header = make_patch(old, new, tmp_path / "p", device="cpu")
    assert all(r.op == "full" for r in header.tensors)
    assert unrelated_reason(old, new) is None
    assert unrelated_reason(None, new) is None  # an anchor
