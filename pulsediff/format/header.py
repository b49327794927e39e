"""The patch header as Python objects, and its strict validation.

`PatchHeader.from_json` is the only way a header read from a file becomes an
object: every field's type and every bound is checked there, so the rest of
the code can trust it. `to_json` is its exact inverse.
"""

from __future__ import annotations

import itertools
import math
import operator
import re
from dataclasses import dataclass, field
from functools import cached_property

from pulsediff.io.names import PRECISIONS, is_plain_filename
from pulsediff.codecs.facts import FACTS, facts_of
from pulsediff.format.digest import DEFAULT_SCHEME, DigestScheme, is_digest, is_tensor_hash, is_word_sum, scheme_of, unknown_scheme
from pulsediff.io.dtypes import DTYPES, DType, lookup
from pulsediff.io.fast_entries import built, elements
from pulsediff.errors import CorruptPatchError, UnknownSchemeError
from pulsediff.io.folder_files import MAX_FILE_BYTES, MAX_FILES, is_carried_name
from pulsediff.format.container import FORMAT_MAJOR, MAX_NAME_BYTES, MAX_NDIM, MAX_SECTION_BYTES, MAX_TENSORS, SectionRef

_CHECKSUM = re.compile("[0-9a-f]{16}")  # a section's XXH3-64, lowercase hex
_LOWER_HEX = re.compile("[0-9a-f]*")

OPS = ("same", "patch", "full")  # copy the base tensor / decode against it / carried whole
LAYOUT_KINDS = ("file", "dir")
LAYOUT_CODEC = "zstd"  # the layout blob is one zstd frame of `Layout.blob_len` bytes
FILE_CODEC = "zstd"  # a folder file carried whole: one zstd frame of its bytes
FILE_OPS = ("same", "full")  # the base folder's file as it is / carried whole


@dataclass(frozen=True)
class TensorRecord:
    name: str
    dtype: DType
    shape: tuple[int, ...]
    op: str
    changed: int  # elements that differ from the base (all of them for a tensor with no base)
    target_hash: str
    base_hash: str | None = None  # for "same" and "patch"
    section: SectionRef | None = None  # for "patch" and "full"
    # Format 1.2 (§3.1): word sums, the check a live apply can afford on a GPU. None in older patches.
    target_sum: str | None = None
    base_sum: str | None = None  # with base_hash
    # How both hashes were taken: the patch's digests' scheme (not written: the header's digests say it).
    scheme: DigestScheme = DEFAULT_SCHEME

    # Cached (in the instance's __dict__, beside the fields; not a field): an apply of 18k tensors
    # asked each record for them ten times over, 0.2 s of math.prod.
    @cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @cached_property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def to_json(self) -> dict:
        out = {"name": self.name, "dtype": self.dtype.name, "shape": list(self.shape), "op": self.op,
               "changed": self.changed, "target_hash": self.target_hash}
        if self.base_hash is not None:
            out["base_hash"] = self.base_hash
        if self.target_sum is not None:
            out["target_sum"] = self.target_sum
        if self.base_sum is not None:
            out["base_sum"] = self.base_sum
        if self.section is not None:
            out["section"] = self.section.to_json()
        return out


@dataclass(frozen=True)
class LayoutFile:
    name: str  # shard file name; "" for a single-file checkpoint
    header_len: int  # bytes of its safetensors header inside the layout blob
    tensors: int  # how many consecutive entries of `tensors` live in this file


@dataclass(frozen=True)
class Layout:
    kind: str
    files: tuple[LayoutFile, ...]
    index_len: int | None  # bytes of model.safetensors.index.json in the blob, if any
    section: SectionRef
    digest: str | None = None  # XXH3-128 hex of the blob (format 1.1; None in 1.0 patches)
    # Format 1.5, bf16 patches: whether the trainer's files held tensors the BF16 view casts (§5.2:
    # only then may an applier write the receiver's own layout). None where not written.
    cast: bool | None = None

    @property
    def blob_len(self) -> int:
        return sum(f.header_len for f in self.files) + (self.index_len or 0)

    def to_json(self) -> dict:
        out = {
            "kind": self.kind,
            "files": [{"name": f.name, "header_len": f.header_len, "tensors": f.tensors} for f in self.files],
            "index_len": self.index_len,
            "section": self.section.to_json(),
        }
        if self.digest is not None:
            out["digest"] = self.digest
        if self.cast is not None:
            out["cast"] = self.cast
        return out


