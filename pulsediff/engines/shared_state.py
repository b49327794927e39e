"""One host state per machine: the ranks of an engine on one machine share one copy of the checkpoint.

Under tensor or pipeline parallelism every rank of a vLLM engine needs the checkpoint in host memory to
decode patches against (engines/state.py). A copy per rank costs the model's size times the ranks (a 70B
model at TP 8: 1.1 TB) and the same decode done once per rank. Here the first rank to start on a machine
(the owner) reads the checkpoint into an anonymous shared-memory file (memfd) and decodes every update
into it; the other ranks of the engine on that machine (followers) map the same pages and load their
part of the model from them. The ranks still agree on every update (engines/agreement.py): a follower
reports what its owner reached, so that all take the update or none does.

Finding each other needs no collective call (the state is read at the engine's start, on a thread of
its own, where a collective would race vLLM's own): the ranks of one engine compute the same key
(`replica_key`: the model folder, the process that started them, the replica's global ranks) and meet
at a rendezvous file of that key in a folder of this user's. Whoever takes the file's lock owns the
state; the lock is released by the kernel when its process ends, so a crashed owner never leaves one
behind. The owner writes "pid fd id" to the file once its state is complete; a follower opens the memfd
through /proc/<pid>/fd/<fd> and checks its header (magic and id) and table before mapping a tensor.
The memfd's memory goes back to the system when the last rank that maps it ends.

Anything that keeps a rank from sharing (no memfd, /proc closed to it, a table that does not check)
makes it read a private copy, as before, and say why: sharing saves memory, it never decides what the
weights are.

The changes of an update reach followers the same way: the owner writes them (name -> flat positions)
to a memfd of their own, whose fd its agreement record carries (`publish_changes`, `read_changes`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import mmap
import os
import secrets
import stat
import struct
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pulsediff.errors import PulsediffError

__all__ = ["Sharing", "SharingUnavailable", "load_shared_host_state", "replica_key", "publish_changes",
           "read_changes"]

MAGIC = b"PDHOST01"
CHANGES_MAGIC = b"PDCHNG01"
_HEAD = struct.Struct("<8sQQ")  # magic, state id, table length (JSON bytes after the head)
ALIGN = 64  # every tensor starts on a cache line
MAX_TABLE_BYTES = 1 << 28
TORCH_DTYPES = ("bfloat16", "float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "bool",
                "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64")
UNOPENABLE_WAIT_S = 30.0  # a rendezvous line whose memfd cannot be opened this long: read a private copy


class SharingUnavailable(Exception):
    """Why this rank reads a private copy (a line for the engine's log)."""


@dataclass
class Sharing:
    """This rank's part in a shared host state."""

    state_id: int  # random, 63 bits: what a follower's agreement record names
    owner_pid: int
    owner: bool
    memfd: int  # the state's memfd (owner) or this rank's own open of it (follower)
    lock_fd: int = -1  # the rendezvous file, locked for the owner's lifetime
    mapping: mmap.mmap | None = field(default=None, repr=False)
    changes_fd: int = -1  # the owner's memfd of the last update's changes (publish_changes)


def replica_key(model_folder: str, ppid: int, ranks: list[int], extra: str = "") -> str:
    """A name the ranks of one engine replica on one machine compute alike, and other engines do not."""
    text = json.dumps([os.path.realpath(model_folder), os.getuid(), ppid, sorted(ranks), extra])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def rendezvous_folder() -> Path:
    """This user's folder for rendezvous files: private (0700, this user's, not a link), or refused."""
    folder = Path(tempfile.gettempdir()) / f"pulsediff-host-state-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(folder)
    except OSError as exc:
        raise SharingUnavailable(f"{folder}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise SharingUnavailable(f"{folder} is not a private folder of this user's")
    return folder


def _layout(entries: list[tuple[str, str, list[int], int]], state_id: int) -> tuple[bytes, list, int]:
    """The memfd's head and table, and its size. Offsets count from the data's start, the first aligned
    byte after the table (`_data_start`)."""
    table, offset = [], 0
    for name, dtype, shape, nbytes in entries:
        table.append([name, dtype, shape, offset, nbytes])
        offset = _aligned(offset + nbytes)
    body = json.dumps(table).encode()
    return _HEAD.pack(MAGIC, state_id, len(body)) + body, table, _data_start(len(body)) + offset


def _data_start(table_len: int) -> int:
    return _aligned(_HEAD.size + table_len)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _tensors_over(mapping, table: list, start: int, torch) -> dict:
    tensors = {}
    for name, dtype, shape, offset, nbytes in table:
        if not nbytes:  # no bytes to share (and torch views no dtype of an empty byte array)
            tensors[name] = torch.empty(shape, dtype=getattr(torch, dtype))
            continue
        raw = np.frombuffer(mapping, np.uint8, nbytes, start + offset)
        tensors[name] = torch.from_numpy(raw).view(getattr(torch, dtype)).reshape(shape)
    return tensors


def _checked_table(raw: bytes, size: int) -> list:
    """A follower's check of the owner's table: types, ranges and relations (no overlaps)."""
    try:
        table = json.loads(raw)
    except ValueError as exc:
        raise SharingUnavailable(f"the shared state's table is not JSON ({exc})") from None
    if not isinstance(table, list):
        raise SharingUnavailable("the shared state's table is not a list")
    import torch

    names, end, room = set(), 0, size - _data_start(len(raw))
    for row in table:
        ok = (isinstance(row, list) and len(row) == 5 and isinstance(row[0], str) and row[0] not in names
              and row[1] in TORCH_DTYPES and isinstance(row[2], list)
              and all(type(d) is int and 0 <= d < 1 << 48 for d in row[2])
              and type(row[3]) is int and type(row[4]) is int and row[3] % ALIGN == 0 and row[3] >= end
              and 0 <= row[4] <= room - row[3])
        if ok:
            numel = math.prod(row[2])
            ok = numel * torch.empty(0, dtype=getattr(torch, row[1])).element_size() == row[4]
        if not ok:
            raise SharingUnavailable(f"the shared state's table has a bad row: {str(row)[:120]}")
        names.add(row[0])
        end = row[3] + row[4]
    return table


def _entries(folder: Path) -> list[tuple[str, str, list[int], int]]:
    from pulsediff.errors import UsageError
    from pulsediff.io.checkpoint import Checkpoint

    out = []
    with Checkpoint(folder) as ckpt:
        for name in ckpt.names:
            entry = ckpt.entry(name)
            if not entry.dtype.torch_name:
                raise UsageError(f"{folder}: tensor {name!r} is {entry.dtype.name}, which torch cannot hold")
            out.append((name, entry.dtype.torch_name, list(entry.shape), entry.nbytes))
    return out


def load_shared_host_state(folder, key: str):
    """(HostState, Sharing): this rank's view of the machine's one host state of `key` (owner or
    follower). SharingUnavailable (the caller reads a private copy) where it cannot share."""
    path = rendezvous_folder() / f"{key}.rendezvous"
    while True:
        try:
            lock_fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise SharingUnavailable(f"{path}: {exc.strerror or exc}") from None
        try:
            found = _meet(Path(folder), path, lock_fd)
        except BaseException:
            os.close(lock_fd)
            raise
        if found is not None:
            if not found[1].owner:
                os.close(lock_fd)  # only the owner keeps it (its lock)
            return found
        os.close(lock_fd)  # swept away as we opened it: meet at the new file


def _meet(folder: Path, path: Path, lock_fd: int):
    """Own the state (the lock is free) or follow its owner; None where the file was replaced meanwhile."""
    if os.fstat(lock_fd).st_uid != os.getuid():
        raise SharingUnavailable(f"{path} is not this user's")
    unopenable_since = None
    while True:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass  # an owner is alive: follow it once its state is complete
        else:
            # A failure here closes the file (the caller), and its lock goes to a waiting follower.
            return _own(folder, lock_fd) if _still_named(path, lock_fd) else None
        line = os.pread(lock_fd, 200, 0).decode("ascii", "replace")
        try:
            pid, fd, state_id = (int(x) for x in line.split())
        except ValueError:  # still loading (empty), or a line written as we read it
            time.sleep(0.05)
            continue
        try:
            return _follow(pid, fd, state_id)
        except FileNotFoundError:  # an old owner's line, before its successor's truncation
            unopenable_since = unopenable_since or time.monotonic()
            if time.monotonic() - unopenable_since > UNOPENABLE_WAIT_S:
                raise SharingUnavailable(f"the owner named by {path} ({line.strip()}) is gone") from None
            time.sleep(0.05)


def _own(folder: Path, lock_fd: int):
    from pulsediff.engines.state import HostState
    from pulsediff.io.checkpoint import Checkpoint
    from pulsediff.ops.live import state_dict_digest

    import torch

    os.ftruncate(lock_fd, 0)  # a dead owner's line goes: followers wait for this state
    _sweep(Path(f"/proc/self/fd/{lock_fd}").resolve().parent)
    if not hasattr(os, "memfd_create"):
        raise SharingUnavailable("this system has no memfd_create")
    state_id = secrets.randbits(63)
    entries = _entries(folder)
    head, table, size = _layout(entries, state_id)
    memfd = os.memfd_create("pulsediff-host-state", os.MFD_CLOEXEC)
    try:
        os.ftruncate(memfd, size)
        mapping = mmap.mmap(memfd, size)
        mapping[:len(head)] = head
        start = _data_start(len(head) - _HEAD.size)
        with Checkpoint(folder) as ckpt:
            for (name, _, _, offset, nbytes) in table:
                if nbytes:
                    np.frombuffer(mapping, np.uint8, nbytes, start + offset)[:] = ckpt.raw_bytes(name)
        tensors = _tensors_over(mapping, table, start, torch)
        if not tensors:
            raise PulsediffError(f"{folder} holds no tensors")
        state = HostState(tensors, state_dict_digest(tensors), origin=str(folder))
    except BaseException:
        os.close(memfd)
        raise
    line = f"{os.getpid()} {memfd} {state_id}\n".encode()
    os.pwrite(lock_fd, line, 0)  # complete: followers may map it
    return state, Sharing(state_id, os.getpid(), True, memfd, lock_fd, mapping)


def _still_named(path: Path, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


STALE_S = 86400  # a rendezvous file this old, whose lock nobody holds, is an ended engine's


def _sweep(folder: Path) -> None:
    """Remove the rendezvous files of engines that ended long ago (one small file per engine start)."""
    now = time.time()
    for path in folder.glob("*.rendezvous"):
        try:
            if now - path.stat().st_mtime < STALE_S:
                continue
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path.unlink()  # while locked: a rank that opened it meanwhile finds it replaced (load_shared_host_state)
        except OSError:
            pass
        finally:
            os.close(fd)


def _follow(pid: int, fd: int, state_id: int):
    from pulsediff.engines.state import HostState

    import torch

    try:
        memfd = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    except PermissionError as exc:
        raise SharingUnavailable(f"/proc/{pid}/fd/{fd}: {exc.strerror}") from None
    try:
        if not os.readlink(f"/proc/self/fd/{memfd}").startswith("/memfd:pulsediff-host-state"):
            raise SharingUnavailable(f"/proc/{pid}/fd/{fd} is not a pulsediff host state")
        size = os.fstat(memfd).st_size
        magic, found_id, table_len = _HEAD.unpack(os.pread(memfd, _HEAD.size, 0).ljust(_HEAD.size, b"\0"))
        if magic != MAGIC or found_id != state_id or not 0 < table_len <= min(MAX_TABLE_BYTES, size):
            raise SharingUnavailable(f"/proc/{pid}/fd/{fd} is not the host state its rendezvous names")
        table = _checked_table(os.pread(memfd, table_len, _HEAD.size), size)
        mapping = mmap.mmap(memfd, size)
        tensors = _tensors_over(mapping, table, _data_start(table_len), torch)
    except BaseException:
        os.close(memfd)
        raise
    # The digest is the owner's to keep: a follower never decodes (HostState.digest None: unknown).
    return HostState(tensors, None, origin=f"rank pid {pid}'s shared host state"), Sharing(
        state_id, pid, False, memfd, mapping=mapping)


# -- an update's changes, from the owner to its followers ---------------------------------------------------

_CHANGES_HEAD = struct.Struct("<8sQ")  # magic, entries; then (tensor index, count or -1) per entry; positions


def publish_changes(sharing: Sharing, names: list[str], changes: dict) -> int:
    """Write `changes` (name -> int64 flat positions, or None: the whole tensor) to a memfd of their own and
    return its fd; the previous update's is closed."""
    close_changes(sharing)
    index = {name: i for i, name in enumerate(names)}
    rows = np.array([(index[name], -1 if p is None else len(p)) for name, p in changes.items()], np.int64)
    rows = rows.reshape(-1, 2)
    parts = [np.asarray(p, np.int64) for p in changes.values() if p is not None]
    positions = np.concatenate(parts) if parts else np.empty(0, np.int64)
    fd = os.memfd_create("pulsediff-changes", os.MFD_CLOEXEC)
    try:
        head = _CHANGES_HEAD.pack(CHANGES_MAGIC, len(rows))
        os.write(fd, head)
        os.write(fd, rows.tobytes())
        view = memoryview(positions.view(np.uint8))
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        raise
    sharing.changes_fd = fd
    return fd


def close_changes(sharing: Sharing) -> None:
    if sharing.changes_fd >= 0:
        os.close(sharing.changes_fd)
        sharing.changes_fd = -1


def read_changes(pid: int, fd: int, tensors: dict) -> dict:
    """A follower's read of the changes its owner published: checked against the state's tensors (indices,
    counts, positions in range, the sizes adding up); PulsediffError where anything does not."""
    names = list(tensors)
    where = f"/proc/{pid}/fd/{fd}"
    try:
        with open(where, "rb") as f:
            raw = bytearray(f.read())  # writable: the positions go to torch.from_numpy
    except OSError as exc:
        raise PulsediffError(f"the update's changes could not be read from its owner ({where}: {exc})") from None
    if len(raw) < _CHANGES_HEAD.size:
        raise PulsediffError(f"{where} holds no changes record")
    magic, count = _CHANGES_HEAD.unpack_from(raw)
    rows_end = _CHANGES_HEAD.size + 16 * count
    if magic != CHANGES_MAGIC or rows_end > len(raw):
        raise PulsediffError(f"{where} is not a changes record")
    rows = np.frombuffer(raw, np.int64, 2 * count, _CHANGES_HEAD.size).reshape(-1, 2)
    positions = np.frombuffer(raw, np.int64, (len(raw) - rows_end) // 8, rows_end)
    if (len(raw) - rows_end) % 8 or len(np.unique(rows[:, 0])) != count or (count and (
            rows[:, 0].min() < 0 or rows[:, 0].max() >= len(names) or rows[:, 1].min() < -1)):
        raise PulsediffError(f"{where}: a bad changes record")
    if int(np.maximum(rows[:, 1], 0).sum()) != positions.size:
        raise PulsediffError(f"{where}: the changes' counts do not add up to its positions")
    out, at = {}, 0
    for i, n in rows.tolist():
        name = names[i]
        if n < 0:
            out[name] = None
            continue
        part = positions[at:at + n]
        at += n
        if n and (part.min() < 0 or part.max() >= tensors[name].numel()):
            raise PulsediffError(f"{where}: a change of {name!r} lies outside it")
        out[name] = part
    return out
