"""Checks a command makes before any work: where its output goes.

Like zstd and rsync, pulsediff does not replace an existing output unless told
to (-f/--force), does not create missing folders for it, and does not pour
binary onto a terminal. The library refuses an existing output too (unless
force=True); the command line checks here as well, before it loads anything,
so that a refusal costs nothing. Except apply's: whether its OUT is to be a
file or a folder is in the patch's header, and an OUT of the wrong kind is
refused first, whatever -f (which would not help), so the library refuses
an existing OUT once it has read the header (still before any work).
"""

from __future__ import annotations

import sys
from pathlib import Path

from pulsediff.errors import (CheckpointNotFoundError, InvalidPatchError, OutputError, OutputExistsError, UsageError,
                              refuse_folder_for_file)


def check_output(path: str | Path, *, force: bool, single_file: tuple[str, str] | None = None) -> None:
    """OUT may be written: it does not exist (or `force`), and its folder does.

    `single_file`: (why, example file name) where OUT is one file, a patch (errors.refuse_folder_for_file):
    a folder there is refused as such, whatever `force`, not with advice to give -f that would fail.
    """
    if str(path) == "-":
        check_stdout_for_binary(force=force)
        return
    if single_file is not None:
        refuse_folder_for_file(path, *single_file)
    out = Path(path)
    if (out.exists() or out.is_symlink()) and not force:
        raise OutputExistsError(str(out))
    check_output_folder(out)


def check_output_folder(out: Path) -> None:
    """OUT's folder exists (pulsediff does not create it)."""
    parent = out.parent
    if not parent.exists():
        raise OutputError(f"cannot write {out}: folder {parent} does not exist")
    if not parent.is_dir():
        raise OutputError(f"cannot write {out}: {parent} is not a folder")


def check_stdout_for_binary(*, force: bool) -> None:
    if not force and sys.stdout.isatty():
        raise OutputError("refusing to write a binary patch to a terminal; redirect or pipe stdout "
                          "(-o - | pulsediff apply ...), or give -f/--force")


def check_patch_paths(patches: list, base: Path | None = None) -> None:
    """Patch arguments name files (or - for stdin): a folder or a missing file is said as such.

    `base` (apply's first argument): a patch there, and a model folder among the patches, are apply's
    arguments swapped, and said so.
    """
    for p in patches:
        if str(p) == "-":
            continue
        path = Path(p)
        if path.is_dir():
            if base is not None and is_patch_file(base) and any(path.glob("*.safetensors")):
                raise UsageError(f"{path} is a model folder and {base} a patch; the base comes first: "
                                        f"pulsediff apply BASE PATCH -o OUT")
            raise InvalidPatchError(f"{path} is a folder, not a patch file")
        if not path.exists():
            raise CheckpointNotFoundError(str(path), "patch")
        _refuse_checkpoint_as_patch(path)


def is_patch_file(path: Path) -> bool:
    """True for a file that starts with a patch's magic bytes."""
    from pulsediff.io.names import PATCH_MAGIC

    try:
        with open(path, "rb") as f:
            return f.read(len(PATCH_MAGIC)) == PATCH_MAGIC
    except OSError:  # a folder, a missing file: not a patch
        return False


def checkpoint_kind(path: Path) -> str | None:
    """"safetensors" or "pickle" when the file starts like a checkpoint of that kind, else None
    (unreadable included: reading it as a patch will say what is wrong)."""
    from pulsediff.io.names import looks_like_pickle, looks_like_safetensors

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
        # Arguments swapped, a usage mistake: exit 2, as catch-up's swapped arguments.
        raise UsageError(f"{path} is a checkpoint, not a patch; the base comes first: "
                         f"pulsediff apply BASE PATCH -o OUT")
