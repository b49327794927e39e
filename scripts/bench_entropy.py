"""Micro-benchmark of a codec's entropy stage: changed values per second per core.

    python scripts/bench_entropy.py [--src DIR ...] [--codec ctx-rans|ctx-ac ...] [--elements N]
                                    [--density D] [--repeats R]

The input is one BF16 tensor of N elements (weights ~N(0, 0.02)) in which a
fraction D changed by one unit in the last place (1 in 200 of them by a far
jump, so the escape path runs too): what an RL step does. One thread
(PULSEDIFF_THREADS=1), so the figures are per core, timed as the CPU time of
that thread (time.thread_time), which other processes disturb far less than
wall time.

  encode  the section from the changed elements' classes, ranks and
          deltas (what make's walk over the tensor, kernels.diff_ranks,
          hands the coder): ctx_rans._encode_ranked, timed alone, i.e.
          class-major ordering, Rice parameters, Rice and rANS coding.
          Trees older than _encode_ranked: the section from a base and
          target minus the walk (timed apart), a noisier difference
  decode  Rice decoding of the ranks and rANS decoding of the values, as
          codec.decode() calls them (one after the other here); for
          ctx-ac, its two adaptive streams (positions with the class table,
          then values), as its decode calls them (ctx_ac._decode_both)
  walk    the ranked walk that rebuilds the tensor from them (apply's
          kernels.apply_ranked over the whole tensor, class counts given),
          in ns per element of the tensor: with --density 0.14, what a
          catch-up link spanning 16 steps lists

With several --src trees (e.g. an older checkout) or --codec values, each
pair is run in its own subprocess, alternating, and the medians are printed
side by side: the way to quote a before/after ratio on a noisy machine.
ctx-ac needs a tree of 2026-11-27 or later.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measure_ctx_ac(base, target, elements: int) -> dict:
    """measure() for ctx-ac: its section writer, then its two streams' decoders (the whole decode,
    walk included, is checked against the target first, untimed)."""
    import numpy as np

    from pulsediff.codecs import ctx_ac, get_codec
    from pulsediff.codecs.base import SectionContext
    from pulsediff.io.memory import Scratch
    from pulsediff.kernels import get_backend

    kernels = get_backend("cpu")
    zigzag, classes, ranks, _ = kernels.diff_ranks(base, target, 7, 255)
    ctx_ac._encode_ranked(classes, ranks, zigzag, 7, 8)  # first touch of its buffers' pages, untimed
    t = time.thread_time()
    enc = ctx_ac._encode_ranked(classes, ranks, zigzag, 7, 8)
    encode_s = time.thread_time() - t
    ctx = SectionContext("t", elements, 2, "bench")
    payload = b"".join(enc.parts)
    rebuilt = get_codec("ctx-ac").decode(base, payload, enc.params, ctx, kernels, Scratch())
    assert np.array_equal(rebuilt, target)  # the whole decode, untimed: the section is right
    count, _, bits, positions, signs, values = ctx_ac._split(payload, enc.params, ctx)
    t = time.thread_time()
    ctx_ac._decode_both(positions, signs, values, bits, count, ctx, Scratch())
    decode_s = time.thread_time() - t
    return {"values": int(count), "bytes": len(payload),
            "encode_s": max(encode_s, 1e-9), "decode_s": decode_s, "walk_s": float("nan")}


def measure(elements: int, density: float, seed: int, codec_id: str = "ctx-rans") -> dict:
    import numpy as np

    from pulsediff.codecs import get_codec
    from pulsediff.codecs.base import Scratch, SectionContext
    try:
        from pulsediff.io.dtypes import DTYPES
    except ImportError:  # a --src tree from before the package was layered (issue 25)
        from pulsediff.dtypes import DTYPES
    from pulsediff.kernels import get_backend

    rng = np.random.default_rng(seed)
    base = (rng.normal(0, 0.02, elements).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    target = base.copy()
    hit = np.flatnonzero(rng.random(elements) < density)
    target[hit] += rng.choice(np.array([1, 0xFFFF], np.uint16), hit.size)
    far = hit[rng.random(hit.size) < 0.005]
    target[far] ^= np.uint16(0x1234)
    if codec_id == "ctx-ac":
        return measure_ctx_ac(base, target, elements)
    positions = np.flatnonzero(base != target).astype(np.int64)
    values = target[positions]
    kernels = get_backend("cpu")
    codec = get_codec("ctx-rans")
    bf16 = DTYPES["BF16"]

    from pulsediff.codecs import ctx_rans

    if hasattr(ctx_rans, "_encode_ranked"):  # since the fused compare: diff_ranks, then the section writer
        zigzag, classes, ranks, _ = kernels.diff_ranks(base, target, 7, 255)
        ctx_rans._encode_ranked(classes, ranks, zigzag, 7, 8)  # first touch of its buffers' pages, untimed
        t = time.thread_time()
        enc = ctx_rans._encode_ranked(classes, ranks, zigzag, 7, 8)
        encode_s = time.thread_time() - t
    elif hasattr(codec, "encode_pair"):
        t = time.thread_time()
        _, enc = codec.encode_pair(base, target, dtype=bf16, kernels=kernels)
        encode_s = time.thread_time() - t
        t = time.thread_time()
        kernels.diff_ranks(base, target, 7, 255)
        encode_s -= time.thread_time() - t
    else:  # before: diff_compact found the positions, encode walked the tensor for their ranks
        t = time.thread_time()
        enc = codec.encode(base, target, positions, values, dtype=bf16, kernels=kernels)
        encode_s = time.thread_time() - t
        t = time.thread_time()
        kernels.class_ranks(base, 7, 255, positions)
        encode_s -= time.thread_time() - t

    payload = b"".join(enc.parts)
    ctx = SectionContext("t", elements, 2, "bench")
    assert (codec.decode(base, payload, enc.params, ctx, kernels, Scratch()) == target).all()
    from pulsediff.kernels import entropy

    count, shift, mask, n_escapes, (table, pos_bytes, freq_bytes, rans_bytes, esc_bytes) = ctx_rans._split(
        payload, enc.params, ctx)
    reader = ctx_rans._Reader(table, ctx, "class table")
    listed = reader.varint(mask + 1)
    ks, counts = np.empty(listed, np.int64), np.empty(listed, np.int64)
    for m in range(listed):
        reader.varint(mask)
        counts[m] = reader.varint(count)
        ks[m] = reader.byte()
    ranks = np.empty(count, np.int64)
    bound = np.full(listed, elements, np.int64)
    t = time.thread_time()
    status, _ = entropy.rice_decode(np.frombuffer(pos_bytes, np.uint8), ks, counts, ranks, bound)
    ctx_rans._decode_values(freq_bytes, rans_bytes, esc_bytes, count, n_escapes, ctx)
    decode_s = time.thread_time() - t
    assert status == entropy.OK
    walk_s = float("nan")
    if hasattr(ctx_rans, "_decode_entries"):  # the walk alone, on the entries as decode hands them over
        entries, _ = ctx_rans._decode_entries(payload, enc.params, ctx, Scratch())
        starts, _ = kernels.chunk_class_starts(base, shift, mask)
        out = np.empty_like(base)
        kernels.apply_ranked(base, shift, mask, starts, entries.offsets, entries.ranks, entries.deltas, out)
        t = time.thread_time()
        applied = kernels.apply_ranked(base, shift, mask, starts, entries.offsets, entries.ranks, entries.deltas, out)
        walk_s = time.thread_time() - t
        assert applied == count and (out == target).all()
    return {"values": int(positions.size), "bytes": len(payload),
            "encode_s": max(encode_s, 1e-9), "decode_s": decode_s, "walk_s": walk_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", action="append", type=Path, help="source tree to import pulsediff from (repeatable)")
    ap.add_argument("--elements", type=int, default=1 << 26)
    ap.add_argument("--density", type=float, default=0.02)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--codec", action="append", choices=["ctx-rans", "ctx-ac"],
                    help="codec whose entropy stage is timed (repeatable; default ctx-rans)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        codec_id = (args.codec or ["ctx-rans"])[0]
        measure(args.elements, args.density, 0, codec_id)  # warm-up: JIT cache, page faults
        print(json.dumps(measure(args.elements, args.density, 0, codec_id)))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_core import from_tree  # here, not at the top: the child runs this file from another tree
    from benchlib import machine_line

    runs_of = [(tree, codec_id) for tree in args.src or [ROOT] for codec_id in args.codec or ["ctx-rans"]]
    results: dict[tuple, list[dict]] = {run: [] for run in runs_of}
    env = dict(os.environ, PULSEDIFF_THREADS="1", NUMBA_NUM_THREADS="1")
    for _ in range(args.repeats):
        for tree, codec_id in runs_of:  # alternating: drift hits every one alike
            child = from_tree(tree, f"import runpy; sys.argv = sys.argv[1:]; runpy.run_path({__file__!r}, "
                                    "run_name='__main__')")
            codec_args = [] if codec_id == "ctx-rans" else ["--codec", codec_id]  # older trees know no --codec
            out = subprocess.run([*child, __file__, "--child", "--elements", str(args.elements),
                                  "--density", str(args.density), *codec_args], env=env, capture_output=True,
                                 text=True, check=True)
            results[(tree, codec_id)].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(machine_line(tools=False))
    print(f"{args.elements} BF16 elements, density {args.density}, one thread, medians of {args.repeats}\n")
    print("| source | codec | changed values | section bytes | encode M values/s | decode M values/s | decode ns/value "
          "| walk ns/element |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for (tree, codec_id), runs in results.items():
        n = runs[0]["values"]
        enc = statistics.median(n / r["encode_s"] / 1e6 for r in runs)
        dec = statistics.median(n / r["decode_s"] / 1e6 for r in runs)
        walk = statistics.median(r.get("walk_s", float("nan")) / args.elements * 1e9 for r in runs)
        print(f"| {tree} | {codec_id} | {n} | {runs[0]['bytes']} | {enc:.1f} | {dec:.1f} | {1e3 / dec:.1f} "
              f"| {walk:.2f} |")


if __name__ == "__main__":
    main()
