"""Adaptive binary range coding for the ctx-ac codec (FORMAT.md 6.4).

Why adaptive binary coding: ctx-rans pays for its static tables (a frequency
table per tensor) and cannot afford one per exponent class, yet the size of a
change in units in the last place depends mostly on the base element's
exponent. Binary decisions with adaptive probabilities learn each class's
distribution as they go, with no table at all, and a class starts from what
the previous (neighbouring) class learned.

- The range coder is LZMA's (Pavlov): 32-bit range, 12-bit probabilities,
  byte-wise normalisation below 2**24, carries propagated through a cached
  byte. The first byte LZMA writes is always 0 and is not stored.
- A context's probability of a 0 is the Krichevsky-Trofimov estimate from the
  bits it has coded (below).
- The position stream ends exactly where its decoder stops reading; the bits
  no context predicts (the low bits of gaps) follow it, reversed, in a plain
  bitstream read many at a time. The value stream is last in its section: it
  is cut after its last nonzero byte, and its decoder reads zeros past the end.

Speed: each decoded bit is a chain (context state -> probability -> bound ->
bit -> new state), and a context used for every entry makes that chain the
loop's. The hot contexts (the first unary bins, the gap's top bit) live in
local variables, not in an array, which halves the decode time (a stored
context is reloaded through memory for the next entry). The bit itself is
taken without a branch. Decoders bound every read and report damage through a
status code; they never read outside the buffers they are given.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from pulsediff.kernels.entropy import OK, OUT_OF_RANGE, TRUNCATED, flush_bytes, refill

PROB_BITS = 12
TOP = 1 << 24
COUNT_LIMIT = 256  # a context's counts halve when their sum reaches this
KEEP = 6  # at each new class, a context's counts shrink to this sum
BAD_STATE = 3

# Contexts of each stream (FORMAT.md 6.4).
GAP_UNARY = 8  # q = gap >> k: a tree for 0..3, unary bins for 3..7, then an escape
EXP_BINS = 24  # unary bins of an escape's bit length (the last one is shared by longer ones)
GAP_TOP = 3  # the top low bit of a gap, by min(q, 2)
VALUE_UNARY = 4  # |d| - 1: unary bins for 0..3, then an escape
TOP_FIRST = GAP_UNARY + EXP_BINS
TABLE_FIRST = TOP_FIRST + GAP_TOP  # then: listed classes, class step, count, k change
POSITION_CONTEXTS = TABLE_FIRST + 4 * EXP_BINS
VALUE_CONTEXTS = VALUE_UNARY + EXP_BINS

_U0, _U1 = np.uint64(0), np.uint64(1)
_U2, _U3 = np.uint64(2), np.uint64(3)


# -- models ---------------------------------------------------------------------
#
# A context's state is one uint64: n0 (the 0 bits it coded) in bits 0-15, n1 in bits 16-31,
# n0 + n1 <= 255. The probability of a 0 is the Krichevsky-Trofimov estimate
# (n0 + 1/2) / (n0 + n1 + 1), in 12 bits through a table of reciprocals (no division per bit).
# Counts halve when they reach 256, so old evidence fades slowly; at each new class they shrink
# to KEEP, so a class starts from its neighbour's estimate but learns its own fast. (On the
# realistic pairs, 0.03 bits per changed element smaller than a shift-updated probability.)
# Numba mixes signed and unsigned integers in floats: the arithmetic stays unsigned.

_U16, _LOW16, _P_SHIFT = np.uint64(16), np.uint64(0xFFFF), np.uint64(32 - PROB_BITS)


def _reciprocals() -> np.ndarray:
    return np.array([(1 << 32) // (2 * t + 2) for t in range(COUNT_LIMIT)], np.uint64)


RECIPROCALS = _reciprocals()


@njit(cache=True, nogil=True, inline="always")
def _prob(n0, n1):
    """P(0) in [8, 4095] out of 4096: ((2 n0 + 1) R[n0 + n1]) >> 20, R[t] = floor(2**32 / (2t + 2))."""
    return ((n0 + n0 + _U1) * RECIPROCALS[n0 + n1]) >> _P_SHIFT


@njit(cache=True, nogil=True, inline="always")
def _counted(s, n0, n1, one_mask):
    """The state after coding a bit (one_mask: all ones for a 1, else 0): its count up by one,
    both counts halved (rounding up) when they reach COUNT_LIMIT."""
    s += _U1 << (_U16 & one_mask)
    if n0 + n1 + _U1 >= np.uint64(COUNT_LIMIT):
        s = (((s & _LOW16) + _U1) >> _U1) | ((((s >> _U16) + _U1) >> _U1) << _U16)
    return s


@njit(cache=True, nogil=True, inline="always")
def _shrunk(s):
    """A new class: counts over KEEP shrink to KEEP, n0 = floor((n0 KEEP + floor(t / 2)) / t)."""
    keep = np.uint64(KEEP)
    n0, n1 = s & _LOW16, s >> _U16
    t = n0 + n1
    if t > keep:
        n0 = (n0 * keep + (t >> _U1)) // t
        s = n0 | ((keep - n0) << _U16)
    return s


@njit(cache=True, nogil=True)
def _new_class(state):
    for j in range(state.size):
        state[j] = _shrunk(state[j])


@njit(cache=True, nogil=True, inline="always")
def _hot_gap_contexts(state):
    """The position stream's hot contexts, taken into locals (see the module's docstring): q's
    tree (contexts 0-2) and the three top-bit contexts. The rest stay in `state`."""
    return state[0], state[1], state[2], state[TOP_FIRST], state[TOP_FIRST + 1], state[TOP_FIRST + 2]


@njit(cache=True, nogil=True, inline="always")
def _new_gap_class(state, q0, q1, q2, t0, t1, t2):
    """A new class for the position stream: the contexts in `state` and the hot ones in locals."""
    _new_class(state)
    return _shrunk(q0), _shrunk(q1), _shrunk(q2), _shrunk(t0), _shrunk(t1), _shrunk(t2)


@njit(cache=True, nogil=True, inline="always")
def _hot_value_contexts(state):
    """The value stream's hot contexts, taken into locals: its four unary bins (contexts 0-3)."""
    return state[0], state[1], state[2], state[3]


