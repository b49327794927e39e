"""`pulsediff digest CKPT`: the digest patches record for a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pulsediff.cli.options import Json, Precision, Quiet


def digest(
    checkpoint: Annotated[Path, typer.Argument(metavar="CKPT", help="A .safetensors file or a folder of shards.")],
    precision: Precision = "exact",
    quiet: Quiet = False,
    as_json: Json = False,
) -> None:
    """Print one line: the digest patches record for CKPT as their base or target (xxh128: and 32 hex digits).

    It hashes the tensors' names, dtypes, shapes and bytes, not the file
    layout: a single file and the same tensors in shards have one digest.
    """
    from pulsediff.ops.inspect import checkpoint_digest_of
    from pulsediff.cli.output import Output

    out = Output(quiet=quiet, as_json=as_json)
    value = checkpoint_digest_of(checkpoint, precision=precision, progress=out.progress())
    if as_json:
        out.json({"path": str(checkpoint), "precision": precision, "digest": value})
    else:
        out.line(value)
