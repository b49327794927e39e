"""Checkpoints on disk: one `.safetensors` file, or a folder of shards.

A `Checkpoint` memory-maps its files and hands out one tensor's bits at a
time, so that nothing ever holds a whole checkpoint in memory. Each mapping
is guarded (pulsediff/io/mapped.py): a file that shrinks while it is read
gives zeros instead of SIGBUS, and `close()` (the end of a `with` block)
then raises `CheckpointChangedError` naming it, as does an output's commit. A folder is
read through its Hugging Face `model.safetensors.index.json` when it has one,
else every `*.safetensors` file in it is a shard.

`TensorView` is how the rest of pulsediff sees a checkpoint under a precision
mode: in exact mode every tensor as stored; in bf16 mode floating tensors cast
to BF16 with round-to-nearest-even (by torch, so it is exactly
`tensor.to(torch.bfloat16)`).
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pulsediff.io import mapped, strict_json
from pulsediff.io.atomic import finish_interrupted
from pulsediff.io.dtypes import BF16, DType
from pulsediff.errors import CheckpointNotFoundError, InvalidCheckpointError
from pulsediff.io.memory import populate_read, unmap_pages
from pulsediff.io.names import (INDEX_NAME, PATCH_ADVICE, PATCH_MAGIC, PICKLE_ADVICE, PRECISIONS,  # noqa: F401  (re-exported)
                                is_plain_filename, looks_like_pickle, looks_like_safetensors)
from pulsediff.io.safetensors_header import MAX_HEADER_BYTES, HeaderError, ParsedHeader, TensorEntry, parse_header, read_header_length

UNMAP_BATCH_BYTES = 32 << 20  # released neighbours unmapped together (Checkpoint.release)
MAX_INDEX_BYTES = 64 * 1024 * 1024


def unreadable(path: Path) -> str | None:
    """Why `path`, which must be a checkpoint file (a shard, the index), is not a regular file that
    can be opened, or None. "missing" when there is nothing there at all."""
    try:
        st = path.stat()  # links followed, as in a Hugging Face cache snapshot
    except FileNotFoundError:
        return "a dangling symbolic link" if path.is_symlink() else "missing"
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symbolic link loop"
        return exc.strerror or str(exc)
    if stat.S_ISDIR(st.st_mode):
        return "a folder, not a file"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file (a pipe, socket or device)"
    return None


@dataclass
class ShardFile:
    name: str  # file name inside the checkpoint folder ("" for a single-file checkpoint)
    path: Path
    header: ParsedHeader
    _map: mmap.mmap | None
    _guard: int | None = None  # its slot in pulsediff.io.mapped while the map is open
    # The whole map as one array, sliced for each tensor: np.frombuffer per tensor took 8 us, a
    # quarter of a second per 18k-tensor checkpoint. Dropped before the map closes.
    _bytes: np.ndarray | None = field(default=None, repr=False, compare=False)

    def tensor_bytes(self, entry: TensorEntry, populate: bool = True) -> np.ndarray:
        """Zero-copy uint8 view of one tensor's bytes, its pages mapped in one call first
        unless `populate` is False."""
        if entry.nbytes == 0:
            return np.empty(0, dtype=np.uint8)
        start = self.header.data_start + entry.begin
        if populate:
            populate_read(self._map, start, entry.nbytes)
        if self._bytes is None:
            self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        return self._bytes[start:start + entry.nbytes]


class Checkpoint:
    """A safetensors checkpoint opened read-only."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.shards: list[ShardFile] = []
        self.index_bytes: bytes | None = None
        self._where: dict[str, tuple[ShardFile, TensorEntry]] = {}
        # Tensors whose pages a prefetch has mapped and no release has dropped since: their views
        # need no second populate (on a pair in the page cache, mapping present pages again cost
        # make's main thread ~0.65 ms per 16 MiB: 7% of make's time on the 1 GiB pair).
        self._mapped: set[str] = set()
        self._unmapping: dict[int, tuple[int, int]] = {}  # per shard: released bytes not unmapped yet
        if not self.path.exists():
            raise CheckpointNotFoundError(str(self.path))
        try:
            if self.path.is_dir():
                self.kind = "dir"
                self._open_dir()
            else:
                self.kind = "file"
                self._add_shard("", self.path)
        except OSError as exc:
            self.close()
            raise InvalidCheckpointError(str(self.path), exc.strerror or str(exc)) from None
        except BaseException:
            self.close()
            raise

    # -- opening ------------------------------------------------------------

    def _open_dir(self) -> None:
        # An in-place update that a kill interrupted between two renames is finished first:
        # until then the folder mixes old and new files.
        finish_interrupted(self.path)
        index_path = self.path / INDEX_NAME
        if os.path.lexists(index_path):  # whatever it is: an index that cannot be read is not ignored
            problem = unreadable(index_path)
            if problem is not None:
                raise InvalidCheckpointError(str(index_path), problem)
            if index_path.stat().st_size > MAX_INDEX_BYTES:
                raise InvalidCheckpointError(str(index_path), "index file is implausibly large")
            self.index_bytes = index_path.read_bytes()
            try:
                index = strict_json.loads(self.index_bytes)
                weight_map = index["weight_map"]
                if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                raise InvalidCheckpointError(str(index_path), "not a valid index (no weight_map object)") from None
            names = sorted(set(weight_map.values()))
            if not all(is_plain_filename(n) for n in names):
                raise InvalidCheckpointError(str(index_path), "weight_map names a file outside the folder")
            for n in names:
                problem = unreadable(self.path / n)
                if problem == "missing":
                    raise InvalidCheckpointError(str(index_path), f"shard {n} is missing")
                if problem is not None:
                    raise InvalidCheckpointError(str(self.path / n), problem)
                self._add_shard(n, self.path / n)
            listed = {k: v for k, v in weight_map.items()}
            actual = {name: shard.name for name, (shard, _) in self._where.items()}
            if listed != actual:
                raise InvalidCheckpointError(str(index_path), "weight_map does not match the shards' contents")
        else:
            # Every *.safetensors entry is a shard: one that cannot be read (a dangling link, a link
            # loop, a FIFO, a folder) is refused, not skipped, or digest and stats would quietly
            # cover fewer tensors than the folder has.
            names = sorted(p.name for p in self.path.iterdir() if p.suffix == ".safetensors")
            for n in names:
                problem = unreadable(self.path / n)
                if problem is not None:
                    raise InvalidCheckpointError(str(self.path / n), problem)
            if not names:
                pickles = sorted(p.name for p in self.path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
                if pickles:
                    raise InvalidCheckpointError(str(self.path), f"folder holds {pickles[0]}: " + PICKLE_ADVICE)
                inner = sorted(p.name for p in self.path.iterdir() if p.is_dir() and not p.name.startswith(".")
                               and any(q.suffix == ".safetensors" for q in p.iterdir()))
                if inner:  # a trainer's folder of steps, or a parent folder: name one checkpoint in it
                    raise InvalidCheckpointError(str(self.path), f"folder has no {INDEX_NAME} and no .safetensors "
                                                 f"files of its own, but holds checkpoints in folders: give one of "
                                                 f"them, e.g. {self.path / inner[-1]}")
                raise InvalidCheckpointError(str(self.path), f"folder has no {INDEX_NAME} and no .safetensors files")
            for n in names:
                self._add_shard(n, self.path / n, several=names)

    def _add_shard(self, name: str, path: Path, several: list[str] | None = None) -> None:
        # O_NONBLOCK: a FIFO given as a checkpoint must be refused, not waited on forever.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise InvalidCheckpointError(str(path), "not a regular file (a pipe, socket or device)")
        with os.fdopen(fd, "rb") as f:
            size = st.st_size
            prefix = f.read(9)
            if looks_like_pickle(prefix):
                raise InvalidCheckpointError(str(path), PICKLE_ADVICE)
            f.seek(0)
            try:
                n = read_header_length(f.read(8))
                if 8 + n > size:
                    raise HeaderError(f"header length {n} runs past the end of the file")
                raw = f.read(n)
                header = parse_header(raw, size - 8 - n)
            except HeaderError as exc:
                reason = PATCH_ADVICE.format(path=path) if prefix.startswith(PATCH_MAGIC) else str(exc)
                raise InvalidCheckpointError(str(path), reason) from None
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size > 0 else None
        shard = ShardFile(name, path, header, mapping)
        if mapping is not None:
            view = np.frombuffer(mapping, np.uint8)  # for its address; no copy
            shard._guard = mapped.watch(view.ctypes.data, size, str(path), size, (st.st_dev, st.st_ino, st.st_mtime_ns))
            del view  # an exported buffer would keep the map from closing
        self.shards.append(shard)
        for entry in header.tensors:
            if entry.name in self._where:
                if several is not None:  # shards without an index that repeat each other: a folder of steps
                    raise InvalidCheckpointError(
                        str(self.path), f"a folder of several checkpoints, not one ({self._where[entry.name][0].name} "
                        f"and {name} both hold {entry.name!r}): give one of them, e.g. {self.path / several[-1]}")
                raise InvalidCheckpointError(str(path), f"tensor {entry.name!r} appears in two shards")
            self._where[entry.name] = (shard, entry)

    # -- access -------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def entry(self, name: str) -> TensorEntry:
        return self._where[name][1]

    def raw_bytes(self, name: str) -> np.ndarray:
        shard, entry = self._where[name]
        return shard.tensor_bytes(entry, populate=name not in self._mapped)

    def prefetch(self, name: str) -> None:
        """Read a tensor's pages into memory and map them (blocking: call it from a thread that
        has time). A view taken after it returns, until a release, skips its populate."""
        shard, entry = self._where[name]
        populate_read(shard._map, shard.header.data_start + entry.begin, entry.nbytes)
        self._mapped.add(name)

    def release(self, name: str) -> None:
        """Done with a tensor's bytes for now: unmap its pages (they stay cached; see unmap_pages).
        The map is read-only and shared, so nothing is lost: a later read maps them again.

        Neighbouring tensors released one after another are unmapped together, once they span
        UNMAP_BATCH_BYTES or the next one does not follow them (an madvise per tensor cost 3 s
        of make's time on 18k expert tensors)."""
        shard, entry = self._where[name]
        self._mapped.discard(name)
        lo = shard.header.data_start + entry.begin
        hi = lo + entry.nbytes
        pending = self._unmapping.get(id(shard))
        if pending is not None and pending[1] == lo:
            lo = pending[0]
        elif pending is not None:
            unmap_pages(shard._map, pending[0], pending[1] - pending[0])
        if hi - lo >= UNMAP_BATCH_BYTES:
            self._unmapping.pop(id(shard), None)
            unmap_pages(shard._map, lo, hi - lo)
        else:
            self._unmapping[id(shard)] = (lo, hi)

    @property
    def metadata(self) -> dict[str, str] | None:
        return self.shards[0].header.metadata if self.kind == "file" else None

    @property
    def total_bytes(self) -> int:
        return sum(8 + len(s.header.raw) + s.header.data_bytes for s in self.shards)

    def check_intact(self) -> None:
        """Raise CheckpointChangedError (or CheckpointReadError) if one of this checkpoint's files
        shrank, or was written over, while mapped: what was read from it is not to be trusted."""
        err = self._first_change()
        if err is not None:
            raise err

    def _first_change(self) -> "Exception | None":
        return next((err for s in self.shards if (err := mapped.changed(s._guard)) is not None), None)

    def close(self, verify: bool = True) -> None:
        """Unmap the files. Raises CheckpointChangedError if one of them shrank while it was mapped:
        whatever was computed from its bytes since is not to be trusted. `verify=False`: the caller has
        checked what it read (mapped.check) and published the result; a change from then on touches
        nothing it made, and an error now would report a failure after the output was committed.
        Closing again does nothing."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        changed = self._first_change() if verify else None
        for s in self.shards:
            s._bytes = None
            if s._map is not None:
                try:
                    s._map.close()
                    mapped.unwatch(s._guard)
                    s._guard = None
                except BufferError:
                    # A view is still alive: the map closes when it is collected, its slot left until a
                    # new map over its addresses clears it (mapped.watch). Not a finalizer: one run by
                    # the garbage collector inside watch, which holds the guard's lock, deadlocked.
                    # The slot keeps guarding the range but leaves mapped.check: this checkpoint is
                    # closed, and a change to its file must not refuse what later work publishes.
                    mapped.retire(s._guard)
                    s._guard = None
                s._map = None
        if changed is not None:
            raise changed

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class EmptyCheckpoint(Checkpoint):
    """A checkpoint with no tensors: the base of an anchor, a patch that carries every tensor whole."""

    def __init__(self) -> None:  # noqa: super().__init__ would look for a path
        self.path = Path("<empty>")
        self.shards = []
        self.index_bytes = None
        self._where = {}
        self.kind = "file"


def open_checkpoint(path: str | os.PathLike | None) -> Checkpoint:
    """`None` stands for the empty checkpoint."""
    return EmptyCheckpoint() if path is None else Checkpoint(path)


@dataclass(frozen=True)
class TensorData:
    """One tensor as a precision mode sees it: its type, shape and bit patterns."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    bits: np.ndarray  # 1-D, unsigned ints of dtype.itemsize bytes, C-contiguous and aligned (make on the device:
    # a Numba device array; the copies its records are made from hold None where unused)


class TensorView:
    """A checkpoint seen under a precision mode ("exact" or "bf16")."""

    def __init__(self, ckpt: Checkpoint, precision: str):
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}")
        self.ckpt = ckpt
        self.precision = precision

    def casts(self, dtype: DType) -> bool:
        return self.precision == "bf16" and dtype.is_float and dtype is not BF16

    def dtype_of(self, name: str) -> DType:
        dtype = self.ckpt.entry(name).dtype
        return BF16 if self.casts(dtype) else dtype

    def shape_of(self, name: str) -> tuple[int, ...]:
        return self.ckpt.entry(name).shape

    def get(self, name: str) -> TensorData:
        entry = self.ckpt.entry(name)
        raw = self.ckpt.raw_bytes(name)
        if self.casts(entry.dtype):
            return TensorData(name, BF16, entry.shape, cast_to_bf16_bits(raw, entry.dtype))
        bits = raw.view(entry.dtype.bits_dtype) if raw.size else np.empty(0, entry.dtype.bits_dtype)
        if not bits.flags.aligned:
            bits = bits.copy()  # numba kernels need aligned arrays; safetensors does not promise alignment
        return TensorData(name, entry.dtype, entry.shape, bits)


def cast_to_bf16_bits(raw: np.ndarray, dtype: DType) -> np.ndarray:
    """BF16 bit patterns of `raw` (elements of `dtype`), exactly as torch rounds them."""
    import torch  # deferred: importing torch costs seconds and most paths never cast

    if dtype.torch_name is None or not hasattr(torch, dtype.torch_name):
        raise InvalidCheckpointError("", f"this torch cannot cast {dtype.name} to BF16")
    if raw.size == 0:
        return np.empty(0, np.uint16)
    import warnings

    with warnings.catch_warnings():
        # frombuffer warns that a read-only mmap is not writable; the tensor is only read.
        warnings.simplefilter("ignore", UserWarning)
        src = torch.frombuffer(raw, dtype=getattr(torch, dtype.torch_name))
    return src.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
