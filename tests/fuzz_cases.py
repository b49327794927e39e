"""Hostile inputs, one seeded case at a time, for tests/test_fuzz.py and scripts/fuzz_campaign.py.

`run_case(kind, seed, corpus, work)` builds one hostile input from an RNG
seeded by (kind, seed), so a failure reproduces from those two values alone,
feeds it to pulsediff and judges what came out. The property:

- **refused**: a `PulsediffError`, and nothing written: no output, no
  temporary file, the base unchanged (every file under the case's folder is
  compared before and after, hidden ones included);
- **accepted**: the output is byte for byte what the input describes. For a
  patch whose header was not changed in substance, that is the target it was
  made for. For a forged but self-consistent patch (XXH3 authenticates
  nothing, docs/FORMAT.md §3), it is what its header and layout claim: every
  file's header bytes, every tensor's hash (checked again here), the folder's
  files and the digest.

Anything else is a finding: `wrong` (accepted with a wrong output, or
refused with something left behind), `asymmetric` (make accepted a
checkpoint that apply then refused, or apply refused a checkpoint for a
reason make did not give first), `exception` (any other exception escaped
the library) or `memory` (MemoryError). An exception with no pulsediff frame
on its way is this module's own bug: `harness`, counted apart.

Mutations are structure-aware. A patch is split into its header and its
section bodies; a body is decoded as far as its codec allows (zstd frames
decompressed, gap arrays and ctx-rans tables parsed), changed there and
encoded again; then the patch is put back together with every offset,
length, section checksum, `target.bytes` and the preamble checksum
recomputed, so that the damage reaches the readers behind the checksums.

Kinds: one per codec of `pulsediff.codecs.CODEC_IDS` (their sections),
`header` (the header's JSON fields, frame and preamble), `layout` (the
layout blob and a folder's carried files), `checkpoint` (hostile safetensors
given to make and to apply) and `manifest` (hostile series manifests given to
catch-up).
"""

from __future__ import annotations

import copy
import io
import json
import math
import os
import random
import shutil
import stat
import struct
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import xxhash
import zstandard

from pulsediff.codecs import CODEC_IDS
from pulsediff.io.dtypes import DTYPES
from pulsediff.errors import InvalidCheckpointError, PulsediffError
from pulsediff.format.container import MAGIC, PREAMBLE
from reference import tree_hash_ref

KINDS = (*CODEC_IDS, "header", "layout", "checkpoint", "manifest")
VERDICTS = ("refused", "accepted", "wrong", "asymmetric", "exception", "memory", "harness")
FINDINGS = ("wrong", "asymmetric", "exception", "memory")  # of pulsediff; "harness": a bug of this module
INDEX_NAME = "model.safetensors.index.json"


# -- outcomes -------------------------------------------------------------------


@dataclass
class Outcome:
    kind: str
    seed: int
    verdict: str  # the worst of the case's runs, in VERDICTS order
    detail: str = ""  # for a finding: what went wrong; for an exception: its type, message and where
    error: str = ""  # the exception's type name
    runs: dict[str, int] = field(default_factory=dict)  # verdict of each run (a case may run several)
    facts: dict[str, int] = field(default_factory=dict)  # what happened, for the campaign's report

    @property
    def finding(self) -> bool:
        return self.verdict in FINDINGS or self.verdict == "harness"

    def to_json(self) -> dict:
        return asdict(self)


class Finding(Exception):
    """Raised inside a case to end it with a verdict other than refused or accepted."""

    def __init__(self, verdict: str, detail: str):
        super().__init__(detail)
        self.verdict, self.detail = verdict, detail


class Judge:
    def __init__(self) -> None:
        self.runs: dict[str, int] = {}
        self.facts: dict[str, int] = {}

    def note(self, verdict: str) -> None:
        self.runs[verdict] = self.runs.get(verdict, 0) + 1

    def fact(self, what: str) -> None:
        self.facts[what] = self.facts.get(what, 0) + 1


TRACEBACKS = False  # print the traceback of an exception finding (scripts/fuzz_campaign.py --replay)


def where(exc: BaseException) -> str:
    """The innermost pulsediff frame a traceback passes through: where to look."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f"{os.sep}pulsediff{os.sep}" in f.filename]
    if not frames:
        return "?"
    f = frames[-1]
    return f"{f.filename.split(os.sep + 'pulsediff' + os.sep, 1)[1]}:{f.lineno} ({f.name})"


def run_case(kind: str, seed: int, corpus: "Corpus", work: Path) -> Outcome:
    """One case in a fresh folder under `work` (removed afterwards)."""
    rng = random.Random(f"{kind}:{seed}")
    folder = Path(work) / f"{kind}-{seed}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    judge = Judge()
    try:
        CASES[kind](corpus, rng, folder, judge)
        verdict = "accepted" if judge.runs.get("accepted") else "refused"
        return Outcome(kind, seed, verdict, runs=judge.runs, facts=judge.facts)
    except Finding as f:
        judge.note(f.verdict)
        return Outcome(kind, seed, f.verdict, f.detail, runs=judge.runs, facts=judge.facts)
    except Exception as exc:  # the finding this whole module hunts for (MemoryError included)
        if TRACEBACKS:
            traceback.print_exc()
        # No pulsediff frame on the way: the exception is this module's own (making an input, judging it).
        verdict = "harness" if where(exc) == "?" else "memory" if isinstance(exc, MemoryError) else "exception"
        judge.note(verdict)
        detail = f"{type(exc).__name__}: {str(exc)[:200]} at {where(exc)}"
        return Outcome(kind, seed, verdict, detail, type(exc).__name__, judge.runs, judge.facts)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# -- what a folder holds, before and after ----------------------------------------


def snapshot(folder: Path) -> dict[str, tuple]:
    """Every entry under `folder` (hidden ones too): files by size and content hash."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), folder) + "/"] = ("dir",)
        for n in filenames:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            if not stat.S_ISREG(st.st_mode):  # a FIFO or a link a case made: never opened here
                out[os.path.relpath(p, folder)] = ("special", stat.S_IFMT(st.st_mode), os.path.islink(p) and os.readlink(p))
                continue
            with open(p, "rb") as f:
                data = f.read()
            out[os.path.relpath(p, folder)] = (len(data), xxhash.xxh3_64_hexdigest(data))
    return out


def changes(before: dict, after: dict) -> list[str]:
    return sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))


def attempt(judge: Judge, work: Path, what: str, fn, allowed: tuple[str, ...] = ()):
    """Run `fn`; a PulsediffError must leave `work` as it was, except the paths in `allowed`.

    Returns (True, result) or (False, the PulsediffError). Other exceptions propagate.
    """
    before = snapshot(work)
    try:
        result = fn()
    except PulsediffError as exc:
        left = [c for c in changes(before, snapshot(work)) if not any(c.startswith(a) for a in allowed)]
        if left:
            raise Finding("wrong", f"{what}: refused ({type(exc).__name__}: {str(exc)[:120]}) but changed {left[:4]}")
        judge.note("refused")
        return False, exc
    judge.note("accepted")
    return True, result


# -- the corpus: small checkpoints and the patches between them ---------------------


@dataclass
class Sample:
    name: str
    precision: str
    base: str | None  # relative to the corpus root; None: the empty checkpoint (an anchor)
    target: str
    patch: str
    reference: str  # what applying the clean patch writes
    kind: str  # "file" or "dir"
    prev: str | None = None  # a patch whose target is this patch's base: a chain [prev, patch]
    prev_base: str | None = None
    next: str | None = None  # a patch from this patch's target: a chain [patch, next]...
    next_reference: str | None = None  # ...whose output is this
    receiver: bool = False  # bf16 onto a BF16 base: the base's own layout is written...
    stream_reference: str | None = None  # ...except from a stream, which keeps the patch's layout


@dataclass
class Corpus:
    root: Path
    samples: list[Sample]
    ckpt_old: str  # single files, for the checkpoint cases
    ckpt_new: str
    ckpt_patch: str
    dir_sample: str  # the name of a folder sample, for hostile folders
    train: str
    pub: str
    bombs: dict[str, str]  # zstd frames that decompress to far more than they weigh

    def path(self, rel: str | None) -> Path | None:
        return None if rel is None else self.root / rel

    def sample(self, name: str) -> Sample:
        return next(s for s in self.samples if s.name == name)

    @classmethod
    def load(cls, root: Path) -> "Corpus":
        obj = json.loads((Path(root) / "corpus.json").read_text())
        obj["samples"] = [Sample(**s) for s in obj["samples"]]
        return cls(root=Path(root), **obj)

    def save(self) -> None:
        obj = asdict(self)
        obj.pop("root")
        (self.root / "corpus.json").write_text(json.dumps(obj, indent=1))

    # cached per process: bytes read once
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def read(self, rel: str) -> bytes:
        if rel not in self._cache:
            self._cache[rel] = (self.root / rel).read_bytes()
        return self._cache[rel]

    def parsed(self, rel: str) -> dict:
        """A patch's header with its section bodies attached (a fresh copy each time)."""
        key = ("parsed", rel)
        if key not in self._cache:
            self._cache[key] = split_patch(self.read(rel))
        return copy.deepcopy(self._cache[key])


