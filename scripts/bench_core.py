"""Benchmark `pulsediff make` and `apply` against cat and cp, as users run them.

    python scripts/bench_core.py --old OLD --new NEW [--repeats 3] [--json FILE]
    python scripts/bench_core.py --gb 1.0 [--density 0.01] [--shards N]
    ... [--baseline-src DIR]    also an older checkout's make and apply, alternating

Each repetition runs, in subprocesses:

    cat OLD NEW > /dev/null             reading both inputs: the floor for make
    cp -r NEW DST                       writing a dense copy: the floor for apply
    cp -r NEW DST && sync DST           the same, flushed to disk (pulsediff fsyncs its output)
    pulsediff make OLD NEW -o PATCH -q
    pulsediff apply OLD PATCH -o OUT -q

and reports medians of wall time (time.perf_counter around spawn and exit, so
process start-up, imports and JIT-cache loading are included), throughput in
GB/s of NEW's size (for every row, cat's included although it reads twice
that), each command's peak RSS (GNU time's %M; it counts the pages of
memory-mapped inputs that were touched, so a tool that maps its inputs shows
up to their size even when it allocates little) and its peak *private*
memory (RssAnon + RssShmem of the command's process, sampled every 20 ms by a
thread of this one: heap, stacks and anonymous maps, what a second process
cannot have; scripts/peak_private.py does the same for one command). After every apply,
OUT must be byte-identical to NEW (cmp).

By default page caches are not dropped; instead one untimed round of every
command runs first, so all timings are warm-cache: inputs in memory, Numba's
on-disk cache compiled. With --cold (root only) every command, timed or not,
starts after `sync` and `echo 3 > /proc/sys/vm/drop_caches`: the way to time
a pair larger than memory (--gb 14 --density 0.01 is the 7B shape of issue
13), where part of every read comes from the disk anyway. Outputs are deleted
between runs, untimed.

With --gb the pair is generated first by make_synthetic_pair.py (next to this
file) into the work folder. This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from benchlib import alternate  # noqa: E402


@dataclass
class Op:
    name: str
    argv: list[str]
    cleanup: list[Path] = field(default_factory=list)  # removed before each run, untimed
    times: list[float] = field(default_factory=list)
    peak_rss_kib: list[int] = field(default_factory=list)
    peak_private_kib: list[int] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def find_pulsediff(explicit: str | None) -> list[str]:
    """The `pulsediff` console script: --pulsediff, the one beside this Python, or PATH's."""
    if explicit:
        return explicit.split()
    beside = Path(sys.executable).with_name("pulsediff")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("pulsediff")
    if found:
        return [found]
    sys.exit("bench_core: no `pulsediff` command found (install the package, or pass --pulsediff)")


def from_tree(tree: Path, code: str) -> list[str]:
    """A command running Python `code` with pulsediff imported from the source tree `tree` (an
    older checkout, say), not from the installed, possibly editable, package. Arguments added
    after it reach `code` as sys.argv[1:]."""
    prelude = ("import sys; src = sys.argv.pop(1); "
               "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]; "
               "sys.path.insert(0, src); ")
    return [sys.executable, "-c", prelude + code, str(Path(tree).resolve())]


def pulsediff_from_tree(tree: Path) -> list[str]:
    """The `pulsediff` command of source tree `tree` (see from_tree)."""
    return from_tree(tree, "from pulsediff.cli.main import main; sys.exit(main())")


def files_of(path: Path) -> list[Path]:
    """A checkpoint's files: itself, or every file in its folder (sorted)."""
    return sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]


