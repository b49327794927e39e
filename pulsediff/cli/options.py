"""Option types shared by several commands."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar or messages; errors still go to stderr.")]
Json = Annotated[bool, typer.Option("--json", help="Print the result as one JSON object on stdout (messages still go to stderr).")]
Force = Annotated[bool, typer.Option("--force", "-f", help="Overwrite an existing output.")]
# For commands whose -o takes - (stdout): -f is also what lets binary reach a terminal.
ForceStdout = Annotated[bool, typer.Option("--force", "-f", help="Overwrite an existing output (and write binary to a terminal with -o -).")]
Device = Annotated[
    str,
    typer.Option("--device", metavar="DEVICE", help="Kernel backend: auto (CUDA when a GPU is usable), cpu or cuda.",
                 envvar="PULSEDIFF_DEVICE"),
]
# These mirror pulsediff.codecs (DEFAULT_SPARSE_CODEC, SPARSE_CODECS) and pulsediff.io.checkpoint.PRECISIONS:
# importing those would load numba and numpy on --help. tests/test_cli.py checks they agree.
DEFAULT_CODEC = "ctx-rans"
CODECS = ("ctx-rans", "ctx-ac", "gap-zstd")
PRECISIONS = ("exact", "bf16")
Codec = Annotated[
    Literal["ctx-rans", "ctx-ac", "gap-zstd"],
    typer.Option("--codec", metavar="CODEC", help="Codec for changed tensors: ctx-rans (base-context positions, "
                 "base-relative values), ctx-ac (the same coded adaptively per exponent class: 10-16% smaller, "
                 "decodes slower; format 1.3 readers) or gap-zstd (the PULSESync paper's)."),
]
# Mirrors pulsediff.format.digest.SCHEMES (tests/test_cli.py checks they agree).
DIGEST_SCHEMES = ("tree", "flat")
DigestSchemeOption = Annotated[
    Literal["tree", "flat"],
    typer.Option("--digest", metavar="SCHEME", help="How tensors are hashed: tree (the default; hashed in parallel "
                 "chunks, on a GPU where the tensors are) or flat (one hash per tensor, as before format 1.4: "
                 "with --format-version 1, for appliers older than pulsediff's format 1.4)."),
]
FormatVersion = Annotated[
    Literal["2", "1"],
    typer.Option("--format-version", metavar="MAJOR", help="Patch format to write: 2 (the default; its tensor "
                 "table reads fast for checkpoints of many tensors) or 1 (format 1.5: for appliers older than "
                 "pulsediff's format 2.0)."),
]
Precision = Annotated[
    Literal["exact", "bf16"],
    typer.Option(
        "--precision",
        help="exact: compare every tensor bit for bit in its own dtype. "
        "bf16: compare floating tensors after casting both sides to BF16 (FP32 master weights -> BF16 workers).",
    ),
]
TrustState = Annotated[Optional[Path], typer.Option("--trust-state", metavar="FILE", help="With --trust or --sign: the "
                       "record of the newest manifest accepted per source (under any key), which an older one may not "
                       "undercut; publish --sign also reads it to re-sign a manifest after an interrupted publish. "
                       "Default: trusted-series.json in $XDG_STATE_HOME/pulsediff (~/.local/state/pulsediff).")]
