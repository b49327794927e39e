"""`pulsediff make OLD NEW -o PATCH`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pulsediff.errors import UsageError
from pulsediff.cli.checks import check_output
from pulsediff.cli.options import DEFAULT_CODEC, Codec, Device, DigestSchemeOption, ForceStdout, FormatVersion, Json, Precision, Quiet
from pulsediff.cli.output import Output, human_bytes


def make(
    old: Annotated[Path, typer.Argument(help="Base checkpoint: a .safetensors file or a folder of shards.")],
    new: Annotated[Path, typer.Argument(help="Target checkpoint, same forms.")],
    output: Annotated[str, typer.Option("--output", "-o", metavar="PATCH", help="Patch file to write, or - for stdout.")],
    precision: Precision = "exact",
    codec: Codec = DEFAULT_CODEC,
    device: Device = "auto",
    digest: DigestSchemeOption = "tree",
    format_version: FormatVersion = "2",
    force: ForceStdout = False,
    skip_unsupported: Annotated[bool, typer.Option("--skip-unsupported", help="Leave out of the patch, with a warning, the files of a model folder it cannot carry (weights in other formats such as .bin or .gguf, files over 256 MiB) instead of refusing.")] = False,
    quiet: Quiet = False,
    as_json: Json = False,
) -> None:
    """Diff two checkpoints into a patch.

    For model folders the patch also carries the folder's other files (config.json, tokenizer files, ...), so that `apply -o` rebuilds a folder that loads as it is.
    """
    if as_json and output == "-":
        raise UsageError("--json prints on stdout, which -o - uses for the patch")
    suggested = (new.name.removesuffix(".safetensors") or "patch") + ".pulsediff"  # as ops.make.patch_name, unloaded
    check_output(output, force=force, single_file=("a patch is a single file", suggested))
    from pulsediff.ops.make import make_patch

    out = Output(quiet=quiet, as_json=as_json)
    skipped: list[str] = []
    unrelated: list[str] = []  # found from the headers before the make, said once the patch is written
    header = make_patch(old, new, output, precision=precision, codec=codec, device=device, progress=out.progress(),
                        skip_unsupported=skip_unsupported, skipped=skipped, force=force, digest=digest,
                        unrelated=unrelated, format_version=int(format_version))
    for note in skipped:
        out.warn(f"not carried in the patch: {new}/{note}")
    for reason in unrelated:  # a valid patch, but likely not the one meant: about as large as NEW itself
        out.warn(f"{old} and {new} look like unrelated checkpoints: {reason}")
    changed = sum(t.changed for t in header.tensors)
    total = sum(t.numel for t in header.tensors)
    size = Path(output).stat().st_size if output != "-" else None
    if as_json:
        # "patch_bytes", as stats --json names it; "bytes", its old name here, stays until 0.3
        out.json({"output": output, "patch_bytes": size, "bytes": size, "precision": header.precision, "elements": total,
                  "changed": changed, "base_digest": header.base_digest, "target_digest": header.target_digest,
                  "target_bytes": header.target_bytes, "files": [f.name for f in header.files],
                  "not_carried": skipped, "looks_unrelated": bool(unrelated)})
    elif size is not None:
        out.info(
            f"wrote {output}: {human_bytes(size)} for {changed:,} of {total:,} elements changed "
            f"({100 * changed / max(total, 1):.3f}%), {header.target_bytes / max(size, 1):.1f}x smaller than the target"
        )
