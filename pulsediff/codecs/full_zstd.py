"""`full-zstd`: the whole target tensor's bytes in one zstd frame.

For tensors with no usable base (added, or changed shape or dtype) and for
tensors so densely changed that listing positions would cost more.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np

from pulsediff.codecs.base import Codec, Encoded, Scratch, SectionContext, zstd_compress, zstd_decompress_exact


class FullZstd(Codec):
    id = "full-zstd"

    def encode(self, base, target, positions, values, dtype=None, kernels=None) -> Encoded:
        return Encoded((zstd_compress(target),), {})

    def decode(self, base, payload, params, ctx: SectionContext, kernels: ModuleType, scratch: Scratch) -> np.ndarray:
        raw = zstd_decompress_exact(payload, ctx.numel * ctx.itemsize, ctx, "tensor data")
        return np.frombuffer(raw, dtype=f"<u{ctx.itemsize}")
