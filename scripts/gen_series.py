"""Write realistic BF16 checkpoint series for the size/speed benchmark.

    python scripts/gen_series.py --out DIR [--lrs 1e-6,3e-6] [--steps 8] [--seed 0]

For each learning rate, trains pulsediff.example's small Llama-shaped decoder
(warm-up, then `--steps` RL-like AdamW steps at that lr) and saves step 0 (after
the warm-up) through step `--steps` into DIR/lr{lr:g}/ as
step_000000.safetensors ... step_00000N.safetensors. With the default 8 steps,
the pairs 0->1 (one step apart) and 0->8 (eight steps apart) both exist.

A series whose step files all exist already is skipped (delete the folder to
regenerate). Same seed, machine and thread count: same files, byte for byte.
Prints one line per series: its folder and the seconds it took (0 if skipped).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pulsediff.example import STEP_NAME, make_example_series


def series_dir(out: Path, lr: float) -> Path:
    """DIR/lr1e-06 for lr 1e-6: `{:g}` formatting, as bench.py expects."""
    return out / f"lr{lr:g}"


def parse_lrs(text: str) -> list[float]:
    try:
        lrs = [float(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from None
    if not lrs or any(lr <= 0 for lr in lrs):
        raise argparse.ArgumentTypeError("give one or more positive learning rates")
    return lrs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="output folder (one subfolder per lr)")
    ap.add_argument("--lrs", type=parse_lrs, default=[1e-6, 3e-6], help="comma-separated (default 1e-6,3e-6)")
    ap.add_argument("--steps", type=int, default=8, help="RL steps after step 0 (default 8)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")

    for lr in args.lrs:
        d = series_dir(args.out, lr)
        expected = [d / STEP_NAME.format(i) for i in range(args.steps + 1)]
        if all(p.is_file() for p in expected):
            print(f"{d}\t0.0\t(exists, skipped)")
            continue
        t0 = time.perf_counter()
        paths = make_example_series(d, steps=args.steps, lr=lr, seed=args.seed)
        assert paths == expected, (paths, expected)
        print(f"{d}\t{time.perf_counter() - t0:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