@njit(cache=True, nogil=True, inline="always")
def _new_value_class(state, m0, m1, m2, m3):
    """A new class for the value stream: the contexts in `state` and the hot ones in locals."""
    _new_class(state)
    return _shrunk(m0), _shrunk(m1), _shrunk(m2), _shrunk(m3)


# -- encoder ----------------------------------------------------------------------
# st = (bytes written, low, range, cached byte, pending bytes): LZMA's encoder state.


@njit(cache=True, nogil=True, inline="always")
def _shift_low(out, o, low, cache, pending):
    """LZMA's ShiftLow: emit the cached byte (plus carry) and any 0xFF bytes held back."""
    if low < np.uint64(0xFF000000) or low >= np.uint64(1 << 32):
        carry = np.uint8(low >> np.uint64(32))
        byte = cache
        while pending:
            if o < out.size:
                out[o] = np.uint8(byte + carry)
            o += 1
            byte = np.uint8(0xFF)
            pending -= 1
        cache = np.uint8((low >> np.uint64(24)) & np.uint64(0xFF))
    pending += 1
    low = (low & np.uint64(0x00FFFFFF)) << np.uint64(8)
    return o, low, cache, pending


@njit(cache=True, nogil=True, inline="always")
def _put_bit(st, out, s, bit):
    """Code one bit with the context state s: (encoder state, the context's new state)."""
    o, low, rng, cache, pending = st
    n0, n1 = s & _LOW16, s >> _U16
    bound = (rng >> np.uint64(PROB_BITS)) * _prob(n0, n1)
    one_mask = _U0 - np.uint64(bit)
    low += bound & one_mask
    rng = ((rng - bound) & one_mask) | (bound & ~one_mask)
    s = _counted(s, n0, n1, one_mask)
    while rng < np.uint64(TOP):
        rng <<= np.uint64(8)
        o, low, cache, pending = _shift_low(out, o, low, cache, pending)
    return (o, low, rng, cache, pending), s


