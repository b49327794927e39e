"""Compare pulsediff's patches with the byte-level deltas RL frameworks use: size and speed.

    python scripts/bench.py --series DIR [--pair OLD NEW ...] [--repeats 3] [--skip zstd19] [--json FILE]
    python scripts/bench.py --list      # every benchmark in scripts/, what it measures, how to run it

For every checkpoint pair, and every method below, it makes a patch of NEW
against OLD and applies it again, in subprocesses, and reports the patch's
size (bytes; bits per changed element; dense/patch ratio), the median wall
time of make and apply, and their peak RSS. Every applied output is compared
with NEW by cmp; a method whose output differs is reported as FAILED.

Methods (run as users run them; `--skip NAME[,NAME]` leaves some out):

    pd-<codec>  pulsediff make --codec <codec> / pulsediff apply, for every codec
                in pulsediff.codecs.SPARSE_CODECS (apply fsyncs its output; no
                other method does)
    xor-zstd1   XOR of the raw file bytes, compressed at zstd level 1; apply =
                decompress and XOR with OLD (what several RL frameworks ship).
                Run by this script's `--xor-helper` subcommand: numpy over
                memory-mapped files in 64 MiB chunks, libzstd through
                python-zstandard, one thread, as a framework would in-process.
                Needs OLD and NEW of the same length (else n/a).
    zstd3       zstd -3 --patch-from=OLD NEW / zstd -d --patch-from=OLD
    zstd19      the same at -19 (slow: minutes per GB)
    xdelta3     xdelta3 -9 -e -s OLD NEW PATCH / xdelta3 -d -s OLD PATCH OUT
                (when installed; else "not installed")

zstd and xdelta3 work on single files; a pair of shard folders gets n/a there.
zstd's --patch-from needs a window covering OLD: for files over 128 MiB
(window log 27) this script passes --long=W, W = ceil(log2(size)), to both
compress and decompress. (zstd 1.5.4 turns long mode on and raises its
decompression memory limit by itself for --patch-from; the flag makes that
explicit, and the patches are identical.) Files over 2 GiB: n/a.

"Changed elements" are counted here with numpy: tensors of NEW whose bit
pattern differs from the same-named tensor of OLD, element by element (all
elements of a tensor absent from OLD or of another dtype or shape).

Wall time is time.perf_counter around spawn and exit (start-up and imports
included); peak RSS is GNU time's %M (memory-mapped file pages that were
touched count). Both come from scripts/bench_core.py's run_timed. Page caches
are not dropped (needs root): one untimed warm-up make and apply of every
method runs first, so timings are warm-cache. A method whose warm-up make
takes longer than --max-warmup seconds is not repeated: its warm-up is its
one timed sample, flagged "1 run". `--timeout S` kills any run over S
seconds, `--timeout NAME=S` only NAME's (repeatable); the method is then
reported as timed out. This is a benchmark, not
a test.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import statistics
import struct
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_core import files_of, find_pulsediff, fs_type, gnu_time, identical, remove, run_timed, size_of  # noqa: E402
from benchlib import list_benchmarks, machine, machine_line  # noqa: E402

CHUNK = 64 << 20  # bytes per XOR step: bounds the helper's buffers, whatever the file size
ZSTD_DEFAULT_WINDOW_LOG = 27  # the largest window zstd decompresses without --long/--memory
ZSTD_MAX_WINDOW_LOG = 31


# --------------------------------------------------------------------------- the XOR helper


def xor_helper(argv: list[str]) -> int:
    """`--xor-helper encode OLD NEW PATCH` or `--xor-helper decode OLD PATCH OUT`.

    Kept to numpy and zstandard so that its time and RSS are those of the
    method, not of this script's other imports.
    """
    import numpy as np
    import zstandard

    if len(argv) != 4 or argv[0] not in ("encode", "decode"):
        sys.exit("usage: bench.py --xor-helper encode OLD NEW PATCH | decode OLD PATCH OUT")
    mode, a, b, c = argv
    old = np.memmap(a, dtype=np.uint8, mode="r")
    if mode == "encode":
        new = np.memmap(b, dtype=np.uint8, mode="r")
        if old.size != new.size:
            sys.exit(f"xor: {a} and {b} differ in length")
        cctx = zstandard.ZstdCompressor(level=1, threads=0)
        with open(c, "wb") as f, cctx.stream_writer(f, size=new.size, closefd=False) as w:
            for i in range(0, new.size, CHUNK):
                w.write(np.bitwise_xor(old[i:i + CHUNK], new[i:i + CHUNK]).data)
    else:
        dctx = zstandard.ZstdDecompressor()
        with open(b, "rb") as f, dctx.stream_reader(f) as r, open(c, "wb") as out:
            pos = 0
            while True:
                buf = r.read(CHUNK)
                if not buf:
                    break
                x = np.frombuffer(buf, dtype=np.uint8)
                if pos + x.size > old.size:
                    sys.exit("xor: the patch is longer than OLD")
                out.write(np.bitwise_xor(x, old[pos:pos + x.size]).data)
                pos += x.size
            if pos != old.size:
                sys.exit("xor: the patch is shorter than OLD")
    return 0


# --------------------------------------------------------------------------- counting changed elements

_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
                "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}


def _tensors(ckpt: Path) -> dict[str, tuple[str, tuple[int, ...], Path, int, int]]:
    """name -> (dtype, shape, file, absolute start, end) over a file or a folder of shards."""
    out = {}
    for f in files_of(ckpt):
        if f.suffix != ".safetensors":
            continue
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                start, end = info["data_offsets"]
                out[name] = (info["dtype"], tuple(info["shape"]), f, 8 + n + start, 8 + n + end)
    return out


def count_changed(old: Path, new: Path) -> dict:
    """Elements of NEW whose bit pattern differs from OLD's, in total and for BF16 tensors."""
    import numpy as np

    a, b = _tensors(old), _tensors(new)
    elements = changed = bf16_elements = bf16_changed = 0
    step = 1 << 24  # elements compared at a time: keeps this process small
    for name, (dtype, shape, f, s, e) in b.items():
        width = _DTYPE_BYTES.get(dtype, 1)
        numel = (e - s) // width
        if name in a and a[name][:2] == (dtype, shape):
            kind = np.dtype(f"<u{width}")
            x = np.memmap(a[name][2], dtype=kind, mode="r", offset=a[name][3], shape=(numel,)) if numel else None
            y = np.memmap(f, dtype=kind, mode="r", offset=s, shape=(numel,)) if numel else None
            diff = sum(int(np.count_nonzero(x[i:i + step] != y[i:i + step])) for i in range(0, numel, step))
            del x, y
        else:
            diff = numel
        elements += numel
        changed += diff
        if dtype == "BF16":
            bf16_elements += numel
            bf16_changed += diff
    return {"elements": elements, "changed": changed, "bf16_elements": bf16_elements, "bf16_changed": bf16_changed}


