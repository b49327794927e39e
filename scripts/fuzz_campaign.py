"""The long fuzz campaign: hostile patches, checkpoints and manifests in worker processes, and kill trials.

    python scripts/fuzz_campaign.py --cases 100000 --workers 1 --json fuzz.json

Cases are those of tests/fuzz_cases.py (the CI suite, tests/test_fuzz.py,
runs a few hundred of them): every codec's sections, the patch header, the
layout and folder files, hostile safetensors given to make and to apply, and
hostile manifests given to catch-up, in equal numbers. Case `i` of kind `k`
is seeded by (k, i), so any finding reproduces with

    python scripts/fuzz_campaign.py --replay KIND SEED

Each worker process sets RLIMIT_AS (`--mem-gib`, 2 GiB by default) after its
imports, and each case has a wall-clock limit (`--timeout`). Counted:
refused (a PulsediffError and nothing written), accepted (the output checked
byte for byte against what the input says), and the findings: other
exceptions (type and one example each), wrong outputs accepted, asymmetric
acceptance (make accepted a checkpoint that apply then refused, or apply
refused a checkpoint make did not refuse first with the same message),
over-memory (MemoryError, or the worker killed), crashes (the worker died)
and hangs (the case ran past its limit; the worker is killed and replaced).

Kill trials (`--kill-trials N`, 50 by default): `pulsediff apply` killed with
SIGKILL at a random moment, into a file, into a new folder (-o DIR) and in
place on a sharded folder. After each: the base is unchanged; the output is
absent or complete and correct; an in-place folder, once pulsediff has opened
it again, is the old checkpoint or the new one, never a mix; and the next
apply succeeds and leaves no temporary file.

Shrink trials (`--shrink-trials N`, 30 by default): an input truncated while
pulsediff reads it (issue 23: a trainer overwriting its checkpoint, a sync
tool replacing it, a full disk), at a random moment to a random length: the
base during `apply`, the base and the new checkpoint during `make`. After
each: no death by a signal (SIGBUS was the failure), either success with a
correct output (the shrink came after the last read) or exit 1 with one line
naming the file and no output, and no temporary file left.

Remote trials (`--remote-trials N`, 30 by default; needs obstore, the
`remote` extra): `pulsediff catch-up` from a local HTTP server that fails
each GET of a patch at random (a 500, a 404, a body cut short after its
headers promised it whole, or one byte flipped), from a random worker step.
After each: exit 0 with the worker bit for bit the published step it
reports; or exit 1 with one line and the worker as it was; or exit 4 (the
newest step unreachable from intact files) with one line saying it is now at
step K, and the worker bit for bit step K; no temporary file beside the worker.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from multiprocessing.connection import wait
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import machine_line  # noqa: E402


# -- workers ------------------------------------------------------------------------


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def worker_main(conn, corpus_root: str, work: str, mem_bytes: int, numba_threads: int) -> None:
    # Tensors here are tiny: one kernel thread per worker is 3x faster on a loaded 2-core machine,
    # and the code paths are the same (the inputs are below one chunk of the parallel kernels).
    os.environ["NUMBA_NUM_THREADS"] = str(numba_threads)
    import resource

    import torch  # noqa: F401  (bf16 cases import it; loaded before the memory limit, like every import)

    import fuzz_cases as fc

    corpus = fc.Corpus.load(Path(corpus_root))
    for kind in fc.KINDS:  # load the compiled kernels and every module a case touches
        fc.run_case(kind, -1, corpus, Path(work))
    resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
    conn.send(("ready", _vm_size()))
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the campaign is gone
            return
        if msg is None:
            return
        kind, seed = msg
        conn.send(("done", fc.run_case(kind, seed, corpus, Path(work)).to_json()))


class Worker:
    def __init__(self, ctx, n: int, corpus_root: Path, work_root: Path, mem_bytes: int, numba_threads: int):
        self.work = work_root / f"w{n}"
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(child, str(corpus_root), str(self.work), mem_bytes,
                                                              numba_threads),
                                daemon=True)
        self.proc.start()
        child.close()
        self.case = None
        self.started = 0.0
        self.ready = False
        self.spawned = time.monotonic()

    def give(self, case) -> None:
        self.case = case
        self.started = time.monotonic()
        self.conn.send(case)

    def kill(self) -> None:
        try:
            os.kill(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.join(5)


def cases_of(kinds: list[str], total: int, offset: int):
    per = -(-total // len(kinds))
    for i in range(per):
        for kind in kinds:
            yield kind, offset + i


def run_cases(args, corpus_root: Path, work_root: Path) -> dict:
    import fuzz_cases as fc

    kinds = args.kinds or list(fc.KINDS)
    todo = cases_of(kinds, args.cases, args.seed_offset)
    ctx = mp.get_context("spawn")
    mem = int(args.mem_gib * (1 << 30))
    workers = [Worker(ctx, n, corpus_root, work_root, mem, args.numba_threads) for n in range(args.workers)]
    by_kind: dict[str, Counter] = defaultdict(Counter)
    facts: dict[str, Counter] = defaultdict(Counter)
    examples: dict[str, dict] = {}  # one example per kind of finding
    vm_sizes = []
    done = 0
    exhausted = False
    t0 = last_report = time.monotonic()

    def record(kind, seed, verdict, detail="", error="", runs=None, case_facts=None):
        nonlocal done
        done += 1
        by_kind[kind][verdict] += 1
        for k, v in (runs or {}).items():
            facts[kind]["run " + k] += v
        for k, v in (case_facts or {}).items():
            facts[kind][k] += v
        if verdict in ("exception", "wrong", "asymmetric", "memory", "crash", "hang", "harness"):
            key = f"{verdict}: {error or detail.split(' at ')[0][:60]} @ {detail.rsplit(' at ', 1)[-1] if ' at ' in detail else kind}"
            examples.setdefault(key, {"kind": kind, "seed": seed, "detail": detail, "count": 0})["count"] += 1

    while True:
        for i, w in enumerate(workers):
            if not w.proc.is_alive() and w.case is None and not w.ready:
                if time.monotonic() - w.spawned > 300:
                    raise SystemExit(f"worker {i} did not start (exit {w.proc.exitcode})")
            if w.ready and w.case is None and not exhausted:
                nxt = next(todo, None)
                if nxt is None:
                    exhausted = True
                else:
                    w.give(nxt)
        if exhausted and all(w.case is None for w in workers):
            break
        for conn in wait([w.conn for w in workers], timeout=1.0):
            w = next(w for w in workers if w.conn is conn)
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                continue  # it died: handled below
            if msg[0] == "ready":
                w.ready = True
                vm_sizes.append(msg[1])
            else:
                o = msg[1]
                record(o["kind"], o["seed"], o["verdict"], o["detail"], o["error"], o["runs"], o.get("facts"))
                w.case = None
        now = time.monotonic()
        for i, w in enumerate(workers):
            died = not w.proc.is_alive()
            hung = w.case is not None and now - w.started > args.timeout
            if not (died or hung):
                continue
            if w.case is not None:
                kind, seed = w.case
                if hung:
                    record(kind, seed, "hang", f"ran past {args.timeout} s")
                    w.kill()
                else:
                    code = w.proc.exitcode
                    verdict = "memory" if code == -signal.SIGKILL else "crash"
                    record(kind, seed, verdict, f"worker died (exit {code})")
            elif w.ready:
                print(f"worker {i} died between cases (exit {w.proc.exitcode})", flush=True)
            elif not died:
                continue
            w.kill()
            workers[i] = Worker(ctx, i, corpus_root, work_root, mem, args.numba_threads)
        if now - last_report > 60:
            last_report = now
            totals = Counter()
            for c in by_kind.values():
                totals.update(c)
            print(f"[{now - t0:7.0f} s] {done} cases: {dict(totals)}", flush=True)
    for w in workers:
        w.conn.send(None)
        w.proc.join(10)
        w.kill()
    return {"wall_s": time.monotonic() - t0, "cases": done, "by_kind": {k: dict(v) for k, v in by_kind.items()},
            "facts": {k: dict(v) for k, v in facts.items()}, "examples": examples,
            "worker_vm_bytes_at_limit": max(vm_sizes, default=0)}


# -- kill trials ---------------------------------------------------------------------

CHILD = """
import sys
import pulsediff.ops.apply, pulsediff.kernels.cpu, pulsediff.codecs.ctx_rans, pulsediff.kernels.entropy  # imports first
from pulsediff import apply_patch
mode, base, patch, out = sys.argv[1:5]
print("go", flush=True)
if mode == "in-place":
    apply_patch(base, patch, in_place=True, device="cpu")
