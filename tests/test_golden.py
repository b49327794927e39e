"""Committed patches from earlier releases must keep applying, byte for byte.

The files in tests/golden/v1 were written once by scripts/make_golden.py and
are never regenerated: a failure here means old patches broke.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pulsediff import apply_patch, read_patch_header
from pulsediff.ops.inspect import checkpoint_digest_of

from ckpt_factory import folder_bytes

GOLDEN = Path(__file__).parent / "golden"
CASES = [(version, name, spec) for version in sorted(p for p in GOLDEN.iterdir() if p.is_dir())
         for name, spec in json.loads((version / "expected.json").read_text()).items()]


# Under the CUDA simulator a golden base of more than this many bytes takes minutes (v1.4's and v1.5's 284 KB base, with a
# tensor of two hash chunks: 110 s a patch, where the others take 7 s): those cases run in the slow tier
# (`pytest -m slow`, which .ci/run runs too); the CPU applies every golden patch in the default one.
SIMULATOR_BASE_BYTES = 64 << 10
# Versions differ in what the host reads (header fields, hashes, sums); the device runs the same kernels for
# all of them. The default tier applies the newest version's light patches on the simulated device, the
# older versions' there in the slow tier (each ~8 s under the simulator: 24 of them were 1.5 minutes of the
# default tier's wall time on two cores).
NEWEST = max((v for v, _, _ in CASES), key=lambda v: tuple(int(x) for x in v.name[1:].split(".")))


def _cases(device: str) -> list:
    def heavy(folder, spec) -> bool:
        base = folder / spec["base"]
        return device == "cuda" and ((base.is_file() and base.stat().st_size > SIMULATOR_BASE_BYTES)
                                     or folder != NEWEST)

    return [pytest.param(device, v, n, spec, id=f"{device}-{v.name}/{n}",
                         marks=[pytest.mark.slow] if heavy(v, spec) else []) for v, n, spec in CASES]


@pytest.mark.parametrize("device,folder,patch,spec", _cases("cpu") + _cases("cuda"))
def test_golden_patch_applies(tmp_path, folder, patch, spec, device):
    if device == "cuda":
        from pulsediff.kernels import cuda_usable

        if not cuda_usable()[0]:
            pytest.skip("no CUDA (real or simulated)")
    target = folder / spec["target"]
    out = tmp_path / ("out" if target.is_dir() else "out.safetensors")
    header = read_patch_header(folder / patch)
    assert header.target_digest == spec["target_digest"]
    # Today's hashing of the target, under the patch's scheme, is what the old writer recorded.
    assert checkpoint_digest_of(target, header.precision, scheme=header.scheme) == spec["target_digest"]
    apply_patch(folder / spec["base"], folder / patch, out, device=device)
    assert checkpoint_digest_of(out) == checkpoint_digest_of(target)
    if target.is_dir():  # every file of the folder, config and tokenizer included, byte for byte
        assert folder_bytes(out) == folder_bytes(target)
    else:
        assert out.read_bytes() == target.read_bytes()


def test_golden_covers_every_format_version_and_folder_files():
    from pulsediff.format.container import FORMAT_MAJOR, FORMAT_MINOR, WRITE_VERSIONS

    for major, minor in WRITE_VERSIONS.values():  # every version make writes
        assert (GOLDEN / f"v{major}.{minor}").is_dir()
    assert FORMAT_MAJOR == 2 and FORMAT_MINOR == 0 and (GOLDEN / "v1").is_dir()
    folder_patches = [read_patch_header(folder / p) for folder, p, _ in CASES if p.startswith("exact.folder.")]
    assert folder_patches and all({f.op for f in h.files} == {"same", "full"} and h.removed_files for h in folder_patches)


def test_golden_covers_every_codec():
    from pulsediff.codecs import CODEC_IDS

    used = set()
    for folder, patch, _ in CASES:
        used |= {t.section.codec for t in read_patch_header(folder / patch).tensors if t.section}
    assert used >= set(CODEC_IDS)