# --------------------------------------------------------------------------- methods


@dataclass
class Method:
    name: str
    label: str
    make: list[str]
    apply: list[str]
    patch: Path
    out: Path
    na: str | None = None  # why it does not apply to this pair (n/a, not installed, skipped)
    timeout: float | None = None


@dataclass
class Result:
    method: str
    label: str
    status: str = "ok"  # ok | n/a: ... | skipped | timed out | FAILED: ...
    patch_bytes: int | None = None
    make_s: list[float] = field(default_factory=list)
    apply_s: list[float] = field(default_factory=list)
    make_rss_kib: list[int] = field(default_factory=list)
    apply_rss_kib: list[int] = field(default_factory=list)
    warmup_only: bool = False
    make_argv: list[str] = field(default_factory=list)
    apply_argv: list[str] = field(default_factory=list)


def sparse_codecs() -> tuple[str, ...]:
    from pulsediff.codecs import SPARSE_CODECS

    return tuple(SPARSE_CODECS)


def zstd_window_log(size: int) -> int:
    return max(ZSTD_DEFAULT_WINDOW_LOG, math.ceil(math.log2(max(size, 1))))


def methods_for(old: Path, new: Path, work: Path, pulsediff: list[str], codecs: tuple[str, ...],
                skip: set[str], timeouts: dict[str, float]) -> list[Method]:
    ext = "" if new.is_dir() else ".safetensors"
    out = work / ("out" + ext)
    ms: list[Method] = []
    for c in codecs:
        patch = work / f"pd-{c}.pulsediff"
        ms.append(Method(f"pd-{c}", f"pulsediff {c}",
                         [*pulsediff, "make", str(old), str(new), "-o", str(patch), "--codec", c, "-q"],
                         [*pulsediff, "apply", str(old), str(patch), "-o", str(out), "-q"], patch, out))

    single = old.is_file() and new.is_file()
    same_len = single and old.stat().st_size == new.stat().st_size
    patch = work / "xor.zst"
    helper = [sys.executable, str(Path(__file__).resolve()), "--xor-helper"]
    ms.append(Method("xor-zstd1", "xor + zstd -1", [*helper, "encode", str(old), str(new), str(patch)],
                     [*helper, "decode", str(old), str(patch), str(out)], patch, out,
                     None if same_len else "n/a (not single files)" if not single else "n/a (lengths differ)"))

    zstd = shutil.which("zstd")
    biggest = max(old.stat().st_size, new.stat().st_size) if single else 0
    wlog = zstd_window_log(biggest)
    long_flag = [f"--long={wlog}"] if wlog > ZSTD_DEFAULT_WINDOW_LOG else []
    for level in (3, 19):
        patch = work / f"zstd{level}.zst"
        na = ("not installed" if not zstd else "n/a (not single files)" if not single
              else "n/a (over 2 GiB)" if wlog > ZSTD_MAX_WINDOW_LOG else None)
        ms.append(Method(f"zstd{level}", f"zstd -{level} --patch-from",
                         [zstd or "zstd", f"-{level}", *long_flag, "-f", "-q", f"--patch-from={old}", str(new),
                          "-o", str(patch)],
                         [zstd or "zstd", "-d", *long_flag, "-f", "-q", f"--patch-from={old}", str(patch),
                          "-o", str(out)], patch, out, na))

    xd = shutil.which("xdelta3")
    patch = work / "xdelta3.vcdiff"
    ms.append(Method("xdelta3", "xdelta3 -9", [xd or "xdelta3", "-9", "-e", "-f", "-s", str(old), str(new),
                                                str(patch)],
                     [xd or "xdelta3", "-d", "-f", "-s", str(old), str(patch), str(out)], patch, out,
                     "not installed" if not xd else None if single else "n/a (not single files)"))
    for m in ms:
        if m.name in skip and m.na is None:
            m.na = "skipped"
        m.timeout = timeouts.get(m.name, timeouts.get("*"))
        if m.timeout:  # KILL, not TERM: it stops at once, whatever the tool does on TERM
            wrap = ["timeout", "--signal=KILL", f"{m.timeout:g}"]
            m.make, m.apply = [*wrap, *m.make], [*wrap, *m.apply]
    return ms


