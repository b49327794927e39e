"""make on a busy machine: its time with competing CPU-bound processes against its idle time.

    python scripts/bench_load.py --old OLD --new NEW [--competitors 2] [--repeats 5] [--src DIR ...]

Inference workers and trainers are busy machines: pulsediff must slow down at
most in proportion to the load, never by spinning threads fighting for the
cores (issue 13 measured 8x with Numba's OpenMP layer). Each repetition runs
`pulsediff make OLD NEW` idle, then again while `--competitors` processes
spin on the CPU, for every source tree given (alternating, so drift hits all
alike), and prints the medians and the loaded/idle ratio. With two
competitors on two cores a fair scheduler gives make half the machine, so a
ratio near 2 is the proportional slowdown.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from bench_core import pulsediff_from_tree  # noqa: E402
from benchlib import alternate, machine_line, medians  # noqa: E402


def run_make(tree: Path, old: Path, new: Path, out: Path) -> float:
    t = time.perf_counter()
    subprocess.run([*pulsediff_from_tree(tree), "make", str(old), str(new), "-o", str(out), "-f", "-q"], check=True)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", type=Path, required=True)
    ap.add_argument("--new", type=Path, required=True)
    ap.add_argument("--competitors", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--src", action="append", type=Path, help="source tree to run pulsediff from (repeatable)")
    args = ap.parse_args()
    trees = args.src or [ROOT]
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "p.pulsediff"

        def loaded(tree):
            spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.competitors)]
            try:
                time.sleep(0.5)  # let them get going
                return run_make(tree, args.old, args.new, out)
            finally:
                for p in spinners:
                    p.kill()
                    p.wait()

        cases = {}
        for tree in trees:
            cases[(str(tree), "idle")] = lambda tree=tree: run_make(tree, args.old, args.new, out)
            cases[(str(tree), "loaded")] = lambda tree=tree: loaded(tree)
        times = alternate(cases, args.repeats)  # round 0 warms JIT caches and the page cache, untimed
    med = medians(times)
    print(machine_line(tools=False))
    print(f"make {args.old.name} -> {args.new.name}, medians of {args.repeats}, "
          f"{args.competitors} competing CPU-bound processes when loaded\n")
    print("| source | idle s | loaded s | loaded / idle |")
    print("|---|---:|---:|---:|")
    for tree in trees:
        idle, busy = med[(str(tree), "idle")], med[(str(tree), "loaded")]
        print(f"| {tree} | {idle:.2f} | {busy:.2f} | {busy / idle:.1f}x |")


if __name__ == "__main__":
    main()
