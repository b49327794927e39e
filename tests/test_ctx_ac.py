"""ctx-ac (FORMAT.md 6.4) against a plain-Python coder written from the spec, bit for bit.

The reference below knows nothing of the Numba kernels: its range coder, contexts and layout come
from FORMAT.md's text. The encoder must write the reference's bytes; the decoder must agree with the
reference's decoder on valid sections and on damaged ones (both refuse, or both rebuild the same
tensor), damage being made behind a valid section checksum as an attacker would.
"""

from __future__ import annotations

import numpy as np
import pytest

from pulsediff.codecs import get_codec
from pulsediff.codecs.base import Scratch, SectionContext
from pulsediff.errors import CorruptPatchError
from pulsediff.io.dtypes import DTYPES
from pulsediff.kernels import cpu

from reference import diff_ranks_ref


class Refused(Exception):
    """The reference decoder's refusal."""


# -- the spec's parts, in plain Python ------------------------------------------------------------


class Context:
    def __init__(self):
        self.n = [0, 0]

    def p(self) -> int:
        n0, n1 = self.n
        return (2 * n0 + 1) * (2**32 // (2 * (n0 + n1) + 2)) >> 20

    def update(self, bit: int) -> None:
        self.n[bit] += 1
        if sum(self.n) >= 256:
            self.n = [(x + 1) // 2 for x in self.n]

    def start_class(self) -> None:
        t = sum(self.n)
        if t > 6:
            n0 = (6 * self.n[0] + t // 2) // t
            self.n = [n0, 6 - n0]


class Encoder:
    """LZMA's range encoder."""

    def __init__(self):
        self.low, self.range, self.cache, self.pending, self.out = 0, 2**32 - 1, 0, 1, bytearray()

    def _shift_low(self):
        if self.low < 0xFF000000 or self.low >= 2**32:
            carry, byte = self.low >> 32, self.cache
            while self.pending:
                self.out.append((byte + carry) & 0xFF)
                byte, self.pending = 0xFF, self.pending - 1
            self.cache = (self.low >> 24) & 0xFF
        self.pending += 1
        self.low = (self.low & 0xFFFFFF) << 8

    def _normalise(self):
        while self.range < 2**24:
            self.range <<= 8
            self._shift_low()

    def bit(self, ctx: Context, bit: int):
        bound = (self.range >> 12) * ctx.p()
        if bit:
            self.low, self.range = self.low + bound, self.range - bound
        else:
            self.range = bound
        ctx.update(bit)
        self._normalise()

    def direct(self, value: int, nbits: int):
        for j in reversed(range(nbits)):
            self.range >>= 1
            if (value >> j) & 1:
                self.low += self.range
            self._normalise()

    def finish(self, shortest: bool) -> bytes:
        if shortest:  # the value in [low, low + range) with the most trailing zero bits
            top = self.low + self.range - 1
            self.low = next(v for s in range(32, -1, -1) if (v := -(-self.low >> s) << s) <= top)
        for _ in range(5):
            self._shift_low()
        assert self.out[0] == 0
        out = bytes(self.out[1:])
        return out.rstrip(b"\0") if shortest else out


class Decoder:
    def __init__(self, data: bytes):
        self.data, self.pos, self.range = data, 4, 2**32 - 1
        self.code = int.from_bytes(self._bytes(0, 4), "big")

    def _bytes(self, lo, hi) -> bytes:
        return bytes(self.data[i] if i < len(self.data) else 0 for i in range(lo, hi))

    def _normalise(self):
        while self.range < 2**24:
            self.range <<= 8
            self.code = ((self.code << 8) & 0xFFFFFFFF) | self._bytes(self.pos, self.pos + 1)[0]
            self.pos += 1

    def bit(self, ctx: Context) -> int:
        bound = (self.range >> 12) * ctx.p()
        if self.code < bound:
            bit, self.range = 0, bound
        else:
            bit, self.code, self.range = 1, self.code - bound, self.range - bound
        ctx.update(bit)
        self._normalise()
        return bit

    def direct(self, nbits: int) -> int:
        value = 0
        for _ in range(nbits):
            self.range >>= 1
            bit = int(self.code >= self.range)
            self.code -= self.range * bit
            value = value << 1 | bit
            self._normalise()
        return value


def escape_bits(value: int) -> tuple[int, int]:
    r = value + 1
    return r, r.bit_length() - 1


def encode_escape(enc: Encoder, ctxs: list[Context], first: int, value: int, plain: list[int] | None):
    r, e = escape_bits(value)
    for j in range(e + 1):
        enc.bit(ctxs[first + min(j, 23)], int(j < e))
    if plain is None:
        enc.direct(r, e)
    else:
        plain += [(r >> j) & 1 for j in range(e)]


def decode_escape(dec: Decoder, ctxs: list[Context], first: int, limit: int, plain) -> int:
    e = 0
    while dec.bit(ctxs[first + min(e, 23)]):
        e += 1
        if e > limit:
            raise Refused("escape too long")
    low = dec.direct(e) if plain is None else plain(e)
    return ((1 << e) | low) - 1


def zigzag(a: int) -> int:
    return 2 * a if a >= 0 else -2 * a - 1


def rice_k(gaps: list[int]) -> int:
    """ctx-rans's Rice parameter without its bound on q: pulsediff's writer's choice, not the format's."""
    cost = lambda k: sum(g >> k for g in gaps) + len(gaps) * (k + 1)  # noqa: E731
    guess = max(0, int(np.log2(float(sum(gaps)) / len(gaps) + 1.0)))
    return min((k for k in (guess - 1, guess, guess + 1) if 0 <= k <= 62), key=lambda k: (cost(k), k))


def section_ref(base: np.ndarray, target: np.ndarray, dtype) -> tuple[bytes, dict]:
    """A ctx-ac section and its params, written from FORMAT.md 6.4."""
    from pulsediff.codecs.ctx_rans import class_field

    shift, bits = class_field(dtype.name)
    width = 8 * base.dtype.itemsize
    zz, classes, ranks, _ = diff_ranks_ref(base, target, shift, (1 << bits) - 1)
    by_class: dict[int, list[tuple[int, int]]] = {}
    for z, c, r in zip(zz.tolist(), classes.tolist(), ranks.tolist()):
        by_class.setdefault(c, []).append((r, z))
    listed = sorted(by_class)
    gaps = {c: [r - prev - 1 for (r, _), prev in zip(by_class[c], [-1] + [r for r, _ in by_class[c][:-1]])]
            for c in listed}
    ks = {c: rice_k(gaps[c]) for c in listed}

    enc, ctxs, plain = Encoder(), [Context() for _ in range(131)], []
    encode_escape(enc, ctxs, 35, len(listed) - 1, None)
    previous_class, previous_k = -1, 0
    for c in listed:
        encode_escape(enc, ctxs, 59, c - previous_class - 1, None)
        encode_escape(enc, ctxs, 83, len(gaps[c]) - 1, None)
        encode_escape(enc, ctxs, 107, zigzag(ks[c] - previous_k), None)
        previous_class, previous_k = c, ks[c]
    for m, c in enumerate(listed):
        if m:
            for ctx in ctxs:
                ctx.start_class()
        k = ks[c]
        for u in gaps[c]:
            q = u >> k
            enc.bit(ctxs[0], int(q >= 2))
            if q >= 2:
                enc.bit(ctxs[2], int(q >= 3))
            else:
                enc.bit(ctxs[1], int(q == 1))
            if q >= 3:
                for j in range(3, 8):
                    enc.bit(ctxs[j], int(q > j))
                    if q <= j:
                        break
                else:
                    encode_escape(enc, ctxs, 8, q - 8, plain)
            if k:
                enc.bit(ctxs[32 + min(q, 2)], (u >> (k - 1)) & 1)
                plain += [(u >> j) & 1 for j in range(k - 1)]
    plain_bytes = bytearray((len(plain) + 7) // 8)
    for i, b in enumerate(plain):
        plain_bytes[i >> 3] |= b << (i & 7)
    positions = enc.finish(shortest=False) + bytes(reversed(plain_bytes))

    deltas = [(z >> 1) ^ -(z & 1) for c in listed for _, z in by_class[c]]  # zigzag back to d
    signs = bytearray((len(deltas) + 7) // 8)
    for i, d in enumerate(deltas):
        signs[i >> 3] |= int(d < 0) << (i & 7)
    enc, ctxs, i = Encoder(), [Context() for _ in range(28)], 0
    for m, c in enumerate(listed):
        if m:
            for ctx in ctxs:
                ctx.start_class()
        for _ in by_class[c]:
            v = abs(deltas[i]) - 1
            i += 1
            for j in range(4):
                enc.bit(ctxs[j], int(v > j))
                if v <= j:
                    break
            else:
                encode_escape(enc, ctxs, 4, v - 4, None)
    assert all(abs(d) <= 2 ** (width - 1) for d in deltas)
    params = {"count": len(deltas), "class_shift": shift, "class_bits": bits, "position_bytes": len(positions)}
    return positions + bytes(signs) + enc.finish(shortest=True), params


def decode_ref(base: np.ndarray, payload: bytes, params: dict) -> np.ndarray:
    """The target from a ctx-ac section, by FORMAT.md 6.4; Refused where a reader MUST refuse."""
    n, s, b, p = (params.get(key) for key in ("count", "class_shift", "class_bits", "position_bytes"))
    width, numel = 8 * base.dtype.itemsize, base.size
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (n, s, b, p)):
        raise Refused("params")
    if not (1 <= n <= numel and 0 <= s <= 63 and 0 <= b <= 12 and s + b <= width and 0 <= p <= len(payload)):
        raise Refused("params out of range")
    signs_at = p + (n + 7) // 8
    if len(payload) < signs_at:
        raise Refused("parts")
    part = payload[:p]
    x = [int(v) for v in base.tolist()]
    cls = [(v >> s) & ((1 << b) - 1) for v in x]
    sizes: dict[int, int] = {}
    for c in cls:
        sizes[c] = sizes.get(c, 0) + 1

    dec, ctxs = Decoder(part), [Context() for _ in range(131)]
    plain_bits = [(part[p - 1 - (i >> 3)] >> (i & 7)) & 1 for i in range(8 * p)]
    taken = [0]

    def plain(nbits: int) -> int:
        if taken[0] + nbits > len(plain_bits):
            raise Refused("plain bitstream ends")
        value = sum(bit << j for j, bit in enumerate(plain_bits[taken[0]:taken[0] + nbits]))
        taken[0] += nbits
        return value

    listed = decode_escape(dec, ctxs, 35, 62, None) + 1
    if listed > 2**b or listed > n:
        raise Refused("listed")
    table, previous_class, previous_k, total = [], -1, 0, 0
    for _ in range(listed):
        c = previous_class + decode_escape(dec, ctxs, 59, 62, None) + 1
        count = decode_escape(dec, ctxs, 83, 62, None) + 1
        k_zig = decode_escape(dec, ctxs, 107, 62, None)
        k = previous_k + (k_zig >> 1 if k_zig % 2 == 0 else -((k_zig + 1) >> 1))
        total += count
        if c >= 2**b or total > n or not 0 <= k <= 62:
            raise Refused("table")
        table.append((c, count, k))
        previous_class, previous_k = c, k
    if total != n:
        raise Refused("counts")
    entries = []  # (class, rank)
    for m, (c, count, k) in enumerate(table):
        if m:
            for ctx in ctxs:
                ctx.start_class()
        rank = -1
        for _ in range(count):
            if dec.bit(ctxs[0]):
                q = 2 + dec.bit(ctxs[2])
            else:
                q = dec.bit(ctxs[1])
            if q == 3:
                for j in range(3, 8):
                    if not dec.bit(ctxs[j]):
                        q = j
                        break
                else:
                    q = decode_escape(dec, ctxs, 8, 62, plain) + 8
            if q << k >= numel:
                raise Refused("gap")
            u = q << k
            if k:
                u |= dec.bit(ctxs[32 + min(q, 2)]) << (k - 1) | plain(k - 1)
            rank += u + 1
            if rank >= numel:
                raise Refused("rank")
            entries.append((c, rank))
    plain_bytes = -(-taken[0] // 8)
    if dec.pos + plain_bytes != p or any(plain_bits[taken[0]:8 * plain_bytes]):
        raise Refused("position part end")

    signs = payload[p:signs_at]
    if n % 8 and signs[-1] >> (n % 8):
        raise Refused("sign padding")
    stream = payload[signs_at:]
    dec, ctxs, out = Decoder(stream), [Context() for _ in range(28)], list(x)
    i = 0
    for m, (c, count, _) in enumerate(table):
        if m:
            for ctx in ctxs:
                ctx.start_class()
        for _ in range(count):
            for j in range(4):
                if not dec.bit(ctxs[j]):
                    v = j
                    break
            else:
                v = decode_escape(dec, ctxs, 4, width - 2, None) + 4
            negative = (signs[i >> 3] >> (i & 7)) & 1
            if v + 1 > 2 ** (width - 1) or (v + 1 == 2 ** (width - 1) and not negative):
                raise Refused("value")
            d = -(v + 1) if negative else v + 1
            cls_c, rank = entries[i]
            positions = [j for j, cj in enumerate(cls) if cj == cls_c]
            if rank >= len(positions):
                raise Refused("rank past its class")
            out[positions[rank]] = (x[positions[rank]] + d) % 2**width
            i += 1
    if dec.pos < len(stream) or (stream and stream[-1] == 0):
        raise Refused("value stream end")
    return np.array(out, dtype=base.dtype)


# -- tests ----------------------------------------------------------------------------------------


def random_pair(rng, dtype, n: int, density: float, far: float = 0.1):
    base = rng.integers(0, np.iinfo(dtype).max, n, dtype=dtype, endpoint=True)
    target = base.copy()
    hit = rng.random(n) < density
    target[hit] += rng.integers(1, 4, int(hit.sum())).astype(dtype)
    target[hit & (rng.random(n) < far)] ^= dtype(0x55)  # far jumps: escapes
    target[hit & (rng.random(n) < 0.3)] -= dtype(4)  # negative differences
    return base, target


CASES = [("BF16", np.uint16, 3000, 0.05), ("F32", np.uint32, 2000, 0.05), ("F8_E4M3", np.uint8, 2500, 0.05),
         ("I64", np.uint64, 500, 0.2), ("BF16", np.uint16, 400, 1.0), ("F16", np.uint16, 5, 1.0)]


@pytest.mark.parametrize("name,dtype,n,density", CASES)
def test_ctx_ac_encoder_writes_the_references_bytes(name, dtype, n, density):
    """Both encoder entries (fused encode_pair, and encode from positions) write the reference's bytes."""
    rng = np.random.default_rng(n)
    base, target = random_pair(rng, dtype, n, density)
    codec = get_codec("ctx-ac")
    expected, params = section_ref(base, target, DTYPES[name])
    changed, enc = codec.encode_pair(base, target, dtype=DTYPES[name], kernels=cpu)
    assert changed == int((base != target).sum())
    assert b"".join(enc.parts) == expected and enc.params == params
    positions = np.flatnonzero(base != target).astype(np.int64)
    enc2 = codec.encode(base, target, positions, target[positions], dtype=DTYPES[name], kernels=cpu)
    assert b"".join(enc2.parts) == expected
    assert decode_ref(base, expected, params).tobytes() == target.tobytes()


def extreme_pair(dtype):
    """Differences of every size up to the largest a W-bit element allows, -2**(W-1) included."""
    width = 8 * np.dtype(dtype).itemsize
    ds = [1, -1, 2, -2, 4, 5, -5, 100, -1000, 2 ** (width - 1) - 1, -(2 ** (width - 1)), 2 ** (width - 2), -3]
    base = np.arange(len(ds) * 3, dtype=dtype) * dtype(3)
    target = base.copy()
    for i, d in enumerate(ds):
        target[3 * i] = dtype((int(base[3 * i]) + d) % 2**width)
    return base, target


@pytest.mark.parametrize("name,dtype", [("BF16", np.uint16), ("F32", np.uint32), ("F64", np.uint64),
                                        ("F8_E5M2", np.uint8)])
def test_ctx_ac_differences_of_every_size_round_trip(name, dtype):
    base, target = extreme_pair(dtype)
    codec = get_codec("ctx-ac")
    expected, params = section_ref(base, target, DTYPES[name])
    _, enc = codec.encode_pair(base, target, dtype=DTYPES[name], kernels=cpu)
    assert b"".join(enc.parts) == expected
    ctx = SectionContext("t", base.size, base.dtype.itemsize, "test")
    assert codec.decode(base, expected, params, ctx, cpu, Scratch()).tobytes() == target.tobytes()


def codec_decode(codec, base, payload, params):
    """The codec's three decode paths, which must agree: the target, or CorruptPatchError."""
    ctx = SectionContext("t", base.size, base.dtype.itemsize, "test")
    results = []
    for decode in (codec.decode, codec.decode_alone):
        try:
            results.append(decode(base.copy(), payload, params, ctx, cpu, Scratch()).tobytes())
        except CorruptPatchError:
            results.append(None)
    try:
        out = base.copy()
        where, deltas = codec.locate(base, payload, params, ctx, cpu, Scratch())
        d = deltas.astype(np.uint64)
        out[where] = (base[where].astype(np.uint64) + ((d >> np.uint64(1)) ^ (np.uint64(0) - (d & np.uint64(1))))
                      ).astype(base.dtype)
        results.append(out.tobytes())
    except CorruptPatchError:
        results.append(None)
    assert results[0] == results[1] == results[2], "decode, decode_alone and locate disagree"
    return results[0]


@pytest.mark.parametrize("seed", range(6))
def test_ctx_ac_decoder_agrees_with_the_reference_on_damaged_sections(seed):
    """Bytes flipped, cut and added, and params changed: the decoder refuses exactly when the
    reference does, and otherwise rebuilds the reference's tensor. Never anything else."""
    rng = np.random.default_rng(100 + seed)
    name, dtype = [("BF16", np.uint16), ("F32", np.uint32), ("F8_E4M3", np.uint8)][seed % 3]
    base, target = random_pair(rng, dtype, 600, 0.08)
    codec = get_codec("ctx-ac")
    payload, params = section_ref(base, target, DTYPES[name])
    refused = agreed = 0
    for trial in range(60):
        body, p = bytearray(payload), dict(params)
        kind = trial % 5
        if kind == 0:
            for _ in range(1 + trial % 3):
                body[int(rng.integers(0, len(body)))] ^= 1 << int(rng.integers(0, 8))
        elif kind == 1:
            body = body[:int(rng.integers(0, len(body)))]
            p["position_bytes"] = min(p["position_bytes"], len(body))
        elif kind == 2:
            body += bytes(rng.integers(0, 256, int(rng.integers(1, 4)), dtype=np.uint8))
        elif kind == 3:
            p["position_bytes"] += int(rng.integers(-3, 4))
        else:
            p[str(rng.choice(["count", "class_shift", "class_bits"]))] += int(rng.integers(-2, 3))
        try:
            expected = decode_ref(base, bytes(body), p).tobytes()
        except (Refused, IndexError):
            expected = None
        got = codec_decode(codec, base, bytes(body), p)
        assert got == expected, (trial, kind)
        refused += expected is None
        agreed += expected is not None
    assert refused and agreed  # both outcomes were exercised


def test_ctx_ac_refuses_params_that_do_not_fit():
    base, target = random_pair(np.random.default_rng(7), np.uint16, 300, 0.1)
    codec = get_codec("ctx-ac")
    payload, params = section_ref(base, target, DTYPES["BF16"])
    ctx = SectionContext("t", base.size, 2, "test")
    for bad in ({**params, "count": 0}, {**params, "count": True}, {**params, "position_bytes": len(payload) + 1},
                {**params, "class_shift": 9}, {k: v for k, v in params.items() if k != "position_bytes"},
                {**params, "position_bytes": "12"}):
        with pytest.raises(CorruptPatchError):
            codec.decode(base, payload, bad, ctx, cpu, Scratch())


def test_ctx_ac_refuses_a_rank_past_its_class():
    """A section made against another base: its ranks can run past this base's class sizes."""
    rng = np.random.default_rng(3)
    base, target = random_pair(rng, np.uint16, 2000, 0.3)
    codec = get_codec("ctx-ac")
    payload, params = section_ref(base, target, DTYPES["BF16"])
    other = np.full_like(base, base[0])  # one class only, but fewer of the section's classes
    other[: other.size // 2] ^= np.uint16(0x4000)
    ctx = SectionContext("t", base.size, 2, "test")
    with pytest.raises(CorruptPatchError, match="outside"):
        codec.decode(other, payload, params, ctx, cpu, Scratch())


def test_ctx_ac_is_smaller_than_ctx_rans_on_one_ulp_steps():
    """The point of it: on RL-like steps (mostly one unit in the last place, more often where the
    exponent is small), per-class values beat one static table."""
    rng = np.random.default_rng(11)
    w = (rng.standard_normal(200_000).astype(np.float32) * 0.02)
    base = (w.view(np.uint32) >> 16).astype(np.uint16)
    update = rng.standard_normal(w.size).astype(np.float32) * 3e-5
    target = (((w + update).view(np.uint32) + 0x8000) >> 16).astype(np.uint16)
    sizes = {c: get_codec(c).encode_pair(base, target, dtype=DTYPES["BF16"], kernels=cpu)[1].length
             for c in ("ctx-rans", "ctx-ac")}
    assert sizes["ctx-ac"] < 0.95 * sizes["ctx-rans"], sizes


@pytest.mark.parametrize("n,changed", [(21, [20]), (1, [0]), (2, [1]), (33, [0, 32]), (1000, [999])])
def test_ctx_ac_split_parameter_wider_than_the_tensor(n, changed):
    """A lone change near the end of a small tensor: the writer's k makes 2**k exceed the element
    count, and q = 0 is still inside it (a bound check of q >= n >> k refused this once)."""
    base = np.zeros(n, np.uint8)
    target = base.copy()
    target[changed] = 1
    codec = get_codec("ctx-ac")
    payload, params = section_ref(base, target, DTYPES["BOOL"])
    assert decode_ref(base, payload, params).tobytes() == target.tobytes()
    assert codec_decode(codec, base, payload, params) == target.tobytes()


def test_ctx_ac_one_far_change_does_not_widen_its_class_past_ctx_rans():
    """ctx-rans raises a class's k so that q stays under 2**20 (its decoder's bound); ctx-ac's escape
    takes any q, so it does not (a review found a section 15x larger than without the far change,
    from that bound). The Rice parameter itself still grows with the mean gap, so one far change
    still costs the class some low bits: no more than under ctx-rans."""
    n = 1 << 22
    base = np.full(n, 0x3C00, np.uint16)  # one class
    target = base.copy()
    target[1000:4000] += np.uint16(1)
    target[n - 1] += np.uint16(1)
    sizes = {c: get_codec(c).encode_pair(base, target, dtype=DTYPES["BF16"], kernels=cpu)[1] for c in ("ctx-rans", "ctx-ac")}
    assert sizes["ctx-ac"].length < sizes["ctx-rans"].length, {c: e.length for c, e in sizes.items()}
    enc = sizes["ctx-ac"]
    ctx = SectionContext("t", n, 2, "test")
    assert get_codec("ctx-ac").decode(base, b"".join(enc.parts), enc.params, ctx, cpu, Scratch()).tobytes() == target.tobytes()


def test_ctx_ac_plain_bitstream_running_dry_inside_an_escape_is_refused():
    """The q escape's low bits cut off, with more plain bits wanted after them: refused (the bit
    reader, once dry, stays dry instead of shifting by a negative count)."""
    base = np.zeros(1 << 20, np.uint16)
    target = base.copy()
    target[list(range(0, 200, 2)) + [900_000, 900_010]] = 1  # a huge gap in a class whose k is small: an escape
    payload, params = section_ref(base, target, DTYPES["BF16"])
    gaps = np.diff(np.flatnonzero(target != base), prepend=-1) - 1
    assert gaps.max() >> rice_k(gaps.tolist()) >= 8  # the far gap's q takes the escape
    codec = get_codec("ctx-ac")
    cut = params["position_bytes"]
    for drop in range(1, 4):
        body = payload[:cut - drop] + payload[cut:]  # the plain bitstream ends the position part
        bad = dict(params, position_bytes=cut - drop)
        assert codec_decode(codec, base, body, bad) is None
