"""engines/agreement.py: an engine's ranks take an update only if every one verified the same target.

The exchange runs for real: worker processes joined by torch.distributed's gloo backend on 127.0.0.1, in
vLLM's layout (tensor-parallel groups, then pipeline-parallel ones). No vLLM needed
(tests/test_vllm_engine.py runs the backend's agreement in a 2-rank engine).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pulsediff.engines.agreement import PREPARE, RECORD_BYTES, Outcome, Verdict, agree, refusal

D1, D2 = "xxh3tree:" + "1" * 32, "xxh3tree:" + "2" * 32


def test_records_round_trip_and_keep_their_size():
    for o in (Outcome(0, True, D1), Outcome(7, False, "", "patch p is corrupt: ü" + "x" * 2000),
              Outcome(2**32 - 1, False, "", "")):
        raw = o.encode()
        assert len(raw) == RECORD_BYTES
        back = Outcome.decode(raw)
        assert (back.rank, back.ok, back.digest) == (o.rank, o.ok, o.digest)
        assert o.message.startswith(back.message.rstrip("\ufffd"))  # cut to fit, never longer
    # A peer's message reaches the others as one line.
    assert Outcome.decode(Outcome(1, False, "", "a\nb\r\n  c").encode()).message == "a b c"


def test_refusal_rules():
    ok0, ok1 = Outcome(0, True, D1), Outcome(1, True, D1)
    then = "so no rank took the update"
    assert refusal(ok0, [ok0, ok1], then) is None
    bad1 = Outcome(1, False, "", "no step 99 in the series")
    assert refusal(bad1, [ok0, bad1], then) == "no step 99 in the series"  # its own line
    says = refusal(ok0, [ok0, bad1], then)
    assert says == "rank 1 of this engine failed (no step 99 in the series), so no rank took the update"
    bad0 = Outcome(0, False, "", "download failed")  # the first failing rank is named
    assert refusal(ok1, [bad1, ok1, bad0], then).startswith("rank 0 of this engine failed (download failed)")
    other = Outcome(1, True, D2)
    says = refusal(ok0, [ok0, other], then)
    assert D1 in says and D2 in says and "different checkpoints" in says
    # Ranks asked to prepare (engines/vllm.py) agree among themselves, never with a rank asked to update.
    p0, p1 = Outcome(0, True, PREPARE), Outcome(1, True, PREPARE)
    assert refusal(p0, [p0, p1], then) is None
    assert "some to prepare an update, others to take one" in refusal(p0, [p0, ok1], then)
    assert "some to prepare an update, others to take one" in refusal(ok1, [p0, ok1], then)


def test_ranks_that_share_a_host_state_take_their_owners_verdict():
    from dataclasses import replace

    then = "so no rank took the update"
    asked1, asked2 = (b"1" * 16, "step 1 of /s"), (b"2" * 16, "step 2 of /s")
    owner = Outcome(0, True, D1, state=7, applied=True, prepared=True, pid=4321, changes_fd=9, step=3,
                    request=asked1[0], asked=asked1[1])
    follower = Outcome(1, True, "", state=7, follows=True, request=asked1[0], asked=asked1[1])
    assert Outcome.decode(owner.encode()) == owner and Outcome.decode(follower.encode()) == follower
    assert refusal(follower, [owner, follower], then) is None and refusal(owner, [owner, follower], then) is None
    # A follower counts as having reached its owner's target: a private rank at another one differs.
    says = refusal(follower, [owner, follower, Outcome(2, True, D2)], then)
    assert "different checkpoints" in says and D1 in says and D2 in says
    assert refusal(follower, [owner, follower, Outcome(2, True, D1)], then) is None
    # Asked another update than its owner: refused on every rank, both requests named.
    other = replace(follower, request=asked2[0], asked=asked2[1])
    for mine in (owner, other):
        says = refusal(mine, [owner, other], then)
        assert says == f"the engine's ranks were asked different updates (rank 0: {asked1[1]}; rank 1: {asked2[1]}), {then}"
    # Asked the same in words but not in full (keys, force, the operator's settings): said so.
    same_words = replace(follower, request=asked2[0])
    assert "(their keys, force or the operator's settings differ)" in refusal(owner, [owner, same_words], then)
    # Two ranks that both own one state (not reached: one lock) are refused, not guessed between.
    assert "both own one shared host state" in refusal(owner, [owner, replace(owner, rank=1)], then)
    # Its owner failed: named as that rank's failure.
    failed = Outcome(0, False, "", "download failed", state=7, request=asked1[0], asked=asked1[1])
    assert refusal(follower, [failed, follower], then) == f"rank 0 of this engine failed (download failed), {then}"
    # A state no rank of the engine owns (two engines met at one rendezvous): refused, never followed.
    stray = replace(follower, state=8)
    assert "no rank of this engine holds" in refusal(owner, [owner, stray], then)
    assert "no rank of this engine holds" in refusal(stray, [owner, stray], then)
    # A follower's own failure (a malformed request) is its own line, and the owner's is named to it.
    own = Outcome(1, False, "", "'source' must be a string", state=7, follows=True)
    assert refusal(own, [owner, own], then) == "'source' must be a string"
    assert refusal(owner, [owner, own], then).startswith("rank 1 of this engine failed ('source' must be")
    # Preparations: a follower asked to prepare reports PREPARE; a mix with an update is refused.
    p0, p1 = replace(owner, digest=PREPARE), replace(follower, digest=PREPARE)
    assert refusal(p1, [p0, p1], then) is None
    assert "some to prepare an update" in refusal(p0, [p0, follower], then)
    # agree() hands a follower its owner's record (what it reached, where its changes are).
    assert agree(follower, []).owner is None  # alone: no owner among the outcomes


def test_one_rank_alone_decides_and_reports_for_itself():
    assert agree(Outcome(0, True, D1), []) == Verdict(None, True)
    assert agree(Outcome(0, False, "", "bad"), []) == Verdict("bad", True)


WORKER = r"""
import json, sys
from datetime import timedelta
import torch.distributed as dist
from pulsediff.engines.agreement import Outcome, agree