@njit(cache=True, nogil=True, inline="always")
def _enc_bit(st, out, state, ctx, bit):
    """_put_bit with the context in an array."""
    st, s = _put_bit(st, out, state[ctx], bit)
    state[ctx] = s
    return st


@njit(cache=True, nogil=True, inline="always")
def _enc_direct(st, out, value, nbits):
    """Code the low nbits of value as equiprobable bits, most significant first."""
    o, low, rng, cache, pending = st
    for b in range(nbits - 1, -1, -1):
        rng >>= _U1
        if (np.uint64(value) >> np.uint64(b)) & _U1:
            low += rng
        while rng < np.uint64(TOP):
            rng <<= np.uint64(8)
            o, low, cache, pending = _shift_low(out, o, low, cache, pending)
    return o, low, rng, cache, pending


@njit(cache=True, nogil=True, inline="always")
def _enc_start():
    return 0, _U0, np.uint64(0xFFFFFFFF), np.uint8(0), 1


@njit(cache=True, nogil=True)
def _enc_finish(st, out, shortest):
    """Flush: the whole of low (LZMA's five ShiftLows), or with `shortest` the value in
    [low, low + range) with the most trailing zero bits, whose zero bytes the caller cuts."""
    o, low, rng, cache, pending = st
    if shortest:
        top = low + rng - _U1
        for s in range(32, -1, -1):
            v = ((low + (_U1 << np.uint64(s)) - _U1) >> np.uint64(s)) << np.uint64(s)
            if v <= top:
                low = v
                break
    for _ in range(5):
        o, low, cache, pending = _shift_low(out, o, low, cache, pending)
    return o  # bytes written (the first always 0, dropped by the caller), or more than out.size: no room


@njit(cache=True, nogil=True, inline="always")
def _enc_unary_escape(st, out, state, first, unary, value, raw, rs, direct):
    """value >= 0: bins first..first+unary-1 say "value > j"; past them, r = value - unary + 1 >= 1
    is coded as its bit length e + 1 (e one-bits then a zero over EXP_BINS contexts, the last
    shared) and its e low bits: in the plain bitstream, or with `direct` as direct bits."""
    for j in range(unary):
        if value == np.uint64(j):
            return _enc_bit(st, out, state, first + j, 0), rs
        st = _enc_bit(st, out, state, first + j, 1)
    r = value - np.uint64(unary) + _U1
    e = 0
    while (r >> np.uint64(e + 1)) != _U0:
        e += 1
    for t in range(e):
        st = _enc_bit(st, out, state, first + unary + min(t, EXP_BINS - 1), 1)
    st = _enc_bit(st, out, state, first + unary + min(e, EXP_BINS - 1), 0)
    if direct:
        st = _enc_direct(st, out, r, e)
    else:
        rs = _put_raw(raw, rs, r, e)
    return st, rs


@njit(cache=True, nogil=True, inline="always")
def _enc_gap_high(st, out, state, q, raw, rs):
    """q = gap >> k: min(q, 3) as two bits of a tree, [q >= 2] (context 0), then [q >= 3]
    (context 2) or [q = 1] (context 1); past 3, unary over contexts 3..7 with an escape. A
    tree, not a unary code, so that the decoder needs no branch on the first two bits."""
    high = q >= _U2
    st = _enc_bit(st, out, state, 0, int(high))
    if high:
        st = _enc_bit(st, out, state, 2, int(q >= _U3))
        if q >= _U3:
            return _enc_unary_escape(st, out, state, 3, GAP_UNARY - 3, q - _U3, raw, rs, False)
        return st, rs
    return _enc_bit(st, out, state, 1, int(q == _U1)), rs


