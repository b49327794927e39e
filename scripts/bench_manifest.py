"""Planning over a long manifest: `catch-up --plan`, and a catch-up whose every file is missing.

A chain of N one-step patches after one anchor, with made-up digests and no
files (the manifest alone decides a plan). Medians of 3, in this process.

    python scripts/bench_manifest.py [--tree PATH] [N ...]

--tree puts another checkout first on sys.path (e.g. a `git worktree` of an
older commit), to compare before and after in one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def fake_chain(folder: Path, n: int, empty: str) -> None:
    d = [f"xxh128:{i:032x}" for i in range(n + 1)]
    entries = [{"kind": "anchor", "file": "anchor-00000000.pulsediff", "step": 0, "from_step": None, "base": empty,
                "target": d[0], "bytes": 1000, "target_bytes": 1000}]
    entries += [{"kind": "patch", "file": f"patch-{i - 1:08d}-{i:08d}.pulsediff", "step": i, "from_step": i - 1,
                 "base": d[i - 1], "target": d[i], "bytes": 10, "target_bytes": 1000} for i in range(1, n + 1)]
    (folder / "manifest.json").write_text(json.dumps({"version": 1, "precision": "exact", "entries": entries}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", type=Path)
    ap.add_argument("sizes", nargs="*", type=int, default=[2000, 20000])
    args = ap.parse_args()
    if args.tree:
        sys.path.insert(0, str(args.tree))
    from pulsediff.errors import PulsediffError
    try:
        from pulsediff.series.catch_up import catch_up, plan_catch_up
        try:
            from pulsediff.format.digest import FLAT
            empty = FLAT.empty
        except ImportError:  # a --tree from before format 1.4's schemes
            from pulsediff.format.digest import checkpoint_digest
            empty = checkpoint_digest([])
    except ImportError:  # a --tree from before the package was layered (issue 25)
        from pulsediff.digest import checkpoint_digest
        from pulsediff.series import catch_up, plan_catch_up
        empty = checkpoint_digest([])

    for n in args.sizes:
        folder = Path(tempfile.mkdtemp())
        fake_chain(folder, n, empty)
        plan, fail = [], []
        for _ in range(3):
            t = time.perf_counter()
            plan_catch_up(folder / "worker.safetensors", folder)
            plan.append(time.perf_counter() - t)
            t = time.perf_counter()
            try:
                catch_up(folder / "worker.safetensors", folder)
            except PulsediffError:
                pass
            fail.append(time.perf_counter() - t)
        print(f"{n:>6} entries  plan {statistics.median(plan):7.3f} s   catch-up, all files missing "
              f"{statistics.median(fail):7.3f} s")


if __name__ == "__main__":
    main()
