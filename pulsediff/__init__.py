"""pulsediff: compact, lossless patches between consecutive model checkpoints.

The public API is imported lazily so that `import pulsediff` (and the CLI's
`--help`) stays fast: numba, torch and zstd load only when a function that
needs them is called.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["make_patch", "make_patch_bytes", "apply_patch", "read_patch_header", "checkpoint_digest_of",
           "apply_to_state_dict", "state_dict_digest", "__version__"]


def __getattr__(name: str):
    if name in ("make_patch", "make_patch_bytes"):
        from . import make

        return getattr(make, name)
    if name in ("apply_to_state_dict", "state_dict_digest"):
        from . import live

        return getattr(live, name)
    if name in ("apply_patch", "read_patch_header"):
        from . import apply

        return getattr(apply, name)
    if name == "checkpoint_digest_of":
        from .inspect import checkpoint_digest_of

        return checkpoint_digest_of
    raise AttributeError(f"module 'pulsediff' has no attribute {name!r}")
