"""A small, realistic checkpoint series made on the spot, for demos and tests.

No weights or data are downloaded: a Llama-shaped decoder (token embedding,
per-layer RMSNorm + q/k/v/o attention + gated MLP, final norm, untied LM head)
is trained in FP32 on tokens drawn from a fixed random Markov chain.

Two phases, mirroring how the checkpoints pulsediff targets come about:

1. *Pretraining-like warm-up*: `warmup_steps` AdamW steps at lr ~3e-4. The
   weights move well away from their initialisation and Adam's moment
   estimates are warm, so that the next phase's update sizes are realistic
   (a fresh Adam's first step moves every weight by exactly `lr`, which is
   not what an RL run looks like).
2. *RL-like phase*: `steps` AdamW steps at `lr` (1e-6..3e-6), on a sharpened
   version of the same chain (RL post-training mostly sharpens the policy's
   distribution). The optimizer and its state carry over; only the lr drops.

After the warm-up and after each RL step the BF16 cast of the FP32 masters
is saved, as a trainer exporting BF16 weights for its inference engine would.
An update of ~lr is far below BF16's rounding step (2^-7 relative) for most
weights, so most BF16 elements stay bit-identical between saved steps.

Same seed, same machine, same thread count: same files, byte for byte (every
random draw uses a local `torch.Generator`; the caller's global RNG is not
touched). Across machines or thread counts the float results may differ.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Callable

# OpenMP's threads (torch's) spin while they wait for work: with the cores
# shared, the README's 4-step series took 45-63 s against 11-16 s passive
# (two CPU hogs beside it on two cores; alike on idle cores). libgomp reads the
# setting once, when torch loads it, so it is set here, before `import torch`:
# a script that imported torch first keeps torch's default. The user's own
# setting wins. `pulsediff demo` does the same before its imports.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402 (after the wait policy)
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from torch import nn  # noqa: E402

__all__ = [
    "DEMO_RECIPE",
    "make_example_series",
    "make_example_pair",
    "make_example_fp32_pair",
    "fp32_path_for",
    "unchanged_fraction",
    "llama_config",
]

# What `pulsediff demo` trains: the default model, with a warm-up of 40 steps at
# a peak lr of 1e-3 on 16-token sequences, ~7x less compute than the defaults'
# 150 steps at 3e-4 on 32 tokens. The pair it makes is as sparse and codes as
# well (1 RL step at lr 1e-6: 98.7% vs 98.6% of BF16 elements unchanged, 7.7
# vs 7.5 bits per changed element), only the warm-up loss ends higher
# (5.3 vs 4.3 nats). The defaults stay for the benchmarks (docs/BENCHMARKS.md).
DEMO_RECIPE = {"warmup_steps": 40, "warmup_lr": 1e-3, "seq_len": 16}

STEP_NAME = "step_{:06d}.safetensors"
FP32_STEP_NAME = "step_{:06d}.fp32.safetensors"


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class _Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.n_heads

        def heads(p: torch.Tensor) -> torch.Tensor:
            return p.view(b, t, h, d // h).transpose(1, 2)

        # No positional encoding: with a causal mask a decoder infers position
        # well enough for a first-order Markov chain, and RoPE has no weights.
        y = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)),
                                           is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, d))


class _MLP(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=False)
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int):
        super().__init__()
        self.input_layernorm = _RMSNorm(d_model)
        self.self_attn = _Attention(d_model, n_heads)
        self.post_attention_layernorm = _RMSNorm(d_model)
        self.mlp = _MLP(d_model, d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, vocab: int, d_model: int, n_layers: int, n_heads: int, d_ff: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(_Block(d_model, n_heads, d_ff) for _ in range(n_layers))
        self.norm = _RMSNorm(d_model)


class TinyDecoder(nn.Module):
    """Llama-shaped decoder; its state-dict names match Hugging Face's Llama."""

    def __init__(self, vocab: int, d_model: int, n_layers: int, n_heads: int, d_ff: int):
        super().__init__()
        self.model = _Body(vocab, d_model, n_layers, n_heads, d_ff)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))

    @torch.no_grad()
    def init_weights(self, gen: torch.Generator, n_layers: int) -> None:
        # GPT-2 style: N(0, 0.02), residual-output projections scaled down by
        # sqrt(2 * n_layers); norm weights stay at 1.
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                continue
            std = 0.02
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                std /= math.sqrt(2 * n_layers)
            p.copy_(torch.randn(p.shape, generator=gen) * std)


