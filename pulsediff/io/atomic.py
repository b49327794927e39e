"""Outputs that appear whole or not at all.

Every file pulsediff writes goes to a temporary name in the destination's own
folder (so the final rename is atomic on POSIX), is fsynced, and only then
renamed into place. On any failure the temporary files are removed and the
destination is left as it was.

Rebuilt checkpoints are written with O_DIRECT where the file system takes it
(`direct=True`): they are fsynced anyway, so the page cache buys nothing but
its cost, which on a VM is fresh memory faulted in from the host. Measured on
the 2-vCPU benchmark VM (scripts/bench_memory.py): 1 GiB written + fsynced in
0.60 s direct against 0.84 to 3.4 s buffered (median 1.74 s). The price: the
new file is not in the page cache, so the next reader reads it from disk.
Direct writes are staged through aligned buffers, several on their way to
the disk at once (`_DirectWriter`); buffered ones go out in 256 KiB pieces
(`_PieceWriter`: larger single writes cost six times as much on that VM).
PULSEDIFF_BUFFERED_WRITES=1 turns it off.

A process killed with SIGKILL cannot remove its temporary files, so their
names say who made them (`.NAME.<host>-<pid>.<random>.pulsediff-tmp`), and
the first write into a folder removes the ones whose writer is gone: same
host and no such process, or (another host's, or an older pulsediff's) not
modified for a day.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import tempfile
import time
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

from pulsediff.io import mapped
from pulsediff.errors import OutputError

# O_DIRECT wants buffers, offsets and lengths aligned to the logical block size;
# 4096 covers every common device. Staged in 8 MiB (a multiple of it) at a time,
# up to four stages on their way to the disk at once: one write in flight left
# the device idle between writes while the CPUs were busy (apply of the 1 GiB
# pair of docs/BENCHMARKS.md, alternating: 1.73 s with one, 1.41 s with four).
_DIRECT_BLOCK = 4096
_DIRECT_STAGE = 8 << 20
_DIRECT_IN_FLIGHT = 4

TMP_SUFFIX = ".pulsediff-tmp"
# Which machine wrote a temporary file: a pid means nothing on another host sharing the folder.
_HOST = f"{zlib.crc32(socket.gethostname().encode()):08x}"
_OWNED_TMP = re.compile(r"\.([0-9a-f]{8})-([0-9]{1,10})\.[^.]+" + re.escape(TMP_SUFFIX) + "$")
FOREIGN_TMP_AGE = 24 * 3600  # seconds before a temporary file whose writer we cannot ask about is stale
_swept: set[str] = set()  # folders already cleaned by this process


def check_inputs(inputs: "list | None") -> None:
    """Raise if one of `inputs` (checkpoints; None: every file mapped in the process) changed while read."""
    if inputs is None:
        mapped.check()
    else:
        for ckpt in inputs:
            ckpt.check_intact()


def output_error(path: Path | str, exc: OSError) -> OutputError:
    if exc.errno == errno.ENOSPC:
        reason = "no space left on device"
    elif exc.errno == errno.EDQUOT:
        reason = "disk quota exceeded"
    else:
        reason = exc.strerror or str(exc)
    return OutputError(f"cannot write {path}: {reason}; nothing was written")


class StagedFiles:
    """A set of files written under temporary names and renamed together at commit.

    `new_folder(path)` stages a whole folder that does not exist yet: its
    files are written inside a temporary folder, which is renamed to `path`
    at commit, so the folder appears complete or not at all.

    `inputs`: the checkpoints the outputs are made from; commit checks that none of them changed
    while it was read. () for outputs made from no mapped checkpoint (a manifest, a key): nothing
    to check. None, for callers that cannot say, checks every file mapped in the process (a change
    to another thread's input then refuses this output too).
    """

    def __init__(self, inputs: "list | None" = None) -> None:
        self._inputs = inputs
        self._staged: list[tuple[Path, Path]] = []  # (temporary, final)
        self._folders: dict[Path, Path] = {}  # final folder -> temporary folder
        self._removals: list[Path] = []  # files to delete at commit (an in-place folder's stale shards)

    def remove_at_commit(self, path: Path) -> None:
        self._removals.append(Path(path))

    def new_folder(self, final: Path) -> None:
        final = Path(final)
        try:
            remove_stale_temporaries(final.parent)
            tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(final), suffix=TMP_SUFFIX, dir=final.parent))
        except OSError as exc:
            raise output_error(final, exc) from None
        self._folders[final] = tmp
        self._staged.append((tmp, final))

    @contextmanager
    def open(self, final: Path, direct: bool = False) -> Iterator[BinaryIO]:
        """A file to write `final` through. `direct`: large output, write it with O_DIRECT where possible."""
        from pulsediff.runtime import interrupt

        final = Path(final)
        # Ctrl-C between creating the temporary and recording it would leave it behind: deferred.
        with interrupt.deferred():
            try:
                if final.parent in self._folders:  # inside a staged folder: the folder's rename is the commit
                    tmp = self._folders[final.parent] / final.name
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
                else:
                    final.parent.mkdir(parents=True, exist_ok=True)
                    remove_stale_temporaries(final.parent)
                    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(final), suffix=TMP_SUFFIX, dir=final.parent)
                    self._staged.append((Path(tmp), final))
            except OSError as exc:
                raise output_error(final, exc) from None
        try:
            interrupt.check()  # one that came meanwhile: raised now, the temporary recorded for discard
            os.fchmod(fd, _mode_for(final))
            direct = direct and _set_direct(fd)
        except OSError as exc:
            os.close(fd)
            raise output_error(final, exc) from None
        except BaseException:
            os.close(fd)
            raise
        # What the caller raises goes through as it is: a read error of its input is not a write
        # error of OUT. The writers turn their own failures into OutputErrors naming `final`.
        if direct:
            with _DirectWriter(fd, final) as f:
                yield f
                f.finish()
                _fsync(fd, final)
        else:
            try:
                yield _PieceWriter(fd, final)
                _fsync(fd, final)
            finally:
                os.close(fd)

    def commit(self) -> None:
        """Rename everything into place. Several changes in one existing folder (an in-place apply to a
        sharded checkpoint) are first written down in an intent record there, so that a kill between two
        renames is finished by the next pulsediff run that opens the folder (`finish_interrupted`)."""
        from pulsediff.runtime import interrupt

        interrupt.check()  # a Ctrl-C that a finalizer swallowed earlier stops us here, before anything is visible
        check_inputs(self._inputs)  # an input that shrank while read gave zeros: nothing made of it is published
        renames = [(tmp, final) for tmp, final in self._staged if final not in self._folders]
        by_folder: dict[Path, list] = {}
        for tmp, final in renames:
            by_folder.setdefault(final.parent, []).append((tmp.name, final.name))
        for path in self._removals:
            by_folder.setdefault(path.parent, [])
        journaled = [folder for folder, moves in by_folder.items()
                     if len(moves) + sum(p.parent == folder for p in self._removals) > 1]
        with interrupt.deferred():  # Ctrl-C waits until the intent records and every rename are made
            try:
                for folder in journaled:
                    _write_intent(folder, by_folder[folder], [p.name for p in self._removals if p.parent == folder])
            except OSError as exc:
                raise output_error(folder, exc) from None
            self._commit_renames(by_folder, journaled)
        for _, final in self._staged:
            interrupt.committed(str(final))
        self._staged.clear()
        self._removals.clear()
        interrupt.check()  # a Ctrl-C during the commit: raised now, with every output whole

    def _commit_renames(self, by_folder: dict, journaled: list) -> None:
        try:
            self._rename_all(by_folder, journaled)
        except OSError as exc:
            if journaled:  # the temporaries belong to the intent record now: the next run finishes the job
                self._staged.clear()
                raise OutputError(f"cannot finish writing {journaled[0]}: {exc.strerror or exc}; the next "
                                  "pulsediff run that opens it completes the update") from None
            raise output_error(self._staged[0][1], exc) from None

    def _rename_all(self, by_folder: dict, journaled: list) -> None:
        """The renames, removals and directory syncs that make the staged outputs visible."""
        for tmp, final in self._staged:
            if final in self._folders:
                os.chmod(tmp, _mode_for_folder())
                _fsync_dir(tmp)
                if final.exists():  # appeared while we worked: never replace a folder wholesale
                    raise FileExistsError(errno.EEXIST, "it appeared while pulsediff was writing", str(final))
                os.rename(tmp, final)
            else:
                os.replace(tmp, final)
        for path in self._removals:
            path.unlink(missing_ok=True)
        for parent in {final.parent for _, final in self._staged} | set(by_folder):
            _fsync_dir(parent)
        for folder in journaled:
            (folder / INTENT_NAME).unlink()
            _fsync_dir(folder)

    def discard(self) -> None:
        for tmp, final in self._staged:
            try:
                if final in self._folders:
                    shutil.rmtree(tmp, ignore_errors=True)
                else:
                    tmp.unlink()
            except FileNotFoundError:
                pass
        self._staged.clear()
        self._folders.clear()
        self._removals.clear()

    def __enter__(self) -> "StagedFiles":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.discard()


INTENT_NAME = ".pulsediff-intent.json"
MAX_INTENT_BYTES = 16 * 1024 * 1024


def _write_intent(folder: Path, moves: list[tuple[str, str]], removals: list[str]) -> None:
    """Durably record the renames and removals about to happen in `folder` (all files already fsynced)."""
    import json

    data = json.dumps({"version": 1, "rename": [list(m) for m in moves], "remove": removals}).encode()
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(folder / INTENT_NAME), suffix=TMP_SUFFIX, dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / INTENT_NAME)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(folder)


def finish_interrupted(folder: Path) -> bool:
    """Complete an update of `folder` that a killed pulsediff left half done (see StagedFiles.commit).

    Every file it names was written and verified before the record was, so
    finishing is always right; it is idempotent, so a kill while finishing is
    finished by the next run. Returns whether there was anything to finish.
    Raises OutputError when the record is not ours or cannot be carried out.
    """
    from pulsediff.io import strict_json

    intent = Path(folder) / INTENT_NAME
    try:
        with open(intent, "rb") as f:
            raw = f.read(MAX_INTENT_BYTES + 1)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise OutputError(f"cannot read {intent}: {exc.strerror or exc}") from None
    try:
        record = strict_json.loads(raw, max_depth=4)
        moves, removals = record["rename"], record["remove"]
        ok = (len(raw) <= MAX_INTENT_BYTES and record.get("version") == 1 and isinstance(moves, list)
              and isinstance(removals, list)
              and all(isinstance(m, list) and len(m) == 2 and _is_temp_name(m[0]) and _is_plain(m[1]) for m in moves)
              and all(_is_plain(n) for n in removals))
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise OutputError(f"{intent} is not a pulsediff intent record; remove it by hand if you know what it is")
    try:
        for tmp, final in moves:
            if (Path(folder) / tmp).exists():
                os.replace(Path(folder) / tmp, Path(folder) / final)
        for name in removals:
            (Path(folder) / name).unlink(missing_ok=True)
        _fsync_dir(Path(folder))
        intent.unlink()
        _fsync_dir(Path(folder))
    except OSError as exc:
        raise OutputError(f"an update of {folder} was interrupted and cannot be finished: "
                          f"{exc.strerror or exc}") from None
    return True


def _is_plain(name: object) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name and "\0" not in name


def _is_temp_name(name: object) -> bool:
    return _is_plain(name) and name.startswith(".") and name.endswith(TMP_SUFFIX)


def temp_prefix(final: Path) -> str:
    """The start of a temporary name for `final`: hidden, and tagged with this host and process."""
    return f".{final.name}.{_HOST}-{os.getpid()}."


def remove_stale_temporaries(folder: Path, *, force: bool = False) -> list[Path]:
    """Remove temporary files in `folder` left by pulsediff runs that were killed (once per process
    and folder unless `force`). Returns what was removed; a file still being written is never touched."""
    key = os.path.abspath(folder)
    if key in _swept and not force:
        return []
    if os.path.exists(os.path.join(folder, INTENT_NAME)):
        return []  # its temporaries are an interrupted update's new files: finish_interrupted's to use
    _swept.add(key)
    removed = []
    try:
        names = [n for n in os.listdir(folder) if n.startswith(".") and n.endswith(TMP_SUFFIX)]
    except OSError:
        return []
    for name in names:
        path = Path(folder) / name
        if _is_stale(name, path):
            try:
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)  # a staged folder (StagedFiles.new_folder)
                else:
                    path.unlink()
                removed.append(path)
            except OSError:
                pass  # gone already, or not ours to remove
    return removed


def _is_stale(name: str, path: Path) -> bool:
    owner = _OWNED_TMP.search(name)
    if owner and owner.group(1) == _HOST:
        pid = int(owner.group(2))
        if pid == os.getpid():
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except (OSError, OverflowError):  # alive (another user's), or no pid this system can have
            return False
        return False
    try:
        return time.time() - path.lstat().st_mtime > FOREIGN_TMP_AGE
    except OSError:
        return False


def _mode_for(final: Path) -> int:
    """mkstemp makes 0600 files: give the output the mode it replaces, or the umask's default."""
    try:
        return final.stat().st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _mode_for_folder() -> int:
    """mkdtemp makes 0700 folders: give a staged folder the umask's default."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o777 & ~umask


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on folders; the rename itself is still atomic
    finally:
        os.close(fd)


def _set_direct(fd: int) -> bool:
    """Turn on O_DIRECT for `fd`; False where the platform, the file system or the user says no."""
    if not hasattr(os, "O_DIRECT") or os.environ.get("PULSEDIFF_BUFFERED_WRITES", "") not in ("", "0"):
        return False
    import fcntl

    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        return True
    except OSError:  # tmpfs and some others refuse it
        return False


# Buffered writes go to the page cache in pieces of this size: on the benchmark VM
# (Linux 6.18, ext4) one write() of 1 MiB or more cost 1.5 s per GiB, of 128-256
# KiB 0.21-0.25 s (the kernel's page-cache path for large writes is the slow part).
_BUFFERED_PIECE = 256 << 10


def _fsync(fd: int, final: Path) -> None:
    try:
        os.fsync(fd)
    except OSError as exc:
        raise output_error(final, exc) from None


class _PieceWriter:
    """Unbuffered sequential writes to a descriptor without O_DIRECT (`_pwrite_all` cuts them in pieces)."""

    def __init__(self, fd: int, final: Path):
        self.fd = fd
        self.final = final  # what a failed write names
        self._offset = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        try:
            _pwrite_all(self.fd, view, self._offset)
        except OSError as exc:
            raise output_error(self.final, exc) from None
        self._offset += len(view)
        return len(view)


class _DirectWriter:
    """Sequential writes through aligned staging buffers, for an O_DIRECT file descriptor.

    Each full stage goes out on an I/O thread (pwrite at its offset) while the
    caller fills the next, up to `_DIRECT_IN_FLIGHT` at once; `finish`
    writes the last partial block zero-padded, waits for every write and
    truncates the file back to its true length. A write error surfaces at a
    later `write` or at `finish`. A file system that accepts the flag but
    refuses the first write (EINVAL) gets the same bytes without O_DIRECT.
    """

    def __init__(self, fd: int, final: Path):
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor

        from pulsediff.io.memory import fresh_buffer  # numpy: only the large-output path needs it

        self.fd = fd
        self.final = final  # what a failed write names
        self._fresh = fresh_buffer
        self._pending = deque()  # (future, stage), oldest first
        try:
            self.buf = fresh_buffer(_DIRECT_STAGE)  # page-aligned: an anonymous map
            self._pool = ThreadPoolExecutor(max_workers=_DIRECT_IN_FLIGHT, thread_name_prefix="pulsediff-io")
        except BaseException:
            os.close(fd)  # __exit__ will not run: the writer owns the descriptor from here
            raise
        self.fill = 0
        self.size = 0
        self._offset = 0  # where the stage being filled goes in the file

    def write(self, data) -> int:
        import numpy as np

        src = np.frombuffer(memoryview(data).cast("B"), np.uint8)
        done = 0
        while done < src.size:
            n = min(src.size - done, _DIRECT_STAGE - self.fill)
            self.buf[self.fill : self.fill + n] = src[done : done + n]
            self.fill += n
            done += n
            if self.fill == _DIRECT_STAGE:
                try:
                    self._send(_DIRECT_STAGE)  # may report an earlier stage's failed write
                except OSError as exc:
                    raise output_error(self.final, exc) from None
        self.size += src.size
        return src.size

    def _send(self, length: int, last: bool = False) -> None:
        """Hand the filled stage to an I/O thread and go on in a free one (the oldest, once written)."""
        future = self._pool.submit(_pwrite_all, self.fd, memoryview(self.buf[:length]), self._offset)
        self._pending.append((future, self.buf))
        self._offset += length
        self.fill = 0
        if last:
            return
        if len(self._pending) < _DIRECT_IN_FLIGHT:
            self.buf = self._fresh(_DIRECT_STAGE)
        else:
            future, self.buf = self._pending.popleft()
            future.result()

    def finish(self) -> None:
        try:
            if self.fill:
                tail = self.fill
                padded = -(-tail // _DIRECT_BLOCK) * _DIRECT_BLOCK
                self.buf[tail:padded] = 0
                self._send(padded, last=True)
            while self._pending:
                future, _ = self._pending.popleft()
                future.result()
            os.ftruncate(self.fd, self.size)
        except OSError as exc:
            raise output_error(self.final, exc) from None

    def __enter__(self) -> "_DirectWriter":
        return self

    def __exit__(self, *exc) -> None:
        from concurrent.futures import wait

        try:
            # No write may still be in flight when the descriptor closes (it could be reused).
            futures = [future for future, _ in self._pending]
            while futures:
                try:
                    wait(futures)
                    break
                except BaseException:  # noqa: BLE001 - even a second Ctrl-C waits
                    pass
            self._pool.shutdown(wait=True)
        finally:
            os.close(self.fd)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """All of `view` at `offset` (several threads may write one file, each its own range): in one
    write through O_DIRECT, else in `_BUFFERED_PIECE` pieces. A descriptor that took O_DIRECT but
    refuses its first write (EINVAL) loses the flag and gets the pieces."""
    buffered = not _is_direct(fd)
    written = 0
    while written < len(view):
        piece = _BUFFERED_PIECE if buffered else len(view)
        try:
            written += os.pwrite(fd, view[written:written + piece], offset + written)
        except OSError as exc:
            if exc.errno != errno.EINVAL or buffered:
                raise
            _clear_direct(fd)  # another stage's thread may have done it already
            buffered = True


def _is_direct(fd: int) -> bool:
    if not hasattr(os, "O_DIRECT"):
        return False
    import fcntl

    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def _clear_direct(fd: int) -> None:
    import fcntl

    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if flags & os.O_DIRECT:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
