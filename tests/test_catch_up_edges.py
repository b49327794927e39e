"""catch-up where a new user or a hostile series folder takes it (issue 33): arguments swapped or given
as the manifest's path, a checkpoint that is no step of the series, a catch-up that stops part-way,
symbolic links out of the series folder. Real CLI runs on series published here."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from cli_run import one_line_error, run
from ckpt_factory import save_series
from pulsediff.format.manifest import MANIFEST
from pulsediff.series.publish import publish_once

STEPS = 4


@pytest.fixture(scope="module")
def series(tmp_path_factory):
    """Steps 0 to 4 (anchors at 0, 2, 4, skip patches), and step 1 of another run of the same shapes."""
    root = tmp_path_factory.mktemp("series")
    train, other, pub = root / "train", root / "other", root / "pub"
    train.mkdir()
    other.mkdir()
    save_series(train, STEPS, seed=3, shape=(64, 32), tensors=2, density=0.02)
    save_series(other, 1, seed=9, shape=(64, 32), tensors=2, density=0.02)
    publish_once(train, pub, anchor_every=2, settle=0)
    return train, other / "step_000001.safetensors", pub


def ckpt(train: Path, step: int) -> Path:
    return train / f"step_{step:06d}.safetensors"


def worker_at(train: Path, step: int, path: Path) -> Path:
    shutil.copyfile(ckpt(train, step), path)
    return path


# -- A. arguments the other way round, or the manifest's own path -------------------------------------


@pytest.mark.parametrize("exists", [True, False])
def test_swapped_arguments_say_the_checkpoint_comes_first(series, tmp_path, exists):
    train, _, pub = series
    worker = tmp_path / "w.safetensors"
    if exists:
        worker_at(train, 1, worker)
    line = one_line_error(run("catch-up", pub, worker, check=False), 2)
    assert line == (f"pulsediff: error: {pub} is a series folder and {worker} is not: the worker's checkpoint "
                    f"comes first (pulsediff catch-up {worker} {pub})")
    assert worker.exists() == exists and (not exists or worker.read_bytes() == ckpt(train, 1).read_bytes())
    one_line_error(run("catch-up", pub, worker, "--plan", check=False), 2)


def test_a_path_to_manifest_json_names_its_series(series, tmp_path):
    train, _, pub = series
    worker = worker_at(train, 1, tmp_path / "w.safetensors")
    run("catch-up", worker, pub / MANIFEST)
    assert worker.read_bytes() == ckpt(train, STEPS).read_bytes()
    line = one_line_error(run("catch-up", worker, tmp_path / "nothing" / MANIFEST, check=False), 1)
    assert line == f"pulsediff: error: manifest not found: {tmp_path / 'nothing' / MANIFEST}"


def test_a_url_to_manifest_json_names_its_series(tmp_path):
    from pulsediff.series.remote import series_source

    for url, base in [("https://cdn.example/run/manifest.json", "https://cdn.example/run"),
                      ("s3://bucket/run/manifest.json", "s3://bucket/run"),
                      ("https://cdn.example/run/manifest.json?x=1", "https://cdn.example/run/manifest.json?x=1"),
                      ("https://cdn.example/run/", "https://cdn.example/run")]:
        store = series_source(url, cache=tmp_path / "cache")
        try:
            assert store.url == base, url
        finally:
            store.close()


# -- B. a checkpoint that is no step of the series ------------------------------------------------------


def test_a_checkpoint_of_another_series_is_not_replaced_unless_forced(series, tmp_path):
    train, stranger, pub = series
    worker = tmp_path / "w.safetensors"
    shutil.copyfile(stranger, worker)
    line = one_line_error(run("catch-up", worker, pub, check=False), 1)
    assert f"{worker} is not a step of the series in {pub}" in line
    assert f"give -f/--force (force=True) to replace it with step {STEPS}, rebuilt from an anchor" in line
    assert worker.read_bytes() == stranger.read_bytes()
    assert f"{worker} is not a step of the series" in one_line_error(run("catch-up", worker, pub, "--plan",
                                                                         check=False), 1)
    # into another output, -f means "overwrite OUT", not "forget the worker": refused all the same
    out = tmp_path / "out.safetensors"
    line = one_line_error(run("catch-up", worker, pub, "-o", out, "-f", check=False), 1)
    assert f"to build {out} from an anchor, catch up {out} on its own (pulsediff catch-up {out} {pub})" in line
    assert not out.exists() and worker.read_bytes() == stranger.read_bytes()
    # --plan says what the run would: not the -f the user already gave
    line = one_line_error(run("catch-up", worker, pub, "-o", out, "-f", "--plan", check=False), 1)
    assert f"catch up {out} on its own" in line and "give -f" not in line
    # in place with -f: replaced, and said so
    assert run("catch-up", worker, pub, "--plan", "-f").stdout == f"anchor-{STEPS:08d}.pulsediff\n"
    proc = run("catch-up", worker, pub, "-f")
    assert proc.stderr == (f"{worker} is now at step {STEPS}: it was not a step of the series in {pub}, so it was "
                           f"rebuilt from an anchor (anchor-{STEPS:08d}.pulsediff)\n")
    assert worker.read_bytes() == ckpt(train, STEPS).read_bytes()


def test_python_api_refuses_a_checkpoint_of_another_series(series, tmp_path):
    from pulsediff.errors import NotInSeriesError
    from pulsediff.series.catch_up import catch_up

    train, stranger, pub = series
    worker = tmp_path / "w.safetensors"
    shutil.copyfile(stranger, worker)
    with pytest.raises(NotInSeriesError, match="force=True"):
        catch_up(worker, pub)
    assert worker.read_bytes() == stranger.read_bytes()
    result = catch_up(worker, pub, force=True)
    assert result.replaced and result.from_anchor and result.step == STEPS


# -- C. a catch-up that stops part-way --------------------------------------------------------------


def damage(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: found by its checksums, not by a stat
    path.write_bytes(bytes(data))


def test_a_catch_up_that_stops_part_way_has_its_own_exit_code(series, tmp_path):
    """Every way to step 4 damaged, step 3 intact: the worker is at step 3, one line says so, exit 4."""
    train, _, pub = series
    copy = tmp_path / "pub"
    shutil.copytree(pub, copy)
    for name in ("anchor-00000004", "patch-00000000-00000004", "patch-00000002-00000004", "patch-00000003-00000004"):
        damage(copy / f"{name}.pulsediff")
    worker = worker_at(train, 1, tmp_path / "w.safetensors")
    proc = run("catch-up", worker, copy, check=False)
    line = one_line_error(proc, 4)
    assert line.startswith(f"pulsediff: error: {worker} is now at step 3 of {STEPS}; stopped: "
                           "patch-00000002-00000004.pulsediff: damaged (")
    assert line.endswith("(and 3 more files missing or damaged)")
    assert worker.read_bytes() == ckpt(train, 3).read_bytes()


def test_a_signed_catch_up_that_stops_part_way_is_at_a_signed_step(series, tmp_path):
    pytest.importorskip("cryptography")
    train, _, _ = series
    key = tmp_path / "k.key"
    pub_key = tmp_path / "k.pub"
    pub_key.write_text(run("keygen", key).stdout)
    signed = tmp_path / "signed"
    run("publish", train, signed, "--anchor-every", "2", "--settle", "0", "--sign", key, "-q")
    damage(signed / "patch-00000003-00000004.pulsediff")
    damage(signed / "anchor-00000004.pulsediff")
    damage(signed / "patch-00000002-00000004.pulsediff")
    damage(signed / "patch-00000000-00000004.pulsediff")
    worker = worker_at(train, 1, tmp_path / "w.safetensors")
    line = one_line_error(run("catch-up", worker, signed, "--trust", pub_key, "--trust-state", tmp_path / "state",
                              check=False), 4)
    assert f"{worker} is now at step 3 of {STEPS}; stopped: patch-00000002-00000004.pulsediff: not the file" in line
    assert worker.read_bytes() == ckpt(train, 3).read_bytes()


# -- D. symbolic links out of the series folder ---------------------------------------------------------


def test_links_out_of_the_series_folder_are_refused(series, tmp_path):
    train, _, pub = series
    copy, away = tmp_path / "pub", tmp_path / "away"
    shutil.copytree(pub, copy)
    away.mkdir()
    worker = worker_at(train, 1, tmp_path / "w.safetensors")
    patch = copy / "patch-00000001-00000002.pulsediff"
    shutil.move(patch, away / patch.name)
    patch.symlink_to(Path("..") / "away" / patch.name)  # the same bytes, outside: still refused
    line = one_line_error(run("catch-up", worker, copy, check=False), 1)
    assert line == (f"pulsediff: error: {patch} is a symbolic link out of its series folder (to "
                    f"{os.path.realpath(away / patch.name)}); not followed")
    assert worker.read_bytes() == ckpt(train, 1).read_bytes()
    manifest = copy / MANIFEST
    shutil.move(manifest, away / MANIFEST)
    manifest.symlink_to(away / MANIFEST)
    line = one_line_error(run("catch-up", worker, copy, "--plan", check=False), 1)
    assert line == (f"pulsediff: error: {manifest} is a symbolic link out of its series folder (to "
                    f"{os.path.realpath(away / MANIFEST)}); not followed")
    # links that stay inside the folder are followed
    manifest.unlink()
    patch.unlink()
    shutil.move(away / MANIFEST, copy / "manifest.json.real")
    manifest.symlink_to("manifest.json.real")
    (copy / "sub").mkdir()
    shutil.move(away / patch.name, copy / "sub" / patch.name)
    patch.symlink_to(Path("sub") / patch.name)
    run("catch-up", worker, copy)
    assert worker.read_bytes() == ckpt(train, STEPS).read_bytes()


def test_where_a_file_is_is_asked_of_its_descriptor(tmp_path):
    """A link swapped after its name was checked: the file actually opened is the one judged."""
    from pulsediff.format.manifest import outside

    folder, away = tmp_path / "series", tmp_path / "away"
    folder.mkdir()
    away.mkdir()
    (folder / "a.pulsediff").write_bytes(b"in")
    (away / "a.pulsediff").write_bytes(b"out")
    root = os.path.realpath(folder)
    fd = os.open(away / "a.pulsediff", os.O_RDONLY)  # what a swapped link would have opened
    try:
        assert outside(fd, folder / "a.pulsediff", root) == os.path.realpath(away / "a.pulsediff")
    finally:
        os.close(fd)
    fd = os.open(folder / "a.pulsediff", os.O_RDONLY)
    try:
        assert outside(fd, folder / "a.pulsediff", root) is None
    finally:
        os.close(fd)


def test_an_output_of_the_other_kind_is_refused_without_advising_force(series, tmp_path):
    """catch-up -o FOLDER for a series of files (or a file for a series of folders): one line before
    anything is read, that does not advise -f (which could not turn one into the other), and with -f
    the same; the folder is left as it was."""
    train, _, pub = series
    worker = worker_at(train, 1, tmp_path / "w.safetensors")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    for extra in ((), ("-f",)):
        line = one_line_error(run("catch-up", worker, pub, "-o", out, *extra, check=False), 2)
        assert f"{out} is a folder, but {worker} is a file" in line and "-f" not in line
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    taken = tmp_path / "taken.safetensors"
    taken.write_bytes(b"x")
    line = one_line_error(run("catch-up", worker, pub, "-o", taken, check=False), 1)
    assert "-f/--force" in line  # the right kind: -f works there, so it is advised
    run("catch-up", worker, pub, "-o", taken, "-f")
    assert taken.read_bytes() == ckpt(train, STEPS).read_bytes()
