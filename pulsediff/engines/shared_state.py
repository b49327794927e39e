"""One host state per machine: the ranks of an engine on one machine share one copy of the checkpoint.

Under tensor or pipeline parallelism every rank of a vLLM engine needs the checkpoint in host memory to
decode patches against (engines/state.py). A copy per rank costs the model's size times the ranks (a 70B
model at TP 8: 1.1 TB) and the same decode done once per rank. Here the first rank to start on a machine
(the owner) reads the checkpoint into an anonymous shared-memory file (memfd, sealed at its size) and
decodes every update into it; the engine's other ranks on that machine (followers) map the same pages and
load their part of the model from them. The ranks still agree on every update (engines/agreement.py): a
follower reports what its owner reached, so that all take the update or none does.

Finding each other needs no collective call (the state is read at the engine's start, on a thread of
its own, where a collective would race vLLM's own): the ranks of one engine compute the same key
(`replica_key`: the model folder, the process that started them, the replica's block of global ranks,
`replica_ranks`) and meet at a rendezvous file of that key in a folder of this user's. Whoever takes
the file's lock owns the state; the kernel releases the lock when the owner's files close (its engine
released, `release`, or its process ended; a child forked without exec would keep it), so a crashed
owner leaves none behind. The owner writes "pid fd id" to the file once its state is complete; a
follower checks what /proc/<pid>/fd/<fd> is before opening it, then its seals, header (magic and id)
and table before mapping a tensor. The memfd's memory goes back once no rank maps it.

Anything that keeps a rank from sharing (no sealed memfd, no flock, /proc closed to it, a table that
does not check) makes it read a private copy, as before, and say why: sharing saves memory, it never
decides what the weights are.

The changes of an update reach followers the same way: the owner writes them (name -> flat positions),
under the state's id and the update's target digest, to a memfd of their own whose fd its agreement
record carries (`publish_changes`, `read_changes`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import mmap
import os
import re
import secrets
import stat
import struct
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pulsediff.errors import PulsediffError

__all__ = ["Sharing", "SharingUnavailable", "load_shared_host_state", "replica_key", "replica_ranks",
           "publish_changes", "read_changes", "release"]

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
    owner: bool
    memfd: int  # the state's memfd (owner) or this rank's own open of it (follower)
    lock_fd: int = -1  # the rendezvous file, locked for the owner's lifetime
    mapping: mmap.mmap | None = field(default=None, repr=False)
    changes_fd: int = -1  # the owner's memfd of the last update's changes (publish_changes)


def replica_key(model_folder: str, ppid: int, ranks: list[int], extra: str = "") -> str:
    """A name the ranks of one engine replica on one machine compute alike, and other engines do not."""
    text = json.dumps([os.path.realpath(model_folder), os.getuid(), ppid, sorted(ranks), extra])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def replica_ranks(rank: int, coordinators: list) -> list[int] | None:
    """The global ranks of this rank's model replica: vLLM lays the world out as (data-parallel, pipeline,
    context, tensor) with the tensor rank fastest, so a replica is the aligned block of pp x pcp x tp ranks.
    None where the groups' ranks do not fall in that block (another layout: no sharing)."""
    size = 1
    for c in coordinators:
        size *= c.world_size
    block = list(range(rank // size * size, rank // size * size + size))
    if not all(int(r) in block for c in coordinators for r in c.ranks):
        return None
    return block


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


def load_shared_host_state(folder, key: str, waiting=None):
    """(HostState, Sharing): this rank's view of the machine's one host state of `key` (owner or
    follower). SharingUnavailable (the caller reads a private copy) where it cannot share; the
    checkpoint's own errors (PulsediffError) as they are. `waiting(seconds, holder)` is called every
    WAIT_NOTE_S while a follower waits for its owner to finish reading the checkpoint."""
    path = rendezvous_folder() / f"{key}.rendezvous"
    while True:
        try:
            lock_fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
        except OSError as exc:
            raise SharingUnavailable(f"{path}: {exc.strerror or exc}") from None
        try:
            found = _meet(Path(folder), path, lock_fd, waiting)
        except PulsediffError:  # the checkpoint's own (some are OSErrors too): as they are
            os.close(lock_fd)
            raise
        except OSError as exc:  # flock or memfd refused, /proc closed: sharing is off, a private copy is not
            os.close(lock_fd)
            raise SharingUnavailable(f"{type(exc).__name__}: {exc}") from None
        except BaseException:
            os.close(lock_fd)
            raise
        if found is not None:
            if not found[1].owner:
                os.close(lock_fd)  # only the owner keeps it (its lock)
            return found
        os.close(lock_fd)  # swept away as we opened it: meet at the new file


WAIT_NOTE_S = 30.0
_LINE = re.compile(rb"([1-9][0-9]{0,9}) ([0-9]{1,9}) ([1-9][0-9]{0,18})\n")  # pid, fd, state id: complete


def _meet(folder: Path, path: Path, lock_fd: int, waiting):
    """Own the state (the lock is free) or follow its owner; None where the file was replaced meanwhile."""
    info = os.fstat(lock_fd)
    if info.st_uid != os.getuid() or not stat.S_ISREG(info.st_mode):
        raise SharingUnavailable(f"{path} is not a file of this user's")
    started = time.monotonic()
    noted = unopenable_since = None
    while True:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass  # an owner is alive: follow it once its state is complete
        else:
            # A failure here closes the file (the caller), and its lock goes to a waiting follower.
            return _own(folder, path, lock_fd) if _still_named(path, lock_fd) else None
        line = os.pread(lock_fd, 200, 0)
        found = _LINE.fullmatch(line)
        if found is None:  # still loading ("loading PID"), or a line written as we read it
            waited = time.monotonic() - started
            if waiting is not None and waited >= (noted or 0) + WAIT_NOTE_S:
                noted = waited
                waiting(waited, line.decode("ascii", "replace").strip())
            time.sleep(0.05)
            continue
        pid, fd, state_id = (int(x) for x in found.groups())
        try:
            return _follow(pid, fd, state_id)
        except FileNotFoundError:  # an old owner's line, before its successor's truncation
            unopenable_since = unopenable_since or time.monotonic()
            if time.monotonic() - unopenable_since > UNOPENABLE_WAIT_S:
                raise SharingUnavailable(f"the owner named by {path} ({line.strip()}) is gone") from None
            time.sleep(0.05)


SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW if hasattr(fcntl, "F_SEAL_SHRINK") else 0


def _own(folder: Path, path: Path, lock_fd: int):
    from pulsediff.engines.state import host_entries, host_state_over
    from pulsediff.io.checkpoint import Checkpoint

    import torch

    os.ftruncate(lock_fd, 0)  # a dead owner's line goes: followers wait for this state
    os.pwrite(lock_fd, f"loading {os.getpid()}".encode(), 0)  # (no newline: not a complete line)
    _sweep(path.parent)
    if not hasattr(os, "memfd_create") or not SEALS:
        raise SharingUnavailable("this system has no sealed memfd")
    state_id = secrets.randbits(63) | 1  # never 0, which marks a private state
    with Checkpoint(folder) as ckpt:
        head, table, size = _layout(host_entries(ckpt, folder), state_id)
        memfd = os.memfd_create("pulsediff-host-state", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(memfd, size)
            fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, SEALS)  # its size is fixed: a follower's pages never vanish
            mapping = mmap.mmap(memfd, size)
            mapping[:len(head)] = head
            start = _data_start(len(head) - _HEAD.size)
            for (name, _, _, offset, nbytes) in table:
                if nbytes:
                    np.frombuffer(mapping, np.uint8, nbytes, start + offset)[:] = ckpt.raw_bytes(name)
            state = host_state_over(_tensors_over(mapping, table, start, torch), folder)
        except BaseException:
            os.close(memfd)
            raise
    line = f"{os.getpid()} {memfd} {state_id}\n".encode()
    os.ftruncate(lock_fd, 0)
    os.pwrite(lock_fd, line, 0)  # complete: followers may map it
    return state, Sharing(state_id, True, memfd, lock_fd, mapping)


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

    where = f"/proc/{pid}/fd/{fd}"
    try:
        target = os.readlink(where)  # what it is, before opening it (a stale line's fd may be anything)
    except PermissionError as exc:
        raise SharingUnavailable(f"{where}: {exc.strerror}") from None
    if not target.startswith("/memfd:pulsediff-host-state"):
        raise SharingUnavailable(f"{where} is not a pulsediff host state")
    memfd = os.open(where, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    try:
        if not os.readlink(f"/proc/self/fd/{memfd}").startswith("/memfd:pulsediff-host-state"):
            raise SharingUnavailable(f"{where} is not a pulsediff host state")
        size = os.fstat(memfd).st_size
        if fcntl.fcntl(memfd, fcntl.F_GET_SEALS) & SEALS != SEALS:
            raise SharingUnavailable(f"{where} is not sealed at its size")
        magic, found_id, table_len = _HEAD.unpack(os.pread(memfd, _HEAD.size, 0).ljust(_HEAD.size, b"\0"))
        if magic != MAGIC or found_id != state_id or not 0 < table_len <= min(MAX_TABLE_BYTES, size - _HEAD.size):
            raise SharingUnavailable(f"{where} is not the host state its rendezvous names")
        raw = os.pread(memfd, table_len, _HEAD.size)
        if len(raw) != table_len:
            raise SharingUnavailable(f"{where}: its table is cut short")
        table = _checked_table(raw, size)
        mapping = mmap.mmap(memfd, size)
        tensors = _tensors_over(mapping, table, _data_start(table_len), torch)
    except BaseException:
        os.close(memfd)
        raise
    # The digest is the owner's to keep: a follower never decodes (HostState.digest None: unknown).
    return HostState(tensors, None, origin=f"rank pid {pid}'s shared host state"), Sharing(
        state_id, False, memfd, mapping=mapping)


def release(sharing: Sharing) -> None:
    """Close this rank's files of the shared state (the owner's lock goes with them). Its tensors stay
    valid while the mapping lives; the memory goes back once no rank maps it."""
    close_changes(sharing)
    for fd in (sharing.memfd, sharing.lock_fd):
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
    sharing.memfd = sharing.lock_fd = -1


# -- an update's changes, from the owner to its followers ---------------------------------------------------

# magic, the state's id, the target digest the changes lead to (ASCII, zero-padded), entries; then (tensor index,
# count or -1: the whole tensor) per entry, then every entry's positions (int64) in entry order
_CHANGES_HEAD = struct.Struct("<8sQ96sQ")


def publish_changes(sharing: Sharing, names: list[str], changes: dict, digest: str) -> int:
    """Write `changes` (name -> int64 flat positions, or None: the whole tensor) of the update to `digest` to
    a memfd of their own and return its fd; the previous update's is closed."""
    close_changes(sharing)
    index = {name: i for i, name in enumerate(names)}
    rows = np.array([(index[name], -1 if p is None else len(p)) for name, p in changes.items()], np.int64)
    fd = os.memfd_create("pulsediff-changes", os.MFD_CLOEXEC)
    try:
        _write_all(fd, _CHANGES_HEAD.pack(CHANGES_MAGIC, sharing.state_id, digest.encode("ascii")[:96], len(rows)))
        _write_all(fd, rows.reshape(-1, 2).tobytes())
        for positions in changes.values():  # one part at a time: no second copy of them all
            if positions is not None:
                _write_all(fd, np.ascontiguousarray(positions, np.int64).view(np.uint8))
    except BaseException:
        os.close(fd)
        raise
    sharing.changes_fd = fd
    return fd


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


def close_changes(sharing: Sharing) -> None:
    if sharing.changes_fd >= 0:
        os.close(sharing.changes_fd)
        sharing.changes_fd = -1


def read_changes(pid: int, fd: int, tensors: dict, state_id: int, digest: str) -> dict:
    """A follower's read of the changes its owner published for the update to `digest` of the state
    `state_id`: checked against the state's tensors (indices, counts, positions in range, the sizes adding
    up); PulsediffError where anything does not."""
    names = list(tensors)
    where = f"/proc/{pid}/fd/{fd}"
    try:
        if not os.readlink(where).startswith("/memfd:pulsediff-changes"):
            raise PulsediffError(f"{where} is not an update's changes")
        handle = os.open(where, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
        try:
            size = os.fstat(handle).st_size
            raw = bytearray(size)  # writable: the positions go to torch.from_numpy
            got = os.preadv(handle, [raw], 0) if size else 0
        finally:
            os.close(handle)
    except OSError as exc:
        raise PulsediffError(f"the update's changes could not be read from its owner ({where}: {exc})") from None
    if got != size or size < _CHANGES_HEAD.size:
        raise PulsediffError(f"{where} holds no changes record")
    magic, found_state, found_digest, count = _CHANGES_HEAD.unpack_from(raw)
    rows_end = _CHANGES_HEAD.size + 16 * count if count <= size else size + 1
    if magic != CHANGES_MAGIC or rows_end > size or (size - rows_end) % 8:
        raise PulsediffError(f"{where} is not a changes record")
    if found_state != state_id or found_digest.rstrip(b"\0").decode("ascii", "replace") != digest:
        raise PulsediffError(f"{where} holds the changes of another update than the one agreed on")
    rows = np.frombuffer(raw, np.int64, 2 * count, _CHANGES_HEAD.size).reshape(-1, 2)
    positions = np.frombuffer(raw, np.int64, (size - rows_end) // 8, rows_end)
    if len(np.unique(rows[:, 0])) != count or (count and (rows[:, 0].min() < 0 or rows[:, 0].max() >= len(names))):
        raise PulsediffError(f"{where}: a bad changes record")
    out, at = {}, 0
    for i, n in rows.tolist():
        name = names[i]
        if n < -1 or n > tensors[name].numel() or at + n > positions.size:
            raise PulsediffError(f"{where}: a bad changes record (the count of {name!r})")
        if n == -1:
            out[name] = None
            continue
        part = positions[at:at + n]
        at += n
        if n and (part.min() < 0 or part.max() >= tensors[name].numel()):
            raise PulsediffError(f"{where}: a change of {name!r} lies outside it")
        out[name] = part
    if at != positions.size:
        raise PulsediffError(f"{where}: the changes' counts do not add up to its positions")
    return out
