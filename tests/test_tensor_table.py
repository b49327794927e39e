"""Format 2.0's tensor table (FORMAT.md §2.1): the same records as 1.5's entries, every malformed
column refused in one line, and nothing accepted that the entries' reader refuses."""

from __future__ import annotations

import copy
import io
import json
import random
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import pulsediff
from pulsediff.cli.main import app
from pulsediff.errors import CorruptPatchError, PulsediffError, UnknownCodecError
from pulsediff.format.container import PREAMBLE
from pulsediff.format.header import PatchHeader, tensor_table
from pulsediff.format.patch_file import open_patch
from pulsediff.io import strict_json

from ckpt_factory import mutate, random_tensor, save
from fuzz_cases import entries_table, table_entries
from test_header_fast import _edits

GOLDEN = sorted(Path("tests/golden").glob("*/*.pulsediff"))


@pytest.fixture(scope="module")
def header() -> PatchHeader:
    """A header with every op, word sums, and two codecs' params (a patch and a full-zstd section)."""
    rng = np.random.default_rng(11)
    old = {"a": random_tensor(rng, "BF16", (64, 4)), "b": random_tensor(rng, "F32", (48,)),
           "c": random_tensor(rng, "I32", (5,)), "d": random_tensor(rng, "BF16", (3, 2, 2))}
    new = {"a": mutate(rng, old["a"], 0.1), "b": random_tensor(rng, "F32", (48,)), "c": old["c"].clone(),
           "d": mutate(rng, old["d"], 0.5), "e": random_tensor(rng, "U8", (0,))}
    _, header, _ = open_patch(io.BytesIO(pulsediff.make_patch_bytes(old, new)))
    assert {t.op for t in header.tensors} == {"same", "patch", "full"} and header.tensors[0].target_sum
    return header


def _parse(obj: dict, major: int = 2):
    try:
        return PatchHeader.from_json(obj, "p", major)
    except PulsediffError as exc:
        return exc


def test_the_table_reads_back_to_the_same_header(header):
    assert PatchHeader.from_json(header.to_json(2), "p", 2) == header
    assert PatchHeader.from_json(header.to_json(1), "p", 1) == header


def test_the_table_is_the_entries_as_the_spec_says(header):
    """The tests' own reading of §2.1 (fuzz_cases.table_entries) gives 1.x's entries, offsets and all."""
    entries = header.to_json(1)["tensors"]
    layout = header.layout.section
    assert table_entries(header.to_json(2)["tensors"], layout.offset + layout.length) == entries
    assert entries_table(entries) == tensor_table(header.tensors)


@pytest.mark.parametrize("path", [p for p in GOLDEN if p.parent.name == "v2.0"], ids=lambda p: p.name)
def test_golden_tables_read_as_their_entries(path):
    with open(path, "rb") as f:
        reader, header, _ = open_patch(f)
    assert reader.version == (2, 0)
    assert PatchHeader.from_json(header.to_json(1), "p", 1) == header


def test_each_majors_form_is_refused_under_the_other(header):
    assert "tensors has the wrong type" in str(_parse(header.to_json(1), 2))
    assert "tensors has the wrong type" in str(_parse(header.to_json(2), 1))


def _table_edit(obj: dict, path: str, value):
    """Set (or with value "<remove>", remove) the table's field at dotted `path`; an int after a
    column name is a row."""
    *parents, last = path.split(".")
    target = obj["tensors"]
    for key in parents:
        target = target[int(key)] if key.isdigit() else target[key]
    key = int(last) if last.isdigit() else last
    if value == "<remove>":
        target.pop(key)
    else:
        target[key] = value


