"""Write the stored patches the warm-up applies (pulsediff/ops/warm_patches/), one per element width.

Run it after a change to what make writes; tests/test_warm_up.py fails until the stored patches are
what today's make writes for ops.warm.warm_pair, so that the warm-up loads the kernels today's
patches need."""

from __future__ import annotations

from pathlib import Path

from pulsediff.ops.make import make_patch_bytes
from pulsediff.ops.warm import WIDTHS, warm_pair, warm_patch_name

FOLDER = Path(__file__).resolve().parent.parent / "pulsediff" / "ops" / "warm_patches"

if __name__ == "__main__":
    FOLDER.mkdir(exist_ok=True)
    for width in WIDTHS:
        path = FOLDER / warm_patch_name(width)
        path.write_bytes(make_patch_bytes(*warm_pair(width)))
        print(f"{path}: {path.stat().st_size:,} bytes")