def build_corpus(root: Path, big_bombs: bool = False) -> Corpus:
    """Write the corpus under `root` (once: later calls load it). Needs torch (tests/ckpt_factory.py)."""
    root = Path(root)
    if (root / "corpus.json").exists():
        return Corpus.load(root)
    import torch

    from ckpt_factory import folder_bytes, mutate, random_tensor, save, save_series, save_sharded
    from pulsediff import apply_patch, make_patch
    from pulsediff.series.publish import publish_once

    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(2024)
    samples: list[Sample] = []

    def record(name, precision, base, target, patch, kind, **kw):
        ref = f"ref/{name}" + (".safetensors" if kind == "file" else "")
        (root / "ref").mkdir(exist_ok=True)
        apply_patch(root / base if base else None, root / patch, root / ref, device="cpu")
        if precision == "exact":
            same = ((root / ref).read_bytes() == (root / target).read_bytes() if kind == "file"
                    else folder_bytes(root / ref) == folder_bytes(root / target))
            assert same, f"corpus sample {name} does not rebuild its target"
        if kw.get("receiver"):
            kw["stream_reference"] = ref + ".stream"
            apply_patch(root / base, io.BytesIO((root / patch).read_bytes()), root / kw["stream_reference"],
                        device="cpu")
        samples.append(Sample(name, precision, base, target, patch, ref, kind, **kw))

    # Single files: every dtype family, a scalar, an empty tensor, added, removed and reshaped tensors.
    s0 = {"w": random_tensor(rng, "BF16", (64, 8)), "b": random_tensor(rng, "F32", (16,)),
          "h": random_tensor(rng, "F16", (40,)), "d": random_tensor(rng, "F64", (12,)),
          "q": random_tensor(rng, "F8_E4M3", (48,)), "ids": random_tensor(rng, "I32", (4,)),
          "gone": random_tensor(rng, "U8", (5,)), "r": random_tensor(rng, "BF16", (4, 6)),
          "e": random_tensor(rng, "F32", (0,)), "s": random_tensor(rng, "F32", ())}
    s1 = {"w": mutate(rng, s0["w"], 0.03), "b": mutate(rng, s0["b"], 0.5), "h": mutate(rng, s0["h"], 0.1),
          "d": mutate(rng, s0["d"], 0.2), "q": mutate(rng, s0["q"], 0.05), "ids": s0["ids"],
          "new": random_tensor(rng, "U8", (3,)), "r": random_tensor(rng, "BF16", (6, 4)), "e": s0["e"],
          "s": mutate(rng, s0["s"], 1.0)}
    s2 = {k: (mutate(rng, v, 0.1) if k in ("w", "h", "q", "d") else v) for k, v in s1.items()}
    (root / "ckpt").mkdir()
    for i, state in enumerate((s0, s1, s2)):
        save(state, root / f"ckpt/s{i}.safetensors", metadata={"format": "pt"})
    for codec in ("ctx-ac", "ctx-rans", "gap-zstd"):
        for a, b in ((0, 1), (1, 2)):
            make_patch(root / f"ckpt/s{a}.safetensors", root / f"ckpt/s{b}.safetensors",
                       root / f"ckpt/{codec}-{a}{b}.pulsediff", codec=codec, device="cpu")
        record(f"file-{codec}-01", "exact", "ckpt/s0.safetensors", "ckpt/s1.safetensors", f"ckpt/{codec}-01.pulsediff",
               "file", next=f"ckpt/{codec}-12.pulsediff", next_reference=f"ref/file-{codec}-12.safetensors")
        record(f"file-{codec}-12", "exact", "ckpt/s1.safetensors", "ckpt/s2.safetensors", f"ckpt/{codec}-12.pulsediff",
               "file", prev=f"ckpt/{codec}-01.pulsediff", prev_base="ckpt/s0.safetensors")
    make_patch(None, root / "ckpt/s1.safetensors", root / "ckpt/anchor.pulsediff", device="cpu")
    record("anchor", "exact", None, "ckpt/s1.safetensors", "ckpt/anchor.pulsediff", "file")

    # Model folders: shards, an index, carried files changed, kept, added and removed; resharded.
    layers = {f"layers.{i}.weight": random_tensor(rng, "BF16", (32, 16)) for i in range(6)}
    layers["norm"] = random_tensor(rng, "F32", (8,))
    moved = {k: mutate(rng, v, 0.05) for k, v in layers.items()}
    old_dir = save_sharded(layers, root / "dir/old", 2)
    new_dir = save_sharded(moved, root / "dir/new", 3)
    (old_dir / "config.json").write_text('{"step": 0}')
    (new_dir / "config.json").write_text('{"step": 1}')
    for d in (old_dir, new_dir):
        (d / "tokenizer.json").write_text('{"vocab": ["a", "b"]}')
    (old_dir / "README.md").write_text("old")
    (new_dir / "generation_config.json").write_text("{}")
    for codec in ("ctx-ac", "ctx-rans", "gap-zstd"):
        make_patch(old_dir, new_dir, root / f"dir/{codec}.pulsediff", codec=codec, device="cpu")
        record(f"dir-{codec}", "exact", "dir/old", "dir/new", f"dir/{codec}.pulsediff", "dir")

    # bf16: an FP32 trainer's steps, applied onto its cast (patch layout) and onto a BF16 copy (receiver's).
    t0 = {"a": random_tensor(rng, "F32", (64, 8)), "c": random_tensor(rng, "F32", (32,)), "ids": random_tensor(rng, "I32", (4,))}
    t0 = {k: (v.nan_to_num(0.0) if v.is_floating_point() else v) for k, v in t0.items()}
    t1 = {k: (v + 1e-3 * torch.randn_like(v) if v.is_floating_point() else v) for k, v in t0.items()}
    (root / "bf16").mkdir()
    save(t0, root / "bf16/t0.safetensors")
    save(t1, root / "bf16/t1.safetensors")
    save({k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in reversed(list(t0.items()))},
         root / "bf16/t0-bf16.safetensors", metadata={"saved_by": "another tool"})
    make_patch(root / "bf16/t0.safetensors", root / "bf16/t1.safetensors", root / "bf16/p.pulsediff",
               precision="bf16", device="cpu")
    record("bf16-cast", "bf16", "bf16/t0.safetensors", "bf16/t1.safetensors", "bf16/p.pulsediff", "file")
    record("bf16-receiver", "bf16", "bf16/t0-bf16.safetensors", "bf16/t1.safetensors", "bf16/p.pulsediff", "file",
           receiver=True)

    # A published series, for the manifests.
    train, pub = root / "series/train", root / "series/pub"
    train.mkdir(parents=True)
    save_series(train, 7, seed=0, shape=(64, 32), tensors=3, density=0.02)
    publish_once(train, pub, anchor_every=3, settle=0)

    # Decompression bombs: small frames that hold (or declare) far more than they weigh. The campaign's
    # are as large as the bounds allow; the CI suite's are smaller, so that they cost seconds, not minutes.
    (root / "bombs").mkdir()
    bombs = {}
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=True)
    sizes = ((b"\0", 256 << 20), (b"1,", 200 << 20), (b"[],", 240 << 20)) if big_bombs else (
        (b"\0", 16 << 20), (b"1,", 16 << 20), (b"[],", 30 << 20))
    for unit, size in ((b"\0", 1 << 20), *sizes):
        name = {b"\0": "zeros", b"1,": "json-ints", b"[],": "json-lists"}[unit] + f"-{size >> 20}M"
        path = root / f"bombs/{name}.zst"
        chunk = unit * ((1 << 20) // len(unit))
        total = (size // len(chunk)) * len(chunk) + (0 if unit == b"\0" else 3)
        with open(path, "wb") as f, cctx.stream_writer(f, size=total) as w:
            if unit != b"\0":
                w.write(b"[")
            for _ in range(size // len(chunk)):
                w.write(chunk)
            if unit != b"\0":
                w.write(b"0]")
        bombs[name] = f"bombs/{name}.zst"
    # A frame that declares 4 GiB and holds 16 bytes: its size field rewritten (8 bytes, single segment).
    small = cctx.compress(b"\0" * 16)
    (root / "bombs/declares-4G.zst").write_bytes(small[:4] + bytes([0xE0]) + struct.pack("<Q", 4 << 30) + small[6:])
    bombs["declares-4G"] = "bombs/declares-4G.zst"

    corpus = Corpus(root, samples, "ckpt/s0.safetensors", "ckpt/s1.safetensors", "ckpt/ctx-rans-01.pulsediff",
                    "dir-ctx-rans", "series/train", "series/pub", bombs)
    corpus.save()
    return Corpus.load(root)


# -- taking a patch apart and putting it back together --------------------------------


def split_patch(data: bytes) -> dict:
    """The header as JSON, each section dict carrying its body under "__body__". A 2.x header's
    tensor table comes as 1.x's entries (table_entries), its major under "__major__" (assemble
    writes the table back)."""
    _, major, _, _, header_len, _ = PREAMBLE.unpack(data[:32])
    header = json.loads(zstandard.ZstdDecompressor().decompress(data[32 : 32 + header_len]))
    if major >= 2:
        layout = header["layout"]["section"]
        header["tensors"] = table_entries(header["tensors"], layout["offset"] + layout["length"])
        header["__major__"] = major
    sections = data[32 + header_len :]
    for ref in section_refs(header):
        ref["__body__"] = sections[ref["offset"] : ref["offset"] + ref["length"]]
    return header


def section_refs(header) -> list[dict]:
    """The section dicts in the order the reader expects them: layout, tensors, folder files."""
    refs = []

    def take(obj):
        if isinstance(obj, dict) and isinstance(obj.get("section"), dict):
            refs.append(obj["section"])

    if isinstance(header, dict):
        take(header.get("layout"))
        for key in ("tensors", "files"):
            items = header.get(key)
            if isinstance(items, list):
                for item in items:
                    take(item)
    return refs


def _json_default(obj):
    return obj.hex() if isinstance(obj, (bytes, bytearray)) else str(obj)


def forge_frame(frame: bytes, major: int = 1, minor: int = 1, flags: int = 0) -> bytes:
    """A preamble with a valid checksum around any header frame."""
    fields = PREAMBLE.pack(MAGIC, major, minor, flags, len(frame), 0)[:24]
    h = xxhash.xxh3_64(fields)
    h.update(frame)
    return fields + struct.pack("<Q", h.intdigest()) + frame


def header_frame(header) -> bytes:
    raw = json.dumps(header, separators=(",", ":"), default=_json_default).encode()
    return zstandard.ZstdCompressor(level=3, write_content_size=True).compress(raw)


def assemble(header: dict, *, fix: bool = True, post=None, minor: int | None = None,
             major: int | None = None, post_table=None) -> bytes:
    """The patch for `header` and its attached bodies; with `fix`, every offset, length, checksum and
    target.bytes recomputed first. `post(header)` edits the header after that (so its edits stay).
    `major`, `minor`: the preamble's version (what a reader takes the version's rules from); by
    default the major split_patch found (else 1), and minor 0 for major 2, 1 for major 1. For major
    2 the entries go out as the tensor table (entries_table), after `post`; `post_table(header)`
    edits the header after that (the table's own columns)."""
    h = copy.deepcopy(header)
    found = h.pop("__major__", 1) if isinstance(h, dict) else 1
    major = found if major is None else major
    minor = (0 if major >= 2 else 1) if minor is None else minor
    bodies, offset = [], 0
    for ref in section_refs(h):
        body = ref.pop("__body__", None)
        if body is None:
            continue
        if fix:
            ref.update(offset=offset, length=len(body), xxh3=xxhash.xxh3_64_hexdigest(body))
        offset += len(body)
        bodies.append(body)
    _strip_bodies(h)
    if fix:
        fix_target_bytes(h)
    if post is not None:
        post(h)
    if major >= 2 and isinstance(h, dict):
        h["tensors"] = entries_table(h.get("tensors"))
    if post_table is not None:
        h = post_table(h)
    return forge_frame(header_frame(h), major=major, minor=minor) + b"".join(bodies)


# -- format 2.0's tensor table (FORMAT.md §2.1), written here from the spec: the tests' reference --

TABLE_FIELDS = ("name", "dtype", "op", "changed", "target_hash", "base_hash")


def table_entries(table: dict, start: int) -> list[dict]:
    """A valid 2.x tensor table as 1.x's entries, each section at its offset (back to back from
    `start`, the end of the layout's section)."""
    n = len(table["name"])
    entries, at = [], 0
    for i in range(n):
        e = {key: table[key][i] for key in TABLE_FIELDS}
        e["shape"] = table["dims"][at:at + table["ndim"][i]]
        at += table["ndim"][i]
        if e["base_hash"] is None:
            del e["base_hash"]
        for key in ("target_sum", "base_sum"):
            if key in table and table[key][i] is not None:
                e[key] = table[key][i]
        entries.append(e)
    sec, offset = table["section"], start
    owners = [e for e in entries if e["op"] != "same"]
    for j, e in enumerate(owners):
        params = {key: column[j] for key, column in sec["params"].items() if column[j] is not None}
        e["section"] = {"offset": offset, "length": sec["length"][j], "xxh3": sec["xxh3"][j],
                        "codec": sec["codec"][j], "params": params}
        offset += sec["length"][j]
    return entries


def entries_table(entries) -> object:
    """1.x's entries as a 2.x tensor table, whatever a mutation made of them: what cannot be
    placed in a column (an entry that is no object, a shape that is no list) goes in as it is, for
    the reader to refuse. Offsets are dropped: a 2.x reader derives them."""
    if not isinstance(entries, list):
        return entries
    rows = [e if isinstance(e, dict) else {"name": e} for e in entries]
    table = {key: [r.get(key) for r in rows] for key in TABLE_FIELDS}
    shapes = [r.get("shape") for r in rows]
    table["ndim"] = [len(s) if isinstance(s, list) else s for s in shapes]
    table["dims"] = [d for s in shapes if isinstance(s, list) for d in s]
    if any("target_sum" in r or "base_sum" in r for r in rows):
        table["target_sum"] = [r.get("target_sum") for r in rows]
        table["base_sum"] = [r.get("base_sum") for r in rows]
    sections = [r["section"] if isinstance(r["section"], dict) else {"codec": r["section"]}
                for r in rows if "section" in r]
    params = [s.get("params") if isinstance(s.get("params"), dict) else {} for s in sections]
    keys = list(dict.fromkeys(k for p in params for k in p))
    table["section"] = {"length": [s.get("length") for s in sections], "xxh3": [s.get("xxh3") for s in sections],
                        "codec": [s.get("codec") for s in sections],
                        "params": {k: [p.get(k) for p in params] for k in keys}}
    bad = [s.get("params") for s in sections if not isinstance(s.get("params"), dict)]
    if bad:  # params that are no object: the table's params object is that value
        table["section"]["params"] = bad[0]
    return table


def _strip_bodies(obj) -> None:
    """Bodies a mutation moved out of a section's place travel nowhere."""
    if isinstance(obj, dict):
        obj.pop("__body__", None)
        for v in obj.values():
            _strip_bodies(v)
    elif isinstance(obj, list):
        for v in obj:
            _strip_bodies(v)


def tensor_nbytes(t: dict) -> int:
    return math.prod(t["shape"]) * DTYPES[t["dtype"]].itemsize


def fix_target_bytes(h: dict) -> None:
    """target.bytes as the layout and tensors imply it, where the header is well-formed enough to say."""
    try:
        lay = h["layout"]
        total = sum(8 + f["header_len"] for f in lay["files"]) + sum(tensor_nbytes(t) for t in h["tensors"])
        total += (lay.get("index_len") or 0) + sum(f["bytes"] for f in h.get("files", []))
        if isinstance(total, int):
            h["target"]["bytes"] = total
    except Exception:
        pass


def decompress(frame: bytes, limit: int = 64 << 20) -> bytes | None:
    try:
        if zstandard.frame_content_size(frame) > limit:  # zstandard would allocate what the frame declares
            return None
        return zstandard.ZstdDecompressor().decompress(frame, max_output_size=limit)
    except zstandard.ZstdError:
        return None


def compress(data: bytes, rng: random.Random | None = None) -> bytes:
    content_size = rng is None or rng.random() < 0.9
    checksum = rng is not None and rng.random() < 0.2
    return zstandard.ZstdCompressor(level=1, write_content_size=content_size, write_checksum=checksum).compress(data)


# -- mutations of values, bytes and JSON ------------------------------------------------


VOCABULARY = [*DTYPES, "same", "patch", "full", *CODEC_IDS, "zstd", "file", "dir", "exact", "bf16",
              "model.safetensors", INDEX_NAME, "config.json"]


def nested(depth: int):
    value = 0
    for _ in range(depth):
        value = [value]
    return value


def hostile_value(rng: random.Random, old, pool: list):
    choices = [
        None, True, False, 0, 1, -1, 0.5, -0.0, 1e308, float("inf"), float("nan"),
        2**31, 2**32, 2**48, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64, -(2**63), 10**40,
        "", " ", "x", "\x00", "/", "..", "../x", "a/b.safetensors", ".hidden", "\ud800", "\udc80", "é",
        "A" * 5000, [], {}, [0], [[]], {"": 0}, nested(rng.randint(5, 40)), [0] * rng.choice([2, 65, 5000]),
    ]
    if isinstance(old, int) and not isinstance(old, bool):
        choices += [old + 1, old - 1, old * 2, old // 2, -old, old + 2**32, old * 1000, old ^ 1]
    if isinstance(old, str):
        choices += [old + "x", old[:-1], old.upper(), old.lower(), old * 2, old + "\x00", "/" + old]
    if isinstance(old, list):
        choices += [old[:-1], old + old[-1:], old[::-1], [old], old * 2]
    if isinstance(old, dict):
        choices += [dict(list(old.items())[:-1]), {**old, "extra": 1}]
    if pool:
        choices += [rng.choice(pool) for _ in range(8)]
    return copy.deepcopy(rng.choice(choices))


def json_paths(value, path=()):
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            if k not in ("__body__", "__major__"):  # the harness's own fields: not the patch's to mutate
                yield from json_paths(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from json_paths(v, path + (i,))


def json_leaves(value) -> list:
    out = []
    for p in json_paths(value):
        v = get_path(value, p)
        if not isinstance(v, (dict, list)):
            out.append(v)
    return out


def get_path(doc, path):
    for k in path:
        doc = doc[k]
    return doc


def set_path(doc, path, value):
    if not path:
        return value
    get_path(doc, path[:-1])[path[-1]] = value
    return doc


def mutate_json(doc, rng: random.Random, n: int | None = None):
    """`doc` with 1 to 3 random edits: values replaced by hostile ones of any type, keys removed or
    added, list items dropped, doubled or swapped, two nodes exchanged. Returns the new document."""
    pool = [v for v in json_leaves(doc) if not isinstance(v, (bytes, bytearray))] + VOCABULARY
    for _ in range(n or rng.choice([1, 1, 1, 2, 3])):
        paths = list(json_paths(doc))
        path = rng.choice(paths)
        node = get_path(doc, path)
        op = rng.random()
        if op < 0.55 or not isinstance(node, (dict, list)) and op < 0.85:
            doc = set_path(doc, path, hostile_value(rng, node, pool))
        elif op < 0.85 and isinstance(node, dict):
            keys = [k for k in node if k not in ("__body__", "__major__")]
            if keys and rng.random() < 0.6:
                del node[rng.choice(keys)]
            else:
                node[rng.choice(["extra", "digest", "index_len", "section", "files", "removed_files", "op"])] = (
                    hostile_value(rng, None, pool))
        elif op < 0.85 and isinstance(node, list):
            r = rng.random()
            if node and r < 0.3:
                del node[rng.randrange(len(node))]
            elif node and r < 0.6:
                i = rng.randrange(len(node))
                node.insert(rng.randrange(len(node) + 1), copy.deepcopy(node[i]))
            elif len(node) > 1 and r < 0.85:
                i, j = rng.sample(range(len(node)), 2)
                node[i], node[j] = node[j], node[i]
            else:
                node.insert(rng.randrange(len(node) + 1), hostile_value(rng, None, pool))
        else:  # exchange two nodes, neither inside the other
            other = rng.choice(paths)
            if path and other and path[: len(other)] != other and other[: len(path)] != path:
                a, b = copy.deepcopy(get_path(doc, path)), copy.deepcopy(get_path(doc, other))
                set_path(doc, path, b)
                set_path(doc, other, a)
    return doc


INTERESTING_INTS = [0, 1, 2, 7, 8, 255, 256, 2**15, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
                    2**48, 2**62, 2**63 - 1, 2**63, 2**64 - 1]


def mutate_bytes(rng: random.Random, data: bytes, n: int | None = None) -> bytes:
    b = bytearray(data)
    for _ in range(n or rng.choice([1, 1, 1, 2, 3, 8])):
        op = rng.randrange(10)
        i = rng.randrange(len(b)) if b else 0
        if op == 0 and b:
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            b[i] = rng.choice([0, 0xFF, 0x7F, 0x80, rng.randrange(256)])
        elif op == 2:
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        elif op == 3 and b:
            del b[i : i + rng.randint(1, 16)]
        elif op == 4:
            del b[i:]
        elif op == 5:
            b += rng.choice([b"\0", b"\xff", bytes([rng.randrange(256)])]) * rng.randint(1, 64)
        elif op == 6 and b:
            j = rng.randrange(len(b))
            b[j:j] = b[i : i + rng.randint(1, 32)]
        elif op == 7:
            width = rng.choice([1, 2, 4, 8])
            value = rng.choice(INTERESTING_INTS) & ((1 << (8 * width)) - 1)
            b[i : i + width] = value.to_bytes(width, "little")
        elif op == 8:
            b = bytearray(rng.choice([b"", b"\0", b"\xff" * rng.randint(1, 64)]))
        elif op == 9 and b:
            b[i] = (b[i] + rng.choice([1, -1])) & 0xFF
    return bytes(b)


def mutate_zstd(rng: random.Random, frame: bytes, corpus: Corpus | None = None) -> bytes:
    """A zstd section changed inside (decompressed, edited, compressed again) or as a frame."""
    content = decompress(frame)
    r = rng.random()
    if content is not None and r < 0.55:
        return compress(mutate_bytes(rng, content), rng)
    if content is not None and r < 0.62:
        return zstandard.ZstdCompressor(write_content_size=False).compress(content)
    if content is not None and r < 0.68:
        return frame + compress(content)  # two frames
    if r < 0.72:
        return b"\x50\x2a\x4d\x18" + struct.pack("<I", 4) + b"skip" + frame  # a skippable frame first
    if corpus is not None and r < 0.80:
        return corpus.read(rng.choice(list(corpus.bombs.values())))
    return mutate_bytes(rng, frame)


# -- codec-aware section mutations -----------------------------------------------------


def mutate_gap_zstd(rng: random.Random, body: bytes, params: dict, numel: int, itemsize: int) -> tuple[bytes, dict]:
    params = dict(params)
    g = params.get("gap_bytes") if isinstance(params.get("gap_bytes"), int) else 0
    width = params.get("gap_width") if params.get("gap_width") in (4, 8) else 4
    gap_frame, value_frame = body[:g], body[g:]
    raw = decompress(gap_frame)
    r = rng.random()
    if raw is not None and len(raw) % width == 0 and r < 0.45:
        gaps = np.frombuffer(raw, f"<u{width}").astype(np.uint64)
        op = rng.randrange(6)
        if op == 0 and gaps.size:
            gaps[rng.randrange(gaps.size)] = np.uint64(rng.choice([0, 1, numel, numel + 1, 2**32 - 1, 2**63 - 1,
                                                                   2**63, 2**64 - 1]) & ((1 << (8 * width)) - 1))
        elif op == 1 and gaps.size > 1:
            i, j = rng.sample(range(gaps.size), 2)
            gaps[i], gaps[j] = gaps[j], gaps[i]
        elif op == 2:
            gaps = np.append(gaps, np.uint64(rng.choice([1, numel])))
        elif op == 3 and gaps.size:
            gaps = gaps[:-1]
        elif op == 4:  # the other width
            width = 12 - width
            params["gap_width"] = width
        else:
            gaps = np.zeros(gaps.size, np.uint64)
        gap_frame = compress(gaps.astype(f"<u{width}").tobytes(), rng)
        if rng.random() < 0.7:
            params["count"] = int(gaps.size)
    elif r < 0.6:
        values = decompress(value_frame)
        if values is not None:
            values = mutate_bytes(rng, values) if rng.random() < 0.5 else values + b"\0" * itemsize
            value_frame = compress(values, rng)
    elif r < 0.75:
        if rng.random() < 0.5:
            gap_frame = mutate_zstd(rng, gap_frame)
        else:
            value_frame = mutate_zstd(rng, value_frame)
    elif r < 0.9:
        key = rng.choice(["count", "gap_width", "gap_bytes"])
        params[key] = hostile_value(rng, params.get(key), [])
    else:
        return mutate_bytes(rng, body), params
    if rng.random() < 0.9:
        params["gap_bytes"] = len(gap_frame)
    return gap_frame + value_frame, params


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _parse_records(data: bytes, layout: str) -> list[list[int]] | None:
    """ctx-rans tables: a varint count, then records of varints ("v") and single bytes ("b")."""
    try:
        n, pos = _read_varint(data, 0)
        records = []
        for _ in range(min(n, 4096)):
            rec = []
            for f in layout:
                if f == "v":
                    v, pos = _read_varint(data, pos)
                else:
                    v, pos = data[pos], pos + 1
                rec.append(v)
            records.append(rec)
        return records
    except IndexError:
        return None


def _write_records(records: list[list[int]], layout: str, count: int | None = None) -> bytes:
    out = bytearray(_varint(len(records) if count is None else count))
    for rec in records:
        for f, v in zip(layout, rec):
            out += _varint(v) if f == "v" else bytes([v & 0xFF])
    return bytes(out)


CTX_PARTS = ("table_bytes", "position_bytes", "frequency_bytes", "value_bytes")


def mutate_ctx_rans(rng: random.Random, body: bytes, params: dict, numel: int, itemsize: int) -> tuple[bytes, dict]:
    params = dict(params)
    lens = [params.get(k) if isinstance(params.get(k), int) and params.get(k) >= 0 else 0 for k in CTX_PARTS]
    bounds = np.cumsum([0, *lens]).tolist()
    parts = [body[bounds[i] : bounds[i + 1]] for i in range(4)] + [body[bounds[4] :]]
    which = rng.randrange(8)
    if which in (0, 2):  # the class table or the frequency table, parsed
        layout = "vvb" if which == 0 else "bv"
        records = _parse_records(parts[which], layout)
        if records is None:
            parts[which] = mutate_bytes(rng, parts[which])
        else:
            count = None
            op = rng.randrange(6)
            if op == 0 and records:
                rec = rng.choice(records)
                f = rng.randrange(len(layout))
                rec[f] = rng.choice([0, 1, 62, 63, 64, 255, 4095, 4096, 4097, numel, numel + 1, 2**12, 2**40, 2**63])
                if layout[f] == "b":
                    rec[f] &= 0xFF
            elif op == 1 and len(records) > 1:
                i, j = rng.sample(range(len(records)), 2)
                records[i], records[j] = records[j], records[i]
            elif op == 2 and records:
                records.insert(rng.randrange(len(records) + 1), list(rng.choice(records)))
            elif op == 3 and records:
                del records[rng.randrange(len(records))]
            elif op == 4:
                count = rng.choice([0, len(records) + 1, 4097, 2**20, 2**62])
            else:
                records.append([rng.choice([255, 4095, 0]), rng.choice([1, 4096, 2**30]), 5][: len(layout)])
            parts[which] = _write_records(records, layout, count)
    elif which == 1:
        parts[1] = rng.choice([mutate_bytes(rng, parts[1]), b"\xff" * rng.choice([8, 200_000]), b"\0" * len(parts[1])])
    elif which == 3:
        parts[3] = mutate_bytes(rng, parts[3])
    elif which == 4:
        parts[4] = rng.choice([mutate_bytes(rng, parts[4]), parts[4] + b"\xff" * itemsize, parts[4][:-itemsize] if itemsize else b""])
    elif which == 5:
        key = rng.choice(["class_shift", "class_bits", "count", "escapes"])
        params[key] = rng.choice([0, 1, 7, 12, 13, 52, 63, 64, params.get(key, 0) + 1, params.get(key, 0) - 1,
                                  hostile_value(rng, params.get(key), [])])
    elif which == 6 and len(parts) == 5:
        i, j = rng.sample(range(4), 2)
        parts[i], parts[j] = parts[j], parts[i]
    else:
        return mutate_bytes(rng, body), params
    if rng.random() < 0.9:
        for k, p in zip(CTX_PARTS, parts):
            params[k] = len(p)
        if itemsize and rng.random() < 0.9:
            params["escapes"] = len(parts[4]) // itemsize
    return b"".join(parts), params


def mutate_ctx_ac(rng: random.Random, body: bytes, params: dict, numel: int, itemsize: int) -> tuple[bytes, dict]:
    """The three parts of a ctx-ac section (FORMAT.md 6.4): position part, sign bitmap, value stream."""
    params = dict(params)
    count = params.get("count") if isinstance(params.get("count"), int) and params.get("count") > 0 else 1
    split = params.get("position_bytes") if isinstance(params.get("position_bytes"), int) else 0
    split = min(max(split, 0), len(body))
    sign_end = min(split + (count + 7) // 8, len(body))
    parts = [body[:split], body[split:sign_end], body[sign_end:]]
    which = rng.randrange(7)
    if which in (0, 1, 2):  # one part's bytes
        parts[which] = rng.choice([mutate_bytes(rng, parts[which]), parts[which][: rng.randrange(len(parts[which]) + 1)],
                                   parts[which] + bytes([rng.randrange(256)]), b"\xff" * len(parts[which]),
                                   b"\0" * len(parts[which])])
    elif which == 3:  # the range streams' ends: a zero byte appended, or the last byte dropped
        i = rng.choice([0, 2])
        parts[i] = rng.choice([parts[i] + b"\0", parts[i][:-1], parts[i] + b"\0" * 4])
    elif which == 4:
        key = rng.choice(["class_shift", "class_bits", "count", "position_bytes"])
        params[key] = rng.choice([0, 1, 7, 12, 13, 52, 63, 64, params.get(key, 0) + 1, params.get(key, 0) - 1,
                                  hostile_value(rng, params.get(key), [])])
    elif which == 5:
        i, j = rng.sample(range(3), 2)
        parts[i], parts[j] = parts[j], parts[i]
    else:
        return mutate_bytes(rng, body), params
    if which != 4 and rng.random() < 0.9:
        params["position_bytes"] = len(parts[0])
    return b"".join(parts), params


def mutate_section(rng: random.Random, corpus: Corpus, entry: dict) -> None:
    """Change one tensor's section (and sometimes its entry), as deep as its codec allows."""
    sec = entry["section"]
    numel, itemsize = math.prod(entry["shape"]), DTYPES[entry["dtype"]].itemsize
    body, codec = sec["__body__"], sec["codec"]
    if codec == "gap-zstd":
        sec["__body__"], sec["params"] = mutate_gap_zstd(rng, body, sec["params"], numel, itemsize)
    elif codec == "ctx-rans":
        sec["__body__"], sec["params"] = mutate_ctx_rans(rng, body, sec["params"], numel, itemsize)
    elif codec == "ctx-ac":
        sec["__body__"], sec["params"] = mutate_ctx_ac(rng, body, sec["params"], numel, itemsize)
    else:
        sec["__body__"] = mutate_zstd(rng, body, corpus)
    if rng.random() < 0.2 and isinstance(sec["params"].get("count"), int):
        entry["changed"] = sec["params"]["count"]  # keep the header's relation, to reach the decoder
    if rng.random() < 0.1:
        entry.update(rng.choice([{"op": "full"}, {"op": "patch"}, {"changed": hostile_value(rng, entry["changed"], [])}]))


# -- hostile safetensors headers ---------------------------------------------------------


HOSTILE_NAMES = ["", " ", "\x00", "a/b", "../x", "\ud800", "\udcff", "é", "\n", "x" * 4096, "x" * 4097,
                 "__metadata__", "model.safetensors"]
HOSTILE_DTYPES = [*DTYPES, "bf16", "", 5, None, "F8_E4M3FNUZ", "C64", "F4", "BOOL ", ["F32"], "U128"]


def read_safetensors(data: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def write_safetensors(rng: random.Random, header: dict, data: bytes, *, pad: bool = True) -> bytes:
    raw = json.dumps(header, separators=rng.choice([(",", ":"), (", ", ": ")]), ensure_ascii=True).encode()
    if rng.random() < 0.3:
        try:
            raw = json.dumps(header, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate can only travel escaped
            pass
    if pad:
        raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def _tensor_keys(header: dict) -> list[str]:
    return [k for k in header if k != "__metadata__"]


def mutate_safetensors(rng: random.Random, data: bytes) -> bytes:
    """A safetensors file changed in its header (types, names, shapes, offsets, metadata), in
    ways that keep it consistent as often as ways that do not, or in its raw bytes."""
    header, body = read_safetensors(data)
    body = bytearray(body)
    raw_edit = None
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        keys = _tensor_keys(header)
        name = rng.choice(keys) if keys else None
        entry = header.get(name) if name else None
        op = rng.randrange(15)
        try:
            header, body, raw_edit = _st_edit(rng, op, header, body, keys, name, entry, raw_edit)
        except (TypeError, ValueError, KeyError, IndexError, AttributeError):
            pass  # an earlier edit made this one meaningless
    return _st_finish(rng, header, bytes(body), raw_edit)


def _st_edit(rng, op, header, body, keys, name, entry, raw_edit):
    """One edit of a safetensors header (op picks which); returns the new (header, body, raw_edit)."""
    if op == 0 and name:  # rename (the order of keys is kept)
        new = rng.choice(HOSTILE_NAMES + keys)
        header = {(new if k == name else k): v for k, v in header.items()}
    elif op == 1 and entry:
        entry["dtype"] = copy.deepcopy(rng.choice(HOSTILE_DTYPES))
    elif op == 2 and entry:
        numel = math.prod(entry["shape"])
        entry["shape"] = copy.deepcopy(rng.choice([
            [], [0], [numel] + [1] * 63, [numel] + [1] * 64, [2**62, 2**62], [-1], [1.5], ["2"], [True], None, {},
            [numel], entry["shape"][::-1], entry["shape"] + [1], [0, 2**62], [2**63], [2**64], [numel, 0]]))
    elif op == 3 and entry:
        b, e = entry["data_offsets"]
        entry["data_offsets"] = copy.deepcopy(rng.choice([
            [b, e + 1], [b - 1, e - 1], [e, b], [0, e], [b, b], [0, 2**64], [-1, e], [str(b), e], [b],
            [b, e, 0], None, [float(b), e], [b + 1, e + 1]]))
    elif op == 4:
        header["__metadata__"] = copy.deepcopy(rng.choice([
            {"k": 1}, {"k": {"a": "b"}}, "s", [], None, {"k": "\ud800"}, {"": ""}, {"k": "v" * 10000},
            {str(i): "v" for i in range(1000)}, {"format": "pt"}]))
    elif op == 5 and entry:
        entry[rng.choice(["dtype", "shape", "data_offsets", "extra"])] = nested(rng.randint(10, 40))
    elif op == 6 and entry:
        entry["extra"] = hostile_value(rng, None, [])
    elif op == 7:
        items = list(header.items())
        rng.shuffle(items)
        header = dict(items)
    elif op == 8:  # a new tensor, consistent, at the end of the data
        dtype = rng.choice(list(DTYPES))
        shape = copy.deepcopy(rng.choice([[3], [], [0], [1] * 64, [1] * 65, [0, 2**62], [2, 0, 5], [1] * 63 + [2]]))
        n = math.prod(shape) * DTYPES[dtype].itemsize
        tname = rng.choice(HOSTILE_NAMES + ["added", "added.2"])
        header[tname] = {"dtype": dtype, "shape": shape, "data_offsets": [len(body), len(body) + n]}
        body += bytes(rng.randrange(256) if dtype != "BOOL" else rng.randrange(2) for _ in range(n))
    elif op == 9 and name:  # a tensor dropped, the others moved up: consistent
        b, e = entry["data_offsets"]
        del header[name]
        del body[b:e]
        for other in _tensor_keys(header):
            o = header[other]["data_offsets"]
            if o[0] >= e:
                header[other]["data_offsets"] = [o[0] - (e - b), o[1] - (e - b)]
    elif op == 10:  # many tiny tensors
        for i in range(rng.choice([100, 2000])):
            header[f"t{i}"] = {"dtype": "U8", "shape": [1], "data_offsets": [len(body), len(body) + 1]}
            body += b"\0"
    elif op == 11:
        body = bytearray(rng.choice([body[:-1], body + b"\0", body[: len(body) // 2], b""]))
    elif op == 12:
        header = mutate_json(header, rng)
        if not isinstance(header, dict):
            header = {"x": header}
    else:
        raw_edit = op
    return header, body, raw_edit


def _st_finish(rng, header, body: bytes, raw_edit) -> bytes:
    out = write_safetensors(rng, header, body, pad=rng.random() < 0.8)
    if raw_edit is None:
        return out
    n = struct.unpack("<Q", out[:8])[0]
    text = out[8 : 8 + n]
    r = rng.randrange(6)
    if r == 0:  # the length field lies
        n2 = rng.choice([0, 1, 2, n - 1, n + 1, n + 8, 2**63, 100_000_001, len(out)])
        return struct.pack("<Q", n2) + out[8:]
    if r == 1 and b'{"' in text[:3]:  # a key twice
        key_end = text.index(b'"', 2)
        dup = text[1 : key_end + 1] + b":0,"
        text = text[:1] + dup + text[1:]
    elif r == 2:
        text = rng.choice([b"\xef\xbb\xbf" + text, text + b"\0", text.replace(b" ", b"\t"), b"\n" + text])
    elif r == 3:
        text = mutate_bytes(rng, text)
    elif r == 4:
        text = text[: rng.randrange(len(text) + 1)]
    else:
        return mutate_bytes(rng, out)
    return struct.pack("<Q", len(text)) + text + out[8 + n :]


# -- checking an accepted output against what the patch says ------------------------------


def strip_header(h) -> object:
    """The header without what the assembly recomputes (where sections lie, codec params, size)."""
    h = copy.deepcopy(h)
    _strip_bodies(h)
    for ref in section_refs(h):
        for k in ("offset", "length", "xxh3", "params"):
            ref.pop(k, None)
    if isinstance(h, dict) and isinstance(h.get("target"), dict):
        h["target"].pop("bytes", None)
    return h


def visible(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and not p.name.startswith(".")}


def hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def check_claims(out: Path, h: dict, blob: bytes | None, *, in_place: bool, receiver: bool) -> str | None:
    """Why the output at `out` is not what header `h` (with layout blob `blob`) says, or None."""
    from pulsediff.io.checkpoint import Checkpoint
    from pulsediff.format.digest import TensorId, scheme_of

    try:
        claims = [TensorId(t["name"], t["dtype"], tuple(t["shape"]), t["target_hash"]) for t in h["tensors"]]
        scheme = scheme_of(h["target"]["digest"])
        if scheme.digest(claims) != h["target"]["digest"]:
            return "accepted a header whose tensors do not make its target digest"
    except Exception as exc:  # a header that apply accepted must at least be this well-formed
        return f"accepted a malformed header ({type(exc).__name__}: {exc})"

    def hash_of(data) -> str:  # the plain references, not the code under test
        return tree_hash_ref(np.frombuffer(data, np.uint8)) if scheme.tree else xxhash.xxh3_128_hexdigest(data)

    lay = h["layout"]
    if receiver:  # bf16 onto a BF16 base: the base's layout, so check the tensors only
        try:
            with Checkpoint(out) as ckpt:
                got = {n: (ckpt.entry(n).dtype.name, ckpt.entry(n).shape,
                           hash_of(ckpt.raw_bytes(n).tobytes())) for n in ckpt.names}
        except PulsediffError as exc:
            return f"output is not a valid checkpoint ({exc})"
        want = {t.name: (t.dtype, t.shape, t.hash) for t in claims}
        return None if got == want else "rebuilt tensors differ from the header's"
    if blob is None:
        return "accepted a layout section that does not decompress"
    if lay["kind"] == "file" and not out.is_file() or lay["kind"] == "dir" and not out.is_dir():
        return f"output is not a {lay['kind']}"
    pos = first = 0
    expected = set()
    for f in lay["files"]:
        raw = blob[pos : pos + f["header_len"]]
        pos += f["header_len"]
        records = h["tensors"][first : first + f["tensors"]]
        first += f["tensors"]
        path = out if lay["kind"] == "file" else out / f["name"]
        expected.add(f["name"])
        if not path.is_file():
            return f"{f['name'] or 'the file'} is missing"
        data = path.read_bytes()
        if data[:8] != len(raw).to_bytes(8, "little") or data[8 : 8 + len(raw)] != raw:
            return f"{f['name'] or 'the file'}: header bytes differ from the layout"
        p = 8 + len(raw)
        for t in records:
            n = tensor_nbytes(t)
            if hash_of(data[p : p + n]) != t["target_hash"]:
                return f"tensor {t['name']!r}: bytes differ from its target_hash"
            p += n
        if p != len(data):
            return f"{f['name'] or 'the file'}: {len(data) - p} bytes after the last tensor"
    if pos + (lay.get("index_len") or 0) != len(blob):
        return "layout blob is longer than its files"
    if lay.get("index_len") is not None:
        expected.add(INDEX_NAME)
        if (out / INDEX_NAME).read_bytes() != blob[pos:]:
            return "index differs from the layout"
    for fr in h.get("files", []):
        path = out / fr["name"]
        if not path.is_file():
            if fr["op"] == "same" and h["precision"] == "bf16":
                continue
            return f"folder file {fr['name']} is missing"
        expected.add(fr["name"])
        data = path.read_bytes()
        if len(data) != fr["bytes"] or xxhash.xxh3_128_hexdigest(data) != fr["hash"]:
            return f"folder file {fr['name']} differs from its hash"
    if lay["kind"] == "dir":
        if hidden(out):
            return f"left {hidden(out)[:3]} in the folder"
        if not in_place and set(visible(out)) != expected:
            return f"folder holds {sorted(set(visible(out)) ^ expected)[:4]} beyond what the patch says"
        for name in h.get("removed_files", []):
            if (out / name).exists():
                return f"removed file {name} is still there"
    return None


def output_problem(out: Path, h: dict, blob: bytes | None, sample: Sample, corpus: Corpus, *, in_place: bool,
                   clean: bool) -> str | None:
    """The output of an accepted apply against the claims, and against the reference when `clean`."""
    problem = check_claims(out, h, blob, in_place=in_place, receiver=sample.receiver)
    if problem or not clean:
        return problem
    refs = [corpus.path(r) for r in (sample.reference, sample.stream_reference) if r]
    if sample.kind == "file":
        if any(out.read_bytes() == ref.read_bytes() for ref in refs):
            return None
        return "output differs from the target, byte for byte"
    ref = refs[0]
    got, want = visible(out), visible(ref)
    if in_place:
        got = {k: v for k, v in got.items() if k in want}
    return None if got == want else f"folder differs from the target in {sorted(set(got) ^ set(want)) or 'content'}"


# -- patch cases ------------------------------------------------------------------------------


def reshape_tensor(h: dict, name: str, shape: list) -> None:
    """Give tensor `name` another shape in the header and in its file's layout header alike: a
    consistent lie about its size."""
    next(t for t in h["tensors"] if t["name"] == name)["shape"] = list(shape)
    edit_layout_headers(h, lambda header, records: None)


def edit_layout_headers(h: dict, edit) -> None:
    """Apply `edit(header_json, records)` to each file's safetensors header in the layout, then redo data
    offsets (in the records' order), padding, header lengths and the layout digest."""
    lay = h["layout"]
    blob = decompress(lay["section"]["__body__"])
    pos = first = 0
    parts = []
    for f in lay["files"]:
        header = json.loads(blob[pos : pos + f["header_len"]])
        pos += f["header_len"]
        records = h["tensors"][first : first + f["tensors"]]
        first += f["tensors"]
        header = edit(header, records) or header
        offset = 0
        out = {"__metadata__": header["__metadata__"]} if "__metadata__" in header else {}
        for t in records:
            n = tensor_nbytes(t)
            out[t["name"]] = {**header.get(t["name"], {}), "dtype": t["dtype"], "shape": t["shape"],
                              "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(out, separators=(",", ":")).encode()
        raw += b" " * (-(8 + len(raw)) % 8)
        f["header_len"] = len(raw)
        parts.append(raw)
    blob = b"".join(parts) + blob[pos:]  # and the index, if any
    lay["section"]["__body__"] = compress(blob)
    lay["digest"] = xxhash.xxh3_128_hexdigest(blob)


def retarget(h: dict) -> None:
    """target.digest recomputed from the tensor entries, so that a lie about them is told consistently."""
    from pulsediff.format.digest import TREE, TensorId, is_digest, scheme_of

    digest = h["target"]["digest"]
    scheme = scheme_of(digest) if is_digest(digest) else TREE
    h["target"]["digest"] = scheme.digest(
        [TensorId(t["name"], t["dtype"], tuple(t["shape"]), t["target_hash"]) for t in h["tensors"]])


HOSTILE_SHAPES = [[2**40], [0], [2**24, 2**24], [1] * 64, [2**28], [3, 0, 2**40], [2**44 // 8, 2]]


def mutate_consistently(rng: random.Random, corpus: Corpus, h: dict) -> None:
    """A lie the header and its layout tell together: shapes, dtypes, names, order, files; the section of a
    resized whole tensor becomes a frame that declares the new size (a bomb, or one that only says so)."""
    try:
        t = rng.choice(h["tensors"])
        op = rng.randrange(6)
        if op == 0:
            t["shape"] = copy.deepcopy(rng.choice(HOSTILE_SHAPES + [[math.prod(t["shape"]) + 1], t["shape"][::-1]]))
            numel = math.prod(t["shape"])
            t["changed"] = min(t["changed"], numel) if t["op"] != "full" else numel
            if t["op"] == "full":
                size = tensor_nbytes(t)
                small = compress(b"\0" * 16)
                t["section"]["__body__"] = rng.choice([
                    small[:4] + bytes([0xE0]) + struct.pack("<Q", size) + small[6:],  # declares it, holds 16 bytes
                    corpus.read(rng.choice(list(corpus.bombs.values()))),
                    zstandard.ZstdCompressor(level=1).compress(b"\0" * min(size, 1 << 24))])
        elif op == 1:
            t["dtype"] = rng.choice(list(DTYPES))
        elif op == 2:
            t["name"] = rng.choice(["renamed", t["name"] + ".x", "a" * 4096, h["tensors"][0]["name"]])
        elif op == 3:
            f = rng.choice(h["layout"]["files"])
            if f["tensors"] > 1:  # two tensors of one file swap places
                start = sum(g["tensors"] for g in h["layout"]["files"][: h["layout"]["files"].index(f)])
                i, j = rng.sample(range(start, start + f["tensors"]), 2)
                h["tensors"][i], h["tensors"][j] = h["tensors"][j], h["tensors"][i]
        elif op == 4 and len(h["layout"]["files"]) > 1:  # a tensor moves to the next file
            f, g = h["layout"]["files"][:2]
            if f["tensors"] > 1:
                f["tensors"] -= 1
                g["tensors"] += 1
        else:
            t["op"], t["changed"] = rng.choice([("same", 0), ("full", math.prod(t["shape"]))])
            t.pop("section", None) if t["op"] == "same" else t.setdefault(
                "section", {"codec": "full-zstd", "params": {}, "__body__": compress(b"\0" * tensor_nbytes(t))})
            t["base_hash"] = t.get("base_hash") or t["target_hash"]
        edit_layout_headers(h, lambda header, records: None)
        if rng.random() < 0.7:
            retarget(h)
    except (KeyError, TypeError, ValueError, IndexError, OverflowError):
        pass  # the sample lacks what this lie needs


def _pick_sample(rng: random.Random, corpus: Corpus, predicate) -> tuple[Sample, dict]:
    choices = [s for s in corpus.samples if predicate(s)]
    sample = rng.choice(choices)
    return sample, corpus.parsed(sample.patch)


def _layout_blob(h) -> bytes | None:
    try:
        return decompress(h["layout"]["section"]["__body__"])
    except (KeyError, TypeError):
        return None


def case_codec(codec: str):
    def case(corpus: Corpus, rng: random.Random, work: Path, judge: Judge) -> None:
        key = ("with codec", codec)
        if key not in corpus._cache:
            corpus._cache[key] = [s for s in corpus.samples if any(
                t.get("section", {}).get("codec") == codec for t in corpus.parsed(s.patch)["tensors"])]
        sample = rng.choice(corpus._cache[key])
        h = corpus.parsed(sample.patch)
        entries = [t for t in h["tensors"] if t.get("section", {}).get("codec") == codec]
        for entry in rng.sample(entries, rng.choice([1, 1, 1, 2]) if len(entries) > 1 else 1):
            mutate_section(rng, corpus, entry)
        run_patch(corpus, rng, work, judge, sample, h)

    return case


def case_header(corpus: Corpus, rng: random.Random, work: Path, judge: Judge) -> None:
    sample, h = _pick_sample(rng, corpus, lambda s: True)
    r = rng.random()
    if r < 0.5:
        h = mutate_json(h, rng)
        if rng.random() < 0.3:
            try:
                retarget(h)  # past the digest relation, to the checks behind it
            except Exception:
                pass
        run_patch(corpus, rng, work, judge, sample, h)
    elif r < 0.7:  # lies told consistently: header, layout, digests and sizes all agree
        mutate_consistently(rng, corpus, h)
        run_patch(corpus, rng, work, judge, sample, h)
    elif r < 0.85:  # edits that must survive the assembly: where sections lie, their checksums, sizes
        post = lambda hh: mutate_json(hh, rng)  # noqa: E731
        if rng.random() < 0.5:  # before a 2.x table is made of the entries, or after (its columns)
            run_patch(corpus, rng, work, judge, sample, h, post=post)
        else:
            feed_patch(corpus, rng, work, judge, sample, h, assemble(h, post_table=post), clean_possible=False)
    else:  # the frame and the preamble, checksum recomputed
        data = assemble(h)
        _, major, minor, flags, n, _ = PREAMBLE.unpack(data[:32])
        frame, sections = data[32 : 32 + n], data[32 + n :]
        raw = zstandard.ZstdDecompressor().decompress(frame)
        op = rng.randrange(6)
        if op == 0:
            frame = compress(mutate_bytes(rng, raw), rng)
        elif op == 1:
            frame = corpus.read(rng.choice(list(corpus.bombs.values())))
        elif op == 2:
            frame = mutate_zstd(rng, frame)
        elif op == 3:
            frame = compress(raw.replace(b'{"tool"', b'{"tool":"x","tool"', 1), rng)
        elif op == 4:
            frame = compress(rng.choice([b"[" * 100_000, b"{}" * 10, raw + b" " * 3, b"\xef\xbb\xbf" + raw,
                                         raw.replace(b'"exact"', b"NaN"), raw.replace(b'"exact"', b'"\\ud800"')]), rng)
        else:
            major, minor, flags = rng.choice([(1, 0, 0), (1, 2, 0), (1, 65535, 0), (0, 1, 0), (2, 0, 0), (1, 1, 1),
                                              (1, 1, 2**31)])
        feed_patch(corpus, rng, work, judge, sample, h, forge_frame(frame, major, minor, flags) + sections,
                clean_possible=False)


def strip_for_json(h):
    """A copy of a split header without its section bodies: plain JSON."""
    h = copy.deepcopy(h)
    _strip_bodies(h)
    return h


def case_layout(corpus: Corpus, rng: random.Random, work: Path, judge: Judge) -> None:
    sample, h = _pick_sample(rng, corpus, lambda s: True)
    lay = h["layout"]
    body = lay["section"]["__body__"]
    blob = decompress(body)
    r = rng.random()
    if r < 0.25 and h.get("files"):  # a carried folder file
        fr = rng.choice(h["files"])
        op = rng.randrange(4)
        if op == 0 and "section" in fr:
            fr["section"]["__body__"] = mutate_zstd(rng, fr["section"]["__body__"], corpus)
            content = decompress(fr["section"]["__body__"])
            if content is not None and rng.random() < 0.6:  # consistent: size and hash follow
                fr.update(bytes=len(content), hash=xxhash.xxh3_128_hexdigest(content))
        elif op == 1:
            fr["name"] = rng.choice(HOSTILE_NAMES + ["x.safetensors", INDEX_NAME, ".hidden", "tokenizer.json",
                                                     "config.json", "a" * 300, "a.bin"])
        elif op == 2:
            if fr["op"] == "full":
                fr["op"] = "same"
                fr.pop("section")
            else:
                fr["op"] = "full"
                fr["section"] = {"codec": "zstd", "params": {}, "__body__": compress(b"x"), "offset": 0, "length": 0,
                                 "xxh3": "0" * 16}
        else:
            h["removed_files"] = rng.choice([[fr["name"]], ["README.md", "README.md"], ["../x"], [INDEX_NAME], [5]])
    elif blob is not None and r < 0.75:
        pos, spans = 0, []
        for f in lay["files"]:
            spans.append((pos, pos + f["header_len"], f))
            pos += f["header_len"]
        if lay.get("index_len") is not None:
            spans.append((pos, pos + lay["index_len"], None))
        a, b, f = rng.choice(spans)
        piece = blob[a:b]
        try:
            if f is not None:
                new = mutate_safetensors(rng, struct.pack("<Q", len(piece)) + piece)
                n = struct.unpack("<Q", new[:8])[0]
                piece = new[8 : 8 + n] if rng.random() < 0.8 else new[8:]
            else:
                piece = json.dumps(mutate_json(json.loads(piece), rng), default=_json_default).encode()
        except Exception:
            piece = mutate_bytes(rng, piece)
        blob = blob[:a] + piece + blob[b:]
        if rng.random() < 0.9:
            if f is not None:
                f["header_len"] = len(piece)
            else:
                lay["index_len"] = len(piece)
        lay["section"]["__body__"] = compress(blob, rng)
        if rng.random() < 0.8:
            lay["digest"] = xxhash.xxh3_128_hexdigest(blob)
    elif blob is not None and r < 0.9:
        blob = mutate_bytes(rng, blob)
        lay["section"]["__body__"] = compress(blob, rng)
        if rng.random() < 0.7:
            lay["digest"] = xxhash.xxh3_128_hexdigest(blob)
    else:
        lay["section"]["__body__"] = mutate_zstd(rng, body, corpus)
        if rng.random() < 0.5 and decompress(lay["section"]["__body__"]) is not None:
            lay["digest"] = xxhash.xxh3_128_hexdigest(decompress(lay["section"]["__body__"]))
    run_patch(corpus, rng, work, judge, sample, h)


def _what_it_says(corpus: Corpus, sample: Sample, data: bytes, clean_possible: bool):
    """(header, layout blob, whether it is the sample's own in substance) of an accepted patch, read
    here independently of pulsediff; (None, None, False) where it does not decode."""
    try:
        n = struct.unpack("<Q", data[16:24])[0]
        frame = data[32 : 32 + n]
        if not 0 < zstandard.frame_content_size(frame) <= 64 << 20:
            return None, None, False
        said = json.loads(zstandard.ZstdDecompressor().decompress(frame))
        if PREAMBLE.unpack(data[:32])[1] >= 2:  # the table as entries (the spec's reading, not pulsediff's)
            try:
                layout = said["layout"]["section"]
                said["tensors"] = table_entries(said["tensors"], layout["offset"] + layout["length"])
            except Exception:  # accepted, yet no table by the spec: check_claims says so
                said["tensors"] = None
            said["__major__"] = PREAMBLE.unpack(data[:32])[1]
        blob = decompress(data[32 + n :][: said["layout"]["section"]["length"]])
        original = corpus.parsed(sample.patch)
        clean = clean_possible and strip_header(said) == strip_header(original) and blob == _layout_blob(original)
        return said, blob, clean
    except Exception:
        return None, None, False


ACTIONS = ("stream", "path", "in-place", "chain", "chain-first", "onto-target", "stats", "squash")


def run_patch(corpus: Corpus, rng: random.Random, work: Path, judge: Judge, sample: Sample, h, post=None) -> None:
    data = assemble(h, post=post) if isinstance(h, dict) else forge_frame(header_frame(h))
    feed_patch(corpus, rng, work, judge, sample, h, data, clean_possible=post is None)


def feed_patch(corpus: Corpus, rng: random.Random, work: Path, judge: Judge, sample: Sample, h, data: bytes,
            clean_possible: bool) -> None:
    """Feed a mutated patch to one of the commands that read patches and judge the outcome."""
    from pulsediff import apply_patch
    from pulsediff.ops.apply import apply_chain
    from pulsediff.ops.squash import squash_patches
    from pulsediff.ops.stats import stats_of_patch_file

    patch = work / "p.pulsediff"
    patch.write_bytes(data)
    base = corpus.path(sample.base)
    weights = [30, 20, 12, 15 if sample.prev else 0, 10 if sample.next else 0, 6 if sample.base else 0, 12, 5]
    action = rng.choices(ACTIONS, weights)[0]
    out = work / ("out.safetensors" if sample.kind == "file" else "out")
    in_place = False
    if action == "stream":
        ok, _ = attempt(judge, work, "apply (stream)", lambda: apply_patch(base, io.BytesIO(data), out, device="cpu"))
    elif action == "path":
        ok, _ = attempt(judge, work, "apply", lambda: apply_patch(base, patch, out, device="cpu"))
    elif action == "chain":
        ok, _ = attempt(judge, work, "apply (chain)", lambda: apply_chain(
            corpus.path(sample.prev_base), [corpus.path(sample.prev), patch], out, device="cpu"))
    elif action == "chain-first":  # the mutated patch, then a clean one: the output is the clean one's target
        ok, _ = attempt(judge, work, "apply (chain, first link)", lambda: apply_chain(
            base, [patch, corpus.path(sample.next)], out, device="cpu"))
        if ok and out.read_bytes() != corpus.read(sample.next_reference):
            raise Finding("wrong", "chain-first: output differs from the chain's target, byte for byte")
        return
    elif action == "onto-target":
        ok, _ = attempt(judge, work, "apply (onto its target)",
                        lambda: apply_patch(corpus.path(sample.target), patch, out, device="cpu"))
    elif action == "in-place" and base is not None:
        out = work / ("base.safetensors" if sample.kind == "file" else "base")
        if sample.kind == "file":
            shutil.copyfile(base, out)
        else:
            shutil.copytree(base, out)
        in_place = True
        ok, _ = attempt(judge, work, "apply --in-place", lambda: apply_patch(out, patch, in_place=True, device="cpu"))
        if not ok:
            return  # attempt() compared every file: the base is unchanged
    elif action == "squash" and base is not None:
        squashed = work / "squashed.pulsediff"
        ok, _ = attempt(judge, work, "squash", lambda: squash_patches(base, [patch], squashed, device="cpu"))
        if ok:  # what squash accepted must apply, to the same output
            patch.unlink()
            good, exc = attempt(judge, work, "apply (squashed)", lambda: apply_patch(base, squashed, out, device="cpu"))
            if not good:
                raise Finding("asymmetric", f"squash accepted a patch whose squashed patch apply refuses: {exc}")
    else:
        ok, _ = attempt(judge, work, "stats", lambda: stats_of_patch_file(patch))
        return
    if not ok:
        return
    said, blob, clean = _what_it_says(corpus, sample, data, clean_possible)
    if said is None:
        raise Finding("wrong", f"{action}: accepted a patch whose header does not decode")
    problem = output_problem(out, said, blob, sample, corpus, in_place=in_place, clean=clean)
    if problem:
        raise Finding("wrong", f"{action}: {problem}")


# -- checkpoint cases ---------------------------------------------------------------------------


def case_checkpoint(corpus: Corpus, rng: random.Random, work: Path, judge: Judge) -> None:
    """A hostile safetensors file (or folder) given to make, as either side, and to apply, as the base.

    Symmetric acceptance: a patch make writes must apply and rebuild its target; a checkpoint apply
    refuses as unreadable, make refuses first, with the same message.
    """
    from pulsediff import apply_patch, make_patch

    old, new, good_patch = corpus.path(corpus.ckpt_old), corpus.path(corpus.ckpt_new), corpus.path(corpus.ckpt_patch)
    if rng.random() < 0.25:  # a model folder with one hostile shard or index
        sample = corpus.sample(corpus.dir_sample)
        old, new, good_patch = corpus.path(sample.base), corpus.path(sample.target), corpus.path(sample.patch)
        hostile = work / "h"
        shutil.copytree(old, hostile)
        r = rng.random()
        if r < 0.1:  # a shard or the index that cannot be read: refused with its name (issue 23), never skipped
            victim = rng.choice([*sorted(hostile.glob("*.safetensors")), hostile / INDEX_NAME])
            victim.unlink()
            special = rng.randrange(4)
            if special == 0:
                victim.symlink_to(victim.name + ".gone")  # dangling
            elif special == 1:
                victim.symlink_to(victim.name)  # a loop
            elif special == 2:
                os.mkfifo(victim)
            else:
                victim.mkdir()
        elif r < 0.6:
            shard = rng.choice(sorted(hostile.glob("*.safetensors")))
            shard.write_bytes(mutate_safetensors(rng, shard.read_bytes()))
        elif r < 0.85:
            index = hostile / INDEX_NAME
            doc = mutate_json(json.loads(index.read_text()), rng)
            index.write_bytes(json.dumps(doc, default=_json_default).encode() if rng.random() < 0.8
                              else mutate_bytes(rng, index.read_bytes()))
        else:
            (hostile / rng.choice(["extra.safetensors", "weights.bin", "sub.safetensors"])).write_bytes(
                mutate_safetensors(rng, next(hostile.glob("*.safetensors")).read_bytes()))
    elif rng.random() < 0.05:  # not a regular file at all: a FIFO used to block forever
        hostile = work / "h.safetensors"
        special = rng.randrange(5)
        if special == 0:
            os.mkfifo(hostile)
        elif special == 1:
            hostile.symlink_to("/dev/zero")
        elif special == 2:
            hostile.symlink_to(hostile.name)  # a loop
        elif special == 3:
            hostile.mkdir()
        else:
            hostile.write_bytes(b"")
    else:
        hostile = work / "h.safetensors"
        hostile.write_bytes(mutate_safetensors(rng, old.read_bytes() if rng.random() < 0.7 else new.read_bytes()))
        if rng.random() < 0.1:
            publish_hostile(corpus, rng, work, judge, hostile)
    precision = "bf16" if rng.random() < 0.15 else "exact"
    codec = rng.choice(["ctx-ac", "ctx-rans", "gap-zstd"])

    def make(a, b, out):
        return lambda: make_patch(a, b, out, precision=precision, codec=codec, device="cpu")

    # hostile as the base of make: what it writes must apply onto it and rebuild NEW
    made_from, exc_from = attempt(judge, work, "make (hostile base)", make(hostile, new, work / "a.pulsediff"))
    judge.fact("make accepted it as a base" if made_from else "make refused it as a base")
    if made_from:
        ok, exc = attempt(judge, work, "apply (made from hostile)",
                          lambda: apply_patch(hostile, work / "a.pulsediff", work / "out-a", device="cpu"))
        if not ok:
            raise Finding("asymmetric", f"make accepted it as a base, apply refused: {exc}")
        if precision == "exact" and _tree_bytes(work / "out-a") != _tree_bytes(new):
            raise Finding("wrong", "apply onto the hostile base did not rebuild NEW byte for byte")
    # hostile as the target of make: the patch must rebuild it, byte for byte in exact mode
    made_to, _ = attempt(judge, work, "make (hostile target)", make(old, hostile, work / "b.pulsediff"))
    judge.fact("make accepted it as a target" if made_to else "make refused it as a target")
    if made_to:
        ok, exc = attempt(judge, work, "apply (made to hostile)",
                          lambda: apply_patch(old, work / "b.pulsediff", work / "out-b", device="cpu"))
        if not ok:
            raise Finding("asymmetric", f"make accepted it as a target, apply of that patch refused: {exc}")
        if precision == "exact" and _tree_bytes(work / "out-b") != _tree_bytes(hostile):
            raise Finding("wrong", "the patch made to the hostile checkpoint does not rebuild it byte for byte")
    # hostile as the base of a good patch: refused, or (the same tensors) NEW
    ok, exc = attempt(judge, work, "apply (hostile base)", lambda: apply_patch(hostile, good_patch, work / "out-c", device="cpu"))
    if ok and _tree_bytes(work / "out-c") != _tree_bytes(new):
        raise Finding("wrong", "apply onto a hostile base wrote something other than NEW")
    if not ok and isinstance(exc, InvalidCheckpointError):
        judge.fact("apply refused it as unreadable")
        if str(exc) != str(exc_from):
            raise Finding("asymmetric", f"apply refused the base ({exc}) but make said {exc_from or 'nothing'}")
        judge.fact("make refused it first, same message")


def publish_hostile(corpus: Corpus, rng: random.Random, work: Path, judge: Judge, hostile: Path) -> None:
    """A hostile checkpoint as a trainer's newest step: publish skips it or publishes a step that
    catch-up then rebuilds byte for byte (it never publishes what no worker can apply)."""
    from pulsediff.ops.inspect import checkpoint_digest_of
    from pulsediff.format.manifest import Manifest
    from pulsediff.series.catch_up import catch_up
    from pulsediff.series.publish import publish_once

    train, pub = work / "train", work / "pub"
    train.mkdir()
    shutil.copyfile(corpus.path(corpus.ckpt_old), train / "step_000000.safetensors")
    shutil.copyfile(hostile, train / "step_000001.safetensors")
    ok, _ = attempt(judge, work, "publish", lambda: publish_once(train, pub, anchor_every=rng.choice([1, 2]), settle=0),
                    allowed=("pub",))
    manifest = Manifest.load(pub) if pub.exists() else None
    if ok and manifest is not None and any(e.step == 1 for e in manifest.entries):
        judge.fact("publish published it")
        worker = work / "w.safetensors"
        done, exc = attempt(judge, work, "catch-up (published hostile)", lambda: catch_up(worker, pub, device="cpu"))
        if not done:
            raise Finding("asymmetric", f"publish published a step catch-up cannot rebuild: {exc}")
        if worker.read_bytes() != hostile.read_bytes():
            # Digests name tensors, not file layouts: when step 1 holds step 0's tensors (only its header
            # differs), catch-up may take step 0's file and say step 1 (docs/FORMAT.md §8). Anything else
            # is wrong.
            if worker.read_bytes() != (train / "step_000000.safetensors").read_bytes() or (
                    checkpoint_digest_of(worker) != checkpoint_digest_of(hostile)):
                raise Finding("wrong", "catch-up of a published hostile step did not rebuild it byte for byte")
            judge.fact("catch-up gave the earlier step with the same tensors")
        worker.unlink()
    elif ok:
        judge.fact("publish skipped it")
    shutil.rmtree(train)
    shutil.rmtree(pub, ignore_errors=True)


def _tree_bytes(path: Path) -> dict[str, bytes] | bytes | None:
    if path.is_dir():
        return visible(path)
    return path.read_bytes() if path.exists() else None


# -- manifest cases -------------------------------------------------------------------------------


def case_manifest(corpus: Corpus, rng: random.Random, work: Path, judge: Judge) -> None:
    """A hostile manifest (and sometimes a hostile file under a plausible entry) given to catch-up."""
    from pulsediff.format.digest import is_digest
    from pulsediff.ops.inspect import checkpoint_digest_of
    from pulsediff.format.digest import EMPTY_DIGESTS
    from pulsediff.format.manifest import MANIFEST, parse_manifest
    from pulsediff.series.catch_up import catch_up, plan_catch_up

    pub, train = corpus.path(corpus.pub), corpus.path(corpus.train)
    truth = {int(p.stem.split("_")[1]): corpus.read(str(p.relative_to(corpus.root))) for p in sorted(train.iterdir())}
    folder = work / "pub"
    folder.mkdir()
    for p in pub.iterdir():
        if p.name != MANIFEST:
            os.link(p, folder / p.name)
    obj = json.loads(corpus.read(str((pub / MANIFEST).relative_to(corpus.root))))
    digests = [e["target"] for e in obj["entries"]]
    mode = rng.random()
    data = None
    if mode < 0.4:
        obj = mutate_json(obj, rng)
    elif mode < 0.7:  # plausible lies: labels, digests, sizes and names taken from other entries
        for _ in range(rng.randint(1, 3)):
            e, other = rng.choice(obj["entries"]), rng.choice(obj["entries"])
            key = rng.choice(["step", "from_step", "base", "target", "file", "bytes", "target_bytes", "kind"])
            e[key] = rng.choice([other.get(key), rng.randint(0, 9), rng.choice(digests), rng.choice(sorted(EMPTY_DIGESTS)),
                                 2**63, -1, None])
    elif mode < 0.85:  # a hostile file under an entry, its size updated or not
        e = rng.choice(obj["entries"])
        h = split_patch((pub / e["file"]).read_bytes())
        if rng.random() < 0.5:
            h = mutate_json(h, rng)
        else:
            entries = [t for t in h["tensors"] if "section" in t]
            mutate_section(rng, corpus, rng.choice(entries))
        patched = assemble(h) if isinstance(h, dict) else forge_frame(header_frame(h))
        (folder / e["file"]).unlink()
        (folder / e["file"]).write_bytes(patched)
        if rng.random() < 0.6:
            e["bytes"] = len(patched)
    elif mode < 0.95:
        data = mutate_bytes(rng, json.dumps(obj).encode())
    else:  # not a file at all (issue 23): a folder, or a link to nothing, where the manifest belongs
        data = b""
    if data is None:
        data = json.dumps(obj, default=_json_default).encode()
    if mode >= 0.95:
        if rng.random() < 0.5:
            (folder / MANIFEST).mkdir()
        else:
            (folder / MANIFEST).symlink_to("nowhere.json")
    else:
        (folder / MANIFEST).write_bytes(data)
    start = rng.choice([None, *truth])
    worker = work / "w.safetensors"
    if start is not None:
        worker.write_bytes(truth[start])
    action = rng.choice(["catch-up", "catch-up", "catch-up -o", "plan"])
    if action == "plan":
        attempt(judge, work, "catch-up --plan", lambda: plan_catch_up(worker, folder))
        return
    out = work / "copy.safetensors" if action == "catch-up -o" else None
    if out is not None and start is None:
        out = None
    ok, result = attempt(judge, work, action, lambda: catch_up(worker, folder, out, device="cpu"))
    if not ok:
        return
    written = out or worker
    if out is not None and worker.read_bytes() != truth[start]:
        raise Finding("wrong", "catch-up -o changed the worker's checkpoint")
    if result.status == "up-to-date" and not written.exists():
        return
    rebuilt = checkpoint_digest_of(written)
    manifest = parse_manifest(data, "manifest")
    if not any(e.step == result.step and e.target == rebuilt for e in manifest.entries):
        raise Finding("wrong", f"catch-up reported step {result.step}, which the manifest does not give to "
                               f"the digest it holds")
    if written.read_bytes() not in truth.values():
        raise Finding("wrong", "catch-up wrote a checkpoint that is no trainer step")
    assert is_digest(rebuilt)


CASES = {**{codec: case_codec(codec) for codec in CODEC_IDS}, "header": case_header, "layout": case_layout,
         "checkpoint": case_checkpoint, "manifest": case_manifest}
