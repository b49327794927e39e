"""`apply_patch`: rebuild the target checkpoint from a base and a patch.

Order of checks, so that nothing is written unless everything holds:
  1. the patch preamble and header (magic, version, checksums, bounds);
  2. the base digest (every base tensor hashed) against the patch's base, or
     its target (then the base is already up to date);
  3. while rebuilding into temporary files: each section's checksum before it
     is decoded, each rebuilt tensor's hash against the header;
  4. the rebuilt checkpoint's digest; only then are the files renamed into place.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from .atomic import StagedFiles
from .checkpoint import INDEX_NAME, Checkpoint, TensorView
from .codecs import get_codec
from .codecs.base import Scratch, SectionContext, zstd_decompress_exact
from .digest import TensorId, checkpoint_digest, tensor_hash
from .errors import (
    BaseMismatchError,
    CheckpointNotFoundError,
    CorruptPatchError,
    PulsediffError,
    TargetMismatchError,
    TensorMismatchError,
    UsageError,
)
from .format import PatchReader
from .inspect import tensor_ids
from .kernels import get_backend
from .patch import PatchHeader, TensorRecord
from .progress import SILENT, Progress
from .safetensors_io import HeaderError, parse_header


@dataclass(frozen=True)
class ApplyResult:
    status: str  # "applied" or "up-to-date"
    output: Path
    header: PatchHeader


def open_patch(patch: str | Path | BinaryIO) -> tuple[PatchReader, PatchHeader, BinaryIO | None]:
    """Read and validate a patch's header. Returns (reader, header, stream to close or None)."""
    if isinstance(patch, (str, Path)) and str(patch) == "-":
        stream, source, owned = sys.stdin.buffer, "<stdin>", None
    elif isinstance(patch, (str, Path)):
        path = Path(patch)
        if not path.is_file():
            raise CheckpointNotFoundError(str(path), "patch")
        stream = open(path, "rb")
        source, owned = str(path), stream
    else:
        stream, source, owned = patch, getattr(patch, "name", "<stream>"), None
    try:
        reader = PatchReader(stream, source)
        header = PatchHeader.from_json(reader.header, source)
    except BaseException:
        if owned:
            owned.close()
        raise
    return reader, header, owned


def read_patch_header(patch: str | Path | BinaryIO) -> PatchHeader:
    """The validated header of a patch (sections are not read)."""
    _, header, owned = open_patch(patch)
    if owned:
        owned.close()
    return header


def apply_patch(
    base: str | Path,
    patch: str | Path | BinaryIO,
    out: str | Path | None = None,
    *,
    in_place: bool = False,
    device: str | None = None,
    progress: Progress = SILENT,
) -> ApplyResult:
    if in_place == (out is not None):
        raise UsageError("give exactly one of an output path or in_place=True")
    base = Path(base)
    out_path = base if in_place else Path(out)
    reader, header, owned = open_patch(patch)
    try:
        with Checkpoint(base) as base_ckpt:
            view = TensorView(base_ckpt, header.precision)
            base_ids = tensor_ids(view, progress)
            digest = checkpoint_digest(base_ids.values())
            if digest == header.target_digest:
                if in_place or out_path.resolve() == base.resolve() or _already_target(out_path, header):
                    return ApplyResult("up-to-date", out_path, header)
            elif digest != header.base_digest:
                raise _base_mismatch(header, base_ids, digest)
            elif _already_target(out_path, header):
                return ApplyResult("up-to-date", out_path, header)
            backend = get_backend(device)
            copy_all = digest == header.target_digest  # base is the target: only the layout may differ
            scratch = Scratch()

            def rebuild(rec: TensorRecord, payload: bytes | None) -> np.ndarray:
                return _rebuild(rec, None if copy_all else payload, view, backend, reader.source, scratch)

            _check_output_kind(header, out_path)
            _write_target(header, reader, rebuild, out_path, progress)
            if in_place:
                _remove_stale_files(base_ckpt, header)
    finally:
        if owned:
            owned.close()
    return ApplyResult("applied", out_path, header)


# -- base checks --------------------------------------------------------------


def _already_target(out_path: Path, header: PatchHeader) -> bool:
    """True when OUT already holds the target (applying twice is harmless)."""
    if not out_path.exists():
        return False
    try:
        with Checkpoint(out_path) as existing:
            ids = tensor_ids(TensorView(existing, header.precision))
            return checkpoint_digest(ids.values()) == header.target_digest
    except PulsediffError:
        return False


