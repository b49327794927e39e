"""Hostile input never escapes as a crash (issue 8): the fuzz suite, and a regression test per finding.

`test_fuzz_cases` runs a few hundred seeded cases of tests/fuzz_cases.py:
every codec's sections, the patch header, the layout and folder files, hostile
safetensors given to make and to apply, hostile manifests given to catch-up;
each mutated structure-aware behind recomputed checksums. Every outcome must
be a PulsediffError with nothing written, or a byte-identical correct output.
A failure names its kind and seed; replay it with

    python scripts/fuzz_campaign.py --replay KIND SEED

The long campaign (>= 100,000 cases in worker processes, with timeouts,
memory limits and SIGKILL trials) is scripts/fuzz_campaign.py; its figures
are in docs/benchmarks-log.md, "Robustness (fuzz campaign)".
"""

from __future__ import annotations

import faulthandler
import io
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fuzz_cases as fc
from ckpt_factory import folder_bytes, mutate, random_tensor, save, save_sharded
from pulsediff import apply_patch, make_patch
from pulsediff.errors import CorruptPatchError, InvalidCheckpointError, PulsediffError
from pulsediff.format.header import PatchHeader
from pulsediff.io.safetensors_header import HeaderError, parse_header

# Cases per kind in CI: about a minute in all on a 2-core machine. The campaign runs 100,000.
CI_CASES = {"gap-zstd": 400, "ctx-rans": 400, "ctx-ac": 400, "full-zstd": 300, "header": 500, "layout": 400, "checkpoint": 300,
            "manifest": 300}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return fc.build_corpus(tmp_path_factory.mktemp("fuzz") / "corpus")


@pytest.fixture
def one_kernel_thread(monkeypatch):
    """The tensors are tiny: worker threads only cost time on a loaded 2-core machine. Windows of
    a few dozen elements make the windowed rebuild of apply run over many windows per tensor."""
    import pulsediff.ops.rebuild

    monkeypatch.setenv("PULSEDIFF_THREADS", "1")
    monkeypatch.setattr(pulsediff.ops.rebuild, "WINDOW_ELEMENTS", 37)


def run_cases(kind: str, seeds, corpus, tmp_path) -> dict[str, int]:
    """Run the cases; fail on any finding or on a touched corpus. Returns the verdict counts."""
    before = fc.snapshot(corpus.root)
    findings, verdicts = [], {}
    faulthandler.dump_traceback_later(600, exit=True)  # a hang fails the run with a traceback, not a stall
    try:
        for seed in seeds:
            o = fc.run_case(kind, seed, corpus, tmp_path)
            verdicts[o.verdict] = verdicts.get(o.verdict, 0) + 1
            if o.finding:
                findings.append(f"{kind} {seed}: {o.verdict}: {o.detail}")
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert not findings, "\n".join(findings)
    assert fc.snapshot(corpus.root) == before  # no base, patch or reference was touched
    return verdicts


@pytest.mark.parametrize("kind", fc.KINDS)
def test_fuzz_cases(corpus, tmp_path, kind, one_kernel_thread):
    verdicts = run_cases(kind, range(CI_CASES[kind]), corpus, tmp_path)
    assert verdicts.get("refused") and (verdicts.get("accepted") or kind == "full-zstd"), verdicts


@pytest.mark.parametrize("kind,cases", [("ctx-ac", 300), ("ctx-rans", 300), ("gap-zstd", 150)])
def test_fuzz_cases_rebuilt_side_by_side(corpus, tmp_path, kind, cases, monkeypatch):
    """The same kind of mutated sections through apply's other path: every (tiny) tensor rebuilt on
    a worker thread of its own beside the others (Codec.decode_alone; apply._SideBySide)."""
    monkeypatch.setenv("PULSEDIFF_THREADS", "2")
    verdicts = run_cases(kind, range(10_000, 10_000 + cases), corpus, tmp_path)
    assert verdicts.get("refused") and verdicts.get("accepted"), verdicts


# -- regression tests: each failed before its fix -------------------------------------------------


