"""`pulsediff apply BASE PATCH... -o OUT` (or `--in-place`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from pulsediff.errors import OutputExistsError, UsageError
from pulsediff.cli.checks import check_output_folder, check_patch_paths
from pulsediff.cli.options import Device, Force, Json, Quiet
from pulsediff.cli.output import Output


def apply(
    base: Annotated[Path, typer.Argument(help="The checkpoint the (first) patch was made from.")],
    patches: Annotated[list[str], typer.Argument(metavar="PATCH...", help="Patch files in order (a chain), or - to read one from stdin.")],
    output: Annotated[Optional[str], typer.Option("--output", "-o", metavar="OUT", help="Where to write the rebuilt checkpoint: a file name, or a folder name when the patch rebuilds a model folder (it must not exist, unless -f).")] = None,
    in_place: Annotated[bool, typer.Option("--in-place", help="Replace BASE with the rebuilt checkpoint (atomically).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="Check the patches and BASE's digest and say what would be written; write nothing (-o and --in-place optional).")] = False,
    device: Device = "auto",
    force: Force = False,
    quiet: Quiet = False,
    as_json: Json = False,
) -> None:
    """Rebuild the target checkpoint from BASE and a patch (or a chain of patches), verified bit for bit."""
    if in_place and output is not None:
        raise UsageError("give one of -o OUT or --in-place, not both")
    if not (in_place or output is not None or dry_run):
        raise UsageError("give -o OUT or --in-place (or -n to check without writing)")
    if output is not None:
        # An existing OUT is refused by apply_chain, once the patch's header has said whether OUT is to be a
        # file or a folder: -f is advised only where it would help.
        check_output_folder(Path(output))
    check_patch_paths(patches, base)
    from pulsediff.ops.apply import apply_chain
    from pulsediff.format.patch_file import verify_patch_file

    out = Output(quiet=quiet, as_json=as_json)
    if dry_run:  # every section's checksum too, where the patch is a file that can be read twice
        for p in patches:
            if p != "-":
                verify_patch_file(p)
    try:
        result = apply_chain(base, patches, output, in_place=in_place, device=device, progress=out.progress(),
                             dry_run=dry_run, force=force)
    except OutputExistsError as exc:  # the library's refusal ("pass force=True"), in the command line's words
        raise OutputExistsError(exc.path) from None
    target = result.header.target_digest
    if as_json:
        out.json({"output": None if result.output is None else str(result.output), "status": result.status,
                  "dry_run": result.dry_run, "patches_applied": result.links_applied,
                  "base_is_target": result.base_is_target, "target_digest": target,
                  "layout": "base" if result.layout_from_base else "patch"})
        return
    would = "would write" if result.dry_run else "wrote"
    if result.base_is_target and (in_place or result.output is None):
        # Applying again where the patch was applied: harmless, as zstd and rsync would say.
        out.info(f"{base} is already up to date: it is the patch's target ({target})")
    elif result.base_is_target:
        # Also what a patch made the wrong way round looks like: `make NEW OLD` applied to OLD.
        state = "is already up to date: it" if result.status == "up-to-date" else "already"
        out.warn(f"{base} {state} is the patch's target ({target}), so the patch changes nothing; "
                 "if you expected a change, OLD and NEW were probably swapped when the patch was made")
        if result.status != "up-to-date":
            out.info(f"{would} {result.output} (a copy of {base})")
    elif result.status == "up-to-date":
        out.info(f"{result.output} is already up to date ({target})")
    else:
        n = result.links_applied
        links = "" if n == 1 else f", {n} patches"
        verified = "all checks passed" if result.dry_run else "verified"
        layout = f", in {base}'s own BF16 file layout" if result.layout_from_base else ""
        if result.output is None:
            out.info(f"would rebuild the target ({target}, {verified}{links}{layout}); "
                     "give -o OUT or --in-place to write it")
        else:
            out.info(f"{would} {result.output} ({target}, {verified}{links}{layout})")
