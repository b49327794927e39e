"""`ctx-ac`: ctx-rans's positions and values, coded by adaptive binary models (FORMAT.md 6.4).

The same entries as ctx-rans (per exponent class of the base: ranks within
the class, class by class, and zigzag differences of the bit patterns), so
every walk over the base, on the CPU or the GPU, is shared with it. What
changes is the entropy layer (codecs/adaptive.py):

- values are coded per class: a change's size in units in the last place
  depends on the base element's exponent, and an adaptive model per class
  learns that with no table to send (ctx-rans codes every class with one
  static table per tensor). The signs are a bitmap: each is a coin toss.
- gaps keep ctx-rans's per-class split parameter k, but their high part
  (gap >> k) and the top low bit are coded adaptively, which learns the
  clustering a Rice code assumes away.
- the class table is range-coded too: a few bits per class, not 3-4 bytes.

Section layout: the position part (`position_bytes` long: a range stream
holding the class table and the gaps, then its plain bitstream reversed), the
signs (one bit per entry), then the value stream to the section's end.
"""

from __future__ import annotations

from concurrent.futures import wait

import numpy as np

from pulsediff.errors import CorruptPatchError
from pulsediff.codecs import adaptive
from pulsediff.kernels import entropy
from pulsediff.kernels.ctx_rans_sections import class_major, rice_parameters
from pulsediff.codecs.base import Encoded, SectionContext, parse_uint
from pulsediff.codecs.ctx_rans import CtxRans, Entries, values_executor, class_params


def _position_part(listed, counts, ks, gaps) -> bytes:
    """The range stream (its leading 0 byte dropped), then the plain bitstream reversed. The
    encoder says when its buffers are too small; they grow until it fits."""
    room = 2 * gaps.size + 8 * listed.size + 64
    while True:
        out, raw = np.empty(room, np.uint8), np.empty(room, np.uint8)
        used, raw_used = adaptive.encode_positions(listed, counts, ks, gaps, out, raw)
        if used <= room and raw_used <= room - 8:
            assert out[0] == 0  # LZMA's leading byte, always 0
            return out[1:used].tobytes() + raw[:raw_used][::-1].tobytes()
        room *= 4


def _value_stream(magnitudes, counts) -> bytes:
    """The range stream without its leading 0 byte, cut after its last nonzero byte (the decoder
    reads zeros past the end)."""
    room = magnitudes.size + 64
    while True:
        out = np.empty(room, np.uint8)
        used = adaptive.encode_values(magnitudes, counts, out)
        if used <= room:
            assert out[0] == 0
            return out[1:used].tobytes().rstrip(b"\0")
        room *= 4


def _encode_ranked(classes: np.ndarray, ranks: np.ndarray, zigzag: np.ndarray, shift: int, bits: int) -> Encoded:
    count = classes.size
    counts, gaps, symbols, _, escapes = class_major(classes, ranks, zigzag, 1 << bits, entropy.ESCAPE)
    listed = np.flatnonzero(counts)
    counts = counts[listed]
    # gaps: ranks in, gap - 1 out. ctx-rans's k, without its bound on q (ctx-ac's escape takes any q):
    # the bound would make one far change raise k for its whole class.
    ks, _ = rice_parameters(gaps, counts, 64)
    positions = _position_part(listed, counts, ks, gaps)
    values = symbols.astype(np.uint64)  # the full zigzag deltas, class-major
    if escapes.size:
        values[symbols == entropy.ESCAPE] = escapes.astype(np.uint64)
    negative = values & np.uint64(1)
    signs = np.packbits(negative.astype(np.uint8), bitorder="little").tobytes()
    stream = _value_stream((values >> np.uint64(1)) + negative, counts)  # |d|
    params = {"count": count, "class_shift": shift, "class_bits": bits, "position_bytes": len(positions)}
    return Encoded((positions, signs, stream), params, index_bytes=len(positions))


def _split(payload: bytes, params: dict, ctx: SectionContext):
    """Checked params and the section's parts: the position part, the sign bitmap and the value
    stream."""
    count, shift, bits = class_params(params, ctx)
    if not count:
        raise CorruptPatchError(ctx.source, f"tensor {ctx.name!r}: codec parameter 'count' is 0")
    split = parse_uint(params, "position_bytes", ctx, len(payload))
    sign_bytes = (count + 7) // 8
    if len(payload) - split < sign_bytes:
        raise CorruptPatchError(ctx.source, f"tensor {ctx.name!r}: section parts do not add up to its length")
    data = np.frombuffer(payload, np.uint8)
    return count, shift, bits, data[:split], data[split:split + sign_bytes], data[split + sign_bytes:]