def patch_parts(path):
    """(header with section bodies, the whole patch) of a patch file."""
    data = path.read_bytes()
    return fc.split_patch(data), data


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pair")
    rng = np.random.default_rng(8)
    base = {"w": random_tensor(rng, "BF16", (64, 8)), "b": random_tensor(rng, "F32", (16,))}
    target = {"w": mutate(rng, base["w"], 0.03), "b": mutate(rng, base["b"], 0.5)}
    old, new = save(base, tmp / "old.safetensors"), save(target, tmp / "new.safetensors")
    make_patch(old, new, tmp / "p.pulsediff", codec="gap-zstd", device="cpu")
    return old, new, tmp / "p.pulsediff"


def refused_with_nothing_written(old, data, tmp_path, match):
    out = tmp_path / "out.safetensors"
    with pytest.raises(PulsediffError, match=match):
        apply_patch(old, io.BytesIO(data), out, device="cpu")
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_whole_tensor_op_with_a_codec_that_needs_a_base_is_refused(pair, tmp_path):
    """op "full" over a gap-zstd section decoded with no base: AttributeError from memory.py (take_copy)."""
    old, _, patch = pair
    h, _ = patch_parts(patch)
    entry = next(t for t in h["tensors"] if t["op"] == "patch")
    entry["op"] = "full"
    entry.pop("base_hash")
    entry.pop("base_sum")  # a consistent forgery: reaches the codec check
    refused_with_nothing_written(old, fc.assemble(h), tmp_path, "cannot carry a whole tensor")


def test_header_json_bomb_is_refused_quickly(pair, tmp_path):
    """A header frame of a few KB that holds 240 MiB of `[],[],...` took 110 s and 6.6 GB to be refused
    (here 27 MB of it)."""
    import time

    import zstandard

    old, _, _ = pair
    n = 9_000_000  # above the bound of 8 million
    # An incompressible string makes the frame heavy enough (1/1024 of what it declares) to pass the
    # header's expansion bound (FORMAT.md 1), so the count of arrays and objects behind it is what refuses.
    ballast = b'"' + os.urandom(24_000).hex().encode() + b'"'
    raw = b"[" + b"[]," * n + ballast + b"]"
    frame = zstandard.ZstdCompressor(level=1).compress(raw)
    assert len(raw) <= 1024 * len(frame)
    t = time.monotonic()
    refused_with_nothing_written(old, fc.forge_frame(frame), tmp_path, "arrays and objects")
    assert time.monotonic() - t < 20


@pytest.mark.parametrize("name, reason", [
    ("", "name is empty"),
    ("x" * 4097, "longer than 4096"),
    ("\ud800", "not Unicode text"),  # a lone surrogate: UnicodeEncodeError from digest.py before
])
def test_tensor_names_a_patch_cannot_carry_are_refused_by_make_and_apply_alike(tmp_path, name, reason):
    """Make wrote patches that apply refused (empty or over-long names), or crashed (surrogates)."""
    rng = np.random.default_rng(9)
    good = save({"a": random_tensor(rng, "F32", (4,))}, tmp_path / "good.safetensors")
    bad = tmp_path / "bad.safetensors"
    header = json.dumps({name: {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}).encode()
    bad.write_bytes(struct.pack("<Q", len(header)) + header + b"\1\2")
    make_patch(good, good, tmp_path / "q", device="cpu")  # a patch to apply onto the bad checkpoint
    messages = []
    for run in (lambda: make_patch(good, bad, tmp_path / "p", device="cpu"),
                lambda: make_patch(bad, good, tmp_path / "p", device="cpu"),
                lambda: apply_patch(bad, tmp_path / "q", tmp_path / "out", device="cpu")):
        with pytest.raises(InvalidCheckpointError, match=reason) as exc:
            run()
        messages.append(str(exc.value))
    assert len(set(messages)) == 1  # the same message from make (either side) and from apply
    assert not (tmp_path / "p").exists() and not (tmp_path / "out").exists()


def test_64_dimensions_apply_and_65_are_refused_by_make_first(tmp_path):
    rng = np.random.default_rng(10)
    old = save({"a": random_tensor(rng, "F32", (4,))}, tmp_path / "old.safetensors")
    for ndim, ok in ((64, True), (65, False)):
        new = tmp_path / f"new{ndim}.safetensors"
        header = json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                             "deep": {"dtype": "U8", "shape": [1] * ndim, "data_offsets": [16, 17]}}).encode()
        new.write_bytes(struct.pack("<Q", len(header)) + header + bytes(17))
        patch = tmp_path / f"p{ndim}"
        if ok:
            make_patch(old, new, patch, device="cpu")
            apply_patch(old, patch, tmp_path / "out", device="cpu")
            assert (tmp_path / "out").read_bytes() == new.read_bytes()
        else:
            with pytest.raises(InvalidCheckpointError, match="65 dimensions"):
                make_patch(old, new, patch, device="cpu")
            assert not patch.exists()


