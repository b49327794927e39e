"""All of an engine's ranks take an update, or none does.

With tensor or pipeline parallelism every worker process verifies the update against its host state,
or follows the rank that owns the host state it shares (below). A failure on one rank alone (a
download error, a file it cannot read, a step published between two ranks' reads of the manifest)
must not leave the ranks at different steps: a model whose shards come from two checkpoints
computes garbage, and nothing says so. So each rank that decodes stages its update
(HostState.advance(stage=True)), the ranks exchange what they reached, and they load only if every
rank verified the same target; otherwise each stage is taken back and all of them refuse the update.

The exchange is one all-gather of a fixed-size record per rank over each of the engine's CPU
(gloo) process groups in turn: tensor-parallel, context-parallel, pipeline-parallel, so that every
rank of the model replica sees every other's record (a data-parallel replica is an engine of its
own, at its own step). Every rank must reach it: a rank that never does (vLLM refused its request
before pulsediff saw it: a per-rank list of requests too short for it) leaves the others waiting on
the group until gloo's timeout, as any collective would.

Ranks that share one host state (engines/shared_state.py: one copy per machine) verify once: the owner
decodes the update and reports what it reached; a follower reports only which state it follows and what
it was asked, and counts as having reached what its owner did, where they were asked the same update
(a follower whose owner is not among the ranks, or was asked another update, refuses for all).

One rank raises. vLLM's multiprocess executor (0.32; vllm-project/vllm issue 49972, open) reads
the workers' replies to a call in rank order and stops at the first failure: the later ranks'
replies stay queued, and every later call then reads the reply to the one before. So when the
ranks refuse together, only the last rank raises (its line names the rank that failed); the others
close their update session as vLLM closes a failed one, and return (engines/vllm.py).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

__all__ = ["Outcome", "Verdict", "agree", "exchange", "refusal"]

RECORD_BYTES = 1024
# global rank, verified, follows, applied, prepared, reloaded (0/1 each), target digest (ASCII, zero-padded), shared
# state id (0: a private state), the owner's pid, its changes' fd (-1: none), the step reached (-1: none),
# the request's hash, what was asked (UTF-8, one line, cut to fit)
_HEAD = struct.Struct("<IBBBBB96sQIiq16s128s")
_MESSAGE_BYTES = RECORD_BYTES - _HEAD.size


@dataclass(frozen=True)
class Outcome:
    """One rank's result of verifying and staging an update."""

    rank: int
    ok: bool
    digest: str  # the target reached ("" where it failed; a follower's: its owner's, PREPARE or "")
    message: str = ""  # why it failed
    state: int = 0  # the shared host state this rank owns or follows (0: its own, private)
    follows: bool = False  # whether this rank follows the state's owner (verified nothing itself)
    applied: bool = False  # whether the update changed the state (an owner's or a private rank's)
    prepared: bool = False  # whether it went on from a preparation
    reloaded: bool = False  # (after a load) whether this rank's load handed vLLM's reload the host tensors
    pid: int = 0  # an owner's process: where its followers open its changes
    changes_fd: int = -1  # an owner's fd of the update's changes (shared_state.publish_changes), -1: none
    step: int | None = None  # the series' step reached (an owner's, for its followers' log)
    request: bytes = bytes(16)  # a hash of what this rank was asked (16 bytes)
    asked: str = ""  # what this rank was asked, for a message

    def encode(self) -> bytes:
        digest = self.digest.encode("ascii", "replace")[:96]
        asked = _line(self.asked, 128)
        message = _line(self.message, _MESSAGE_BYTES)
        return (_HEAD.pack(self.rank, int(self.ok), int(self.follows), int(self.applied), int(self.prepared),
                           int(self.reloaded), digest,
                           self.state, self.pid, self.changes_fd, -1 if self.step is None else self.step,
                           self.request[:16].ljust(16, b"\0"), asked)
                + message).ljust(RECORD_BYTES, b"\0")

    @classmethod
    def decode(cls, raw: bytes) -> "Outcome":
        (rank, ok, follows, applied, prepared, reloaded, digest, state, pid, changes_fd, step, request,
         asked) = _HEAD.unpack_from(raw)
        return cls(rank, bool(ok), digest.rstrip(b"\0").decode("ascii", "replace"), _text(raw[_HEAD.size:]),
                   state, bool(follows), bool(applied), bool(prepared), bool(reloaded), pid, changes_fd,
                   None if step < 0 else step, request.ljust(16, b"\0"), _text(asked))


def _line(text: str, limit: int) -> bytes:
    return " ".join(text.split()).encode("utf-8", "replace")[:limit]  # one line, cut to fit


def _text(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode("utf-8", "replace")


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
    owner: Outcome | None = None  # a follower's: its owner's outcome (what it reached, where its changes are)
    outcomes: tuple = field(default=(), compare=False)  # every rank's, in rank order


def refusal(mine: Outcome, outcomes: list[Outcome], consequence: str) -> str | None:
    """Why this rank must not go on (one line), or None where every rank reached the same target.
    `consequence` ends the line that names another rank's failure."""
    if not mine.ok:
        return mine.message
    outcomes = sorted(outcomes, key=lambda o: o.rank)
    if len({o.digest == PREPARE for o in outcomes if o.ok}) > 1:
        return ("the engine's ranks were not all asked the same: some to prepare an update, others to take "
                f"one, {consequence}")
    owners: dict = {}
    for o in outcomes:
        if o.state and not o.follows and owners.setdefault(o.state, o) is not o:
            return (f"ranks {owners[o.state].rank} and {o.rank} both own one shared host state (set "
                    f"PULSEDIFF_VLLM_SHARE_HOST_STATE=0), {consequence}")
    for o in outcomes:  # what one state's ranks were asked first: that is why their verdicts differ
        owner = owners.get(o.state)
        if o.follows and owner is None:
            return (f"rank {o.rank} follows a shared host state that no rank of this engine holds (set "
                    f"PULSEDIFF_VLLM_SHARE_HOST_STATE=0 where engines on one machine were started alike), {consequence}")
        # (`asked` is empty only where a request did not parse: that rank's own line says why)
        if o.follows and o.request != owner.request and o.asked and owner.asked:
            hint = " (their keys, force or the operator's settings differ)" if o.asked == owner.asked else ""
            return (f"the engine's ranks were asked different updates (rank {owner.rank}: {owner.asked}; rank "
                    f"{o.rank}: {o.asked}){hint}, {consequence}")
    failed = [o for o in outcomes if not o.ok]
    if failed:
        return f"rank {failed[0].rank} of this engine failed ({failed[0].message}), {consequence}"
    reached = {}
    for o in outcomes:
        reached.setdefault(owners[o.state].digest if o.follows else o.digest, o.rank)
    if len(reached) > 1:
        seen = ", ".join(f"rank {rank}: {digest}" for digest, rank in reached.items())
        return (f"the engine's ranks reached different checkpoints ({seen}); was a step published during the "
                f"update? Name the step to update to")
    return None


def agree(mine: Outcome, groups: list, consequence: str = "so no rank took the update") -> Verdict:
    """`refusal` over the outcomes of every rank of the model replica (exchanged over `groups`)."""
    outcomes = [mine] if not groups else [Outcome.decode(raw) for raw in exchange(mine.encode(), groups)]
    owner = next((o for o in outcomes if mine.follows and o.state == mine.state and not o.follows), None)
    return Verdict(refusal(mine, outcomes, consequence), mine.rank == max(o.rank for o in outcomes), owner,
                   tuple(sorted(outcomes, key=lambda o: o.rank)))