def _damaged(ctx: SectionContext, what: str, status: int) -> CorruptPatchError:
    if status == entropy.OUT_OF_RANGE:
        why = "positions fall outside the tensor" if what == "position" else f"{what} out of range"
        return CorruptPatchError(ctx.source, f"tensor {ctx.name!r}: {why}")
    return CorruptPatchError(ctx.source, f"tensor {ctx.name!r}: {what} stream is damaged")


def _table_room(bits: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    room = min(1 << bits, count)
    return np.empty(room, np.int64), np.empty(room, np.int64), np.empty(room, np.int64)


def _decode_values(counts, signs, values, count: int, ctx: SectionContext, scratch=None) -> np.ndarray:
    """The zigzag deltas, class-major, given the class counts of the position part's table."""
    wide = np.empty(count, np.uint64) if scratch is None else scratch.take(count, np.uint64, "wide")
    status, largest = adaptive.decode_values(signs, values, counts, 8 * ctx.itemsize, wide)
    if status != entropy.OK:
        raise _damaged(ctx, "value", status)
    return _narrowed(wide, largest, scratch)


def _decode_both(positions, signs, values, bits: int, count: int, ctx: SectionContext, scratch):
    """(classes, counts, ranks, deltas) of a section's entries, class-major."""
    ranks = scratch.take(count, np.int64, "ranks")
    classes, counts, ks = _table_room(bits, count)
    # The plain bits are read from the part's end: a reversed copy, read-only where the part is, so that
    # the kernel has one type whatever the part's length (a reversed view of one byte is contiguous,
    # of more is not: Numba compiled this 11 s kernel twice).
    reversed_part = positions[::-1].copy()
    reversed_part.flags.writeable = positions.flags.writeable
    status, listed = adaptive.decode_positions(positions, reversed_part, 1 << bits, count, classes, counts, ks,
                                               ranks, ctx.numel)
    if status != entropy.OK:
        raise _damaged(ctx, "position", status)
    deltas = _decode_values(counts[:listed], signs, values, count, ctx, scratch)
    return classes[:listed], counts[:listed], ranks, deltas


def _narrowed(wide: np.ndarray, largest: int, scratch=None) -> np.ndarray:
    """uint8 deltas where they all fit, as the kernels take them fastest."""
    if largest >= 256:
        return wide
    narrow = np.empty(wide.size, np.uint8) if scratch is None else scratch.take(wide.size, np.uint8, "symbols")
    np.copyto(narrow, wide, casting="unsafe")
    return narrow


def _entries(count, shift, bits, classes, counts, ranks, deltas) -> Entries:
    mask = (1 << bits) - 1
    offsets = np.zeros(mask + 2, np.int64)
    per_class = np.zeros(mask + 1, np.int64)
    per_class[classes] = counts
    np.cumsum(per_class, out=offsets[1:])
    return Entries(count, shift, mask, classes, counts, ranks, deltas, offsets)


class CtxAc(CtxRans):
    id = "ctx-ac"

    @staticmethod
    def _encode_ranked(classes, ranks, zigzag, shift, bits) -> Encoded:
        return _encode_ranked(classes, ranks, zigzag, shift, bits)

    @staticmethod
    def _decode_entries(payload, params, ctx, scratch, during=None, inline=False):
        """The entries, as ctx-rans's. Both streams decode on a second thread while
        `during(shift, mask)` (the count of the base's classes, which needs no entry) runs here:
        ctx-ac's entropy decode is twice ctx-rans's, and this hides it behind that pass where
        there is one (`inline`: all on this thread)."""
        count, shift, bits, positions, signs, values = _split(payload, params, ctx)
        args = (positions, signs, values, bits, count, ctx, scratch)
        if inline:
            found = _decode_both(*args)
            return _entries(count, shift, bits, *found), (during(shift, (1 << bits) - 1) if during else None)
        pending = values_executor().submit(_decode_both, *args)
        try:
            extra = during(shift, (1 << bits) - 1) if during is not None else None
        except BaseException:
            wait([pending])  # it writes into scratch: let it finish before anything else does
            raise
        return _entries(count, shift, bits, *pending.result()), extra

    @staticmethod
    def _zigzag_values(payload, params, ctx) -> np.ndarray:
        count, _, bits, positions, signs, values = _split(payload, params, ctx)
        classes, counts, ks = _table_room(bits, count)
        status, listed = adaptive.decode_table(positions, 1 << bits, count, classes, counts, ks)
        if status != entropy.OK:
            raise _damaged(ctx, "position", status)
        return _decode_values(counts[:listed], signs, values, count, ctx)
