"""`pulsediff stats PATCH` and `pulsediff stats OLD NEW`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Optional

import typer

from pulsediff.errors import UsageError
from pulsediff.cli.options import DEFAULT_CODEC, Codec, Device, Force, Json, Precision, Quiet
from pulsediff.cli.output import Output, human_bytes


def stats(
    first: Annotated[Path, typer.Argument(metavar="PATCH|OLD|DIR",
                                          help="A patch, the base checkpoint of a pair, or a folder of checkpoints (a series).")],
    second: Annotated[Optional[Path], typer.Argument(metavar="NEW", help="The target checkpoint, when the first argument is OLD.")] = None,
    precision: Precision = "exact",
    codec: Codec = DEFAULT_CODEC,
    top: Annotated[int, typer.Option("--top", metavar="N", help="Tensors to list, largest patch share first (0: all).")] = 20,
    device: Device = "auto",
    plot: Annotated[Optional[Path], typer.Option("--plot", metavar="PNG", help="For a series: draw density and patch size per step, the k-step curve and the layer types into this PNG (needs matplotlib; an existing one is replaced only with -f).")] = None,
    step_pattern: Annotated[Optional[str], typer.Option("--step-pattern", metavar="REGEX", help="For a series: a regex whose first group is the step number in a checkpoint's name (default: as publish reads names).")] = None,
    values: Annotated[bool, typer.Option("--values", help="For a patch: also decode its changed values, for a "
                                         "histogram of |new - base| in ULPs (loads the kernels: about a decode's "
                                         "time; without it only the header is read). A pair always has it.")] = False,
    force: Force = False,
    quiet: Quiet = False,
    as_json: Json = False,
) -> None:
    """Sparsity and size statistics of a patch, of the patch a checkpoint pair would make, or of a series."""
    from pulsediff.ops.stats import stats_of_pair, stats_of_patch_file

    out = Output(quiet=quiet, as_json=as_json)
    if second is None and first.is_dir():
        if _is_checkpoint_folder(first, step_pattern):
            raise UsageError(f"{first} is a checkpoint (a model folder), not a patch or a series folder; "
                             "give OLD NEW to compare two checkpoints")
        return _series(first, precision, codec, device, plot, step_pattern, force, out)
    if plot is not None:
        raise UsageError("--plot is for a folder of checkpoints (a series)")
    if values and second is not None:
        raise UsageError("--values is for a patch file (the stats of a pair always decode the values)")
    if step_pattern is not None:
        raise UsageError("--step-pattern is for a folder of checkpoints (a series)")
    if second is None:
        _refuse_checkpoint_as_patch(first)
        s = stats_of_patch_file(first, values=values)
    else:
        s = stats_of_pair(first, second, precision=precision, codec=codec, device=device, progress=out.progress())
    if as_json:
        out.json(s.to_json())
        return
    bits = f"{s.bits_per_changed:.2f}" if s.bits_per_changed is not None else "-"
    pct = lambda part: f"{100 * part / s.patch_bytes:.1f}%" if s.patch_bytes else "-"  # noqa: E731
    out.table("summary", ["", ""], [
        ("precision", s.precision),
        ("codecs", ", ".join(s.codec) or "-"),
        ("tensors", f"{s.tensors:,} ({s.changed_tensors:,} changed, {s.whole_tensors:,} carried whole, {s.removed_tensors:,} removed)"),
        ("elements changed", f"{s.changed:,} of {s.elements:,}"),
        ("density", f"{100 * s.density:.4f}%"),
        ("patch", f"{human_bytes(s.patch_bytes)} ({s.patch_bytes:,} bytes)"),
        ("  header", f"{human_bytes(s.header_bytes)} ({pct(s.header_bytes)})"),
        ("  indices", f"{human_bytes(s.index_bytes)} ({pct(s.index_bytes)})"),
        ("  values", f"{human_bytes(s.value_bytes)} ({pct(s.value_bytes)})"),
        ("bits per changed element", bits),
        ("  positions / values", f"{8 * s.index_bytes / s.changed:.2f} / {8 * s.value_bytes / s.changed:.2f}" if s.changed else "-"),
        ("dense target", human_bytes(s.target_bytes)),
        ("ratio (target / patch)", f"{s.ratio:.1f}x" if s.ratio else "-"),
        ("base digest", s.base_digest),
        ("target digest", s.target_digest),
    ])
    if s.ulp_histogram is not None and s.changed:
        total = sum(s.ulp_histogram.values())
        out.table("changed values: |new - base| in units of the last place (bit-pattern distance)",
                  ["ULPs", "elements", "share"],
                  [(k, f"{v:,}", f"{100 * v / total:.2f}%") for k, v in s.ulp_histogram.items()], right=(1, 2))
    elif s.changed and (values or second is not None):
        out.info("ULP histogram: only for codecs that store differences (--codec ctx-rans or ctx-ac)")
    rows = sorted(s.per_tensor, key=lambda t: (-t.bytes, t.name))
    if top > 0:
        rows = rows[:top]
    out.table(
        f"tensors ({len(rows)} of {len(s.per_tensor)}, by patch bytes)",
        ["tensor", "dtype", "shape", "op", "changed", "density", "indices", "values", "bits/changed"],
        [(t.name, t.dtype, "x".join(map(str, t.shape)) or "scalar", t.op, f"{t.changed:,}", f"{100 * t.density:.3f}%",
          human_bytes(t.index_bytes), human_bytes(t.value_bytes),
          f"{8 * t.bytes / t.changed:.2f}" if t.changed else "-") for t in rows],
        right=(4, 5, 6, 7, 8), drop=(6, 7, 3, 1, 2),  # at 80 columns: the byte split, op, dtype, shape
    )


def _is_checkpoint_folder(folder: Path, step_pattern: Optional[str]) -> bool:
    """A folder that is one checkpoint, not a series of them: shards with their index, HF-named shards, or
    .safetensors files none of whose names carries a step number (a model folder's model.safetensors)."""
    from pulsediff.io.names import INDEX_NAME
    from pulsediff.series.steps import DEFAULT_STEP_PATTERN, SHARD_NAME, step_in_name

    if (folder / INDEX_NAME).is_file():
        return True
    files = [p.name for p in folder.iterdir() if p.suffix == ".safetensors" and p.is_file()]
    try:
        regex = re.compile(step_pattern or DEFAULT_STEP_PATTERN)
    except re.error:
        regex = None
    if regex is None or regex.groups < 1:  # a bad pattern is refused later, with its own message
        regex = re.compile(DEFAULT_STEP_PATTERN)
    return bool(files) and all(SHARD_NAME.search(name) or step_in_name(name, regex) is None for name in files)


def _refuse_checkpoint_as_patch(path: Path) -> None:
    """A checkpoint given where a patch belongs: say so instead of "bad magic bytes"."""
    from pulsediff.io.names import PICKLE_ADVICE
    from pulsediff.cli.checks import checkpoint_kind

    kind = checkpoint_kind(path)
    if kind == "safetensors":
        raise UsageError(f"{path} is a checkpoint, not a patch or a series folder; give OLD NEW to compare two checkpoints")
    if kind == "pickle":
        raise UsageError(f"{path} is not a patch: {PICKLE_ADVICE}")


def _series(folder: Path, precision: str, codec: str, device: str, plot: Optional[Path], step_pattern: Optional[str],
            force: bool, out: Output) -> None:
    from pulsediff.series.steps import DEFAULT_STEP_PATTERN
    from pulsediff.series.stats import series_stats

    if step_pattern is not None:
        _check_pattern(step_pattern)
    if plot is not None:  # before the work: matplotlib is there, the PNG's folder exists, no PNG is lost
        from pulsediff.series.stats import pyplot
        from pulsediff.cli.checks import check_output

        pyplot()
        check_output(plot, force=force)
    s = series_stats(folder, precision=precision, codec=codec, device=device,
                     pattern=step_pattern or DEFAULT_STEP_PATTERN, progress=out.progress())
    if plot is not None:
        from pulsediff.series.stats import plot_series

        plot_series(s, plot)
        out.info(f"wrote {plot}")
    if out.as_json:
        out.json(s.to_json())
        return
    out.table(f"per step ({len(s.steps)} checkpoints, {precision}, {codec})",
              ["step", "changed", "of", "density", "patch", "dense", "ratio", "bits/changed"],
              [(f"{d['from']} -> {d['to']}", f"{d['changed']:,}", f"{d['total']:,}", f"{100 * d['density']:.4f}%",
                human_bytes(d["patch_bytes"]), human_bytes(d["dense_bytes"]), f"{d['ratio']:.1f}x",
                f"{d['bits_per_changed']:.2f}" if d["bits_per_changed"] else "-") for d in s.step_density],
              right=range(1, 8), drop=(2, 5, 1))  # at 80 columns: the totals, then the count
    out.table("k steps apart", ["k (t vs t+k)", "pairs", "density"],
              [(d["k"], d["pairs"], f"{100 * d['density']:.4f}%") for d in s.k_step_density], right=(0, 1, 2))
    out.table("by layer type (all steps)", ["layer type", "elements", "density", "patch bytes", "share"],
              [(k, f"{v['elements']:,}", f"{100 * v['density']:.4f}%", human_bytes(v["patch_bytes"]),
                f"{100 * v['patch_share']:.1f}%") for k, v in s.layer_types.items()], right=(1, 2, 3, 4))


def _check_pattern(pattern: str) -> None:
    try:
        groups = re.compile(pattern).groups
    except re.error as exc:
        raise UsageError(f"--step-pattern {pattern!r} is not a valid regex: {exc}") from None
    if groups < 1:
        raise UsageError(f"--step-pattern {pattern!r} needs a group around the step number, e.g. 'step_(\\d+)'")
