"""The patch file format, version 2, which reads version 1 too (normative text: docs/FORMAT.md).

    preamble   32 bytes  magic, version, flags, header length, header checksum
    header     zstd frame holding UTF-8 JSON: digests, mode, layout, the tensors (2: a table of
               columns; 1: one object per tensor)
    sections   back to back, in header order; each has its own offset, length and checksum

Everything read from a patch is bounded and checked here before use: the
reader never allocates more than the header's validated sizes allow, and
every section's checksum is verified before its bytes are decoded.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import BinaryIO

import xxhash
import zstandard

from pulsediff.io import strict_json
from pulsediff.io.fast_entries import gc_paused
from pulsediff.io.safetensors_header import MAX_NAME_BYTES, MAX_NDIM  # noqa: F401 (a patch's limits too)
from pulsediff.errors import (
    CorruptPatchError,
    NotAPatchError,
    PatchReadError,
    PulsediffError,
    TruncatedPatchError,
    UnsupportedVersionError,
)

MAGIC = b"PULSEDIF"
FORMAT_MAJOR = 2  # what this version writes; it reads every major in READ_MAJORS
FORMAT_MINOR = 0
READ_MAJORS = (1, 2)
# The version each major is written as: 1.5 by `make --format-version 1`, for appliers older than 2.0.
WRITE_VERSIONS = {1: (1, 5), FORMAT_MAJOR: (FORMAT_MAJOR, FORMAT_MINOR)}
PREAMBLE = struct.Struct("<8sHHIQQ")  # magic, major, minor, flags, header length, checksum
# The checksum is XXH3-64 of the first 24 preamble bytes followed by the header
# frame, so that no byte before the sections goes unchecked.
PREAMBLE_SIZE = PREAMBLE.size  # 32
MAX_HEADER_BYTES = 256 * 1024 * 1024  # compressed and decompressed alike
MAX_TENSORS = 1_000_000
MAX_SECTION_BYTES = 2**48  # 256 TiB: a sanity bound, far above any checkpoint
# Arrays and objects in the header JSON: 4 per tensor entry (entry, shape, section, params) and 2 per
# folder file (1.1), doubled for fields a later minor version may add. Counted before parsing: each
# costs ~20x its two bytes once parsed, so a header frame of a few KB holding 240 MiB of `[],` took
# 110 s and 6.6 GB to be refused.
MAX_HEADER_CONTAINERS = 2 * (4 * MAX_TENSORS + 2 * 10_000 + 64)


def section_checksum(data) -> str:
    return xxhash.xxh3_64_hexdigest(data)


# zstd level of the header: it is compressed once every tensor is done, so its time is make's
# alone. On the 1 GiB pair's header (147 tensors, 74 KB of JSON) level 19 took 26.7 ms for
# 12,663 bytes and level 15 8.4 ms for 12,716 (53 bytes more, 0.001% of that patch).
HEADER_ZSTD_LEVEL = 15
# A header of more JSON than this (thousands of tensors: an MoE checkpoint's experts) is compressed
# at LARGE_HEADER_ZSTD_LEVEL: on 18,432 experts (9.3 MB of JSON) level 15 took 0.96 s of a 6 s
# make for 1,569,623 bytes, level 9 0.15-0.27 s for 1,592,759 (0.4% of that patch).
LARGE_HEADER_BYTES = 1 << 20
LARGE_HEADER_ZSTD_LEVEL = 9


# A header frame may declare at most this many times its own length (or HEADER_EXPANSION_FLOOR): a
# frame of a few KB can otherwise declare 256 MiB, which a reader must hold (and copy) before it can
# tell that it is no header. pulsediff's headers compress 1.6-6x: their entries' XXH3-128 digests
# do not compress. (FORMAT.md 1.)
MAX_HEADER_EXPANSION = 1024
HEADER_EXPANSION_FLOOR = 1 << 20


def header_size_allowed(frame_length: int) -> int:
    """The most a header frame of `frame_length` bytes may declare."""
    return min(MAX_HEADER_BYTES, max(HEADER_EXPANSION_FLOOR, MAX_HEADER_EXPANSION * frame_length))


def encode_header(header: dict) -> bytes:
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    if len(raw) > MAX_HEADER_BYTES:  # readers refuse it (FORMAT.md 9): write nothing they refuse
        raise PulsediffError(f"the patch header would be {len(raw)} bytes, over the format's limit of "
                             f"{MAX_HEADER_BYTES >> 20} MiB: too many tensors or files for one patch")
    level = HEADER_ZSTD_LEVEL if len(raw) <= LARGE_HEADER_BYTES else LARGE_HEADER_ZSTD_LEVEL
    frame = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(raw)
    if len(raw) > header_size_allowed(len(frame)):  # would compress past what readers accept
        frame = stored_frame(raw)
    return frame


def stored_frame(raw: bytes) -> bytes:
    """`raw` as a zstd frame of raw (uncompressed) blocks, its content size declared: how a header
    that compresses too well to be read back is written (it never happens with real checkpoints).
    The frame names a 128 KiB window (one block), not the whole content as a single-segment frame
    would: stock decoders refuse windows over 128 MiB."""
    block = 128 * 1024  # the most a zstd block may hold
    # Descriptor 0xC0: an 8-byte content size, a window descriptor, no checksum, no dictionary.
    # Window descriptor 0x38: exponent 7, mantissa 0, i.e. 2**(10 + 7) bytes.
    out = [struct.pack("<IBB", 0xFD2FB528, 0xC0, 0x38), struct.pack("<Q", len(raw))]
    starts = range(0, len(raw), block) if raw else [0]
    for start in starts:
        size = min(block, len(raw) - start)
        last = int(start + block >= len(raw))
        out.append((size << 3 | last).to_bytes(3, "little"))  # block type 0: raw
        out.append(raw[start:start + size])
    return b"".join(out)


def _header_checksum(preamble_fields: bytes, header_frame: bytes) -> int:
    h = xxhash.xxh3_64(preamble_fields)
    h.update(header_frame)
    return h.intdigest()


def encode_preamble(header_frame: bytes, version: tuple[int, int] = (FORMAT_MAJOR, FORMAT_MINOR)) -> bytes:
    fields = PREAMBLE.pack(MAGIC, *version, 0, len(header_frame), 0)[:24]
    return fields + struct.pack("<Q", _header_checksum(fields, header_frame))


@dataclass(frozen=True)
class SectionRef:
    """Where a section lies (offset from the end of the header) and how to check it."""

    offset: int
    length: int
    checksum: str
    codec: str
    params: dict

    def to_json(self) -> dict:
        return {"offset": self.offset, "length": self.length, "xxh3": self.checksum, "codec": self.codec, "params": self.params}


class PatchReader:
    """Reads a patch from a byte stream: header first, then sections in order.

    Works on pipes (stdin) as well as files; on a seekable file `read_section`
    also gives random access to one tensor without decoding the rest.
    """

    def __init__(self, stream: BinaryIO, source: str):
        self.stream = stream
        self.source = source
        self._pos = 0
        pre = self._read_exact(PREAMBLE_SIZE, "preamble")
        magic, major, minor, flags, header_len, header_sum = PREAMBLE.unpack(pre)
        if magic != MAGIC:
            raise NotAPatchError(source)
        if major not in READ_MAJORS:
            raise UnsupportedVersionError(major, minor, READ_MAJORS)
        if flags != 0:
            raise CorruptPatchError(source, f"reserved flags are set ({flags:#x})")
        if header_len > MAX_HEADER_BYTES:
            raise CorruptPatchError(source, f"header length {header_len} exceeds the limit")
        frame = self._read_exact(header_len, "header")
        if _header_checksum(pre[:24], frame) != header_sum:
            raise CorruptPatchError(source, "header checksum mismatch")
        self.version = (major, minor)
        self.header_bytes = PREAMBLE_SIZE + header_len
        self.header = _decode_header_frame(frame, source)
        self.sections_start = self._pos

    def _failed(self, exc: OSError) -> PatchReadError:
        return PatchReadError(self.source, exc.strerror or str(exc))

    def _read_exact(self, n: int, what: str) -> bytes:
        chunks, left = [], n
        while left:
            try:
                chunk = self.stream.read(min(left, 1 << 24))
            except OSError as exc:
                raise self._failed(exc) from None
            if not chunk:
                raise TruncatedPatchError(self.source, f"ends inside the {what}")
            chunks.append(chunk)
            left -= len(chunk)
        self._pos += n
        return b"".join(chunks)

    def read_next(self, ref: SectionRef, what: str) -> bytes:
        """The next section in stream order, checksum verified."""
        expected_pos = self.sections_start + ref.offset
        if self._pos != expected_pos:
            raise CorruptPatchError(self.source, f"{what}: section is not where the header puts it")
        data = self._read_exact(ref.length, what)
        if section_checksum(data) != ref.checksum:
            raise CorruptPatchError(self.source, f"{what}: section checksum mismatch")
        return data

    def read_section(self, ref: SectionRef, what: str) -> bytes:
        """Random access (seekable files only)."""
        try:
            self.stream.seek(self.sections_start + ref.offset)
        except OSError as exc:
            raise self._failed(exc) from None
        self._pos = self.sections_start + ref.offset
        return self.read_next(ref, what)

    def check_size(self, sections_length: int) -> None:
        """For random access: the file must end right after the last section."""
        import os

        try:
            size = os.fstat(self.stream.fileno()).st_size
        except OSError as exc:
            raise self._failed(exc) from None
        if size < self.sections_start + sections_length:
            raise TruncatedPatchError(self.source, "ends before its last section")
        if size > self.sections_start + sections_length:
            raise CorruptPatchError(self.source, "unexpected bytes after the last section")

    def expect_end(self, sections_length: int) -> None:
        """The stream must end right after the last section: trailing bytes mean damage."""
        if self._pos != self.sections_start + sections_length:
            raise CorruptPatchError(self.source, "sections do not end where the header says")
        try:
            more = self.stream.read(1)
        except OSError as exc:
            raise self._failed(exc) from None
        if more:
            raise CorruptPatchError(self.source, "unexpected bytes after the last section")


def _decode_header_frame(frame: bytes, source: str) -> dict:
    try:
        size = zstandard.frame_content_size(frame)
        if not 0 < size <= MAX_HEADER_BYTES:
            raise CorruptPatchError(source, "header declares an invalid size")
        if size > header_size_allowed(len(frame)):
            raise CorruptPatchError(source, f"header frame of {len(frame)} bytes declares {size}, more than "
                                            f"{MAX_HEADER_EXPANSION} times its length")
        raw = zstandard.ZstdDecompressor().decompress(frame, max_output_size=size, allow_extra_data=False)
        with gc_paused():  # the parse's objects, none in a cycle (io/fast_entries.py)
            header = strict_json.loads(raw, max_containers=MAX_HEADER_CONTAINERS)
    except zstandard.ZstdError:
        raise CorruptPatchError(source, "header does not decode") from None
    except strict_json.JsonError as exc:
        raise CorruptPatchError(source, f"header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CorruptPatchError(source, "header is not a JSON object")
    return header

