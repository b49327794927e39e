"""`ctx-rans`: positions coded in the base's context, values relative to the base.

Why it is smaller than `gap-zstd`: at RL learning rates whether an element
changes depends mostly on its base magnitude (an update of size lr crosses a
BF16 rounding boundary with probability about lr / ULP(|w|)), and a change is
almost always one unit in the last place. The receiver already holds the base,
so both facts can be used for free:

- positions: every element falls into a *class*, `(base_bits >> shift) & mask`
  (the exponent field for floating types, one class otherwise). Inside a
  class, the changed elements are listed by their rank among that class's
  elements, and the gaps between ranks are Rice-coded with a parameter chosen
  per class: each class is coded at its own density.
- values: delta = new_bits - base_bits modulo 2**width, as a signed integer,
  zigzag-mapped (0, -1, 1, -2, ... -> 0, 1, 2, 3, ...), then a static rANS
  code over min(zigzag, 255) with 255 escaping to the full value, stored
  after. Exact integer arithmetic on bit patterns: no floating point at all.

Section layout (all sizes in params):
    class table   varint count of listed classes, then per class (ascending):
                  varint class, varint changed count, u8 Rice parameter
    positions     Rice codes of (gap - 1), class-major, LSB-first bits
    frequencies   varint count of symbols, then per symbol (ascending):
                  u8 symbol, varint frequency (they sum to 4096)
    values        rANS stream of the symbols, class-major order
    escapes       little-endian width-byte zigzag values for each symbol 255

Safe only against the exact base it was made from: the base digest check
before decoding is mandatory (apply always does it).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor, wait
from functools import partial
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from pulsediff.errors import CorruptPatchError
from pulsediff.kernels import entropy
from pulsediff.kernels.ctx_rans_sections import encode_section  # the section coder as kernels
from pulsediff.codecs.base import Codec, Encoded, Scratch, SectionContext, cpu_if_none, parse_uint, to_host

# (shift, bits) of the exponent field: the class of a base element.
CLASS_FIELDS = {
    "BF16": (7, 8), "F16": (10, 5), "F32": (23, 8), "F64": (52, 11),
    "F8_E4M3": (3, 4), "F8_E5M2": (2, 5), "F8_E8M0": (0, 8),
}
MAX_CLASS_BITS = 12


# One worker: decodes a section's values while the caller decodes its positions.
# Made per process: a forked child inherits the executor but not its thread.
_values_thread: tuple[int, ThreadPoolExecutor] | None = None


def values_executor() -> ThreadPoolExecutor:
    global _values_thread
    if _values_thread is None or _values_thread[0] != os.getpid():
        _values_thread = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="pulsediff-values"))
    return _values_thread[1]


def class_field(dtype_name: str) -> tuple[int, int]:
    return CLASS_FIELDS.get(dtype_name, (0, 0))


# -- varints -----------------------------------------------------------------


def _put_varint(out: bytearray, value: int) -> None:
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return


class _Reader:
    def __init__(self, data: bytes, ctx: SectionContext, what: str):
        self.data, self.pos, self.ctx, self.what = data, 0, ctx, what

    def fail(self, why: str) -> CorruptPatchError:
        return CorruptPatchError(self.ctx.source, f"tensor {self.ctx.name!r}: {self.what}: {why}")

    def varint(self, upper: int) -> int:
        value = shift = 0
        while True:
            if self.pos >= len(self.data) or shift > 63:
                raise self.fail("bad varint")
            byte = self.data[self.pos]
            self.pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        if value > upper:
            raise self.fail("value out of range")
        return value

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise self.fail("truncated")
        self.pos += 1
        return self.data[self.pos - 1]

    def done(self) -> None:
        if self.pos != len(self.data):
            raise self.fail("trailing bytes")


# -- kernels local to this codec ----------------------------------------------


def _zigzag_deltas(base_at: np.ndarray, values: np.ndarray, width_bits: int) -> np.ndarray:
    d = values.astype(np.uint64) - base_at.astype(np.uint64)  # wraps modulo 2**64
    if width_bits < 64:
        d &= np.uint64((1 << width_bits) - 1)
        sign = np.uint64(1 << (width_bits - 1))
        s = (d ^ sign).view(np.int64) - np.int64(1 << (width_bits - 1))  # sign-extend
    else:
        s = d.view(np.int64)
    return ((s << 1) ^ (s >> 63)).view(np.uint64)


class CtxRans(Codec):
    id = "ctx-rans"

    def encode(self, base, target, positions, values, dtype=None, kernels=None) -> Encoded:
        kernels = cpu_if_none(kernels)
        shift, bits = class_field(dtype.name if dtype is not None else "")
        mask = (1 << bits) - 1
        ranks, _ = kernels.class_ranks(base, shift, mask, positions)
        base_at = base[positions]
        classes = ((base_at.astype(np.int64) >> shift) & mask).astype(np.uint16)
        zigzag = _zigzag_deltas(base_at, values, base.dtype.itemsize * 8).astype(base.dtype)
        return self._encode_ranked(classes, ranks, zigzag, shift, bits)

    def encode_pair(self, base, target, dtype=None, kernels=None, max_changed=None):
        """Compare and encode in one read of the pair (kernels.diff_ranks)."""
        changed, encode = self.compare_pair(base, target, dtype, kernels, max_changed)
        return changed, None if encode is None else encode()

    def compare_pair(self, base, target, dtype=None, kernels=None, max_changed=None):
        kernels = cpu_if_none(kernels)
        shift, bits = class_field(dtype.name if dtype is not None else "")
        zigzag, classes, ranks, _ = kernels.diff_ranks(base, target, shift, (1 << bits) - 1)
        if max_changed is not None and zigzag.size > max_changed:
            return zigzag.size, None
        # Device arrays in (the CUDA backend): only these compact entries cross to the host.
        zigzag, classes, ranks = to_host(zigzag), to_host(classes), to_host(ranks)
        return zigzag.size, partial(self._encode_ranked, classes, ranks, zigzag, shift, bits)

    def fuses_checks(self, kernels):
        return hasattr(kernels, "diff_ranks_checked")  # the CPU kernels

    def encode_pair_checked(self, base, target, base_hasher, target_hasher, dtype=None, kernels=None,
                            max_changed=None):
        """encode_pair, the checks taken in its read of the pair (kernels.diff_ranks_checked)."""
        shift, bits = class_field(dtype.name if dtype is not None else "")
        zigzag, classes, ranks, base_sum, target_sum = kernels.diff_ranks_checked(
            base, target, shift, (1 << bits) - 1, base_hasher, target_hasher)
        if zigzag.size == 0 or max_changed is not None and zigzag.size > max_changed:
            return zigzag.size, None, base_sum, target_sum
        return zigzag.size, self._encode_ranked(classes, ranks, zigzag, shift, bits), base_sum, target_sum

    def decode(self, base, payload, params, ctx: SectionContext, kernels: ModuleType, scratch: Scratch) -> np.ndarray:
        # The base's classes are counted while the values decode on the other thread.
        entries, (starts, sizes) = self._decode_entries(payload, params, ctx, scratch,
                                                   lambda shift, mask: kernels.chunk_class_starts(base, shift, mask))
        entries.check_classes(sizes, ctx)
        out = scratch.take(base.size, base.dtype)  # may be `base` itself: a chain decodes in place
        if kernels.apply_ranked(base, entries.shift, entries.mask, starts, entries.offsets, entries.ranks,
                                entries.deltas, out) != entries.count:
            raise CorruptPatchError(ctx.source, f"tensor {ctx.name!r}: positions fall outside the tensor")
        return out

    def decode_alone(self, base, payload, params, ctx: SectionContext, kernels: ModuleType,
                     scratch: Scratch) -> np.ndarray:
        """decode() on the calling thread alone, for a worker rebuilding one of several tensors side
        by side: the values decode here too, and the walk over the base is one range, which needs
        no class count pass before it (that pass only splits a walk across threads). A rank past
        its class is never met by the walk, so the count of applied entries catches it."""
        entries, _ = self._decode_entries(payload, params, ctx, scratch, inline=True)
        out = scratch.take(base.size, base.dtype)  # may be `base` itself: a chain decodes in place
        one_range = np.zeros((1, entries.mask + 1), np.int64)
        if kernels.apply_ranked(base, entries.shift, entries.mask, one_range, entries.offsets, entries.ranks,
                                entries.deltas, out) != entries.count:
            raise CorruptPatchError(ctx.source, f"tensor {ctx.name!r}: positions fall outside the tensor")
        return out

    def decode_changes(self, payload, params, ctx: SectionContext):
        """The entries (ranks and deltas, class-major), decoded on the calling thread into
        buffers of their own."""
        return self._decode_entries(payload, params, ctx, _OwnBuffers(), inline=True)[0]

    def locate(self, base, payload, params, ctx: SectionContext, kernels: ModuleType, scratch: Scratch,
               decoded=None):
        """Positions (entry order, where `base` lives) and zigzag deltas of the changed elements:
        the class sizes and the rank-to-position map run on `base`'s device, the entropy decode
        here (or ahead of time: `decoded`, from decode_changes)."""
        entries = decoded if decoded is not None else self._decode_entries(payload, params, ctx, scratch)[0]
        where, found, sizes = kernels.locate_ranked(base, entries.shift, entries.mask, entries.offsets,
                                                    entries.ranks)
        entries.check_classes(sizes, ctx)
        if found != entries.count:
            raise CorruptPatchError(ctx.source, f"tensor {ctx.name!r}: positions fall outside the tensor")
        return where, entries.deltas

    def add_in_place(self, base, entries: "Entries", ctx: SectionContext, kernels: ModuleType, where, old) -> int:
        """Write the decoded entries (decode_changes) into `base` in place with the walk that finds
        them (kernels.locate_add_summed: one read of the tensor, where locate, add_at and a word sum
        take three); their positions go to `where` (filled with -1) and old values to `old`.
        Returns the change of base's word sum. On a failed check the entries written are put back
        first, so the tensor is as it was."""
        found, change, sizes = kernels.locate_add_summed(base, entries.shift, entries.mask, entries.offsets,
                                                         entries.ranks, entries.deltas, where, old)
        try:
            entries.check_classes(sizes, ctx)
            if found != entries.count:
                raise CorruptPatchError(ctx.source, f"tensor {ctx.name!r}: positions fall outside the tensor")
        except CorruptPatchError:
            kernels.scatter(base, where, old)  # the entries not found (-1) are skipped
            raise
        return change

    def decode_stream(self, parts, payload, params, ctx: SectionContext, kernels: ModuleType, scratch: Scratch):
        """The target bits as consecutive windows, one per window of the base taken from `parts`
        (the base's own windows, or in a chain the previous link's); they must add up to the
        tensor's ctx.numel elements.

        Each window is counted (class histogram) and rebuilt while it is hot in
        the cache, so the base is read from memory once; memory stays at two
        windows whatever the tensor's size. Windows come from
        `scratch.alternate`: one stays valid while the next is made. The
        class-size and count checks run before the last window is yielded.
        """
        entries, _ = self._decode_entries(payload, params, ctx, scratch)
        seen = np.zeros(entries.mask + 1, np.int64)  # class sizes of the windows so far
        offsets, ranks, deltas = kernels.resident(entries.offsets, entries.ranks, entries.deltas)  # once per tensor
        applied = done = 0
        for part in parts:
            done += part.size
            if done > ctx.numel:
                raise CorruptPatchError(ctx.source, f"tensor {ctx.name!r}: the base has more than its "
                                                    f"{ctx.numel} elements")
            out = scratch.alternate(part.size, part.dtype, "window")
            applied += kernels.ranked_window(part, entries.shift, entries.mask, seen, offsets, ranks, deltas, out)
            if done == ctx.numel:
                entries.check_classes(seen, ctx)
                if applied != entries.count:
                    raise CorruptPatchError(ctx.source, f"tensor {ctx.name!r}: positions fall outside the tensor")
            yield out
        if done != ctx.numel:
            raise CorruptPatchError(ctx.source, f"tensor {ctx.name!r}: the base has {done} elements, "
                                                f"not {ctx.numel}")
        if done == 0 and entries.count:
            raise CorruptPatchError(ctx.source, f"tensor {ctx.name!r}: positions fall outside the tensor")

    def value_deltas(self, payload, params, ctx: SectionContext) -> np.ndarray:
        """Signed bit-pattern differences of the changed elements (no base needed)."""
        zigzag = self._zigzag_values(payload, params, ctx).astype(np.uint64)
        return ((zigzag >> np.uint64(1)) ^ (np.uint64(0) - (zigzag & np.uint64(1)))).view(np.int64)

    # The entropy layer, which ctx-ac replaces: everything above works on the entries it yields.

    @staticmethod
    def _encode_ranked(classes, ranks, zigzag, shift, bits) -> Encoded:
        return _encode_ranked(classes, ranks, zigzag, shift, bits)

    @staticmethod
    def _decode_entries(payload, params, ctx, scratch, during=None, inline=False):
        return _decode_entries(payload, params, ctx, scratch, during, inline)

    @staticmethod
    def _zigzag_values(payload, params, ctx) -> np.ndarray:
        """The zigzag deltas, class-major, with no base."""
        count, _, _, n_escapes, parts = _split(payload, params, ctx)
        return _decode_values(parts[2], parts[3], parts[4], count, n_escapes, ctx)


def _encode_ranked(classes: np.ndarray, ranks: np.ndarray, zigzag: np.ndarray, shift: int, bits: int) -> Encoded:
    """The section for changed elements given (in position order) by class, rank in class and zigzag delta."""
    out, end, *lengths, escapes = encode_section(classes, ranks, zigzag, bits, np.empty(0, np.uint8), 0)
    return encoded_at(out[:end].tobytes(), 0, int(classes.size), shift, bits, lengths, escapes, zigzag.itemsize)


def encoded_at(data, at: int, count: int, shift: int, bits: int, lengths, escapes: int, width: int) -> Encoded:
    """The section that encode_section wrote at data[at:] (bytes or a memoryview), given its
    table, position, frequency and value byte counts (`lengths`) and its escapes, as an Encoded:
    its parts slices of `data`, its params those this codec records."""
    parts = []
    for n in (*lengths, escapes * width):
        parts.append(data[at:at + n])
        at += n
    params = {
        "count": count, "class_shift": shift, "class_bits": bits,
        "table_bytes": lengths[0], "position_bytes": lengths[1],
        "frequency_bytes": lengths[2], "value_bytes": lengths[3], "escapes": escapes,
    }
    return Encoded(tuple(parts), params, index_bytes=lengths[0] + lengths[1])


class _OwnBuffers(Scratch):
    """Fresh buffers from the allocator, one per take, for entries that outlive the call.

    Not Scratch's pre-populated shared maps: those pay for reuse, and a buffer taken once
    and dropped paid its page population alone, 3.3 ms of a 20 ms decode of 490K changes
    (scripts/bench_live_decode.py)."""

    def take(self, count: int, dtype, slot: str = "out") -> np.ndarray:
        return np.empty(count, dtype)


@dataclass
class Entries:
    """A section's changed elements, class-major: rank in class and zigzag delta of each."""

    count: int
    shift: int
    mask: int
    classes: np.ndarray  # listed classes, ascending
    counts: np.ndarray  # changed elements per listed class
    ranks: np.ndarray
    deltas: np.ndarray
    offsets: np.ndarray  # offsets[c]: first entry of class c (mask + 2 entries)

    def check_classes(self, sizes: np.ndarray, ctx: SectionContext) -> None:
        """Every rank must fall inside its class of the base (sizes: the base's class sizes)."""
        listed = self.counts > 0
        last_ranks = self.ranks[np.cumsum(self.counts)[listed] - 1]  # ranks ascend within a class
        if (last_ranks >= sizes[self.classes[listed]]).any():
            raise CorruptPatchError(ctx.source, f"tensor {ctx.name!r}: positions fall outside their class")


