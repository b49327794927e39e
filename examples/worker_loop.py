"""An inference worker that keeps its model loaded and follows a trainer's published series in place.

Runs on CPU tensors in a few seconds, with no download: a small Llama is built
from a config. The trainer side takes RL-sized AdamW steps and saves each step
as a Hugging Face folder (`save_pretrained`), and `pulsediff publish` turns
the folders into patches and anchors. The worker holds a BF16 model that is
never reloaded: after each publish it calls `catch_up_state_dict` on the
model's state dict (whose tensors are the model's parameters), checked by the
word sums a GPU worker would use (check="sums"), then checks
its logits against a model loaded from the trainer's folder for that step,
bit for bit.

    python examples/worker_loop.py [WORKDIR] [--steps N]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from pulsediff import catch_up_state_dict


def small_llama() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def load_bf16(folder: Path):
    return AutoModelForCausalLM.from_pretrained(folder).to(torch.bfloat16)  # exact: the weights are BF16


def main(workdir: Path, steps: int) -> int:
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    train, outbox = workdir / "train", workdir / "outbox"
    train.mkdir(parents=True, exist_ok=True)

    # Trainer: FP32 masters, AdamW at an RL learning rate; BF16 folders saved after each step.
    trainer = small_llama()
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1)

    def save_step(step: int) -> Path:
        folder = train / f"step_{step:06d}"
        trainer.to(torch.bfloat16).save_pretrained(folder)
        trainer.to(torch.float32)
        return folder

    def train_step(lr: float) -> None:
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids = torch.randint(0, 128, (4, 32), generator=data)
        loss = trainer(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(5):  # warm Adam's moments up, as pretraining would have
        train_step(1e-3)
    save_step(0)

    # Worker: loads step 0 once and keeps it.
    worker = load_bf16(train / "step_000000")
    prompt = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(2))

    known = None  # the digest the worker's tensors have, once a catch-up has said it
    for step in range(1, steps + 1):
        train_step(2e-6)
        target_folder = save_step(step)
        subprocess.run(["pulsediff", "publish", str(train), str(outbox), "--anchor-every", "4", "--settle", "0", "-q"],
                       check=True)
        reference = load_bf16(target_folder)
        with torch.no_grad():
            expected = reference(prompt).logits
            stale = torch.equal(worker(prompt).logits, expected)  # before: the step must change the logits
            # check="sums": base and target checked by word sums where the tensors are (what a GPU
            # worker gets by default); `digest` spares hashing the tensors to find their step.
            result = catch_up_state_dict(worker.state_dict(), outbox, check="sums", digest=known)
            known = result.digest
            same = torch.equal(worker(prompt).logits, expected)
        n_params = sum(p.numel() for p in worker.parameters())
        print(f"step {result.step}: {result.links} patch(es), {result.changed_elements:,} of {n_params:,} "
              f"elements changed in place, logits bit-identical: {same}")
        if not same or stale or result.step != step:
            return 1
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", nargs="?", type=Path)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if args.workdir is None:
        with tempfile.TemporaryDirectory() as tmp:
            sys.exit(main(Path(tmp), args.steps))
    sys.exit(main(args.workdir, args.steps))