@njit(cache=True, nogil=True, inline="always")
def _put_word_bits(raw, pos, acc, nacc, value, nbits):
    """Append nbits (<= 32) of value; a whole 32-bit word goes out at once, not byte by byte."""
    acc |= (np.uint64(value) & ((_U1 << np.uint64(nbits)) - _U1)) << np.uint64(nacc)
    nacc += nbits
    if nacc >= 32:
        raw[pos] = np.uint8(acc & np.uint64(0xFF))
        raw[pos + 1] = np.uint8((acc >> np.uint64(8)) & np.uint64(0xFF))
        raw[pos + 2] = np.uint8((acc >> np.uint64(16)) & np.uint64(0xFF))
        raw[pos + 3] = np.uint8((acc >> np.uint64(24)) & np.uint64(0xFF))
        pos += 4
        acc >>= np.uint64(32)
        nacc -= 32
    return pos, acc, nacc


@njit(cache=True, nogil=True, inline="always")
def _put_raw(raw, rs, value, nbits):
    """Append the low nbits (<= 64) of value to the plain bitstream, least significant first.
    rs: (pos, acc, nacc); pos over raw.size means it ran out of room (the caller retries)."""
    pos, acc, nacc = rs
    if nbits == 0:
        return rs
    if pos + 16 > raw.size:
        return raw.size + 1, acc, nacc
    if nbits > 32:
        pos, acc, nacc = _put_word_bits(raw, pos, acc, nacc, np.uint64(value) & np.uint64(0xFFFFFFFF), 32)
        return _put_word_bits(raw, pos, acc, nacc, np.uint64(value) >> np.uint64(32), nbits - 32)
    return _put_word_bits(raw, pos, acc, nacc, value, nbits)


@njit(cache=True, nogil=True)
def _raw_finish(raw, rs):
    pos, acc, nacc = rs
    if pos > raw.size - 8:
        return raw.size + 1
    return flush_bytes(raw, pos, acc, nacc)


@njit(cache=True, nogil=True, inline="always")
def _enc_golomb(st, out, state, first, value):
    """value >= 0 as its bit length (unary over EXP_BINS contexts from first) and its low bits direct."""
    r = np.uint64(value) + _U1
    e = 0
    while (r >> np.uint64(e + 1)) != _U0:
        e += 1
    for t in range(e):
        st = _enc_bit(st, out, state, first + min(t, EXP_BINS - 1), 1)
    st = _enc_bit(st, out, state, first + min(e, EXP_BINS - 1), 0)
    return _enc_direct(st, out, r, e)


@njit(cache=True, nogil=True)
def encode_positions(classes, counts, ks, gaps, out, raw):
    """The position stream: the class table (listed classes - 1, then per class: the step from
    the previous class - 1, its count - 1, the zigzag change of its split parameter k), then per
    class its counts[g] gaps minus one (class-major) with split parameter ks[g]: q = gap >> k in
    unary with an escape, the top of the k low bits by min(q, 2), the rest plain. Returns (range
    bytes, raw bytes) written; either over its buffer's size means: retry with more room."""
    state = np.zeros(POSITION_CONTEXTS, np.uint64)
    st = _enc_start()
    rs = (0, _U0, 0)
    st = _enc_golomb(st, out, state, TABLE_FIRST, classes.size - 1)
    previous_class, previous_k = -1, 0
    for m in range(classes.size):
        st = _enc_golomb(st, out, state, TABLE_FIRST + EXP_BINS, classes[m] - previous_class - 1)
        st = _enc_golomb(st, out, state, TABLE_FIRST + 2 * EXP_BINS, counts[m] - 1)
        change = ks[m] - previous_k
        st = _enc_golomb(st, out, state, TABLE_FIRST + 3 * EXP_BINS, 2 * change if change >= 0 else -2 * change - 1)
        previous_class, previous_k = classes[m], ks[m]
    q0, q1, q2, t0, t1, t2 = _hot_gap_contexts(state)
    i = 0
    for g in range(counts.size):
        if g:
            q0, q1, q2, t0, t1, t2 = _new_gap_class(state, q0, q1, q2, t0, t1, t2)
        k = ks[g]
        kk = np.uint64(k)
        for _ in range(counts[g]):
            u = np.uint64(gaps[i])
            i += 1
            q = u >> kk
            # contexts chosen by masks, not branches on q, which would be mispredicted
            high = np.uint64(q >= _U2)
            st, q0 = _put_bit(st, out, q0, high)
            pick = _U0 - high
            s = (q2 & pick) | (q1 & ~pick)
            st, s = _put_bit(st, out, s, (np.uint64(q >= _U3) & pick) | (np.uint64(q == _U1) & ~pick))
            q2 = (s & pick) | (q2 & ~pick)
            q1 = (q1 & pick) | (s & ~pick)
            if q >= _U3:
                st, rs = _enc_unary_escape(st, out, state, 3, GAP_UNARY - 3, q - _U3, raw, rs, False)
            if k > 0:
                is0, is1 = _U0 - np.uint64(q == _U0), _U0 - np.uint64(q == _U1)
                is2 = ~(is0 | is1)
                t = (t0 & is0) | (t1 & is1) | (t2 & is2)
                st, t = _put_bit(st, out, t, (u >> (kk - _U1)) & _U1)
                t0 = (t & is0) | (t0 & ~is0)
                t1 = (t & is1) | (t1 & ~is1)
                t2 = (t & is2) | (t2 & ~is2)
                rs = _put_raw(raw, rs, u, k - 1)
        if st[0] > out.size or rs[0] > raw.size:
            return out.size + 1, raw.size + 1
    return _enc_finish(st, out, False), _raw_finish(raw, rs)