def _decode_entries(payload: bytes, params: dict, ctx: SectionContext, scratch: Scratch, during=None,
                    inline: bool = False):
    """Decode a section's class table, ranks and deltas; `during(shift, mask)`, if given,
    runs on this thread while the values decode on another (`inline`: on this one, after the
    ranks). Returns (entries, its result)."""
    count, shift, mask, n_escapes, (table, pos_bytes, freq_bytes, rans_bytes, esc_bytes) = _split(payload, params, ctx)
    reader = _Reader(table, ctx, "class table")
    listed = reader.varint(mask + 1)
    classes = np.empty(listed, np.int64)
    counts = np.empty(listed, np.int64)
    ks = np.empty(listed, np.int64)
    for m in range(listed):
        classes[m] = reader.varint(mask)
        counts[m] = reader.varint(count)
        ks[m] = reader.byte()
        if ks[m] > 62 or (m and classes[m] <= classes[m - 1]):
            raise reader.fail("classes out of order or bad Rice parameter")
    reader.done()
    if int(counts.sum()) != count:
        raise reader.fail("class counts do not add up")
    # The value stream is independent of the positions: decode it on a second
    # core (the entropy decoders are sequential and release the GIL).
    symbols = scratch.take(count, np.uint8, "symbols")
    decode_values = (freq_bytes, rans_bytes, esc_bytes, count, n_escapes, ctx, symbols)
    values = None if inline else values_executor().submit(_decode_values, *decode_values)
    try:
        # positions: ranks within classes, bounded by the tensor here and by
        # each class's size once the base's classes are counted
        ranks = scratch.take(count, np.int64, "ranks")
        bound = np.full(listed, ctx.numel, np.int64)
        status, used = entropy.rice_decode(np.frombuffer(pos_bytes, np.uint8), ks, counts, ranks, bound)
        if status == entropy.OUT_OF_RANGE:
            raise CorruptPatchError(ctx.source, f"tensor {ctx.name!r}: positions fall outside the tensor")
        if status != entropy.OK or used != len(pos_bytes):
            raise CorruptPatchError(ctx.source, f"tensor {ctx.name!r}: position stream is damaged")
        extra = during(shift, mask) if during is not None else None
    except BaseException:
        if values is not None:
            wait([values])  # it writes into scratch: let it finish before anything else does
        raise
    deltas = _decode_values(*decode_values) if values is None else values.result()
    offsets = np.zeros(mask + 2, np.int64)
    per_class = np.zeros(mask + 1, np.int64)
    per_class[classes] = counts
    np.cumsum(per_class, out=offsets[1:])
    return Entries(count, shift, mask, classes, counts, ranks, deltas, offsets), extra


