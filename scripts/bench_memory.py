"""Measure what first touches of memory cost, with and without pulsediff.io.memory's hints.

    python scripts/bench_memory.py [--mib 1024] [--file PATH] [--repeats 5]

1. Anonymous memory: `np.empty(n).fill(1)` (pages fault in one at a time)
   against `fresh_buffer(n).fill(1)` (huge pages where offered, all pages
   mapped in one MADV_POPULATE_WRITE call).
2. A file in the page cache, memory-mapped and read one byte per page: plain
   faults against `populate_read` first. The file is read once beforehand so
   that it is cached; --file defaults to a scratch file of --mib MiB.
3. Writing --mib MiB to a new file and fsyncing it, through StagedFiles:
   buffered against direct=True (O_DIRECT), into the folder of --file (or the
   temporary folder). The data is in memory before the clock starts.

Each case runs in a fresh child process (a process reuses memory it has freed,
which would hide the first-touch cost), alternating, --repeats times; medians.
This is a benchmark, not a test.
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
from benchlib import alternate, machine_line, ratio_rows  # noqa: E402

CASES = {
    "anon: np.empty + fill": """
import numpy as np, time
t = time.perf_counter(); a = np.empty(N, np.uint8); a.fill(1); print(time.perf_counter() - t)
""",
    "anon: fresh_buffer + fill": """
import numpy as np, time
from pulsediff.io.memory import fresh_buffer
t = time.perf_counter(); a = fresh_buffer(N); a.fill(1); print(time.perf_counter() - t)
""",
    "file: mmap, a byte per page": """
import mmap, numpy as np, time
f = open(PATH, 'rb')
t = time.perf_counter()
m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
a = np.frombuffer(m, np.uint8); s = int(a[::mmap.PAGESIZE].sum()); print(time.perf_counter() - t)
""",
    "file: mmap + populate_read, a byte per page": """
import mmap, numpy as np, time
from pulsediff.io.memory import populate_read
f = open(PATH, 'rb')
t = time.perf_counter()
m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ); populate_read(m, 0, len(m))
a = np.frombuffer(m, np.uint8); s = int(a[::mmap.PAGESIZE].sum()); print(time.perf_counter() - t)
""",
}
for _mode in ("buffered", "direct"):
    CASES[f"write + fsync: {_mode}"] = f"""
import time, pathlib
from pulsediff.io.atomic import StagedFiles
from pulsediff.io.memory import fresh_buffer
a = fresh_buffer(N); a.fill(7)
out = pathlib.Path(OUTDIR) / "written.bin"
t = time.perf_counter()
with StagedFiles() as staged:
    with staged.open(out, direct={_mode == "direct"}) as f:
        for i in range(0, N, 64 << 20):
            f.write(memoryview(a[i:i + (64 << 20)]))
    staged.commit()
print(time.perf_counter() - t)
out.unlink()
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--file", type=Path, help="a file to map (default: a scratch file of --mib MiB)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    n = args.mib << 20
    with tempfile.TemporaryDirectory() as tmp:
        path = args.file
        if path is None:
            path = Path(tmp) / "mapped.bin"
            with open(path, "wb") as f:
                for _ in range(args.mib):
                    f.write(os.urandom(1 << 20))
        path.read_bytes()  # into the page cache
        prelude = f"N = {n}\nPATH = {str(path)!r}\nOUTDIR = {str(path.parent if args.file else tmp)!r}\n"

        def case(code):  # the child's own time of its region
            return lambda: float(subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True,
                                                check=True, cwd=ROOT).stdout.strip())

        times = alternate({name: case(code) for name, code in CASES.items()}, args.repeats, warmup=False)
    print(f"{machine_line(tools=False)}; {args.mib} MiB, medians of {args.repeats}, each in a fresh process")
    for name, med, _, worst in ratio_rows(times, next(iter(CASES))):
        t = times[name]
        print(f"  {name:<46} {med:7.3f} s  ({args.mib / 1024 / med:6.2f} GiB/s; min {min(t):.3f}, max {worst:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
