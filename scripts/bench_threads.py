#!/usr/bin/env python
"""make and apply under PULSEDIFF_THREADS=1 and =2 (or any counts), alternating in one run, with
the process start (a make of a tiny pair) measured beside them and subtracted (issue 27).

    python scripts/bench_threads.py --old OLD --new NEW [--threads 1 2] [--repeats 5]
    python scripts/bench_threads.py --gb 1.0 --density 0.02

Each round runs, for every thread count T: `make OLD NEW -o P -q`, `apply OLD P -o OUT -q` and
`make TINY_OLD TINY_NEW -o TP -q`, each in a fresh process with PULSEDIFF_THREADS=T, wall time
from spawn to exit. A first round is untimed (page cache, Numba's cache). Every patch must be
byte-identical to the first and every OUT to NEW. Prints medians, the start-subtracted work
and its ratio to the first thread count's.
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


def run(cmd: list[str], threads: int) -> float:
    env = {**os.environ, "PULSEDIFF_THREADS": str(threads)}
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, env=env)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.decode().strip()}")
    return elapsed


def tiny_pair(work: Path) -> tuple[Path, Path]:
    import numpy as np
    import torch
    from safetensors.torch import save_file

    rng = np.random.default_rng(0)
    a = torch.from_numpy(rng.integers(0, 1 << 16, 4096, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)
    b = a.clone()
    b.view(torch.int16)[::97] += 1
    save_file({"w": a}, str(work / "tiny_old.safetensors"))
    save_file({"w": b}, str(work / "tiny_new.safetensors"))
    return work / "tiny_old.safetensors", work / "tiny_new.safetensors"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", type=Path)
    ap.add_argument("--new", type=Path)
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--density", type=float, default=0.02)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workdir", type=Path)
    args = ap.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="pulsediff-threads-"))
    work.mkdir(parents=True, exist_ok=True)
    old, new = args.old, args.new
    if old is None or new is None:
        subprocess.run([sys.executable, str(HERE / "make_synthetic_pair.py"), "--gb", str(args.gb), "--density",
                        str(args.density), "--out", str(work), "-q"], check=True)
        old, new = work / "old.safetensors", work / "new.safetensors"
    t_old, t_new = tiny_pair(work)
    cli = [sys.executable, "-m", "pulsediff"]
    times: dict[tuple[str, int], list[float]] = {}
    first = None
    for r in range(args.repeats + 1):
        for t in args.threads:
            patch, out, tp = work / f"p{t}", work / f"out{t}.safetensors", work / f"tp{t}"
            for p in (patch, out, tp):
                if p.exists():
                    p.unlink()
            row = {"make": run([*cli, "make", str(old), str(new), "-o", str(patch), "-q"], t),
                   "apply": run([*cli, "apply", str(old), str(patch), "-o", str(out), "-q"], t),
                   "start": run([*cli, "make", str(t_old), str(t_new), "-o", str(tp), "-q"], t)}
            if first is None:
                first = work / "p.first"
                shutil.copyfile(patch, first)
            if not filecmp.cmp(patch, first, shallow=False) or not filecmp.cmp(out, new, shallow=False):
                raise SystemExit(f"PULSEDIFF_THREADS={t}: patch or output differs")
            if r:
                for k, v in row.items():
                    times.setdefault((k, t), []).append(v)
    med = {k: statistics.median(v) for k, v in times.items()}
    t0 = args.threads[0]
    print(f"\n{os.path.getsize(new) / 1e9:.3f} GB pair ({new.name}), {args.repeats} rounds alternating, medians; "
          "every patch identical, every output cmp-identical to NEW\n")
    print("| PULSEDIFF_THREADS | start (tiny make) | make | apply | make - start | apply - start "
          f"| make ratio to {t0} | apply ratio to {t0} |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for t in args.threads:
        mk, ap_ = med[("make", t)] - med[("start", t)], med[("apply", t)] - med[("start", t)]
        mk0, ap0 = med[("make", t0)] - med[("start", t0)], med[("apply", t0)] - med[("start", t0)]
        print(f"| {t} | {med[('start', t)]:.3f} s | {med[('make', t)]:.3f} s | {med[('apply', t)]:.3f} s "
              f"| {mk:.3f} s | {ap_:.3f} s | {mk / mk0:.2f} | {ap_ / ap0:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
