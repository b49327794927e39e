"""Statistics over a checkpoint series: how sparse are the steps, what do they cost, how fast does sparsity decay.

For a training folder of checkpoints (as `publish` reads it):

- per step (checkpoint t against t + 1): changed elements, and the real size
  of the patch `make` writes for it with the given codec (encoded in memory,
  not written), next to the dense size of the checkpoint it rebuilds;
- the k-step density for k = 1, 2, 4, 8, ... (checkpoint t against t + k,
  averaged over t: what a worker k steps behind must fetch);
- both split by layer type (embeddings, attention, MLP, norms, LM head, other).
"""

from __future__ import annotations

import re
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pulsediff.io.checkpoint import Checkpoint, TensorView
from pulsediff.codecs import DEFAULT_SPARSE_CODEC
from pulsediff.errors import MissingExtraError, PulsediffError
from pulsediff.kernels import get_backend
from pulsediff.runtime.progress import SILENT, Labelled, Progress
from pulsediff.series.steps import DEFAULT_STEP_PATTERN, find_checkpoints

LAYER_TYPES = ("embeddings", "attention", "mlp", "norms", "lm_head", "other")
_LAYER_RULES = [  # first match wins; names as Hugging Face, GPT-2, GPT-NeoX, Megatron and Meta spell them
    ("norms", re.compile(r"norm|(^|[._])ln(_|\d|[._]|$)|layernorm|rmsnorm", re.I)),
    # The output projection apart from the input embeddings: tied or not, it is
    # usually the densest tensor of a step.
    ("lm_head", re.compile(r"lm_head|output_layer|embed_out|(^|\.)output\.weight$", re.I)),
    ("embeddings", re.compile(r"embed|wte|wpe|tok_emb|pos_emb|word_embeddings", re.I)),
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
    codec: str
    steps: list[int]
    # {"from", "to", "changed", "total", "density", "patch_bytes", "dense_bytes", "ratio", "bits_per_changed",
    #  "by_type": {type: {"changed", "total", "density", "patch_bytes"}}}
    step_density: list[dict]
    k_step_density: list[dict]  # {"k", "pairs", "density"}
    layer_density: dict[str, float]  # over all consecutive pairs
    # over all consecutive pairs: {type: {"elements" (per checkpoint, last), "changed", "total", "density",
    # "patch_bytes" (its tensors' sections; headers and layout are not split by type), "patch_share"}}
    layer_types: dict[str, dict]

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


class _ByteCounter:
    """A write-only stream that keeps only the number of bytes written: a patch's size without the patch."""

    def __init__(self):
        self.n = 0

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        self.n += n
        return n


def step_patch(old: Path, new: Path, *, precision: str, codec: str, device: str | None,
               progress: Progress = SILENT) -> dict:
    """The patch `make` writes for OLD -> NEW, measured: its size, and its changes and bytes by layer type."""
    from pulsediff.ops.make import make_patch

    sink = _ByteCounter()
    header = make_patch(old, new, sink, precision=precision, codec=codec, device=device, progress=progress,
                        skip_unsupported=True)
    by_type = {t: {"changed": 0, "total": 0, "patch_bytes": 0} for t in LAYER_TYPES}
    for rec in header.tensors:
        slot = by_type[layer_type(rec.name)]
        slot["changed"] += rec.changed
        slot["total"] += rec.numel
        slot["patch_bytes"] += rec.section.length if rec.section is not None else 0
    changed = sum(s["changed"] for s in by_type.values())
    total = sum(s["total"] for s in by_type.values())
    for slot in by_type.values():
        slot["density"] = slot["changed"] / slot["total"] if slot["total"] else 0.0
    return {"changed": changed, "total": total, "density": changed / total if total else 0.0,
            "patch_bytes": sink.n, "dense_bytes": header.target_bytes,
            "ratio": header.target_bytes / sink.n,
            "bits_per_changed": 8 * sink.n / changed if changed else None,
            "by_type": {t: s for t, s in by_type.items() if s["total"]}}


def series_stats(train_dir: Path, *, precision: str = "exact", pattern: str = DEFAULT_STEP_PATTERN,
                 device: str | None = None, max_k: int | None = None, codec: str = DEFAULT_SPARSE_CODEC,
                 progress: Progress = SILENT) -> SeriesStats:
    checkpoints = find_checkpoints(train_dir, pattern)
    if len(checkpoints) < 2:
        # A problem of the folder's contents (exit 1), not of the command line.
        n = len(checkpoints)
        raise PulsediffError(f"{train_dir} holds {n} checkpoint{'' if n == 1 else 's'} with a step number in its name "
                             "(step_N.safetensors or step_N/); series statistics need 2 or more")
    steps = [s for s, _ in checkpoints]
    # Consecutive pairs: the patches themselves, made in memory (their counts are the k = 1 densities).
    step_density = []
    for i in range(len(checkpoints) - 1):
        measured = step_patch(checkpoints[i][1], checkpoints[i + 1][1], precision=precision, codec=codec,
                              device=device, progress=Labelled(progress, f"make {i + 1}/{len(checkpoints) - 1}"))
        step_density.append({"from": steps[i], "to": steps[i + 1], **measured})

    layer_types = {}
    sections = sum(sum(s["patch_bytes"] for s in d["by_type"].values()) for d in step_density)
    for kind in LAYER_TYPES:
        slots = [d["by_type"][kind] for d in step_density if kind in d["by_type"]]
        if not slots:
            continue
        changed, total = sum(s["changed"] for s in slots), sum(s["total"] for s in slots)
        nbytes = sum(s["patch_bytes"] for s in slots)
        layer_types[kind] = {"elements": slots[-1]["total"], "changed": changed, "total": total,
                             "density": changed / total if total else 0.0, "patch_bytes": nbytes,
                             "patch_share": nbytes / sections if sections else 0.0}
    layer_density = {kind: v["density"] for kind, v in layer_types.items()}

    ks, k = [], 2
    while k < len(checkpoints) and (max_k is None or k <= max_k):
        ks.append(k)
        k *= 2
    k_step = [{"k": 1, "pairs": len(step_density),
               "density": sum(d["changed"] for d in step_density) / max(1, sum(d["total"] for d in step_density))}]
    if ks:
        backend = get_backend(device)
        opened = [Checkpoint(p) for _, p in checkpoints]
        try:
            views = [TensorView(c, precision) for c in opened]
            for k in ks:
                counts = [count_changes(views[i], views[i + k], backend) for i in range(len(views) - k)]
                k_step.append({"k": k, "pairs": len(counts),
                               "density": sum(c.changed for c in counts) / max(1, sum(c.total for c in counts))})
        finally:
            for c in opened:
                c.close()
    return SeriesStats(precision, codec, steps, step_density, k_step, layer_density, layer_types)


_LAYER_LABELS = {"embeddings": "embeddings", "attention": "attention", "mlp": "MLP", "norms": "norms",
                 "lm_head": "LM head", "other": "other"}


def pyplot():
    """matplotlib's pyplot on a file-only backend, or a MissingExtraError that says how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingExtraError("--plot", "matplotlib", "plot") from None
    return plt


def plot_series(stats: SeriesStats, path: Path) -> None:
    """Four panels in one PNG, written atomically: density per step, patch size per step against the dense
    checkpoint, the k-step curve, and density and patch share by layer type."""
    import io

    from pulsediff.io.atomic import StagedFiles

    plt = pyplot()
    steps = [d["to"] for d in stats.step_density]
    with plt.rc_context({"font.size": 11, "axes.titlesize": 13, "axes.titleweight": "bold"}):
        fig, axes = plt.subplots(2, 2, figsize=(13, 9))
        (density_ax, bytes_ax), (k_ax, layer_ax) = axes
        _plot_density(density_ax, steps, [100 * d["density"] for d in stats.step_density])
        _plot_bytes(bytes_ax, steps, stats.step_density)
        _plot_k_steps(k_ax, stats.k_step_density)
        _plot_layers(layer_ax, stats.layer_types)
        n = len(stats.steps)
        fig.suptitle(f"pulsediff series statistics: {n} checkpoints, steps {stats.steps[0]} to {stats.steps[-1]} "
                     f"(precision {stats.precision}, codec {stats.codec})", fontsize=14)
        fig.tight_layout()
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=110)
        plt.close(fig)
    with StagedFiles(inputs=()) as staged:  # made of no mapped checkpoint
        with staged.open(Path(path)) as f:
            f.write(png.getbuffer())
        staged.commit()


def _percent_axis(axis, log: bool, decades: float = 0) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter, PercentFormatter

    if log:  # PercentFormatter picks its decimals for a linear range; on a log axis 0.01% would read 0.0%
        # 1-2-5 ticks over a decade or two (one tick per decade would leave one label), powers of ten beyond
        axis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5) if decades <= 2.5 else (1,)))
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}%"))
        axis.set_minor_formatter(NullFormatter())
    else:
        axis.set_major_formatter(PercentFormatter(decimals=None))


def _step_axis(ax, steps: list[int]) -> None:
    ax.set_xlabel("step (checkpoint t against t - 1)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    if len(steps) == 1:
        ax.set_xticks(steps)
    ax.grid(alpha=0.3)


def _plot_density(ax, steps, percents) -> None:
    ax.plot(steps, percents, marker="o", color="tab:blue")
    lo, hi = min(percents), max(percents)
    log = lo > 0 and hi / lo > 10  # spans a decade or more: a log axis shows every step
    if log:
        ax.set_yscale("log")
    else:  # from zero: step-to-step noise looks as small as it is
        ax.set_ylim(0, 1.15 * hi if hi > 0 else 1)
    _percent_axis(ax.yaxis, log, math.log10(hi / lo) if log else 0)
    mean = sum(percents) / len(percents)
    ax.axhline(mean, color="tab:blue", alpha=0.4, linestyle=":")
    ax.annotate(f"mean {mean:.3g}%", (1, mean), xycoords=("axes fraction", "data"), xytext=(-4, 4),
                textcoords="offset points", ha="right", va="bottom", color="tab:blue")
    ax.set(ylabel="changed elements (% of all)", title="Elements changed per step")
    _step_axis(ax, steps)


def _bytes_label(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if n >= 10 or n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _plot_bytes(ax, steps, step_density) -> None:
    from matplotlib.ticker import FuncFormatter

    patch = [d["patch_bytes"] for d in step_density]
    dense = [d["dense_bytes"] for d in step_density]
    width = 0.38 * (min(b - a for a, b in zip(steps, steps[1:])) if len(steps) > 1 else 1)
    ax.bar([x - width / 2 for x in steps], dense, width=width, color="tab:gray", alpha=0.45, label="dense checkpoint")
    ax.bar([x + width / 2 for x in steps], patch, width=width, color="tab:orange", label="patch (label: dense / patch)")
    # Log scale: the two differ ~100x. Ticks at powers of two, so that they read 16 KiB, 64 KiB, 1 MiB.
    ax.set_yscale("log", base=2)
    lo, hi = min(patch) / 2, max(dense) * 12  # room above for the legend and the summary
    ax.set_ylim(lo, hi)
    e0, e1 = math.ceil(math.log2(lo)), math.floor(math.log2(hi))
    every = max(1, math.ceil((e1 - e0 + 1) / 7))
    ax.set_yticks([2.0 ** e for e in range(e0, e1 + 1) if e % every == 0])
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _bytes_label(v)))
    ax.minorticks_off()
    if len(steps) <= 16:  # more labels than that overlap
        for x, p, d in zip(steps, patch, dense):
            ax.annotate(f"{d / p:.0f}x", (x + width / 2, p), xytext=(0, 3), textcoords="offset points",
                        ha="center", va="bottom", fontsize=9)
    changed = sum(d["changed"] for d in step_density)
    summary = f"mean patch {_bytes_label(sum(patch) / len(patch))}"
    if changed:
        summary += f", {8 * sum(patch) / changed:.2f} bits per changed element"
    ax.set(ylabel="bytes (log scale)", title="Patch size per step vs dense checkpoint")
    ax.legend(loc="upper left", fontsize=9, ncol=2)
    ax.text(0.02, 0.86, summary, transform=ax.transAxes, ha="left", va="top", fontsize=10)
    _step_axis(ax, steps)
    ax.grid(alpha=0.3, axis="y")
    ax.grid(False, axis="x")


def _plot_k_steps(ax, k_steps) -> None:
    from matplotlib.ticker import NullFormatter

    ks = [d["k"] for d in k_steps]
    measured = [100 * d["density"] for d in k_steps]
    one = k_steps[0]["density"]
    # If every step changed elements independently of the others, at the 1-step density:
    independent = [100 * (1 - (1 - one) ** k) for k in ks]
    ax.plot(ks, measured, marker="o", color="tab:green", label="measured (mean over t)")
    ax.plot(ks, independent, linestyle="--", color="tab:gray",
            label="if each step changed independent elements")
    for k, m, d in zip(ks, measured, k_steps):
        ax.annotate(f"{m:.3g}%", (k, m), xytext=(0, -14), textcoords="offset points", ha="center", fontsize=9,
                    color="tab:green")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlim(ks[0] / 1.4, ks[-1] * 1.4)
    ax.set_ylim(0, 1.25 * max(measured + independent) or 1)
    _percent_axis(ax.yaxis, log=False)
    if len(ks) == 1:
        ax.text(0.5, 0.45, "the curve needs 3 or more checkpoints", transform=ax.transAxes, ha="center",
                color="tab:gray")
    ax.set(xlabel="k (checkpoint t against t + k)", ylabel="changed elements (% of all)",
           title="k steps apart: what a worker k steps behind needs")
    ax.legend(loc="upper left", fontsize=9)
    ax.grid(alpha=0.3)


def _plot_layers(ax, layer_types: dict[str, dict]) -> None:
    kinds = [k for k in LAYER_TYPES if k in layer_types][::-1]  # first type on top
    density = [100 * layer_types[k]["density"] for k in kinds]
    ax.barh(range(len(kinds)), density, color="tab:purple", height=0.6)
    ax.set_yticks(range(len(kinds)), [f"{_LAYER_LABELS[k]}\n{layer_types[k]['elements']:,} elements" for k in kinds],
                  fontsize=10)
    positive = [d for d in density if d > 0]
    log = bool(positive) and max(positive) / min(positive) > 20  # norms barely change: log keeps them visible
    if log:
        ax.set_xscale("log")
        ax.set_xlim(min(positive) / 2, max(positive) * 12)
    else:
        ax.set_xlim(0, 1.45 * max(density) if max(density) > 0 else 1)
    for y, k, d in zip(range(len(kinds)), kinds, density):
        v = layer_types[k]
        text = f"{d:.3g}% changed\n{100 * v['patch_share']:.3g}% of patch bytes" if v["changed"] else "unchanged"
        ax.annotate(text, (d if d > 0 else ax.get_xlim()[0], y), xytext=(4, 0), textcoords="offset points",
                    va="center", fontsize=9)
    _percent_axis(ax.xaxis, log, math.log10(ax.get_xlim()[1] / ax.get_xlim()[0]) if log else 0)
    ax.set(xlabel="changed elements per step (% of the type's elements)", title="By layer type (all steps)")
    ax.grid(alpha=0.3, axis="x")
