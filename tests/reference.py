"""Slow, obvious NumPy oracles for the kernels in `pulsediff.kernels`.

Every backend (cpu, cuda) is checked against these bit for bit. Keep them
plain: no chunking, no scans written by hand, nothing clever to get wrong in
the same way as the kernels.
"""

from __future__ import annotations

import numpy as np


def diff_compact_ref(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions (int64, ascending) where old != new, and new's values there."""
    assert old.shape == new.shape and old.dtype == new.dtype
    positions = np.flatnonzero(old != new).astype(np.int64)
    return positions, new[positions]


def scatter_ref(out: np.ndarray, positions: np.ndarray, values: np.ndarray) -> int:
    """out[p] = v for every in-range p, in order; returns how many p were out of range."""
    n = out.size
    bad = 0
    # tolist(): exact Python ints, so uint64 positions >= 2**63 stay huge (out
    # of range) and int64 ones stay negative (out of range); neither wraps.
    for p, v in zip(positions.tolist(), values.tolist()):
        if 0 <= p < n:
            out[p] = v
        else:
            bad += 1
    return bad


def gaps_to_positions_ref(gaps: np.ndarray) -> tuple[np.ndarray, int]:
    """positions[i] = sum(gaps[:i+1]) - 1 in int64 (wrapping), and the number of gaps <= 0.

    Gaps are read as int64: a uint64 gap >= 2**63 is negative, hence bad.
    """
    signed = gaps.astype(np.int64)  # two's-complement reinterpretation for uint64
    positions = np.cumsum(signed, dtype=np.int64) - 1
    return positions.astype(np.int64), int(np.count_nonzero(signed <= 0))


def diff_ranks_ref(old: np.ndarray, new: np.ndarray, shift: int, mask: int):
    """For each changed element in position order: zigzag(new - old mod 2**width as signed), its
    class (old >> shift) & mask, its rank among the elements of that class; and the class sizes."""
    width = old.dtype.itemsize * 8
    classes_all = [(int(v) >> shift) & mask for v in old.tolist()]
    seen = [0] * (mask + 1)
    zigzag, classes, ranks = [], [], []
    for a, b, c in zip(old.tolist(), new.tolist(), classes_all):
        if a != b:
            d = (b - a) % (1 << width)
            signed = d - (1 << width) if d >= 1 << (width - 1) else d
            zigzag.append(2 * signed if signed >= 0 else -2 * signed - 1)
            classes.append(c)
            ranks.append(seen[c])
        seen[c] += 1
    return (np.array(zigzag, np.uint64).astype(old.dtype), np.array(classes, np.uint16), np.array(ranks, np.int64),
            np.array(seen, np.int64))


# -- base-context kernels (codec ctx-rans) -----------------------------------------


def classes_ref(base: np.ndarray, shift: int, mask: int) -> list[int]:
    """Each element's class, (int64(bits) >> shift) & mask, as the kernels define it: 8-byte
    patterns are read as signed, so the shift is arithmetic (it matters with the top bit set)."""
    return [(v >> shift) & mask for v in base.astype(np.int64).tolist()]


def chunk_class_starts_ref(base: np.ndarray, shift: int, mask: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """starts[r, c]: elements of class c before range r, the ranges being rows pieces of
    ceil(n / rows) elements (the last ones shorter or empty); and the class sizes."""
    classes = classes_ref(base, shift, mask)
    step = -(-len(classes) // rows) if classes else 0
    starts = np.zeros((rows, mask + 1), np.int64)
    for r in range(rows):
        for c in classes[: r * step]:
            starts[r, c] += 1
    return starts, np.bincount(np.array(classes, np.int64), minlength=mask + 1).astype(np.int64)


def class_ranks_ref(base: np.ndarray, shift: int, mask: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each position's rank: how many elements of its class come before it; and the class sizes."""
    classes = classes_ref(base, shift, mask)
    seen = [0] * (mask + 1)
    rank_at = []
    for c in classes:
        rank_at.append(seen[c])
        seen[c] += 1
    return np.array([rank_at[p] for p in positions.tolist()], np.int64), np.array(seen, np.int64)


def apply_ranked_ref(base: np.ndarray, shift: int, mask: int, class_offsets: np.ndarray, ranks: np.ndarray,
                     deltas: np.ndarray) -> tuple[np.ndarray, int]:
    """(base with the listed elements changed, how many entries were applied).

    Entry e of class k (class_offsets[k] <= e < class_offsets[k + 1]) names the
    ranks[e]-th element of class k; its new bits are base + un-zigzag(deltas[e])
    modulo 2**width. Entries whose rank is not that of an element of the class
    are not applied. Ranks must ascend strictly within a class (as every decoder
    makes them): this oracle does not define what other inputs do.
    """
    width = base.dtype.itemsize * 8
    classes = classes_ref(base, shift, mask)
    members = [[] for _ in range(mask + 1)]
    for i, c in enumerate(classes):
        members[c].append(i)
    out = base.copy()
    applied = 0
    for k in range(mask + 1):
        listed = ranks[class_offsets[k] : class_offsets[k + 1]].tolist()
        assert all(a < b for a, b in zip(listed, listed[1:])), "ranks must ascend within a class"
        for e, r in zip(range(class_offsets[k], class_offsets[k + 1]), listed):
            if 0 <= r < len(members[k]):
                z = int(deltas[e])
                delta = (z >> 1) ^ -(z & 1)
                i = members[k][r]
                out[i] = (int(base[i]) + delta) % (1 << width)
                applied += 1
    return out, applied


def word_sum_ref(data: np.ndarray) -> int:
    """FORMAT.md §3.1 sum64, word by word in Python integers."""
    raw = bytes(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    raw += bytes(-len(raw) % 8)
    m64 = (1 << 64) - 1
    total = 0
    for j in range(len(raw) // 8):
        x = int.from_bytes(raw[8 * j:8 * j + 8], "little") ^ ((j + 1) * 0x9E3779B97F4A7C15 & m64)
        x ^= x >> 33
        x = x * 0xFF51AFD7ED558CCD & m64
        x ^= x >> 33
        x = x * 0xC4CEB9FE1A85EC53 & m64
        x ^= x >> 33
        total = (total + x) & m64
    return total


def ranked_positions_ref(base: np.ndarray, shift: int, mask: int, class_offsets: np.ndarray,
                         ranks: np.ndarray) -> tuple[np.ndarray, int]:
    """(position of each entry's element, -1 where its rank is not in its class; how many were found).
    Ranks ascend strictly within a class, as for apply_ranked_ref."""
    classes = classes_ref(base, shift, mask)
    members = [[] for _ in range(mask + 1)]
    for i, c in enumerate(classes):
        members[c].append(i)
    where = np.full(ranks.size, -1, np.int64)
    for k in range(mask + 1):
        for e in range(class_offsets[k], class_offsets[k + 1]):
            if 0 <= ranks[e] < len(members[k]):
                where[e] = members[k][ranks[e]]
    return where, int((where >= 0).sum())


def add_at_ref(out: np.ndarray, positions: np.ndarray, deltas: np.ndarray) -> tuple[np.ndarray, int]:
    """In place: out[p] += un-zigzag(delta) mod 2**width for each in-range p; (old values, out-of-range count)."""
    width = out.dtype.itemsize * 8
    old = np.zeros(positions.size, out.dtype)
    bad = 0
    for e, p in enumerate(positions.tolist()):
        if 0 <= p < out.size:
            old[e] = out[p]
            z = int(deltas[e])
            out[p] = (int(out[p]) + ((z >> 1) ^ -(z & 1))) % (1 << width)
        else:
            bad += 1
    return old, bad


def chunk_digests_ref(data: np.ndarray, chunk: int) -> np.ndarray:
    """XXH3-128 (the xxhash library's) of each `chunk` bytes of the array's bytes, one chunk
    at a time, as rows of (low 64 bits, high 64 bits)."""
    import xxhash

    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8).tobytes()
    rows = []
    for lo in range(0, len(raw), chunk):
        value = xxhash.xxh3_128_intdigest(raw[lo:lo + chunk])
        rows.append((value & 0xFFFFFFFFFFFFFFFF, value >> 64))
    return np.array(rows, np.uint64).reshape(-1, 2)


def tree_hash_ref(data: np.ndarray, chunk: int = 1 << 18) -> str:
    """format.digest.tree_hash written out: XXH3-128 of the byte length (u64 LE) followed by each
    chunk's canonical XXH3-128 digest (the xxhash library's own bytes)."""
    import xxhash

    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8).tobytes()
    body = len(raw).to_bytes(8, "little") + b"".join(xxhash.xxh3_128_digest(raw[lo:lo + chunk])
                                                      for lo in range(0, len(raw), chunk))
    return xxhash.xxh3_128_hexdigest(body)


def quantise_frequencies_ref(counts: np.ndarray) -> np.ndarray:
    """entropy.quantise_frequencies as first written, in NumPy: frequencies summing to 2**12, every
    present symbol >= 1, the rounding error given to or taken from the most frequent symbols."""
    from pulsediff.kernels.entropy import PROB_SCALE

    total = int(counts.sum())
    freqs = np.zeros(counts.size, np.int64)
    present = counts > 0
    if total == 0:
        return freqs
    freqs[present] = np.maximum(1, (counts[present].astype(np.float64) * PROB_SCALE / total).astype(np.int64))
    diff = PROB_SCALE - int(freqs.sum())
    order = np.lexsort((np.arange(counts.size), -counts))
    i = 0
    while diff != 0:
        s = order[i % int(present.sum())]
        if diff > 0:
            freqs[s] += diff
            diff = 0
        else:
            take = min(-diff, int(freqs[s]) - 1)
            freqs[s] -= take
            diff += take
            i += 1
    return freqs


def encode_ranked_ref(classes: np.ndarray, ranks: np.ndarray, zigzag: np.ndarray, bits: int) -> tuple[bytes, ...]:
    """ctx-rans's section parts (class table, positions, frequencies, values, escapes) as first
    written, a NumPy call or a bytearray step at a time: the oracle of ctx_rans.encode_section."""
    from pulsediff.codecs.ctx_rans import _put_varint
    from pulsediff.kernels import entropy
    from pulsediff.kernels.ctx_rans_sections import MAX_Q_BITS, class_major, rice_parameters

    count = classes.size
    counts, values, symbols, symbol_counts, escapes = class_major(classes, ranks, zigzag, 1 << bits, entropy.ESCAPE)
    listed = np.flatnonzero(counts)
    counts = counts[listed]
    ks, rice_bits = rice_parameters(values, counts, MAX_Q_BITS)
    table = bytearray()
    _put_varint(table, int(listed.size))
    for cls, n, k in zip(listed.tolist(), counts.tolist(), ks.tolist()):
        _put_varint(table, cls)
        _put_varint(table, n)
        table.append(k)
    rice_buf = np.zeros((int(rice_bits) + 7) // 8 + 8, np.uint8)
    used = entropy.rice_encode(values, ks, counts, rice_buf)
    freqs = quantise_frequencies_ref(symbol_counts)
    cums, _ = entropy.rans_tables(freqs)
    freq_table = bytearray()
    present = np.flatnonzero(freqs)
    _put_varint(freq_table, int(present.size))
    for s in present.tolist():
        freq_table.append(s)
        _put_varint(freq_table, int(freqs[s]))
    rans_buf = np.empty(2 * count + 16, np.uint8)
    start = entropy.rans_encode(symbols, freqs, cums, rans_buf)
    return (bytes(table), rice_buf[:used].tobytes(), bytes(freq_table), rans_buf[start:].tobytes(),
            escapes.astype(f"<u{zigzag.dtype.itemsize}").tobytes())
