"""What every benchmark in scripts/ shares: the machine line, alternating rounds, medians and ratios,
markdown tables, and the list of benchmarks (`python scripts/bench.py --list`).

These machines are noisy: a figure is quoted as a median over rounds, and a speed-up as the ratio
of two medians taken side by side in one run, each round running every case once in turn, so that
drift and a neighbour's load fall on all cases alike (docs/BENCHMARKS.md says how to read them).
"""

from __future__ import annotations

import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# --- the machine -----------------------------------------------------------------------------


def machine(tools: bool = True) -> dict:
    """The facts a figure needs beside it: cores (and those this process may use), CPU model,
    RAM, platform, Python, load average now, and with `tools` the compression tools' versions
    (two subprocesses)."""
    model = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram_gib = None
    try:
        ram_gib = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1)) / 1024 ** 2
    except (OSError, AttributeError):
        pass

    env = {"nproc": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "cpu": model,
           "ram": f"{ram_gib:.1f} GiB" if ram_gib is not None else "?", "ram_gib": ram_gib,
           "platform": platform.platform(), "python": sys.version.split()[0], "loadavg": os.getloadavg()}
    if not tools:
        return env

    def version(cmd: list[str]) -> str:
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
            line = (p.stdout or p.stderr).strip().splitlines()[0]
            return line.strip("* ").split(", Copyright")[0].split(", by ")[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            return "not installed"

    try:
        import zstandard
        pyzstd = f"python-zstandard {zstandard.__version__} (libzstd {'.'.join(map(str, zstandard.ZSTD_VERSION))})"
    except ImportError:
        pyzstd = "python-zstandard not installed"
    return {**env, "zstd": version(["zstd", "-V"]), "xdelta3": version(["xdelta3", "-V"]), "pyzstd": pyzstd}


def machine_line(env: dict | None = None, tools: bool = True) -> str:
    """One line (two with `tools`) naming the machine a table was measured on."""
    env = machine(tools) if env is None else env
    line = (f"machine: nproc {env['nproc']} (affinity {env['affinity']}), {env['cpu']}, RAM {env['ram']}, "
            f"{env['platform']}, Python {env['python']}, load avg {env['loadavg'][0]:.2f}")
    return line + (f"\ntools:   {env['zstd']}; {env['xdelta3']}; {env['pyzstd']}" if tools else "")


# --- timing ----------------------------------------------------------------------------------


def alternate(cases: dict[str, Callable], rounds: int, *, setup: Callable | None = None,
              warmup: bool = True, after_round: Callable | None = None) -> dict[str, list[float]]:
    """Each case's seconds in each of `rounds` rounds, every round running every case once, in the
    order given. A case is called with `setup()`'s value when `setup` is given (made fresh for each
    call, untimed: a copy of the base to write into, say), else with nothing. Its time is the
    wall-clock time of the call, or what the call returns when that is a number (a case that
    times itself: a region inside it, a subprocess's own clock). With `warmup`, a round 0 runs
    first and is not counted (kernels compiled and loaded, caches and allocators warm).
    `after_round(times)`, if given, runs after each counted round (a check of its outputs, a
    progress line)."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(rounds + (1 if warmup else 0)):
        for name, case in cases.items():
            arg = setup() if setup is not None else None
            t0 = time.perf_counter()
            got = case(arg) if setup is not None else case()
            took = time.perf_counter() - t0
            if isinstance(got, (int, float)) and not isinstance(got, bool):
                took = float(got)
            if r or not warmup:
                times[name].append(took)
        if after_round is not None and (r or not warmup):
            after_round(times)
    return times


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(ts) for name, ts in times.items() if ts}


def ratio_rows(times: dict[str, list[float]], baseline: str) -> list[tuple[str, float, float, float]]:
    """(case, median s, median / the baseline's median, worst s) per case, in order."""
    med = medians(times)
    return [(name, med[name], med[name] / med[baseline], max(ts)) for name, ts in times.items() if ts]


def markdown(header: list[str], rows: list[list]) -> str:
    """A markdown table; numbers right-aligned."""
    def right(i):
        return any(isinstance(r[i], (int, float)) for r in rows)
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---:" if right(i) else "---" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


# --- the list --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Benchmark:
    script: str
    measures: str
    run: str  # a typical command line


BENCHMARKS = (
    Benchmark("bench.py", "patch size and make/apply time of every codec and the byte-level peers "
              "(XOR+zstd, zstd --patch-from, xdelta3) on a series", "python scripts/bench.py --series DIR"),
    Benchmark("bench_core.py", "make and apply through the CLI on a pair against cat and cp + sync, peak "
              "private memory", "python scripts/bench_core.py --gb 1.0 --repeats 3"),
    Benchmark("bench_variants.py", "the CLI at several PULSEDIFF_THREADS or --device values, alternating",
              "python scripts/bench_variants.py --threads 1 2 --gb 1.0"),
    Benchmark("bench_inprocess.py", "make or apply through the Python API, several source trees and thread "
              "counts", "python scripts/bench_inprocess.py --help"),
    Benchmark("bench_load.py", "make on a busy machine against its idle time", "python scripts/bench_load.py "
              "--old OLD --new NEW"),
    Benchmark("bench_memory.py", "first touches of memory with and without pulsediff.io.memory's hints",
              "python scripts/bench_memory.py --mib 1024"),
    Benchmark("bench_digest.py", "checkpoint digests, tree against flat", "python scripts/bench_digest.py FILE"),
    Benchmark("bench_entropy.py", "the entropy coders' encode, decode and walk speeds",
              "python scripts/bench_entropy.py"),
    Benchmark("bench_light.py", "stats, digest and every --help against --version",
              "python scripts/bench_light.py --rounds 11"),
    Benchmark("bench_live_apply.py", "issue 45: the live apply into host tensors against index_copy_ of raw "
              "indices (a small model, an MoE shape, the 1 GB Qwen2 shape), with the break-even link speed",
              "python scripts/bench_live_apply.py --rounds 3"),
    Benchmark("bench_live_decode.py", "the live decode on the CPU against index_copy_ (1 GB Qwen2 shape)",
              "python scripts/bench_live_decode.py"),
    Benchmark("bench_manifest.py", "a series manifest's plan and catch-up time as the chain grows",
              "python scripts/bench_manifest.py"),
    Benchmark("bench_catchup.py", "catch-up over rsync, S3 and HTTP against fetching the dense checkpoint",
              "python scripts/bench_catchup.py --help"),
    Benchmark("bench_vllm.py", "updates into a running vLLM engine against its own reload (engine venv)",
              "python scripts/bench_vllm.py --rounds 3 --layers 16"),
    Benchmark("bench_tp_memory.py", "issue 45, item 7: a 2-rank tensor-parallel engine's host memory, ranks sharing "
              "one host state against a copy per rank (engine venv)", "python scripts/bench_tp_memory.py --layers 16"),
    Benchmark("soak_rl.py", "issue 46: the RL loop (examples/rl_loop.py) for 300 steps with both faults: patch bytes, "
              "pauses, the engine worker's memory, beside TRL's delta format re-created (engine venv)",
              "python scripts/soak_rl.py --steps 300"),
    Benchmark("bench_gpu.py", "each CUDA kernel's bandwidth, the 7B live apply and make on a GPU",
              "scripts/gpu_check.sh bench"),
    Benchmark("profile_gpu_live.py", "where a GPU live apply spends its time (host or device)",
              "python scripts/profile_gpu_live.py --layers 8"),
    Benchmark("fuzz_campaign.py", "hostile inputs behind valid checksums, for a time budget",
              "python scripts/fuzz_campaign.py --help"),
)
HELPERS = ("benchlib.py", "make_synthetic_pair.py", "gen_series.py", "make_golden.py", "peak_private.py",
           "gpu_check.sh", "make_warm_patches.py")


def list_benchmarks() -> str:
    width = max(len(b.script) for b in BENCHMARKS)
    lines = [f"{b.script:<{width}}  {b.measures}\n{'':<{width}}  $ {b.run}" for b in BENCHMARKS]
    lines.append(f"\nhelpers: {', '.join(HELPERS)}; timing and the machine line: scripts/benchlib.py")
    return "\n".join(lines)