@njit(cache=True, nogil=True)
def encode_values(magnitudes, counts, out):
    """The value stream: |d| - 1 of each entry (class-major, counts[g] per class) in unary with an
    escape whose low bits are direct. Returns the bytes written, before the cut of trailing
    zeros (over out.size: retry with more room)."""
    state = np.zeros(VALUE_CONTEXTS, np.uint64)
    m0, m1, m2, m3 = _hot_value_contexts(state)
    st = _enc_start()
    rs = (0, _U0, 0)
    nowhere = np.empty(0, np.uint8)
    i = 0
    for g in range(counts.size):
        if g:
            m0, m1, m2, m3 = _new_value_class(state, m0, m1, m2, m3)
        for _ in range(counts[g]):
            v = np.uint64(magnitudes[i]) - _U1
            i += 1
            st, m0 = _put_bit(st, out, m0, int(v > _U0))
            if v > _U0:
                st, m1 = _put_bit(st, out, m1, int(v > _U1))
                if v > _U1:
                    st, m2 = _put_bit(st, out, m2, int(v > _U2))
                    if v > _U2:
                        st, m3 = _put_bit(st, out, m3, int(v > _U3))
                        if v > _U3:
                            st, rs = _enc_unary_escape(st, out, state, VALUE_UNARY, 0, v - np.uint64(VALUE_UNARY),
                                                       nowhere, rs, True)
        if st[0] > out.size:
            return out.size + 1
    return _enc_finish(st, out, True)


# -- decoder ------------------------------------------------------------------------


@njit(cache=True, nogil=True, inline="always")
def _dec_start(data):
    """(pos, range, code) after the first four bytes (the encoder's leading 0 byte is not
    stored); bytes past the end read as 0."""
    code = _U0
    for j in range(4):
        code <<= np.uint64(8)
        if j < data.size:
            code |= np.uint64(data[j])
    return 4, np.uint64(0xFFFFFFFF), code


@njit(cache=True, nogil=True, inline="always")
def _bit(data, pos, rng, code, s):
    """One bit decoded with the context state s, without a branch on it (half of them would be
    mispredicted): (bit as 0 or 1, pos, range, code, the context's new state). Bytes past the
    end read as 0."""
    n0, n1 = s & _LOW16, s >> _U16
    bound = (rng >> np.uint64(PROB_BITS)) * _prob(n0, n1)
    one = code >= bound
    one_mask = _U0 - np.uint64(one)
    code -= bound & one_mask
    rng = ((rng - bound) & one_mask) | (bound & ~one_mask)
    s = _counted(s, n0, n1, one_mask)
    while rng < np.uint64(TOP):
        rng <<= np.uint64(8)
        code = (code << np.uint64(8)) & np.uint64(0xFFFFFFFF)
        if pos < data.size:
            code |= np.uint64(data[pos])
        pos += 1
    return np.uint64(one), pos, rng, code, s


