"""Strict reading and canonical writing of safetensors headers.

pulsediff parses headers itself instead of going through `safetensors.safe_open`
because it needs two things the library does not expose: the exact header
bytes (exact-mode patches rebuild files byte for byte, header included) and
zero-copy views of each tensor's raw bytes in any dtype (numpy has no BF16 or
FP8). The rules enforced are safetensors' own: bounded header size, known
dtypes, offsets that match shapes, no holes and no overlaps.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from operator import attrgetter

from pulsediff.io import strict_json
from pulsediff.io.dtypes import DType, lookup
from pulsediff.io.fast_entries import built, elements, gc_paused

# safetensors caps the header at 100 MB; a larger length field is refused
# before anything is allocated.
MAX_HEADER_BYTES = 100_000_000
# Tensor names and ranks a checkpoint may have: those a patch can carry (docs/FORMAT.md §3), so that
# every checkpoint pulsediff opens can be diffed. format/container.py takes its limits from here.
MAX_NAME_BYTES = 4096
MAX_NDIM = 64
HEADER_ALIGN = 8


class HeaderError(ValueError):
    """Raised with a reason; callers wrap it with the offending path."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: DType
    shape: tuple[int, ...]
    begin: int  # offset inside the data region
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class ParsedHeader:
    raw: bytes  # the header bytes exactly as stored (without the 8-byte length)
    metadata: dict[str, str] | None
    tensors: tuple[TensorEntry, ...]  # in data-offset order

    @property
    def data_start(self) -> int:
        return 8 + len(self.raw)

    @property
    def data_bytes(self) -> int:
        return self.tensors[-1].end if self.tensors else 0


