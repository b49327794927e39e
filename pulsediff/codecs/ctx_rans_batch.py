"""Many ctx-rans sections decoded and applied to live CPU tensors in one kernel call.

The cost of patching a state dict should follow its changed elements, not its
tensors (the many-small-tensors rule of PyTorch's `multi_tensor_apply`): an
MoE checkpoint holds 18k expert tensors of a few thousand changes each, and
the per-section path (`CtxRans.locate`, then `add_at_summed` and a word sum)
spends about 0.4-0.8 ms per tensor in Python, NumPy calls and thread handoffs
against a few microseconds of work.

Here a *batch*, a run of consecutive small sections of one element width, is
one `@njit(nogil=True)` call that for each tensor in turn does everything the
per-section path does on one thread, with the same checks in the same order:
the class table, the Rice-coded ranks, the frequency table, the rANS values
and their escapes, the countdown walk from rank to position, the class-size
and found-count checks, the in-place add with its undo log, and the target
word sum from the written words (`add_at_summed`'s telescoping change). Batches
run on the worker threads, one per thread. A failure is a status code and
the index of the tensor; the kernel first puts back that tensor's own writes,
so the caller's undo log covers exactly the tensors before it.

The tensors are reached through their addresses (`numba.carray` over the
live memory; the caller keeps the arrays alive for the call), so a batch
needs no list of arrays, whose boxing would cost what it saves.

`tests/test_ctx_rans_batch.py` checks every status against the per-section
path on damaged sections, and results bit for bit on random tensors.
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from pulsediff.codecs import entropy
from pulsediff.errors import CorruptPatchError
from pulsediff.kernels.cpu import _locate_whole, _word_sum_range, _word_term_at

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

_MESSAGES = {
    TABLE_VARINT: "class table: bad varint", TABLE_RANGE: "class table: value out of range",
    TABLE_TRUNCATED: "class table: truncated", TABLE_ORDER: "class table: classes out of order or bad Rice parameter",
    TABLE_TRAILING: "class table: trailing bytes", TABLE_SUM: "class table: class counts do not add up",
    RANKS_OUTSIDE: "positions fall outside the tensor", RANKS_DAMAGED: "position stream is damaged",
    FREQ_VARINT: "frequency table: bad varint", FREQ_RANGE: "frequency table: value out of range",
    FREQ_TRUNCATED: "frequency table: truncated", FREQ_ORDER: "frequency table: symbols out of order",
    FREQ_TRAILING: "frequency table: trailing bytes", FREQ_SCALE: "frequency table: frequencies do not sum to the scale",
    VALUES_DAMAGED: "value stream is damaged", ESCAPES: "escape count mismatch",
    OUTSIDE_CLASS: "positions fall outside their class", NOT_FOUND: "positions fall outside the tensor",
}


def failure_message(status: int, name: str) -> str:
    """The per-section path's words for a batch's failure in tensor `name`."""
    if status == TARGET_SUM:
        return f"tensor {name!r} does not rebuild to its recorded word sum"
    return f"tensor {name!r}: {_MESSAGES[status]}"


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
        found = _locate_whole(base, row[M_SHIFT], mask, offsets, ranks, where, sizes) if base.size else 0
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
            before = _word_term_at(base, j, per, bits)
            v = base[p]
            old[e] = v
            z = zigzag[e]
            base[p] = v + ((z >> np.uint64(1)) ^ (np.uint64(0) - (z & np.uint64(1))))  # un-zigzag, wraps
            change += _word_term_at(base, j, per, bits) - before
        after = np.uint64(row[M_BASE_SUM]) + change
        sums_after[t] = np.int64(after)
        if row[M_CHECK_SUM] and after != np.uint64(row[M_TARGET_SUM]):
            for e in range(count - 1, -1, -1):
                base[where[e]] = old[e]
            return TARGET_SUM, t
    return OK, meta.shape[0]


@njit(cache=True, nogil=True)
def word_sums(addresses, nbytes, out):
    """FORMAT.md §3.1's word sum of each buffer (kernels.cpu.word_sum, one thread each) into
    `out` (as int64 bit patterns)."""
    for t in range(addresses.size):
        raw = carray(_pointer(addresses[t]), nbytes[t], np.uint8)
        nwords = nbytes[t] // 8
        total = _word_sum_range(raw[:8 * nwords].view(np.uint64), 0, nwords) if nwords else np.uint64(0)
        if nbytes[t] % 8:  # the last word, zero-padded
            total += _word_term_at(raw, nwords, 8, 8)
        out[t] = np.int64(total)


# -- the caller's side: a batch assembled section by section ---------------------------------

# Tensors up to this many elements are batched; a larger one is worth its own call, whose
# walk spreads over the threads.
BATCH_MAX_NUMEL = 1 << 20
# A batch is closed once its tensors hold this many elements: big enough that a call's ~20 us
# is noise, small enough that the threads share a state dict's batches evenly.
BATCH_ELEMENTS = 1 << 21


class Batch:
    """Consecutive ctx-rans sections of one element width, applied by one `apply_batch` call.

    `add` checks each section's params (ctx_rans.section_layout) and keeps its payload; `run`
    applies them all (on any thread). `views` are flat host arrays over the live tensors' memory:
    the caller keeps them alive and unwritten by anyone else until `run` returns."""

    def __init__(self, dtype: np.dtype):
        self.dtype = np.dtype(dtype)
        self.names: list[str] = []
        self.views: list[np.ndarray] = []
        self._payloads: list[bytes] = []
        self._rows: list[tuple] = []
        self._offset = 0
        self._undo = 0
        self.elements = 0

    def __len__(self) -> int:
        return len(self.names)

    def add(self, name: str, view: np.ndarray, payload: bytes, params: dict, ctx, base_sum: int | None = None,
            target_sum: int | None = None) -> None:
        """One more section, for the tensor at `view`; its word sum after is checked against
        `target_sum` when the sum before, `base_sum`, is given."""
        from pulsediff.codecs.ctx_rans import section_layout

        count, shift, mask, escapes, lengths = section_layout(params, ctx, len(payload))
        check = base_sum is not None and target_sum is not None
        self._rows.append((self._offset, view.size, count, shift, mask, escapes, *lengths, self._undo,
                           _as_int64(base_sum or 0), _as_int64(target_sum or 0), int(check)))
        self.names.append(name)
        self.views.append(view)
        self._payloads.append(payload)
        self.source = ctx.source
        self._offset += len(payload)
        self._undo += count
        self.elements += view.size

    def run(self) -> "BatchResult":
        meta = np.array(self._rows, np.int64).reshape(-1, META_COLUMNS)
        data = np.frombuffer(b"".join(self._payloads), np.uint8)
        addresses = np.array([v.__array_interface__["data"][0] for v in self.views], np.int64)
        positions = np.empty(self._undo, np.int64)
        old = np.empty(self._undo, self.dtype)
        sums_after = np.zeros(len(self.names), np.int64)
        status, index = apply_batch(data, meta, addresses, np.empty(0, self.dtype), positions, old, sums_after)
        return BatchResult(self, int(status), int(index), meta[:, M_UNDO], meta[:, M_COUNT], positions, old,
                           sums_after)


class BatchResult:
    """What a batch did: tensors [0, done) applied, then the failure (status, at `done`) if any."""

    def __init__(self, batch: Batch, status: int, index: int, starts, counts, positions, old, sums_after):
        self.batch, self.status = batch, status
        self.done = index if status != OK else len(batch)
        self._starts, self._counts, self._positions, self._old = starts, counts, positions, old
        self._sums = sums_after

    def applied(self):
        """(name, view, positions, old values, word sum after, changed elements) per tensor applied."""
        for t in range(self.done):
            lo, n = int(self._starts[t]), int(self._counts[t])
            yield (self.batch.names[t], self.batch.views[t], self._positions[lo:lo + n], self._old[lo:lo + n],
                   int(self._sums[t]) & 0xFFFFFFFFFFFFFFFF, n)

    def error(self) -> CorruptPatchError | None:
        """The failed tensor's error, None when every tensor was applied."""
        if self.status == OK:
            return None
        return CorruptPatchError(self.batch.source, failure_message(self.status, self.batch.names[self.done]))


def _as_int64(value: int) -> int:
    """A word sum in [0, 2**64) as the int64 of the same bits (meta is an int64 table)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def word_sums_of(views: list[np.ndarray]) -> list[int]:
    """kernels.cpu.word_sum of each host array, in one kernel call."""
    addresses = np.array([v.__array_interface__["data"][0] for v in views], np.int64)
    nbytes = np.array([v.nbytes for v in views], np.int64)
    out = np.zeros(len(views), np.int64)
    word_sums(addresses, nbytes, out)
    return [int(s) & 0xFFFFFFFFFFFFFFFF for s in out]
