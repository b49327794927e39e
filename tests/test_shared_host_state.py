"""engines/shared_state.py: the ranks of an engine on one machine share one host state.

Real processes meet at a real rendezvous file and map a real memfd: the owner decodes a real patch into
it, the follower sees the target bit for bit and reads the update's changes as the owner wrote them. A
dead owner's line, a lock the owner holds while loading, a fd that is not a host state and a damaged
table or changes record are each met with a clear outcome (a private copy, or PulsediffError)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from pulsediff.engines import shared_state
from pulsediff.engines.shared_state import (
    SharingUnavailable,
    load_shared_host_state,
    publish_changes,
    read_changes,
    replica_key,
)
from pulsediff.errors import PulsediffError

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memfd_create is Linux's")


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """Rendezvous files in a folder of this test's (tempfile's temp dir is where the module looks)."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    return tmp_path


def checkpoint_pair(folder):
    gen = torch.Generator().manual_seed(1)
    old = {"a.weight": torch.randn(300, 70, generator=gen).bfloat16(), "b.bias": torch.randn(33, generator=gen),
           "c.ids": torch.arange(5, dtype=torch.int64), "d.empty": torch.empty(0, 4, dtype=torch.bfloat16)}
    new = {k: v.clone() for k, v in old.items()}
    new["a.weight"].view(-1)[::53] += 1
    new["b.bias"][3] = 7.0
    save_file(old, str(folder / "model.safetensors"))
    return old, new


FOLLOWER = textwrap.dedent("""
    import json, sys, time, torch
    from pulsediff.engines.shared_state import load_shared_host_state, read_changes
    folder, key, out = sys.argv[1:4]
    state, sharing = load_shared_host_state(folder, key)
    assert not sharing.owner, "the follower became an owner"
    while not __import__("os").path.exists(out + ".go"):
        time.sleep(0.02)
    pid, fd, digest = open(out + ".go").read().split()
    changes = read_changes(int(pid), int(fd), state.tensors, sharing.state_id, digest)
    bits = {k: v.contiguous().view(-1).view(torch.uint8).numpy().tobytes().hex() for k, v in state.tensors.items()}
    json.dump({"state_id": sharing.state_id, "digest": state.digest, "bits": bits,
               "changes": {k: None if v is None else v.tolist() for k, v in changes.items()}}, open(out, "w"))
""")


def test_an_owner_decodes_and_a_follower_sees_the_target_and_its_changes(private_tmp, tmp_path):
    from pulsediff.ops.make import make_patch_bytes

    old, new = checkpoint_pair(tmp_path)
    patch = tmp_path / "p.pulsediff"
    patch.write_bytes(make_patch_bytes(old, new))
    key = replica_key(str(tmp_path), os.getpid(), [0, 1], uuid.uuid4().hex)
    state, sharing = load_shared_host_state(tmp_path, key)  # first: the owner
    assert sharing.owner and sharing.state_id > 0
    out = tmp_path / "follower.json"
    follower = subprocess.Popen([sys.executable, "-c", FOLLOWER, str(tmp_path), key, str(out)],
                                env={**os.environ, "TMPDIR": str(private_tmp)})
    try:
        advance = state.advance(str(patch), stage=True)
        state.commit()
        fd = publish_changes(sharing, list(state.tensors), advance.changes, advance.digest)
        (tmp_path / "follower.json.go").write_text(f"{os.getpid()} {fd} {advance.digest}")
        assert follower.wait(timeout=120) == 0
    finally:
        follower.kill()
    seen = json.loads(out.read_text())
    assert seen["state_id"] == sharing.state_id and seen["digest"] is None  # the owner's digest is its own
    for name, tensor in new.items():  # the target, bit for bit, through the follower's own mapping
        assert seen["bits"][name] == tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes().hex(), name
    assert seen["changes"] == {k: v.tolist() for k, v in advance.changes.items()}
    assert sorted(seen["changes"]["a.weight"]) == list(range(0, 300 * 70, 53))