@njit(cache=True, nogil=True, inline="always")
def _dec_bit(data, pos, rng, code, state, ctx):
    """_bit with the context in an array."""
    bit, pos, rng, code, s = _bit(data, pos, rng, code, state[ctx])
    state[ctx] = s
    return bit, pos, rng, code


@njit(cache=True, nogil=True, inline="always")
def _dec_direct(data, pos, rng, code, nbits):
    value = _U0
    for _ in range(nbits):
        rng >>= _U1
        bit = _U0
        if code >= rng:
            code -= rng
            bit = _U1
        value = (value << _U1) | bit
        while rng < np.uint64(TOP):
            rng <<= np.uint64(8)
            code = (code << np.uint64(8)) & np.uint64(0xFFFFFFFF)
            if pos < data.size:
                code |= np.uint64(data[pos])
            pos += 1
    return value, pos, rng, code


@njit(cache=True, nogil=True, inline="always")
def _get_raw(raw, rpos, buf, nbuf, nbits):
    """nbits (<= 64) from the plain bitstream; nbuf < 0 after the call means it ran out."""
    if nbuf < 0:  # it ran out before: stay out, shifting nothing by a negative count
        return _U0, rpos, buf, nbuf
    if nbuf < 32:  # top the window up while it runs low: most reads then take one mask
        rpos, buf, nbuf = refill(raw, rpos, buf, nbuf)
    if nbits <= nbuf and nbits < 64:
        value = buf & ((_U1 << np.uint64(nbits)) - _U1)
        return value, rpos, buf >> np.uint64(nbits), nbuf - nbits
    value = _U0
    got = 0
    while got < nbits:
        if nbuf == 0:
            if rpos >= raw.size:
                return value, rpos, buf, -1
            rpos, buf, nbuf = refill(raw, rpos, buf, nbuf)
        take = min(nbits - got, nbuf)
        part = buf & ((_U1 << np.uint64(take)) - _U1) if take < 64 else buf
        value |= part << np.uint64(got)
        buf = buf >> np.uint64(take) if take < 64 else _U0
        nbuf -= take
        got += take
    return value, rpos, buf, nbuf


@njit(cache=True, nogil=True, inline="always")
def _dec_escape_length(data, pos, rng, code, state, first, max_bits):
    """The bit length e of an escape (e one-bits then a zero over EXP_BINS contexts from first);
    -1 where it exceeds max_bits."""
    e = 0
    while True:
        bit, pos, rng, code = _dec_bit(data, pos, rng, code, state, first + min(e, EXP_BINS - 1))
        if bit == _U0:
            return e, pos, rng, code
        e += 1
        if e > max_bits:
            return -1, pos, rng, code


@njit(cache=True, nogil=True, inline="always")
def _dec_golomb(data, pos, rng, code, state, first):
    """Inverse of _enc_golomb; -1 on damage (a bit length over 62)."""
    e, pos, rng, code = _dec_escape_length(data, pos, rng, code, state, first, 62)
    if e < 0:
        return -1, pos, rng, code
    low, pos, rng, code = _dec_direct(data, pos, rng, code, e)
    return np.int64((_U1 << np.uint64(e)) | low) - 1, pos, rng, code