# --------------------------------------------------------------------------- running


def timed(argv: list[str], time_cmd: str | None, rss_file: Path, timeout: float | None) -> tuple[float, int] | str:
    """(seconds, peak RSS KiB), or why it failed.

    bench_core.run_timed exits the process on a failing command; one method
    failing must not end the comparison, so its SystemExit becomes a status.
    """
    t0 = time.perf_counter()
    try:
        return run_timed(argv, time_cmd, rss_file)[:2]
    except SystemExit as e:
        if timeout and time.perf_counter() - t0 >= timeout:
            return f"timed out (> {timeout:g} s)"
        return "FAILED: " + " ".join(str(e.code).split())[:300]


def bench_method(m: Method, new: Path, args, time_cmd: str | None, rss_file: Path) -> Result:
    r = Result(m.name, m.label, make_argv=m.make, apply_argv=m.apply)
    if m.na:
        r.status = m.na
        return r
    rounds = [None] * args.repeats
    if not args.no_warmup:
        rounds = ["warm-up", *rounds]
    for tag in rounds:
        remove(m.patch)
        remove(m.out)
        mk = timed(m.make, time_cmd, rss_file, m.timeout)
        if isinstance(mk, str):
            r.status = mk
            break
        size = m.patch.stat().st_size
        if r.patch_bytes is not None and r.patch_bytes != size:
            r.status = f"FAILED: patch size changed between runs ({r.patch_bytes} then {size})"
            break
        r.patch_bytes = size
        ap = timed(m.apply, time_cmd, rss_file, m.timeout)
        if isinstance(ap, str):
            r.status = ap
            break
        if not identical(m.out, new):
            r.status = "FAILED: applied output differs from NEW"
            break
        slow = tag == "warm-up" and args.max_warmup is not None and mk[0] > args.max_warmup
        if tag != "warm-up" or slow:
            r.make_s.append(mk[0])
            r.make_rss_kib.append(mk[1])
            r.apply_s.append(ap[0])
            r.apply_rss_kib.append(ap[1])
        print(f"  {m.name:<14} {tag or f'run {len(r.make_s)}/{args.repeats}'}: make {mk[0]:.2f} s, "
              f"apply {ap[0]:.2f} s, {size:,} bytes, cmp ok", file=sys.stderr, flush=True)
        if slow:
            r.warmup_only = True
            print(f"  {m.name:<14} warm-up make over --max-warmup {args.max_warmup:g} s: "
                  f"not repeated, the warm-up is its one sample", file=sys.stderr)
            break
    remove(m.patch)
    remove(m.out)
    return r


