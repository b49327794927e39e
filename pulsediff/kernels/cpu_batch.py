"""Many small ctx-rans sections decoded and applied to host tensors in one kernel call (the CPU's).

The cost of patching a state dict should follow its changed elements, not its tensors (the
many-small-tensors rule of PyTorch's `multi_tensor_apply`): an MoE checkpoint holds 18k expert
tensors of a few hundred changes each, and the per-section path (`CtxRans.locate`, an add and a
word sum) spent 0.4-0.8 ms per tensor in Python, NumPy calls and thread handoffs against a few
microseconds of work.

`apply_batch` takes a *batch*, consecutive small sections of one element width, and for each
tensor in turn does on one thread everything the per-section path does, with the same checks in
the same order: the class table, the Rice-coded ranks, the frequency table, the rANS values and
their escapes (docs/FORMAT.md 6.3), the countdown walk from rank to position
(cpu.locate_whole), the class-size and found-count checks, the in-place add with its undo log,
and the target word sum from the written words (the telescoping change of add_at_summed). A
failure is a status code and the index of the tensor; the kernel first puts back that tensor's
own writes, so the caller's undo log covers exactly the tensors before it. codecs/ctx_rans_batch.py
assembles batches and turns statuses into the codec's errors.

The tensors are reached through their addresses (`numba.carray` over the live memory; the caller
keeps the arrays alive for the call), so a batch needs no list of arrays, whose boxing would cost
what it saves. Bytes moved: each tensor is read once by the walk (and once more by `word_sums`
where its sum is not known), the changed words are written, and the section is read once.
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from pulsediff.kernels import entropy
from pulsediff.kernels.cpu import diff_ranks_range, locate_whole, same_range, word_sum_range, word_term_at
from pulsediff.kernels.ctx_rans_sections import encode_section

# Columns of a batch's int64 `meta` table, one row per section (all checked by the caller
# against the section's length and its tensor, as ctx_rans._split checks them).
(M_OFFSET, M_NUMEL, M_COUNT, M_SHIFT, M_MASK, M_ESCAPES, M_TABLE, M_POSITIONS, M_FREQS, M_VALUES,
 M_UNDO, M_BASE_SUM, M_TARGET_SUM, M_CHECK_SUM) = range(14)
META_COLUMNS = 14

# Status codes: what failed, mapped back to the per-section path's words by `failure_message`.
OK = 0
(TABLE_VARINT, TABLE_RANGE, TABLE_TRUNCATED, TABLE_ORDER, TABLE_TRAILING, TABLE_SUM, RANKS_OUTSIDE,
 RANKS_DAMAGED, FREQ_VARINT, FREQ_RANGE, FREQ_TRUNCATED, FREQ_ORDER, FREQ_TRAILING, FREQ_SCALE,
 VALUES_DAMAGED, ESCAPES, OUTSIDE_CLASS, NOT_FOUND, TARGET_SUM) = range(1, 20)


@intrinsic
def _pointer(typingctx, address):
    """An int64 address as a void pointer, for numba.carray over memory the caller owns."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(types.int64), codegen


@njit(cache=True, nogil=True, inline="always")
def _varint(data, lo, hi, pos, upper):
    """ctx_rans._Reader.varint over data[lo:hi] from pos: (value, new pos, 0), or (0, pos, 1)
    for a bad varint, (0, pos, 2) for a value above `upper` (bits past 64 count as above)."""
    value = np.uint64(0)
    shift = 0
    over = False
    while True:
        if pos >= hi or shift > 63:
            return 0, pos, 1
        byte = np.uint64(data[pos])
        pos += 1
        low = byte & np.uint64(0x7F)
        if shift == 63 and low > np.uint64(1):
            over = True
        value |= low << np.uint64(shift)
        shift += 7
        if not byte & np.uint64(0x80):
            break
    if over or value > np.uint64(upper):
        return 0, pos, 2
    return np.int64(value), pos, 0