def test_squash_refuses_a_layout_apply_would_refuse(tmp_path):
    """A layout header edited behind valid checksums (digest recomputed) was squashed into a patch that
    apply then refused: squash must check the layout as apply does."""
    from pulsediff.ops.squash import squash_patches

    rng = np.random.default_rng(12)
    old = save({"a": random_tensor(rng, "F32", (4,))}, tmp_path / "old.safetensors")
    new = save({"a": random_tensor(rng, "F32", (4,))}, tmp_path / "new.safetensors")
    make_patch(old, new, tmp_path / "p", device="cpu")
    h, _ = patch_parts(tmp_path / "p")
    blob = fc.decompress(h["layout"]["section"]["__body__"])
    edited = blob.replace(b'"F32"', b'"F64"')
    h["layout"]["section"]["__body__"] = fc.compress(edited)
    h["layout"]["digest"] = xxhash.xxh3_128_hexdigest(edited)
    (tmp_path / "forged").write_bytes(fc.assemble(h))
    with pytest.raises(CorruptPatchError, match="layout header"):
        squash_patches(old, [tmp_path / "forged"], tmp_path / "squashed", device="cpu")
    assert not (tmp_path / "squashed").exists()


# -- property tests of the readers on any JSON ------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats()
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=5),
    max_leaves=25,
)
entry = st.fixed_dictionaries({}, optional={
    "dtype": st.sampled_from(["F32", "BF16", "U8", "bf16", ""]) | json_values,
    "shape": st.lists(st.integers(min_value=-2, max_value=2**64), max_size=66) | json_values,
    "data_offsets": st.lists(st.integers(min_value=-2, max_value=64), max_size=3) | json_values,
})
safetensors_headers = st.dictionaries(st.text(max_size=5) | st.just("__metadata__"), entry | json_values, max_size=5)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(safetensors_headers, st.integers(min_value=0, max_value=80))
def test_any_safetensors_header_parses_or_raises_header_error(header, data_len):
    raw = json.dumps(header).encode()
    try:
        parsed = parse_header(raw, data_len)
    except HeaderError:
        return
    assert parsed.data_bytes == data_len


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_any_edit_of_a_patch_header_parses_or_raises_corrupt_patch(pair, data):
    _, _, patch = pair
    h = fc.strip_for_json(fc.split_patch(patch.read_bytes()))
    paths = list(fc.json_paths(h))
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        try:
            h = fc.set_path(h, path, data.draw(json_values))
        except (KeyError, IndexError, TypeError):
            pass  # an earlier edit removed the place
    try:
        PatchHeader.from_json(h, "p")
    except PulsediffError:
        pass


# -- SIGKILL during apply (50 random moments each in the campaign; here, fixed ones) ----------------

KILL_AT_FSYNC = """
import os, signal, sys
calls = 0
real_fsync = os.fsync
def fsync(fd):
    global calls
    calls += 1
    if calls == int(sys.argv[1]):
        os.kill(os.getpid(), signal.SIGKILL)
    return real_fsync(fd)
os.fsync = fsync
from pulsediff import apply_patch
apply_patch(sys.argv[2], sys.argv[3], sys.argv[4], device="cpu")
"""


