"""The header's fast reading of a tensor entry (header._tensor_checked) against the field-by-field
one (_Parser.tensor): on every entry of the golden patches they build the same record, and on
entries edited field by field the fast one accepts nothing the other refuses (anything out of the
ordinary it hands back, to be refused in the parser's own words)."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
import zstandard

from pulsediff.errors import PulsediffError
from pulsediff.format.container import PREAMBLE
from pulsediff.format.digest import DEFAULT_SCHEME
from pulsediff.format.header import _Parser, _tensor_checked

GOLDEN = sorted(Path("tests/golden").glob("*/*.pulsediff"))

# Values an edit puts in a field: wrong types, edges of each range, other ops and codecs.
HOSTILE = [None, True, False, 0, 1, -1, 2**63, 2**64, 1.0, "", "x", "patch", "same", "full", "BF16", "F32",
           "ctx-rans", "gap-zstd", "full-zstd", "ctx-ac", "ab" * 8, "AB" * 8, "0" * 32, "g" * 32, "0" * 16,
           [], [0], [2, 3], [-1], [True], [2**40, 2**40], {}, {"count": 1}, "é" * 2000, "é", "\ud800"]


def _entries(path: Path) -> list[dict]:
    """A golden patch's tensor entries (a 2.0 table's as 1.x's entries)."""
    from fuzz_cases import table_entries

    data = path.read_bytes()
    major, header_len = PREAMBLE.unpack(data[:32])[1], PREAMBLE.unpack(data[:32])[4]
    header = json.loads(zstandard.ZstdDecompressor().decompress(data[32:32 + header_len]))
    if major >= 2:
        layout = header["layout"]["section"]
        return table_entries(header["tensors"], layout["offset"] + layout["length"])
    return header["tensors"]


def _slow(entry):
    """What the field-by-field reading makes of an entry: its record, or the error it raises."""
    try:
        return _Parser("<test>").tensor(entry, 0, DEFAULT_SCHEME)
    except PulsediffError as exc:
        return exc


def test_the_golden_patches_have_entries_of_every_op_and_codec():
    entries = [e for path in GOLDEN for e in _entries(path)]
    assert {e["op"] for e in entries} == {"same", "patch", "full"}
    assert {e["section"]["codec"] for e in entries if "section" in e} >= {"ctx-rans", "ctx-ac", "gap-zstd",
                                                                         "full-zstd"}


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_fast_reading_builds_the_parsers_record(path):
    for entry in _entries(path):
        fast = _tensor_checked(entry, DEFAULT_SCHEME)
        assert fast is not None, entry["name"]
        assert fast == _slow(entry)


def _edits(entry: dict, rng: random.Random):
    """The entry with one field (of the entry, its section or its params) set to a hostile value,
    or removed."""
    places = [(None, key) for key in list(entry) + ["base_hash", "target_sum", "base_sum", "section"]]
    if isinstance(entry.get("section"), dict):
        places += [("section", key) for key in entry["section"]]
        places += [("params", key) for key in entry["section"]["params"]]
    for where, key in places:
        for value in rng.sample(HOSTILE, 8) + ["<remove>"]:
            edited = copy.deepcopy(entry)
            target = {None: edited, "section": edited.get("section"),
                      "params": (edited.get("section") or {}).get("params")}[where]
            if value == "<remove>":
                target.pop(key, None)
            else:
                target[key] = value
            yield edited


@pytest.mark.parametrize("path", GOLDEN[::3], ids=lambda p: f"{p.parent.name}/{p.name}")
def test_fast_reading_accepts_no_edit_the_parser_refuses(path):
    rng = random.Random(path.name)
    accepted = refused = 0
    for entry in _entries(path):
        for edited in _edits(entry, rng):
            fast = _tensor_checked(edited, DEFAULT_SCHEME)
            if fast is None:
                refused += 1
                continue
            accepted += 1
            assert fast == _slow(edited), edited
    assert accepted and refused  # both kinds of edit were met


def _layout_headers(path: Path):
    """(raw safetensors header, its tensor records) for each file of a golden patch's layout."""
    from pulsediff.format.patch_file import open_patch, read_layout

    with open(path, "rb") as f:
        reader, header, owned = open_patch(f)
        blob = read_layout(reader, header, sequential=False)
    pos = first = 0
    for lf in header.layout.files:
        yield blob[pos:pos + lf.header_len], header.tensors[first:first + lf.tensors]
        pos, first = pos + lf.header_len, first + lf.tensors


