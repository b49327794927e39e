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
    digest, message = case[rank]
    verdict = agree(Outcome(rank, message is None, digest or "", message or ""), groups)
    results.append([verdict.refusal, verdict.speaks])
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
    got = run_ranks(tp, pp, [good, one_failed, two_steps, good], tmp_path)
    last = world - 1
    for rank, results in enumerate(got):
        refusals, speaks = [r[0] for r in results], [r[1] for r in results]
        assert speaks == [rank == last] * 4  # the last rank alone reports (agreement.py: "One rank raises")
        assert refusals[0] is None and refusals[3] is None  # every rank goes on, before and after the refusals
        if rank == last:
            assert refusals[1] == "tensor 'w' is not the patch's base"
        else:  # every other rank, across both kinds of group, hears of the failure
            assert refusals[1] == (f"rank {last} of this engine failed (tensor 'w' is not the patch's base), "
                                   "so no rank took the update")
        assert "different checkpoints" in refusals[2] and D1 in refusals[2] and D2 in refusals[2]
