"""`pulsediff make OLD NEW -o PATCH`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .options import DEFAULT_CODEC, Codec, Device, Precision, Quiet
from .output import Output, human_bytes


def make(
    old: Annotated[Path, typer.Argument(help="Base checkpoint: a .safetensors file or a folder of shards.")],
    new: Annotated[Path, typer.Argument(help="Target checkpoint, same forms.")],
    output: Annotated[str, typer.Option("--output", "-o", help="Patch file to write, or - for stdout.")],
    precision: Precision = "exact",
    codec: Codec = DEFAULT_CODEC,
    device: Device = "auto",
    quiet: Quiet = False,
) -> None:
    """Diff two checkpoints into a patch."""
    from ..make import make_patch

    out = Output(quiet=quiet)
    header = make_patch(old, new, output, precision=precision, codec=codec, device=device, progress=out.progress())
    if output != "-":
        changed = sum(t.changed for t in header.tensors)
        total = sum(t.numel for t in header.tensors)
        size = Path(output).stat().st_size
        out.info(
            f"wrote {output}: {human_bytes(size)} for {changed:,} of {total:,} elements changed "
            f"({100 * changed / max(total, 1):.3f}%), {header.target_bytes / max(size, 1):.1f}x smaller than the target"
        )