@dataclass(frozen=True)
class FileRecord:
    """A target folder's file other than shards and index (config, tokenizer, ...), format 1.1."""

    name: str
    size: int
    hash: str  # XXH3-128 hex of its bytes
    op: str  # "same": the base folder's file; "full": carried whole in `section`
    section: SectionRef | None = None

    def to_json(self) -> dict:
        out = {"name": self.name, "bytes": self.size, "hash": self.hash, "op": self.op}
        if self.section is not None:
            out["section"] = self.section.to_json()
        return out


@dataclass(frozen=True)
class PatchHeader:
    tool: str
    precision: str
    base_digest: str
    target_digest: str
    base_tensors: int
    target_bytes: int  # size of the rebuilt checkpoint's files, headers included
    layout: Layout
    tensors: tuple[TensorRecord, ...]
    removed: tuple[str, ...] = field(default=())
    files: tuple[FileRecord, ...] = field(default=())  # format 1.1: the folder's other files
    removed_files: tuple[str, ...] = field(default=())  # format 1.1: base folder files the target lacks

    @property
    def scheme(self) -> DigestScheme:
        """How the tensor hashes of this patch were taken (its digests' prefix; both share it)."""
        return scheme_of(self.target_digest)

    @property
    def sections_length(self) -> int:
        refs = self.section_refs()
        return refs[-1].offset + refs[-1].length

    def section_refs(self) -> list[SectionRef]:
        return ([self.layout.section] + [t.section for t in self.tensors if t.section is not None]
                + [f.section for f in self.files if f.section is not None])

    def to_json(self, major: int = FORMAT_MAJOR) -> dict:
        """The header as format `major` writes it: 2's tensors as one table of columns (§2.1), 1's
        as one object per tensor."""
        out = {
            "tool": self.tool,
            "precision": self.precision,
            "base": {"digest": self.base_digest, "tensors": self.base_tensors},
            "target": {"digest": self.target_digest, "bytes": self.target_bytes},
            "layout": self.layout.to_json(),
            "tensors": tensor_table(self.tensors) if major >= 2 else [t.to_json() for t in self.tensors],
            "removed": list(self.removed),
        }
        if self.files or self.removed_files:
            out["files"] = [f.to_json() for f in self.files]
            out["removed_files"] = list(self.removed_files)
        return out

    @classmethod
    def from_json(cls, obj: dict, source: str, major: int = FORMAT_MAJOR) -> "PatchHeader":
        """The header of a patch of format `major` (the preamble's), every field checked."""
        return _Parser(source).header(obj, major)