def series_pairs(series: Path) -> list[tuple[str, Path, Path]]:
    """Per lr folder (sorted by lr): step 0 -> 1 and step 0 -> last."""
    pairs = []
    dirs = [d for d in series.iterdir() if d.is_dir() and re.fullmatch(r"lr[0-9.e+-]+", d.name)]
    for d in sorted(dirs, key=lambda d: float(d.name[2:])):
        steps = sorted(d.glob("step_[0-9][0-9][0-9][0-9][0-9][0-9].safetensors"))
        if len(steps) < 2:
            continue
        num = lambda p: int(p.name[5:11])  # noqa: E731
        for later in dict.fromkeys((steps[1], steps[-1])):
            n = num(later) - num(steps[0])
            pairs.append((f"lr{float(d.name[2:]):g} {n} step{'s' if n > 1 else ''} ({num(steps[0])}->{num(later)})",
                          steps[0], later))
    return pairs


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--xor-helper"]:
        return xor_helper(argv[1:])
    if argv[:1] == ["--list"]:
        print(list_benchmarks())
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--series", type=Path, help="folder written by gen_series.py: its 0->1 and 0->last pairs")
    ap.add_argument("--pair", nargs=2, action="append", default=[], metavar=("OLD", "NEW"), type=Path,
                    help="another pair (repeatable)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip", action="append", default=[],
                    help="methods to leave out, comma-separated (pd-<codec>, xor-zstd1, zstd3, zstd19, xdelta3)")
    ap.add_argument("--no-warmup", action="store_true", help="no untimed warm-up run per method")
    ap.add_argument("--max-warmup", type=float, default=None,
                    help="a method whose warm-up make takes longer is not repeated (its warm-up is its sample)")
    ap.add_argument("--timeout", action="append", default=[], metavar="[NAME=]S",
                    help="kill any run (or NAME's runs) over S seconds (repeatable)")
    ap.add_argument("--workdir", type=Path, help="where patches and outputs go; default: a new temp folder")
    ap.add_argument("--pulsediff", help="command to run instead of the installed `pulsediff`")
    ap.add_argument("--json", type=Path, help="also save everything to this JSON file")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.series and not args.series.is_dir():
        ap.error(f"--series {args.series}: not a folder")
    pairs = series_pairs(args.series) if args.series else []
    if args.series and not pairs:
        ap.error(f"no lr*/step_*.safetensors series in {args.series}")
    for old, new in args.pair:
        for p in (old, new):
            if not p.exists():
                ap.error(f"{p} does not exist")
        pairs.append((f"{old.resolve().parent.name}: {old.name} -> {new.name}", old.resolve(), new.resolve()))
    if not pairs:
        ap.error("give --series DIR and/or --pair OLD NEW")
    codecs = sparse_codecs()
    known = {f"pd-{c}" for c in codecs} | {"xor-zstd1", "zstd3", "zstd19", "xdelta3"}
    skip = {s.strip() for arg in args.skip for s in arg.split(",") if s.strip()}
    if skip - known:
        ap.error(f"unknown method(s) {sorted(skip - known)}; known: {sorted(known)}")
    timeouts: dict[str, float] = {}
    for t in args.timeout:
        name, _, secs = t.rpartition("=")
        try:
            timeouts[name or "*"] = float(secs)
        except ValueError:
            ap.error(f"--timeout {t!r}: give S or NAME=S")
        if name and name not in known:
            ap.error(f"--timeout {t!r}: unknown method {name!r}; known: {sorted(known)}")

    pulsediff = find_pulsediff(args.pulsediff)
    made = args.workdir is None
    work = Path(tempfile.mkdtemp(prefix="pulsediff-bench-")) if made else args.workdir
    work.mkdir(parents=True, exist_ok=True)
    time_cmd = gnu_time()
    env = machine()
    print(machine_line(env), flush=True)
    # Start-up (imports, Numba's cache) is in every pulsediff timing below; on
    # small pairs it is most of it, so show it on its own.
    startup = [timed([*pulsediff, "--version"], time_cmd, work / "rss.txt", None) for _ in range(1 + args.repeats)][1:]
    startup_s = statistics.median(t[0] for t in startup) if all(isinstance(t, tuple) for t in startup) else None
    print(f"pulsediff CLI start-up (`pulsediff --version`, median; make/apply also load their kernels): "
          f"{f'{startup_s:.3f} s' if startup_s is not None else 'failed'}\n"
          f"timing:  {args.repeats} timed run(s) per method, medians, "
          f"{'after one untimed warm-up run' if not args.no_warmup else 'NO warm-up run'}; "
          f"warm page cache (not dropped);\n         apply output checked with cmp every run; peak RSS: "
          f"{'GNU time %M' if time_cmd else 'wait4, a floor'}, touched pages of memory-mapped files included; "
          f"\n         pulsediff apply fsyncs its output, the others do not", flush=True)
    report = {"machine": env, "repeats": args.repeats, "warm_cache": not args.no_warmup,
              "max_warmup_s": args.max_warmup, "timeouts_s": timeouts, "workdir_fs": fs_type(work),
              "rss_source": "GNU time %M" if time_cmd else "wait4 (a floor)",
              "pulsediff": pulsediff, "pulsediff_startup_s": startup_s, "pairs": []}
    ok = True
    try:
        for label, old, new in pairs:
            t0 = time.perf_counter()
            counts = count_changed(old, new)
            count_s = time.perf_counter() - t0
            print(f"\n== {label}: counted {counts['changed']:,} changed elements in {count_s:.1f} s; benchmarking",
                  file=sys.stderr, flush=True)
            results = [bench_method(m, new, args, time_cmd, work / "rss.txt")
                       for m in methods_for(old, new, work, pulsediff, codecs, skip, timeouts)]
            ok &= not any(r.status.startswith("FAILED") for r in results)
            entry = {"label": label, "old": str(old), "new": str(new), "new_bytes": size_of(new),
                     "old_bytes": size_of(old), **counts, "results": [summary(r) for r in results]}
            report["pairs"].append(entry)
            render_pair(entry)
    finally:
        rss = work / "rss.txt"
        if rss.exists():
            rss.unlink()
        if made:
            shutil.rmtree(work, ignore_errors=True)
    if len(report["pairs"]) > 1:
        render_overview(report["pairs"])
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"results saved to {args.json}", file=sys.stderr)
    return 0 if ok else 1


