"""How long the light commands take, beside `pulsediff --version` (issue 48, item 8).

    python scripts/bench_light.py [--rounds 15] [--baseline-src DIR]

Reading a patch's header, a manifest or help needs no kernels, so each of these
should cost little more than the interpreter's start and the CLI's imports:

    version           pulsediff --version                 the floor
    stats PATCH       pulsediff stats PATCH               header only (no --values)
    stats --json      pulsediff stats PATCH --json
    stats --values    pulsediff stats PATCH --values      decodes the values: loads the kernels
    digest CKPT       pulsediff digest CKPT               hashes a tiny checkpoint: loads Numba
    help <command>    pulsediff COMMAND --help            every command

The commands run in subprocesses, in alternating rounds (one of each per round), on a
tiny patch made here; it prints each one's median wall time (spawn to exit) and its
ratio to `--version`'s median in the same rounds. `--baseline-src DIR` also runs
`stats PATCH` and `publish --help` from an older checkout, in the same rounds. The aim
is under 0.25 s for `stats PATCH` and for every help. This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import find_pulsediff, pulsediff_from_tree  # noqa: E402
from benchlib import alternate, machine_line, ratio_rows  # noqa: E402

COMMANDS = ["make", "apply", "squash", "publish", "catch-up", "vllm-sync", "stats", "digest", "keygen", "demo"]


def tiny_pair(work: Path) -> tuple[Path, Path]:
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    old = {f"layers.{i}.weight": rng.integers(0, 1 << 16, (256, 64), dtype=np.uint16).view(np.float16) for i in range(4)}
    new = {k: v.copy() for k, v in old.items()}
    for v in new.values():
        bits = v.view(np.uint16).reshape(-1)
        at = rng.choice(bits.size, bits.size // 100, replace=False)
        bits[at] ^= 1
    save_file(old, str(work / "old.safetensors"))
    save_file(new, str(work / "new.safetensors"))
    return work / "old.safetensors", work / "new.safetensors"


# Bytecode caches as a user has them: with PYTHONDONTWRITEBYTECODE set (some sandboxes set it), every run
# compiles pulsediff's modules from source again, which is not what a user waits for.
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def timed(argv: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    took = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"bench_light: {' '.join(argv)} failed: {proc.stderr.decode()[-400:]}")
    return took


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--pulsediff", help="the command to time (default: the one beside this Python)")
    ap.add_argument("--baseline-src", type=Path, help="an older checkout: its stats and publish --help too")
    args = ap.parse_args(argv)
    pulsediff = find_pulsediff(args.pulsediff)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        old, new = tiny_pair(work)
        patch = work / "p.pulsediff"
        subprocess.run([*pulsediff, "make", str(old), str(new), "-o", str(patch), "-q"], check=True, env=ENV)
        ops = {"version": [*pulsediff, "--version"],
               "stats PATCH": [*pulsediff, "stats", str(patch)],
               "stats --json": [*pulsediff, "stats", str(patch), "--json"],
               "stats --values": [*pulsediff, "stats", str(patch), "--values"],
               "digest CKPT": [*pulsediff, "digest", str(new)]}
        ops |= {f"help {c}": [*pulsediff, c, "--help"] for c in COMMANDS}
        if args.baseline_src:
            base = pulsediff_from_tree(args.baseline_src)
            ops |= {"baseline stats PATCH": [*base, "stats", str(patch)],
                    "baseline help publish": [*base, "publish", "--help"]}
        # round 0 warms Numba's cache, the page cache and .pyc files, untimed
        times = alternate({name: (lambda argv_=argv_: timed(argv_)) for name, argv_ in ops.items()}, args.rounds)
    print(f"{machine_line(tools=False)}; {args.rounds} alternating rounds, medians")
    print(f"{'command':<24} {'median s':>9} {'x version':>10} {'worst s':>8}")
    for name, median, ratio, worst in ratio_rows(times, "version"):
        print(f"{name:<24} {median:9.3f} {ratio:10.2f} {worst:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