class _Parser:
    """Field-by-field checks; every failure names what was wrong."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, what: str) -> CorruptPatchError:
        return CorruptPatchError(self.source, f"header field {what}")

    def get(self, obj: object, key: str, kind: type | tuple, where: str):
        if not isinstance(obj, dict) or key not in obj:
            raise self.fail(f"{where}.{key} is missing")
        value = obj[key]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise self.fail(f"{where}.{key} has the wrong type")
        return value

    def uint(self, obj, key, where, upper=MAX_SECTION_BYTES) -> int:
        value = self.get(obj, key, int, where)
        if not 0 <= value <= upper:
            raise self.fail(f"{where}.{key} is out of range")
        return value

    def section(self, obj, where: str) -> SectionRef:
        sec = self.get(obj, "section", dict, where)
        checksum = self.get(sec, "xxh3", str, where + ".section")
        if _CHECKSUM.fullmatch(checksum) is None:
            raise self.fail(f"{where}.section.xxh3 is not a checksum")
        codec = self.get(sec, "codec", str, where + ".section")
        params = self.get(sec, "params", dict, where + ".section")
        return SectionRef(self.uint(sec, "offset", where), self.uint(sec, "length", where), checksum, codec, params)

    def header(self, obj: dict, major: int) -> PatchHeader:
        tool = self.get(obj, "tool", str, "")
        precision = self.get(obj, "precision", str, "")
        if precision not in PRECISIONS:
            raise self.fail(f"precision {precision!r} is unknown")
        base = self.get(obj, "base", dict, "")
        target = self.get(obj, "target", dict, "")
        base_digest = self.get(base, "digest", str, "base")
        target_digest = self.get(target, "digest", str, "target")
        for digest in (base_digest, target_digest):
            if not is_digest(digest):
                unknown = unknown_scheme(digest)
                if unknown:  # a later version's hashes: not damage, and not a wrong base either
                    raise UnknownSchemeError(self.source, unknown)
                raise self.fail("digest is malformed")
        if scheme_of(base_digest) != scheme_of(target_digest):
            raise self.fail("base.digest and target.digest are of different schemes")
        scheme = scheme_of(target_digest)
        if major >= 2:
            # The table's sections follow the layout's, which is checked below with the rest.
            layout_section = self.get(self.get(obj, "layout", dict, ""), "section", dict, "layout")
            start = self.uint(layout_section, "offset", "layout") + self.uint(layout_section, "length", "layout")
            tensors = _TableReader(self, scheme).records(self.get(obj, "tensors", dict, ""), start)
        else:
            tensors = tuple(_tensor_checked(t, scheme) or self.tensor(t, i, scheme)
                            for i, t in enumerate(self.list(obj, "tensors", MAX_TENSORS)))
            names = [t.name for t in tensors]
            if len(set(names)) != len(names):
                raise self.fail("tensors names a tensor twice")
            if len({t.target_sum is None for t in tensors}) > 1:  # 1.2: every tensor or none (§3.1)
                raise self.fail("tensors carry word sums for some tensors only")
        # The target digest is the digest of these entries (§3): one that is not names another checkpoint
        # than the entries rebuild (squash wrote such a patch, then failed an assertion).
        if scheme.digest_of_rows((t.name, t.dtype.name, t.shape, t.target_hash) for t in tensors) != target_digest:
            raise self.fail("target.digest is not the digest of the tensor entries")
        removed = tuple(self.name(n, "removed") for n in self.list(obj, "removed", MAX_TENSORS))
        layout = self.layout(self.get(obj, "layout", dict, ""), len(tensors))
        files, removed_files = self.folder_files(obj, layout)
        header = PatchHeader(
            tool=tool, precision=precision, base_digest=base_digest, target_digest=target_digest,
            base_tensors=self.uint(base, "tensors", "base", MAX_TENSORS),
            target_bytes=self.uint(target, "bytes", "target"),
            layout=layout, tensors=tensors, removed=removed, files=files, removed_files=removed_files,
        )
        # target.bytes is what apply will write: a size that disagrees would mislead every reader
        # that plans by it (stats, catch-up's costs).
        written = (sum(8 + f.header_len for f in layout.files) + sum(t.nbytes for t in tensors)
                   + (layout.index_len or 0) + sum(f.size for f in files))
        if header.target_bytes != written:
            raise self.fail("target.bytes contradicts the layout and tensors")
        # Sections lie back to back in header order: no holes, no overlaps.
        expected = 0
        for ref in header.section_refs():
            if ref.offset != expected:
                raise self.fail("sections are not contiguous")
            expected += ref.length
        return header

    def list(self, obj, key, upper) -> list:  # noqa: A003 (the header's lists)
        value = self.get(obj, key, list, "")
        if len(value) > upper:
            raise self.fail(f"{key} is too long")
        return value

    def name(self, value, where) -> str:
        if not isinstance(value, str) or not value or len(value.encode("utf-8")) > MAX_NAME_BYTES:
            raise self.fail(f"{where} has an invalid tensor name")
        return value

    def tensor(self, obj, i: int, scheme: DigestScheme) -> TensorRecord:
        where = f"tensors[{i}]"
        name = self.name(self.get(obj, "name", str, where), where)
        dtype = lookup(self.get(obj, "dtype", str, where))
        if dtype is None:
            raise self.fail(f"{where}.dtype is unknown")
        shape = self.get(obj, "shape", list, where)
        if len(shape) > MAX_NDIM or not all(type(d) is int and 0 <= d < 2**63 for d in shape):
            raise self.fail(f"{where}.shape is invalid")
        if math.prod(shape) * dtype.itemsize > MAX_SECTION_BYTES:
            raise self.fail(f"{where}.shape is implausibly large")
        op = self.get(obj, "op", str, where)
        if op not in OPS:
            raise self.fail(f"{where}.op {op!r} is unknown")
        changed = self.uint(obj, "changed", where, math.prod(shape))
        if (op == "same" and changed != 0) or (op == "patch" and changed == 0):
            raise self.fail(f"{where}.changed contradicts its op")
        target_hash = self.get(obj, "target_hash", str, where)
        base_hash = obj.get("base_hash")
        if not is_tensor_hash(target_hash) or (op != "full" and not is_tensor_hash(base_hash)):
            raise self.fail(f"{where} has a malformed tensor hash")
        target_sum, base_sum = self.word_sums(obj, where, op)
        section = self.section(obj, where) if op != "same" else None
        if section is not None:
            codec = facts_of(section.codec)
            if op == "patch" and not codec.needs_base:
                raise self.fail(f"{where}: codec {section.codec!r} cannot patch")
            if op == "full" and codec.needs_base:  # it would be decoded with no base to decode against
                raise self.fail(f"{where}: codec {section.codec!r} cannot carry a whole tensor")
            if codec.changed_count(section.params) not in (None, changed):
                raise self.fail(f"{where}: the codec's count contradicts changed")
            if not 0 <= codec.index_bytes(section.params) <= section.length:
                raise self.fail(f"{where}: the codec's index size is invalid")
        return TensorRecord(name, dtype, tuple(shape), op, changed, target_hash, base_hash if op != "full" else None,
                            section, target_sum, base_sum, scheme)

    def word_sums(self, obj: dict, where: str, op: str) -> tuple[str | None, str | None]:
        """Format 1.2's target_sum and base_sum (§3.1): both or neither; no base_sum for a tensor
        carried whole; a `same` tensor's two sums are one."""
        target_sum, base_sum = obj.get("target_sum"), obj.get("base_sum")
        if target_sum is None and base_sum is None:
            return None, None
        if not is_word_sum(target_sum) or (op == "full") != (base_sum is None) or \
                (base_sum is not None and not is_word_sum(base_sum)):
            raise self.fail(f"{where} has malformed or missing word sums")
        if op == "same" and base_sum != target_sum:
            raise self.fail(f"{where}: a tensor kept the same has two word sums")
        return target_sum, base_sum

    def layout(self, obj, n_tensors: int) -> Layout:
        kind = self.get(obj, "kind", str, "layout")
        if kind not in LAYOUT_KINDS:
            raise self.fail(f"layout.kind {kind!r} is unknown")
        files = []
        for i, f in enumerate(self.get(obj, "files", list, "layout")):
            where = f"layout.files[{i}]"
            name = self.get(f, "name", str, where)
            if (kind == "file") != (name == "") or (name and not (is_plain_filename(name) and name.endswith(".safetensors"))):
                raise self.fail(f"{where}.name {name!r} is not allowed")
            files.append(LayoutFile(name, self.uint(f, "header_len", where, 100_000_000), self.uint(f, "tensors", where, MAX_TENSORS)))
        if kind == "file" and len(files) != 1:
            raise self.fail("layout of a single-file checkpoint must list one file")
        if len({f.name for f in files}) != len(files):
            raise self.fail("layout names a file twice")
        if sum(f.tensors for f in files) != n_tensors:
            raise self.fail("layout does not account for every tensor")
        index_len = obj.get("index_len")
        if index_len is not None:
            index_len = self.uint(obj, "index_len", "layout", 64 * 1024 * 1024)
            if kind != "dir":
                raise self.fail("layout.index_len is only allowed for a folder")
        section = self.section(obj, "layout")
        if section.codec != LAYOUT_CODEC:
            raise self.fail(f"layout.section.codec must be {LAYOUT_CODEC!r}")
        digest = obj.get("digest")
        if digest is not None and not is_tensor_hash(digest):
            raise self.fail("layout.digest is not a hash")
        cast = obj.get("cast")
        if cast is not None and type(cast) is not bool:
            raise self.fail("layout.cast is not true or false")
        return Layout(kind, tuple(files), index_len, section, digest, cast)

    def folder_files(self, obj: dict, layout: Layout) -> tuple[tuple[FileRecord, ...], tuple[str, ...]]:
        """Format 1.1's `files` and `removed_files`: absent in 1.0 patches, only for folders."""
        if "files" not in obj and "removed_files" not in obj:
            return (), ()
        if layout.kind != "dir":
            raise self.fail("files is only allowed for a folder")
        taken = {f.name for f in layout.files}
        records = []
        for i, f in enumerate(self.list(obj, "files", MAX_FILES)):
            where = f"files[{i}]"
            name = self.get(f, "name", str, where)
            if not is_carried_name(name) or name in taken:
                raise self.fail(f"{where}.name {name!r} is not allowed")
            taken.add(name)
            size = self.uint(f, "bytes", where, MAX_FILE_BYTES)
            digest = self.get(f, "hash", str, where)
            if not is_tensor_hash(digest):
                raise self.fail(f"{where}.hash is not a hash")
            op = self.get(f, "op", str, where)
            if op not in FILE_OPS:
                raise self.fail(f"{where}.op {op!r} is unknown")
            section = None
            if op == "full":
                section = self.section(f, where)
                if section.codec != FILE_CODEC:
                    raise self.fail(f"{where}.section.codec must be {FILE_CODEC!r}")
            elif "section" in f:
                raise self.fail(f"{where} has a section but op 'same'")
            records.append(FileRecord(name, size, digest, op, section))
        removed = []
        for name in self.list(obj, "removed_files", MAX_FILES):
            if not isinstance(name, str) or not is_carried_name(name) or name in taken:
                raise self.fail(f"removed_files names {name!r}, which is not allowed")
            taken.add(name)
            removed.append(name)
        return tuple(records), tuple(removed)


