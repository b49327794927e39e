"""ctx-rans's section coder as kernels: the regrouping of changed elements by class
(class_major), the Rice parameters of their rank gaps (rice_parameters) and a whole section's
bytes in one call (encode_section). codecs/ctx_rans.py specifies the section (its docstring) and
codes with encode_section, codecs/ctx_ac.py with the first two; kernels/cpu_batch.py's batched
make calls encode_section from its own kernel, which is why they live below the codecs."""

from __future__ import annotations

import numpy as np
from numba import njit

from pulsediff.kernels import entropy

# Rice runs longer than this are avoided by raising k: the decoder refuses longer ones.
MAX_Q_BITS = 20

_U1, _U2, _U3 = np.uint64(1), np.uint64(2), np.uint64(3)
_U256, _U512, _U768 = np.uint64(256), np.uint64(512), np.uint64(768)


@njit(cache=True, nogil=True)
def class_major(classes, ranks, zigzag, ncls, escape):
    """Regroup the changed elements class by class (a stable counting sort), in one scatter.

    In: per changed element in position order, its class, its rank within the
    class (ascending within each class) and its zigzag delta. Out: elements
    per class; the ranks in class-major order (uint64, which rice_parameters
    turns into the Rice values in place); the rANS symbols min(delta, escape)
    in class-major order and their counts; the escaped deltas, class-major.

    Classes are counted, and slots taken, four elements at a time: neighbours
    mostly share a class, and one counter per class would serialise on its own
    store-to-load latency (the same correction as apply_ranked's group walk).
    """
    m = classes.size
    lanes = np.zeros(4 * ncls, np.int64)
    # Unsigned indices throughout: Numba guards every signed index with a select for negative ones.
    n1, n2, n3 = np.uint64(ncls), np.uint64(2 * ncls), np.uint64(3 * ncls)
    i = 0
    while i + 4 <= m:
        u = np.uint64(i)
        lanes[np.uint64(classes[u])] += 1
        lanes[n1 + np.uint64(classes[u + _U1])] += 1
        lanes[n2 + np.uint64(classes[u + _U2])] += 1
        lanes[n3 + np.uint64(classes[u + _U3])] += 1
        i += 4
    while i < m:
        lanes[np.uint64(classes[np.uint64(i)])] += 1
        i += 1
    counts = np.empty(ncls, np.int64)
    ptr = np.empty(ncls, np.int64)
    run = 0
    for c in range(ncls):
        counts[c] = lanes[c] + lanes[ncls + c] + lanes[2 * ncls + c] + lanes[3 * ncls + c]
        ptr[c] = run
        run += counts[c]
    ranks_cm = np.empty(m, np.uint64)
    symbols = np.empty(m, np.uint8)
    esc = np.uint64(escape)
    esc_slot = np.empty(m, np.int64)  # where each escaped delta goes, in the order met
    esc_from = np.empty(m, np.int64)
    n_esc = 0
    i = 0
    while i + 4 <= m:
        u = np.uint64(i)
        c0, c1, c2, c3 = classes[u], classes[u + _U1], classes[u + _U2], classes[u + _U3]
        p0 = ptr[c0]
        p1 = ptr[c1] + (c1 == c0)
        p2 = ptr[c2] + (c2 == c0) + (c2 == c1)
        p3 = ptr[c3] + (c3 == c0) + (c3 == c1) + (c3 == c2)
        ptr[c0] = p0 + 1  # same-class stores land in order: the last one holds the group's count
        ptr[c1] = p1 + 1
        ptr[c2] = p2 + 1
        ptr[c3] = p3 + 1
        q0, q1, q2, q3 = np.uint64(p0), np.uint64(p1), np.uint64(p2), np.uint64(p3)
        ranks_cm[q0] = np.uint64(ranks[u])
        ranks_cm[q1] = np.uint64(ranks[u + _U1])
        ranks_cm[q2] = np.uint64(ranks[u + _U2])
        ranks_cm[q3] = np.uint64(ranks[u + _U3])
        z0, z1 = np.uint64(zigzag[u]), np.uint64(zigzag[u + _U1])
        z2, z3 = np.uint64(zigzag[u + _U2]), np.uint64(zigzag[u + _U3])
        symbols[q0] = np.uint8(min(z0, esc))
        symbols[q1] = np.uint8(min(z1, esc))
        symbols[q2] = np.uint8(min(z2, esc))
        symbols[q3] = np.uint8(min(z3, esc))
        if (z0 >= esc) | (z1 >= esc) | (z2 >= esc) | (z3 >= esc):  # rare: far jumps
            for j, p in ((0, p0), (1, p1), (2, p2), (3, p3)):
                if np.uint64(zigzag[i + j]) >= esc:
                    esc_slot[n_esc] = p
                    esc_from[n_esc] = i + j
                    n_esc += 1
        i += 4
    while i < m:
        u = np.uint64(i)
        c = classes[u]
        p = ptr[c]
        ptr[c] = p + 1
        ranks_cm[np.uint64(p)] = np.uint64(ranks[u])
        z = np.uint64(zigzag[u])
        symbols[np.uint64(p)] = np.uint8(min(z, esc))
        if z >= esc:
            esc_slot[n_esc] = p
            esc_from[n_esc] = i
            n_esc += 1
        i += 1
    escapes = np.empty(n_esc, zigzag.dtype)
    order = np.argsort(esc_slot[:n_esc])
    for j in range(n_esc):
        escapes[j] = zigzag[esc_from[order[j]]]
    sym = np.zeros(4 * 256, np.int64)  # the symbols' counts, in four lanes too: one ULP up or down is most
    i = 0
    while i + 4 <= m:
        u = np.uint64(i)
        sym[np.uint64(symbols[u])] += 1
        sym[_U256 + np.uint64(symbols[u + _U1])] += 1
        sym[_U512 + np.uint64(symbols[u + _U2])] += 1
        sym[_U768 + np.uint64(symbols[u + _U3])] += 1
        i += 4
    while i < m:
        sym[np.uint64(symbols[np.uint64(i)])] += 1
        i += 1
    symbol_counts = sym[:256] + sym[256:512] + sym[512:768] + sym[768:]
    return counts, ranks_cm, symbols, symbol_counts, escapes