else:
    apply_patch(base, patch, out, device="cpu")
"""


def build_kill_corpus(root: Path) -> dict:
    import numpy as np

    from ckpt_factory import mutate, random_tensor, save, save_sharded
    from pulsediff import make_patch

    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(99)
    base = {f"layers.{i}.weight": random_tensor(rng, "BF16", (1024, 1024)) for i in range(24)}  # 48 MiB
    target = {k: mutate(rng, v, 0.01) for k, v in base.items()}
    save(base, root / "old.safetensors")
    save(target, root / "new.safetensors")
    make_patch(root / "old.safetensors", root / "new.safetensors", root / "file.pulsediff", device="cpu")
    save_sharded(base, root / "old", 4)
    save_sharded(target, root / "new", 3)  # resharded: one old shard goes away
    (root / "old/config.json").write_text('{"step": 0}')
    (root / "new/config.json").write_text('{"step": 1}')
    make_patch(root / "old", root / "new", root / "dir.pulsediff", device="cpu")
    return {"file": (root / "old.safetensors", root / "new.safetensors", root / "file.pulsediff"),
            "dir": (root / "old", root / "new", root / "dir.pulsediff")}


def _tree(path: Path):
    from ckpt_factory import folder_bytes

    if path.is_dir():
        return {k: v for k, v in folder_bytes(path).items() if not k.startswith(".")}
    return path.read_bytes() if path.exists() else None


def _child(mode: str, base: Path, patch: Path, out: Path | None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, mode, str(base), str(patch), str(out or "-")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _run_child(mode, base, patch, out, kill_after: float | None) -> tuple[float, bool]:
    """(seconds from 'go' to exit or kill, whether it was killed before it finished)."""
    p = _child(mode, base, patch, out)
    line = p.stdout.readline()
    if line.strip() != b"go":
        raise SystemExit(f"kill-trial child did not start: {p.stderr.read().decode()[-500:]}")
    go = time.monotonic()
    killed = False
    if kill_after is not None:
        try:
            p.wait(kill_after)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
            killed = True
    rc = p.wait()
    if not killed and rc != 0:
        raise SystemExit(f"kill-trial child failed (exit {rc}): {p.stderr.read().decode()[-500:]}")
    return time.monotonic() - go, killed


def kill_trials(n: int, root: Path, seed: int = 0) -> dict:
    from pulsediff import apply_patch
    from pulsediff.io.atomic import INTENT_NAME
    from pulsediff.ops.inspect import checkpoint_digest_of

    data = build_kill_corpus(root / "corpus")
    rng = random.Random(seed)
    results = {}
    for mode in ("file", "dir", "in-place"):
        old, new, patch = data["file" if mode == "file" else "dir"]
        old_tree, new_tree = _tree(old), _tree(new)
        durations = []
        for _ in range(3):  # how long an apply takes once the child is ready: the window to kill in
            trial = root / "time"
            shutil.rmtree(trial, ignore_errors=True)
            trial.mkdir()
            if mode == "in-place":
                shutil.copytree(old, trial / "base")
                durations.append(_run_child("in-place", trial / "base", patch, None, None)[0])
            else:
                durations.append(_run_child("out", old, patch, trial / "out", None)[0])
        window = statistics.median(durations)
        counts = Counter()
        problems = []
        for t in range(n):
            trial = root / f"{mode}-{t}"
            shutil.rmtree(trial, ignore_errors=True)
            trial.mkdir()
            at = rng.uniform(0, 1.1 * window)
            if mode == "in-place":
                target = trial / "base"
                shutil.copytree(old, target)
                _, killed = _run_child("in-place", target, patch, None, at)
            else:
                target = trial / "out"
                _, killed = _run_child("out", old, patch, target, at)
            counts["killed" if killed else "finished before the kill"] += 1
            problem = None
            if _tree(old) != old_tree:
                problem = "the base changed"
            elif mode == "in-place":
                if (target / INTENT_NAME).exists():
                    counts["killed among the renames (intent record left)"] += 1
                checkpoint_digest_of(target)  # the next run that opens the folder finishes an interrupted update
                now = _tree(target)
                state = "old" if now == old_tree else "new" if now == new_tree else None
                counts[f"folder is {state or 'a MIX'} after reopening"] += 1
                if state is None:
                    problem = f"folder mixes old and new: {sorted(now)}"
                else:
                    apply_patch(target, patch, in_place=True, device="cpu")
                    if _tree(target) != new_tree:
                        problem = "applying again did not give the new folder"
                    elif any(p.name.startswith(".") for p in target.iterdir()):
                        problem = f"temporaries left after the next apply: {[p.name for p in target.iterdir()]}"
            else:
                got = _tree(target)
                counts["output absent" if got is None else "output complete" if got == new_tree else "output WRONG"] += 1
                if got is not None and got != new_tree:
                    problem = "a partial or wrong output under the real name"
                else:
                    again = trial / "again"  # the next apply into the folder removes the dead run's temporaries
                    apply_patch(old, patch, again, device="cpu")
                    left = [p.name for p in trial.iterdir() if p.name.startswith(".")]
                    if _tree(again) != new_tree:
                        problem = "the next apply did not give the target"
                    elif left:
                        problem = f"temporaries left after the next apply: {left}"
            if problem:
                problems.append(f"trial {t} (kill at {at:.3f} s): {problem}")
            shutil.rmtree(trial, ignore_errors=True)
        results[mode] = {"trials": n, "apply_s_median": round(window, 3), "counts": dict(counts), "problems": problems}
        print(f"kill trials, {mode}: {dict(counts)}; problems: {len(problems)}", flush=True)
    return results


# -- shrink trials: inputs truncated while they are read ------------------------------


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "pulsediff.cli.main", *map(str, args)]


def shrink_trials(n: int, root: Path, seed: int = 0) -> dict:
    from pulsediff import apply_patch

    data = build_kill_corpus(root / "corpus")
    old, new, patch = data["file"]
    rng = random.Random(seed)
    results = {}
    for mode in ("apply: base", "make: base", "make: new"):
        victim_of = {"apply: base": old, "make: base": old, "make: new": new}[mode]

        def command(trial: Path, victim: Path) -> tuple[list[str], Path]:
            if mode == "apply: base":
                return _cli("apply", victim, patch, "-o", trial / "out" / "ckpt.safetensors", "-q"), \
                    trial / "out" / "ckpt.safetensors"
            pair = (victim, new) if mode == "make: base" else (old, victim)
            return _cli("make", *pair, "-o", trial / "out" / "p.pulsediff", "-q"), trial / "out" / "p.pulsediff"

        durations = []
        for _ in range(3):  # how long the command takes, start-up included: the window to shrink in
            trial = root / "time"
            shutil.rmtree(trial, ignore_errors=True)
            (trial / "out").mkdir(parents=True)
            shutil.copy(victim_of, trial / "victim.safetensors")
            cmd, _ = command(trial, trial / "victim.safetensors")
            t = time.monotonic()
            subprocess.run(cmd, check=True, capture_output=True)
            durations.append(time.monotonic() - t)
        window = statistics.median(durations)
        counts = Counter()
        problems = []
        for t in range(n):
            trial = root / f"shrink-{t}"
            shutil.rmtree(trial, ignore_errors=True)
            (trial / "out").mkdir(parents=True)
            victim = trial / "victim.safetensors"
            shutil.copy(victim_of, victim)
            size = victim.stat().st_size
            at, keep = rng.uniform(0, 1.1 * window), int(size * rng.uniform(0, 0.95))
            cmd, out = command(trial, victim)
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            time.sleep(at)
            os.truncate(victim, keep)
            stdout, stderr = proc.communicate(timeout=600)
            err = stderr.decode(errors="replace").strip()
            left = [p.name for p in (trial / "out").iterdir() if p.name.startswith(".")]
            problem = None
            if proc.returncode < 0:
                problem = f"died of signal {-proc.returncode}"
            elif proc.returncode == 0:
                counts["finished (the shrink came after the reads)"] += 1
                if mode == "apply: base":
                    ok = out.read_bytes() == new.read_bytes()
                else:
                    rebuilt = trial / "rebuilt.safetensors"
                    try:
                        apply_patch(old, out, rebuilt, device="cpu")
                        ok = rebuilt.read_bytes() == new.read_bytes()
                    except Exception as exc:  # a patch made of zeros read from a cut file: a finding, not a crash
                        ok = False
                        err = f"its patch does not apply: {exc}"
                if not ok:
                    problem = f"exit 0 with a wrong output {err[-200:]!r}"
            elif proc.returncode == 1:
                counts["refused"] += 1
                if not _one_line(err):
                    problem = f"not one line: {err[-300:]!r}"
                elif "victim.safetensors" not in err:
                    problem = f"the message does not name the file: {err!r}"
                elif out.exists():
                    problem = "an output was left under its real name"
                else:  # what the refusal said, the trial's path and the sizes taken out
                    counts["refused: " + re.sub(r"\d[\d,]*", "N", err.replace(str(trial), "T"))[:100]] += 1
            else:
                problem = f"exit {proc.returncode}: {err[-300:]!r}"
            _note_problem(problems, f"trial {t} (truncated to {keep} of {size} bytes at {at:.3f} s)", problem, left)
            shutil.rmtree(trial, ignore_errors=True)
        results[mode] = {"trials": n, "command_s_median": round(window, 3), "counts": dict(counts),
                         "problems": problems}
        print(f"shrink trials, {mode}: {dict(counts)}; problems: {len(problems)}", flush=True)
    return results


def _one_line(err: str) -> bool:
    """A refusal as users must see it: one line, no traceback."""
    return len(err.splitlines()) == 1 and "Traceback" not in err


def _note_problem(problems: list[str], trial: str, problem: str | None, left: list[str]) -> None:
    """Adds the trial's problem, with any temporaries it left, to `problems` (nothing when neither)."""
    if left:
        problem = (problem + "; " if problem else "") + f"temporaries left: {left}"
    if problem:
        problems.append(f"{trial}: {problem}")


