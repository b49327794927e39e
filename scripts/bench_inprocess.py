#!/usr/bin/env python
"""make (or apply) through the Python API, without process start-up or Numba's kernel loads,
for several source trees and PULSEDIFF_THREADS values, alternating in one run (issue 27).

    python scripts/bench_inprocess.py --old OLD --new NEW --threads 1 2 [--src TREE ...] [--rounds 5]

Each cell of each round is a fresh process that runs one untimed warm-up and then `--per-process`
timed calls (their median is the cell's figure); the table gives the median over rounds. A
`--src` is a source tree (e.g. a `git worktree` of an older commit); the default is this one.
For apply, each tree first makes the patch it applies. Outputs are checked: apply's
byte-identical to NEW, make's the same bytes for every thread count and round of a tree
(another tree may write another header).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from benchlib import alternate, medians  # noqa: E402

# Runs in the child: argv = op, old, new, patch, out, count. Prints the median time and the
# output's SHA-256.
CHILD = r"""
import filecmp, hashlib, os, statistics, sys, time
from pulsediff import apply_patch, make_patch
op, old, new, patch, out, count = sys.argv[1:7]
times = []
for k in range(int(count) + 1):
    if os.path.exists(out):
        os.unlink(out)
    start = time.perf_counter()
    if op == "make":
        make_patch(old, new, out)
    else:
        apply_patch(old, patch, out)
    if k:
        times.append(time.perf_counter() - start)
if op == "apply" and not filecmp.cmp(out, new, shallow=False):
    raise SystemExit("apply: output differs from NEW")
with open(out, "rb") as f:
    digest = hashlib.sha256(f.read()).hexdigest()
os.unlink(out)
print(statistics.median(times), digest)
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", type=Path, required=True)
    ap.add_argument("--new", type=Path, required=True)
    ap.add_argument("--op", choices=("make", "apply"), default="make")
    ap.add_argument("--threads", nargs="+", default=["1", "2"])
    ap.add_argument("--src", type=Path, action="append", help="source tree (repeatable); default: this one")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per-process", type=int, default=3)
    args = ap.parse_args(argv)
    trees = args.src or [ROOT]
    with tempfile.TemporaryDirectory(prefix="pulsediff-inprocess-") as tmp:
        times = _measure(args, trees, Path(tmp))
    first = args.threads[0]
    print(f"\n{args.op}, in-process after a warm-up; {args.rounds} rounds alternating, medians\n")
    print("| tree | " + " | ".join(f"{t} threads" for t in args.threads) + f" | ratio to {first} |")
    print("|---|" + "---:|" * (len(args.threads) + 1))
    for k, tree in enumerate(trees):
        med = [medians(times)[(k, t)] for t in args.threads]
        ratios = ", ".join(f"{m / med[0]:.2f}" for m in med[1:])
        print(f"| {tree} | " + " | ".join(f"{m:.3f} s" for m in med) + f" | {ratios} |")
    return 0


def _measure(args, trees: list[Path], work: Path) -> dict[tuple[int, str], list[float]]:
    """Seconds per (tree's position in `trees`, thread count), one figure per round."""
    # Each tree applies the patch its own make writes (a tree before format 1.4 cannot read 1.4's).
    patches = [work / f"reference-{k}.pulsediff" for k in range(len(trees))]
    for tree, patch in zip(trees, patches):
        subprocess.run([sys.executable, "-c", "import sys; from pulsediff import make_patch; make_patch(*sys.argv[1:])",
                        str(args.old), str(args.new), str(patch)], check=True, env={**os.environ, "PYTHONPATH": str(tree)})
    digests: dict[int, str] = {}

    def case(k, tree, threads):
        def run():  # the child's own median of --per-process runs after its warm-up
            env = {**os.environ, "PYTHONPATH": str(tree), "PULSEDIFF_THREADS": threads}
            out = subprocess.run([sys.executable, "-c", CHILD, args.op, str(args.old), str(args.new), str(patches[k]),
                                  str(work / "out"), str(args.per_process)], env=env, capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"{tree} at {threads} threads failed: {out.stderr.strip()}")
            seconds, digest = out.stdout.split()
            if digests.setdefault(k, digest) != digest:
                raise SystemExit(f"{tree} at {threads} threads wrote other bytes than before")
            return float(seconds)
        return run

    times = alternate({(k, t): case(k, tree, t) for k, tree in enumerate(trees) for t in args.threads}, args.rounds,
                      warmup=False)
    return times


if __name__ == "__main__":
    sys.exit(main())
