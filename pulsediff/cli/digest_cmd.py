"""`pulsediff digest CKPT`: the digest patches record for a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pulsediff.cli.options import DigestSchemeOption, Json, Precision, Quiet


def digest(
    checkpoint: Annotated[Path, typer.Argument(metavar="CKPT", help="A .safetensors file or a folder of shards.")],
    precision: Precision = "exact",
    scheme: DigestSchemeOption = "tree",
    quiet: Quiet = False,
    as_json: Json = False,
) -> None:
    """Print one line: the digest patches record for CKPT as their base or target (xxh3tree: and 32 hex digits).

    It hashes the tensors' names, dtypes, shapes and bytes, not the file layout: a single file and the same tensors in shards have one digest. Patches and series made before format 1.4 name checkpoints by --digest flat (xxh128:).

    What it costs: one read of every tensor, hashed on all cores (about the time `cat CKPT > /dev/null` takes; from the page cache, several GB/s), plus Numba's start the first time (~0.5 s).
    """
    from pulsediff.ops.inspect import checkpoint_digest_of
    from pulsediff.cli.output import Output

    out = Output(quiet=quiet, as_json=as_json)
    value = checkpoint_digest_of(checkpoint, precision=precision, progress=out.progress(), scheme=scheme)
    if as_json:
        out.json({"path": str(checkpoint), "precision": precision, "scheme": scheme, "digest": value})
    else:
        out.line(value)
