"""The other files of a model folder: config, generation config, tokenizer, README.

A Hugging Face model folder is more than its shards: `from_pretrained` needs
`config.json`, and a worker needs the tokenizer. Patches between folders carry
these files byte for byte (docs/FORMAT.md §5.1): a changed file whole, an
unchanged one by its hash.

What counts as such a file: a regular file (symlinks followed, as in a
Hugging Face cache snapshot) directly in the folder, whose name does not
start with "." and is neither a shard nor the index. Subfolders are not
carried (they are reported). Weights in formats pulsediff does not diff
(`*.bin`, `*.pt`, `*.gguf`, ...) and files over `MAX_FILE_BYTES` would turn
a small patch into a dense copy, so they are refused, or left out with
`skip_unsupported`.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from pulsediff.errors import FolderFileError

MAX_FILE_BYTES = 256 * 1024 * 1024
MAX_FILES = 10_000
WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".gguf", ".ggml", ".h5", ".msgpack", ".onnx", ".pkl", ".pickle", ".npz")
SKIP_HINT = "give --skip-unsupported to leave such files out of the patch"


def is_carried_name(name: str) -> bool:
    """A name a patch may carry as a folder file: plain, visible, not a checkpoint file."""
    from pulsediff.io.names import INDEX_NAME, is_plain_filename

    return (is_plain_filename(name) and not name.startswith(".") and not name.endswith(".safetensors")
            and name != INDEX_NAME and len(name.encode("utf-8", "surrogatepass")) <= 255)


@dataclass(frozen=True)
class FolderFile:
    name: str
    path: Path
    size: int


@dataclass
class FolderFiles:
    files: list[FolderFile] = field(default_factory=list)  # sorted by name
    skipped: list[str] = field(default_factory=list)  # what was left out, said to the user

    def by_name(self) -> dict[str, FolderFile]:
        return {f.name: f for f in self.files}


def folder_files(ckpt, *, skip_unsupported: bool = False) -> FolderFiles:
    """The files of checkpoint `ckpt`'s folder that a patch carries (none for a single file)."""
    found = FolderFiles()
    if ckpt.kind != "dir":
        return found
    from pulsediff.io.names import INDEX_NAME

    shards = {s.name for s in ckpt.shards}
    try:
        names = sorted(os.listdir(ckpt.path))
    except OSError as exc:
        raise FolderFileError(str(ckpt.path), exc.strerror or str(exc)) from None
    for name in names:
        if name in shards or name == INDEX_NAME or name.startswith("."):
            continue
        path = ckpt.path / name
        try:
            st = path.stat()
        except OSError:
            found.skipped.append(f"{name} (cannot be read)")
            continue
        if stat.S_ISDIR(st.st_mode):
            found.skipped.append(f"{name}/ (subfolders are not carried)")
            continue
        if not stat.S_ISREG(st.st_mode):
            found.skipped.append(f"{name} (not a regular file)")
            continue
        problem = None
        if name.endswith(".safetensors"):
            problem = f"a .safetensors file that {INDEX_NAME} does not list (add it to the index or move it out)"
        elif name.lower().endswith(WEIGHT_SUFFIXES):
            problem = "weights in a format pulsediff does not diff (convert them to safetensors, or move them out)"
        elif st.st_size > MAX_FILE_BYTES:
            problem = f"{st.st_size:,} bytes, over the {MAX_FILE_BYTES >> 20} MiB a patch carries whole"
        elif not is_carried_name(name):
            problem = "a name a patch cannot carry"
        if problem:
            if not skip_unsupported:
                raise FolderFileError(str(path), f"{problem}; {SKIP_HINT}")
            found.skipped.append(f"{name} ({problem})")
            continue
        found.files.append(FolderFile(name, path, st.st_size))
    if len(found.files) > MAX_FILES:
        raise FolderFileError(str(ckpt.path), f"more than {MAX_FILES:,} files besides the weights")
    return found


def read_folder_file(path: Path, size: int | None = None) -> bytes:
    """A carried file's bytes, at most MAX_FILE_BYTES, never blocking on a FIFO swapped in since the scan."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise FolderFileError(str(path), exc.strerror or str(exc)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FolderFileError(str(path), "not a regular file")
        # One byte past what fstat says (or past the limit) shows a file that grew or is too
        # large, without reserving the limit's 256 MiB for every small file.
        expect = min(st.st_size, MAX_FILE_BYTES)
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(expect + 1)
    except OSError as exc:
        raise FolderFileError(str(path), exc.strerror or str(exc)) from None
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        raise FolderFileError(str(path), f"larger than {MAX_FILE_BYTES >> 20} MiB")
    if len(data) > expect or (size is not None and len(data) != size):
        raise FolderFileError(str(path), "changed while it was read")
    return data


def file_hash(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)