@njit(cache=True, nogil=True)
def rice_parameters(values, counts, max_q_bits):
    """Per group of `values` (class-major ranks, turned here in place into the Rice values,
    rank gap - 1): the Rice parameter with the fewest bits among log2 of the mean and its
    neighbours (ties: the smaller k), then raised so that no unary run exceeds max_q_bits
    bits (ctx-rans's decoder refuses longer ones; 64: no bound). Returns (ks, total bits).

    Three short loops over each group, each of which LLVM vectorises: ranks to gaps
    (backwards, in place), their sum and maximum, then the costs of the (up to) three
    candidate parameters side by side (the cost of each candidate in a scalar pass of its
    own measured ten times slower).
    """
    ks = np.zeros(counts.size, np.int64)
    bits = np.uint64(0)
    one = np.uint64(1)
    lo = 0
    for g in range(counts.size):
        hi = lo + counts[g]
        if hi > lo:
            sub = values[lo:hi]
            for i in range(sub.size - 1, 0, -1):  # backwards: each rank is read before it is replaced
                sub[i] = sub[i] - sub[i - 1] - one
            total = np.uint64(0)
            largest = np.uint64(0)
            for i in range(sub.size):
                total += sub[i]
                largest = max(largest, sub[i])
            n = np.uint64(sub.size)
            guess = max(0, int(np.log2(np.float64(total) / sub.size + 1.0)))
            first, last = max(0, guess - 1), min(62, guess + 1)
            ka, kb, kc = np.uint64(min(first, 63)), np.uint64(min(first + 1, 63)), np.uint64(min(first + 2, 63))
            sa = sb = sc = np.uint64(0)
            for i in range(sub.size):
                v = sub[i]
                sa += v >> ka
                sb += v >> kb
                sc += v >> kc
            best_k = -1
            best = np.uint64(0)
            for k, shifted in ((first, sa), (first + 1, sb), (first + 2, sc)):
                cost = shifted + n * np.uint64(k + 1)
                if k <= last and (best_k < 0 or cost < best):
                    best_k, best = k, cost
            length = 0
            while largest >> np.uint64(length):
                length += 1
            if length - max_q_bits > best_k:
                best_k = length - max_q_bits
                kk = np.uint64(best_k)
                shifted = np.uint64(0)
                for i in range(sub.size):
                    shifted += sub[i] >> kk
                best = shifted + n * np.uint64(best_k + 1)
            ks[g] = best_k
            bits += best
        lo = hi
    return ks, bits


