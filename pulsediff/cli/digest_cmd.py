"""`pulsediff digest CKPT`: the digest patches record for a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .options import Json, Precision


def digest(
    checkpoint: Annotated[Path, typer.Argument(help="A .safetensors file or a folder of shards.")],
    precision: Precision = "exact",
    as_json: Json = False,
) -> None:
    """Print a checkpoint's digest: its tensors' names, dtypes, shapes and bytes, not its file layout."""
    from ..inspect import checkpoint_digest_of
    from .output import Output

    value = checkpoint_digest_of(checkpoint, precision=precision)
    if as_json:
        Output().json({"path": str(checkpoint), "precision": precision, "digest": value})
    else:
        print(value)
