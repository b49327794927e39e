#!/usr/bin/env python
"""The live apply against what the RL frameworks send (issue 45): `apply_to_state_dict` of a patch
into host tensors, alternating in one process with torch's `index_copy_` of the same changes as raw
int64 indices and BF16 values; medians, the ratio, and the break-even link speed.

    python scripts/bench_live_apply.py [--cases model moe qwen2] [--rounds 5] [--moe-tensors 18432]
    python scripts/bench_live_apply.py --save-moe DIR    # the moe pair as files, for bench_core.py

Cases (issue 45, 5a-5c):
- model: a real small model's RL step: pulsediff.example's Llama-shaped decoder, pretrained
  briefly, then one AdamW step at lr 1e-6 from FP32 masters, BF16 before and after.
- moe: as many BF16 expert tensors as a Qwen3-30B-A3B (18,432 by default) of 16,384 elements
  each, N(0, 0.02), 1% of each changed by one unit in the last place.
- qwen2: the 1 GB Qwen2 shape of scripts/bench_live_decode.py (16 layers), 1% changed.

Each round times, in turn and each on a fresh copy of the base (the copy is not timed):
index_copy_, apply with check="sums", apply with check="digests" (the CPU default). Every apply is
checked bit for bit against the target. B* = (raw bytes - patch bytes) / (apply - index_copy_),
raw bytes = changes x 6 (an int32 index and a BF16 value, what the peers send): on a link slower
than B* the patch delivers a step sooner than the raw changes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import alternate, machine_line, medians  # noqa: E402


def model_case() -> tuple[dict, dict]:
    from safetensors.torch import load_file

    from pulsediff.example import DEMO_RECIPE, make_example_series

    with tempfile.TemporaryDirectory() as tmp:
        paths = make_example_series(tmp, steps=1, lr=1e-6, **DEMO_RECIPE)
        return load_file(str(paths[0])), load_file(str(paths[1]))


def moe_case(tensors: int, elements: int = 16384, density: float = 0.01) -> tuple[dict, dict]:
    import numpy as np
    import torch

    from bench_live_decode import step

    gen = torch.Generator().manual_seed(0)
    rows = elements // 128
    old = {f"model.layers.{i // 384}.mlp.experts.{i % 128}.{('gate', 'up', 'down')[i // 128 % 3]}_proj.weight":
           (torch.randn(rows, 128, generator=gen) * 0.02).bfloat16() for i in range(tensors)}
    return old, step(old, np.random.default_rng(1), density)


def qwen2_case(layers: int = 16) -> tuple[dict, dict]:
    import numpy as np
    import torch

    from bench_live_decode import qwen2_shapes, step

    gen = torch.Generator().manual_seed(0)
    old = {k: (torch.randn(s, generator=gen) * 0.02).bfloat16() for k, s in qwen2_shapes(layers).items()}
    return old, step(old, np.random.default_rng(1), 0.01)


def raw_changes(old: dict, new: dict) -> dict:
    """name -> (int64 indices, BF16 values) of the elements that differ, as a peer would send them."""
    import numpy as np
    import torch

    out = {}
    for name, t in old.items():
        a, b = t.reshape(-1).view(torch.int16), new[name].reshape(-1).view(torch.int16)
        index = torch.from_numpy(np.flatnonzero((a != b).numpy()))
        out[name] = (index, new[name].reshape(-1)[index].clone())
    return out


def measure(name: str, old: dict, new: dict, rounds: int) -> dict:
    import torch

    import pulsediff

    patch = pulsediff.make_patch_bytes(old, new)
    raw = raw_changes(old, new)
    changes = sum(int(i.numel()) for i, _ in raw.values())
    target = {k: v.view(torch.int16) for k, v in new.items()}

    def index_copy(live):
        for k, (index, values) in raw.items():
            live[k].view(-1).index_copy_(0, index, values)

    def apply(check):
        return lambda live: pulsediff.apply_to_state_dict(live, patch, check=check)

    def checked(label, fn):  # timed, then checked bit for bit (the check is not timed)
        def run(live):
            t0 = time.perf_counter()
            fn(live)
            took = time.perf_counter() - t0
            if not all(torch.equal(live[k].view(torch.int16), target[k]) for k in live):
                raise SystemExit(f"{name}: {label} did not rebuild the target bit for bit")
            return took
        return run

    runs = {"index_copy_": index_copy, "sums": apply("sums"), "digests": apply("digests")}
    times = alternate({label: checked(label, fn) for label, fn in runs.items()}, rounds,
                      setup=lambda: {k: v.clone() for k, v in old.items()})  # round 0 warms, untimed
    med = medians(times)
    out = {"case": name, "tensors": len(old), "elements": sum(t.numel() for t in old.values()), "changes": changes,
           "patch_bytes": len(patch), "raw_bytes": 6 * changes, "median_s": med}
    for check in ("sums", "digests"):
        extra = med[check] - med["index_copy_"]
        out[f"ratio_{check}"] = med[check] / med["index_copy_"]
        out[f"bstar_{check}_gbit"] = (6 * changes - len(patch)) * 8 / extra / 1e9 if extra > 0 else float("inf")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=["model", "moe", "qwen2"], choices=["model", "moe", "qwen2"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--moe-tensors", type=int, default=18432)
    parser.add_argument("--layers", type=int, default=16, help="qwen2: layers (16: 0.98 GB)")
    parser.add_argument("--save-moe", type=Path, metavar="DIR",
                        help="write the moe case's pair as DIR/old.safetensors and DIR/new.safetensors (for "
                             "scripts/bench_core.py: the CLI against cat and cp) and exit")
    args = parser.parse_args(argv)
    if args.save_moe:
        from safetensors.torch import save_file

        args.save_moe.mkdir(parents=True, exist_ok=True)
        for name, tensors in zip(("old", "new"), moe_case(args.moe_tensors)):
            save_file(tensors, str(args.save_moe / f"{name}.safetensors"), metadata={"format": "pt"})
        print(args.save_moe / "old.safetensors", args.save_moe / "new.safetensors")
        return 0

    print(machine_line())
    builders = {"model": model_case, "moe": lambda: moe_case(args.moe_tensors), "qwen2": lambda: qwen2_case(args.layers)}
    print(f"{'case':<7} {'tensors':>8} {'elements':>12} {'changes':>10} {'patch':>10} {'index_copy_':>12} "
          f"{'sums':>9} {'digests':>9} {'x sums':>7} {'x dig':>7} {'B* sums':>9} {'B* dig':>9}")
    for case in args.cases:
        old, new = builders[case]()
        r = measure(case, old, new, args.rounds)
        m = r["median_s"]
        print(f"{case:<7} {r['tensors']:>8} {r['elements']:>12,} {r['changes']:>10,} {r['patch_bytes']:>10,} "
              f"{m['index_copy_'] * 1e3:>10.1f}ms {m['sums'] * 1e3:>7.0f}ms {m['digests'] * 1e3:>7.0f}ms "
              f"{r['ratio_sums']:>6.1f}x {r['ratio_digests']:>6.1f}x {r['bstar_sums_gbit']:>6.2f}Gb/s "
              f"{r['bstar_digests_gbit']:>6.2f}Gb/s", flush=True)
        del old, new
    return 0


if __name__ == "__main__":
    sys.exit(main())
