"""A damaged or hostile patch is refused with a PulsediffError, and nothing is written."""

from __future__ import annotations

import io
import json
import struct

import numpy as np
import pytest
import xxhash
import zstandard

from pulsediff import apply_patch, make_patch
from pulsediff.codecs import SPARSE_CODECS
from pulsediff.errors import (
    BaseMismatchError,
    CorruptPatchError,
    InvalidPatchError,
    NotAPatchError,
    PulsediffError,
    TensorMismatchError,
    TruncatedPatchError,
    UnsupportedVersionError,
)
from pulsediff.format.container import (FORMAT_MAJOR, FORMAT_MINOR, MAGIC, PREAMBLE, READ_MAJORS, encode_header,
                                        encode_preamble)

from ckpt_factory import mutate, random_tensor, save
from fuzz_cases import entries_table, table_entries


@pytest.fixture(scope="module", params=SPARSE_CODECS)
def small_pair(tmp_path_factory, request):
    tmp = tmp_path_factory.mktemp("pair")
    rng = np.random.default_rng(7)
    base = {"w": random_tensor(rng, "BF16", (64, 8)), "b": random_tensor(rng, "F32", (16,)), "ids": random_tensor(rng, "I32", (4,))}
    target = {"w": mutate(rng, base["w"], 0.03), "b": mutate(rng, base["b"], 0.5), "ids": base["ids"], "new": random_tensor(rng, "U8", (3,))}
    old = save(base, tmp / "old.safetensors")
    new = save(target, tmp / "new.safetensors")
    patch = tmp / "p.pulsediff"
    make_patch(old, new, patch, device="cpu", codec=request.param)
    return old, new, patch.read_bytes()


def apply_bytes(old, data: bytes, out):
    return apply_patch(old, io.BytesIO(data), out, device="cpu")


def test_every_single_byte_flip_is_detected(small_pair, tmp_path):
    old, _, patch = small_pair
    base_before = old.read_bytes()
    out = tmp_path / "out.safetensors"
    assert len(patch) < 4000  # keep the exhaustive loop quick
    for i in range(len(patch)):
        for flip in (0x01, 0x80):
            damaged = bytearray(patch)
            damaged[i] ^= flip
            with pytest.raises(PulsediffError):
                apply_bytes(old, bytes(damaged), out)
            assert not out.exists(), f"flip at byte {i} left an output"
    assert old.read_bytes() == base_before
    assert list(tmp_path.iterdir()) == []  # no temporary files left behind either


def test_every_truncation_is_detected(small_pair, tmp_path):
    old, _, patch = small_pair
    out = tmp_path / "out.safetensors"
    for n in range(len(patch)):
        with pytest.raises((TruncatedPatchError, CorruptPatchError, NotAPatchError)):
            apply_bytes(old, patch[:n], out)
        assert not out.exists()


def test_trailing_bytes_are_detected(small_pair, tmp_path):
    old, _, patch = small_pair
    with pytest.raises(CorruptPatchError, match="after the last section"):
        apply_bytes(old, patch + b"\0", tmp_path / "out")


def test_unknown_major_version_is_refused(small_pair, tmp_path):
    old, _, patch = small_pair
    data = bytearray(patch)
    struct.pack_into("<H", data, 8, FORMAT_MAJOR + 1)
    with pytest.raises(UnsupportedVersionError, match=rf"version 3\.{FORMAT_MINOR} is not supported.*versions 1 and 2"):
        apply_bytes(old, bytes(data), tmp_path / "out")