# -- the common case at the speed of the JSON parse -----------------------------------------

def _tensor_checked(obj: object, scheme: DigestScheme) -> TensorRecord | None:
    """A tensor entry as `_Parser.tensor` reads it, by the same checks written for speed (a header of
    18k expert tensors is read on every apply), or None for anything out of the ordinary, which
    `_Parser.tensor` then reads again and refuses in its own words. It accepts only what that
    accepts (tests/test_header_fast.py holds the two together on valid and edited entries)."""
    if type(obj) is not dict:
        return None
    name, dtype, shape, op, changed = obj.get("name"), obj.get("dtype"), obj.get("shape"), obj.get("op"), obj.get("changed")
    target_hash, base_hash = obj.get("target_hash"), obj.get("base_hash")
    target_sum, base_sum, section = obj.get("target_sum"), obj.get("base_sum"), obj.get("section")
    if type(name) is not str or not name or type(dtype) is not str or type(shape) is not list \
            or type(op) is not str or type(changed) is not int or type(target_hash) is not str:
        return None
    if not name.isascii() or len(name) > MAX_NAME_BYTES:  # others (their UTF-8 length): the parser
        return None
    dtype = DTYPES.get(dtype)
    if dtype is None or len(shape) > MAX_NDIM:
        return None
    numel = elements(shape)
    if numel < 0 or numel * dtype.itemsize > MAX_SECTION_BYTES or not 0 <= changed <= numel:
        return None
    hexes = target_hash
    if op == "patch":
        if changed == 0 or type(base_hash) is not str or type(section) is not dict:
            return None
        hexes += base_hash
    elif op == "same":
        if changed != 0 or type(base_hash) is not str or section is not None:
            return None
        hexes += base_hash
    elif op == "full":
        if type(section) is not dict:
            return None
        base_hash = None
    else:
        return None
    if target_sum is not None or base_sum is not None:
        if type(target_sum) is not str or len(target_sum) != 16 or (op == "full") != (base_sum is None):
            return None
        hexes += target_sum
        if base_sum is not None:
            if type(base_sum) is not str or len(base_sum) != 16 or (op == "same" and base_sum != target_sum):
                return None
            hexes += base_sum
    if len(target_hash) != 32 or (base_hash is not None and len(base_hash) != 32):
        return None
    ref = None
    if section is not None:
        offset, length, checksum = section.get("offset"), section.get("length"), section.get("xxh3")
        codec, params = section.get("codec"), section.get("params")
        if type(offset) is not int or type(length) is not int or type(checksum) is not str \
                or len(checksum) != 16 or type(codec) is not str or type(params) is not dict \
                or not 0 <= offset <= MAX_SECTION_BYTES or not 0 <= length <= MAX_SECTION_BYTES:
            return None
        facts = FACTS.get(codec)
        if facts is None or facts.needs_base != (op == "patch") \
                or facts.changed_count(params) not in (None, changed) \
                or not 0 <= facts.index_bytes(params) <= length:
            return None
        hexes += checksum
        ref = built(SectionRef, {"offset": offset, "length": length, "checksum": checksum, "codec": codec,
                                 "params": params})
    if _LOWER_HEX.fullmatch(hexes) is None:
        return None
    return built(TensorRecord, {"name": name, "dtype": dtype, "shape": tuple(shape), "op": op, "changed": changed,
                                "target_hash": target_hash, "base_hash": base_hash, "section": ref,
                                "target_sum": target_sum, "base_sum": base_sum, "scheme": scheme,
                                "numel": numel, "nbytes": numel * dtype.itemsize})  # TensorRecord's cache