def summary(r: Result) -> dict:
    d = asdict(r)
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    d.update(make_median_s=med(r.make_s), apply_median_s=med(r.apply_s),
             make_peak_rss_mib=max(r.make_rss_kib) / 1024 if r.make_rss_kib else None,
             apply_peak_rss_mib=max(r.apply_rss_kib) / 1024 if r.apply_rss_kib else None)
    return d


def render_pair(p: dict) -> None:
    dens = p["changed"] / p["elements"] if p["elements"] else 0.0
    print(f"\n{p['label']}\n  OLD {p['old']}\n  NEW {p['new']}: {p['new_bytes']:,} bytes; "
          f"{p['changed']:,} of {p['elements']:,} elements changed ({100 * dens:.3f}%; BF16: "
          f"{p['bf16_changed']:,} of {p['bf16_elements']:,})")
    head = (f"  {'method':<24} {'patch bytes':>13} {'bits/chg':>9} {'dense/patch':>11} {'make s':>8} "
            f"{'apply s':>8} {'make MiB':>9} {'apply MiB':>9}  note")
    print(head)
    print("  " + "-" * (len(head) - 2))
    for r in p["results"]:
        if r["patch_bytes"] is None:
            print(f"  {r['label']:<24} {'-':>13} {'-':>9} {'-':>11} {'-':>8} {'-':>8} {'-':>9} {'-':>9}  {r['status']}")
            continue
        b = r["patch_bytes"]
        bits = f"{8 * b / p['changed']:.2f}" if p["changed"] and b is not None else "-"
        ratio = f"{p['new_bytes'] / b:.1f}x" if b else "-"
        f = lambda x, fmt: format(x, fmt) if x is not None else "-"  # noqa: E731
        note = "cmp ok" if r["status"] == "ok" else r["status"]
        if r["warmup_only"]:
            note += ", 1 run (the warm-up)"
        elif r["status"] == "ok":
            note += f", {len(r['make_s'])} run{'s' if len(r['make_s']) > 1 else ''}"
        print(f"  {r['label']:<24} {f(b, ',d'):>13} {bits:>9} {ratio:>11} {f(r['make_median_s'], '.3f'):>8} "
              f"{f(r['apply_median_s'], '.3f'):>8} {f(r['make_peak_rss_mib'], '.0f'):>9} "
              f"{f(r['apply_peak_rss_mib'], '.0f'):>9}  {note}")


def render_overview(pairs: list[dict]) -> None:
    """Bits per changed element, method by pair: the one-glance comparison."""
    labels = [r["label"] for r in pairs[0]["results"]]
    print("\nbits per changed element (patch bytes x 8 / changed elements)")
    cols = [p["label"] for p in pairs]
    width = max(12, *(len(c) for c in cols))
    print(f"  {'method':<24} " + " ".join(f"{c:>{width}}" for c in cols))
    for i, lab in enumerate(labels):
        cells = []
        for p in pairs:
            r = p["results"][i]
            b = r["patch_bytes"]
            ok = r["status"] == "ok" and b is not None and p["changed"]
            cells.append(f"{8 * b / p['changed']:.2f}" if ok else r["status"].split(" (")[0][:width])
        print(f"  {lab:<24} " + " ".join(f"{c:>{width}}" for c in cells))


if __name__ == "__main__":
    sys.exit(main())