# (path, value, words of the one-line refusal)
TABLE_EDITS = [
    ("name", "<remove>", "tensors.name is missing"),
    ("dtype", "BF16", "tensors.dtype is missing or not a list"),
    ("op.0", None, "tensors.op holds a value of the wrong type"),
    ("changed.1", True, "tensors.changed holds a value of the wrong type"),
    ("changed.1", 1.0, "wrong type"),
    ("ndim", [1, 1], "tensors.ndim has 2 rows, not 5"),
    ("ndim.0", 3, "ndim does not give a valid shape"),
    ("ndim.0", 65, "ndim does not give a valid shape"),
    ("ndim.0", -1, "ndim does not give a valid shape"),
    ("dims.0", -4, "dims holds an invalid shape"),
    ("dims.0", 2**63, "dims holds an invalid shape"),
    ("dims.0", 2**47, "implausibly large"),  # F32: 2**49 bytes
    ("name.1", "a", "twice"),
    ("name.1", "", "invalid tensor name"),
    ("name.1", "é" * 2049, "invalid tensor name"),
    ("dtype.0", "Q9", "dtype 'Q9' is unknown"),
    ("op.0", "rm", "op 'rm' is unknown"),
    ("target_hash.0", "AB" * 16, "malformed tensor hash"),
    ("target_hash.0", "ab" * 15, "malformed tensor hash"),
    ("base_hash.1", None, "base_hash is null where it is needed"),
    ("base_hash.0", "ab" * 16, "given for a tensor carried whole"),
    ("target_sum", "<remove>", "tensors.target_sum is missing"),
    ("base_sum.2", "0" * 15, "malformed word sum"),
    ("base_sum.2", "<remove>", "has 4 rows"),
    ("section", [], "section is missing or not an object"),
    ("section.length", [1], "has 1 rows"),
    ("section.length.0", -1, "section.length is out of range"),
    ("section.length.0", 2**49, "section.length is out of range"),
    ("section.xxh3.0", "x" * 16, "not a checksum"),
    ("section.codec.0", "lzma-9000", "unknown codec"),
    ("section.params", [], "section.params is missing or not an object"),
    ("section.params.count", [1], "section.params.count has 1 rows"),
    ("section.params.count.0", "12", "section.params.count holds a value of the wrong type"),
    ("section.params.count.0", 2**63, "out of range"),
    ("section.params.count.1", 10**12, "count contradicts changed"),
    ("section.params.count.1", None, "count contradicts changed"),
    ("section.params.table_bytes.1", 10**9, "index size is invalid"),
    ("section.params.table_bytes.1", None, "index size is invalid"),
]


@pytest.mark.parametrize("path, value, words", TABLE_EDITS, ids=[f"{p}={v!r}"[:40] for p, v, _ in TABLE_EDITS])
def test_a_malformed_table_is_refused_in_one_line(header, path, value, words):
    obj = header.to_json(2)
    assert obj["tensors"]["op"] == ["full", "same", "patch", "full", "full"]  # the rows the edits name
    assert obj["tensors"]["section"]["codec"][1] == "ctx-rans"
    _table_edit(obj, path, value)
    with pytest.raises((CorruptPatchError, UnknownCodecError), match=words) as caught:
        PatchHeader.from_json(obj, "p", 2)
    assert "\n" not in str(caught.value)


def test_a_table_naming_the_wrong_op_for_its_codec_is_refused(header):
    obj = header.to_json(2)
    obj["tensors"]["section"]["codec"] = ["full-zstd", "full-zstd", "full-zstd", "full-zstd"]
    assert "cannot patch" in str(_parse(obj))
    obj = header.to_json(2)
    obj["tensors"]["op"][0] = "patch"  # a full-zstd section under a patch op
    assert isinstance(_parse(obj), CorruptPatchError)


