"""`pulsediff squash BASE P1 ... Pn -o P`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .options import DEFAULT_CODEC, Codec, Device, Quiet
from .output import Output, human_bytes


def squash(
    base: Annotated[Path, typer.Argument(help="The first patch's base checkpoint.")],
    patches: Annotated[list[Path], typer.Argument(help="The chain, in order.")],
    output: Annotated[str, typer.Option("--output", "-o", help="Squashed patch to write, or - for stdout.")],
    codec: Codec = DEFAULT_CODEC,
    device: Device = "auto",
    quiet: Quiet = False,
) -> None:
    """Make one patch from BASE straight to the end of a chain (for a worker many steps behind)."""
    from ..squash import squash_patches

    out = Output(quiet=quiet)
    squash_patches(base, patches, output, codec=codec, device=device, progress=out.progress())
    if output != "-":
        size = Path(output).stat().st_size
        links = sum(p.stat().st_size for p in patches)
        out.info(f"wrote {output}: {human_bytes(size)} for {len(patches)} patches of {human_bytes(links)} in all")
