"""Checks a command makes before any work: where its output goes.

Like zstd and rsync, pulsediff does not replace an existing output unless told
to (-f/--force), does not create missing folders for it, and does not pour
binary onto a terminal. The library refuses an existing output too (unless
force=True); the command line checks here as well, before it loads anything,
so that a refusal costs nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pulsediff.errors import CheckpointNotFoundError, InvalidPatchError, OutputError, OutputExistsError


def check_output(path: str | Path, *, force: bool) -> None:
    """OUT may be written: it does not exist (or `force`), and its folder does."""
    if str(path) == "-":
        check_stdout_for_binary(force=force)
        return
    out = Path(path)
    if (out.exists() or out.is_symlink()) and not force:
        raise OutputExistsError(str(out))
    parent = out.parent
    if not parent.exists():
        raise OutputError(f"cannot write {out}: folder {parent} does not exist")
    if not parent.is_dir():
        raise OutputError(f"cannot write {out}: {parent} is not a folder")


def check_stdout_for_binary(*, force: bool) -> None:
    if not force and sys.stdout.isatty():
        raise OutputError("refusing to write a binary patch to a terminal; redirect or pipe stdout "
                          "(-o - | pulsediff apply ...), or give -f/--force")


def check_patch_paths(patches: list) -> None:
    """Patch arguments name files (or - for stdin): a folder or a missing file is said as such."""
    for p in patches:
        if str(p) == "-":
            continue
        path = Path(p)
        if path.is_dir():
            raise InvalidPatchError(f"{path} is a folder, not a patch file")
        if not path.exists():
            raise CheckpointNotFoundError(str(path), "patch")
        _refuse_checkpoint_as_patch(path)


def checkpoint_kind(path: Path) -> str | None:
    """"safetensors" or "pickle" when the file starts like a checkpoint of that kind, else None
    (unreadable included: reading it as a patch will say what is wrong)."""
    from pulsediff.io.checkpoint import looks_like_pickle, looks_like_safetensors

    try:
        with open(path, "rb") as f:
            prefix = f.read(9)
    except OSError:
        return None
    if looks_like_safetensors(prefix):
        return "safetensors"
    return "pickle" if looks_like_pickle(prefix) else None


def _refuse_checkpoint_as_patch(path: Path) -> None:
    """A checkpoint where a patch belongs (apply's arguments swapped, say): say so, not "bad magic bytes"."""
    if checkpoint_kind(path) == "safetensors":
        raise InvalidPatchError(f"{path} is a checkpoint, not a patch; the base comes first: "
                                f"pulsediff apply BASE PATCH -o OUT")
