"""Loading an apply's kernels before the first apply needs them (a server's start)."""

from __future__ import annotations

from pulsediff.codecs.ctx_rans_batch import BATCH_MAX_NUMEL
from pulsediff.ops.live import apply_to_state_dict, same_width_int
from pulsediff.ops.make import make_patch_bytes


def warm_up(dtypes=None, check: str = "prefer-sums") -> float:
    """Load every kernel an apply_to_state_dict of tensors of these torch dtypes (default: BF16 and
    F32) will call, from Numba's cache or by compiling them: a server calls it when it starts, so
    that its first update costs what its tenth does (a 1 GB engine's first update spent 2.7 s of
    its 3.4 s in first calls). Kernels are typed by element width, so one dtype per width is run:
    a small patch of one batched tensor and two large ones (deltas of a byte, and escapes), with
    `check` as the real applies will take it.
    Returns the seconds it took."""
    import time

    import torch

    start = time.perf_counter()
    widths = sorted({torch.empty(0, dtype=d).element_size() for d in (dtypes or (torch.bfloat16, torch.float32))})
    gen = torch.Generator().manual_seed(0)
    old, new = {}, {}
    for width in widths:
        dtype = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[width]
        # one batched; two placed on their own, by one unit (deltas of a byte) and by many (escapes)
        for k, (size, step) in enumerate([(64, 1), (BATCH_MAX_NUMEL + 64, 1), (BATCH_MAX_NUMEL + 64, 1000)]):
            bits = torch.randint(0, 100, (size,), generator=gen).to(same_width_int(width))
            changed = bits.clone()
            changed[::50] += step
            old[f"warm.{width}.{k}"], new[f"warm.{width}.{k}"] = bits.view(dtype), changed.view(dtype)
    apply_to_state_dict(old, make_patch_bytes(old, new), check=check)
    return time.perf_counter() - start
