"""The kernel contract: what every backend module (`kernels.cpu`, `kernels.cuda`) provides.

Kept apart from the package's `__init__`, which picks a backend, so that a backend can
name the contract without importing the module that imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np


class Backend(Protocol):
    """What every backend module provides (tests/test_kernels.py checks both against this list and
    against the plain references in tests/reference.py, bit for bit)."""

    def diff_compact(self, old: "np.ndarray", new: "np.ndarray") -> "tuple[np.ndarray, np.ndarray]":
        """Ascending positions where the bit patterns differ, and the new values there."""

    def scatter(self, out: "np.ndarray", positions: "np.ndarray", values: "np.ndarray") -> int:
        """out[positions] = values; returns how many positions were out of range (then nothing is trusted)."""

    def gaps_to_positions(self, gaps: "np.ndarray") -> "tuple[np.ndarray, int]":
        """Positions from gaps (inclusive prefix sum - 1), and the count of invalid gaps."""

    def chunk_class_starts(self, base: "np.ndarray", shift: int, mask: int) -> "tuple[np.ndarray, np.ndarray]":
        """Per chunk and class, the elements of that class before the chunk; and the class sizes."""

    def class_ranks(self, base: "np.ndarray", shift: int, mask: int,
                    positions: "np.ndarray") -> "tuple[np.ndarray, np.ndarray]":
        """Each position's rank within its base class; and the class sizes."""

    def apply_ranked(self, base: "np.ndarray", shift: int, mask: int, starts: "np.ndarray",
                     class_offsets: "np.ndarray", ranks: "np.ndarray", deltas: "np.ndarray",
                     out: "np.ndarray") -> int:
        """out = base with zigzag deltas added at the listed (class, rank) elements; returns how many applied."""

    def diff_ranks(self, old: "np.ndarray", new: "np.ndarray", shift: int,
                   mask: int) -> "tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]":
        """make's compare fused with class_ranks: per changed element in position order, the
        zigzag delta (old's dtype), base class (uint16) and rank in class (int64); class sizes."""

    def class_major_order(self, classes: "np.ndarray", ncls: int) -> "np.ndarray":
        """The stable permutation grouping indices by class."""

    def side_by_side(self) -> int:
        """How many tensors a caller may rebuild at once, each on a worker thread of its own
        (`threads.pool()`); 0: one at a time, each spread over the backend's own parallelism."""

    def resident(self, *arrays: "np.ndarray") -> tuple:
        """The arrays where the kernels use them without a copy (uploaded once to a device)."""

    def ranked_window(self, part: "np.ndarray", shift: int, mask: int, seen: "np.ndarray",
                      class_offsets: "np.ndarray", ranks: "np.ndarray", deltas: "np.ndarray",
                      out: "np.ndarray") -> int:
        """apply_ranked on one window of a host tensor; `seen` holds (and gets) the class counts before it."""

    # Patching live tensors in place (pulsediff.ops.live): each reads or writes the tensor where it lives.
    def word_sum(self, data: "np.ndarray") -> int:
        """FORMAT.md §3.1's sum64 of the array's bytes: the base and target check of a live apply."""

    def ranked_positions(self, base: "np.ndarray", shift: int, mask: int, starts: "np.ndarray",
                         class_offsets: "np.ndarray", ranks: "np.ndarray") -> "tuple[np.ndarray, int]":
        """apply_ranked's walk, noting where each (class, rank) entry lies (-1: not found); and how many were."""

    def locate_ranked(self, base: "np.ndarray", shift: int, mask: int, class_offsets: "np.ndarray",
                      ranks: "np.ndarray") -> "tuple[np.ndarray, int, np.ndarray]":
        """chunk_class_starts then ranked_positions, as each backend does them best: the
        entries' positions (-1: not found), how many were found, and the base's class sizes."""

    def chunk_digests(self, data: "np.ndarray", chunk: int) -> "np.ndarray":
        """XXH3-128 of each `chunk` bytes of the array's bytes, as host rows of (low, high) uint64."""

    def add_at(self, out: "np.ndarray", positions: "np.ndarray",
               deltas: "np.ndarray") -> "tuple[np.ndarray, int]":
        """out[positions] += un-zigzagged deltas in place; the old values (an undo log) and the out-of-range count."""


KERNELS = tuple(name for name in vars(Backend) if not name.startswith("_"))


def first_line(exc: BaseException) -> str:
    """An exception in one line, its type first: what a one-line error or notice shows."""
    text = str(exc).strip().splitlines()
    return f"{exc.__class__.__name__}: {text[0]}" if text else exc.__class__.__name__
