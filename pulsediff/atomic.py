"""Outputs that appear whole or not at all.

Every file pulsediff writes goes to a temporary name in the destination's own
folder (so the final rename is atomic on POSIX), is fsynced, and only then
renamed into place. On any failure the temporary files are removed and the
destination is left as it was.
"""

from __future__ import annotations

import errno
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

from .errors import OutputError


def output_error(path: Path | str, exc: OSError) -> OutputError:
    if exc.errno == errno.ENOSPC:
        reason = "no space left on device"
    elif exc.errno == errno.EDQUOT:
        reason = "disk quota exceeded"
    else:
        reason = exc.strerror or str(exc)
    return OutputError(f"cannot write {path}: {reason}; nothing was written")


class StagedFiles:
    """A set of files written under temporary names and renamed together at commit."""

    def __init__(self) -> None:
        self._staged: list[tuple[Path, Path]] = []  # (temporary, final)

    @contextmanager
    def open(self, final: Path) -> Iterator[BinaryIO]:
        final = Path(final)
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".pulsediff-tmp", dir=final.parent)
        except OSError as exc:
            raise output_error(final, exc) from None
        self._staged.append((Path(tmp), final))
        try:
            os.fchmod(fd, _mode_for(final))
            with os.fdopen(fd, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            raise output_error(final, exc) from None

    def commit(self) -> None:
        try:
            for tmp, final in self._staged:
                os.replace(tmp, final)
            for parent in {final.parent for _, final in self._staged}:
                _fsync_dir(parent)
        except OSError as exc:
            raise output_error(self._staged[0][1], exc) from None
        self._staged.clear()

    def discard(self) -> None:
        for tmp, _ in self._staged:
            try:
                tmp.unlink()
            except FileNotFoundError:
                pass
        self._staged.clear()

    def __enter__(self) -> "StagedFiles":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.discard()


def _mode_for(final: Path) -> int:
    """mkstemp makes 0600 files: give the output the mode it replaces, or the umask's default."""
    try:
        return final.stat().st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


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
