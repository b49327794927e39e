#!/usr/bin/env python
"""make and apply as users run them, under several --device values, PULSEDIFF_THREADS counts or
--codec values, alternating in one run (issues 27 and 34).

    python scripts/bench_variants.py --threads 1 2 [--old OLD --new NEW] [--repeats 5]
    python scripts/bench_variants.py --devices cpu auto cuda --gb 1.0 --density 0.02
    python scripts/bench_variants.py --codecs ctx-rans ctx-ac --old OLD --new NEW

Generates the pair with make_synthetic_pair.py (next to this file) unless --old/--new are given.
Each round runs, for every variant, `make OLD NEW -o P -q` and `apply OLD P -o OUT -q`, and, to
measure the process start, `make` of a 4096-element pair; each in a fresh process, wall time
from spawn to exit (imports and kernel-cache loads included, as a user waits for them). A first
round is untimed (page cache, Numba's cache). Every patch must be byte-identical to the first
of its variant, and every OUT to NEW. Prints medians, the start-subtracted work and its ratio to the first
variant's.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from benchlib import alternate, medians  # noqa: E402


def run(cmd: list[str], env: dict) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, env={**os.environ, **env})
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
    ap.add_argument("--gb", type=float, default=1.0, help="size of the generated pair, when no --old/--new")
    ap.add_argument("--density", type=float, default=0.02)
    variants = ap.add_mutually_exclusive_group(required=True)
    variants.add_argument("--threads", type=int, nargs="+", help="PULSEDIFF_THREADS values to compare")
    variants.add_argument("--devices", nargs="+", help="--device values to compare")
    variants.add_argument("--codecs", nargs="+", help="make --codec values to compare")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workdir", type=Path)
    args = ap.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="pulsediff-variants-"))
    work.mkdir(parents=True, exist_ok=True)
    old, new = args.old, args.new
    if old is None or new is None:
        subprocess.run([sys.executable, str(HERE / "make_synthetic_pair.py"), "--gb", str(args.gb), "--density",
                        str(args.density), "--out", str(work), "-q"], check=True)
        old, new = work / "old.safetensors", work / "new.safetensors"
    t_old, t_new = tiny_pair(work)
    # per variant: (environment, make's extra arguments, apply's)
    if args.threads:
        label, names = "PULSEDIFF_THREADS", [str(t) for t in args.threads]
        setting = {n: ({"PULSEDIFF_THREADS": n}, [], []) for n in names}
    elif args.devices:
        label, names = "--device", list(args.devices)
        setting = {n: ({}, ["--device", n], ["--device", n]) for n in names}
    else:
        label, names = "--codec", list(args.codecs)
        setting = {n: ({}, ["--codec", n], []) for n in names}
    cli = [sys.executable, "-m", "pulsediff"]
    def fresh(*paths):
        for p in paths:
            if p.exists():
                p.unlink()

    def cases_of(name):
        env, make_extra, apply_extra = setting[name]
        patch, out, tp = work / f"p.{name}", work / f"out.{name}.safetensors", work / f"tp.{name}"
        first = work / f"p.first.{name}"

        def make():
            fresh(patch)
            return run([*cli, "make", str(old), str(new), "-o", str(patch), "-q", *make_extra], env)

        def apply():
            fresh(out)
            took = run([*cli, "apply", str(old), str(patch), "-o", str(out), "-q", *apply_extra], env)
            if not first.exists():
                shutil.copyfile(patch, first)
            if not filecmp.cmp(patch, first, shallow=False) or not filecmp.cmp(out, new, shallow=False):
                raise SystemExit(f"{label} {name}: patch or output differs")
            return took

        def start():
            fresh(tp)
            return run([*cli, "make", str(t_old), str(t_new), "-o", str(tp), "-q", *make_extra], env)

        return {("make", name): make, ("apply", name): apply, ("start", name): start}

    times = alternate({key: case for name in names for key, case in cases_of(name).items()}, args.repeats)
    med = medians(times)
    base = names[0]
    print(f"\n{os.path.getsize(new) / 1e9:.3f} GB pair ({new.name}), {args.repeats} rounds alternating, medians; "
          "every patch identical within its variant, every output cmp-identical to NEW\n")
    print("patch bytes: " + ", ".join(f"{n} {os.path.getsize(work / f'p.first.{n}'):,}" for n in names) + "\n")
    print(f"| {label} | start (tiny make) | make | apply | make - start | apply - start "
          f"| make ratio to {base} | apply ratio to {base} |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in names:
        mk, ap_ = (med[(op, name)] - med[("start", name)] for op in ("make", "apply"))
        mk0, ap0 = (med[(op, base)] - med[("start", base)] for op in ("make", "apply"))
        print(f"| {name} | {med[('start', name)]:.3f} s | {med[('make', name)]:.3f} s | {med[('apply', name)]:.3f} s "
              f"| {mk:.3f} s | {ap_:.3f} s | {mk / mk0:.2f} | {ap_ / ap0:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