def _base_mismatch(header: PatchHeader, base_ids: dict[str, TensorId], digest: str) -> PulsediffError:
    """The most specific explanation of why the base is not the patch's base."""
    expected = [r for r in header.tensors if r.base_hash is not None]
    for rec in expected:  # a wrong shape or dtype says most about what went wrong
        have = base_ids.get(rec.name)
        if have is not None and (have.dtype != rec.dtype.name or have.shape != rec.shape):
            return TensorMismatchError(
                f"base tensor {rec.name!r} is {have.dtype}{list(have.shape)}, "
                f"the patch expects {rec.dtype.name}{list(rec.shape)}: this patch was made from another base"
            )
    for rec in expected:
        have = base_ids.get(rec.name)
        if have is None:
            return BaseMismatchError(header.base_digest, digest, f"tensor {rec.name!r} is missing from the base")
        if have.hash != rec.base_hash:
            return BaseMismatchError(header.base_digest, digest, f"tensor {rec.name!r} differs from the patch's base")
    return BaseMismatchError(header.base_digest, digest, "the base's set of tensors differs")


# -- rebuilding -----------------------------------------------------------------


def _rebuild(rec: TensorRecord, payload: bytes | None, view: TensorView, backend, source: str,
             scratch: Scratch) -> np.ndarray:
    """One target tensor's bits; `payload` None means: the base tensor as it is."""
    if payload is None:
        bits = view.get(rec.name).bits
    else:
        codec = get_codec(rec.section.codec)
        base_bits = view.get(rec.name).bits if rec.op == "patch" else None
        ctx = SectionContext(rec.name, rec.numel, rec.dtype.itemsize, source)
        bits = codec.decode(base_bits, payload, rec.section.params, ctx, backend, scratch)
    if tensor_hash(bits) != rec.target_hash:
        raise CorruptPatchError(source, f"tensor {rec.name!r} does not rebuild to its recorded hash")
    return bits


def _check_output_kind(header: PatchHeader, out_path: Path) -> None:
    if header.layout.kind == "dir" and out_path.exists() and not out_path.is_dir():
        raise UsageError(f"{out_path} is a file, but the patch rebuilds a sharded folder")
    if header.layout.kind == "file" and out_path.is_dir():
        raise UsageError(f"{out_path} is a folder, but the patch rebuilds a single file")


def _write_target(header: PatchHeader, reader: PatchReader, rebuild, out_path: Path, progress: Progress) -> None:
    """Stream sections in header order into staged files; rename only once all is verified."""
    layout = header.layout
    source = reader.source
    blob = zstd_decompress_exact(reader.read_next(layout.section, "layout"), layout.blob_len,
                                 SectionContext("<layout>", layout.blob_len, 1, source), "layout")
    progress.begin("apply", sum(r.nbytes for r in header.tensors), len(header.tensors))
    rebuilt: list[TensorId] = []
    pos = first = 0
    with StagedFiles() as staged:
        for lf in layout.files:
            raw = blob[pos : pos + lf.header_len]
            records = header.tensors[first : first + lf.tensors]
            pos, first = pos + lf.header_len, first + lf.tensors
            _check_file_header(raw, records, lf.name, source)
            with staged.open(out_path if layout.kind == "file" else out_path / lf.name) as f:
                f.write(len(raw).to_bytes(8, "little"))
                f.write(raw)
                for rec in records:
                    payload = reader.read_next(rec.section, f"tensor {rec.name!r}") if rec.section else None
                    bits = rebuild(rec, payload)
                    if bits.size:
                        f.write(memoryview(np.ascontiguousarray(bits)).cast("B"))
                    rebuilt.append(TensorId(rec.name, rec.dtype.name, rec.shape, rec.target_hash))
                    progress.advance(rec.nbytes)
        if layout.index_len is not None:
            with staged.open(out_path / INDEX_NAME) as f:
                f.write(blob[pos : pos + layout.index_len])
        reader.expect_end(header.sections_length)
        if checkpoint_digest(rebuilt) != header.target_digest:
            raise TargetMismatchError(header.target_digest, checkpoint_digest(rebuilt))
        staged.commit()
    progress.end()


def _check_file_header(raw: bytes, records, file_name: str, source: str) -> None:
    """The stored safetensors header must describe exactly these tensors, in this order."""
    try:
        parsed = parse_header(raw, sum(r.nbytes for r in records))
    except HeaderError as exc:
        raise CorruptPatchError(source, f"layout header of {file_name or 'the file'}: {exc}") from None
    described = [(e.name, e.dtype.name, e.shape) for e in parsed.tensors]
    if described != [(r.name, r.dtype.name, r.shape) for r in records]:
        raise CorruptPatchError(source, f"layout header of {file_name or 'the file'} does not match the tensor list")


def _remove_stale_files(base: Checkpoint, header: PatchHeader) -> None:
    """After an in-place apply to a folder: drop base shards (and index) the target no longer has."""
    if base.kind != "dir":
        return
    keep = {f.name for f in header.layout.files}
    for shard in base.shards:
        if shard.name not in keep:
            shard.path.unlink(missing_ok=True)
    if header.layout.index_len is None and base.index_bytes is not None:
        (base.path / INDEX_NAME).unlink(missing_ok=True)