port, rank, tp, pp, plan = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
world = tp * pp
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                        timeout=timedelta(seconds=60))
# vLLM's layout: ranks [p*tp, (p+1)*tp) form a tensor-parallel group, ranks p, p+tp, ... a pipeline one.
# Every process creates every group, in the same order.
tp_groups = [dist.new_group(list(range(p * tp, (p + 1) * tp))) for p in range(pp)]
pp_groups = [dist.new_group(list(range(t, world, tp))) for t in range(tp)]
groups = [g for g, size in ((tp_groups[rank // tp], tp), (pp_groups[rank % tp], pp)) if size > 1]
results = []
for case in plan:
    digest, message, *shared = case[rank]
    state, follows = shared or (0, False)  # a shared host state's id, and whether this rank follows its owner
    verdict = agree(Outcome(rank, message is None, digest or "", message or "", state=state, follows=follows,
                            pid=1000 + rank, changes_fd=rank), groups)
    results.append([verdict.refusal, verdict.speaks, verdict.owner and [verdict.owner.pid, verdict.owner.changes_fd]])
print(json.dumps(results))
dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(tp: int, pp: int, plan: list, tmp_path: Path) -> list[list]:
    """Each case of `plan` gives every rank its (digest, failure message or None); returns per rank the
    refusal each case gave it."""
    script = tmp_path / "rank.py"
    script.write_text(WORKER)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(script), str(port), str(rank), str(tp), str(pp), json.dumps(plan)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(tp * pp)]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=240)
        assert proc.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2)])
def test_ranks_agree_over_gloo(tp, pp, tmp_path):
    world = tp * pp
    good = [(D1, None)] * world
    one_failed = [(D1, None)] * (world - 1) + [("", "tensor 'w' is not the patch's base")]
    two_steps = [(D1, None)] * (world - 1) + [(D2, None)]
    # Pairs of ranks share a host state (one per machine, two machines under pp 2): the first of each owns it.
    shared = [(D1, None, 7 + r // 2, False) if r % 2 == 0 else ("", None, 7 + r // 2, True) for r in range(world)]
    got = run_ranks(tp, pp, [good, one_failed, two_steps, good, shared], tmp_path)
    last = world - 1
    for rank, results in enumerate(got):
        refusals, speaks = [r[0] for r in results], [r[1] for r in results]
        assert speaks == [rank == last] * 5  # the last rank alone reports (agreement.py: "One rank raises")
        assert refusals[4] is None  # followers reached what their owners did
        owner = rank - 1  # a follower hears where its owner's changes are; an owner follows none
        assert results[4][2] == ([1000 + owner, owner] if rank % 2 else None)
        assert refusals[0] is None and refusals[3] is None  # every rank goes on, before and after the refusals
        if rank == last:
            assert refusals[1] == "tensor 'w' is not the patch's base"
        else:  # every other rank, across both kinds of group, hears of the failure
            assert refusals[1] == (f"rank {last} of this engine failed (tensor 'w' is not the patch's base), "
                                   "so no rank took the update")
        assert "different checkpoints" in refusals[2] and D1 in refusals[2] and D2 in refusals[2]
