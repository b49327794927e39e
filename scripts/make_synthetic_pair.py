"""Write a large synthetic BF16 checkpoint pair, fast, for benchmarks.

    python scripts/make_synthetic_pair.py --gb 1.0 --density 0.01 --out DIR [--shards N]

OLD holds Llama-shaped BF16 tensors (embedding and LM head of a few hundred MB,
per-layer projections, norm vectors) with values ~N(0, 0.02) (norms ~N(1, 0.02)).
NEW is OLD with each element changed, independently, with probability
`density`, by one unit in the last place (its bit pattern +1 or -1), which is
what an RL step at lr ~1e-6 does to the elements it changes at all.

Writes DIR/old.safetensors and DIR/new.safetensors, or with --shards N the
folders DIR/old and DIR/new in the Hugging Face layout
(model-0000k-of-0000N.safetensors plus model.safetensors.index.json).

Memory: tensors are generated and written one at a time (both files side by
side), so the peak is about two copies of the largest tensor, whatever the
total size. The files are written by a streaming writer that lays them out
exactly as `safetensors.torch.save_file(..., metadata={"format": "pt"})` does
(same header bytes, same tensor order), since save_file wants every tensor of
a file in memory at once; `--check` reads them back with safetensors.

Values are drawn through a 65536-entry inverse-CDF table from uniform 16-bit
integers: as random as normal draws for every purpose here (distinct values,
compressibility) and about twice as fast. Same --seed, same files.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

import numpy as np

INDEX_NAME = "model.safetensors.index.json"
MIN_LAYERS = 8
CHUNK = 1 << 24  # elements generated per step: bounds the int64 index temporaries to 128 MiB


@dataclass(frozen=True)
class Config:
    d_model: int
    d_ff: int
    d_kv: int
    vocab: int


# Real model widths (from small test sizes up to Llama-3-70B), largest last.
CONFIGS = (
    Config(128, 512, 32, 8192),
    Config(256, 1024, 64, 32000),
    Config(512, 1536, 128, 32000),
    Config(1024, 4096, 256, 128256),
    Config(2048, 8192, 512, 128256),  # Llama-3.2-1B
    Config(3072, 8192, 1024, 128256),  # Llama-3.2-3B
    Config(4096, 14336, 1024, 128256),  # Llama-3-8B
    Config(8192, 28672, 1024, 128256),  # Llama-3-70B
)


@dataclass(frozen=True)
class Spec:
    name: str
    shape: tuple[int, ...]
    seed_index: int  # position in model order: seeds this tensor's random streams

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return 2 * self.numel

    @property
    def is_norm(self) -> bool:
        return len(self.shape) == 1


def _layer(i: int, c: Config) -> list[tuple[str, tuple[int, ...]]]:
    p = f"model.layers.{i}."
    return [
        (p + "input_layernorm.weight", (c.d_model,)),
        (p + "self_attn.q_proj.weight", (c.d_model, c.d_model)),
        (p + "self_attn.k_proj.weight", (c.d_kv, c.d_model)),
        (p + "self_attn.v_proj.weight", (c.d_kv, c.d_model)),
        (p + "self_attn.o_proj.weight", (c.d_model, c.d_model)),
        (p + "post_attention_layernorm.weight", (c.d_model,)),
        (p + "mlp.gate_proj.weight", (c.d_ff, c.d_model)),
        (p + "mlp.up_proj.weight", (c.d_ff, c.d_model)),
        (p + "mlp.down_proj.weight", (c.d_model, c.d_ff)),
    ]


def model_specs(gb: float) -> tuple[Config, int, list[Spec]]:
    """Tensors (in model order) of a Llama-shaped BF16 model of about `gb` GB.

    The widest config that leaves room for at least MIN_LAYERS layers next to
    its untied embedding and LM head is taken; layers fill the rest.
    """
    target = gb * 1e9

    def layers(c: Config) -> int:
        per_layer = 2 * sum(math.prod(s) for _, s in _layer(0, c))
        return round((target - 2 * 2 * c.vocab * c.d_model - 2 * c.d_model) / per_layer)

    c = CONFIGS[0]
    for candidate in CONFIGS:
        if layers(candidate) >= MIN_LAYERS:
            c = candidate
    n_layers = max(1, layers(c))
    named = [("model.embed_tokens.weight", (c.vocab, c.d_model))]
    for i in range(n_layers):
        named += _layer(i, c)
    named += [("model.norm.weight", (c.d_model,)), ("lm_head.weight", (c.vocab, c.d_model))]
    return c, n_layers, [Spec(n, s, i) for i, (n, s) in enumerate(named)]


def _bf16_quantile_table(mean: float, std: float) -> np.ndarray:
    """BF16 bit patterns of the 65536 mid-quantiles of N(mean, std), as uint16."""
    dist = NormalDist(mean, std)
    f32 = np.array([dist.inv_cdf((i + 0.5) / 65536) for i in range(65536)], dtype=np.float32)
    # FP32 -> BF16 with round-to-nearest-even (as torch casts; the values are finite).
    u = f32.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


WEIGHT_TABLE = None
NORM_TABLE = None


def generate_pair(spec: Spec, seed: int, density: float,
                  buffers: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """(old bits, new bits, changed count) of one tensor, as uint16 arrays.

    With `buffers` (two uint16 arrays of at least spec.numel elements), the
    results are views into them: reusing them saves the page faults of fresh
    allocations, a fifth of the run time.
    """
    global WEIGHT_TABLE, NORM_TABLE
    if WEIGHT_TABLE is None:
        WEIGHT_TABLE, NORM_TABLE = _bf16_quantile_table(0.0, 0.02), _bf16_quantile_table(1.0, 0.02)
    table = NORM_TABLE if spec.is_norm else WEIGHT_TABLE
    rng = np.random.Generator(np.random.SFC64([seed, spec.seed_index]))
    n = spec.numel
    if buffers is None:
        old, new = np.empty(n, dtype=np.uint16), np.empty(n, dtype=np.uint16)
    else:
        old, new = buffers[0][:n], buffers[1][:n]
    for start in range(0, n, CHUNK):
        stop = min(n, start + CHUNK)
        np.take(table, rng.integers(0, 65536, stop - start, dtype=np.uint16), out=old[start:stop])
    np.copyto(new, old)
    pos = _bernoulli_positions(rng, n, density)
    if pos.size:
        step = rng.integers(0, 2, pos.size, dtype=np.int8).astype(np.int16) * 2 - 1
        bits = old[pos]
        # -1 on +0.0 or -0.0 would give a NaN pattern: step up from zero instead.
        step[(bits & 0x7FFF) == 0] = 1
        new[pos] = (bits.astype(np.int32) + step).astype(np.uint16)
    return old, new, int(pos.size)


def _bernoulli_positions(rng: np.random.Generator, n: int, density: float) -> np.ndarray:
    """Sorted positions of i.i.d. Bernoulli(density) successes among n, by geometric gaps."""
    if density <= 0 or n == 0:
        return np.empty(0, dtype=np.int64)
    if density >= 1:
        return np.arange(n, dtype=np.int64)
    chunks = []
    last = -1
    expected = n * density
    while True:
        gaps = rng.geometric(density, int(expected + 6 * math.sqrt(expected) + 16))
        pos = last + np.cumsum(gaps)
        if pos[-1] >= n:
            chunks.append(pos[pos < n])
            break
        chunks.append(pos)
        last = int(pos[-1])
    return np.concatenate(chunks)


def shard_plan(specs: list[Spec], shards: int) -> list[list[Spec]]:
    """Split tensors, in model order, into at most `shards` groups of similar byte size."""
    total = sum(s.nbytes for s in specs)
    groups: list[list[Spec]] = [[] for _ in range(shards)]
    done = 0
    for s in specs:
        k = min(shards - 1, int(shards * (done + s.nbytes / 2) / total))
        groups[k].append(s)
        done += s.nbytes
    return [g for g in groups if g]


def safetensors_header(specs: list[Spec]) -> bytes:
    """Header bytes as safetensors writes them: compact JSON, tensors sorted by name
    (all BF16, so dtype does not reorder them), padded with spaces to 8 bytes."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for s in sorted(specs, key=lambda s: s.name):
        header[s.name] = {"dtype": "BF16", "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_synthetic_pair(out: str | Path, gb: float, density: float, *, shards: int = 1, seed: int = 0,
                         verbose: bool = True) -> tuple[Path, Path]:
    """Write the pair under `out`; returns (old, new) paths (files, or folders when sharded)."""
    if gb <= 0:
        raise ValueError("--gb must be > 0")
    if not 0 <= density <= 1:
        raise ValueError("--density must be in [0, 1]")
    if shards < 1:
        raise ValueError("--shards must be >= 1")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config, n_layers, specs = model_specs(gb)
    groups = shard_plan(specs, shards)
    if shards == 1:
        old_root, new_root = out / "old.safetensors", out / "new.safetensors"
        names = [None]
    else:
        old_root, new_root = out / "old", out / "new"
        old_root.mkdir(exist_ok=True)
        new_root.mkdir(exist_ok=True)
        names = [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
    total = sum(s.nbytes for s in specs)
    if verbose:
        print(f"model: d_model={config.d_model} d_ff={config.d_ff} vocab={config.vocab} layers={n_layers}, "
              f"{len(specs)} tensors, {total / 1e9:.3f} GB per checkpoint, largest tensor "
              f"{max(s.nbytes for s in specs) / 1e6:.0f} MB, {len(groups)} file(s)", file=sys.stderr)
    t0 = time.perf_counter()
    changed = 0
    weight_map = {}
    largest = max(s.numel for s in specs)
    buffers = (np.empty(largest, dtype=np.uint16), np.empty(largest, dtype=np.uint16))
    for name, group in zip(names, groups):
        old_path = old_root if name is None else old_root / name
        new_path = new_root if name is None else new_root / name
        header = safetensors_header(group)
        with open(old_path, "wb") as fo, open(new_path, "wb") as fn:
            fo.write(header)
            fn.write(header)
            for spec in sorted(group, key=lambda s: s.name):
                old, new, k = generate_pair(spec, seed, density, buffers)
                fo.write(memoryview(old))
                fn.write(memoryview(new))
                changed += k
                if name is not None:
                    weight_map[spec.name] = name
    if shards > 1:
        index = json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                           indent=2) + "\n"
        (old_root / INDEX_NAME).write_text(index)
        (new_root / INDEX_NAME).write_text(index)
    if verbose:
        dt = time.perf_counter() - t0
        n = total // 2
        print(f"wrote {old_root} and {new_root}: {changed:,} of {n:,} elements changed "
              f"({changed / n:.4%}), {2 * total / 1e9 / dt:.2f} GB/s written, {dt:.1f} s", file=sys.stderr)
    return old_root, new_root


