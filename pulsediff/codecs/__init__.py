"""Section codecs, looked up by the id each section records.

The contract (see `base.Codec`): a codec turns one target tensor, given the
base tensor it replaces, into section bytes plus a small JSON-able `params`
dict, and back. `params` travels in the patch header next to the section, so
decoding needs nothing else. Ids are part of the patch format: an id, once
released, keeps its meaning forever; a changed encoding gets a new id.

What a header needs of a codec is in `facts` (no kernels); a codec itself,
with its Numba kernels, is imported on the first `get_codec` of its id, so
that commands that only read headers start without Numba.
"""

from __future__ import annotations

import threading

from typing import TYPE_CHECKING

from pulsediff.codecs.facts import FACTS, facts_of
from pulsediff.errors import UnknownCodecError

if TYPE_CHECKING:
    from pulsediff.codecs.base import Codec

CODEC_IDS = tuple(FACTS)
_loaded: dict[str, Codec] = {}
_loading = threading.Lock()

# Codecs `make --codec` may choose for changed tensors (FullZstd is picked per
# tensor when a sparse encoding would not be smaller).
SPARSE_CODECS = ("gap-zstd", "ctx-rans", "ctx-ac")
# ctx-ac is 10-16% smaller on realistic steps but decodes slower (docs/BENCHMARKS.md): opt-in until it does not.
DEFAULT_SPARSE_CODEC = "ctx-rans"


def get_codec(codec_id: object) -> Codec:
    codec = _loaded.get(codec_id) if isinstance(codec_id, str) else None
    if codec is not None:
        return codec
    facts_of(codec_id)  # UnknownCodecError for an id no codec has
    with _loading:
        if codec_id not in _loaded:
            _loaded[codec_id] = _implementation(codec_id)
        return _loaded[codec_id]


def _implementation(codec_id: str) -> Codec:
    """The codec of a known id, its module imported now (plain imports: tests/test_layers.py sees them)."""
    if codec_id == "gap-zstd":
        from pulsediff.codecs.gap_zstd import GapZstd

        return GapZstd()
    if codec_id == "ctx-rans":
        from pulsediff.codecs.ctx_rans import CtxRans

        return CtxRans()
    if codec_id == "ctx-ac":
        from pulsediff.codecs.ctx_ac import CtxAc

        return CtxAc()
    if codec_id == "full-zstd":
        from pulsediff.codecs.full_zstd import FullZstd

        return FullZstd()
    raise UnknownCodecError(codec_id)  # an id in FACTS without a codec here: a bug, said as plainly


def __getattr__(name: str):
    if name == "Codec":  # the contract's base class, with numpy and zstandard: loaded when asked for
        from pulsediff.codecs.base import Codec

        return Codec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Codec", "CODEC_IDS", "SPARSE_CODECS", "DEFAULT_SPARSE_CODEC", "facts_of", "get_codec"]