@pytest.fixture(scope="module")
def kill_pairs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kill")
    rng = np.random.default_rng(13)
    base = {f"t{i}": random_tensor(rng, "BF16", (64,)) for i in range(6)}
    target = {k: mutate(rng, v, 0.2) for k, v in base.items()}
    pairs = {"file": (save(base, tmp / "old.safetensors"), save(target, tmp / "new.safetensors")),
             "dir": (save_sharded(base, tmp / "old", 3), save_sharded(target, tmp / "new", 2))}
    (pairs["dir"][0] / "config.json").write_text('{"step": 0}')
    (pairs["dir"][1] / "config.json").write_text('{"step": 1}')
    for kind, (old, new) in pairs.items():
        make_patch(old, new, tmp / f"{kind}.pulsediff", device="cpu")
    return {kind: (old, new, tmp / f"{kind}.pulsediff") for kind, (old, new) in pairs.items()}


def tree(path):
    if path.is_dir():
        return folder_bytes(path)
    return path.read_bytes() if path.exists() else None


# The fsync calls of an apply: -o FILE: the file, then its folder after the rename; -o DIR (new): 2 shards,
# the index, config.json, the staged folder, then its parent after the rename. Killed at one of them, the
# output must be absent before the rename and whole after it.
@pytest.mark.parametrize("kind, kill_at, whole", [("file", 1, False), ("file", 2, True), ("dir", 5, False),
                                                  ("dir", 6, True)])
def test_killed_apply_leaves_no_output_or_a_whole_one(kill_pairs, tmp_path, kind, kill_at, whole):
    old, new, patch = kill_pairs[kind]
    before = tree(old)
    out = tmp_path / ("out.safetensors" if kind == "file" else "out")
    run = subprocess.run([sys.executable, "-c", KILL_AT_FSYNC, str(kill_at), str(old), str(patch), str(out)],
                         capture_output=True)
    assert run.returncode == (0 if kill_at == 99 else -9), run.stderr
    assert tree(old) == before
    assert tree(out) == (tree(new) if whole else None)  # absent or whole, never partial
    visible = [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert visible in ([], [out.name])
    # the next apply into that folder works, and removes what the killed one left behind
    again = tmp_path / ("again.safetensors" if kind == "file" else "again")
    apply_patch(old, patch, again, device="cpu")
    assert tree(again) == tree(new)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_header_of_small_values_that_exceeds_memory_is_refused(tmp_path):
    """200 MiB of `1,1,...` (within the 256 MiB header bound) escaped as MemoryError under a 2 GiB limit."""
    child = """
import os, resource, zstandard
from pulsediff.errors import CorruptPatchError
from pulsediff.format.container import _decode_header_frame
ballast = b'"' + os.urandom(100_000).hex().encode() + b'"'  # passes the expansion bound (FORMAT.md 1)
frame = zstandard.ZstdCompressor(level=1).compress(b"[" + b"1," * (48 << 20) + ballast + b"]")
assert (96 << 20) <= 1024 * len(frame)
vm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20),) * 2)  # less than the list of 48 Mi ints needs
try:
    _decode_header_frame(frame, "p")
except CorruptPatchError as exc:
    print(exc)
"""
    run = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-500:]
    assert "too large to parse in the memory" in run.stdout


def test_a_frame_cannot_declare_more_than_zstd_blocks_can_hold(pair, tmp_path):
    """A tensor reshaped to 4 TiB in the header, its layout and the target digest (checksums recomputed), carried
    by a 30-byte frame that declares 4 TiB: the declared size matched the header's, so zstandard allocated
    it (MemoryError). A zstd block holds at most 128 KiB behind a 3-byte header, so no frame of n bytes
    can hold more than ~n/3 * 128 KiB: the declared size is checked against that first."""
    old, _, patch = pair
    h, _ = patch_parts(patch)
    fc.reshape_tensor(h, "b", [2**40])
    small = fc.compress(b"\0" * 16)
    entry = next(t for t in h["tensors"] if t["name"] == "b")
    assert entry["op"] == "full"
    entry["section"]["__body__"] = small[:4] + bytes([0xE0]) + struct.pack("<Q", 2**42) + small[6:]
    entry["changed"] = 2**40
    fc.retarget(h)  # the lie told consistently: the target digest agrees with the entries
    refused_with_nothing_written(old, fc.assemble(h), tmp_path, "more than a frame of")


