"""Run a command and report its wall time and peak *private* memory.

    python scripts/peak_private.py [--interval 0.02] -- COMMAND [ARG ...]

Peak RSS (GNU time's %M) counts the pages of memory-mapped files a process
has touched, so a tool that maps a 14 GB checkpoint shows up to 14 GB even
when it allocates little. What a second process on the machine cannot have is
the process's anonymous memory: RssAnon + RssShmem in /proc/PID/status
(heap, thread stacks, and anonymous maps, which Python makes MAP_SHARED and
the kernel counts as shared memory although no other process maps them:
pulsediff's large buffers are those), sampled every --interval seconds until
the command exits (a peak shorter than the interval can be missed). Before
2026-11-25 this counted RssAnon alone and missed those buffers. Prints one JSON line:
{"seconds": ..., "peak_private_mib": ..., "peak_rss_mib": ..., "exit": ...}.
Linux only. A measuring tool for benchmarks, not a test.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def status_kib(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interval", type=float, default=0.02)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give a command after --")
    t0 = time.perf_counter()
    proc = subprocess.Popen(command)
    peak_anon = peak_rss = 0
    while proc.poll() is None:
        # pulsediff's large buffers are anonymous MAP_SHARED maps (memory.fresh_buffer): RssShmem
        peak_anon = max(peak_anon, status_kib(proc.pid, "RssAnon") + status_kib(proc.pid, "RssShmem"))
        peak_rss = max(peak_rss, status_kib(proc.pid, "VmHWM"))
        time.sleep(args.interval)
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": round(seconds, 3), "peak_private_mib": round(peak_anon / 1024, 1),
                      "peak_rss_mib": round(peak_rss / 1024, 1), "exit": proc.returncode}))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