def test_patch_from_another_base_is_refused_before_writing(small_pair, tmp_path):
    old, new, patch = small_pair
    rng = np.random.default_rng(99)
    other = save({"w": random_tensor(rng, "BF16", (64, 8)), "b": random_tensor(rng, "F32", (16,)),
                  "ids": random_tensor(rng, "I32", (4,))}, tmp_path / "other.safetensors")
    with pytest.raises(BaseMismatchError, match="differs from the patch's base"):
        apply_bytes(other, patch, tmp_path / "out")
    reshaped = save({"w": random_tensor(rng, "BF16", (8, 64)), "b": random_tensor(rng, "F32", (16,)),
                     "ids": random_tensor(rng, "I32", (4,))}, tmp_path / "reshaped.safetensors")
    with pytest.raises(TensorMismatchError, match="expects BF16"):
        apply_bytes(reshaped, patch, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def header_of(patch: bytes) -> dict:
    """A patch's header JSON, a 2.x tensor table as 1.x's entries (tests edit those)."""
    pre = PREAMBLE.unpack(patch[:32])
    header = json.loads(zstandard.ZstdDecompressor().decompress(patch[32 : 32 + pre[4]]))
    if pre[1] >= 2:
        layout = header["layout"]["section"]
        header["tensors"] = table_entries(header["tensors"], layout["offset"] + layout["length"])
    return header


def forge(header: dict, sections: bytes = b"", major: int = FORMAT_MAJOR) -> bytes:
    """A patch with a valid preamble and checksum around a hand-written header (1.x's entries,
    written as a tensor table for major 2; a major 1 patch is a 1.5 one)."""
    if major >= 2:
        header = dict(header, tensors=entries_table(header.get("tensors")))
    frame = encode_header(header)
    return encode_preamble(frame, (major, FORMAT_MINOR if major == FORMAT_MAJOR else 5)) + frame + sections


@pytest.mark.parametrize("major", [1, 2])
def test_hostile_headers_are_refused(small_pair, tmp_path, major):
    """Each edit refused, in a 1.5 patch's entries and in 2.0's tensor table alike (a table holds
    only counts where params go: a string or a list there is refused as a wrong type)."""
    old, _, patch = small_pair
    pre = PREAMBLE.unpack(patch[:32])
    header = header_of(patch)
    out = tmp_path / "out"
    typed = "|wrong type" if major >= 2 else ""

    def refuse(mutator, match=None):
        h = json.loads(json.dumps(header))
        mutator(h)
        with pytest.raises(InvalidPatchError, match=match):
            apply_bytes(old, forge(h, patch[32 + pre[4]:], major), out)
        assert not out.exists()

    apply_bytes(old, forge(json.loads(json.dumps(header)), patch[32 + pre[4]:], major), out)  # unedited: applies
    out.unlink()

    refuse(lambda h: h.update(precision="fp7"), "precision")
    refuse(lambda h: h["tensors"][0].update(shape=[2**62, 2**62]), "shape")
    refuse(lambda h: h["tensors"][0].update(dtype="Q9"), "dtype")
    refuse(lambda h: h["tensors"][0].update(op="rm"), "op")
    refuse(lambda h: h["layout"]["files"][0].update(name="../evil.safetensors"), "not allowed")
    refuse(lambda h: h["layout"].update(kind="dir"), "not allowed")
    refuse(lambda h: h["tensors"].append(dict(h["tensors"][0])), "twice")
    refuse(lambda h: h.update(tensors="nope"), "wrong type")
    patched = next(i for i, t in enumerate(header["tensors"]) if t["op"] == "patch")

    def set_param(key, value):
        return lambda h: h["tensors"][patched]["section"]["params"].update({key: value})

    refuse(set_param("count", 10**12), "count")
    # wrong JSON types where a count belongs used to escape as TypeError from `pulsediff stats`
    refuse(set_param("count", str(header["tensors"][patched]["changed"])), "count")
    refuse(set_param("count", float(header["tensors"][patched]["changed"])), "count")
    refuse(set_param("count", True), "count")
    codec = header["tensors"][patched]["section"]["codec"]
    index_key = {"gap-zstd": "gap_bytes", "ctx-rans": "table_bytes", "ctx-ac": "position_bytes"}[codec]
    refuse(set_param(index_key, "12"), "index size" + typed)
    refuse(set_param(index_key, [1]), "index size" + typed)
    refuse(set_param(index_key, 10**9), "index size")
    if codec == "gap-zstd":
        refuse(set_param("gap_width", 3), "gap_width")
    else:
        refuse(set_param("class_bits", 40), "class_bits")
    if codec == "ctx-rans":
        refuse(set_param("escapes", 10**6), "escapes")
    refuse(lambda h: h["tensors"][patched]["section"].update(codec="lzma-9000"), "unknown codec")
    if major == 1:  # a table has no offsets: its sections lie back to back by construction
        refuse(lambda h: h["tensors"][patched]["section"].update(offset=0), "contiguous")


def test_hostile_section_with_valid_checksum(small_pair, tmp_path):
    """A section that passes its checksum but decodes to out-of-range positions must not be scattered."""
    old, _, patch = small_pair
    pre = PREAMBLE.unpack(patch[:32])
    header = header_of(patch)
    sections = bytearray(patch[32 + pre[4]:])
    i = next(i for i, t in enumerate(header["tensors"]) if t["op"] == "patch")
    sec = header["tensors"][i]["section"]
    if sec["codec"] != "gap-zstd":
        pytest.skip("hand-crafted for gap-zstd; test_fuzzed_sections_with_valid_checksums covers every codec")
    count = sec["params"]["count"]
    gaps = np.full(count, 1000, np.uint32)  # runs far past the tensor's 512 elements
    gap_frame = zstandard.ZstdCompressor().compress(gaps.tobytes())
    value_frame = bytes(sections[sec["offset"] + sec["params"]["gap_bytes"] : sec["offset"] + sec["length"]])
    payload = gap_frame + value_frame
    new_sections = bytes(sections[: sec["offset"]]) + payload + bytes(sections[sec["offset"] + sec["length"]:])
    delta = len(payload) - sec["length"]
    sec.update(length=len(payload), xxh3=xxhash.xxh3_64_hexdigest(payload))
    sec["params"]["gap_bytes"] = len(gap_frame)
    for t in header["tensors"][i + 1:]:
        if "section" in t:
            t["section"]["offset"] += delta
    with pytest.raises(CorruptPatchError, match="out of order or out of range"):
        apply_bytes(old, forge(header, new_sections), tmp_path / "out")


def test_fuzzed_sections_with_valid_checksums(small_pair, tmp_path):
    """Random damage that the checksum cannot see (it is recomputed): decoders must refuse, not crash."""
    old, _, patch = small_pair
    pre = PREAMBLE.unpack(patch[:32])
    header = header_of(patch)
    sections = patch[32 + pre[4]:]
    rng = np.random.default_rng(5)
    out = tmp_path / "out"
    targets = [t for t in header["tensors"] if t.get("section")]
    for trial in range(300):
        h = json.loads(json.dumps(header))
        t = h["tensors"][header["tensors"].index(targets[trial % len(targets)])]
        sec = t["section"]
        body = bytearray(sections[sec["offset"] : sec["offset"] + sec["length"]])
        for _ in range(1 + trial % 4):
            body[rng.integers(len(body))] = rng.integers(256)
        sec["xxh3"] = xxhash.xxh3_64_hexdigest(bytes(body))
        fuzzed = sections[: sec["offset"]] + bytes(body) + sections[sec["offset"] + sec["length"]:]
        try:
            apply_bytes(old, forge(h, fuzzed), out)
        except PulsediffError:
            pass
        else:  # only possible if the damage did not change what the section decodes to
            assert bytes(body) == sections[sec["offset"] : sec["offset"] + sec["length"]] or out.exists()
            out.unlink()
        assert not out.exists()


def test_magic_and_version_are_pinned():
    from pulsediff.io.checkpoint import PATCH_MAGIC

    assert MAGIC == b"PULSEDIF"
    assert PATCH_MAGIC == MAGIC  # the checkpoint reader names a patch given in a checkpoint's place by it
    assert FORMAT_MAJOR == 2
    assert FORMAT_MINOR == 0  # 1.1: layout digest, folder files; 1.2: word sums; 1.3: ctx-ac; 1.4: tree hashes;
    # 1.5: layout.cast; 2.0: the tensor table (docs/FORMAT.md §11)
    assert READ_MAJORS == (1, 2)
    assert PREAMBLE.size == 32


@pytest.mark.parametrize("raw, reason", [
    (b"[" * 50_000 + b"]" * 50_000, "nested deeper"),  # RecursionError escaped before
    (b'{"tool": 1' + b"0" * 5000 + b"}", "digits"),  # a bare ValueError escaped before
    (b'{"tool": "a", "tool": "b"}', "appears twice"),
])
def test_hostile_header_json_is_a_corrupt_patch(raw, reason):
    import zstandard

    from pulsediff.errors import CorruptPatchError
    from pulsediff.format.container import _decode_header_frame

    with pytest.raises(CorruptPatchError, match=reason):
        _decode_header_frame(zstandard.ZstdCompressor().compress(raw), "p")


def test_header_frame_that_declares_far_more_than_it_weighs_is_refused_before_decoding():
    """A frame of a few KB may declare 256 MiB, which a reader had to hold (and copy) before it could
    tell it was no header: refused from the frame's length and declared size alone."""
    from pulsediff.errors import CorruptPatchError
    from pulsediff.format.container import MAX_HEADER_EXPANSION, PatchReader, header_size_allowed

    frame = zstandard.ZstdCompressor(write_content_size=True).compress(b"{" + b" " * (8 << 20) + b"}")
    assert header_size_allowed(len(frame)) < (8 << 20)
    with pytest.raises(CorruptPatchError, match=f"more than {MAX_HEADER_EXPANSION} times its length"):
        PatchReader(io.BytesIO(encode_preamble(frame) + frame), "p")


def test_header_that_compresses_past_the_bound_is_written_stored_and_reads_back():
    """A writer must not write what readers refuse: a header that zstd would squeeze past the bound
    (never a real checkpoint's: their digests do not compress) goes out as raw zstd blocks, with a
    128 KiB window, which stock decoders read whole or streamed."""
    from pulsediff.format.container import PatchReader, header_size_allowed

    header = {"tool": "t", "pad": "x" * (3 << 20)}
    frame = encode_header(header)
    assert len(frame) > 3 << 20  # stored, not compressed
    assert zstandard.frame_content_size(frame) <= header_size_allowed(len(frame))
    assert zstandard.get_frame_parameters(frame).window_size == 128 * 1024
    assert json.loads(zstandard.ZstdDecompressor().decompress(frame)) == header
    assert json.loads(zstandard.ZstdDecompressor().stream_reader(frame).read()) == header
    assert PatchReader(io.BytesIO(encode_preamble(frame) + frame), "p").header == header
    small = encode_header({"tool": "t"})
    assert len(small) < 64  # the usual case: compressed


@pytest.mark.parametrize("size", [0, 1, 128 * 1024 - 1, 128 * 1024, 128 * 1024 + 1, 3 * 128 * 1024 - 5])
def test_stored_frame_is_plain_zstd(size):
    from pulsediff.format.container import stored_frame

    raw = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    frame = stored_frame(raw)
    assert zstandard.frame_content_size(frame) == size
    assert zstandard.ZstdDecompressor().decompress(frame, max_output_size=max(size, 1)) == raw
    assert zstandard.ZstdDecompressor().stream_reader(frame).read() == raw


def test_header_bound_is_exact_and_nothing_may_follow_the_frame():
    from pulsediff.errors import CorruptPatchError
    from pulsediff.format.container import HEADER_EXPANSION_FLOOR, MAX_HEADER_EXPANSION, _decode_header_frame

    raw = b'{"a":"' + b"x" * (4 * HEADER_EXPANSION_FLOOR) + b'"}'
    squeezed = zstandard.ZstdCompressor(write_content_size=True).compress(raw)
    skippable = struct.pack("<II", 0x184D2A50, 0)  # a skippable frame: padding that raises the allowance
    at_bound = len(raw) // MAX_HEADER_EXPANSION + (len(raw) % MAX_HEADER_EXPANSION > 0)
    with pytest.raises(CorruptPatchError, match="more than"):
        _decode_header_frame(squeezed, "p")
    with pytest.raises(CorruptPatchError, match="more than"):  # one byte short of the bound
        _decode_header_frame(squeezed + skippable + b"\0" * (at_bound - len(squeezed) - 9), "p")
    with pytest.raises(CorruptPatchError, match="does not decode"):  # at the bound: bytes after the frame
        _decode_header_frame(squeezed + skippable + b"\0" * (at_bound - len(squeezed) - 8), "p")
    fits = encode_header({"a": "b"})
    assert _decode_header_frame(fits, "p") == {"a": "b"}
    with pytest.raises(CorruptPatchError, match="does not decode"):
        _decode_header_frame(fits + b"\0" * 4, "p")


def test_writer_refuses_a_header_over_the_limit(monkeypatch):
    from pulsediff.errors import PulsediffError
    from pulsediff.format import container

    monkeypatch.setattr(container, "MAX_HEADER_BYTES", 1000)
    with pytest.raises(PulsediffError, match="over the format's limit"):
        container.encode_header({"pad": "x" * 2000})


def _edit_layout(patch: bytes, edit) -> bytes:
    """The patch with its layout blob replaced by `edit(blob, header)`, every checksum, offset and size
    recomputed to match: what a careless or hostile writer produces."""
    pre = PREAMBLE.unpack(patch[:32])
    header = header_of(patch)
    sections = patch[32 + pre[4]:]
    lay = header["layout"]
    blob = zstandard.ZstdDecompressor().decompress(sections[: lay["section"]["length"]])
    new_blob = edit(blob, header)
    frame = zstandard.ZstdCompressor().compress(new_blob)
    delta = len(frame) - lay["section"]["length"]
    lay["section"].update(length=len(frame), xxh3=xxhash.xxh3_64_hexdigest(frame))
    for t in header["tensors"]:
        if "section" in t:
            t["section"]["offset"] += delta
    header["target"]["bytes"] += len(new_blob) - len(blob)
    return forge(header, frame + sections[lay["section"]["length"]:])


def test_edited_layout_is_refused_in_exact_mode(small_pair, tmp_path):
    """Metadata, key order or padding edited behind valid checksums used to be applied and called verified
    (the tensor digest does not see them); the layout digest of format 1.1 refuses it before writing."""
    old, new, patch = small_pair
    out = tmp_path / "out"

    def reorder(blob, header):
        raw = json.loads(blob)
        edited = json.dumps(dict(reversed(list(raw.items()))), indent=1).encode()
        edited += b" " * (-(8 + len(edited)) % 8)
        header["layout"]["files"][0]["header_len"] = len(edited)
        return edited

    with pytest.raises(CorruptPatchError, match="layout does not match its recorded digest"):
        apply_bytes(old, _edit_layout(patch, reorder), out)
    assert not out.exists()
    # the same edit with the digest updated too is a consistent (forged) patch: it applies and says so
    # honestly, since XXH3 authenticates nothing (docs/FORMAT.md §3); the bytes are then the edited ones
    unchanged = _edit_layout(patch, lambda blob, header: blob)
    apply_bytes(old, unchanged, out)
    assert out.read_bytes() == new.read_bytes()


def test_target_bytes_must_agree_with_the_layout(small_pair, tmp_path):
    old, _, patch = small_pair
    pre = PREAMBLE.unpack(patch[:32])
    header = header_of(patch)
    header["target"]["bytes"] += 1
    with pytest.raises(CorruptPatchError, match="target.bytes contradicts"):
        apply_bytes(old, forge(header, patch[32 + pre[4]:]), tmp_path / "out")


def test_zstd_compress_is_safe_from_several_threads_at_once():
    """make encodes tensors on several threads; one shared ZstdCompressor corrupted frames (CI)."""
    from concurrent.futures import ThreadPoolExecutor

    import zstandard

    from pulsediff.codecs.base import zstd_compress

    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 50, 20_000 + 37 * i).astype(np.uint32) for i in range(64)]
    with ThreadPoolExecutor(4) as pool:
        frames = list(pool.map(zstd_compress, arrays * 4))
    for data, frame in zip(arrays * 4, frames):
        assert zstandard.ZstdDecompressor().decompress(frame) == data.tobytes()


