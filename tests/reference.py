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
