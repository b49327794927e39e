"""Entropy coders for the ctx-rans codec: Rice codes and static rANS.

Both are sequential (they run over the changed elements only, ~1% of a
tensor) and compiled with Numba. Decoders bound every read by the buffer they
were given and report damage through a status code instead of reading past
the end: a hostile section must not make them touch foreign memory.

- Rice coding (Golomb coding with a power-of-two parameter, Rice 1979) of
  n >= 0 with parameter k: q = n >> k as q one-bits and a zero-bit, then the
  k low bits of n. Bits are packed LSB-first. Optimal for geometric
  distributions when 2**k is near ln(2) times the mean.
- rANS (Duda, "Asymmetric numeral systems", 2013; the byte-wise variant of
  Giesen's ryg_rans): 32-bit state, 8-bit renormalisation, L = 2**23,
  frequencies quantised to 2**12. The encoder runs backwards and emits bytes
  in reverse; the stream stored here is already reversed, so the decoder
  reads forwards.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import trailing_zeros  # LLVM cttz

PROB_BITS = 12
PROB_SCALE = 1 << PROB_BITS
RANS_L = 1 << 23
ESCAPE = 255  # symbol meaning: the value is stored whole in the escape list
MAX_UNARY = 1 << 20  # a longer run of one-bits cannot come from our encoder

OK, TRUNCATED, TOO_LONG, BAD_STATE, OUT_OF_RANGE = 0, 1, 2, 3, 4


# -- Rice ---------------------------------------------------------------------


@njit(cache=True, nogil=True, inline="always")
def put_bits(out, pos, acc, nacc, value, nbits):
    """Append the low `nbits` (<= 32) of value, LSB first; returns the writer's new state."""
    acc |= (np.uint64(value) & ((np.uint64(1) << np.uint64(nbits)) - np.uint64(1))) << np.uint64(nacc)
    nacc += nbits
    while nacc >= 8:
        out[pos] = np.uint8(acc & np.uint64(0xFF))
        pos += 1
        acc >>= np.uint64(8)
        nacc -= 8
    return pos, acc, nacc