def size_of(path: Path) -> int:
    return sum(p.stat().st_size for p in files_of(path))


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def gnu_time() -> str | None:
    """/usr/bin/time if it is GNU time (it has -f and -o), else None."""
    path = shutil.which("time", path="/usr/bin:/bin")
    if path and subprocess.run([path, "-f", "%M", "-o", os.devnull, "true"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0:
        return path
    return None


def private_kib(pid: int, via_parent: bool) -> int:
    """RssAnon + RssShmem of `pid` (anonymous maps are MAP_SHARED in Python: pulsediff's large buffers
    count as shared memory), or with `via_parent` of its first child (the command GNU time runs); 0 if gone."""
    try:
        if via_parent:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                children = f.read().split()
            if not children:
                return 0
            pid = int(children[0])
        with open(f"/proc/{pid}/status") as f:
            return sum(int(line.split()[1]) for line in f if line.startswith(("RssAnon:", "RssShmem:")))
    except (OSError, ValueError, IndexError):
        pass
    return 0


def drop_caches() -> None:
    """Write back dirty pages, then drop the page cache (root only): the next command reads from disk."""
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def run_timed(argv: list[str], time_cmd: str | None, rss_file: Path, interval: float = 0.02) -> tuple[float, int, int]:
    """(wall seconds, peak RSS in KiB, peak private memory in KiB) of one command; exits on failure.

    The peak RSS comes from GNU time when there is one: a child's ru_maxrss
    also counts the memory of the process that spawned it, as it was before
    exec, so it must be spawned by something small, not by this Python. Without
    GNU time, wait4's figure is a floor of this process's own RSS. The private
    memory is sampled by a thread (the main thread's wait stays exact; a peak
    shorter than `interval` can be missed).
    """
    import threading

    full = [time_cmd, "-f", "%M", "-o", str(rss_file), *argv] if time_cmd else argv
    t0 = time.perf_counter()
    proc = subprocess.Popen(full, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stop, peak = threading.Event(), [0]

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], private_kib(proc.pid, time_cmd is not None))
            stop.wait(interval)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - t0
    stop.set()
    sampler.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    proc.stderr.close()
    if proc.returncode != 0:
        sys.exit(f"bench_core: {' '.join(argv)} failed with exit status {proc.returncode}:\n"
                 f"{stderr.decode(errors='replace')}")
    if time_cmd:
        return elapsed, int(rss_file.read_text().split()[-1]), peak[0]
    return elapsed, usage.ru_maxrss, peak[0]  # KiB on Linux


def identical(a: Path, b: Path) -> bool:
    """Byte-identical checkpoints (same file names in a folder), by cmp."""
    fa, fb = files_of(a), files_of(b)
    if a.is_dir() != b.is_dir() or (a.is_dir() and [p.name for p in fa] != [p.name for p in fb]):
        return False
    return all(subprocess.run(["cmp", "-s", str(x), str(y)]).returncode == 0 for x, y in zip(fa, fb))


def fs_type(path: Path) -> str:
    try:
        out = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True)
        return out.stdout.strip() or "?"
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_argument_group("input (either --old and --new, or --gb)")
    src.add_argument("--old", type=Path)
    src.add_argument("--new", type=Path)
    src.add_argument("--gb", type=float, help="generate a synthetic BF16 pair of this size (GB) instead")
    src.add_argument("--density", type=float, default=0.01, help="with --gb: fraction of elements changed")
    src.add_argument("--shards", type=int, default=1, help="with --gb: write N-shard folders")
    src.add_argument("--seed", type=int, default=0, help="with --gb")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", type=Path, help="where outputs (and a generated pair) go; default: a new temp folder")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--pulsediff", help="command to run instead of the installed `pulsediff`")
    ap.add_argument("--baseline-src", type=Path,
                    help="also run make and apply from this source tree (e.g. a `git worktree` of an older "
                         "commit), alternating with the installed one, for a before/after ratio")
    ap.add_argument("--make-arg", action="append", default=[], help="extra argument for `pulsediff make` (repeatable)")
    ap.add_argument("--apply-arg", action="append", default=[], help="extra argument for `pulsediff apply` (repeatable)")
    ap.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up round")
    ap.add_argument("--cold", action="store_true",
                    help="drop the page cache before every command (root only; implies --no-warmup)")
    ap.add_argument("--json", type=Path, help="also save the results to this JSON file")
    args = ap.parse_args(argv)
    if (args.gb is not None) == (args.old is not None or args.new is not None) or \
            (args.gb is None and (args.old is None or args.new is None)):
        ap.error("give either --old and --new, or --gb")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.cold:
        if not os.access("/proc/sys/vm/drop_caches", os.W_OK):
            ap.error("--cold drops the page cache, which needs root")
        args.no_warmup = True

    pulsediff = find_pulsediff(args.pulsediff)
    made_workdir = args.workdir is None
    work = Path(tempfile.mkdtemp(prefix="pulsediff-bench-")) if made_workdir else args.workdir
    work.mkdir(parents=True, exist_ok=True)
    try:
        return bench(args, pulsediff, work)
    finally:
        if made_workdir and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        elif args.keep or not made_workdir:
            print(f"work folder kept: {work}", file=sys.stderr)