def class_params(params: dict, ctx: SectionContext) -> tuple[int, int, int]:
    """The checked count, class shift and class bits (FORMAT.md 6.3, shared by 6.4)."""
    count = parse_uint(params, "count", ctx, ctx.numel)
    shift = parse_uint(params, "class_shift", ctx, 63)
    bits = parse_uint(params, "class_bits", ctx, MAX_CLASS_BITS)
    if shift + bits > 8 * ctx.itemsize:  # FORMAT.md 6.3: the class field lies inside the element
        raise CorruptPatchError(ctx.source, f"tensor {ctx.name!r}: class field (shift {shift}, {bits} bits) "
                                            f"does not fit {8 * ctx.itemsize}-bit elements")
    return count, shift, bits


_LAYOUT_KEYS = ("count", "class_shift", "class_bits", "escapes", "table_bytes", "position_bytes", "frequency_bytes",
                "value_bytes")


def section_layout(params: dict, ctx: SectionContext, length: int) -> tuple[int, int, int, int, list[int]]:
    """Checked params of a section of `length` bytes: (count, class shift, class mask, escapes,
    the byte lengths of its table, positions, frequencies and values; the escapes fill the rest).

    Params that pass every check at once take a path of plain comparisons (an MoE patch has
    18k sections; the checks one by one cost 15 us each); any other goes through the checks
    one by one, which name what is wrong."""
    try:
        count, shift, bits, n_escapes, *lengths = values = [params[key] for key in _LAYOUT_KEYS]
    except (KeyError, TypeError):
        values = ()
    if all(type(v) is int for v in values) and values and 0 <= count <= ctx.numel and 0 <= shift <= 63 \
            and 0 <= bits <= MAX_CLASS_BITS and shift + bits <= 8 * ctx.itemsize and 0 <= n_escapes <= count \
            and all(0 <= n <= length for n in lengths) and sum(lengths) + n_escapes * ctx.itemsize == length:
        return count, shift, (1 << bits) - 1, n_escapes, lengths
    return _checked_layout(params, ctx, length)


