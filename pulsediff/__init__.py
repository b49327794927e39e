"""pulsediff: compact, lossless patches between consecutive model checkpoints.

The public API is imported lazily so that `import pulsediff` (and the CLI's
`--help`) stays fast: numba, torch and zstd load only when a function that
needs them is called.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["make_patch", "apply_patch", "read_patch_header", "checkpoint_digest_of", "__version__"]


def __getattr__(name: str):
    if name == "make_patch":
        from .make import make_patch

        return make_patch
    if name in ("apply_patch", "read_patch_header"):
        from . import apply

        return getattr(apply, name)
    if name == "checkpoint_digest_of":
        from .inspect import checkpoint_digest_of

        return checkpoint_digest_of
    raise AttributeError(f"module 'pulsediff' has no attribute {name!r}")
