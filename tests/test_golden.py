"""Committed patches from earlier releases must keep applying, byte for byte.

The files in tests/golden/v1 were written once by scripts/make_golden.py and
are never regenerated: a failure here means old patches broke.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pulsediff import apply_patch, read_patch_header
from pulsediff.inspect import checkpoint_digest_of

GOLDEN = Path(__file__).parent / "golden"
CASES = [(version, name, spec) for version in sorted(p for p in GOLDEN.iterdir() if p.is_dir())
         for name, spec in json.loads((version / "expected.json").read_text()).items()]


@pytest.mark.parametrize("folder,patch,spec", CASES, ids=[f"{v.name}/{n}" for v, n, _ in CASES])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_golden_patch_applies(tmp_path, folder, patch, spec, device):
    if device == "cuda":
        from pulsediff.kernels import cuda_usable

        if not cuda_usable()[0]:
            pytest.skip("no CUDA (real or simulated)")
    out = tmp_path / "out.safetensors"
    header = read_patch_header(folder / patch)
    assert header.target_digest == spec["target_digest"]
    apply_patch(folder / spec["base"], folder / patch, out, device=device)
    assert checkpoint_digest_of(out) == checkpoint_digest_of(folder / spec["target"])
    assert out.read_bytes() == (folder / spec["target"]).read_bytes()


def test_golden_covers_every_codec():
    from pulsediff.codecs import REGISTRY

    used = set()
    for folder, patch, _ in CASES:
        used |= {t.section.codec for t in read_patch_header(folder / patch).tensors if t.section}
    assert used >= set(REGISTRY)