@njit(cache=True, nogil=True)
def _decode_section(data, row, ranks, zigzag, symbols, itemsize):
    """One section's class table, ranks and values (ctx_rans._decode_entries and _decode_values,
    checked alike): (status, listed classes, their counts, class offsets)."""
    ncls = row[M_MASK] + 1
    count = row[M_COUNT]
    pos = row[M_OFFSET]
    end = pos + row[M_TABLE]
    classes = np.empty(0, np.int64)
    counts = np.empty(0, np.int64)
    offsets = np.zeros(ncls + 1, np.int64)
    listed, pos, bad = _varint(data, pos, end, pos, ncls)
    if bad:
        return TABLE_VARINT if bad == 1 else TABLE_RANGE, classes, counts, offsets
    classes = np.empty(listed, np.int64)
    counts = np.empty(listed, np.int64)
    ks = np.empty(listed, np.int64)
    total = 0
    for m in range(listed):
        classes[m], pos, bad = _varint(data, pos, end, pos, ncls - 1)
        if not bad:
            counts[m], pos, bad = _varint(data, pos, end, pos, count)
        if bad:
            return TABLE_VARINT if bad == 1 else TABLE_RANGE, classes, counts, offsets
        if pos >= end:
            return TABLE_TRUNCATED, classes, counts, offsets
        ks[m] = data[pos]
        pos += 1
        if ks[m] > 62 or (m and classes[m] <= classes[m - 1]):
            return TABLE_ORDER, classes, counts, offsets
        total += counts[m]
    if pos != end:
        return TABLE_TRAILING, classes, counts, offsets
    if total != count:
        return TABLE_SUM, classes, counts, offsets

    lo = end
    end = lo + row[M_POSITIONS]
    bound = np.full(listed, row[M_NUMEL], np.int64)
    status, used = entropy.rice_decode(data[lo:end], ks, counts, ranks, bound)
    if status == entropy.OUT_OF_RANGE:
        return RANKS_OUTSIDE, classes, counts, offsets
    if status != entropy.OK or used != end - lo:
        return RANKS_DAMAGED, classes, counts, offsets

    pos = end
    end = pos + row[M_FREQS]
    freqs = np.zeros(256, np.int64)
    nsym, pos, bad = _varint(data, pos, end, pos, 256)
    if bad:
        return FREQ_VARINT if bad == 1 else FREQ_RANGE, classes, counts, offsets
    last = -1
    scale = 0
    for _ in range(nsym):
        if pos >= end:
            return FREQ_TRUNCATED, classes, counts, offsets
        s = np.int64(data[pos])
        pos += 1
        if s <= last:
            return FREQ_ORDER, classes, counts, offsets
        f, pos, bad = _varint(data, pos, end, pos, entropy.PROB_SCALE)
        if bad:
            return FREQ_VARINT if bad == 1 else FREQ_RANGE, classes, counts, offsets
        freqs[s] = f
        scale += f
        last = s
    if pos != end:
        return FREQ_TRAILING, classes, counts, offsets
    if count and scale != entropy.PROB_SCALE:
        return FREQ_SCALE, classes, counts, offsets
    lo = end
    end = lo + row[M_VALUES]
    if count:
        cums = np.zeros(256, np.int64)
        for s in range(1, 256):
            cums[s] = cums[s - 1] + freqs[s - 1]
        slot_to_symbol = np.empty(entropy.PROB_SCALE, np.uint8)
        for s in range(256):
            slot_to_symbol[cums[s]:cums[s] + freqs[s]] = s
        if entropy.rans_decode(data[lo:end], freqs, cums, slot_to_symbol, symbols) != entropy.OK:
            return VALUES_DAMAGED, classes, counts, offsets
    escapes = 0
    for i in range(count):
        zigzag[i] = symbols[i]
        if symbols[i] == entropy.ESCAPE:
            escapes += 1
    if escapes != row[M_ESCAPES]:
        return ESCAPES, classes, counts, offsets
    at = end
    for i in range(count):  # escaped values, little-endian, in order
        if symbols[i] == entropy.ESCAPE:
            v = np.uint64(0)
            for b in range(itemsize):
                v |= np.uint64(data[at + b]) << np.uint64(8 * b)
            zigzag[i] = v
            at += itemsize
    for m in range(listed):
        offsets[classes[m] + 1] = counts[m]
    for c in range(ncls):
        offsets[c + 1] += offsets[c]
    return OK, classes, counts, offsets


@njit(cache=True, nogil=True)
def apply_batch(data, meta, addresses, like, undo_positions, undo_old, sums_after):
    """Decode and apply the batch's sections in order into the tensors at `addresses` (elements
    of `like`'s dtype); returns (status, index of the failed tensor or the count done).

    Per tensor t: its entries' positions go to undo_positions[meta[t, M_UNDO]:][:count] and the
    old values to undo_old likewise; the word sum after (from the words written, starting at
    meta[t, M_BASE_SUM], the sum before) to sums_after[t], checked against M_TARGET_SUM where
    M_CHECK_SUM is set (a caller that checks the tensor's hash instead leaves it 0).
    A failed tensor is left as it was, and nothing after it is touched."""
    itemsize = like.itemsize
    per = 8 // itemsize
    bits = 8 * itemsize
    for t in range(meta.shape[0]):
        row = meta[t]
        count = row[M_COUNT]
        u0 = row[M_UNDO]
        where = undo_positions[u0:u0 + count]
        old = undo_old[u0:u0 + count]
        ranks = np.empty(count, np.int64)
        zigzag = np.empty(count, np.uint64)
        symbols = np.empty(count, np.uint8)
        status, classes, counts, offsets = _decode_section(data, row, ranks, zigzag, symbols, itemsize)
        if status != OK:
            return status, t
        base = carray(_pointer(addresses[t]), row[M_NUMEL], like.dtype)
        mask = row[M_MASK]
        where[:] = -1
        sizes = np.zeros(mask + 1, np.int64)
        found = locate_whole(base, row[M_SHIFT], mask, offsets, ranks, where, sizes) if base.size else 0
        end = 0
        for m in range(classes.size):  # Entries.check_classes: ranks ascend within a class
            end += counts[m]
            if counts[m] > 0 and ranks[end - 1] >= sizes[classes[m]]:
                return OUTSIDE_CLASS, t
        if found != count:
            return NOT_FOUND, t
        change = np.uint64(0)  # kernels.cpu._add_at_summed, every position found and in range
        for e in range(count):
            p = where[e]
            j = p // per
            before = word_term_at(base, j, per, bits)
            v = base[p]
            old[e] = v
            z = zigzag[e]
            base[p] = v + ((z >> np.uint64(1)) ^ (np.uint64(0) - (z & np.uint64(1))))  # un-zigzag, wraps
            change += word_term_at(base, j, per, bits) - before
        after = np.uint64(row[M_BASE_SUM]) + change
        sums_after[t] = np.int64(after)
        if row[M_CHECK_SUM] and after != np.uint64(row[M_TARGET_SUM]):
            for e in range(count - 1, -1, -1):
                base[where[e]] = old[e]
            return TARGET_SUM, t
    return OK, meta.shape[0]