def test_a_base_that_differs_only_in_a_tensor_carried_whole_says_so(tmp_path):
    """The patch records no base hash for a tensor it carries whole: the refusal names the
    tensors it could be, instead of a vague "set of tensors differs"."""
    import numpy as np
    from safetensors.torch import load_file

    from pulsediff import apply_patch, make_patch
    from pulsediff.errors import BaseMismatchError

    from ckpt_factory import mutate, random_tensor, save

    rng = np.random.default_rng(40)
    old = {"w": random_tensor(rng, "BF16", (64, 8)), "f": random_tensor(rng, "F32", (50,))}
    new = {"w": mutate(rng, old["w"], 0.05), "f": random_tensor(rng, "F32", (50,))}  # f: every element new
    old_path, new_path = save(old, tmp_path / "old.safetensors"), save(new, tmp_path / "new.safetensors")
    make_patch(old_path, new_path, tmp_path / "p", device="cpu")
    other = load_file(str(old_path))
    other["f"] = other["f"] + 1
    with pytest.raises(BaseMismatchError, match="carries whole or removes \\(one of 'f'\\)"):
        apply_patch(save(other, tmp_path / "other.safetensors"), tmp_path / "p", tmp_path / "out", device="cpu")
    assert not (tmp_path / "out").exists()
    fewer = {"w": old["w"]}
    with pytest.raises(BaseMismatchError, match=r"the base holds 1 tensor\(s\), the patch's base 2"):
        apply_patch(save(fewer, tmp_path / "fewer.safetensors"), tmp_path / "p", tmp_path / "out", device="cpu")