# -- remote trials: a server that fails objects -----------------------------------------


def remote_trials(n: int, root: Path, seed: int = 0) -> dict:
    import importlib.util

    if importlib.util.find_spec("obstore") is None:
        print("remote trials skipped: obstore is not installed (pip install 'pulsediff[remote]')", flush=True)
        return {"skipped": "obstore is not installed"}
    from ckpt_factory import save_series
    from pulsediff.series.publish import publish_once

    steps = 8
    train, pub = root / "train", root / "pub"
    train.mkdir(parents=True, exist_ok=True)
    save_series(train, steps, seed=31, shape=(256, 256), tensors=4, density=0.02)
    publish_once(train, pub, anchor_every=4, settle=0)
    published = {step: (train / f"step_{step:06d}.safetensors").read_bytes() for step in range(steps + 1)}
    rng = random.Random(seed)
    counts, problems = Counter(), []
    from http_faults import FAULTS, FaultServer

    draws = random.Random(seed)
    choices = ("ok", "ok", *FAULTS)  # what one GET of a patch gets: the file a third of the time
    gets = Counter()  # GETs of patches by what they got (the manifest is always served whole)

    def fault_of(path: str) -> str:  # called under the server's lock
        if not path.endswith(".pulsediff"):
            return "ok"
        gets[fault := draws.choice(choices)] += 1
        return fault

    server = FaultServer(root, fault_of)
    try:
        for t in range(n):
            trial = root / f"remote-{t}"
            shutil.rmtree(trial, ignore_errors=True)
            trial.mkdir()
            worker = trial / "worker.safetensors"
            start = rng.choice([None, 0, 1, 3, 5, 7])
            if start is not None:
                worker.write_bytes(published[start])
            before = worker.read_bytes() if worker.exists() else None
            proc = subprocess.run(_cli("catch-up", worker, f"{server.url}/pub", "--cache", trial / "cache", "--json"),
                                  capture_output=True, text=True, timeout=600)
            err = proc.stderr.strip()
            now = worker.read_bytes() if worker.exists() else None
            left = [p.name for p in trial.iterdir() if p.name.startswith(".")]
            problem = None
            if proc.returncode == 0:
                step = json.loads(proc.stdout)["step"]
                counts["reached the newest step" if step == steps else "stopped short, reported"] += 1
                if now != published.get(step):
                    problem = f"exit 0 at step {step}, but the worker is not that step's checkpoint"
            elif proc.returncode in (1, 4):
                stopped = re.search(r"is now at step (\d+) of \d+; stopped: ", err)
                counts["went part of the way, said where (exit 4)" if stopped else "refused"] += 1
                if not _one_line(err):
                    problem = f"not one line: {err[-300:]!r}"
                elif (proc.returncode == 4) != bool(stopped):
                    problem = f"exit {proc.returncode} with: {err[-300:]!r}"
                elif stopped and now != published.get(int(stopped.group(1))):
                    problem = f"says it stopped at step {stopped.group(1)}, but the worker is not that step: {err!r}"
                elif not stopped and now != before:
                    problem = f"refused, but the worker changed: {err[-300:]!r}"
            else:
                problem = f"exit {proc.returncode}: {err[-300:]!r}"
            _note_problem(problems, f"trial {t} (from step {start})", problem, left)
            shutil.rmtree(trial, ignore_errors=True)
    finally:
        server.close()
    faults = {k: v for k, v in gets.items() if k != "ok"}
    result = {"trials": n, "counts": dict(counts), "patch_gets": dict(gets), "faults_served": faults,
              "problems": problems}
    print(f"remote trials: {dict(counts)}; patch GETs {dict(gets)}; problems: {len(problems)}", flush=True)
    return result


