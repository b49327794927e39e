"""`gap-zstd`: the PULSESync paper's codec.

Positions of the changed elements, delta-encoded as gaps (gap[0] = p[0] + 1,
gap[i] = p[i] - p[i-1], so every gap is >= 1) and stored as little-endian
uint32 (uint64 for tensors of 2**32 elements or more), then one zstd frame;
the new elements' exact bit patterns, little-endian, then a second zstd frame.
The section is the two frames back to back.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np

from pulsediff.errors import CorruptPatchError
from pulsediff.codecs.base import Codec, Encoded, Scratch, SectionContext, parse_choice, parse_uint, zstd_compress, zstd_decompress_exact


def gap_width(numel: int) -> int:
    return 4 if numel < 2**32 else 8


class GapZstd(Codec):
    id = "gap-zstd"

    def encode(self, base, target, positions, values, dtype=None, kernels=None) -> Encoded:
        width = gap_width(target.size)
        gaps = np.empty(positions.size, np.dtype(f"<u{width}"))
        if positions.size:
            gaps[0] = positions[0] + 1
            np.subtract(positions[1:], positions[:-1], out=gaps[1:], casting="unsafe")
        gap_frame = zstd_compress(gaps)
        value_frame = zstd_compress(np.ascontiguousarray(values))
        params = {"count": int(positions.size), "gap_width": width, "gap_bytes": len(gap_frame)}
        return Encoded((gap_frame, value_frame), params, index_bytes=len(gap_frame))

    def decode(self, base, payload, params, ctx: SectionContext, kernels: ModuleType, scratch: Scratch) -> np.ndarray:
        count = parse_uint(params, "count", ctx, ctx.numel)
        width = parse_choice(params, "gap_width", ctx, (4, 8))
        gap_bytes = parse_uint(params, "gap_bytes", ctx, len(payload))
        gaps = np.frombuffer(
            zstd_decompress_exact(payload[:gap_bytes], count * width, ctx, "gap stream"), dtype=f"<u{width}"
        )
        values = np.frombuffer(
            zstd_decompress_exact(payload[gap_bytes:], count * ctx.itemsize, ctx, "value stream"),
            dtype=f"<u{ctx.itemsize}",
        )
        positions, bad = kernels.gaps_to_positions(gaps)
        if bad or (count and positions[-1] >= ctx.numel):
            raise CorruptPatchError(ctx.source, f"tensor {ctx.name!r}: changed positions are out of order or out of range")
        out = scratch.take_copy(base)
        if kernels.scatter(out, positions, values):
            raise CorruptPatchError(ctx.source, f"tensor {ctx.name!r}: changed positions are out of range")
        return out
