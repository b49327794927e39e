#!/usr/bin/env python
"""The live decode on the CPU (issue 35): `apply_to_state_dict` of a 1% patch into host tensors, against
torch's `index_copy_` of the same changes as raw int64 indices and BF16 values (what the RL frameworks'
sparse syncs do), alternating in one process, medians; then where the decode's time goes.

    python scripts/bench_live_decode.py [--layers 16] [--rounds 5] [--codecs ctx-rans ctx-ac]

The state dict is Qwen2-shaped (hidden 1536, 12 heads, 2 KV heads, intermediate 4096, vocab 32000, untied
head; --layers 16: 0.98 GB in BF16), weights N(0, 0.02) in BF16; each round's target changes 1% of every
tensor's elements by one unit in the last place. It needs no vLLM: this is the decode the engine backend
runs before it loads anything (scripts/bench_vllm.py times the whole engine update).

The split (the patch's sections in turn): the entropy decode (`decode_changes`, one thread), the class
walk (`locate_ranked`: class counts, then the rank-to-position walk) and `word_sum` (each on the backend's
threads), per change or per element. Every apply is checked bit for bit against the target.

With --codecs, each round makes one patch per codec, and the `check="sums"` decode of each alternates
with the others and with index_copy_ (the digests check runs for the first codec only).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def qwen2_shapes(layers: int, hidden=1536, heads=12, kv_heads=2, inter=4096, vocab=32000) -> dict:
    kv = hidden // heads * kv_heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.q_proj.bias": (hidden,),
                       p + "self_attn.k_proj.weight": (kv, hidden), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.v_proj.bias": (kv,),
                       p + "self_attn.o_proj.weight": (hidden, hidden),
                       p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                       p + "mlp.down_proj.weight": (hidden, inter),
                       p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)})
    return shapes


def step(tensors: dict, rng, density: float = 0.01) -> dict:
    """A copy of the tensors with `density` of each one's elements moved by one ULP (bit pattern +-1)."""
    import numpy as np
    import torch

    out = {}
    for name, t in tensors.items():
        bits = t.view(torch.int16).reshape(-1).numpy().copy()
        k = max(1, int(bits.size * density))
        where = rng.choice(bits.size, k, replace=False)
        bits[where] += rng.choice(np.array([1, -1], np.int16), k)
        out[name] = torch.from_numpy(bits).view(torch.bfloat16).reshape(t.shape)
    return out


def split_times(tensors: dict, patch: bytes) -> dict[str, float]:
    """Seconds for the entropy decode (one thread), the class walk and the word sums (the backend's
    threads) of the whole patch."""
    import numpy as np

    from pulsediff.codecs import get_codec
    from pulsediff.codecs.base import SectionContext
    import io

    from pulsediff.format.patch_file import open_patch, read_layout
    from pulsediff.kernels import cpu
    from pulsediff.ops.live import device_bits

    reader, header, _ = open_patch(io.BytesIO(patch))
    read_layout(reader, header, sequential=True)  # the sections follow the layout
    took = {"entropy decode": 0.0, "class walk": 0.0, "word_sum": 0.0}
    for rec in header.tensors:
        if rec.section is None:
            continue
        payload = reader.read_next(rec.section, rec.name)
        if rec.op != "patch":
            continue
        codec = get_codec(rec.section.codec)
        ctx = SectionContext(rec.name, rec.numel, rec.dtype.itemsize, "bench")
        bits = np.ascontiguousarray(device_bits(tensors[rec.name]))
        t0 = time.perf_counter()
        entries = codec.decode_changes(payload, rec.section.params, ctx)
        t1 = time.perf_counter()
        cpu.locate_ranked(bits, entries.shift, entries.mask, entries.offsets, entries.ranks)
        t2 = time.perf_counter()
        cpu.word_sum(bits)
        t3 = time.perf_counter()
        took["entropy decode"] += t1 - t0
        took["class walk"] += t2 - t1
        took["word_sum"] += t3 - t2
    return took


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--codecs", nargs="+", default=None, help="codecs to compare (default: make's default)")
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    from pulsediff import make_patch_bytes
    from pulsediff.kernels.threads import num_threads
    from pulsediff.ops.live import apply_to_state_dict

    rng = np.random.default_rng(35)
    shapes = qwen2_shapes(args.layers)
    base = {n: (torch.from_numpy(rng.standard_normal(s, dtype=np.float32)) * 0.02).to(torch.bfloat16)
            for n, s in shapes.items()}
    elements = sum(t.numel() for t in base.values())
    from pulsediff.codecs import DEFAULT_SPARSE_CODEC

    codecs = args.codecs or [DEFAULT_SPARSE_CODEC]
    ways = [f"sums {c}" for c in codecs] + [f"digests {codecs[0]}", "index_copy_"]
    times: dict[str, list[float]] = {way: [] for way in ways}
    changes = 0
    patch_len: dict[str, int] = {}
    split: dict[str, dict[str, float]] = {}
    for r in range(args.rounds):
        target = step(base, rng, args.density)
        patches = {c: make_patch_bytes(base, target, codec=c) for c in codecs}
        patch_len = {c: len(p) for c, p in patches.items()}
        staged = {}
        for name, t in target.items():
            a, b = base[name].view(torch.int16).reshape(-1), t.view(torch.int16).reshape(-1)
            idx = torch.nonzero(a != b).squeeze(1)
            staged[name] = (idx, t.reshape(-1)[idx].clone())
        changes = sum(idx.numel() for idx, _ in staged.values())
        turn = r % len(ways)
        for way in ways[turn:] + ways[:turn]:  # each first in turn
            live = {n: t.clone() for n, t in base.items()}
            t0 = time.perf_counter()
            if way == "index_copy_":
                for name, (idx, values) in staged.items():
                    live[name].view(-1).index_copy_(0, idx, values)
            else:
                check, codec = way.split()
                apply_to_state_dict(live, patches[codec], check=check)
            times[way].append(time.perf_counter() - t0)
            assert all(torch.equal(live[n].view(torch.int16), target[n].view(torch.int16)) for n in live), way
        if r == args.rounds - 1:
            split = {c: split_times(base, p) for c, p in patches.items()}
        base = target

    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\nQwen2-shaped state dict, {args.layers} layers, {elements / 1e6:.0f}M BF16 elements "
          f"({2 * elements / 1e9:.2f} GB), {changes / 1e6:.2f}M changes per step ({100 * args.density:g}%), "
          f"patch {', '.join(f'{c} {n / 1e6:.2f} MB' for c, n in patch_len.items())}; {args.rounds} rounds "
          f"alternating, medians; {num_threads()} threads, {os.cpu_count()} cores; torch {torch.__version__}\n")
    print("| decode on host tensors | median | ratio to index_copy_ |")
    print("|---|---:|---:|")
    for way in ways:
        if way == "index_copy_":
            label = "torch `index_copy_` of raw int64 indices and BF16 values"
        else:
            check, codec = way.split()
            label = (f'`apply_to_state_dict(check="{check}")`, {codec}, '
                     + ("as the engine backend decodes" if check == "sums" else "the CPU default"))
        print(f"| {label} | {1e3 * med[way]:,.1f} ms | {med[way] / med['index_copy_']:.1f} |")
    for codec, took in split.items():
        print(f"\n| the last round's {codec} patch, part by part | total | per unit |")
        print("|---|---:|---:|")
        for key, unit, n in (("entropy decode", "change", changes), ("class walk", "element", elements),
                             ("word_sum", "element", elements)):
            print(f"| {key} | {1e3 * took[key]:,.1f} ms | {1e9 * took[key] / n:.2f} ns per {unit} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