@pytest.mark.parametrize("edit", ["renamed shard", "index moved a tensor"])
def test_layout_whose_names_disagree_with_its_index_is_refused(tmp_path, edit):
    """File names live in the header, outside the layout digest: a shard renamed there (checksums
    recomputed) rebuilt 'éodel-00001-of-00002.safetensors' beside an index naming
    'model-00001-...', reported verified, and the folder no longer loaded (issue 23)."""
    from ckpt_factory import save_sharded
    from fuzz_cases import assemble, split_patch

    rng = np.random.default_rng(51)
    base = {f"w{i}": random_tensor(rng, "BF16", (32, 32)) for i in range(4)}
    old = save_sharded(base, tmp_path / "old", 2)
    new = save_sharded({k: mutate(rng, v, 0.1) for k, v in base.items()}, tmp_path / "new", 2)
    patch = tmp_path / "p.pulsediff"
    make_patch(old, new, patch, device="cpu")
    header = split_patch(patch.read_bytes())

    def rename(h):
        f = h["layout"]["files"][0]
        f["name"] = "é" + f["name"][1:]

    def swap_counts(h):  # same names, but the files' tensor counts moved: tensors land in other files
        a, b = h["layout"]["files"][:2]
        a["tensors"], b["tensors"] = a["tensors"] + 1, b["tensors"] - 1

    hostile = tmp_path / "hostile.pulsediff"
    hostile.write_bytes(assemble(header, post=rename if edit == "renamed shard" else swap_counts))
    out = tmp_path / "out"
    with pytest.raises(InvalidPatchError):
        apply_patch(old, hostile, out, device="cpu")
    assert not out.exists() and not any(p.name.startswith(".") for p in tmp_path.iterdir())