@njit(cache=True, nogil=True)
def rice_encode(values, ks, counts, out):
    """Rice-code values, the first counts[0] with parameter ks[0], the next counts[1] with ks[1], ...

    Returns the bytes used in `out`, which must hold sum((v >> k) + 1 + k) bits
    plus 4 bytes. A code of at most 32 bits (nearly all: q is small when k fits
    the data) goes into the 64-bit accumulator in one step, and the
    accumulator's low 32 bits are stored as a little-endian word after every
    code, the word index moving on only once it is full: no branch on the
    data there (a branch on "is a word full" mispredicted about one code in
    four). Longer codes take the general path, a byte at a time.
    """
    words = out[:(out.size // 4) * 4].view(np.uint32)  # LSB-first bytes are little-endian words
    acc = np.uint64(0)
    nacc = 0
    w = 0
    i = 0
    one = np.uint64(1)
    low32 = np.uint64(0xFFFFFFFF)
    for g in range(counts.size):
        k = ks[g]
        kk = np.uint64(k)
        kmask = (one << kk) - one
        for _ in range(counts[g]):
            v = np.uint64(values[np.uint64(i)])
            i += 1
            q = v >> kk
            if q + kk < np.uint64(32):  # q ones, a zero, then the k low bits: one code of q + 1 + k bits
                code = ((one << q) - one) | ((v & kmask) << (q + one))
                acc |= code << np.uint64(nacc)
                nacc += int(q) + 1 + k
                words[np.uint64(w)] = np.uint32(acc & low32)
                full = nacc >> 5
                w += full
                acc >>= np.uint64(32 * full)
                nacc -= 32 * full
                continue
            pos = 4 * w
            while q > 0:  # unary part: q one-bits, at most 32 at a time
                take = min(q, np.uint64(32))
                pos, acc, nacc = put_bits(out, pos, acc, nacc, (one << take) - one, int(take))
                q -= take
            pos, acc, nacc = put_bits(out, pos, acc, nacc, 0, 1)  # the terminating zero bit
            low = v
            remaining = k
            while remaining > 0:  # the k low bits, at most 32 at a time
                take = min(remaining, 32)
                pos, acc, nacc = put_bits(out, pos, acc, nacc, low, take)
                low >>= np.uint64(take)
                remaining -= take
            while pos % 4:  # back to a word boundary: the last whole bytes return to the accumulator
                pos -= 1
                acc = (acc << np.uint64(8)) | np.uint64(out[pos])
                nacc += 8
            w = pos // 4
    return flush_bytes(out, 4 * w, acc, nacc)


@njit(cache=True, nogil=True, inline="always")
def flush_bytes(out, pos, acc, nacc):
    """Write an LSB-first bit writer's last nacc bits from its accumulator as whole bytes (the last
    one padded with zeros) at out[pos:]; returns the position after them."""
    while nacc > 0:
        out[pos] = np.uint8(acc & np.uint64(0xFF))
        pos += 1
        acc >>= np.uint64(8)
        nacc -= 8
    return pos


@njit(cache=True, nogil=True, inline="always")
def refill(data, pos, buf, nbuf):
    """Load bytes from data[pos:] above the window's nbuf bits until it holds 57 or more, or data ends."""
    while nbuf <= 56 and pos < data.size:
        buf |= np.uint64(data[np.uint64(pos)]) << np.uint64(nbuf)
        pos += 1
        nbuf += 8
    return pos, buf, nbuf


@njit(cache=True, nogil=True)
def rice_decode(data, ks, counts, out, sizes=None):
    """Inverse of rice_encode; returns (status, bytes consumed).

    Bits are read through a 64-bit window refilled a byte at a time, so the
    k low bits come out with one mask, not k reads. With `sizes` (one per
    group), the values are gaps minus one and `out` receives their running
    sums instead, the ranks r = r_prev + value + 1 starting from -1, each
    checked to stay below its group's size (else OUT_OF_RANGE).
    """
    n = data.size
    pos = 0  # next byte to load into the window
    buf = np.uint64(0)
    nbuf = 0
    i = 0
    for g in range(counts.size):
        k = ks[g]
        kmask = (np.uint64(1) << np.uint64(k)) - np.uint64(1)
        rank = np.int64(-1)
        for _ in range(counts[g]):
            if nbuf < 32:  # top the window up only when it runs low: most codes are a few bits
                pos, buf, nbuf = refill(data, pos, buf, nbuf)
            q = 0
            while True:  # unary part: count the one-bits before the first zero, a window at a time
                if nbuf == 0:
                    return TRUNCATED, 0
                valid = (np.uint64(1) << np.uint64(nbuf)) - np.uint64(1) if nbuf < 64 else ~np.uint64(0)
                zeros = ~buf & valid
                if zeros == 0:  # every valid bit is a one: the run goes on past the window
                    q += nbuf
                    buf = np.uint64(0)
                    nbuf = 0
                    if q > MAX_UNARY:
                        return TOO_LONG, 0
                    pos, buf, nbuf = refill(data, pos, buf, nbuf)
                    continue
                ones = int(trailing_zeros(zeros))
                q += ones
                if q > MAX_UNARY:
                    return TOO_LONG, 0
                used = ones + 1  # the run and its terminating zero
                buf = buf >> np.uint64(used) if used < 64 else np.uint64(0)
                nbuf -= used
                break
            if k <= nbuf:  # the k low bits are in the window: one mask
                low = buf & kmask
                buf = buf >> np.uint64(k) if k < 64 else np.uint64(0)
                nbuf -= k
            else:  # k low bits, as many per step as the window holds
                low = np.uint64(0)
                got = 0
                while got < k:
                    if nbuf == 0:
                        if pos >= n:
                            return TRUNCATED, 0
                        pos, buf, nbuf = refill(data, pos, buf, nbuf)
                    take = min(k - got, nbuf)
                    low |= (buf & ((np.uint64(1) << np.uint64(take)) - np.uint64(1))) << np.uint64(got)
                    buf = buf >> np.uint64(take) if take < 64 else np.uint64(0)
                    nbuf -= take
                    got += take
            value = (np.uint64(q) << np.uint64(k)) | low
            if sizes is None:
                out[np.uint64(i)] = value
            else:
                if value >= np.uint64(sizes[g]):
                    return OUT_OF_RANGE, 0
                rank += np.int64(value) + 1
                if rank >= sizes[g]:
                    return OUT_OF_RANGE, 0
                out[np.uint64(i)] = rank
            i += 1
    # bytes consumed: those loaded, minus whole bytes still unread in the window
    return OK, pos - (nbuf // 8)


def rice_cost(values: np.ndarray, k: int) -> int:
    return int((values >> np.uint64(k)).sum()) + values.size * (k + 1)


def best_rice_k(values: np.ndarray) -> int:
    """The k with the fewest bits, searched around log2 of the mean."""
    if values.size == 0:
        return 0
    mean = float(values.mean()) + 1.0
    guess = max(0, int(np.log2(mean)))
    candidates = [k for k in (guess - 1, guess, guess + 1) if 0 <= k <= 62]
    return min(candidates, key=lambda k: (rice_cost(values, k), k))


# -- rANS ---------------------------------------------------------------------


@njit(cache=True, nogil=True)
def quantise_frequencies(counts):
    """Frequencies summing to PROB_SCALE, every present symbol >= 1, deterministic (int64 counts).

    Written out for Numba: a dozen NumPy calls on 256 entries cost ~25 us a section under the
    GIL, which an MoE make of 18k sections pays on every encoder thread. The plain NumPy form it
    must equal bit for bit is tests/reference.py's quantise_frequencies_ref."""
    n = counts.size
    total = np.int64(0)
    present = 0
    for s in range(n):
        total += counts[s]
        if counts[s] > 0:
            present += 1
    freqs = np.zeros(n, np.int64)
    if total == 0:
        return freqs
    given = np.int64(0)
    for s in range(n):
        if counts[s] > 0:
            freqs[s] = max(np.int64(1), np.int64(np.float64(counts[s]) * PROB_SCALE / np.float64(total)))
            given += freqs[s]
    # Give or take the rounding error from the most frequent symbol (ties: lowest symbol).
    diff = PROB_SCALE - given
    order = np.argsort(-counts, kind="mergesort")  # stable: equal counts keep symbol order
    i = 0
    while diff != 0:
        s = order[i % present]
        if diff > 0:
            freqs[s] += diff
            diff = 0
        else:
            take = min(-diff, freqs[s] - 1)
            freqs[s] -= take
            diff += take
            i += 1
    return freqs


@njit(cache=True, nogil=True)
def rans_encode(symbols, freqs, cums, out):
    """Encode symbols; writes the stream to the END of `out`; returns its start index.

    The step x -> (x // f) * 2**12 + x % f + cum is computed as
    x + cum + q * (2**12 - f) with q = x // f found by a multiplication with a
    per-symbol reciprocal, exact for x < 2**31 (Giesen, ryg_rans, after
    Alverson, "Integer division using reciprocals", 1991): the division was
    the hot loop's main cost. A symbol of frequency 1 has q = x, handled by
    the same formula with a reciprocal of 2**32 - 1 and the bias moved.
    """
    n_sym = freqs.size
    rcp = np.zeros(n_sym, np.uint64)
    rshift = np.zeros(n_sym, np.uint64)
    bias = np.zeros(n_sym, np.uint64)
    cmpl = np.zeros(n_sym, np.uint64)
    x_max = np.zeros(n_sym, np.uint64)
    for s in range(n_sym):
        f = freqs[s]
        if f == 0:
            continue
        x_max[s] = np.uint64((RANS_L >> PROB_BITS) << 8) * np.uint64(f)
        cmpl[s] = np.uint64(PROB_SCALE - f)
        if f < 2:
            rcp[s] = np.uint64(0xFFFFFFFF)
            bias[s] = np.uint64(cums[s] + PROB_SCALE - 1)
        else:
            shift = 0
            while f > (1 << shift):
                shift += 1
            rcp[s] = np.uint64(((1 << (shift + 31)) + f - 1) // f)
            rshift[s] = np.uint64(shift - 1)
            bias[s] = np.uint64(cums[s])
    x = np.uint64(RANS_L)
    pos = out.size
    eight = np.uint64(8)
    for i in range(symbols.size - 1, -1, -1):
        s = symbols[np.uint64(i)]
        while x >= x_max[s]:
            pos -= 1
            out[np.uint64(pos)] = np.uint8(x & np.uint64(0xFF))
            x >>= eight
        q = ((x * rcp[s]) >> np.uint64(32)) >> rshift[s]
        x = x + bias[s] + q * cmpl[s]
    for _ in range(4):
        pos -= 1
        out[pos] = np.uint8(x & np.uint64(0xFF))
        x >>= eight
    return pos


@njit(cache=True, nogil=True)
def rans_decode(data, freqs, cums, slot_to_symbol, out):
    """Decode len(out) symbols; returns a status code.

    Each slot's symbol, frequency and offset in its symbol's range are packed
    in one 32-bit table entry (12 + 12 + 8 bits), so a step is one dependent
    load instead of two (the symbol, then its frequency and start): 1.2x
    faster (227 against 188 M symbols/s, one thread).
    """
    if data.size < 4:
        return TRUNCATED
    table = np.empty(PROB_SCALE, np.uint32)
    for slot in range(PROB_SCALE):
        s = slot_to_symbol[slot]
        table[slot] = np.uint32(((freqs[s] - 1) << 20) | ((slot - cums[s]) << 8) | s)
    pos = 0
    x = np.uint64(0)
    # The encoder wrote the state's low byte last, so it comes first... in reverse:
    for _ in range(4):
        x = (x << np.uint64(8)) | np.uint64(data[pos])
        pos += 1
    mask = np.uint64(PROB_SCALE - 1)
    for i in range(out.size):
        e = np.uint64(table[x & mask])
        out[np.uint64(i)] = np.uint8(e & np.uint64(0xFF))
        x = ((e >> np.uint64(20)) + np.uint64(1)) * (x >> np.uint64(PROB_BITS)) + ((e >> np.uint64(8)) & np.uint64(0xFFF))
        while x < np.uint64(RANS_L):
            if pos >= data.size:
                return TRUNCATED
            x = (x << np.uint64(8)) | np.uint64(data[np.uint64(pos)])
            pos += 1
    if x != np.uint64(RANS_L) or pos != data.size:
        return BAD_STATE
    return OK


def rans_tables(freqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    cums = np.zeros(freqs.size, np.int64)
    np.cumsum(freqs[:-1], out=cums[1:])
    slot_to_symbol = np.repeat(np.arange(freqs.size, dtype=np.uint8), freqs.astype(np.int64))
    return cums, slot_to_symbol
