"""pulsediff: compact, lossless patches between consecutive model checkpoints.

This module is the public API and nothing else. It is imported lazily so that
`import pulsediff` (and the CLI's `--help`) stays fast: numba, torch and zstd
load only when a function that needs them is called.

The package is layered; each folder imports only from the ones above it in
this list (tests/test_layers.py checks it):
  errors, version, example   every error pulsediff raises; the version; example data
  runtime/                   Ctrl-C deferral, notices, progress
  kernels/                   CPU (Numba) and CUDA (Numba CUDA) kernels; picks a backend
  io/                        checkpoints, model folders, memory, all-or-nothing outputs
  codecs/                    section codecs behind one contract
  format/                    the patch container and header, a patch file opened and checked,
                             digests, the series manifest
  ops/                       make, apply, squash, stats; live tensors
  series/                    publish and catch-up over folders, S3 and HTTP; signing
  cli/                       the typer commands
"""

from __future__ import annotations

from pulsediff.version import __version__

__all__ = ["make_patch", "make_patch_bytes", "apply_patch", "read_patch_header", "checkpoint_digest_of",
           "apply_to_state_dict", "state_dict_digest", "catch_up_state_dict", "publish", "catch_up",
           "plan_catch_up", "__version__"]

# public name -> the module that defines it
_HOMES = {
    "make_patch": "pulsediff.ops.make",
    "make_patch_bytes": "pulsediff.ops.make",
    "apply_patch": "pulsediff.ops.apply",
    "read_patch_header": "pulsediff.format.patch_file",
    "checkpoint_digest_of": "pulsediff.ops.inspect",
    "apply_to_state_dict": "pulsediff.ops.live",
    "state_dict_digest": "pulsediff.ops.live",
    "catch_up_state_dict": "pulsediff.series.catch_up",
    "publish": "pulsediff.series.publish",
    "catch_up": "pulsediff.series.catch_up",
    "plan_catch_up": "pulsediff.series.catch_up",
}


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'pulsediff' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
