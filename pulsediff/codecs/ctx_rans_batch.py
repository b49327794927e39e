"""Batches of small ctx-rans sections, for the CPU's one-call decode (kernels/cpu_batch.py).

`Batch.add` checks each section's params (ctx_rans.section_layout) and keeps its payload, the
caller's ops layer hands `Batch.run` the CPU kernels (a codec never chooses a backend), and
`BatchResult` turns the kernel's status into the per-section path's error, word for word.
`tests/test_ctx_rans_batch.py` checks every status against the per-section path on damaged
sections, and results bit for bit on random tensors.
"""

from __future__ import annotations

import numpy as np

from pulsediff.errors import CorruptPatchError

# Status codes of kernels/cpu_batch.py, the same numbers (a codec does not import a backend; the
# kernels are handed to Batch.run; tests/test_ctx_rans_batch.py pins the two lists together).
OK = 0
(TABLE_VARINT, TABLE_RANGE, TABLE_TRUNCATED, TABLE_ORDER, TABLE_TRAILING, TABLE_SUM, RANKS_OUTSIDE,
 RANKS_DAMAGED, FREQ_VARINT, FREQ_RANGE, FREQ_TRUNCATED, FREQ_ORDER, FREQ_TRAILING, FREQ_SCALE,
 VALUES_DAMAGED, ESCAPES, OUTSIDE_CLASS, NOT_FOUND, TARGET_SUM) = range(1, 20)
META_COLUMNS = 14  # kernels/cpu_batch.py's meta table: one row per section, columns in its order
M_COUNT, M_UNDO = 2, 10

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


# -- the caller's side: a batch assembled section by section ---------------------------------

# Tensors up to this many elements are batched; a larger one is worth its own call, whose
# walk spreads over the threads.
BATCH_MAX_NUMEL = 1 << 20
# A batch is closed once its tensors hold this many elements: big enough that a call's ~20 us
# is noise, small enough that the threads share a state dict's batches evenly.
BATCH_ELEMENTS = 1 << 21


def batchable(rec) -> bool:
    """Whether a tensor record's section can go in a batch: a small ctx-rans patch."""
    return rec.op == "patch" and rec.section.codec == "ctx-rans" and rec.numel <= BATCH_MAX_NUMEL


class Batch:
    """Consecutive ctx-rans sections of one element width, applied by one kernel call.

    `add` checks each section's params (ctx_rans.section_layout) and keeps its payload; `run`
    applies them all (on any thread). `views` are flat host arrays over the live tensors' memory:
    the caller keeps them alive and unwritten by anyone else until `run` returns."""

    def __init__(self, dtype: np.dtype):
        self.dtype = np.dtype(dtype)
        self.names: list[str] = []
        self.views: list = []
        self._addresses: list[int] = []
        self._payloads: list[bytes] = []
        self._rows: list[tuple] = []
        self._offset = 0
        self._undo = 0
        self.elements = 0

    def __len__(self) -> int:
        return len(self.names)

    def add(self, name: str, view, payload: bytes, params: dict, ctx, base_sum: int | None = None,
            target_sum: int | None = None, span: tuple[int, int] | None = None) -> None:
        """One more section, for the tensor at `view`; its word sum after is checked against
        `target_sum` when the sum before, `base_sum`, is given. `span` (address, elements) says
        where the tensor is when `view` is not a NumPy array over it (a handle the caller gets
        back from `BatchResult.applied`: a live apply makes no view of a tensor it need not)."""
        from pulsediff.codecs.ctx_rans import section_layout

        count, shift, mask, escapes, lengths = section_layout(params, ctx, len(payload))
        check = base_sum is not None and target_sum is not None
        address, size = span if span is not None else (view.__array_interface__["data"][0], view.size)
        self._rows.append((self._offset, size, count, shift, mask, escapes, *lengths, self._undo,
                           _as_int64(base_sum or 0), _as_int64(target_sum or 0), int(check)))
        self.names.append(name)
        self.views.append(view)
        self._addresses.append(address)
        self._payloads.append(payload)
        self.source = ctx.source
        self._offset += len(payload)
        self._undo += count
        self.elements += size

    def run(self, kernels) -> "BatchResult":
        """Apply every section with `kernels` (kernels/cpu_batch.py, which the caller chose)."""
        meta = np.array(self._rows, np.int64).reshape(-1, META_COLUMNS)
        data = np.frombuffer(b"".join(self._payloads), np.uint8)
        addresses = np.array(self._addresses, np.int64)
        positions = np.empty(self._undo, np.int64)
        old = np.empty(self._undo, self.dtype)
        sums_after = np.zeros(len(self.names), np.int64)
        status, index = kernels.apply_batch(data, meta, addresses, np.empty(0, self.dtype), positions, old,
                                            sums_after)
        self._payloads = self._rows = None  # decoded: an undo log that keeps the result needs them no more
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

    def columns(self) -> tuple[list[str], list[int], list[int]]:
        """The tensors applied: their names, changed elements and word sums after, as lists."""
        done = self.done
        return (self.batch.names[:done], self._counts[:done].tolist(),
                self._sums[:done].view(np.uint64).tolist())

    def error(self) -> CorruptPatchError | None:
        """The failed tensor's error, None when every tensor was applied."""
        if self.status == OK:
            return None
        return CorruptPatchError(self.batch.source, failure_message(self.status, self.batch.names[self.done]))


def _as_int64(value: int) -> int:
    """A word sum in [0, 2**64) as the int64 of the same bits (meta is an int64 table)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def word_sums_of(views: list[np.ndarray], kernels) -> list[int]:
    """The word sum (FORMAT.md 3.1) of each host array, in one call of `kernels` (kernels/cpu_batch.py)."""
    return word_sums_at([v.__array_interface__["data"][0] for v in views], [v.nbytes for v in views], kernels)


def word_sums_at(addresses: list[int], nbytes: list[int], kernels) -> list[int]:
    """The word sum of each host buffer of `nbytes[i]` bytes at `addresses[i]`, in one call."""
    addresses = np.array(addresses, np.int64)
    nbytes = np.array(nbytes, np.int64)
    out = np.zeros(len(addresses), np.int64)
    kernels.word_sums(addresses, nbytes, out)
    return [int(s) & 0xFFFFFFFFFFFFFFFF for s in out]