@njit(cache=True, nogil=True, inline="always")
def _dec_table(data, class_limit, count, classes, counts, ks):
    """The class table at the front of the position stream. Classes ascend below class_limit,
    counts are >= 1 and add up to `count`, ks lie in [0, 62]. Returns (status, listed, pos,
    range, code, state): the decoder's state, for the gaps that follow."""
    state = np.zeros(POSITION_CONTEXTS, np.uint64)
    pos, rng, code = _dec_start(data)
    listed, pos, rng, code = _dec_golomb(data, pos, rng, code, state, TABLE_FIRST)
    listed += 1
    if listed < 1 or listed > class_limit or listed > count:
        return OUT_OF_RANGE, 0, pos, rng, code, state
    previous_class, previous_k, total = -1, 0, 0
    for m in range(listed):
        step, pos, rng, code = _dec_golomb(data, pos, rng, code, state, TABLE_FIRST + EXP_BINS)
        n, pos, rng, code = _dec_golomb(data, pos, rng, code, state, TABLE_FIRST + 2 * EXP_BINS)
        change, pos, rng, code = _dec_golomb(data, pos, rng, code, state, TABLE_FIRST + 3 * EXP_BINS)
        if step < 0 or n < 0 or change < 0 or step >= class_limit - previous_class - 1 or n >= count - total:
            return OUT_OF_RANGE, 0, pos, rng, code, state
        k = previous_k + (change >> 1 if change & 1 == 0 else -((change + 1) >> 1))
        if k < 0 or k > 62:
            return OUT_OF_RANGE, 0, pos, rng, code, state
        previous_class += step + 1
        previous_k = k
        total += n + 1
        classes[m], counts[m], ks[m] = previous_class, n + 1, k
        if pos > data.size + 8:
            return TRUNCATED, 0, pos, rng, code, state
    if total != count:
        return OUT_OF_RANGE, 0, pos, rng, code, state
    return OK, listed, pos, rng, code, state


@njit(cache=True, nogil=True)
def decode_table(data, class_limit, count, classes, counts, ks):
    """The class table alone (for the value stream's decoder, which needs the counts): (status,
    listed). classes, counts and ks need room for min(class_limit, count) entries."""
    status, listed, _, _, _, _ = _dec_table(data, class_limit, count, classes, counts, ks)
    return status, listed


@njit(cache=True, nogil=True)
def decode_positions(data, raw, class_limit, count, classes, counts, ks, out, bound):
    """Inverse of encode_positions: the class table into classes, counts and ks, then the ranks
    (running sums of the gaps) into out, each below `bound` (else OUT_OF_RANGE). `raw` is the
    part reversed: the plain bitstream read from the part's end. The range stream and the
    plain bitstream must meet exactly, with zero padding bits. Returns (status, listed)."""
    status, listed, pos, rng, code, state = _dec_table(data, class_limit, count, classes, counts, ks)
    if status != OK:
        return status, 0
    rpos, buf, nbuf = 0, _U0, 0
    limit = np.uint64(bound)
    q0, q1, q2, t0, t1, t2 = _hot_gap_contexts(state)
    i = 0
    for g in range(listed):
        if g:
            q0, q1, q2, t0, t1, t2 = _new_gap_class(state, q0, q1, q2, t0, t1, t2)
        k = ks[g]
        kk = np.uint64(k)
        rank = _U0  # the previous entry's rank + 1
        for _ in range(counts[g]):
            high, pos, rng, code, q0 = _bit(data, pos, rng, code, q0)
            pick = _U0 - high  # all ones where q >= 2: the second bit's context, by selects
            s = (q2 & pick) | (q1 & ~pick)
            low_bit, pos, rng, code, s = _bit(data, pos, rng, code, s)
            q2 = (s & pick) | (q2 & ~pick)
            q1 = (q1 & pick) | (s & ~pick)
            q = high + high + low_bit  # 0, 1, 2, or 3 for q >= 3
            if q == _U3:  # rare: q >= 3, unary over contexts 3..7, then the escape
                while q < np.uint64(GAP_UNARY):
                    one, pos, rng, code = _dec_bit(data, pos, rng, code, state, int(q))
                    if not one:
                        break
                    q += _U1
                if q == np.uint64(GAP_UNARY):
                    e, pos, rng, code = _dec_escape_length(data, pos, rng, code, state, GAP_UNARY, 62)
                    if e < 0:
                        return OUT_OF_RANGE, 0
                    low, rpos, buf, nbuf = _get_raw(raw, rpos, buf, nbuf, e)
                    q = ((_U1 << np.uint64(e)) | low) + np.uint64(GAP_UNARY - 1)
            if q > (limit - _U1) >> kk:  # q·2**k alone reaches past the tensor (2**k may exceed it)
                return OUT_OF_RANGE, 0
            u = q << kk
            if k > 0:
                # the context by min(q, 2), by masks: a branch on q would be mispredicted
                is0, is1 = _U0 - np.uint64(q == _U0), _U0 - np.uint64(q == _U1)
                is2 = ~(is0 | is1)
                t = (t0 & is0) | (t1 & is1) | (t2 & is2)
                top, pos, rng, code, t = _bit(data, pos, rng, code, t)
                t0 = (t & is0) | (t0 & ~is0)
                t1 = (t & is1) | (t1 & ~is1)
                t2 = (t & is2) | (t2 & ~is2)
                low, rpos, buf, nbuf = _get_raw(raw, rpos, buf, nbuf, k - 1)
                u |= (top << (kk - _U1)) | low
            if nbuf < 0:
                return TRUNCATED, 0
            if u >= limit - rank:
                return OUT_OF_RANGE, 0
            rank += u + _U1
            out[i] = np.int64(rank - _U1)
            i += 1
        if pos > data.size + 8:
            return TRUNCATED, 0
    used = rpos - nbuf // 8  # plain bytes read, the last partly
    padding = (buf & ((_U1 << np.uint64(nbuf % 8)) - _U1)) != _U0
    return (OK if pos + used == data.size and not padding else BAD_STATE), listed