@njit(cache=True, nogil=True, inline="always")
def _put_varint_at(out, pos, value):
    # _put_varint into a byte array at `pos`; returns the position after it.
    v = np.uint64(value)
    while v >= np.uint64(0x80):
        out[pos] = np.uint8((v & np.uint64(0x7F)) | np.uint64(0x80))
        v >>= np.uint64(7)
        pos += 1
    out[pos] = np.uint8(v)
    return pos + 1


@njit(cache=True, nogil=True)
def encode_section(classes, ranks, zigzag, bits, out, at):
    """A section's bytes (the layout in codecs/ctx_rans.py's docstring) for changed elements given in
    position order by class, rank in class and zigzag delta, written into out[at:]; `out` is
    replaced by a larger copy when short. Returns (out, end, table, position, frequency and
    value bytes, escapes). All in one call: the varints and tables cost a make of many small
    tensors more in Python than the coding itself (18k MoE experts: ~40 us a section).
    tests/reference.py's encode_ranked_ref, the plain form, is its oracle."""
    count = classes.size
    counts, values, symbols, symbol_counts, escapes = class_major(classes, ranks, zigzag, 1 << bits, entropy.ESCAPE)
    listed = np.flatnonzero(counts)
    counts = counts[listed]
    ks, rice_bits = rice_parameters(values, counts, MAX_Q_BITS)  # values: ranks in, Rice values (gap - 1) out
    rice_buf = np.zeros((np.int64(rice_bits) + 7) // 8 + 8, np.uint8)
    used = entropy.rice_encode(values, ks, counts, rice_buf)
    freqs = entropy.quantise_frequencies(symbol_counts)
    cums = np.zeros(freqs.size, np.int64)
    for s in range(1, freqs.size):
        cums[s] = cums[s - 1] + freqs[s - 1]
    rans_buf = np.empty(2 * count + 16, np.uint8)
    start = entropy.rans_encode(symbols, freqs, cums, rans_buf)
    width = zigzag.itemsize
    # Varints of at most 10 bytes: the table's count, per class its id, count and parameter; the
    # frequency table's count, per symbol the symbol and its frequency (at most 2 bytes).
    need = 10 + listed.size * 21 + used + 10 + 3 * freqs.size + (rans_buf.size - start) + escapes.size * width
    if at + need > out.size:
        grown = np.empty(max(2 * out.size, at + need), np.uint8)
        grown[:at] = out[:at]
        out = grown
    pos = _put_varint_at(out, at, listed.size)
    for j in range(listed.size):
        pos = _put_varint_at(out, pos, listed[j])
        pos = _put_varint_at(out, pos, counts[j])
        out[pos] = np.uint8(ks[j])
        pos += 1
    table_bytes = pos - at
    out[pos:pos + used] = rice_buf[:used]
    pos += used
    freq_at = pos
    present = 0
    for s in range(freqs.size):
        present += freqs[s] > 0
    pos = _put_varint_at(out, pos, present)
    for s in range(freqs.size):
        if freqs[s] > 0:
            out[pos] = np.uint8(s)
            pos = _put_varint_at(out, pos + 1, freqs[s])
    frequency_bytes = pos - freq_at
    value_bytes = rans_buf.size - start
    out[pos:pos + value_bytes] = rans_buf[start:]
    pos += value_bytes
    for e in range(escapes.size):  # little-endian, `width` bytes each
        v = np.uint64(escapes[e])
        for b in range(width):
            out[pos] = np.uint8((v >> np.uint64(8 * b)) & np.uint64(0xFF))
            pos += 1
    return out, pos, table_bytes, used, frequency_bytes, value_bytes, escapes.size
