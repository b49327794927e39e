"""Where a series lives: a local folder, an S3 bucket, or any HTTP(S) server.

`publish` and `catch_up` (publish.py, catch_up.py) talk to a `Store` and never ask which
kind it is. The contract:

- `read_manifest()`: the manifest through the strict reader (format/manifest.py),
  its 64 MiB bound enforced while the bytes arrive, or None when there is none;
  `read_manifest_bytes()` and `read_signature()` give the bytes a signed
  series' reader verifies before it parses anything (signing.py).
- Publishing: patches are written to `staging()` under temporary names, then
  `commit` makes them visible under their real names, immutably; then
  `save_manifest` replaces the manifest, last (its signature, when given,
  just before it); `delete` removes objects the manifest no longer names
  (`--keep`).
- Catching up: `fetch(entries, check, progress)` makes each entry's file
  readable at `path(name)` and returns {name: what is wrong} for those that
  are missing, incomplete or fail `check` (catch_up.py's size, checksum and
  header test). `forget(names)` says catch-up is done with them.

`Folder` is the local case: nothing to fetch, files are read in place.
`ObjectStoreSource` (remote.py) is the remote case: S3 and HTTP(S), with a
download cache. `open_store` (remote.py) turns a command line's DEST or
SOURCE into one or the other.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from pulsediff.errors import OutsideLinkError
from pulsediff.format.manifest import (MANIFEST, MAX_MANIFEST_BYTES, Entry, Manifest, outside, parse_manifest,
                                       read_small_file, within)
from pulsediff.runtime.progress import SILENT, Progress

Check = Callable[[Path, Entry], "str | None"]


class Store:
    """A series' home. Subclasses: Folder, ObjectStoreSource."""

    location: str  # as the user gave it, for messages
    identity: str  # the same for every spelling of this store: a signed series' rollback record is kept under it
    remote = False

    def where(self, name: str) -> str:
        """The file's path or URL, for messages and `catch-up --plan`."""
        raise NotImplementedError

    def shown(self, name: str) -> str:
        """Where a file of the series is, for messages: its URL, or its path (`where` gives a folder's names
        relative, for `rsync --files-from`)."""
        return self.where(name) if self.remote else str(Path(self.location) / name)

    def read_manifest(self) -> Manifest | None:
        data = self.read_manifest_bytes()
        return None if data is None else parse_manifest(data, self.shown(MANIFEST))

    def read_manifest_bytes(self) -> bytes | None:
        raise NotImplementedError

    def read_signature(self) -> bytes | None:
        """The manifest's detached signature (signing.SIGNATURE_NAME), None when there is none."""
        raise NotImplementedError

    # -- publishing
    def writable(self) -> None:
        """Raise UsageError if this store cannot be published to."""

    def staging(self) -> Path:
        """A local folder to write files in before `commit`."""
        raise NotImplementedError

    def commit(self, staged: list[tuple[Path, str]]) -> None:
        """Make each staged temporary file visible as its name; the temporaries are gone afterwards."""
        raise NotImplementedError

    def save_manifest(self, manifest: Manifest, signature: bytes | None = None) -> None:
        """Replace the manifest with `manifest.to_bytes()`; `signature` (its detached signature) goes first."""
        raise NotImplementedError

    def save_signature(self, signature: bytes) -> None:
        """Replace only the manifest's detached signature (a publisher re-signing the manifest it finds)."""
        raise NotImplementedError

    def delete(self, names: list[str]) -> None:
        raise NotImplementedError

    # -- catching up
    def known_problems(self, entries: list[Entry]) -> dict[str, str]:
        """What is wrong with files, found without fetching anything (before the first search)."""
        return {}

    def fetch(self, entries: list[Entry], check: Check, progress: Progress = SILENT) -> dict[str, str]:
        raise NotImplementedError

    def path(self, name: str) -> Path:
        raise NotImplementedError

    def forget(self, names: list[str], listed: set[str]) -> None:
        """Catch-up applied `names`; `listed` is every file the manifest names."""

    def close(self) -> None:
        pass


# -- a local folder ------------------------------------------------------------------


class Folder(Store):
    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.location = str(folder)
        self.identity = str(self.folder.resolve())

    def where(self, name: str) -> str:
        return name  # relative: `catch-up --plan | rsync --files-from=-` reads names

    # Like rsync's --safe-links: a file of the folder that is a symbolic link out of it is refused (one
    # that stays inside is followed). Checked by name before a file is opened, and again on the
    # descriptor (format.manifest.outside).

    def root(self) -> str:
        return os.path.realpath(self.folder)

    def read_manifest_bytes(self) -> bytes | None:
        return read_small_file(self.folder / MANIFEST, MAX_MANIFEST_BYTES, root=self.root())

    def read_signature(self) -> bytes | None:
        from pulsediff.series.signing import MAX_SIGNATURE_BYTES, SIGNATURE_NAME

        return read_small_file(self.folder / SIGNATURE_NAME, MAX_SIGNATURE_BYTES, root=self.root())

    def staging(self) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        return self.folder  # a rename in the same folder is atomic

    def commit(self, staged: list[tuple[Path, str]]) -> None:
        for tmp, name in staged:
            os.replace(tmp, self.folder / name)

    def save_manifest(self, manifest: Manifest, signature: bytes | None = None) -> None:
        if signature is not None:  # first: a reader between the two renames sees a pair that does not match yet
            self.save_signature(signature)
        manifest.save(self.folder)

    def save_signature(self, signature: bytes) -> None:
        from pulsediff.io.atomic import StagedFiles
        from pulsediff.series.signing import SIGNATURE_NAME

        with StagedFiles(inputs=()) as staged:  # made of no mapped checkpoint
            with staged.open(self.folder / SIGNATURE_NAME) as f:
                f.write(signature)
            staged.commit()

    def delete(self, names: list[str]) -> None:
        for name in names:
            (self.folder / name).unlink(missing_ok=True)

    def known_problems(self, entries: list[Entry]) -> dict[str, str]:
        return {e.file: why for e in entries if (why := size_problem(self.folder / e.file, e)) is not None}

    def fetch(self, entries: list[Entry], check: Check, progress: Progress = SILENT) -> dict[str, str]:
        root = self.root()
        for e in entries:
            self._refuse_outside(self.folder / e.file, root)
        return {e.file: why for e in entries if (why := check(self.folder / e.file, e)) is not None}

    @staticmethod
    def _refuse_outside(path: Path, root: str) -> None:
        real = os.path.realpath(path)
        if not within(real, root):
            raise OutsideLinkError(str(path), real)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return  # missing or unreadable: the check says so
        try:
            real = outside(fd, path, root)
        finally:
            os.close(fd)
        if real is not None:
            raise OutsideLinkError(str(path), real)

    def path(self, name: str) -> Path:
        return self.folder / name


def size_problem(path: Path, e: Entry) -> str | None:
    """A missing or half-fetched file, found by one stat."""
    try:
        size = path.stat().st_size if path.is_file() else None
    except OSError:
        size = None
    if size is None:
        return "missing"
    return f"{size} bytes, the manifest says {e.bytes}" if size != e.bytes else None


# -- S3 and HTTP(S) through obstore ---------------------------------------------------------------