def test_a_tensor_kept_from_the_base_must_have_the_size_the_header_says(pair, tmp_path):
    """A 'same' tensor whose shape (or dtype) the header changed, with its layout header and the target
    digest recomputed to agree: apply wrote the base's 64 bytes where the file header promised 68 or 16,
    a corrupt safetensors file, and called it verified. The rebuilt tensor's size is now checked."""
    old, _, _ = pair
    rng = np.random.default_rng(14)
    base = {"w": random_tensor(rng, "BF16", (64, 8)), "ids": random_tensor(rng, "I32", (16,))}
    old = save(base, tmp_path / "old.safetensors")
    new = save({"w": mutate(rng, base["w"], 0.05), "ids": base["ids"]}, tmp_path / "new.safetensors")
    make_patch(old, new, tmp_path / "p", device="cpu")
    for lie in ({"shape": [17]}, {"dtype": "F8_E4M3"}):
        h, _ = patch_parts(tmp_path / "p")
        entry = next(t for t in h["tensors"] if t["name"] == "ids")
        assert entry["op"] == "same"
        entry.update(lie)
        fc.edit_layout_headers(h, lambda header, records: None)
        fc.retarget(h)
        out = tmp_path / "out.safetensors"
        with pytest.raises(CorruptPatchError, match="'ids' rebuilds to"):
            apply_patch(old, io.BytesIO(fc.assemble(h)), out, device="cpu")
        assert not out.exists()


def test_a_tensor_kept_from_a_base_that_lacks_it_is_refused(tmp_path):
    """An anchor (base: the empty checkpoint) with an entry turned into 'same': KeyError from checkpoint.py."""
    rng = np.random.default_rng(15)
    new = save({"a": random_tensor(rng, "F32", (4,)), "b": random_tensor(rng, "U8", (3,))}, tmp_path / "new.safetensors")
    make_patch(None, new, tmp_path / "anchor", device="cpu")
    h, _ = patch_parts(tmp_path / "anchor")
    entry = h["tensors"][0]
    entry.update(op="same", changed=0, base_hash=entry["target_hash"], base_sum=entry["target_sum"])
    entry.pop("section")
    out = tmp_path / "out.safetensors"
    with pytest.raises(CorruptPatchError, match="the base lacks"):
        apply_patch(None, io.BytesIO(fc.assemble(h)), out, device="cpu")
    assert not out.exists()


def test_a_target_digest_that_is_not_the_entries_digest_is_refused(tmp_path):
    """A tensor's dtype changed U8 -> BOOL (layout agreeing, target digest left as it was): squash wrote the
    squashed patch, then failed `AssertionError: squashed patch does not reach the chain's target`."""
    from pulsediff.ops.squash import squash_patches

    rng = np.random.default_rng(16)
    base = {"w": random_tensor(rng, "BF16", (64, 8)), "m": random_tensor(rng, "BOOL", (8,))}
    old = save(base, tmp_path / "old.safetensors")
    new = save({"w": mutate(rng, base["w"], 0.05), "m": base["m"]}, tmp_path / "new.safetensors")
    make_patch(old, new, tmp_path / "p", device="cpu")
    h, _ = patch_parts(tmp_path / "p")
    next(t for t in h["tensors"] if t["name"] == "m")["dtype"] = "U8"
    fc.edit_layout_headers(h, lambda header, records: None)
    (tmp_path / "forged").write_bytes(fc.assemble(h))
    with pytest.raises(CorruptPatchError, match="target.digest is not the digest of the tensor entries"):
        squash_patches(old, [tmp_path / "forged"], tmp_path / "squashed", device="cpu")
    assert not (tmp_path / "squashed").exists()
