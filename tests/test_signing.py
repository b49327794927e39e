"""Signed series over a local folder: keygen, publish --sign, catch-up --trust, and the forgeries
they must refuse (issue 23). The same over real S3 and HTTP servers is in tests/test_remote.py.

Every refusal is one line on stderr, exit 1, and the worker's checkpoint as it was (absent when
it was absent); every success is a checkpoint `cmp`-identical to the trainer's newest step.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("cryptography")

from ckpt_factory import save_series  # noqa: E402
from pulsediff.errors import RollbackError, SigningKeyError, UntrustedManifestError  # noqa: E402
from pulsediff.series.catch_up import catch_up_state_dict  # noqa: E402
from pulsediff.format.manifest import MANIFEST, Manifest  # noqa: E402
from pulsediff.series.catch_up import catch_up
from pulsediff.series.publish import publish_once  # noqa: E402
from pulsediff.series import signing  # noqa: E402
from pulsediff.series.signing import SIGNATURE_NAME  # noqa: E402

PULSEDIFF = [sys.executable, "-m", "pulsediff"]
STEPS = 4


@pytest.fixture(autouse=True)
def state_home(tmp_path, monkeypatch):
    """Every test's rollback record in its own folder (never the user's ~/.local/state)."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return tmp_path / "state"


@pytest.fixture(scope="module")
def train(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("train")
    save_series(folder, STEPS, seed=5, shape=(64, 32), tensors=3, density=0.05)
    return folder


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """Two key pairs: the publisher's and someone else's (file, public key line)."""
    folder = tmp_path_factory.mktemp("keys")
    return {name: (folder / f"{name}.key", signing.keygen(folder / f"{name}.key")) for name in ("ours", "theirs")}


def ckpt(train: Path, step: int) -> Path:
    return train / f"step_{step:06d}.safetensors"


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*PULSEDIFF, *map(str, args)], capture_output=True, env=os.environ.copy(), timeout=300)


def signed_series(train: Path, dest: Path, key: Path, upto: int = STEPS) -> Path:
    """The trainer's steps 0..upto published into `dest`, signed with `key`."""
    part = dest.parent / f"{dest.name}-train"
    if not part.exists():
        part.mkdir()
    for step in range(upto + 1):
        if not ckpt(part, step).exists():
            shutil.copy(ckpt(train, step), ckpt(part, step))
    publish_once(part, dest, anchor_every=2, settle=0, sign=key)
    return dest


def refused(proc: subprocess.CompletedProcess, *words: str) -> str:
    err = proc.stderr.decode()
    assert proc.returncode == 1, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, err
    return err


# -- keys ----------------------------------------------------------------------------------------


def test_keygen_writes_a_private_key_only_its_owner_reads_and_prints_the_public_key(tmp_path):
    key = tmp_path / "trainer.key"
    proc = cli("keygen", key)
    assert proc.returncode == 0, proc.stderr.decode()
    public = proc.stdout.decode()
    assert public.count("\n") == 1 and public.startswith("ed25519:")
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert b"PRIVATE KEY" in key.read_bytes()
    again = cli("keygen", "--public", key)
    assert again.returncode == 0 and again.stdout.decode() == public
    assert [p.name for p in tmp_path.iterdir()] == ["trainer.key"]  # no temporary left


def test_keygen_refuses_to_overwrite_a_key_without_force(tmp_path):
    key = tmp_path / "trainer.key"
    first = cli("keygen", key).stdout
    before = key.read_bytes()
    refused(cli("keygen", key), "already exists", "-f")
    assert key.read_bytes() == before
    forced = cli("keygen", key, "-f")
    assert forced.returncode == 0 and forced.stdout != first and key.read_bytes() != before
    assert stat.S_IMODE(key.stat().st_mode) == 0o600