@njit(cache=True, nogil=True)
def decode_values(signs, data, counts, width, out):
    """Inverse of encode_values into out (uint64 zigzag deltas), the sign of entry i being bit
    i & 7 of signs[i >> 3] (1: negative). A magnitude that is no difference of two width-bit
    values (over 2**(width-1), or exactly that with a + sign) is refused. The stream must be
    read to its end, its last byte nonzero; the bitmap's padding bits are zero. Returns
    (status, largest zigzag)."""
    size = data.size
    state = np.zeros(VALUE_CONTEXTS, np.uint64)
    m0, m1, m2, m3 = _hot_value_contexts(state)
    pos, rng, code = _dec_start(data)
    half = _U1 << np.uint64(width - 1)
    largest = _U0
    i = 0
    for g in range(counts.size):
        if g:
            m0, m1, m2, m3 = _new_value_class(state, m0, m1, m2, m3)
        for _ in range(counts[g]):
            one, pos, rng, code, m0 = _bit(data, pos, rng, code, m0)
            m = _U0
            if one:
                one, pos, rng, code, m1 = _bit(data, pos, rng, code, m1)
                m = _U1
                if one:
                    one, pos, rng, code, m2 = _bit(data, pos, rng, code, m2)
                    m = _U2
                    if one:
                        one, pos, rng, code, m3 = _bit(data, pos, rng, code, m3)
                        m = _U3
                        if one:
                            e, pos, rng, code = _dec_escape_length(data, pos, rng, code, state, VALUE_UNARY,
                                                                   width - 2)  # |d| <= 2**(width-1)
                            if e < 0:
                                return OUT_OF_RANGE, largest
                            low, pos, rng, code = _dec_direct(data, pos, rng, code, e)
                            m = ((_U1 << np.uint64(e)) | low) + np.uint64(VALUE_UNARY - 1)
            negative = (np.uint64(signs[i >> 3]) >> np.uint64(i & 7)) & _U1
            if m >= half or (m == half - _U1 and negative == _U0):
                return OUT_OF_RANGE, largest
            z = ((m + _U1) << _U1) - negative
            largest = max(largest, z)
            out[i] = z
            i += 1
    if _padding_set(signs, i) or pos < size or (size and data[size - 1] == 0):
        return BAD_STATE, largest
    return OK, largest


@njit(cache=True, nogil=True, inline="always")
def _padding_set(signs, n):
    """Whether the sign bitmap has set bits past its n entries (its padding must be zero)."""
    return n % 8 != 0 and (np.uint64(signs[signs.size - 1]) >> np.uint64(n % 8)) != _U0