def test_a_dead_owners_line_is_replaced_and_its_lock_is_gone(private_tmp, tmp_path):
    checkpoint_pair(tmp_path)
    key = replica_key(str(tmp_path), 1, [0, 1], uuid.uuid4().hex)
    line = shared_state.rendezvous_folder() / f"{key}.rendezvous"
    line.write_text("999999 7 12345\n")  # a process that ended: its flock went with it
    state, sharing = load_shared_host_state(tmp_path, key)
    assert sharing.owner
    assert line.read_text().split() == [str(os.getpid()), str(sharing.memfd), str(sharing.state_id)]
    import fcntl

    assert fcntl.fcntl(sharing.memfd, fcntl.F_GET_SEALS) & shared_state.SEALS == shared_state.SEALS  # its size fixed
    shared_state.release(sharing)
    state2, again = load_shared_host_state(tmp_path, key)  # released: the lock is free for a new owner
    assert again.owner and again.state_id != sharing.state_id
    assert torch.equal(state2.tensors["a.weight"].view(torch.int16), state.tensors["a.weight"].view(torch.int16))


def test_a_follower_waits_for_a_loading_owner_and_refuses_what_is_not_a_host_state(private_tmp, tmp_path):
    checkpoint_pair(tmp_path)
    key = replica_key(str(tmp_path), 1, [0, 1], uuid.uuid4().hex)
    path = shared_state.rendezvous_folder() / f"{key}.rendezvous"
    # Another process holds the lock and names its stdin: not a pulsediff host state.
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, sys, time
        fd = os.open({str(path)!r}, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("locked", flush=True)
        time.sleep(0.5)  # "loading": the follower waits
        os.pwrite(fd, f"{{os.getpid()}} 0 5\\n".encode(), 0)
        print("named", flush=True)
        time.sleep(60)
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(SharingUnavailable, match="not a pulsediff host state"):
            load_shared_host_state(tmp_path, key)
        assert holder.stdout.readline().strip() == "named"  # it waited for the line
    finally:
        holder.kill()
        holder.wait()


def test_a_shared_folder_of_another_mode_is_not_used(private_tmp):
    folder = private_tmp / f"pulsediff-host-state-{os.getuid()}"
    folder.mkdir(mode=0o777)
    os.chmod(folder, 0o777)
    with pytest.raises(SharingUnavailable, match="not a private folder"):
        shared_state.rendezvous_folder()


def test_a_followers_checks_of_the_table():
    good = [["w", "bfloat16", [4, 8], 0, 64], ["b", "float32", [3], 64, 12]]
    size = shared_state._data_start(len(json.dumps(good))) + 128
    assert shared_state._checked_table(json.dumps(good).encode(), size) == good
    bad_rows = [
        ["w", "bfloat16", [4, 8], 0, 63],  # size and shape disagree
        ["w", "pickle", [4], 0, 8],  # not a dtype
        ["w", "float32", [-1], 0, 0],
        ["w", "float32", [2], 8, 8],  # not aligned
        ["w", "float32", [2], 0, 1 << 40],  # past the end
        ["w", "float32", [True], 0, 4],  # a bool for an int
        "w",
    ]
    for row in bad_rows:
        raw = json.dumps([row]).encode()
        with pytest.raises(SharingUnavailable):
            shared_state._checked_table(raw, shared_state._data_start(len(raw)) + 256)
    overlapping = json.dumps([["a", "float32", [16], 0, 64], ["b", "float32", [16], 32, 64]]).encode()
    with pytest.raises(SharingUnavailable):
        shared_state._checked_table(overlapping, 4096)
    twice = json.dumps([["a", "float32", [16], 0, 64], ["a", "float32", [16], 64, 64]]).encode()
    with pytest.raises(SharingUnavailable):
        shared_state._checked_table(twice, 4096)
    with pytest.raises(SharingUnavailable):
        shared_state._checked_table(b"{not json", 4096)


def test_changes_records_are_checked_before_use(tmp_path):
    tensors = {"a": torch.zeros(10), "b": torch.zeros(4)}
    sharing = shared_state.Sharing(5, True, -1)
    changes = {"a": np.array([1, 9], np.int64), "b": None}
    fd = publish_changes(sharing, list(tensors), changes, "xxh3tree:" + "a" * 32)
    got = read_changes(os.getpid(), fd, tensors, 5, "xxh3tree:" + "a" * 32)
    assert got["a"].tolist() == [1, 9] and got["b"] is None
    with pytest.raises(PulsediffError, match="another update"):
        read_changes(os.getpid(), fd, tensors, 5, "xxh3tree:" + "b" * 32)  # not the agreed target
    with pytest.raises(PulsediffError, match="another update"):
        read_changes(os.getpid(), fd, tensors, 6, "xxh3tree:" + "a" * 32)  # another state's
    shared_state.close_changes(sharing)

    def record(rows, positions, magic=shared_state.CHANGES_MAGIC, count=None):
        fd = os.memfd_create("pulsediff-changes")
        os.write(fd, shared_state._CHANGES_HEAD.pack(magic, 5, b"d", len(rows) if count is None else count)
                 + np.array(rows, np.int64).tobytes() + np.array(positions, np.int64).tobytes())
        return fd

    cases = {"outside it": ([[0, 1]], [10], None), "add up": ([[0, 2]], [1], None),
             "bad index": ([[2, 1]], [0], None), "twice": ([[0, 1], [0, 1]], [1, 2], None),
             "negative": ([[0, -2]], [], None), "huge count": ([[0, 2**62]], [1], None),
             "more rows than bytes": ([[0, 1]], [1], 2**40), "left over": ([[0, 1]], [1, 2], None)}
    for what, (rows, positions, count) in cases.items():
        fd = record(rows, positions, count=count)
        try:
            with pytest.raises(PulsediffError):
                read_changes(os.getpid(), fd, tensors, 5, "d")
        finally:
            os.close(fd)
    fd = record([], [], magic=b"XXXXXXXX")
    try:
        with pytest.raises(PulsediffError, match="not a changes record"):
            read_changes(os.getpid(), fd, tensors, 5, "d")
    finally:
        os.close(fd)
    other = os.memfd_create("something-else")
    try:
        with pytest.raises(PulsediffError, match="not an update's changes"):
            read_changes(os.getpid(), other, tensors, 5, "d")
    finally:
        os.close(other)
    with pytest.raises(PulsediffError, match="could not be read"):
        read_changes(os.getpid(), 10_000, tensors, 5, "d")


def test_an_owner_that_cannot_load_lets_go_of_the_lock(private_tmp, tmp_path):
    import fcntl

    key = replica_key(str(tmp_path), 1, [0, 1], uuid.uuid4().hex)
    with pytest.raises(PulsediffError):
        load_shared_host_state(tmp_path / "missing", key)
    path = shared_state.rendezvous_folder() / f"{key}.rendezvous"
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: a waiting follower would take it and load itself
    finally:
        os.close(fd)


def test_old_rendezvous_files_of_ended_engines_are_swept(private_tmp, tmp_path):
    checkpoint_pair(tmp_path)
    folder = shared_state.rendezvous_folder()
    old, recent = folder / "old.rendezvous", folder / "recent.rendezvous"
    old.write_text("1 2 3\n")
    recent.write_text("1 2 3\n")
    os.utime(old, (1, 1))
    held = folder / "held.rendezvous"  # an old file whose engine still runs (it holds the lock): kept
    state, sharing = load_shared_host_state(tmp_path, "held")
    os.utime(held, (1, 1))
    load_shared_host_state(tmp_path, replica_key(str(tmp_path), 1, [0], uuid.uuid4().hex))
    assert not old.exists() and recent.exists() and held.exists()


def test_a_lock_that_cannot_be_taken_means_a_private_copy(private_tmp, tmp_path, monkeypatch):
    import fcntl

    checkpoint_pair(tmp_path)

    def no_locks(fd, op):
        raise OSError(38, "Function not implemented")  # flock on a file system without it (Lustre, some FUSE)

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(SharingUnavailable, match="not implemented"):
        load_shared_host_state(tmp_path, replica_key(str(tmp_path), 1, [0, 1], uuid.uuid4().hex))


def test_a_replica_is_its_aligned_block_of_ranks():
    from types import SimpleNamespace

    from pulsediff.engines.shared_state import replica_ranks

    # vLLM's layout: ranks = arange(world).reshape(dp, pp, tp); tensor ranks fastest.
    tp, pp, dp = 2, 2, 2
    grid = np.arange(dp * pp * tp).reshape(dp, pp, tp)
    for rank in range(dp * pp * tp):
        d, p, t = np.argwhere(grid == rank)[0]
        groups = [SimpleNamespace(world_size=tp, ranks=grid[d, p, :].tolist()),
                  SimpleNamespace(world_size=pp, ranks=grid[d, :, t].tolist())]
        assert replica_ranks(rank, groups) == grid[d].reshape(-1).tolist()
    odd = [SimpleNamespace(world_size=2, ranks=[0, 5])]  # not vLLM's layout: no sharing
    assert replica_ranks(0, odd) is None