class _MarkovChain:
    """A sparse random first-order chain with Zipf-distributed token frequencies.

    Each token has `fanout` successors drawn from a Zipf(1) law over the
    vocabulary (so, as in text, a few tokens are frequent and most are rare),
    with Zipf-like probabilities among them. Frequent tokens' bigrams are
    learnt within the warm-up; a uniform chain over 4096 tokens is not.
    """

    def __init__(self, vocab: int, fanout: int, gen: torch.Generator):
        self.vocab = vocab
        zipf = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float32)
        self.successors = torch.multinomial(zipf.expand(vocab, vocab), fanout, replacement=True, generator=gen)
        ranks = torch.argsort(torch.rand(vocab, fanout, generator=gen), dim=1).float() + 1
        self.probs = 1.0 / ranks
        self.probs /= self.probs.sum(1, keepdim=True)

    def sharpened(self, power: float) -> "_MarkovChain":
        chain = object.__new__(_MarkovChain)
        chain.vocab, chain.successors = self.vocab, self.successors
        chain.probs = self.probs ** power
        chain.probs /= chain.probs.sum(1, keepdim=True)
        return chain

    def sample(self, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
        out = torch.empty(batch, seq_len, dtype=torch.long)
        cur = torch.randint(0, self.vocab, (batch,), generator=gen)
        out[:, 0] = cur
        for t in range(1, seq_len):
            pick = torch.multinomial(self.probs[cur], 1, generator=gen).squeeze(1)
            cur = self.successors[cur, pick]
            out[:, t] = cur
        return out


def _step(model: TinyDecoder, opt: torch.optim.Optimizer, tokens: torch.Tensor) -> float:
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


# One metadata key, as transformers writes: safetensors serialises the metadata
# map in hash order, which varies between processes, so a second key would make
# same-seed files differ in their header bytes.
_METADATA = {"format": "pt"}


def _save(model: TinyDecoder, out_dir: Path, step: int, save_fp32: bool, config: dict | None = None) -> Path:
    state = {k: v.detach() for k, v in model.state_dict().items()}
    path = out_dir / STEP_NAME.format(step)
    if config is not None:  # a Hugging Face model folder: step_N/model.safetensors and config.json
        path = out_dir / STEP_NAME.format(step).removesuffix(".safetensors")
        path.mkdir(exist_ok=True)
        (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name, text in example_tokenizer(config["vocab_size"]).items():
            (path / name).write_text(text)
        path = path / "model.safetensors"
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}, str(path), metadata=_METADATA)
    if config is not None:
        return path.parent
    if save_fp32:
        save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / FP32_STEP_NAME.format(step)),
                  metadata=_METADATA)
    return path


