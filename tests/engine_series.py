"""Small Hugging Face model folders and RL-like series of them, for the engine tests.

A step changes about 1% of each tensor's BF16 elements by one ULP, up or down, as an RL step at
lr ~1e-6 does; zeros, subnormals and the largest exponents are left alone so that no step makes
an infinity or a NaN. Deterministic for a seed. Used by tests/test_engine_state.py (no vLLM
needed) and tests/test_vllm_engine.py (through tests/vllm_driver.py).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

# head_dim 64 (vLLM's CPU attention takes 32, 64, 80, ...); vocab small, so that the tests stay fast
SHAPES = {
    # q/k/v with biases fused into qkv_proj, gate/up into gate_up_proj, untied head
    "qwen2": dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                  tie_word_embeddings=False),
    # tied embeddings: the checkpoint has no lm_head.weight
    "llama-tied": dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                       tie_word_embeddings=True),
    # a small Qwen3-MoE: routed experts (vLLM fuses them into w13/w2 per layer)
    "qwen3-moe": dict(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                      num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=64, max_position_embeddings=512, tie_word_embeddings=False,
                      decoder_sparse_step=1, mlp_only_layers=[]),
}


def make_model_folder(kind: str, folder: Path, seed: int = 0, shape: dict | None = None) -> Path:
    """A randomly initialised BF16 model saved by transformers' save_pretrained (config.json and
    model.safetensors). `shape` overrides SHAPES[kind]'s config fields."""
    import transformers

    config_cls, model_cls = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "llama-tied": ("LlamaConfig", "LlamaForCausalLM"),
                             "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}[kind]
    config_cls, model_cls = getattr(transformers, config_cls), getattr(transformers, model_cls)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**SHAPES[kind], **(shape or {})})).to(torch.bfloat16)
    with torch.no_grad():  # biases start at zero: give them values, so that their changes are RL-like too
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.02)
    model.save_pretrained(folder)
    return folder


def rl_step(tensors: dict, rng: np.random.Generator, density: float = 0.01) -> dict:
    """A copy of `tensors` with ~`density` of each float tensor's elements one ULP up or down."""
    out = {}
    for name, t in tensors.items():
        t = t.clone()
        bits = t.view(torch.int16).reshape(-1)
        pos = torch.from_numpy(np.flatnonzero(rng.random(bits.numel()) < density))
        magnitude = bits[pos] & 0x7FFF
        pos = pos[(magnitude > 0x007F) & (magnitude < 0x7F00)]  # normal numbers away from infinity
        bits[pos] += torch.from_numpy(rng.choice([-1, 1], pos.numel()).astype(np.int16))
        out[name] = t
    return out


def make_series(kind: str, root: Path, steps: int, seed: int = 0, shape: dict | None = None) -> Path:
    """root/train/step_00000N/ (model folders) for N in 0..steps; returns root/train."""
    from safetensors.torch import load_file, save_file

    train = root / "train"
    first = make_model_folder(kind, train / "step_000000", seed, shape)
    tensors = load_file(str(first / "model.safetensors"))
    rng = np.random.default_rng(seed)
    for step in range(1, steps + 1):
        tensors = rl_step(tensors, rng)
        folder = train / f"step_{step:06d}"
        folder.mkdir(parents=True)
        for f in first.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, folder / f.name)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return train


def publish(train: Path, outbox: Path, *extra: str) -> Path:
    subprocess.run([sys.executable, "-m", "pulsediff", "publish", str(train), str(outbox), "--settle", "0", "-q",
                    *extra], check=True)
    return outbox