def bench(args, pulsediff: list[str], work: Path) -> int:
    generated = None
    if args.gb is not None:
        # In a child process, so that this one stays small (see run_timed).
        t0 = time.perf_counter()
        cmd = [sys.executable, str(HERE / "make_synthetic_pair.py"), "--gb", str(args.gb), "--density",
               str(args.density), "--shards", str(args.shards), "--seed", str(args.seed), "--out", str(work / "pair")]
        lines = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True).stdout.split("\n")
        old, new = Path(lines[0]), Path(lines[1])
        generated = {"gb": args.gb, "density": args.density, "shards": args.shards, "seed": args.seed,
                     "seconds": time.perf_counter() - t0}
    else:
        old, new = args.old.resolve(), args.new.resolve()
        for p in (old, new):
            if not p.exists():
                sys.exit(f"bench_core: {p} does not exist")

    patch, out, copy = work / "bench.pulsediff", work / ("out" + ("" if new.is_dir() else ".safetensors")), \
        work / ("copy" + ("" if new.is_dir() else ".safetensors"))
    sync_targets = f'"{copy}"/*' if new.is_dir() else f'"{copy}"'
    ops = [
        Op("startup", [*pulsediff, "--version"]),
        Op("cat OLD NEW", ["cat", *map(str, files_of(old)), *map(str, files_of(new))]),
        Op("cp NEW", ["cp", "-r", str(new), str(copy)], [copy]),
        Op("cp NEW + sync", ["sh", "-c", f'cp -r "{new}" "{copy}" && sync {sync_targets}'], [copy]),
        Op("make", [*pulsediff, "make", str(old), str(new), "-o", str(patch), "-q", *args.make_arg], [patch]),
        Op("apply", [*pulsediff, "apply", str(old), str(patch), "-o", str(out), "-q", *args.apply_arg], [out]),
    ]
    baseline_out = None
    if args.baseline_src is not None:
        before = pulsediff_from_tree(args.baseline_src)
        baseline_patch = work / "baseline.pulsediff"
        baseline_out = work / ("baseline-out" + ("" if new.is_dir() else ".safetensors"))
        ops += [
            Op("make (baseline)", [*before, "make", str(old), str(new), "-o", str(baseline_patch), "-q"],
               [baseline_patch]),
            Op("apply (baseline)", [*before, "apply", str(old), str(baseline_patch), "-o", str(baseline_out), "-q"],
               [baseline_out]),
        ]
    by_name = {op.name: op for op in ops}

    time_cmd = gnu_time()
    rss_file = work / "rss.txt"

    def run(op: Op) -> tuple[float, int, int]:
        for p in op.cleanup:
            remove(p)
        if args.cold:
            drop_caches()
        return run_timed(op.argv, time_cmd, rss_file)

    if not args.no_warmup:
        print("warm-up: one untimed round of every command (page caches cannot be dropped "
              "without root, so all timings below are warm-cache)", file=sys.stderr)
    last: dict[str, tuple[int, int]] = {}  # the newest run's peak RSS and private memory per command
    cmp_ok = True

    def case(op: Op):
        def go() -> float:
            dt, rss, private = run(op)
            last[op.name] = (rss, private)
            return dt
        return go

    def after_round(times: dict[str, list[float]]) -> None:
        nonlocal cmp_ok
        for op in ops:
            op.peak_rss_kib.append(last[op.name][0])
            op.peak_private_kib.append(last[op.name][1])
        same = identical(out, new) and (baseline_out is None or identical(baseline_out, new))
        cmp_ok &= same
        print(f"repeat {len(times['make'])}/{args.repeats}: make {times['make'][-1]:.2f} s, "
              f"apply {times['apply'][-1]:.2f} s, cmp OUT NEW: {'ok' if same else 'DIFFERENT'}", file=sys.stderr)

    times = alternate({op.name: case(op) for op in ops}, args.repeats, warmup=not args.no_warmup,
                      after_round=after_round)
    for op in ops:
        op.times = times[op.name]

    new_bytes, old_bytes, patch_bytes = size_of(new), size_of(old), patch.stat().st_size
    results = {
        "old": str(old), "new": str(new), "old_bytes": old_bytes, "new_bytes": new_bytes,
        "patch_bytes": patch_bytes, "ratio_dense_over_patch": new_bytes / patch_bytes,
        "repeats": args.repeats, "warm_cache": not args.no_warmup, "cold": args.cold, "cmp_ok": cmp_ok,
        "rss_source": "GNU time" if time_cmd else "wait4 (a floor of the benchmark's own RSS)",
        "ops": {op.name: {**{k: v for k, v in asdict(op).items() if k not in ("name", "cleanup")},
                          "median_s": op.median,
                          "gb_per_s_of_new": new_bytes / 1e9 / op.median,
                          "peak_rss_mib": max(op.peak_rss_kib) / 1024,
                          "peak_private_mib": max(op.peak_private_kib) / 1024} for op in ops},
        "make_over_cat": by_name["make"].median / by_name["cat OLD NEW"].median,
        "apply_over_cp": by_name["apply"].median / by_name["cp NEW"].median,
        "apply_over_cp_sync": by_name["apply"].median / by_name["cp NEW + sync"].median,
        "baseline": {"src": str(args.baseline_src), "make_over_baseline": by_name["make"].median / by_name[
            "make (baseline)"].median, "apply_over_baseline": by_name["apply"].median / by_name[
            "apply (baseline)"].median} if baseline_out is not None else None,
        "generated": generated,
        "env": {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count(),
                "pulsediff": pulsediff, "workdir_fs": fs_type(work), "loadavg": os.getloadavg()},
    }
    render(results, ops)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"results saved to {args.json}", file=sys.stderr)
    if not cmp_ok:
        print("FAILED: the applied checkpoint differs from NEW", file=sys.stderr)
        return 1
    return 0


