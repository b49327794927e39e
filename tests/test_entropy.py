"""The ctx-rans building blocks against plain-Python references, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pulsediff.kernels import entropy
from pulsediff.kernels import cpu

from reference import apply_ranked_ref, chunk_class_starts_ref, class_ranks_ref, diff_ranks_ref


# -- references -------------------------------------------------------------------


def rice_encode_ref(values, ks) -> bytes:
    bits = []
    for v, k in zip(values, ks):
        v, k = int(v), int(k)
        bits += [1] * (v >> k) + [0]
        bits += [(v >> j) & 1 for j in range(k)]
    out = bytearray((len(bits) + 7) // 8)
    for i, b in enumerate(bits):
        out[i >> 3] |= b << (i & 7)
    return bytes(out)


def rans_encode_ref(symbols, freqs) -> bytes:
    cums = np.concatenate([[0], np.cumsum(freqs)[:-1]])
    x, out = entropy.RANS_L, []
    for s in reversed(list(symbols)):
        f, c = int(freqs[s]), int(cums[s])
        while x >= ((entropy.RANS_L >> entropy.PROB_BITS) << 8) * f:
            out.append(x & 0xFF)
            x >>= 8
        x = (x // f << entropy.PROB_BITS) + x % f + c
    out += [(x >> 0) & 0xFF, (x >> 8) & 0xFF, (x >> 16) & 0xFF, (x >> 24) & 0xFF]
    return bytes(reversed(out))


# -- tests ------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 12)), max_size=300))
def test_rice_matches_reference_and_round_trips(pairs):
    values = np.array([v for v, _ in pairs], np.uint64)
    ks = np.array([k for _, k in pairs], np.int64)
    counts = np.ones(len(pairs), np.int64)  # one value per parameter: the most parameter changes
    expected = rice_encode_ref(values, ks)
    buf = np.zeros(len(expected) + 16, np.uint8)
    used = entropy.rice_encode(values, ks, counts, buf)
    assert buf[:used].tobytes() == expected
    out = np.empty(len(pairs), np.uint64)
    status, consumed = entropy.rice_decode(np.frombuffer(expected, np.uint8), ks, counts, out)
    assert status == entropy.OK and consumed == len(expected)
    assert (out == values).all()


@pytest.mark.parametrize("seed", range(4))
def test_rice_decode_of_long_mixed_streams(seed):
    """Many groups with k from 0 to 40 and runs of every length: every refill path of the window (decoder)
    and both paths of the encoder."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 400, 40).astype(np.int64)
    ks = rng.integers(0, 41, counts.size).astype(np.int64)
    values = np.concatenate([
        (rng.geometric(rng.uniform(0.01, 0.9), n).astype(np.uint64) - np.uint64(1)) << np.uint64(k)
        | rng.integers(0, 1 << k, n, dtype=np.uint64, endpoint=False)
        for n, k in zip(counts, ks)
    ]) if counts.sum() else np.zeros(0, np.uint64)
    stream = rice_encode_ref(values, np.repeat(ks, counts))
    # the encoder too: codes past 32 bits (k up to 40, long runs) take its byte path, which must
    # hand back to the word path at any bit offset
    buf = np.zeros(len(stream) + 4, np.uint8)
    assert buf[:entropy.rice_encode(values, ks, counts, buf)].tobytes() == stream
    out = np.empty(values.size, np.uint64)
    assert entropy.rice_decode(np.frombuffer(stream, np.uint8), ks, counts, out) == (entropy.OK, len(stream))
    assert (out == values).all()
    status, _ = entropy.rice_decode(np.frombuffer(stream[: len(stream) // 2], np.uint8), ks, counts, out)
    assert status == entropy.TRUNCATED


def test_rice_decoder_refuses_truncation_and_long_runs():
    out = np.empty(1, np.uint64)
    ks, counts = np.zeros(1, np.int64), np.ones(1, np.int64)
    assert entropy.rice_decode(np.full(4, 0xFF, np.uint8), ks, counts, out)[0] == entropy.TRUNCATED
    ones = np.full((entropy.MAX_UNARY >> 3) + 2, 0xFF, np.uint8)
    assert entropy.rice_decode(ones, ks, counts, out)[0] == entropy.TOO_LONG
    # a value split across the window's refills, with k up to 62
    values = np.array([2**61 + 12345, 7, 2**40], np.uint64)
    ks3, counts3 = np.array([61, 2, 40], np.int64), np.ones(3, np.int64)
    stream = rice_encode_ref(values, ks3)
    got = np.empty(3, np.uint64)
    assert entropy.rice_decode(np.frombuffer(stream, np.uint8), ks3, counts3, got) == (entropy.OK, len(stream))
    assert (got == values).all()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 255), min_size=1, max_size=2000), st.integers(0, 2**32 - 1))
