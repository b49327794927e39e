"""Statistics over a checkpoint series: how sparse are the steps, and how fast does sparsity decay.

For a training folder of checkpoints (as `publish` reads it): the density of
each step (changed / total elements between consecutive checkpoints), the
k-step density for k = 1, 2, 4, 8, ... (checkpoint t against t + k, averaged
over t: what a worker k steps behind must fetch), and the per-step density
split by layer type (attention, MLP, embeddings, norms, other).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .checkpoint import Checkpoint, TensorView
from .kernels import get_backend
from .series import DEFAULT_STEP_PATTERN, find_checkpoints
from .errors import UsageError

LAYER_TYPES = ("attention", "mlp", "embeddings", "norms", "other")
_LAYER_RULES = [  # first match wins; names as Hugging Face, GPT-2 and Megatron spell them
    ("norms", re.compile(r"norm|(^|[._])ln(_|\d|[._]|$)|layernorm|rmsnorm", re.I)),
    ("embeddings", re.compile(r"embed|wte|wpe|lm_head|tok_emb|pos_emb|word_embeddings|output_layer", re.I)),
    ("attention", re.compile(r"attn|attention|q_proj|k_proj|v_proj|o_proj|qkv|query|key|value|c_attn", re.I)),
    ("mlp", re.compile(r"mlp|ffn|feed_forward|fc\d|c_fc|gate_proj|up_proj|down_proj|(^|[._])w[123]([._]|$)|dense_h_to_4h|dense_4h_to_h", re.I)),
]


def layer_type(name: str) -> str:
    for kind, rule in _LAYER_RULES:
        if rule.search(name):
            return kind
    return "other"


@dataclass
class PairCount:
    changed: int = 0
    total: int = 0
    by_type: dict[str, list[int]] = field(default_factory=lambda: {t: [0, 0] for t in LAYER_TYPES})

    @property
    def density(self) -> float:
        return self.changed / self.total if self.total else 0.0


@dataclass(frozen=True)
class SeriesStats:
    precision: str
    steps: list[int]
    step_density: list[dict]  # {"from", "to", "changed", "total", "density"}
    k_step_density: list[dict]  # {"k", "pairs", "density"}
    layer_density: dict[str, float]  # over all consecutive pairs

    def to_json(self) -> dict:
        return asdict(self)


def count_changes(old: TensorView, new: TensorView, backend) -> PairCount:
    """Changed elements between two checkpoints, over the tensors they share with equal shape and dtype;
    tensors only one side has, or of another shape or dtype, count as wholly changed."""
    out = PairCount()
    for name in new.ckpt.names:
        t = new.get(name)
        n = t.bits.size
        if name in old.ckpt and old.dtype_of(name) is t.dtype and old.shape_of(name) == t.shape:
            changed = backend.diff_compact(old.get(name).bits, t.bits)[0].size
        else:
            changed = n
        out.changed += changed
        out.total += n
        slot = out.by_type[layer_type(name)]
        slot[0] += changed
        slot[1] += n
    return out


def series_stats(train_dir: Path, *, precision: str = "exact", pattern: str = DEFAULT_STEP_PATTERN,
                 device: str | None = None, max_k: int | None = None) -> SeriesStats:
    checkpoints = find_checkpoints(train_dir, pattern)
    if len(checkpoints) < 2:
        raise UsageError(f"{train_dir} holds {len(checkpoints)} complete checkpoints; series statistics need 2 or more")
    backend = get_backend(device)
    steps = [s for s, _ in checkpoints]
    opened = [Checkpoint(p) for _, p in checkpoints]
    try:
        views = [TensorView(c, precision) for c in opened]
        consecutive = [count_changes(views[i], views[i + 1], backend) for i in range(len(views) - 1)]
        step_density = [{"from": steps[i], "to": steps[i + 1], "changed": c.changed, "total": c.total,
                         "density": c.density} for i, c in enumerate(consecutive)]
        ks, k = [], 1
        while k < len(views) and (max_k is None or k <= max_k):
            ks.append(k)
            k *= 2
        k_step = []
        for k in ks:
            counts = consecutive if k == 1 else [count_changes(views[i], views[i + k], backend)
                                                 for i in range(len(views) - k)]
            k_step.append({"k": k, "pairs": len(counts),
                           "density": sum(c.changed for c in counts) / max(1, sum(c.total for c in counts))})
        layer_density = {}
        for kind in LAYER_TYPES:
            changed = sum(c.by_type[kind][0] for c in consecutive)
            total = sum(c.by_type[kind][1] for c in consecutive)
            if total:
                layer_density[kind] = changed / total
        return SeriesStats(precision, steps, step_density, k_step, layer_density)
    finally:
        for c in opened:
            c.close()


def plot_series(stats: SeriesStats, path: Path) -> None:
    """Density per step and the k-step curve, side by side, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'pulsediff[plot]' (or pip install matplotlib)") from None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot([d["to"] for d in stats.step_density], [100 * d["density"] for d in stats.step_density], marker="o")
    left.set(xlabel="step", ylabel="changed elements (%)", title="density per step")
    left.xaxis.get_major_locator().set_params(integer=True)
    right.plot([d["k"] for d in stats.k_step_density], [100 * d["density"] for d in stats.k_step_density], marker="o")
    right.set(xscale="log", xlabel="k (steps apart)", ylabel="changed elements (%)", title="k-step density")
    right.set_xticks([d["k"] for d in stats.k_step_density], [str(d["k"]) for d in stats.k_step_density])
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle(f"pulsediff series statistics ({stats.precision})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