def make_example_series(
    out_dir: str | Path,
    *,
    steps: int = 1,
    lr: float = 1e-6,
    seed: int = 0,
    d_model: int = 384,
    n_layers: int = 6,
    vocab: int = 4096,
    n_heads: int = 6,
    d_ff: int | None = None,
    warmup_steps: int = 150,
    warmup_lr: float = 3e-4,
    batch: int = 8,
    seq_len: int = 32,
    save_fp32: bool = False,
    model_folders: bool = False,
    on_step: Callable[[int, int, float], None] | None = None,
) -> list[Path]:
    """Train a tiny decoder and save a series of BF16 checkpoints to `out_dir`.

    Writes `step_000000.safetensors` (after the warm-up) and one file per RL
    step after it, `steps + 1` in all, and returns their paths in order. With
    `save_fp32`, also writes the FP32 masters as `step_XXXXXX.fp32.safetensors`
    next to each (see `fp32_path_for`). With `model_folders`, each step is a
    Hugging Face model folder `step_XXXXXX/` (model.safetensors and a
    config.json of `llama_config`) that vLLM and transformers load (`save_fp32`
    is not taken then). `on_step(done, total, loss)` is called
    after each training step, warm-up and RL steps alike (`total` counts both).

    The defaults (~13.8M parameters) take about 65 s on two idle CPU cores
    (`DEMO_RECIPE` about 14 s); time scales with parameters x batch x seq_len
    x warmup_steps. Importing this module sets OMP_WAIT_POLICY=PASSIVE unless
    it is set (OpenMP's spinning threads made training ~4x slower with the
    cores shared); that takes effect only if torch was not imported before.
    """
    if steps < 0 or warmup_steps < 0:
        raise ValueError("steps and warmup_steps must be >= 0")
    if d_model % n_heads:
        raise ValueError(f"d_model ({d_model}) must be a multiple of n_heads ({n_heads})")
    # Llama's gated-MLP width, 8/3 of d_model, rounded up to a multiple of 64.
    d_ff = d_ff if d_ff is not None else 64 * math.ceil(8 * d_model / 3 / 64)
    if model_folders and save_fp32:
        raise ValueError("save_fp32 writes files beside step files, not into model folders")
    config = llama_config(vocab, d_model, n_layers, n_heads, d_ff) if model_folders else None
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    gen = torch.Generator().manual_seed(seed)
    chain = _MarkovChain(vocab, fanout=16, gen=gen)
    rl_chain = chain.sharpened(2.0)
    model = TinyDecoder(vocab, d_model, n_layers, n_heads, d_ff)
    model.init_weights(gen, n_layers)

    # No weight decay on norm weights, as in common LLM recipes.
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=warmup_lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    ramp = max(1, warmup_steps // 10)

    model.train()
    for i in range(warmup_steps):
        # Linear ramp, then cosine decay to 10%: a pretraining schedule in miniature.
        frac = (i - ramp) / max(1, warmup_steps - ramp)
        scale = (i + 1) / ramp if i < ramp else 0.1 + 0.45 * (1 + math.cos(math.pi * frac))
        for group in opt.param_groups:
            group["lr"] = warmup_lr * scale
        loss = _step(model, opt, chain.sample(batch, seq_len + 1, gen))
        if on_step is not None:
            on_step(i + 1, warmup_steps + steps, loss)

    paths = [_save(model, out_dir, 0, save_fp32, config)]
    for group, wd in zip(opt.param_groups, (0.01, 0.0)):
        group["lr"], group["weight_decay"] = lr, wd
    for step in range(1, steps + 1):
        loss = _step(model, opt, rl_chain.sample(batch, seq_len + 1, gen))
        if on_step is not None:
            on_step(warmup_steps + step, warmup_steps + steps, loss)
        paths.append(_save(model, out_dir, step, save_fp32, config))
    return paths


def llama_config(vocab: int, d_model: int, n_layers: int, n_heads: int, d_ff: int) -> dict:
    """A Hugging Face config.json for the example's tensors: a LlamaForCausalLM of the same shapes, so
    that inference engines load the steps. Its forward pass adds rotary position embeddings, which
    the trainer here does without (RoPE has no weights: the tensors are the same)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
            "hidden_size": d_model, "intermediate_size": d_ff, "num_hidden_layers": n_layers,
            "num_attention_heads": n_heads, "num_key_value_heads": n_heads, "hidden_act": "silu",
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}


def example_tokenizer(vocab: int) -> dict[str, str]:
    """tokenizer.json and tokenizer_config.json for the example's tokens: token i is the word "w<i>", words
    split at spaces, so an engine serving a step can be asked in text ("w1 w2 w3") and answers in it. A
    WordLevel model written as JSON (the `tokenizers` format), with no special tokens: decoding keeps every
    token; a word outside the vocabulary reads as w0. The chat template joins the messages' contents."""
    model = {"type": "WordLevel", "vocab": {f"w{i}": i for i in range(vocab)}, "unk_token": "w0"}
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
                 "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
                 "model": model}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 2048,
              "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}
    return {"tokenizer.json": json.dumps(tokenizer) + "\n", "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}


def fp32_path_for(bf16_path: str | Path) -> Path:
    """The FP32-master file saved next to a BF16 step file (with `save_fp32=True`)."""
    p = Path(bf16_path)
    return p.with_name(p.name.removesuffix(".safetensors") + ".fp32.safetensors")


def make_example_pair(out_dir: str | Path, **kw) -> tuple[Path, Path]:
    """A BF16 (old, new) pair: the last two steps of a series (1 RL step unless `steps` is given)."""
    kw.setdefault("steps", 1)
    if kw["steps"] < 1:
        raise ValueError("a pair needs steps >= 1")
    paths = make_example_series(out_dir, **kw)
    return paths[-2], paths[-1]


def make_example_fp32_pair(out_dir: str | Path, **kw) -> tuple[Path, Path]:
    """The FP32-master (old, new) pair of the last two steps; the BF16 pair is written too."""
    old, new = make_example_pair(out_dir, save_fp32=True, **kw)
    return fp32_path_for(old), fp32_path_for(new)


def unchanged_fraction(old: str | Path, new: str | Path) -> float:
    """Fraction of elements bit-identical between two checkpoints with the same tensors."""
    a, b = load_file(str(old)), load_file(str(new))
    if a.keys() != b.keys():
        raise ValueError("the checkpoints hold different tensors")
    same = total = 0
    for name, x in a.items():
        y = b[name]
        if x.dtype != y.dtype or x.shape != y.shape:
            raise ValueError(f"tensor {name!r} differs in dtype or shape")
        # Compare bit patterns, not values (NaN != NaN, -0.0 == 0.0).
        bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
        same += int((x.view(bits) == y.view(bits)).sum())
        total += x.numel()
    return same / total if total else 1.0