def _checked_layout(params: dict, ctx: SectionContext, length: int) -> tuple[int, int, int, int, list[int]]:
    count, shift, bits = class_params(params, ctx)
    n_escapes = parse_uint(params, "escapes", ctx, count)
    lengths = [parse_uint(params, key, ctx, length) for key in
               ("table_bytes", "position_bytes", "frequency_bytes", "value_bytes")]
    if sum(lengths) + n_escapes * ctx.itemsize != length:
        raise CorruptPatchError(ctx.source, f"tensor {ctx.name!r}: section parts do not add up to its length")
    return count, shift, (1 << bits) - 1, n_escapes, lengths


def _split(payload: bytes, params: dict, ctx: SectionContext):
    """Checked params and the section's five parts."""
    count, shift, mask, n_escapes, lengths = section_layout(params, ctx, len(payload))
    bounds = np.cumsum([0, *lengths, n_escapes * ctx.itemsize])
    parts = tuple(payload[bounds[i]:bounds[i + 1]] for i in range(5))
    return count, shift, mask, n_escapes, parts


def _decode_values(freq_bytes: bytes, rans_bytes: bytes, esc_bytes: bytes, count: int, n_escapes: int,
                   ctx: SectionContext, symbols: np.ndarray | None = None) -> np.ndarray:
    """The zigzag-coded differences, in class-major order (decoded into `symbols` when given)."""
    reader = _Reader(freq_bytes, ctx, "frequency table")
    freqs = np.zeros(256, np.int64)
    last = -1
    for _ in range(reader.varint(256)):
        s = reader.byte()
        if s <= last:
            raise reader.fail("symbols out of order")
        freqs[s] = reader.varint(entropy.PROB_SCALE)
        last = s
    reader.done()
    if count and freqs.sum() != entropy.PROB_SCALE:
        raise reader.fail("frequencies do not sum to the scale")
    cums, slot_to_symbol = entropy.rans_tables(freqs)
    if symbols is None:
        symbols = np.empty(count, np.uint8)
    if count and entropy.rans_decode(np.frombuffer(rans_bytes, np.uint8), freqs, cums, slot_to_symbol, symbols) != entropy.OK:
        raise CorruptPatchError(ctx.source, f"tensor {ctx.name!r}: value stream is damaged")
    escaped = symbols == entropy.ESCAPE
    if int(escaped.sum()) != n_escapes:
        raise CorruptPatchError(ctx.source, f"tensor {ctx.name!r}: escape count mismatch")
    if not n_escapes:
        return symbols  # uint8 is enough, and a widening copy of every value would cost more than the decode
    zigzag = symbols.astype(np.uint64)
    zigzag[escaped] = np.frombuffer(esc_bytes, f"<u{ctx.itemsize}").astype(np.uint64)
    return zigzag