def check_pair(old: Path, new: Path) -> tuple[int, int]:
    """Read both checkpoints back with safetensors: (changed elements, total), all ±1 ULP."""
    import torch
    from safetensors import safe_open

    def files(p: Path) -> list[Path]:
        return sorted(p.glob("*.safetensors")) if p.is_dir() else [p]

    changed = total = 0
    for fo, fn in zip(files(old), files(new), strict=True):
        with safe_open(str(fo), "pt") as a, safe_open(str(fn), "pt") as b:
            if a.metadata() != {"format": "pt"} or sorted(a.keys()) != sorted(b.keys()):
                raise AssertionError(f"{fo} and {fn} differ in metadata or tensor names")
            for key in a.keys():
                x = a.get_tensor(key).view(torch.int16).to(torch.int32)
                y = b.get_tensor(key).view(torch.int16).to(torch.int32)
                d = y - x
                if not bool(((d == 0) | (d == 1) | (d == -1)).all()):
                    raise AssertionError(f"{key}: a change other than ±1 in the bit pattern")
                changed += int((d != 0).sum())
                total += x.numel()
    return changed, total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.0, help="size of each checkpoint in GB (1e9 bytes), approximately (default 1.0)")
    ap.add_argument("--density", type=float, default=0.01, help="fraction of elements changed (default 0.01)")
    ap.add_argument("--out", required=True, type=Path, help="output folder")
    ap.add_argument("--shards", type=int, default=1, help="write N-shard HF folders instead of single files")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--check", action="store_true", help="read the pair back with safetensors and verify it")
    ap.add_argument("-q", "--quiet", action="store_true", help="print only the two paths written (for scripts)")
    args = ap.parse_args(argv)
    try:
        old, new = write_synthetic_pair(args.out, args.gb, args.density, shards=args.shards, seed=args.seed,
                                        verbose=not args.quiet)
    except ValueError as e:
        ap.error(str(e))
    if args.check:
        changed, total = check_pair(old, new)
        print(f"check: ok, {changed:,} of {total:,} elements differ by one ULP ({changed / total:.4%})",
              file=sys.stderr)
    print(old)
    print(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
