"""`pulsediff apply BASE PATCH... -o OUT` (or `--in-place`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import UsageError
from .options import Device, Quiet
from .output import Output


def apply(
    base: Annotated[Path, typer.Argument(help="The checkpoint the (first) patch was made from.")],
    patches: Annotated[list[str], typer.Argument(help="Patch files in order (a chain), or - to read one from stdin.")],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Where to write the rebuilt checkpoint.")] = None,
    in_place: Annotated[bool, typer.Option("--in-place", help="Replace BASE with the rebuilt checkpoint (atomically).")] = False,
    device: Device = "auto",
    quiet: Quiet = False,
) -> None:
    """Rebuild the target checkpoint from BASE and a patch (or a chain of patches), verified bit for bit."""
    from ..apply import apply_chain

    if in_place == (output is not None):
        raise UsageError("give exactly one of -o OUT or --in-place")
    out = Output(quiet=quiet)
    result = apply_chain(base, patches, output, in_place=in_place, device=device, progress=out.progress())
    if result.status == "up-to-date":
        out.info(f"{result.output} is already up to date ({result.header.target_digest})")
    else:
        links = {0: ", the base already held the target", 1: ""}.get(result.links_applied, f", {result.links_applied} patches")
        out.info(f"wrote {result.output} ({result.header.target_digest}, verified{links})")
