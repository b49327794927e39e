"""Section codecs, looked up by the id each section records.

The contract (see `base.Codec`): a codec turns one target tensor, given the
base tensor it replaces, into section bytes plus a small JSON-able `params`
dict, and back. `params` travels in the patch header next to the section, so
decoding needs nothing else. Ids are part of the patch format: an id, once
released, keeps its meaning forever; a changed encoding gets a new id.
"""

from __future__ import annotations

from pulsediff.errors import UnknownCodecError
from pulsediff.codecs.base import Codec
from pulsediff.codecs.ctx_ac import CtxAc
from pulsediff.codecs.ctx_rans import CtxRans
from pulsediff.codecs.full_zstd import FullZstd
from pulsediff.codecs.gap_zstd import GapZstd

REGISTRY: dict[str, Codec] = {c.id: c for c in (GapZstd(), CtxRans(), CtxAc(), FullZstd())}

# Codecs `make --codec` may choose for changed tensors (FullZstd is picked per
# tensor when a sparse encoding would not be smaller).
SPARSE_CODECS = ("gap-zstd", "ctx-rans", "ctx-ac")
# ctx-ac is 10-16% smaller on realistic steps but decodes slower (docs/BENCHMARKS.md): opt-in until it does not.
DEFAULT_SPARSE_CODEC = "ctx-rans"


def get_codec(codec_id: object) -> Codec:
    codec = REGISTRY.get(codec_id) if isinstance(codec_id, str) else None
    if codec is None:
        raise UnknownCodecError(str(codec_id))
    return codec


__all__ = ["Codec", "REGISTRY", "SPARSE_CODECS", "DEFAULT_SPARSE_CODEC", "get_codec"]
