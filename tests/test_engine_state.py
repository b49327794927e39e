"""engines/state.py, the engine-independent half of the vLLM backend: the host state moves along a
series or through a patch file bit for bit, reports exactly the positions it wrote, and refuses
every bad input before it writes anything. No vLLM needed (tests/test_vllm_engine.py has the
engine itself)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine_series import make_series, publish
from pulsediff.engines.state import load_host_state, parse_update_request
from pulsediff.errors import PulsediffError, UsageError

STEPS = 3


@pytest.fixture(scope="module")
def series(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-series")
    train = make_series("qwen2", root, STEPS)
    return train, publish(train, root / "outbox", "--anchor-every", "2")


def step_tensors(train: Path, step: int) -> dict:
    return load_file(str(train / f"step_{step:06d}" / "model.safetensors"))


def bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).reshape(-1).numpy()


def assert_at(state, train: Path, step: int) -> None:
    want = step_tensors(train, step)
    assert set(state.tensors) == set(want)
    for name, t in want.items():
        assert np.array_equal(bits(state.tensors[name]), bits(t)), name


def snapshot(state) -> tuple[str, dict]:
    return state.digest, {n: bits(t).copy() for n, t in state.tensors.items()}


def assert_unchanged(state, before) -> None:
    digest, tensors = before
    assert state.digest == digest
    for name, b in tensors.items():
        assert np.array_equal(bits(state.tensors[name]), b), name


def test_loads_the_folder_with_the_digest_patches_record(series):
    from pulsediff.ops.inspect import checkpoint_digest_of

    train, _ = series
    state = load_host_state(train / "step_000000")
    assert state.digest == checkpoint_digest_of(train / "step_000000")
    assert_at(state, train, 0)
    assert state.nbytes == sum(t.numel() * 2 for t in step_tensors(train, 0).values())


def test_moves_along_the_series_and_reports_exactly_the_positions_it_wrote(series):
    train, outbox = series
    state = load_host_state(train / "step_000000")
    at = 0
    for step, target in ((1, 1), (None, STEPS)):  # an explicit step, then the newest
        before = {n: bits(t).copy() for n, t in state.tensors.items()}
        advance = state.advance(str(outbox), step)
        assert (advance.status, advance.step, state.step) == ("applied", target, target)
        assert_at(state, train, target)
        for name, b in before.items():
            # The reference: every element that differs now was written, and nothing was written that no
            # step on the way changed (a chain writes an element a step changed even if a later one undid it).
            net = np.flatnonzero(b != bits(state.tensors[name]))
            stepwise = np.unique(np.concatenate([
                np.flatnonzero(bits(step_tensors(train, k)[name]) != bits(step_tensors(train, k + 1)[name]))
                for k in range(at, target)]))
            written = advance.changes.get(name, np.empty(0, np.int64))
            assert written is None or (np.isin(net, written).all() and np.isin(written, stepwise).all()), name
            assert written is None or np.unique(written).size == written.size, name  # each position once
        at = target
    again = state.advance(str(outbox / "manifest.json"))  # the manifest's path names its series too
    assert (again.status, again.step, again.changes) == ("up-to-date", STEPS, {})


def test_a_lone_patch_file(series):
    train, outbox = series
    state = load_host_state(train / "step_000001")
    advance = state.advance(str(outbox / "patch-00000001-00000002.pulsediff"))
    assert (advance.status, advance.step) == ("applied", None)
    assert_at(state, train, 2)


def test_a_step_older_than_the_state_goes_back_through_an_anchor(series):
    train, outbox = series
    state = load_host_state(train / f"step_{STEPS:06d}")
    advance = state.advance(str(outbox), 2)
    assert advance.step == 2
    assert_at(state, train, 2)


@pytest.mark.parametrize("how", ["series chain", "back through an anchor", "lone patch"])
def test_a_staged_update_is_taken_back_exactly_or_kept(series, how):
    """advance(stage=True) then revert(): tensors, digest, step and kept word sums as they were (the
    vLLM backend's ranks take back an update another rank refused); then commit() keeps one."""
    train, outbox = series
    start, source, step, target = {"series chain": (1, str(outbox), None, STEPS),
                                   "back through an anchor": (STEPS, str(outbox), 2, 2),
                                   "lone patch": (1, str(outbox / "patch-00000001-00000002.pulsediff"), None, 2)}[how]
    state = load_host_state(train / "step_000000")
    state.advance(str(outbox), start)  # a step, and the word sums it kept
    assert state.step == start and state.sums
    before, fields = snapshot(state), (state.step, dict(state.sums))
    advance = state.advance(source, step, stage=True)
    assert advance.status == "applied" and state.staged is not None
    assert_at(state, train, target)
    with pytest.raises(RuntimeError, match="staged"):  # one stage at a time
        state.advance(source, step)
    state.revert()
    assert_unchanged(state, before)
    assert (state.step, state.sums, state.staged) == (*fields, None)
    state.revert()  # nothing staged: nothing to do
    assert_unchanged(state, before)
    # The state goes on from where it was, by its kept sums, and a committed stage stays.
    state.advance(source, step, stage=True)
    state.commit()
    assert_at(state, train, target)
    assert state.staged is None
    state.revert()
    assert_at(state, train, target)


@pytest.mark.parametrize("stage", [False, True])
def test_a_failure_after_the_tensors_were_written_puts_them_back(series, monkeypatch, stage):
    """The catch-up's housekeeping runs after the apply: an unexpected failure there leaves the host
    state as it was (tensors, digest, step, kept sums), not written with its old digest."""
    from pulsediff.series import store

    train, outbox = series
    state = load_host_state(train / "step_000000")
    state.advance(str(outbox), 1)
    before, fields = snapshot(state), (state.step, dict(state.sums))

    def broken(self, names, listed):
        raise RuntimeError("housekeeping broke")

    monkeypatch.setattr(store.Store, "forget", broken)
    with pytest.raises(RuntimeError, match="housekeeping broke"):
        state.advance(str(outbox), STEPS, stage=stage)
    assert_unchanged(state, before)
    assert (state.step, state.sums, state.staged) == (*fields, None)
    monkeypatch.undo()
    state.advance(str(outbox), STEPS)
    assert_at(state, train, STEPS)


def test_a_refused_staged_update_leaves_nothing_staged(series, tmp_path):
    train, outbox = series
    state = load_host_state(train / "step_000000")
    before = snapshot(state)
    with pytest.raises(PulsediffError):
        state.advance(str(outbox), 99, stage=True)
    assert state.staged is None
    assert_unchanged(state, before)
    state.advance(str(outbox), 1, stage=True)  # not blocked by the refused one
    state.commit()
    assert_at(state, train, 1)


def test_a_prepared_update_is_taken_by_the_next_advance_of_its_source(series):
    """prepare() does the work on a thread of its own and touches nothing an engine sees until the next
    advance of the same source takes it: that advance returns the same result as one made without it
    (target, changes, links), staged back to where the state stood before the preparation."""
    train, outbox = series
    plain = load_host_state(train / "step_000000")
    direct = plain.advance(str(outbox), 2)
    state = load_host_state(train / "step_000000")
    before, fields = snapshot(state), (state.step, dict(state.sums))
    assert state.prepare(str(outbox), 2)
    state.settle()
    assert state.prepare_error == "" and state.prepared is not None and not state.preparing
    assert state.prepare_seconds > 0
    assert_at(state, train, 2)  # prepared in the host state, and held staged
    advance = state.advance(str(outbox), 2, stage=True)
    assert (advance.status, advance.step, advance.digest, advance.links, advance.prepared) == (
        "applied", 2, direct.digest, direct.links, True)
    assert not direct.prepared
    assert advance.changes.keys() == direct.changes.keys()
    for name, positions in direct.changes.items():
        assert np.array_equal(np.sort(advance.changes[name]), np.sort(positions)), name
    assert state.prepared is None
    state.revert()  # a refused verdict takes back the preparation too: back to where the engine is
    assert_unchanged(state, before)
    assert (state.step, state.sums, state.staged) == (*fields, None)


def test_an_advance_goes_on_from_a_preparation_and_reports_every_position_of_both(series):
    """Prepared to step 1, asked for the newest: the advance goes on from step 1, and its changes are
    those of both legs (what an engine still at step 0 must load)."""
    train, outbox = series
    state = load_host_state(train / "step_000000")
    assert state.prepare(str(outbox), 1)
    advance = state.advance(str(outbox))  # waits for the preparation, then the rest of the way
    assert (advance.status, advance.step, state.step, state.staged) == ("applied", STEPS, STEPS, None)
    assert_at(state, train, STEPS)
    for name in advance.changes:
        written = advance.changes[name]
        net = np.flatnonzero(bits(step_tensors(train, 0)[name]) != bits(state.tensors[name]))
        assert written is None or (np.isin(net, written).all() and np.unique(written).size == written.size), name
    # Every changed tensor is there: none is left out because only the first leg wrote it.
    changed = {n for n, t in step_tensors(train, 0).items()
               if not np.array_equal(bits(t), bits(state.tensors[n]))}
    assert changed <= set(advance.changes)


def test_a_preparation_of_another_source_is_taken_back_first(series):
    train, outbox = series
    state = load_host_state(train / "step_000001")
    assert state.prepare(str(outbox / "patch-00000001-00000002.pulsediff"))
    advance = state.advance(str(outbox), 1)  # the series, at the step the state stood at before
    assert (advance.status, advance.step, advance.changes, advance.prepared) == ("up-to-date", 1, {}, False)
    assert_at(state, train, 1)
    assert state.staged is None and state.prepared is None


def test_a_failed_preparation_changes_nothing_and_says_why(series):
    train, outbox = series
    state = load_host_state(train / "step_000000")
    before = snapshot(state)
    assert state.prepare(str(outbox), 99)
    wait_for_preparation(state)  # its thread ends, and puts the state back, on its own
    state.settle()
    assert "99" in state.prepare_error and "\n" not in state.prepare_error
    assert state.prepared is None and state.staged is None
    assert_unchanged(state, before)
    assert state.advance(str(outbox), 1).step == 1  # the next update does the work itself
    assert_at(state, train, 1)


def wait_for_preparation(state) -> None:
    import time

    deadline = time.monotonic() + 60
    while state.preparing and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not state.preparing


def test_a_second_preparation_of_another_source_takes_the_first_back(series):
    """Prepared through a lone patch, then prepared again from the series: the second preparation's thread
    takes the first back itself (it never waits for its own thread) before it goes its own way."""
    train, outbox = series
    state = load_host_state(train / "step_000001")
    assert state.prepare(str(outbox / "patch-00000001-00000002.pulsediff"))
    wait_for_preparation(state)
    assert state.prepare(str(outbox), STEPS)
    wait_for_preparation(state)
    assert state.prepare_error == ""
    state.settle()
    assert_at(state, train, STEPS)
    advance = state.advance(str(outbox), STEPS, stage=True)
    assert (advance.step, advance.prepared, advance.links) == (STEPS, True, STEPS - 1)  # 1 -> 3 only, no detour
    state.revert()
    assert_at(state, train, 1)
    assert state.step is None  # as it stood: loaded from a folder, no step known


def test_an_update_to_a_step_before_the_prepared_one_goes_the_whole_way_again(series):
    """Prepared to the newest step, asked for an earlier one: the way on from the prepared step does not
    exist (or costs an anchor), so it is taken from where the engine is, and the changes are that way's."""
    train, outbox = series
    state = load_host_state(train / "step_000000")
    assert state.prepare(str(outbox), STEPS)
    advance = state.advance(str(outbox), 1, stage=True)
    assert advance.step == 1 and state.step == 1
    assert_at(state, train, 1)
    for name, positions in advance.changes.items():
        net = np.flatnonzero(bits(step_tensors(train, 0)[name]) != bits(state.tensors[name]))
        assert positions is None or np.isin(net, positions).all(), name
    state.revert()
    assert_at(state, train, 0)


@pytest.mark.parametrize("seed", range(4))
def test_random_sequences_of_preparations_and_updates_keep_the_engine_and_the_state_together(series, seed):
    """Random sequences of what an engine does (prepare, update then commit or revert, a refused update),
    against a model of where the engine is: after every verdict the host state is exactly the engine's
    step, and every update's changes cover every element that differs between the engine's old step and
    its new one (what the engine is then loaded with)."""
    import random

    rng = random.Random(seed)
    train, outbox = series
    state = load_host_state(train / "step_000000")
    engine = 0  # the step the engine serves
    sources = [str(outbox), str(outbox / "patch-00000001-00000002.pulsediff")]
    for _ in range(10):
        op = rng.choice(["prepare", "prepare", "update", "update", "refused"])
        if op == "prepare":
            source = rng.choice(sources)
            step = rng.choice([None, 1, 2, STEPS]) if source == sources[0] else None
            state.prepare(source, step)
            if rng.random() < 0.5:
                wait_for_preparation(state)
            continue
        if op == "refused":
            with pytest.raises(PulsediffError):
                state.advance(str(outbox), 99, stage=True)
            assert state.staged is None and state.prepared is None
            assert_at(state, train, engine)
            continue
        step = rng.choice([None, 1, 2, STEPS])
        advance = state.advance(str(outbox), step, stage=True)
        target = STEPS if step is None else step
        assert advance.step == target
        assert_at(state, train, target)
        if rng.random() < 0.3:  # another rank refused: every rank takes it back
            state.revert()
            assert_at(state, train, engine)
            continue
        state.commit()
        for name, positions in advance.changes.items():
            net = np.flatnonzero(bits(step_tensors(train, engine)[name]) != bits(state.tensors[name]))
            assert positions is None or np.isin(net, positions).all(), (seed, name)
        changed = {n for n, t in step_tensors(train, engine).items()
                   if not np.array_equal(bits(t), bits(state.tensors[n]))}
        assert changed <= set(advance.changes), seed
        engine = target
    state.settle()
    state.advance(str(outbox), engine)  # whatever is left prepared: the engine's own step again
    assert_at(state, train, engine)


def test_an_unjudged_stage_is_dropped_and_a_prepared_one_kept(series):
    train, outbox = series
    state = load_host_state(train / "step_000000")
    state.advance(str(outbox), 1, stage=True)  # its caller never said commit or revert
    state.drop_unjudged()
    assert state.staged is None
    assert_at(state, train, 0)
    assert state.prepare(str(outbox), 2)
    wait_for_preparation(state)
    state.drop_unjudged()  # a preparation's stage is for the next advance to go on from
    assert state.prepared is not None
    assert state.advance(str(outbox), 2).prepared


def test_one_preparation_at_a_time_and_commit_or_revert_wait_for_it(series, monkeypatch):
    import threading

    from pulsediff.engines import state as state_module

    train, outbox = series
    state = load_host_state(train / "step_000000")
    release = threading.Event()
    real = state_module.HostState._advance

    def slow(self, *args):
        release.wait(30)
        return real(self, *args)

    monkeypatch.setattr(state_module.HostState, "_advance", slow)
    assert state.prepare(str(outbox), 1)
    assert state.preparing
    assert not state.prepare(str(outbox), 2)  # refused while the first runs: nothing started
    release.set()
    state.commit()  # waits for it, then keeps it
    assert not state.preparing and state.staged is None and state.prepared is None
    assert_at(state, train, 1)
    assert state.step == 1


def corrupt(path: Path, where: float) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x20
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("bad", ["wrong base", "payload byte", "header byte", "truncated", "missing step",
                                 "no such file", "unsigned under trust", "reshaped tensor", "anchor of another model"])
def test_bad_input_is_refused_and_nothing_changes(series, tmp_path, bad):
    train, outbox = series
    state = load_host_state(train / "step_000001")
    before = snapshot(state)
    patch = tmp_path / "p.pulsediff"
    shutil.copy(outbox / "patch-00000001-00000002.pulsediff", patch)
    kwargs = {}
    source = str(patch)
    if bad == "wrong base":
        source = str(outbox / "patch-00000002-00000003.pulsediff")
    elif bad == "payload byte":
        corrupt(patch, 0.9)
    elif bad == "header byte":
        corrupt(patch, 0.02)
    elif bad == "truncated":
        patch.write_bytes(patch.read_bytes()[:-100])
    elif bad == "missing step":
        source, kwargs = str(outbox), {"step": 99}
    elif bad == "no such file":
        source = str(tmp_path / "nothing.pulsediff")
    elif bad == "unsigned under trust":
        pytest.importorskip("cryptography")
        from pulsediff.series import signing

        public = signing.keygen(tmp_path / "k.key")
        source, kwargs = str(outbox), {"trust": [public], "trust_state": tmp_path / "state.json"}
    elif bad in ("reshaped tensor", "anchor of another model"):
        from pulsediff.ops.make import make_patch

        other = step_tensors(train, 2)
        if bad == "reshaped tensor":
            other["model.norm.weight"] = other["model.norm.weight"][:64].clone()
            make_patch(step_tensors(train, 1), other, patch, force=True)
        else:  # every tensor carried whole (an anchor's empty base): any base takes it, but not these shapes
            other = {"w": torch.zeros(4, dtype=torch.bfloat16)}
            make_patch({}, other, patch, force=True)
    with pytest.raises(PulsediffError) as info:
        state.advance(source, **kwargs)
    assert "\n" not in str(info.value)
    assert_unchanged(state, before)


NESTED = [[]]
for _ in range(10_000):  # 10,000 lists deep: refused by type, never walked
    NESTED = [NESTED]


@pytest.mark.parametrize("info, says", [
    ("x", "must be an object"),
    ({}, "needs 'source'"),
    ({"source": ""}, "'source' must be"),
    ({"source": 3}, "'source' must be"),
    ({"source": "a\0b"}, "'source' must be"),
    ({"source": "s", "step": -1}, "'step'"),
    ({"source": "s", "step": True}, "'step'"),
    ({"source": "s", "step": "3"}, "'step'"),
    ({"source": "s", "step": 1 << 63}, "'step'"),
    ({"source": "s", "trust": 5}, "'trust'"),
    ({"source": "s", "trust": []}, "'trust'"),
    ({"source": "s", "trust": [""]}, "'trust'"),
    ({"source": "s", "trust": "/etc/passwd"}, "'trust'"),  # a file would be read on the engine's machine
    ({"source": "s", "steps": 1}, "unknown key 'steps'"),
    ({"source": "s", "trust": NESTED}, "'trust'"),
    ({"source": "s", "prepare": 1}, "'prepare'"),
    ({"source": "s", "prepare": "yes"}, "'prepare'"),
    ({"source": NESTED}, "'source' must be"),
    ({"source": "s" * 5000}, "'source' must be"),
], ids=lambda v: v[:40] if isinstance(v, str) else type(v).__name__)
def test_update_requests_are_checked_for_type_and_range(info, says):
    with pytest.raises(UsageError, match=says):
        parse_update_request(info)


def test_a_good_update_request():
    request = parse_update_request({"source": "s3://b/run", "step": 7, "trust": "ed25519:abc"})
    assert (request.source, request.step, request.trust, request.prepare) == ("s3://b/run", 7, ("ed25519:abc",), False)
    assert parse_update_request({"source": "s", "prepare": True}).prepare is True


def test_a_series_and_a_patch_url_over_http(series, tmp_path):
    """The same over a real HTTP server (rclone's, on 127.0.0.1): a series URL, then one patch's URL; a
    patch URL that is not there is one line, and nothing changes."""
    pytest.importorskip("obstore")
    from test_remote import Server

    train, outbox = series
    server = Server("http", outbox.parent)  # serves the folder holding outbox/
    try:
        state = load_host_state(train / "step_000000")
        advance = state.advance(f"{server.url}/{outbox.name}", 2, cache=tmp_path / "cache")
        assert (advance.status, advance.step) == ("applied", 2)
        assert_at(state, train, 2)
        state.advance(f"{server.url}/{outbox.name}/patch-00000002-00000003.pulsediff")
        assert_at(state, train, 3)
        before = snapshot(state)
        with pytest.raises(PulsediffError, match="not found") as info:
            state.advance(f"{server.url}/{outbox.name}/patch-00000003-00000004.pulsediff")
        assert "\n" not in str(info.value)
        assert_unchanged(state, before)
    finally:
        server.kill()


@pytest.mark.parametrize("version", ["v1.1", "v1.2"])
def test_patches_with_and_without_word_sums(version):
    """The host state checks by word sums where a patch carries them (format 1.2) and by digests where it
    does not (1.1): both golden BF16 patches rebuild their target."""
    from pulsediff.engines.state import HostState
    from pulsediff.ops.live import state_dict_digest

    golden = Path(__file__).parent / "golden" / version
    tensors = {k: v.bfloat16() for k, v in load_file(str(golden / "base32.safetensors")).items()}
    state = HostState(tensors, state_dict_digest(tensors))
    advance = state.advance(str(golden / "bf16.ctx-rans.pulsediff"))
    want = load_file(str(golden / "target32.as-bf16.safetensors"))
    assert advance.status == "applied" and state.digest == state_dict_digest(want, scheme="flat")  # patches before 1.4
    for name, t in want.items():
        assert torch.equal(state.tensors[name].view(torch.int16), t.view(torch.int16)), name


class _RefusingLLM:
    """The four calls update_llm makes, the update refused as vLLM reports a worker's error: wrapped."""

    def __init__(self, line: str):
        self.line, self.calls = line, []

    def start_weight_update(self):
        self.calls.append("start")

    def update_weights(self, request):
        self.calls.append("update")
        raise RuntimeError(f"Call to collective_rpc method failed: Worker failed with error '{self.line}', "
                           "please check the stack trace above for the root cause")

    def update_weight_version(self, version):
        self.calls.append(f"version {version}")


@pytest.mark.parametrize("ending", ["(the engine keeps its weights)",
                                    "(the engine's weights are undefined: the next update loads every tensor)"])
def test_update_llm_refuses_with_the_workers_own_line(series, ending):
    from pulsediff.engines.vllm_client import update_llm

    _, outbox = series
    llm = _RefusingLLM(f"pulsediff: step 2 in {outbox}: damaged {ending}")
    with pytest.raises(PulsediffError) as refused:
        update_llm(llm, str(outbox), step=2)
    assert str(refused.value) == f"step 2 in {outbox}: damaged {ending}"
    assert llm.calls[-1] == ("version undefined" if "undefined" in ending else "update")  # no finish