# -- main ----------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=100_000)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds one case may take")
    ap.add_argument("--mem-gib", type=float, default=2.0, help="RLIMIT_AS of each worker")
    ap.add_argument("--numba-threads", type=int, default=1, help="NUMBA_NUM_THREADS of each worker")
    ap.add_argument("--kill-trials", type=int, default=50, help="per kind of apply; 0 to skip")
    ap.add_argument("--shrink-trials", type=int, default=30, help="per input truncated while read; 0 to skip")
    ap.add_argument("--remote-trials", type=int, default=30, help="catch-ups from a failing server; 0 to skip")
    ap.add_argument("--kinds", nargs="*", help="only these case kinds")
    ap.add_argument("--seed-offset", type=int, default=0)
    ap.add_argument("--root", type=Path, help="where the corpus and the workers' folders go (default: a temp dir)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--replay", nargs=2, metavar=("KIND", "SEED"), help="run one case here, with its traceback")
    args = ap.parse_args()

    root = args.root or Path(tempfile.mkdtemp(prefix="pulsediff-fuzz-"))
    import fuzz_cases as fc

    t = time.monotonic()
    corpus = fc.build_corpus(root / "corpus", big_bombs=True)
    print(f"corpus in {time.monotonic() - t:.1f} s at {root}", flush=True)
    if args.replay:
        fc.TRACEBACKS = True
        print(fc.run_case(args.replay[0], int(args.replay[1]), corpus, root / "replay"))
        return
    fingerprint = fc.snapshot(corpus.root)
    report = {"machine": machine_line(tools=False), "workers": args.workers, "timeout_s": args.timeout, "mem_gib": args.mem_gib,
              "numba_threads": args.numba_threads}
    if args.cases:
        report.update(run_cases(args, corpus.root, root / "work"))
        report["corpus_unchanged"] = fc.snapshot(corpus.root) == fingerprint
    if args.kill_trials:
        t = time.monotonic()
        report["kill_trials"] = kill_trials(args.kill_trials, root / "kill")
        report["kill_trials_wall_s"] = time.monotonic() - t
    if args.shrink_trials:
        t = time.monotonic()
        report["shrink_trials"] = shrink_trials(args.shrink_trials, root / "shrink")
        report["shrink_trials_wall_s"] = time.monotonic() - t
    if args.remote_trials:
        t = time.monotonic()
        report["remote_trials"] = remote_trials(args.remote_trials, root / "remote")
        report["remote_trials_wall_s"] = time.monotonic() - t
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    if args.root is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