def render(r: dict, ops: list[Op]) -> None:
    print(f"NEW   {r['new']}: {r['new_bytes']:,} bytes ({r['new_bytes'] / 1e9:.3f} GB)")
    print(f"patch {r['patch_bytes']:,} bytes, dense/patch ratio {r['ratio_dense_over_patch']:.1f}x")
    caches = ("cold page cache (sync and drop_caches before every command)" if r["cold"] else
              f"warm page cache ({'one untimed warm-up round first' if r['warm_cache'] else 'NO warm-up round'}; "
              f"caches not dropped)")
    print(f"{r['repeats']} repeats, medians; {caches}; workdir fs: {r['env']['workdir_fs']}; "
          f"load avg {r['env']['loadavg'][0]:.2f}")
    print(f"wall time includes process start-up; peak RSS from {r['rss_source']}, "
          f"memory-mapped file pages included; private: peak RssAnon + RssShmem, sampled every 20 ms")
    print()
    head = (f"{'command':<18} {'median s':>9} {'min s':>8} {'max s':>8} {'GB/s of NEW':>12} {'peak RSS MiB':>13} "
            f"{'private MiB':>12}")
    print(head)
    print("-" * len(head))
    for op in ops:
        print(f"{op.name:<18} {op.median:>9.3f} {min(op.times):>8.3f} {max(op.times):>8.3f} "
              f"{r['new_bytes'] / 1e9 / op.median:>12.2f} {max(op.peak_rss_kib) / 1024:>13.0f} "
              f"{max(op.peak_private_kib) / 1024:>12.0f}")
    print()
    print(f"make / cat       {r['make_over_cat']:.2f}x   (cat reads OLD and NEW, as make does)")
    print(f"apply / cp       {r['apply_over_cp']:.2f}x   (cp leaves its copy in the page cache)")
    print(f"apply / cp+sync  {r['apply_over_cp_sync']:.2f}x   (pulsediff apply fsyncs its output)")
    if r["baseline"]:
        print(f"make / baseline  {r['baseline']['make_over_baseline']:.2f}x   (baseline: {r['baseline']['src']})")
        print(f"apply / baseline {r['baseline']['apply_over_baseline']:.2f}x")
    print(f"cmp OUT NEW      {'identical' if r['cmp_ok'] else 'DIFFERENT'}")


if __name__ == "__main__":
    sys.exit(main())