def test_rans_matches_reference_and_round_trips(alphabet_draw, seed):
    rng = np.random.default_rng(seed)
    symbols = np.array(alphabet_draw, np.uint8)
    symbols = symbols[rng.permutation(symbols.size)]
    freqs = entropy.quantise_frequencies(np.bincount(symbols, minlength=256))
    assert freqs.sum() == entropy.PROB_SCALE and (freqs[np.unique(symbols)] >= 1).all()
    cums, slots = entropy.rans_tables(freqs)
    buf = np.empty(2 * symbols.size + 16, np.uint8)
    start = entropy.rans_encode(symbols, freqs, cums, buf)
    stream = buf[start:].tobytes()
    assert stream == rans_encode_ref(symbols, freqs)
    out = np.empty(symbols.size, np.uint8)
    assert entropy.rans_decode(np.frombuffer(stream, np.uint8), freqs, cums, slots, out) == entropy.OK
    assert (out == symbols).all()
    assert entropy.rans_decode(np.frombuffer(stream[:-1], np.uint8), freqs, cums, slots, out) != entropy.OK


@pytest.mark.parametrize("n", [1, 17, 1000, 200_003])
@pytest.mark.parametrize("dtype,shift,bits", [(np.uint16, 7, 8), (np.uint32, 23, 8), (np.uint64, 52, 11), (np.uint8, 0, 0)])
def test_class_ranks_and_apply_ranked_match_reference(n, dtype, shift, bits):
    rng = np.random.default_rng(n)
    info = np.iinfo(dtype)
    base = rng.integers(0, info.max, n, dtype=dtype, endpoint=True)
    mask = (1 << bits) - 1
    positions = np.flatnonzero(rng.random(n) < 0.05).astype(np.int64)
    if n <= 1000:  # the reference is quadratic
        ranks, sizes = cpu.class_ranks(base, shift, mask, positions)
        assert (ranks == class_ranks_ref(base, shift, mask, positions)[0]).all()
        assert (sizes == np.bincount((base.astype(np.int64) >> shift) & mask, minlength=mask + 1)).all()
    ranks, _ = cpu.class_ranks(base, shift, mask, positions)
    # rebuild: target = base + delta at positions, listed class-major as ctx-rans lists them
    delta = rng.integers(-3, 4, positions.size).astype(np.int64)
    zigzag = ((delta << 1) ^ (delta >> 63)).astype(np.uint64)
    classes = (base[positions].astype(np.int64) >> shift) & mask
    order = cpu.class_major_order(classes, mask + 1)
    assert (order == np.argsort(classes, kind="stable")).all()
    offsets = np.zeros(mask + 2, np.int64)
    np.cumsum(np.bincount(classes, minlength=mask + 1), out=offsets[1:])
    starts, _ = cpu.chunk_class_starts(base, shift, mask)
    out = np.full_like(base, info.max // 3)  # garbage: the walk writes every element
    applied = cpu.apply_ranked(base, shift, mask, starts, offsets, ranks[order], zigzag[order], out)
    expected = base.copy()
    expected[positions] = (base[positions].astype(np.uint64) + delta.astype(np.uint64)).astype(dtype)
    assert applied == positions.size
    assert (out == expected).all()
    in_place = base.copy()  # chains decode each link over the previous one's output
    cpu.apply_ranked(in_place, shift, mask, starts, offsets, ranks[order], zigzag[order], in_place)
    assert (in_place == expected).all()


@pytest.mark.parametrize("seed", range(12))
def test_apply_ranked_few_classes_matches_reference(seed):
    """Few classes, so neighbours mostly share one (each element's countdown then follows its
    neighbour's store), every density, lengths off a multiple of four,
    ranks past their class, into a buffer and in place: bit for bit the reference."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 3000))
    bits = int(rng.integers(0, 3))  # 1, 2 or 4 classes
    mask = (1 << bits) - 1
    base = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    if seed % 3 == 0:
        base[rng.random(n) < 0.7] = 5  # long runs of one class
    density = float(rng.choice([0.0, 0.01, 0.3, 0.9, 1.0]))
    positions = np.flatnonzero(rng.random(n) < density).astype(np.int64)
    classes = (base[positions].astype(np.int64) >> 3) & mask
    ranks, _ = class_ranks_ref(base, 3, mask, positions)
    order = np.argsort(classes, kind="stable")
    want_where = positions[order]
    offsets = np.zeros(mask + 2, np.int64)
    np.cumsum(np.bincount(classes, minlength=mask + 1), out=offsets[1:])
    ranks = ranks[order]
    if ranks.size and seed % 4 == 1:  # the last entry of the largest class names a rank past its class
        k = int(np.argmax(np.diff(offsets)))
        ranks[offsets[k + 1] - 1] = n + 5
        want_where[offsets[k + 1] - 1] = -1
    deltas = rng.integers(0, 8, positions.size).astype(np.uint16)
    want, want_applied = apply_ranked_ref(base, 3, mask, offsets, ranks, deltas)
    starts, _ = cpu.chunk_class_starts(base, 3, mask)
    out = np.full_like(base, 0xA5A5)
    assert cpu.apply_ranked(base, 3, mask, starts, offsets, ranks, deltas, out) == want_applied
    np.testing.assert_array_equal(out, want)
    in_place = base.copy()
    assert cpu.apply_ranked(in_place, 3, mask, starts, offsets, ranks, deltas, in_place) == want_applied
    np.testing.assert_array_equal(in_place, want)
    where, found = cpu.ranked_positions(base, 3, mask, starts, offsets, ranks)
    assert found == want_applied
    np.testing.assert_array_equal(where, want_where)


def test_rice_decode_to_ranks_checks_each_class_size():
    gaps_minus_one = np.array([0, 2, 0, 5, 1], np.uint64)  # class A: ranks 0, 3, 4; class B: ranks 5, 7
    ks, counts = np.array([1, 2], np.int64), np.array([3, 2], np.int64)
    stream = np.frombuffer(rice_encode_ref(gaps_minus_one, [1, 1, 1, 2, 2]), np.uint8)
    ranks = np.empty(5, np.int64)
    assert entropy.rice_decode(stream, ks, counts, ranks, np.array([5, 8], np.int64))[0] == entropy.OK
    assert ranks.tolist() == [0, 3, 4, 5, 7]
    # class B holds only 7 elements: rank 7 is out of range
    assert entropy.rice_decode(stream, ks, counts, ranks, np.array([5, 7], np.int64))[0] == entropy.OUT_OF_RANGE


def test_values_thread_is_made_again_after_a_fork(monkeypatch):
    """A forked child inherits the executor object but not its thread: it must get a new one."""
    from pulsediff.codecs import ctx_rans

    first = ctx_rans.values_executor()
    assert ctx_rans.values_executor() is first
    monkeypatch.setattr(ctx_rans.os, "getpid", lambda: -1)  # as if in a child
    second = ctx_rans.values_executor()
    assert second is not first
    assert second.submit(lambda: 7).result(timeout=30) == 7


@pytest.mark.parametrize("n", [0, 1, 3, 5, 1000, 3 * (1 << 16) + 7])
@pytest.mark.parametrize("dtype,shift,bits", [(np.uint16, 7, 8), (np.uint32, 23, 8), (np.uint64, 52, 11),
                                              (np.uint8, 0, 0), (np.uint8, 3, 4)])
def test_diff_ranks_matches_reference(n, dtype, shift, bits):
    """The fused compare + class ranks of make, against the plain reference; dense ranges take the second read."""
    rng = np.random.default_rng(n + bits)
    info = np.iinfo(dtype)
    mask = (1 << bits) - 1
    old = rng.integers(0, info.max, n, dtype=dtype, endpoint=True)
    for density in (0.0, 0.02, 0.3, 1.0):  # 0.3 and 1.0 overflow the 1/32 per-range buffers
        new = old.copy()
        hit = rng.random(n) < density
        new[hit] = rng.integers(0, info.max, int(hit.sum()), dtype=dtype, endpoint=True)
        if n > 4:  # the extreme deltas: +-1 and the wrap-around
            new[:4] = old[:4] + np.array([1, info.max, info.max // 2 + 1, info.max // 2], dtype)
        got = cpu.diff_ranks(old, new, shift, mask)
        if n <= 1000:
            want = diff_ranks_ref(old, new, shift, mask)
        else:  # the quadratic-free parts of the reference, for the large size
            positions = np.flatnonzero(old != new)
            want = (None, ((old[positions].astype(np.int64) >> shift) & mask).astype(np.uint16),
                    cpu.class_ranks(old, shift, mask, positions)[0],
                    np.bincount((old.astype(np.int64) >> shift) & mask, minlength=mask + 1))
        for i, (g, w) in enumerate(zip(got, want)):
            if w is not None:
                assert g.dtype == w.dtype and np.array_equal(g, w), (i, density)
        assert got[0].dtype == old.dtype


def test_diff_ranks_refuses_mismatched_inputs():
    with pytest.raises(ValueError):
        cpu.diff_ranks(np.zeros(4, np.uint16), np.zeros(5, np.uint16), 7, 255)
    with pytest.raises(ValueError):
        cpu.diff_ranks(np.zeros(4, np.uint16), np.zeros(4, np.uint32), 7, 255)


def ctx_rans_section_ref(base: np.ndarray, target: np.ndarray, dtype) -> bytes:
    """A ctx-rans section written from FORMAT.md's description, element by element in plain Python."""
    from pulsediff.codecs.ctx_rans import class_field
    from pulsediff.kernels.ctx_rans_sections import MAX_Q_BITS

    shift, bits = class_field(dtype.name)
    mask = (1 << bits) - 1
    zigzag, classes, ranks, _ = diff_ranks_ref(base, target, shift, mask)
    by_class: dict[int, list[tuple[int, int]]] = {}
    for z, c, r in zip(zigzag.tolist(), classes.tolist(), ranks.tolist()):
        by_class.setdefault(c, []).append((r, z))

    def varint(value: int) -> bytes:
        out = bytearray()
        while True:
            out.append((value & 0x7F) | (0x80 if value >> 7 else 0))
            value >>= 7
            if not value:
                return bytes(out)

    table, rice_values, rice_ks, deltas = varint(len(by_class)), [], [], []
    for c in sorted(by_class):
        gaps = [r - prev - 1 for (r, _), prev in zip(by_class[c], [-1] + [r for r, _ in by_class[c][:-1]])]
        cost = lambda k: sum(g >> k for g in gaps) + len(gaps) * (k + 1)  # noqa: E731
        guess = max(0, int(np.log2(float(sum(gaps)) / len(gaps) + 1.0)))
        k = min((k for k in (guess - 1, guess, guess + 1) if 0 <= k <= 62), key=lambda k: (cost(k), k))
        k = max(k, max(gaps).bit_length() - MAX_Q_BITS)
        table += varint(c) + varint(len(gaps)) + bytes([k])
        rice_values += gaps
        rice_ks += [k] * len(gaps)
        deltas += [z for _, z in by_class[c]]
    symbols = [min(z, entropy.ESCAPE) for z in deltas]
    freqs = entropy.quantise_frequencies(np.bincount(np.array(symbols, np.int64), minlength=256))
    freq_table = varint(int(np.count_nonzero(freqs)))
    for s in np.flatnonzero(freqs).tolist():
        freq_table += bytes([s]) + varint(int(freqs[s]))
    escapes = b"".join(z.to_bytes(base.dtype.itemsize, "little") for z in deltas if z >= entropy.ESCAPE)
    return (bytes(table) + rice_encode_ref(rice_values, rice_ks) + freq_table
            + rans_encode_ref(np.array(symbols, np.uint8), freqs) + escapes)


@pytest.mark.parametrize("name,dtype,n", [("BF16", np.uint16, 3000), ("F32", np.uint32, 2000),
                                          ("F8_E4M3", np.uint8, 2500), ("I64", np.uint64, 500)])
def test_ctx_rans_encoder_matches_plain_reference(name, dtype, n):
    """Both encoder entries (fused encode_pair, and encode from positions) write the reference's bytes."""
    from pulsediff.codecs import get_codec
    from pulsediff.io.dtypes import DTYPES

    rng = np.random.default_rng(n)
    base = rng.integers(0, np.iinfo(dtype).max, n, dtype=dtype, endpoint=True)
    target = base.copy()
    hit = rng.random(n) < 0.05
    target[hit] += rng.integers(1, 4, int(hit.sum())).astype(dtype)
    target[hit & (rng.random(n) < 0.1)] ^= dtype(0x55)  # some far jumps: escapes
    codec = get_codec("ctx-rans")
    expected = ctx_rans_section_ref(base, target, DTYPES[name])
    changed, enc = codec.encode_pair(base, target, dtype=DTYPES[name], kernels=cpu)
    assert changed == int((base != target).sum()) and b"".join(enc.parts) == expected
    positions = np.flatnonzero(base != target).astype(np.int64)
    enc2 = codec.encode(base, target, positions, target[positions], dtype=DTYPES[name], kernels=cpu)
    assert b"".join(enc2.parts) == expected
    assert codec.encode_pair(base, target, dtype=DTYPES[name], kernels=cpu, max_changed=changed - 1) == (changed, None)


def windows_of(base: np.ndarray, window: int):
    """The base as consecutive windows of `window` elements, as the windowed rebuild hands them over."""
    return (base[lo:lo + window] for lo in range(0, base.size, window))


@pytest.mark.parametrize("window", [1, 5000, 1 << 17, 1 << 20])
def test_ctx_rans_windowed_decode_matches_whole_decode(window):
    """Windows (counted and rebuilt one at a time, several kernel ranges each) give the whole decode's bits."""
    from pulsediff.codecs import get_codec
    from pulsediff.codecs.base import SectionContext
    from pulsediff.io.dtypes import DTYPES
    from pulsediff.io.memory import Scratch

    n = 3 * (1 << 16) + 7 if window > 1 else 3000
    rng = np.random.default_rng(window)
    base = (rng.normal(0, 0.02, n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    target = base.copy()
    hit = rng.random(n) < 0.03
    target[hit] += np.uint16(1)
    codec = get_codec("ctx-rans")
    _, enc = codec.encode_pair(base, target, dtype=DTYPES["BF16"], kernels=cpu)
    payload, ctx = b"".join(enc.parts), SectionContext("t", n, 2, "test")
    parts = [p.copy() for p in codec.decode_stream(windows_of(base, window), payload, enc.params, ctx, cpu, Scratch())]
    assert [p.size for p in parts] == [min(window, n - lo) for lo in range(0, n, window)]
    assert np.array_equal(np.concatenate(parts), target)


def test_ctx_rans_refuses_a_rank_past_its_class_windowed_before_the_last_window_and_alone():
    from pulsediff.codecs import get_codec
    from pulsediff.codecs.base import SectionContext
    from pulsediff.io.dtypes import DTYPES
    from pulsediff.errors import CorruptPatchError
    from pulsediff.io.memory import Scratch

    base = np.full(4000, 0x3F80, np.uint16)  # one class: rank r is element r
    target = base.copy()
    target[-1] += np.uint16(1)
    codec = get_codec("ctx-rans")
    _, enc = codec.encode_pair(base, target, dtype=DTYPES["BF16"], kernels=cpu)
    payload, ctx = b"".join(enc.parts), SectionContext("t", 4000, 2, "test")
    other = base.copy()
    other[0] = 0x4080  # another exponent: the class now has 3999 elements, and rank 3999 is past its end
    windows = codec.decode_stream(windows_of(other, 1000), payload, enc.params, ctx, cpu, Scratch())
    got = []
    with pytest.raises(CorruptPatchError, match="outside their class"):
        for part in windows:
            got.append(part)
    assert len(got) == 3  # the fourth (last) window is never handed out
    assert [p.size for p in codec.decode_stream(windows_of(base, 1000), payload, enc.params, ctx, cpu,
                                                Scratch())] == [1000] * 4
    # decode_alone (one walk, no class count first) never meets the rank: the applied count says so
    with pytest.raises(CorruptPatchError, match="outside the tensor"):
        codec.decode_alone(other, payload, enc.params, ctx, cpu, Scratch())


def test_rans_reciprocal_division_is_exact_over_the_state_range():
    """The encoder's q = x // f by reciprocal (see rans_encode), checked for every frequency
    at the values where a floor is most fragile: multiples of f, one either side, and the
    ends of the states the encoder can see (x < x_max = 2**19 * f <= 2**31)."""
    for f in range(2, entropy.PROB_SCALE + 1):
        shift = (f - 1).bit_length()
        rcp = ((1 << (shift + 31)) + f - 1) // f
        x_max = ((entropy.RANS_L >> entropy.PROB_BITS) << 8) * f
        mults = np.unique(np.linspace(0, x_max // f, 64).astype(np.int64)) * f
        x = np.unique(np.concatenate([mults - 1, mults, mults + 1, [1, x_max - 1]]))
        x = x[(x >= 1) & (x < x_max)].astype(np.uint64)
        q = ((x * np.uint64(rcp)) >> np.uint64(32)) >> np.uint64(shift - 1)
        assert np.array_equal(q, x // np.uint64(f)), f


@pytest.mark.parametrize("dtype,name,shift,bits", [(np.uint64, "I64", 60, 12), (np.uint16, "BF16", 10, 12),
                                                   (np.uint8, "U8", 9, 0)])
def test_ctx_rans_refuses_a_class_field_outside_the_element(dtype, name, shift, bits):
    """FORMAT.md 6.3: s + b <= W. Past it, a signed and an unsigned shift give different classes."""
    from pulsediff.codecs import get_codec
    from pulsediff.codecs.base import SectionContext
    from pulsediff.io.dtypes import DTYPES
    from pulsediff.errors import CorruptPatchError
    from pulsediff.io.memory import Scratch

    base = np.arange(1000, dtype=dtype)
    target = base.copy()
    target[::7] += dtype(1)
    codec = get_codec("ctx-rans")
    _, enc = codec.encode_pair(base, target, dtype=DTYPES[name], kernels=cpu)
    payload, ctx = b"".join(enc.parts), SectionContext("t", 1000, base.itemsize, "test")
    assert np.array_equal(codec.decode(base, payload, enc.params, ctx, cpu, Scratch()), target)
    hostile = dict(enc.params, class_shift=shift, class_bits=bits)
    with pytest.raises(CorruptPatchError, match="class field"):
        codec.decode(base, payload, hostile, ctx, cpu, Scratch())


def class_major_entries(base, shift, mask, positions):
    """(class offsets, ranks) of the changed positions, listed class by class as ctx-rans lists them."""
    classes = (base[positions].astype(np.int64) >> shift) & mask
    ranks, _ = class_ranks_ref(base, shift, mask, positions)
    offsets = np.zeros(mask + 2, np.int64)
    np.cumsum(np.bincount(classes, minlength=mask + 1), out=offsets[1:])
    return offsets, ranks[np.argsort(classes, kind="stable")]


@pytest.mark.parametrize("seed", range(16))
def test_apply_ranked_walk_matches_reference_on_hard_cases(seed):
    """The walk against the reference on hard inputs: many classes with entries, runs of one
    class far longer than the gaps between its entries, classes that run out of entries,
    ranks past their class, dense and sparse stretches in one tensor, ranges that start
    anywhere (their class counts before them given), into a buffer and in place: bit for bit."""
    rng = np.random.default_rng(1000 + seed)
    n = int(rng.integers(1, 40_000))
    shift, mask = 3, 63
    # classes drawn from a skewed distribution over ~30 of the 64, some runs of one class
    cls = np.minimum(rng.geometric(0.12, n), mask).astype(np.uint16)
    if seed % 2:
        starts_at = rng.integers(0, n, 5)
        for s in starts_at:
            cls[s:s + int(rng.integers(200, 3000))] = cls[s]
    base = (cls << shift) | rng.integers(0, 1 << shift, n, dtype=np.uint16) | (rng.integers(0, 2, n, dtype=np.uint16) << 15)
    density = float(rng.choice([0.0, 0.002, 0.02, 0.3, 1.0]))
    if seed % 3 == 2:  # dense and sparse stretches in one tensor
        density = np.where((np.arange(n) // 5000) % 2 == 0, 0.4, 0.01)
    positions = np.flatnonzero(rng.random(n) < density).astype(np.int64)
    offsets, ranks = class_major_entries(base, shift, mask, positions)
    if ranks.size and seed % 4 == 1:  # a rank past its class
        k = int(rng.choice(np.flatnonzero(np.diff(offsets))))
        ranks[offsets[k + 1] - 1] = n + 5
    deltas = rng.integers(0, 1 << 16, positions.size).astype(np.uint16)
    want, want_applied = apply_ranked_ref(base, shift, mask, offsets, ranks, deltas)
    rows = int(rng.integers(1, 8))
    starts, _ = chunk_class_starts_ref(base, shift, mask, rows)
    out = np.full_like(base, 0xA5A5)
    assert cpu.apply_ranked(base, shift, mask, starts, offsets, ranks, deltas, out) == want_applied
    np.testing.assert_array_equal(out, want)
    in_place = base.copy()
    assert cpu.apply_ranked(in_place, shift, mask, starts, offsets, ranks, deltas, in_place) == want_applied
    np.testing.assert_array_equal(in_place, want)


@pytest.mark.parametrize("seed", range(6))
def test_apply_ranked_refuses_ranks_that_do_not_rise(seed):
    """A damaged section whose ranks stop rising inside a class (behind a valid checksum): the
    walk applies fewer entries than it was given, which is how apply knows to refuse it,
    in a rare class and in the largest."""
    rng = np.random.default_rng(2000 + seed)
    n = 20_000
    shift, mask = 3, 63
    base = (np.minimum(rng.geometric(0.12, n), mask).astype(np.uint16) << shift)
    positions = np.flatnonzero(rng.random(n) < 0.05).astype(np.int64)
    offsets, ranks = class_major_entries(base, shift, mask, positions)
    sizes = np.diff(offsets)
    k = int(np.flatnonzero(sizes >= 3)[-1] if seed % 2 else np.argmax(sizes))  # a rare class, or the largest
    e = int(offsets[k]) + int(rng.integers(1, sizes[k]))
    ranks[e] = ranks[e - 1] - int(rng.integers(0, 2))  # equal to, or below, the one before
    deltas = np.ones(positions.size, np.uint16)
    starts, _ = chunk_class_starts_ref(base, shift, mask, 3)
    out = np.empty_like(base)
    assert cpu.apply_ranked(base, shift, mask, starts, offsets, ranks, deltas, out) < positions.size


# -- make's one read of a pair: diff_ranks with both sides' hashes and word sums ------------


def _checked_cases():
    """(old, new) pairs whose ranges, cut small, are: all unchanged; changed only past several
    unchanged ones (their class counts are taken afterwards); dense (a range's second read);
    and of sizes that end off a word."""
    rng = np.random.default_rng(27)
    for dtype in (np.uint16, np.uint8, np.uint32, np.uint64):
        info = np.iinfo(dtype)
        for n in (0, 1, 7, 4096 + 3, 6 * 4096 + 5):
            old = rng.integers(0, info.max, n, dtype=dtype, endpoint=True)
            yield "unchanged", old, old.copy()
            for density in (0.0005, 0.02, 0.5):
                new = old.copy()
                hit = rng.random(n) < density
                new[hit] ^= rng.integers(1, info.max, int(hit.sum()), dtype=dtype, endpoint=True)
                yield f"density {density}", old, new
            if n > 3 * 4096:
                late = old.copy()
                late[-2] ^= 1  # one change in the last range only
                yield "late", old, late


def test_turns_run_each_step_in_index_order_whatever_order_the_tasks_come():
    """threads.Turns: tasks started in reverse index order on threads of their own still run
    their steps 0, 1, 2, ...; a failing step and a task without a step pass the turn on."""
    import threading

    from pulsediff.kernels.threads import Turns

    turns, order, errors = Turns(), [], []

    def step(i):
        order.append(i)
        if i == 3:
            raise RuntimeError("step 3")

    def task(i):
        try:
            turns.take(i, None if i == 5 else (lambda: step(i)))
        except RuntimeError as exc:
            errors.append(str(exc))

    workers = [threading.Thread(target=task, args=(i,)) for i in reversed(range(8))]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=30)
    assert not any(w.is_alive() for w in workers), "a task is still waiting for its turn"
    assert order == [0, 1, 2, 3, 4, 6, 7] and errors == ["step 3"]


@pytest.mark.parametrize("scheme", ["tree", "flat"])
@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_diff_ranks_checked_matches_the_separate_passes(monkeypatch, fresh_pool, threads, scheme):
    """The fused read gives diff_ranks' results, each side's tensor hash under either scheme (fed
    in order, ranges computed on several threads; 4 KiB pieces cut the tree's 256 KiB chunks) and
    each side's word sum, bit for bit; ranges are cut small here (4 KiB per side) so that each
    case spans several."""
    from pulsediff.format.digest import SCHEMES
    from pulsediff.kernels.threads import pool

    from reference import word_sum_ref

    monkeypatch.setenv("PULSEDIFF_THREADS", threads)
    monkeypatch.setattr(cpu, "_CHECKED_RANGE_BYTES", 4096)
    assert pool()._max_workers == int(threads)
    for label, old, new in _checked_cases():
        shift, mask = {1: (3, 15), 2: (7, 255), 4: (23, 255), 8: (52, 2047)}[old.dtype.itemsize]
        h_old, h_new = SCHEMES[scheme].hasher(), SCHEMES[scheme].hasher()
        zigzag, classes, ranks, old_sum, new_sum = cpu.diff_ranks_checked(old, new, shift, mask, h_old, h_new)
        want = cpu.diff_ranks(old, new, shift, mask)
        if old.size <= 4096:
            assert all(np.array_equal(a, b) for a, b in zip(want, diff_ranks_ref(old, new, shift, mask)))
        for got, expected in zip((zigzag, classes, ranks), want[:3]):
            assert got.dtype == expected.dtype and np.array_equal(got, expected), (label, old.dtype, old.size)
        hashes = (SCHEMES[scheme].tensor_hash(old), SCHEMES[scheme].tensor_hash(new))
        assert (h_old.hexdigest(), h_new.hexdigest()) == hashes, (label, old.size)
        assert (old_sum, new_sum) == (word_sum_ref(old), word_sum_ref(new)), (label, old.dtype, old.size)


def test_diff_ranks_checked_reads_views_in_c_order():
    """A view that is not contiguous is hashed and summed as its bytes in C order (as
    tensor hashes and word_sum take it)."""
    from pulsediff.format.digest import TREE

    rng = np.random.default_rng(3)
    old = rng.integers(0, 1 << 16, (64, 96), dtype=np.uint16)[:, ::3]
    new = old.copy()
    new[5, 7] += 1
    h_old, h_new = TREE.hasher(), TREE.hasher()
    zigzag, _, _, old_sum, new_sum = cpu.diff_ranks_checked(old, new, 7, 255, h_old, h_new)
    assert zigzag.size == 1 and h_old.hexdigest() == TREE.tensor_hash(np.ascontiguousarray(old))
    assert h_new.hexdigest() == TREE.tensor_hash(new) and (old_sum, new_sum) == (cpu.word_sum(old), cpu.word_sum(new))


def test_diff_ranks_checked_fails_whole_and_waits_for_no_one(monkeypatch, fresh_pool):
    """A range that fails still passes the hashing turn on: the call raises the error (no
    thread is left waiting on a turn that never comes)."""
    monkeypatch.setenv("PULSEDIFF_THREADS", "2")
    monkeypatch.setattr(cpu, "_CHECKED_RANGE_BYTES", 4096)
    real = cpu._checked_diff_range
    calls = []

    def flaky(old, new, lo, *rest):
        calls.append(lo)
        if lo == 2048 * 3:
            raise MemoryError("range 3")
        return real(old, new, lo, *rest)

    monkeypatch.setattr(cpu, "_checked_diff_range", flaky)
    old = np.arange(2048 * 8, dtype=np.uint16)
    new = old.copy()
    new[::100] += 1  # sparse: each range is read once

    class Hasher:
        def __init__(self):
            self.parts = 0

        def update(self, data):
            self.parts += 1

    h_old, h_new = Hasher(), Hasher()
    with pytest.raises(MemoryError, match="range 3"):
        cpu.diff_ranks_checked(old, new, 7, 255, h_old, h_new)
    assert sorted(calls) == [2048 * c for c in range(8)] and h_old.parts == h_new.parts == 7  # every range but the failed one


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.just(0), st.integers(1, 5), st.integers(1, 10**9)), min_size=256, max_size=256),
       st.booleans())
def test_quantise_frequencies_matches_the_numpy_reference(counts, few):
    """The Numba form of quantise_frequencies gives the NumPy form's table bit for bit (a section's
    bytes depend on it): many ties, huge and tiny counts, one symbol, none."""
    from reference import quantise_frequencies_ref

    counts = np.array(counts, np.int64)
    if few:  # one or two symbols present: the rounding error all on one
        counts[np.argsort(counts)[:-2]] = 0
    want = quantise_frequencies_ref(counts)
    got = entropy.quantise_frequencies(counts)
    assert got.dtype == np.int64 and np.array_equal(got, want)
    if counts.sum():
        assert got.sum() == entropy.PROB_SCALE and (got[counts > 0] >= 1).all() and not got[counts == 0].any()
