"""The RL loop's soak: examples/rl_loop.py for hundreds of steps, both faults, and its table.

    python scripts/soak_rl.py [--steps 300] [--check-every 25] [--work DIR]   # needs vLLM (.venv-vllm)

Runs the loop (a trainer stepping by GRPO, a vLLM engine kept current by pulsediff's backend with each
update prepared ahead, a file worker on `catch-up --watch --trust`, a signed series) with --faults, then
prints what docs/BENCHMARKS.md records: per-step medians and worst steps of patch bytes, bits per changed
element, the update's pause and preparation, the engine worker's resident memory and the trainer's step;
the same steps' bytes in TRL's wire format re-created (sparse int32 indices and BF16 values in safetensors
under zstd) and its receiver's rebuild; the worker's memory after step 50 against its level at step 50; and
whether every check held. Exit 1 if a check failed or the memory grew by more than 5%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from benchlib import machine_line, markdown  # noqa: E402

LOOP = Path(__file__).parent.parent / "examples" / "rl_loop.py"
MEMORY_FROM, MEMORY_SLACK = 50, 0.05


def summary(records: list[dict]) -> tuple[str, list[str]]:
    """The markdown table of the records, and the lines that say what failed (none when all held)."""
    def column(key: str, scale: float = 1.0) -> list[float]:
        return [r[key] * scale for r in records if key in r]

    bits = [8 * r["patch_bytes"] / r["changes"] for r in records if "patch_bytes" in r and r["changes"]]
    trl_bits = [8 * r["trl_bytes"] / r["changes"] for r in records if r["changes"]]
    rows = []
    for label, values, worst in (
            ("pulsediff patch, bytes (one step)", column("patch_bytes"), max),
            ("pulsediff patch, bits per changed element", bits, max),
            ("TRL's format re-created, bytes", column("trl_bytes"), max),
            ("TRL's format re-created, bits per changed element", trl_bits, max),
            ("changed elements, % of all", [100 * r["changes"] / r["elements"] for r in records], max),
            ("engine pause per update, ms (prepared ahead)", column("pause_s", 1e3), max),
            ("preparation beside the rollouts, ms", column("prepare_s", 1e3), max),
            ("TRL's format: receiver's rebuild, ms (before its load)", column("trl_decode_s", 1e3), max),
            ("rollouts, ms", column("rollout_s", 1e3), max),
            ("trainer step, ms", column("train_s", 1e3), max),
            ("engine worker resident memory, MiB", column("worker_rss_kib", 1 / 1024), max)):
        if values:
            rows.append([label, round(statistics.median(values), 2), round(worst(values), 2), len(values)])
    table = markdown(["per step", "median", "worst", "steps"], rows)
    failed = []
    at = {r["step"]: r["worker_rss_kib"] for r in records if "worker_rss_kib" in r}
    if MEMORY_FROM in at:
        base, top = at[MEMORY_FROM], max(v for s, v in at.items() if s >= MEMORY_FROM)
        table += (f"\n\nengine worker memory after step {MEMORY_FROM}: at most {top / 1024:.1f} MiB against "
                  f"{base / 1024:.1f} MiB at step {MEMORY_FROM} ({100 * (top - base) / base:+.2f}%)")
        if top > base * (1 + MEMORY_SLACK):
            failed.append(f"the worker's memory grew {100 * (top - base) / base:.1f}% after step {MEMORY_FROM}")
    checks = [r["checked"] for r in records if "checked" in r]
    table += f"\nchecks against a fresh engine and the trainer's digest: {sum(checks)} of {len(checks)} equal"
    if not all(checks):
        failed.append("a check against a fresh engine or the trainer's digest differed")
    return table, failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--check-every", type=int, default=25)
    parser.add_argument("--work", type=Path, help="a new folder for the run (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp) / "soak"
        record = Path(tmp) / "steps.jsonl"
        proc = subprocess.run([sys.executable, str(LOOP), str(work), "--steps", str(args.steps), "--check-every",
                               str(args.check_every), "--faults", "--record", str(record)], capture_output=True,
                              text=True)
        said = [line for line in proc.stdout.splitlines() if " stays at " in line or "publisher" in line
                or "broken" in line or "restored" in line or "file worker" in line or "FAILED" in line]
        records = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    print(machine_line(tools=False))
    print(f"{args.steps} steps, a check every {args.check_every}; loop exit {proc.returncode}\n")
    table, failed = summary(records)
    print(table)
    print("\nwhat the loop said of the faults:\n" + "\n".join(f"    {line}" for line in said))
    if proc.returncode:
        print(proc.stdout[-3000:] + proc.stderr[-3000:], file=sys.stderr)
    for line in failed:
        print(f"FAILED {line}")
    return 1 if failed or proc.returncode else 0


if __name__ == "__main__":
    sys.exit(main())
