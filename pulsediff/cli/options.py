"""Option types shared by several commands."""

from __future__ import annotations

from typing import Annotated

import typer

Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar or messages; errors still go to stderr.")]
Device = Annotated[
    str,
    typer.Option("--device", help="Kernel backend: auto (CUDA when a GPU is usable), cpu or cuda.", envvar="PULSEDIFF_DEVICE"),
]
# Mirrors pulsediff.codecs.DEFAULT_SPARSE_CODEC (importing that would load numba on --help);
# tests/test_cli.py checks they agree.
DEFAULT_CODEC = "ctx-rans"
Codec = Annotated[
    str,
    typer.Option("--codec", help="Codec for changed tensors: ctx-rans (base-context positions, base-relative "
                 "values; smallest) or gap-zstd (the PULSESync paper's)."),
]
Json = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout instead of a table.")]
Precision = Annotated[
    str,
    typer.Option(
        "--precision",
        help="exact: compare every tensor bit for bit in its own dtype. "
        "bf16: compare floating tensors after casting both sides to BF16 (FP32 master weights -> BF16 workers).",
    ),
]