@pytest.mark.parametrize("path", GOLDEN[::2], ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_table_accepts_no_edit_the_entries_reader_refuses(path):
    """Each entry of a golden patch edited field by field (test_header_fast's edits), the whole
    header then read as entries (1.5) and as a table (2.0): where the table is accepted, the entries
    are too, into the same records. The table may refuse more (params are counts only)."""
    with open(path, "rb") as f:
        _, header, _ = open_patch(f)
    base = header.to_json(1)
    rng = random.Random(path.name)
    accepted = refused = 0
    for i, entry in enumerate(base["tensors"]):
        for edited in _edits(entry, rng):
            obj = copy.deepcopy(base)
            obj["tensors"][i] = edited
            as_table = dict(obj, tensors=entries_table(obj["tensors"]))
            try:  # as a reader gets it: strict JSON refuses a lone surrogate before any field is read
                table = _parse(strict_json.loads(json.dumps(as_table).encode()))
            except strict_json.JsonError:
                table = None
            if table is None or isinstance(table, PulsediffError):
                refused += 1
                continue
            accepted += 1
            for entry_k, record in zip(obj["tensors"], table.tensors):  # a table has no offsets: the
                if isinstance(entry_k.get("section"), dict) and record.section is not None:  # lengths place them
                    entry_k["section"]["offset"] = record.section.offset
            if isinstance(edited.get("section"), dict) and table.tensors[i].section is not None:
                params = edited["section"]["params"]  # a table's null is an absent key (both refused at decode)
                edited["section"]["params"] = {k: v for k, v in params.items() if v is not None}
            assert _parse(obj, 1) == table, edited
    assert accepted and refused


def test_make_writes_either_major_and_both_apply(tmp_path):
    rng = np.random.default_rng(3)
    old = save({"w": random_tensor(rng, "BF16", (64, 8))}, tmp_path / "old.safetensors")
    new = save({"w": mutate(rng, random_tensor(rng, "BF16", (64, 8)), 0.0)}, tmp_path / "new.safetensors")
    runner = CliRunner()
    for major, version in (("2", (2, 0)), ("1", (1, 5))):
        patch, out = tmp_path / f"p{major}.pulsediff", tmp_path / f"out{major}.safetensors"
        args = ["make", str(old), str(new), "-o", str(patch), "-q"] + (["--format-version", major] if major == "1" else [])
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        assert PREAMBLE.unpack(patch.read_bytes()[:32])[1:3] == version
        assert runner.invoke(app, ["apply", str(old), str(patch), "-o", str(out), "-q"]).exit_code == 0
        assert out.read_bytes() == new.read_bytes()
    result = runner.invoke(app, ["make", str(old), str(new), "-o", str(tmp_path / "p3"),
                                                    "--format-version", "3"])
    assert result.exit_code != 0 and "format-version" in result.output
    with pytest.raises(PulsediffError, match="unknown format version 3"):
        pulsediff.make_patch(old, new, tmp_path / "p3", format_version=3)


def test_what_a_table_can_make_a_reader_hold_is_bounded(header):
    """Review findings: params keys are columns of a row per section, so their number is bounded
    (MAX_PARAMS_KEYS); the sections' derived offsets are bounded as 1.x's written ones are."""
    from pulsediff.format.header import MAX_PARAMS_KEYS

    obj = header.to_json(2)
    params = obj["tensors"]["section"]["params"]
    for k in range(MAX_PARAMS_KEYS + 1 - len(params)):
        params[f"extra{k}"] = [None] * len(obj["tensors"]["section"]["length"])
    assert f"has {MAX_PARAMS_KEYS + 1} keys" in str(_parse(obj))
    obj = header.to_json(2)
    obj["tensors"]["section"]["length"][0] = 2**48  # the next section would start past 2**48
    assert "past the format's bound" in str(_parse(obj))
    assert "offset is out of range" in str(_parse(dict(obj, tensors=table_entries(obj["tensors"], 2**48 - 5)), 1))


def test_values_from_the_table_are_shown_escaped_and_short(header):
    """A params key or a dtype is the patch's text: a refusal shows it escaped, cut short."""
    for edit in ("params", "dtype"):
        edited = header.to_json(2)
        if edit == "params":
            edited["tensors"]["section"]["params"]["x\nerror: ok\x1b[0m"] = 1
        else:
            edited["tensors"]["dtype"][0] = "Q" * 10_000 + "\n"
        message = str(_parse(edited))
        assert "\n" not in message and "\x1b" not in message and len(message) < 200, message
