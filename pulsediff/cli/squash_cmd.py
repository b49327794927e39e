"""`pulsediff squash BASE P1 ... Pn -o P`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pulsediff.errors import UsageError
from pulsediff.cli.checks import check_output, check_patch_paths
from pulsediff.cli.options import DEFAULT_CODEC, Codec, Device, ForceStdout, Json, Quiet
from pulsediff.cli.output import Output, human_bytes, plural


def squash(
    base: Annotated[Path, typer.Argument(help="The first patch's base checkpoint.")],
    patches: Annotated[list[Path], typer.Argument(metavar="PATCH...", help="The chain, in order.")],
    output: Annotated[str, typer.Option("--output", "-o", metavar="PATCH", help="Squashed patch to write, or - for stdout.")],
    codec: Codec = DEFAULT_CODEC,
    device: Device = "auto",
    force: ForceStdout = False,
    quiet: Quiet = False,
    as_json: Json = False,
) -> None:
    """Make one patch from BASE straight to the end of a chain (for a worker many steps behind)."""
    if as_json and output == "-":
        raise UsageError("--json prints on stdout, which -o - uses for the patch")
    # "squashed.pulsediff": ops.squash.SQUASHED_NAME, without loading the kernels to say it
    check_output(output, force=force, single_file=("a patch is a single file", "squashed.pulsediff"))
    check_patch_paths(patches)
    from pulsediff.ops.squash import squash_patches

    out = Output(quiet=quiet, as_json=as_json)
    header = squash_patches(base, patches, output, codec=codec, device=device, progress=out.progress(), force=force)
    size = Path(output).stat().st_size if output != "-" else None
    links = sum(p.stat().st_size for p in patches)
    if as_json:
        # "patch_bytes", as stats --json names it; "bytes", its old name here, stays until 0.3
        out.json({"output": output, "patch_bytes": size, "bytes": size, "patches": len(patches), "patches_bytes": links,
                  "base_digest": header.base_digest, "target_digest": header.target_digest})
    elif size is not None:
        out.info(f"wrote {output}: {human_bytes(size)} for {plural(len(patches), 'patch', 'patches')} of {human_bytes(links)} in all")
