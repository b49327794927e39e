#!/usr/bin/env python
"""The CLI's make and apply under each --device, alternating in one run (issue 27).

    python scripts/bench_cli_devices.py --gb 1.0 --density 0.02 [--repeats 3] [--devices cpu auto cuda]

Generates the pair with make_synthetic_pair.py (next to this file) unless --old/--new are
given, then runs, round by round, `make OLD NEW -o P --device D -q` and
`apply OLD P -o OUT --device D -q` for every D, in subprocesses (start-up, imports and
kernel-cache loads included, as a user waits for them). Every patch must be byte-identical
to the first device's and every OUT byte-identical to NEW; prints a markdown table of medians.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.decode().strip()}")
    if proc.stderr.strip():
        print(f"stderr of {' '.join(cmd[2:4])}: {proc.stderr.decode().strip()}", file=sys.stderr)
    return elapsed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", type=Path)
    ap.add_argument("--new", type=Path)
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--density", type=float, default=0.02)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--devices", nargs="+", default=["cpu", "auto", "cuda"])
    ap.add_argument("--workdir", type=Path)
    args = ap.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="pulsediff-devices-"))
    work.mkdir(parents=True, exist_ok=True)
    old, new = args.old, args.new
    if old is None or new is None:
        subprocess.run([sys.executable, str(HERE / "make_synthetic_pair.py"), "--gb", str(args.gb), "--density",
                        str(args.density), "--out", str(work), "-q"], check=True)
        old, new = work / "old.safetensors", work / "new.safetensors"
    cli = [sys.executable, "-m", "pulsediff"]
    times: dict[tuple[str, str], list[float]] = {}
    first_patch = None
    for r in range(args.repeats + 1):  # round 0 warms the page cache and the kernel caches, untimed
        for device in args.devices:
            patch, out = work / f"p.{device}", work / f"out.{device}.safetensors"
            for p in (patch, out):
                if p.exists():
                    p.unlink()
            t_make = timed([*cli, "make", str(old), str(new), "-o", str(patch), "--device", device, "-q"])
            t_apply = timed([*cli, "apply", str(old), str(patch), "-o", str(out), "--device", device, "-q"])
            if first_patch is None:
                first_patch = work / "p.first"
                shutil.copyfile(patch, first_patch)
            if not filecmp.cmp(patch, first_patch, shallow=False) or not filecmp.cmp(out, new, shallow=False):
                raise SystemExit(f"--device {device}: patch or output differs")
            if r:
                times.setdefault(("make", device), []).append(t_make)
                times.setdefault(("apply", device), []).append(t_apply)
    size = os.path.getsize(new) / 1e9
    print(f"\n{size:.2f} GB pair, density {args.density}, {args.repeats} rounds alternating, medians "
          "(all patches identical, all outputs cmp-identical to NEW)\n")
    print("| command | " + " | ".join(f"--device {d}" for d in args.devices) + " |")
    print("|---|" + "---:|" * len(args.devices))
    for op in ("make", "apply"):
        cells = [f"{statistics.median(times[(op, d)]):.2f} s" for d in args.devices]
        print(f"| {op} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
