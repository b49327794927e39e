"""A patch file opened and checked before anything is rebuilt from it: its header (open_patch), all
of its checksums (verify_patch_file), a chain of patches whose links follow one another
(open_chain), and the layout of the target's files (read_layout). Used by apply, squash, stats,
live tensors and catch-up alike."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

from pulsediff.errors import ChainError, CheckpointNotFoundError, CorruptPatchError
from pulsediff.format.container import PatchReader
from pulsediff.format.header import FileRecord, PatchHeader, TensorRecord
from pulsediff.io.fast_entries import gc_paused
from pulsediff.io.names import INDEX_NAME
from pulsediff.io.folder_files import file_hash
from pulsediff.io.safetensors_header import HeaderError, canonical_entries, parse_header


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
        reader = PatchReader(stream, source)  # its JSON parsed with the GC paused (container.py)
        with gc_paused():  # not over the read: a stream may block, and other threads need the GC
            header = PatchHeader.from_json(reader.header, source, reader.version[0])
    except BaseException:
        if owned:
            owned.close()
        raise
    return reader, header, owned


def verify_patch_file(patch: str | Path) -> PatchHeader:
    """Read a whole patch file and check every checksum and its length; decode nothing."""
    reader, header, owned = open_patch(patch)
    try:
        for ref in header.section_refs():
            reader.read_next(ref, "section")
        reader.expect_end(header.sections_length)
        return header
    finally:
        if owned:
            owned.close()


def read_patch_header(patch: str | Path | BinaryIO) -> PatchHeader:
    """The validated header of a patch (sections are not read)."""
    _, header, owned = open_patch(patch)
    if owned:
        owned.close()
    return header


@dataclass
class Link:
    reader: PatchReader
    header: PatchHeader
    records: dict[str, TensorRecord]

    @property
    def files(self) -> dict[str, FileRecord]:
        return {f.name: f for f in self.header.files}


@contextmanager
def open_chain(patches: list) -> Iterator[list[Link]]:
    """Open patches as a chain, every link checked against the previous one; closes them after."""
    owned: list[BinaryIO] = []
    try:
        links = []
        for p in patches:
            reader, header, stream = open_patch(p)
            if stream is not None:
                owned.append(stream)
            links.append(Link(reader, header, {r.name: r for r in header.tensors}))
        check_links(links)
        yield links
    finally:
        for stream in owned:
            stream.close()


def check_links(links: list[Link]) -> None:
    for prev, link in zip(links, links[1:]):
        if link.header.precision != prev.header.precision:
            raise ChainError(f"{link.reader.source} is a {link.header.precision} patch but "
                             f"{prev.reader.source} is {prev.header.precision}: they do not chain")
        if link.header.base_digest != prev.header.target_digest:
            raise ChainError(f"{link.reader.source} does not follow {prev.reader.source} "
                             f"(its base is {link.header.base_digest}, the previous target {prev.header.target_digest})")


def read_layout(reader: PatchReader, header: PatchHeader, sequential: bool) -> bytes:
    layout = header.layout
    data = (reader.read_next if sequential else reader.read_section)(layout.section, "layout")
    from pulsediff.codecs.base import SectionContext, zstd_decompress_exact  # numpy: not for reading a header

    blob = zstd_decompress_exact(data, layout.blob_len, SectionContext("<layout>", layout.blob_len, 1, reader.source), "layout")
    # Format 1.1: every byte of the target's files that is not tensor data is in the blob,
    # so with this check (and the tensor hashes) exact mode rebuilds the files byte for byte.
    if layout.digest is not None and file_hash(blob) != layout.digest:
        raise CorruptPatchError(reader.source, "the layout does not match its recorded digest")
    # Each file's header must describe its tensors, for every reader of the layout (squash wrote
    # patches from layouts that apply then refused).
    pos = first = 0
    holder = {}  # tensor -> the file the layout writes it to
    for lf in layout.files:
        check_file_header(blob[pos : pos + lf.header_len], header.tensors[first : first + lf.tensors], lf.name,
                           reader.source)
        holder.update((r.name, lf.name) for r in header.tensors[first : first + lf.tensors])
        pos, first = pos + lf.header_len, first + lf.tensors
    if layout.index_len is not None:
        _check_index(blob[pos : pos + layout.index_len], holder, reader.source)
    return blob


def _check_index(index: bytes, holder: dict[str, str], source: str) -> None:
    """The index the layout writes must list each tensor in the file the layout writes it to (§5):
    the file names are in the header, outside the layout digest, so a patch whose names were edited
    (checksums recomputed) would otherwise rebuild a folder whose index names files it does not have."""
    from pulsediff.io import strict_json

    try:
        weight_map = strict_json.loads(index)["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise CorruptPatchError(source, f"the layout's {INDEX_NAME} has no weight_map object") from None
    if weight_map != holder:
        wrong = sorted(set(weight_map.items()) ^ set(holder.items()))[0][0]
        raise CorruptPatchError(source, f"the layout's {INDEX_NAME} lists tensor {wrong!r} in "
                                        f"{weight_map.get(wrong)!r}, but the layout writes it to "
                                        f"{holder.get(wrong)!r}: the rebuilt folder would not load")


def check_file_header(raw: bytes, records, file_name: str, source: str) -> None:
    """The stored safetensors header must describe exactly these tensors, in this order."""
    if _describes_in_order(raw, records):
        return
    try:
        parsed = parse_header(raw, sum(r.nbytes for r in records))
    except HeaderError as exc:
        raise CorruptPatchError(source, f"layout header of {file_name or 'the file'}: {exc}") from None
    described = [(e.name, e.dtype.name, e.shape) for e in parsed.tensors]
    if described != [(r.name, r.dtype.name, r.shape) for r in records]:
        raise CorruptPatchError(source, f"layout header of {file_name or 'the file'} does not match the tensor list")


def _describes_in_order(raw: bytes, records) -> bool:
    """Whether a safetensors header lists exactly these tensors, each with its dtype and shape, in
    this order and at the offsets that lay them back to back from 0 (what every writer writes), with
    metadata of strings only: then parse_header would accept it and describe the same tensors. Read
    in one pass with no objects per tensor; False sends the header to parse_header, for its words."""
    from pulsediff.io import strict_json

    if _is_canonical(raw, records):
        return True
    try:
        obj = strict_json.loads(raw)
    except strict_json.JsonError:
        return False
    if type(obj) is not dict:
        return False
    metadata = obj.pop("__metadata__", None)
    if metadata is not None and (type(metadata) is not dict or not all(
            type(k) is str and type(v) is str for k, v in metadata.items())):
        return False
    if len(obj) != len(records):
        return False
    offset = 0
    for (name, info), rec in zip(obj.items(), records):
        if name != rec.name or type(info) is not dict or info.get("dtype") != rec.dtype.name:
            return False
        shape, offsets, end = info.get("shape"), info.get("data_offsets"), offset + rec.nbytes
        if end >= 2**63 or type(shape) is not list or tuple(shape) != rec.shape or any(type(d) is not int for d in shape) \
                or type(offsets) is not list or len(offsets) != 2 or offsets[0] != offset or offsets[1] != end \
                or type(offsets[0]) is not int or type(offsets[1]) is not int:
            return False
        offset = end
    return True


_METADATA_START = b'{"__metadata__":'


def _is_canonical(raw: bytes, records) -> bool:
    """Whether `raw` is, byte for byte, the header safetensors (and build_header) writes for these
    tensors back to back (metadata first, padded with spaces): compared as bytes, with no JSON parse
    of the entries. An 18k-tensor layout's strict parse cost ~0.25 s of every apply, live ones
    included; this ~0.06 s. Any other spelling of the same header (another writer's) returns False,
    for the full reading."""
    if not records or any(r.name == "__metadata__" for r in records):
        return False
    if sum(r.nbytes for r in records) >= 2**63:
        return False
    try:
        entries = canonical_entries((r.name, r.dtype.name, r.shape, r.nbytes) for r in records)
    except UnicodeEncodeError:  # a lone surrogate: not what a writer writes
        return False
    body = raw.rstrip(b" ")
    if body == b"{" + entries + b"}":
        return True
    if not (body.startswith(_METADATA_START) and body.endswith(b"," + entries + b"}")):
        return False
    from pulsediff.io import strict_json

    try:  # the metadata object alone: one JSON value, so the whole is that object and the entries
        metadata = strict_json.loads(body[len(_METADATA_START):len(body) - len(entries) - 2])
    except strict_json.JsonError:
        return False
    return type(metadata) is dict and all(type(k) is str and type(v) is str for k, v in metadata.items())