def test_bad_keys_are_one_line(tmp_path, keys):
    (tmp_path / "junk.key").write_text("hello\n")
    refused(cli("keygen", "--public", tmp_path / "junk.key"), "not an unencrypted PEM private key")
    refused(cli("keygen", "--public", tmp_path / "none.key"), "key file not found")
    with pytest.raises(SigningKeyError, match="not an Ed25519 public key"):
        signing.trusted_keys("ed25519:AAAA")
    with pytest.raises(SigningKeyError, match="is a private key"):
        signing.trusted_keys(keys["ours"][0])
    (tmp_path / "trusted").write_text(f"# the trainer's keys\n{keys['ours'][1]}\n\n{keys['theirs'][1]}\n")
    assert signing.trusted_keys(str(tmp_path / "trusted")) == (keys["ours"][1], keys["theirs"][1])


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620])
def test_a_private_key_others_can_read_is_refused(tmp_path, train, keys, mode):
    """As ssh does: a key the group or everyone could have read (or replaced) signs nothing; the
    message says how to fix it, and nothing is published."""
    key = tmp_path / "trainer.key"
    key.write_bytes(keys["ours"][0].read_bytes())
    key.chmod(mode)
    refused(cli("publish", train, tmp_path / "pub", "--settle", "0", "--sign", key), "accessible to other users",
            f"chmod 600 {key}")
    assert not (tmp_path / "pub").exists() or not any((tmp_path / "pub").iterdir())
    refused(cli("keygen", "--public", key), "other users")
    key.chmod(0o600)
    assert cli("keygen", "--public", key).stdout.decode() == keys["ours"][1] + "\n"


def test_keygen_temporaries_never_collide_and_a_dead_ones_is_removed(tmp_path):
    """The temporary has a random name of its own (not one per process, which a stale file of a
    dead process under the same pid would block), and one left by a killed keygen goes."""
    from pulsediff.io.atomic import TMP_SUFFIX, temp_prefix

    key = tmp_path / "trainer.key"
    stale = tmp_path / f"{temp_prefix(key).replace(f'-{os.getpid()}.', '-999999999.')}key{TMP_SUFFIX}"
    stale.write_bytes(b"half a key")
    blocker = tmp_path / f"{temp_prefix(key)}key{TMP_SUFFIX}"  # the name the old keygen always used
    blocker.write_bytes(b"")
    public = signing.keygen(key)
    assert public.startswith("ed25519:") and stat.S_IMODE(key.stat().st_mode) == 0o600
    assert not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([key.name, blocker.name])


