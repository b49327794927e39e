"""Loading an apply's kernels before the first apply needs them (a server's start).

The warm-up applies small stored patches (ops/warm_patches/, written by scripts/make_warm_patches.py)
to tensors it computes: it never runs make, whose kernels an engine does not need (building its
patch with make_patch_bytes compiled them too, and a first update once waited 35 s on Numba's
compiler lock for them)."""

from __future__ import annotations

from importlib import resources

import numpy as np

from pulsediff.codecs.ctx_rans_batch import BATCH_MAX_NUMEL
from pulsediff.ops.live import apply_to_state_dict, same_width_int

WIDTHS = (1, 2, 4, 8)  # kernels are typed by element width: one stored patch per width
_DTYPE_NAMES = {1: "uint8", 2: "bfloat16", 4: "float32", 8: "float64"}


def warm_patch_name(width: int) -> str:
    return f"warm-{width}.pulsediff"


def warm_pair(width: int) -> tuple[dict, dict]:
    """The base and target the stored patch of this element width was made from: one tensor small
    enough to be batched and two placed on their own, changed by one unit (deltas of a byte) and by
    1000 (escapes). Computed by integer arithmetic, so every NumPy and torch computes the same bits."""
    import torch

    dtype = getattr(torch, _DTYPE_NAMES[width])
    old, new = {}, {}
    for k, (size, step) in enumerate([(64, 1), (BATCH_MAX_NUMEL + 64, 1), (BATCH_MAX_NUMEL + 64, 1000)]):
        i = np.arange(size, dtype=np.uint64)
        values = ((i * np.uint64(2654435761)) % np.uint64(1 << 32) >> np.uint64(9)).astype(np.int64) % 100
        bits = torch.from_numpy(values).to(same_width_int(width))
        changed = bits.clone()
        changed[:20000:100] += step  # the walk still reads the whole tensor; the patch stays ~1-3 KB
        old[f"warm.{k}"], new[f"warm.{k}"] = bits.view(dtype), changed.view(dtype)
    return old, new


def warm_up(dtypes=None, check: str = "prefer-sums") -> float:
    """Load every kernel an apply_to_state_dict of tensors of these torch dtypes (default: BF16 and
    F32) will call, from Numba's cache or by compiling them: a server calls it when it starts, so
    that its first update costs what its tenth does (a 1 GB engine's first update spent 2.7 s of
    its 3.4 s in first calls). One stored patch per element width is applied, with `check` as the
    real applies will take it. Returns the seconds it took."""
    import time

    import torch

    start = time.perf_counter()
    widths = sorted({torch.empty(0, dtype=d).element_size() for d in (dtypes or (torch.bfloat16, torch.float32))})
    stored = resources.files("pulsediff.ops") / "warm_patches"
    for width in widths:
        if width not in WIDTHS:
            continue
        base, _ = warm_pair(width)
        apply_to_state_dict(base, (stored / warm_patch_name(width)).read_bytes(), check=check)
    return time.perf_counter() - start