@njit(cache=True, nogil=True, inline="always")
def _word_sum_at(address, nbytes):
    # kernels.cpu.word_sum of the nbytes bytes at `address`.
    raw = carray(_pointer(address), nbytes, np.uint8)
    nwords = nbytes // 8
    total = word_sum_range(raw[:8 * nwords].view(np.uint64), 0, nwords) if nwords else np.uint64(0)
    if nbytes % 8:  # the last word, zero-padded
        total += word_term_at(raw, nwords, 8, 8)
    return total


@njit(cache=True, nogil=True)
def word_sums(addresses, nbytes, out):
    """FORMAT.md §3.1's word sum of each buffer (kernels.cpu.word_sum, one thread each) into
    `out` (as int64 bit patterns)."""
    for t in range(addresses.size):
        out[t] = np.int64(_word_sum_at(addresses[t], nbytes[t]))


# -- make: many small tensor pairs compared and coded in one call -----------------------------

# Columns of diff_encode_batch's int64 `rows` table, one row per tensor pair.
(R_CHANGED, R_OLD_SUM, R_NEW_SUM, R_SECTION, R_TABLE, R_POSITIONS, R_FREQUENCIES, R_VALUES,
 R_ESCAPES) = range(9)
ROW_COLUMNS = 9


@njit(cache=True, nogil=True)
def diff_encode_batch(old_addresses, new_addresses, numels, like, shift, bits, max_changed, rows, out):
    """For each pair t of tensors at old_addresses[t] and new_addresses[t] (numels[t] elements of
    `like`'s dtype), what make's per-tensor path finds in its read of a pair
    (kernels.cpu.diff_ranks_checked, then ctx-rans's coding), on this thread alone: both word sums,
    the changed elements' count and, when there are from 1 to max_changed[t] of them, their
    ctx-rans section (ctx_rans_sections.encode_section) appended to `out`. Fills `rows` (columns R_*;
    R_SECTION is the section's start in `out`, -1 for none) and returns `out`, replaced by a larger
    copy when it was short. Bytes moved: each pair read once (from cache for the sums, which
    come first) and the sections written."""
    itemsize = like.itemsize
    mask = (1 << bits) - 1
    cap = 0
    for t in range(numels.size):
        cap = max(cap, min(numels[t], max_changed[t] + 1))
    zigzag = np.empty(cap, like.dtype)
    classes = np.empty(cap, np.uint16)
    ranks = np.empty(cap, np.int64)
    hist = np.empty(mask + 1, np.int64)
    at = 0
    for t in range(numels.size):
        n = numels[t]
        row = rows[t]
        row[R_OLD_SUM] = np.int64(_word_sum_at(old_addresses[t], n * itemsize))
        row[R_NEW_SUM] = np.int64(_word_sum_at(new_addresses[t], n * itemsize))
        row[R_SECTION] = -1
        old = carray(_pointer(old_addresses[t]), n, like.dtype)
        new = carray(_pointer(new_addresses[t]), n, like.dtype)
        if same_range(old, new, 0, n):
            row[R_CHANGED] = 0
            continue
        room = min(n, max_changed[t] + 1)
        k = diff_ranks_range(old, new, 0, n, shift, mask, zigzag[:room], classes[:room], ranks[:room], hist)
        row[R_CHANGED] = k
        if k == 0 or k > max_changed[t]:
            continue
        out, end, table, positions, frequencies, values, escapes = encode_section(
            classes[:k], ranks[:k], zigzag[:k], bits, out, at)
        row[R_SECTION] = at
        row[R_TABLE], row[R_POSITIONS], row[R_FREQUENCIES], row[R_VALUES] = table, positions, frequencies, values
        row[R_ESCAPES] = escapes
        at = end
    return out
