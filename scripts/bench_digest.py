"""A checkpoint's digest under each scheme (format 1.4's tree, 1.0-1.3's flat), alternating in one
process: what `pulsediff digest`, catch-up's "where am I" and apply's base check cost.

    python scripts/bench_digest.py CKPT [--repeats 7] [--threads N]

The flat hash of a tensor is one XXH3 chain, so a tensor runs on one core; tree leaves are
hashed side by side by every worker thread. One untimed round of each first (page cache warm,
Numba's cache loaded); medians of the timed rounds. This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import alternate, machine_line, ratio_rows  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="PULSEDIFF_THREADS (default: every core)")
    args = ap.parse_args(argv)
    if args.threads:
        os.environ["PULSEDIFF_THREADS"] = str(args.threads)
    from pulsediff.kernels.threads import num_threads
    from pulsediff.ops.inspect import checkpoint_digest_of

    size = sum(p.stat().st_size for p in ([args.checkpoint] if args.checkpoint.is_file()
                                            else args.checkpoint.rglob("*.safetensors")))
    times = alternate({scheme: (lambda scheme=scheme: checkpoint_digest_of(args.checkpoint, scheme=scheme))
                       for scheme in ("tree", "flat")}, args.repeats)
    print(machine_line(tools=False))
    print(f"{args.checkpoint} ({size / 1e9:.2f} GB), {num_threads()} threads, medians of {args.repeats}, alternating")
    print("| scheme | s | GB/s |\n|---|---:|---:|")
    rows = ratio_rows(times, "flat")
    for scheme, m, _, _ in rows:
        print(f"| {scheme} | {m:.3f} | {size / 1e9 / m:.1f} |")
    print(f"tree / flat: {rows[0][2]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