def _parsed_agrees(raw: bytes, records) -> bool:
    from pulsediff.io.safetensors_header import HeaderError, parse_header

    try:
        parsed = parse_header(raw, sum(r.nbytes for r in records))
    except HeaderError:
        return False
    return [(e.name, e.dtype.name, e.shape) for e in parsed.tensors] == [(r.name, r.dtype.name, r.shape)
                                                                          for r in records]


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_layout_headers_are_read_in_one_pass_and_edits_go_to_the_parser(path):
    from pulsediff.format.patch_file import _describes_in_order

    rng = random.Random(path.name)
    accepted = 0
    for raw, records in _layout_headers(path):
        assert _describes_in_order(raw, records) and _parsed_agrees(raw, records)
        obj = json.loads(raw)
        names = [k for k in obj if k != "__metadata__"]
        for _ in range(60):
            edited = copy.deepcopy(obj)
            name = rng.choice(names)
            field = rng.choice(["dtype", "shape", "data_offsets", "<swap>", "<metadata>", "<extra>"])
            if field == "<swap>" and len(names) > 1:  # two entries' order in the JSON object
                edited = {k: edited[k] for k in sorted(edited, key=lambda k: rng.random())}
            elif field == "<metadata>":
                edited["__metadata__"] = rng.choice([{"a": 1}, [], "x", {"a": "b"}])
            elif field == "<extra>":
                edited[name]["extra"] = rng.choice(HOSTILE)
            elif field in ("dtype", "shape", "data_offsets"):
                edited[name][field] = rng.choice(HOSTILE + [[0, 0], [0, 2**40]])
            data = json.dumps(edited).encode()
            if _describes_in_order(data, records):
                accepted += 1
                assert _parsed_agrees(data, records), edited
    assert accepted  # edits that keep the header right (metadata of strings, extra keys) were met


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_layout_headers_as_safetensors_writes_them_are_matched_as_bytes(path):
    """_is_canonical: a layout header exactly as safetensors writes it is recognised without a JSON
    parse; a byte edited anywhere in it (or metadata spelled another way) is recognised only where
    parse_header describes the same tensors (else it goes to the full reading)."""
    from pulsediff.format.patch_file import _is_canonical

    rng = random.Random(path.name)
    for raw, records in _layout_headers(path):
        assert _is_canonical(raw, records)
        kept = 0
        for _ in range(300):
            data = bytearray(raw)
            at = rng.randrange(len(data))
            data[at] = rng.choice(b' {}[],:"\\0129aBz\x00\xff')
            for edited in (bytes(data), b'{"__metadata__":{"a":"b"},' + bytes(raw[1:]),
                           b'{"__metadata__":{"a":1},' + bytes(raw[1:]), b'{"__metadata__" : {},' + bytes(raw[1:])):
                if _is_canonical(edited, records):
                    kept += 1
                    assert _parsed_agrees(edited, records), edited[:200]
        assert kept  # some edits keep it right (the metadata variants, a flip inside the padding)


def _build_header_reference(metadata, tensors) -> bytes:
    """build_header as one json.dumps of the whole object (the spelling it must keep)."""
    obj = {} if metadata is None else {"__metadata__": dict(metadata)}
    offset = 0
    for name, dtype, shape, nbytes in tensors:
        obj[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return raw + b" " * ((-(8 + len(raw))) % 8)


def test_build_header_spells_headers_as_one_json_dumps_would():
    """build_header writes its entries itself (io/safetensors_header.canonical_entries, which the
    layout's byte match shares): byte for byte one json.dumps of the object, on random names."""
    from pulsediff.io.safetensors_header import build_header

    rng = random.Random(17)
    alphabet = ["a", "Z", "0", ".", "_", '"', "\\", "/", "\n", "\t", "\x00", "\x1f", "\x7f", "é", "€", "\u2028",
                "😀", " ", "{", "}", ",", ":"]
    for case in range(300):
        names = {"".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 12))) for _ in range(rng.randrange(0, 8))}
        if case % 7 == 0:
            names.add("__metadata__")
        tensors = [(n, rng.choice(["BF16", "F32", "U8"]), tuple(rng.randrange(0, 5) for _ in range(rng.randrange(0, 4))),
                    rng.randrange(0, 100)) for n in names]
        metadata = rng.choice([None, {}, {"format": "pt"}, {rng.choice(alphabet): rng.choice(alphabet), "k": "v"}])
        assert build_header(metadata, tensors) == _build_header_reference(metadata, tensors), (metadata, tensors)
