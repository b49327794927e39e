"""All of an engine's ranks take an update, or none does.

With tensor or pipeline parallelism every worker process keeps its own host state and verifies the
update for itself. A failure on one rank alone (a download error, a file it cannot read, a step
published between two ranks' reads of the manifest) must not leave the ranks at different steps: a
model whose shards come from two checkpoints computes garbage, and nothing says so. So each rank
stages its update (HostState.advance(stage=True)), the ranks exchange what they reached, and they
load only if every rank verified the same target; otherwise each takes its stage back and all of
them refuse the update.

The exchange is one all-gather of a fixed-size record per rank over each of the engine's CPU
(gloo) process groups in turn: tensor-parallel, context-parallel, pipeline-parallel, so that every
rank of the model replica sees every other's record (a data-parallel replica is an engine of its
own, at its own step). Every rank must reach it: a rank that never does (vLLM refused its request
before pulsediff saw it: a per-rank list of requests too short for it) leaves the others waiting on
the group until gloo's timeout, as any collective would.

One rank raises. vLLM's multiprocess executor (0.32; vllm-project/vllm issue 49972, open) reads
the workers' replies to a call in rank order and stops at the first failure: the later ranks'
replies stay queued, and every later call then reads the reply to the one before. So when the
ranks refuse together, only the last rank raises (its line names the rank that failed); the others
close their update session as vLLM closes a failed one, and return (engines/vllm.py).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

__all__ = ["Outcome", "Verdict", "agree", "exchange", "refusal"]

RECORD_BYTES = 512
_HEAD = struct.Struct("<IB96s")  # global rank, verified (0/1), target digest (ASCII, zero-padded)
_MESSAGE_BYTES = RECORD_BYTES - _HEAD.size


@dataclass(frozen=True)
class Outcome:
    """One rank's result of verifying and staging an update."""

    rank: int
    ok: bool
    digest: str  # the target reached ("" where it failed)
    message: str = ""  # why it failed

    def encode(self) -> bytes:
        digest = self.digest.encode("ascii", "replace")[:96]
        message = " ".join(self.message.split()).encode("utf-8", "replace")[:_MESSAGE_BYTES]  # one line
        return (_HEAD.pack(self.rank, int(self.ok), digest) + message).ljust(RECORD_BYTES, b"\0")

    @classmethod
    def decode(cls, raw: bytes) -> "Outcome":
        rank, ok, digest = _HEAD.unpack_from(raw)
        message = raw[_HEAD.size:].rstrip(b"\0").decode("utf-8", "replace")
        return cls(rank, bool(ok), digest.rstrip(b"\0").decode("ascii", "replace"), message)


def exchange(record: bytes, groups: list) -> list[bytes]:
    """Every rank's record, on every rank: an all-gather over each group in turn (torch.distributed
    process groups that run on CPU tensors; groups of one rank are passed over)."""
    import torch
    import torch.distributed as dist

    records = [record]
    for group in groups:
        size = dist.get_world_size(group)
        if size == 1:
            continue
        mine = torch.frombuffer(bytearray(b"".join(records)), dtype=torch.uint8)
        parts = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(parts, mine, group=group)
        width = len(record)
        records = [bytes(part[i * width:(i + 1) * width].numpy()) for part in parts for i in range(len(records))]
    return records


PREPARE = "prepare"  # the target a rank asked only to prepare reports: never an update's digest


@dataclass(frozen=True)
class Verdict:
    refusal: str | None  # why no rank may go on (one line); None: every rank may
    speaks: bool  # whether this rank reports it: the last rank (module docstring, "One rank raises")


def refusal(mine: Outcome, outcomes: list[Outcome], consequence: str) -> str | None:
    """Why this rank must not go on (one line), or None where every rank reached the same target.
    `consequence` ends the line that names another rank's failure."""
    if not mine.ok:
        return mine.message
    failed = sorted((o for o in outcomes if not o.ok), key=lambda o: o.rank)
    if failed:
        return f"rank {failed[0].rank} of this engine failed ({failed[0].message}), {consequence}"
    reached = {}
    for o in sorted(outcomes, key=lambda o: o.rank):
        reached.setdefault(o.digest, o.rank)
    if len(reached) > 1 and PREPARE in reached:
        return ("the engine's ranks were not all asked the same: some to prepare an update, others to take "
                f"one, {consequence}")
    if len(reached) > 1:
        seen = ", ".join(f"rank {rank}: {digest}" for digest, rank in reached.items())
        return (f"the engine's ranks reached different checkpoints ({seen}); was a step published during the "
                f"update? Name the step to update to")
    return None


def agree(mine: Outcome, groups: list, consequence: str = "so no rank took the update") -> Verdict:
    """`refusal` over the outcomes of every rank of the model replica (exchanged over `groups`)."""
    outcomes = [mine] if not groups else [Outcome.decode(raw) for raw in exchange(mine.encode(), groups)]
    return Verdict(refusal(mine, outcomes, consequence), mine.rank == max(o.rank for o in outcomes))