def test_without_cryptography_signing_is_one_line_with_the_install_hint(tmp_path, keys, monkeypatch):
    from pulsediff.errors import MissingExtraError

    for name in [m for m in sys.modules if m == "cryptography" or m.startswith("cryptography.")] + ["cryptography"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    with pytest.raises(MissingExtraError, match=r"pip install 'pulsediff\[sign\]'"):
        signing.keygen(tmp_path / "k.key")
    with pytest.raises(MissingExtraError):
        catch_up(tmp_path / "w.safetensors", tmp_path, trust=keys["ours"][1])
    assert not (tmp_path / "k.key").exists()


# -- round trips -----------------------------------------------------------------------------------


@pytest.mark.parametrize("start", [None, 1])
def test_signed_round_trip_over_a_folder(train, keys, tmp_path, start):
    pub = tmp_path / "pub"
    proc = cli("publish", train, pub, "--sign", keys["ours"][0], "--anchor-every", "2", "--settle", "0", "-q")
    assert proc.returncode == 0, proc.stderr.decode()
    assert (pub / SIGNATURE_NAME).is_file()
    manifest = Manifest.load(pub)
    assert manifest.serial == STEPS + 1 and all(e.sha256 for e in manifest.entries)
    worker = tmp_path / "worker.safetensors"
    if start is not None:
        shutil.copy(ckpt(train, start), worker)
    trust_file = tmp_path / "trainer.pub"
    trust_file.write_text(keys["ours"][1] + "\n")
    for trust in (keys["ours"][1], trust_file):  # the key itself, or a file holding it
        proc = cli("catch-up", worker, pub, "--trust", trust, "--json")
        assert proc.returncode == 0, proc.stderr.decode()
        assert json.loads(proc.stdout)["step"] == STEPS
        assert worker.read_bytes() == ckpt(train, STEPS).read_bytes()


def test_unsigned_series_keep_working_without_trust(train, tmp_path):
    pub = tmp_path / "pub"
    publish_once(train, pub, anchor_every=2, settle=0)
    assert not (pub / SIGNATURE_NAME).exists()
    result = catch_up(tmp_path / "w.safetensors", pub)
    assert result.step == STEPS


def test_a_worker_without_trust_reads_a_signed_series(train, keys, tmp_path):
    pub = signed_series(train, tmp_path / "pub", keys["ours"][0])
    assert catch_up(tmp_path / "w.safetensors", pub).step == STEPS


# -- what a trusting worker refuses ------------------------------------------------------------------


def worker_at(train: Path, tmp_path: Path, step: int | None) -> tuple[Path, bytes | None]:
    worker = tmp_path / "worker.safetensors"
    if step is not None:
        shutil.copy(ckpt(train, step), worker)
    return worker, (worker.read_bytes() if step is not None else None)


def untouched(worker: Path, before: bytes | None) -> None:
    if before is None:
        assert not worker.exists()
    else:
        assert worker.read_bytes() == before
    assert not [p for p in worker.parent.iterdir() if p.name.startswith(".")]  # no temporary left


@pytest.mark.parametrize("start", [None, 1])
def test_a_tampered_manifest_is_refused(train, keys, tmp_path, start):
    pub = signed_series(train, tmp_path / "pub", keys["ours"][0])
    text = (pub / MANIFEST).read_text()
    # A consistent lie: the newest step relabelled, every digest and size still true.
    (pub / MANIFEST).write_text(text.replace(f'"step": {STEPS},', f'"step": {STEPS + 100},'))
    worker, before = worker_at(train, tmp_path, start)
    refused(cli("catch-up", worker, pub, "--trust", keys["ours"][1]), "does not match", "manifest.json")
    untouched(worker, before)


def test_a_manifest_signed_by_another_key_is_refused(train, keys, tmp_path):
    pub = signed_series(train, tmp_path / "pub", keys["ours"][0])
    data = (pub / MANIFEST).read_bytes()
    (pub / SIGNATURE_NAME).write_bytes(signing.sign_manifest(signing.load_private_key(keys["theirs"][0]), data))
    worker, before = worker_at(train, tmp_path, 1)
    refused(cli("catch-up", worker, pub, "--trust", keys["ours"][1]), keys["theirs"][1], "not a trusted key")
    untouched(worker, before)


def test_a_consistent_fake_series_without_a_valid_signature_is_refused(train, keys, tmp_path):
    """Someone who can write the folder publishes a series of their own (true digests, true sizes)."""
    fake_train = tmp_path / "fake-train"
    fake_train.mkdir()
    save_series(fake_train, STEPS, seed=99, shape=(64, 32), tensors=3, density=0.05)
    pub = signed_series(train, tmp_path / "pub", keys["ours"][0])
    genuine_sig = (pub / SIGNATURE_NAME).read_bytes()
    shutil.rmtree(pub)
    publish_once(fake_train, pub, anchor_every=2, settle=0)  # unsigned, all its checksums right
    worker, before = worker_at(train, tmp_path, None)
    refused(cli("catch-up", worker, pub, "--trust", keys["ours"][1]), "not signed")
    untouched(worker, before)
    (pub / SIGNATURE_NAME).write_bytes(genuine_sig)  # the trainer's real signature, over other bytes
    refused(cli("catch-up", worker, pub, "--trust", keys["ours"][1]), "does not match")
    untouched(worker, before)
    publish_once(fake_train, tmp_path / "theirs", anchor_every=2, settle=0, sign=keys["theirs"][0])  # their own key
    refused(cli("catch-up", worker, tmp_path / "theirs", "--trust", keys["ours"][1]), "not a trusted key")
    untouched(worker, before)


def test_a_replayed_older_signed_manifest_is_refused(train, keys, tmp_path):
    pub = signed_series(train, tmp_path / "pub", keys["ours"][0], upto=2)
    old = {name: (pub / name).read_bytes() for name in (MANIFEST, SIGNATURE_NAME)}  # signed, genuine, step 2
    signed_series(train, pub, keys["ours"][0], upto=STEPS)
    first = tmp_path / "first.safetensors"
    assert cli("catch-up", first, pub, "--trust", keys["ours"][1]).returncode == 0  # sees the step-4 manifest
    for name, data in old.items():  # a mirror (or an attacker) serves the older signed pair again
        (pub / name).write_bytes(data)
    worker, before = worker_at(train, tmp_path, 1)
    err = refused(cli("catch-up", worker, pub, "--trust", keys["ours"][1]), "older than serial", "replayed")
    assert "serial 3 " in err and f"serial {STEPS + 1} (step {STEPS})" in err
    untouched(worker, before)
    # Another record (a fresh worker's) has seen nothing newer: the old manifest is genuine, so it is used.
    ok = cli("catch-up", worker, pub, "--trust", keys["ours"][1], "--trust-state", tmp_path / "fresh.json", "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["step"] == 2


def test_a_file_that_is_not_the_signed_one_is_skipped_for_another_chain(train, keys, tmp_path):
    pub = signed_series(train, tmp_path / "pub", keys["ours"][0])
    worker, _ = worker_at(train, tmp_path, 3)
    link = f"patch-{3:08d}-{STEPS:08d}.pulsediff"
    data = bytearray((pub / link).read_bytes())
    data[-1] ^= 1  # same size; only its SHA-256 (and a checksum) can tell
    (pub / link).write_bytes(bytes(data))
    result = catch_up(worker, pub, trust=keys["ours"][1])
    assert result.step == STEPS and link in result.problems and "SHA-256" in result.problems[link]
    assert worker.read_bytes() == ckpt(train, STEPS).read_bytes()


def test_a_signed_manifest_without_file_hashes_is_refused(train, keys, tmp_path):
    pub = signed_series(train, tmp_path / "pub", keys["ours"][0])
    obj = json.loads((pub / MANIFEST).read_text())
    for e in obj["entries"]:
        del e["sha256"]
    data = json.dumps(obj).encode()
    (pub / MANIFEST).write_bytes(data)
    (pub / SIGNATURE_NAME).write_bytes(signing.sign_manifest(signing.load_private_key(keys["ours"][0]), data))
    with pytest.raises(UntrustedManifestError, match="without a sha256"):
        catch_up(tmp_path / "w.safetensors", pub, trust=keys["ours"][1])
    assert not (tmp_path / "w.safetensors").exists()


def test_a_damaged_rollback_record_is_refused_not_forgotten(train, keys, tmp_path, state_home):
    pub = signed_series(train, tmp_path / "pub", keys["ours"][0])
    record = signing.default_state_file()
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text("{not json")
    worker, before = worker_at(train, tmp_path, 1)
    refused(cli("catch-up", worker, pub, "--trust", keys["ours"][1]), "rollback record is damaged", str(record))
    untouched(worker, before)


def test_plan_with_trust_checks_the_signature_and_records_nothing(train, keys, tmp_path):
    pub = signed_series(train, tmp_path / "pub", keys["ours"][0])
    worker, _ = worker_at(train, tmp_path, 1)
    record = tmp_path / "worker-state.json"
    proc = cli("catch-up", worker, pub, "--trust", keys["ours"][1], "--plan", "--trust-state", record)
    assert proc.returncode == 0 and proc.stdout.decode().split()
    assert not record.exists()
    refused(cli("catch-up", worker, pub, "--trust", keys["theirs"][1], "--plan"), "not a trusted key")


# -- manifest and signature seen at different moments ---------------------------------------------------


def test_a_pair_caught_mid_replacement_is_read_again(train, keys, tmp_path, monkeypatch):
    """The publisher writes the signature, then the manifest: a reader between the two sees a new
    signature over an old manifest. It reads again instead of refusing at once."""
    monkeypatch.setattr(signing, "RETRY_DELAY", 0.3)
    pub = signed_series(train, tmp_path / "pub", keys["ours"][0], upto=2)
    old_manifest = (pub / MANIFEST).read_bytes()
    signed_series(train, pub, keys["ours"][0], upto=STEPS)
    new_manifest = (pub / MANIFEST).read_bytes()
    (pub / MANIFEST).write_bytes(old_manifest)  # the new signature is in place, the manifest not yet
    timer = threading.Timer(0.15, lambda: (pub / MANIFEST).write_bytes(new_manifest))
    timer.start()
    try:
        result = catch_up(tmp_path / "w.safetensors", pub, trust=keys["ours"][1])
    finally:
        timer.join()
    assert result.step == STEPS


def test_publish_signs_the_manifest_after_writing_the_signature(train, keys, tmp_path, monkeypatch):
    """Order of the two renames: signature first, so a reader never sees a new manifest under an old
    signature for longer than the gap between them."""
    from pulsediff.series import store

    order = []
    real_save = Manifest.save
    monkeypatch.setattr(Manifest, "save", lambda self, folder: (order.append(MANIFEST), real_save(self, folder)))
    real_staged = store.Folder.save_manifest

    def spy(self, manifest, signature=None):
        if signature is not None:
            order.append(SIGNATURE_NAME)
        return real_staged(self, manifest, signature)

    monkeypatch.setattr(store.Folder, "save_manifest", spy)
    signed_series(train, tmp_path / "pub", keys["ours"][0], upto=1)
    assert order == [SIGNATURE_NAME, MANIFEST] * 2


# -- the publisher's side: continuing, rotating ---------------------------------------------------------


def test_publish_refuses_to_continue_a_series_it_cannot_verify(train, keys, tmp_path):
    pub = signed_series(train, tmp_path / "pub", keys["ours"][0], upto=2)
    before = {p.name: p.read_bytes() for p in pub.iterdir()}
    refused(cli("publish", train, pub, "--sign", keys["theirs"][0], "--settle", "0"), "not a trusted key", "--trust")
    proc = cli("publish", train, pub, "--settle", "0")  # unsigned on top of a signed series
    assert proc.returncode == 2 and "--sign" in proc.stderr.decode()
    assert {p.name: p.read_bytes() for p in pub.iterdir()} == before
    unsigned = tmp_path / "unsigned"
    publish_once(train, unsigned, anchor_every=2, settle=0)
    refused(cli("publish", train, unsigned, "--sign", keys["ours"][0], "--settle", "0"), "not signed")


def test_key_rotation_publish_with_the_new_key_trusting_the_old(train, keys, tmp_path):
    old, new = keys["ours"], keys["theirs"]
    pub = signed_series(train, tmp_path / "pub", old[0], upto=2)
    worker = tmp_path / "w.safetensors"
    assert catch_up(worker, pub, trust=old[1]).step == 2
    part = tmp_path / "pub-train"
    for step in range(3, STEPS + 1):
        shutil.copy(ckpt(train, step), ckpt(part, step))
    proc = cli("publish", part, pub, "--sign", new[0], "--trust", old[1], "--settle", "0", "-q")
    assert proc.returncode == 0, proc.stderr.decode()
    refused(cli("catch-up", worker, pub, "--trust", old[1]), "not a trusted key")  # the old key alone: no more
    proc = cli("catch-up", worker, pub, "--trust", old[1], "--trust", new[1], "--json")  # during the rotation
    assert proc.returncode == 0 and json.loads(proc.stdout)["step"] == STEPS
    assert worker.read_bytes() == ckpt(train, STEPS).read_bytes()


# -- live tensors ----------------------------------------------------------------------------------


def bits(t) -> bytes:
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_catch_up_state_dict_verifies_the_same_way(train, keys, tmp_path):
    from safetensors.torch import load_file

    pub = signed_series(train, tmp_path / "pub", keys["ours"][0])
    tensors = {k: v.clone() for k, v in load_file(ckpt(train, 1)).items()}
    result = catch_up_state_dict(tensors, pub, trust=keys["ours"][1])
    assert result.step == STEPS
    target = load_file(ckpt(train, STEPS))
    assert all(bits(tensors[k]) == bits(target[k]) for k in target)

    tensors = {k: v.clone() for k, v in load_file(ckpt(train, 1)).items()}
    before = {k: bits(v) for k, v in tensors.items()}
    with pytest.raises(UntrustedManifestError, match="not a trusted key"):
        catch_up_state_dict(tensors, pub, trust=keys["theirs"][1])
    text = (pub / MANIFEST).read_text()
    (pub / MANIFEST).write_text(text.replace('"serial": ', '"serial":  '))  # one byte more, same meaning
    with pytest.raises(UntrustedManifestError, match="does not match"):
        catch_up_state_dict(tensors, pub, trust=keys["ours"][1])
    assert all(bits(tensors[k]) == before[k] for k in before)


def test_catch_up_state_dict_refuses_a_replayed_manifest(train, keys, tmp_path):
    from safetensors.torch import load_file

    pub = signed_series(train, tmp_path / "pub", keys["ours"][0], upto=2)
    old = {name: (pub / name).read_bytes() for name in (MANIFEST, SIGNATURE_NAME)}
    signed_series(train, pub, keys["ours"][0], upto=STEPS)
    state = tmp_path / "live-state.json"
    tensors = {k: v.clone() for k, v in load_file(ckpt(train, 0)).items()}
    assert catch_up_state_dict(tensors, pub, trust=keys["ours"][1], trust_state=state).step == STEPS
    for name, data in old.items():
        (pub / name).write_bytes(data)
    tensors = {k: v.clone() for k, v in load_file(ckpt(train, 0)).items()}
    with pytest.raises(RollbackError):
        catch_up_state_dict(tensors, pub, trust=keys["ours"][1], trust_state=state)


def test_a_replay_of_the_old_keys_manifest_after_a_rotation_is_refused(train, keys, tmp_path):
    """The rollback record is per source, not per (source, key): serials continue across a rotation,
    so the old key's last manifest (genuine, still trusted during the rotation) is older than what the
    worker accepted under the new key."""
    old, new = keys["ours"], keys["theirs"]
    pub = signed_series(train, tmp_path / "pub", old[0], upto=2)
    replay = {name: (pub / name).read_bytes() for name in (MANIFEST, SIGNATURE_NAME)}  # K1's last, step 2
    part = tmp_path / "pub-train"
    for step in range(3, STEPS + 1):
        shutil.copy(ckpt(train, step), ckpt(part, step))
    publish_once(part, pub, anchor_every=2, settle=0, sign=new[0], trust=old[1])
    worker = tmp_path / "worker.safetensors"
    assert catch_up(worker, pub, trust=[old[1], new[1]]).step == STEPS  # accepted under K2
    before = worker.read_bytes()
    for name, data in replay.items():
        (pub / name).write_bytes(data)
    err = refused(cli("catch-up", worker, pub, "--trust", old[1], "--trust", new[1]), "older than serial", "replayed")
    assert f"(step {STEPS})" in err
    untouched(worker, before)
    with pytest.raises(RollbackError):
        catch_up(worker, pub, trust=[old[1], new[1]])
    untouched(worker, before)


def test_a_record_of_the_first_format_still_counts_for_its_source(tmp_path):
    """Entries written as "KEY SOURCE" (before the record was per source) still refuse older serials."""
    record = tmp_path / "record.json"
    record.write_text(json.dumps({"version": 1, "series": {
        "ed25519:" + "A" * 43 + "= /src": {"serial": 5, "step": 4, "sha256": "0" * 64}}}))
    with pytest.raises(RollbackError, match="older than serial 5"):
        signing.check_rollback(record, "/src", "ed25519:" + "B" * 43 + "=", 3, 2, b"x", "m")
    signing.check_rollback(record, "/src", "ed25519:" + "B" * 43 + "=", 6, 5, b"y", "m")
    assert list(json.loads(record.read_text())["series"]) == ["/src"]


# -- a file swapped between its check and its use ------------------------------------------------------


def swapper(monkeypatch, pub: Path, name: str, evil: bytes, which: str):
    """check_file as it is, then `name` replaced by `evil` right after it passed: in the series folder
    (`which` == "folder"), or wherever catch-up will read it from (its private copy, when it makes one)."""
    from pulsediff.series import catch_up as catch_up_mod

    real = catch_up_mod.check_file
    swapped = []

    def check(path, e, *args, **kwargs):
        problem = real(path, e, *args, **kwargs)
        if problem is None and e.file == name:
            target = kwargs.get("private") if which == "used" and kwargs.get("private") else path
            os.chmod(target, 0o600)
            Path(target).write_bytes(evil)
            swapped.append(target)
        return problem

    monkeypatch.setattr(catch_up_mod, "check_file", check)
    return swapped


@pytest.mark.parametrize("which", ["folder", "used"])
@pytest.mark.parametrize("start", [None, 3])
def test_a_file_swapped_after_its_check_is_never_applied(train, keys, tmp_path, monkeypatch, start, which):
    from pulsediff.ops.make import make_patch

    pub = signed_series(train, tmp_path / "pub", keys["ours"][0])
    fake = tmp_path / "fake-train"
    fake.mkdir()
    save_series(fake, STEPS, seed=99, shape=(64, 32), tensors=3, density=0.05)
    name = f"anchor-{STEPS:08d}.pulsediff" if start is None else f"patch-{start:08d}-{STEPS:08d}.pulsediff"
    make_patch(None if start is None else ckpt(train, start), ckpt(fake, STEPS), tmp_path / "evil")
    evil = (tmp_path / "evil").read_bytes()
    (tmp_path / "evil").unlink()
    worker, before = worker_at(train, tmp_path, start)
    swapped = swapper(monkeypatch, pub, name, evil, which)
    cache = tmp_path / "cache"  # where the private copies go
    if which == "folder":  # the file in the folder changed after it was read: what was read is what is applied
        result = catch_up(worker, pub, trust=keys["ours"][1], cache=cache)
        assert swapped and result.status == "applied" and result.step == STEPS
        assert worker.read_bytes() == ckpt(train, STEPS).read_bytes()
    else:  # the file applied is not the one checked: the rebuilt digest is not the signed target
        with pytest.raises(UntrustedManifestError, match="signed entry names"):
            catch_up(worker, pub, trust=keys["ours"][1], cache=cache)
        assert swapped
        untouched(worker, before)
    assert not any(p.name.startswith("pulsediff-trusted") for p in tmp_path.rglob("*"))  # private copies removed
    assert any(str(p).startswith(str(cache)) for p in swapped) == (which == "used")


@pytest.mark.parametrize("which", ["folder", "used"])
def test_catch_up_state_dict_never_applies_a_file_swapped_after_its_check(train, keys, tmp_path, monkeypatch, which):
    from safetensors.torch import load_file

    from pulsediff.ops.make import make_patch

    pub = signed_series(train, tmp_path / "pub", keys["ours"][0])
    fake = tmp_path / "fake-train"
    fake.mkdir()
    save_series(fake, STEPS, seed=99, shape=(64, 32), tensors=3, density=0.05)
    name = f"patch-{3:08d}-{STEPS:08d}.pulsediff"
    make_patch(ckpt(train, 3), ckpt(fake, STEPS), tmp_path / "evil")
    swapper(monkeypatch, pub, name, (tmp_path / "evil").read_bytes(), which)
    tensors = {k: v.clone() for k, v in load_file(ckpt(train, 3)).items()}
    before = {k: bits(v) for k, v in tensors.items()}
    if which == "folder":
        assert catch_up_state_dict(tensors, pub, trust=keys["ours"][1]).step == STEPS
        target = load_file(ckpt(train, STEPS))
        assert all(bits(tensors[k]) == bits(target[k]) for k in target)
    else:
        with pytest.raises(UntrustedManifestError, match="signed entry names"):
            catch_up_state_dict(tensors, pub, trust=keys["ours"][1])
        assert all(bits(tensors[k]) == before[k] for k in before)


# -- a publisher interrupted between the signature and the manifest ------------------------------------


def interrupted_publish(train: Path, pub: Path, key: Path, monkeypatch, upto: int) -> None:
    """publish --sign of steps up to `upto`, failing after manifest.json.sig is written, before manifest.json."""
    def fail(self, folder):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(Manifest, "save", fail)
        with pytest.raises(OSError):
            signed_series(train, pub, key, upto=upto)


def test_publish_recovers_from_a_failure_between_the_signature_and_the_manifest(train, keys, tmp_path, monkeypatch):
    monkeypatch.setattr(signing, "RETRY_DELAY", 0.01)
    pub = signed_series(train, tmp_path / "pub", keys["ours"][0], upto=2)
    manifest = (pub / MANIFEST).read_bytes()
    interrupted_publish(train, pub, keys["ours"][0], monkeypatch, upto=3)
    assert (pub / MANIFEST).read_bytes() == manifest  # the old manifest under the new signature
    with pytest.raises(UntrustedManifestError, match="does not match"):  # workers refuse the pair meanwhile
        catch_up(tmp_path / "w0.safetensors", pub, trust=keys["ours"][1], trust_state=tmp_path / "w0.json")
    # The publisher's own record holds the manifest's bytes: it re-signs them and goes on.
    signed_series(train, pub, keys["ours"][0], upto=STEPS)
    worker = tmp_path / "w.safetensors"
    assert catch_up(worker, pub, trust=keys["ours"][1], trust_state=tmp_path / "w.json").step == STEPS
    assert worker.read_bytes() == ckpt(train, STEPS).read_bytes()


def test_publish_without_the_record_still_refuses_a_pair_that_does_not_match(train, keys, tmp_path, monkeypatch):
    """Only bytes this publisher recorded are re-signed: a manifest edited meanwhile, or a publisher with
    another record, is refused with one line naming the recovery."""
    monkeypatch.setattr(signing, "RETRY_DELAY", 0.01)
    pub = signed_series(train, tmp_path / "pub", keys["ours"][0], upto=2)
    interrupted_publish(train, pub, keys["ours"][0], monkeypatch, upto=3)
    before = {p.name: p.read_bytes() for p in pub.iterdir()}
    err = refused(cli("publish", tmp_path / "pub-train", pub, "--sign", keys["ours"][0], "--settle", "0",
                      "--trust-state", tmp_path / "other.json"), "does not match", "--trust-state")
    assert "interrupted" in err
    assert {p.name: p.read_bytes() for p in pub.iterdir()} == before
    (pub / MANIFEST).write_text((pub / MANIFEST).read_text().replace('"step": 2,', '"step": 102,'))
    with pytest.raises(UntrustedManifestError, match="does not match"):
        signed_series(train, pub, keys["ours"][0], upto=STEPS)


def test_recovery_re_signs_only_bytes_recorded_under_a_key_the_publisher_trusts(train, keys, tmp_path, monkeypatch):
    monkeypatch.setattr(signing, "RETRY_DELAY", 0.01)
    pub = signed_series(train, tmp_path / "pub", keys["ours"][0], upto=2)
    interrupted_publish(train, pub, keys["ours"][0], monkeypatch, upto=3)
    before = {p.name: p.read_bytes() for p in pub.iterdir()}
    with pytest.raises(UntrustedManifestError, match="not a trusted key"):  # another key, not trusting ours
        signed_series(train, pub, keys["theirs"][0], upto=STEPS)
    assert {p.name: p.read_bytes() for p in pub.iterdir()} == before
    publish_once(tmp_path / "pub-train", pub, anchor_every=2, settle=0, sign=keys["theirs"][0],
                 trust=keys["ours"][1])  # a rotation: trusted, so recovered
    worker = tmp_path / "w.safetensors"
    assert catch_up(worker, pub, trust=[keys["ours"][1], keys["theirs"][1]], trust_state=tmp_path / "w.json").step == STEPS


# -- one key, two series: the signed series id ------------------------------------------------------------


def test_another_series_signed_by_the_same_key_is_refused_where_one_is_followed(train, keys, tmp_path):
    """Series B, signed by the same key with a higher serial, copied over series A's folder: the worker
    pinned A's signed `series` id when it first trusted it, and refuses B."""
    pub = signed_series(train, tmp_path / "pub", keys["ours"][0], upto=2)
    series_id = json.loads((pub / MANIFEST).read_text())["series"]
    assert isinstance(series_id, str) and len(series_id) == 32
    worker = tmp_path / "worker.safetensors"
    assert catch_up(worker, pub, trust=keys["ours"][1]).step == 2
    fake = tmp_path / "fake-train"
    fake.mkdir()
    save_series(fake, STEPS + 2, seed=99, shape=(64, 32), tensors=3, density=0.05)
    other = tmp_path / "other"
    publish_once(fake, other, anchor_every=2, settle=0, sign=keys["ours"][0])  # serial 7 > 3
    assert json.loads((other / MANIFEST).read_text())["series"] != series_id
    before = worker.read_bytes()
    saved = {p.name: p.read_bytes() for p in pub.iterdir()}
    for p in other.iterdir():
        shutil.copy(p, pub / p.name)
    refused(cli("catch-up", worker, pub, "--trust", keys["ours"][1]), "series", series_id)
    untouched(worker, before)
    for p in pub.iterdir():  # A's own folder back: A goes on under its id, whoever continues it
        p.unlink()
    for name, data in saved.items():
        (pub / name).write_bytes(data)
    signed_series(train, pub, keys["ours"][0], upto=STEPS)
    assert json.loads((pub / MANIFEST).read_text())["series"] == series_id
    assert catch_up(worker, pub, trust=keys["ours"][1]).step == STEPS


def test_a_series_id_of_another_form_makes_the_manifest_invalid():
    from pulsediff.errors import InvalidManifestError
    from pulsediff.format.manifest import parse_manifest

    good = Manifest("exact", [], 3, "0123abcd").to_bytes()
    assert parse_manifest(good, "m").series == "0123abcd"
    for bad in ('"a b"', '""', "7", '"' + "a" * 65 + '"'):
        with pytest.raises(InvalidManifestError, match="series"):
            parse_manifest(good.replace(b'"0123abcd"', bad.encode()), "m")