# -- format 2.0's tensor table (FORMAT.md §2.1) ----------------------------------------------
#
# One JSON array per field, a row per tensor, instead of one object per tensor: an MoE checkpoint's
# 18k expert entries were 10 MB of objects (0.21 s of JSON parse on every read, 0.65 s of CPU to
# open the header). As columns the JSON is 4.5 MB and parses in 0.06 s, and each column is checked
# whole by a few C-level passes (types by set(map(type, ...)), hex digits by one regex over the
# column joined): the header opens in 0.34 s.

_NONE = type(None)
# Params keys a table may hold (FORMAT.md §9): the codecs use at most 8. Each key is a column of a
# row per section, so without a bound a 477 KB patch of zeros in 62 columns took 4.2 GB to refuse.
MAX_PARAMS_KEYS = 16


def _shown(value: object) -> str:
    """A value from the patch in a one-line message: its repr (escapes and all), cut short."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def tensor_table(records) -> dict:
    """Tensor records as format 2.0's table. The sections' rows are those of the tensors that
    have one, in order; their offsets are not written (they lie back to back after the layout's)."""
    sections = [t.section for t in records if t.section is not None]
    for prev, ref in zip(sections, sections[1:]):
        if ref.offset != prev.offset + prev.length:  # a reader derives offsets from the lengths
            raise ValueError("the tensor table needs sections back to back")
    keys = list(dict.fromkeys(key for ref in sections for key in ref.params))
    table = {
        "name": [t.name for t in records],
        "dtype": [t.dtype.name for t in records],
        "ndim": [len(t.shape) for t in records],
        "dims": [d for t in records for d in t.shape],
        "op": [t.op for t in records],
        "changed": [t.changed for t in records],
        "target_hash": [t.target_hash for t in records],
        "base_hash": [t.base_hash for t in records],
    }
    if records and records[0].target_sum is not None:
        table["target_sum"] = [t.target_sum for t in records]
        table["base_sum"] = [t.base_sum for t in records]
    table["section"] = {
        "length": [ref.length for ref in sections],
        "xxh3": [ref.checksum for ref in sections],
        "codec": [ref.codec for ref in sections],
        "params": {key: [ref.params.get(key) for ref in sections] for key in keys},
    }
    return table


class _TableReader:
    """Format 2.0's tensor table read into TensorRecords, by the same rules as a 1.x entry
    (_Parser.tensor), each checked over a whole column."""

    def __init__(self, parser: _Parser, scheme: DigestScheme):
        self.parser, self.scheme = parser, scheme

    def fail(self, what: str) -> CorruptPatchError:
        return self.parser.fail(f"tensors.{what}")

    def column(self, obj: dict, key: str, kinds: set, rows: int | None, where: str = "") -> list:
        value = obj.get(key)
        named = key if key.isidentifier() else _shown(key)  # a params key is the patch's: shown escaped
        if type(value) is not list:
            raise self.fail(f"{where}{named} is missing or not a list")
        if rows is not None and len(value) != rows:
            raise self.fail(f"{where}{named} has {len(value)} rows, not {rows}")
        if not set(map(type, value)) <= kinds:
            raise self.fail(f"{where}{named} holds a value of the wrong type")
        return value

    def hexes(self, values: list, width: int, key: str, what: str) -> None:
        if not set(map(len, values)) <= {width} or _LOWER_HEX.fullmatch("".join(values)) is None:
            raise self.fail(f"{key} holds {what}")

    def records(self, obj: dict, start: int) -> tuple[TensorRecord, ...]:
        """The table's records; `start`: where its first section lies (after the layout's)."""
        names = self.column(obj, "name", {str}, None)
        n = len(names)
        if n > MAX_TENSORS:
            raise self.fail("name is too long")
        dtype_names = self.column(obj, "dtype", {str}, n)
        ops = self.column(obj, "op", {str}, n)
        changed = self.column(obj, "changed", {int}, n)
        ndims = self.column(obj, "ndim", {int}, n)
        dims = self.column(obj, "dims", {int}, None)
        target_hashes = self.column(obj, "target_hash", {str}, n)
        base_hashes = self.column(obj, "base_hash", {str, _NONE}, n)

        if n and min(map(len, names)) == 0:
            raise self.fail("name holds an invalid tensor name")
        longest = max(map(len, names), default=0) if "".join(names).isascii() else \
            max(len(name.encode("utf-8")) for name in names)
        if longest > MAX_NAME_BYTES:
            raise self.fail("name holds an invalid tensor name")
        if len(set(names)) != n:
            raise self.fail("name names a tensor twice")
        if not set(dtype_names) <= DTYPES.keys():
            raise self.fail(f"dtype {_shown(sorted(set(dtype_names) - DTYPES.keys())[0])} is unknown")
        dtypes = [DTYPES[d] for d in dtype_names]
        if not set(ops) <= set(OPS):
            raise self.fail(f"op {_shown(sorted(set(ops) - set(OPS))[0])} is unknown")

        if n and (min(ndims) < 0 or max(ndims) > MAX_NDIM) or sum(ndims) != len(dims):
            raise self.fail("ndim does not give a valid shape")
        if dims and (min(dims) < 0 or max(dims) >= 2**63):
            raise self.fail("dims holds an invalid shape")
        shapes, at = [], 0
        for k in ndims:
            shapes.append(tuple(dims[at:at + k]))
            at += k
        numels = list(map(math.prod, shapes))
        if n and max(numel * d.itemsize for numel, d in zip(numels, dtypes)) > MAX_SECTION_BYTES:
            raise self.fail("dims holds an implausibly large shape")
        for op, count, numel in zip(ops, changed, numels):
            if not 0 <= count <= numel or (op == "same" and count != 0) or (op == "patch" and count == 0):
                raise self.fail("changed contradicts an op or a shape")

        full = [op == "full" for op in ops]
        if [h is None for h in base_hashes] != full:
            raise self.fail("base_hash is null where it is needed, or given for a tensor carried whole")
        self.hexes(target_hashes, 32, "target_hash", "a malformed tensor hash")
        self.hexes([h for h in base_hashes if h is not None], 32, "base_hash", "a malformed tensor hash")
        target_sums, base_sums = self.word_sums(obj, n, ops, full)
        sections = self.sections(obj, ops, changed, start)
        scheme, has_section = self.scheme, iter(sections)
        return tuple(built(TensorRecord, {
            "name": names[i], "dtype": dtypes[i], "shape": shapes[i], "op": ops[i], "changed": changed[i],
            "target_hash": target_hashes[i], "base_hash": base_hashes[i],
            "section": next(has_section) if ops[i] != "same" else None,
            "target_sum": target_sums[i], "base_sum": base_sums[i], "scheme": scheme,
            "numel": numels[i], "nbytes": numels[i] * dtypes[i].itemsize}) for i in range(n))

    def word_sums(self, obj: dict, n: int, ops: list, full: list) -> tuple[list, list]:
        """Format 1.2's word sums (§3.1), both columns or neither, as a 1.x entry's."""
        if obj.get("target_sum") is None and obj.get("base_sum") is None:
            return [None] * n, [None] * n
        if type(obj.get("target_sum")) is list and None in obj["target_sum"]:  # 1.2: every tensor or none (§3.1)
            raise self.fail("target_sum: tensors carry word sums for some tensors only")
        target_sums = self.column(obj, "target_sum", {str}, n)
        base_sums = self.column(obj, "base_sum", {str, _NONE}, n)
        if [s is None for s in base_sums] != full:
            raise self.fail("base_sum is null where it is needed, or given for a tensor carried whole")
        self.hexes(target_sums, 16, "target_sum", "a malformed word sum")
        self.hexes([s for s in base_sums if s is not None], 16, "base_sum", "a malformed word sum")
        if any(op == "same" and b != t for op, b, t in zip(ops, base_sums, target_sums)):
            raise self.fail("base_sum: a tensor kept the same has two word sums")
        return target_sums, base_sums

    def sections(self, obj: dict, ops: list, changed: list, start: int) -> list[SectionRef]:
        """The sections of the tensors that have one (op patch or full), in order, back to back
        from `start`."""
        section = obj.get("section")
        if type(section) is not dict:
            raise self.fail("section is missing or not an object")
        owners = [i for i, op in enumerate(ops) if op != "same"]
        m = len(owners)
        lengths = self.column(section, "length", {int}, m, "section.")
        checksums = self.column(section, "xxh3", {str}, m, "section.")
        codecs = self.column(section, "codec", {str}, m, "section.")
        params = section.get("params")
        if type(params) is not dict:
            raise self.fail("section.params is missing or not an object")
        if len(params) > MAX_PARAMS_KEYS:
            raise self.fail(f"section.params has {len(params)} keys, more than {MAX_PARAMS_KEYS}")
        columns = [self.column(params, key, {int, _NONE}, m, "section.params.") for key in params]
        if m and (min(lengths) < 0 or max(lengths) > MAX_SECTION_BYTES):
            raise self.fail("section.length is out of range")
        for values in columns:
            present = [v for v in values if v is not None]
            if present and (min(present) < 0 or max(present) >= 2**63):
                raise self.fail("section.params holds a value out of range")
        self.hexes(checksums, 16, "section.xxh3", "a value that is not a checksum")
        by_key = dict(zip(params, columns))
        for codec_id in set(codecs):  # each codec's rules over its rows at once (an unknown codec refused here)
            codec = facts_of(codec_id)
            rows = [j for j, c in enumerate(codecs) if c == codec_id]
            if any((ops[owners[j]] == "patch") != codec.needs_base for j in rows):
                raise self.fail(f"section.codec: {codec_id!r} cannot "
                                f"{'patch' if codec.needs_base is False else 'carry a whole tensor'}")
            if codec.count_key is not None:
                counts = by_key.get(codec.count_key, [None] * m)
                if any(counts[j] != changed[owners[j]] for j in rows):
                    raise self.fail("section.params: the codec's count contradicts changed")
            sizes = [by_key.get(key, [None] * m) for key in codec.index_keys]
            limits = lengths
            if len(rows) < m:  # the codec's rows only
                sizes, limits = [[size[j] for j in rows] for size in sizes], [lengths[j] for j in rows]
            # Each row's index bytes, the sum of its index keys' values, within its section's length.
            if any(None in size for size in sizes) or any(map(operator.gt, map(sum, zip(*sizes)), limits)):
                raise self.fail("section.params: the codec's index size is invalid")
        keys = list(by_key)
        if any(None in values for values in columns):  # each section's params: its non-null cells
            each = [{key: v for key, v in zip(keys, row) if v is not None} for row in zip(*columns)]
        else:
            each = [dict(zip(keys, row)) for row in zip(*columns)] if columns else [{} for _ in range(m)]
        offsets = list(itertools.accumulate(lengths, initial=start))
        if m and offsets[m - 1] > MAX_SECTION_BYTES:  # where the last one starts: bounded as 1.x's offsets
            raise self.fail("section.length: the sections reach past the format's bound")
        return [built(SectionRef, {"offset": offsets[j], "length": lengths[j], "checksum": checksums[j],
                                   "codec": codecs[j], "params": each[j]}) for j in range(m)]