def read_header_length(prefix: bytes) -> int:
    if len(prefix) < 8:
        raise HeaderError("file is shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise HeaderError(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
    if n < 2:
        raise HeaderError("header is too short to hold a JSON object")
    return n


def parse_header(raw: bytes, data_bytes_available: int) -> ParsedHeader:
    """Validate a header against the size of the data region that follows it."""
    with gc_paused():  # an MoE file's 18k entries: 0.20 -> 0.15 s of CPU
        return _parse_header(raw, data_bytes_available)


def _parse_header(raw: bytes, data_bytes_available: int) -> ParsedHeader:
    try:
        obj = strict_json.loads(raw)
    except strict_json.JsonError as exc:
        raise HeaderError(f"header is not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise HeaderError("header is not a JSON object")

    metadata = obj.pop("__metadata__", None)
    if metadata is not None:
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise HeaderError("__metadata__ must map strings to strings")

    tensors = []
    for name, info in obj.items():
        entry = _entry_checked(name, info)
        tensors.append(entry if entry is not None else _entry(name, info))

    tensors.sort(key=attrgetter("begin", "end"))
    expected = 0
    for t in tensors:
        if t.begin != expected:
            raise HeaderError(f"tensor {t.name!r}: data has a hole or overlaps the previous tensor")
        expected = t.end
    if expected != data_bytes_available:
        raise HeaderError(
            f"data region is {data_bytes_available} bytes but the header describes {expected}"
        )
    return ParsedHeader(raw=raw, metadata=metadata, tensors=tuple(tensors))


def _entry(name: str, info: object) -> TensorEntry:
    """A tensor's entry, checked field by field; HeaderError in words for what is wrong."""
    if not isinstance(info, dict):
        raise HeaderError(f"entry {name!r} is not an object")
    # What a patch cannot carry (docs/FORMAT.md §9) is refused on reading, so that make refuses
    # it first, with the message apply would give, rather than write a patch nothing applies.
    if not name:
        raise HeaderError(f"a tensor name is empty; patches carry names of 1 to {MAX_NAME_BYTES} UTF-8 bytes")
    if len(name.encode("utf-8")) > MAX_NAME_BYTES:
        raise HeaderError(f"tensor name {name[:40]!r}... is longer than {MAX_NAME_BYTES} UTF-8 bytes, "
                          "the most a patch carries")
    dtype_name = info.get("dtype")
    shape = info.get("shape")
    offsets = info.get("data_offsets")
    dtype = lookup(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise HeaderError(f"tensor {name!r} has unsupported dtype {dtype_name!r}")
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise HeaderError(f"tensor {name!r} has an invalid shape")
    if len(shape) > MAX_NDIM:
        raise HeaderError(f"tensor {name!r} has {len(shape)} dimensions; a patch carries at most {MAX_NDIM}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_uint(o) for o in offsets)):
        raise HeaderError(f"tensor {name!r} has invalid data_offsets")
    begin, end = offsets
    entry = TensorEntry(name, dtype, tuple(shape), begin, end)
    if end < begin or entry.numel * dtype.itemsize != end - begin:
        raise HeaderError(f"tensor {name!r}: data_offsets do not match its shape and dtype")
    return entry


def _entry_checked(name: str, info: object) -> TensorEntry | None:
    """_entry's result by the same checks written for speed (a checkpoint of 18k expert tensors is
    opened by every make and apply), or None for anything out of the ordinary, which _entry then
    reads in full and refuses in its words. tests/test_checkpoint.py holds the two together."""
    if type(info) is not dict:
        return None
    dtype_name, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    dtype = lookup(dtype_name) if type(dtype_name) is str else None
    if (dtype is None or type(shape) is not list or len(shape) > MAX_NDIM or type(offsets) is not list
            or len(offsets) != 2 or not name or len(name) > MAX_NAME_BYTES or not name.isascii()):
        return None
    begin, end = offsets
    if type(begin) is not int or type(end) is not int or not 0 <= begin <= end < 2**63:
        return None
    numel = elements(shape)
    if numel < 0 or numel * dtype.itemsize != end - begin:
        return None
    return built(TensorEntry, {"name": name, "dtype": dtype, "shape": tuple(shape), "begin": begin, "end": end})


def _is_uint(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**63


def build_header(metadata: dict[str, str] | None, tensors: list[tuple[str, str, tuple[int, ...], int]]) -> bytes:
    """Canonical header bytes for tensors laid out in the given order.

    `tensors` holds (name, dtype name, shape, nbytes). Keys are written in
    data order, compact separators, padded with spaces to 8-byte alignment as
    safetensors does: the same input always gives the same bytes.
    """
    tensors = list(tensors)
    if metadata is not None and any(name == "__metadata__" for name, *_ in tensors):
        # A tensor of that name takes the metadata's place, as one JSON object's key would.
        obj: dict[str, object] = {"__metadata__": dict(metadata)}
        offset = 0
        for name, dtype, shape, nbytes in tensors:
            obj[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    else:
        entries = canonical_entries(tensors)
        if metadata is not None:
            head = json.dumps({"__metadata__": dict(metadata)}, separators=(",", ":"), ensure_ascii=False)
            raw = head[:-1].encode("utf-8") + (b"," + entries if entries else b"") + b"}"
        else:
            raw = b"{" + entries + b"}"
    pad = (-(8 + len(raw))) % HEADER_ALIGN
    return raw + b" " * pad


def canonical_entries(tensors) -> bytes:
    """The tensors' entries of build_header's header, between its braces (after the metadata):
    `"name":{"dtype":..,"shape":[..],"data_offsets":[begin,end]}`, back to back from 0, joined by
    commas. Spelled out here rather than by json.dumps of a dict of dicts, which took 0.24 s for
    18k tensors against 0.04. UnicodeEncodeError for a name with a lone surrogate."""
    parts, offset = [], 0
    for name, dtype, shape, nbytes in tensors:
        end = offset + nbytes
        parts.append(f'{json.dumps(name, ensure_ascii=False)}:{{"dtype":"{dtype}","shape":'
                     f'[{",".join(map(str, shape))}],"data_offsets":[{offset},{end}]}}')
        offset = end
    return ",".join(parts).encode("utf-8")
