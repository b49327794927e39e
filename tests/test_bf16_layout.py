"""`--precision bf16` on folders: the receiver keeps its own BF16 file layout.

The trainer diffs FP32 master folders (its sharding, its metadata); the
worker holds BF16 weights saved by its own tool, sharded its own way. Applying
onto such a base writes the base's layout (file names, sharding, headers,
index) around the new values, byte for byte what the worker's tool would have
saved; the trainer's layout is used only when the base has no BF16 layout of
its own (it is FP32 itself, or its tensors differ from the target's).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import torch

from pulsediff import apply_patch, make_patch
from pulsediff.ops.inspect import checkpoint_digest_of

from ckpt_factory import folder_bytes, save, save_sharded

CLI = [sys.executable, "-m", "pulsediff.cli.main"]


def _steps(rng):
    w0 = {f"layer{i}.w": torch.from_numpy(rng.standard_normal((40, 24)).astype(np.float32)) for i in range(5)}
    w1 = {k: v + 3e-3 * torch.from_numpy(rng.standard_normal(v.shape).astype(np.float32)) * v for k, v in w0.items()}
    return w0, w1


def _bf16(tensors):
    return {k: v.to(torch.bfloat16) for k, v in tensors.items()}


def test_applied_onto_a_bf16_folder_keeps_its_layout(tmp_path):
    w0, w1 = _steps(np.random.default_rng(3))
    trainer0 = save_sharded(w0, tmp_path / "fp32_0", 3)  # the trainer's sharding: 3 FP32 files
    trainer1 = save_sharded(w1, tmp_path / "fp32_1", 3)
    worker = save_sharded(_bf16(w0), tmp_path / "worker", 2, metadata={"saved_by": "worker"})  # its own: 2 files
    expected = save_sharded(_bf16(w1), tmp_path / "expected", 2, metadata={"saved_by": "worker"})
    patch = tmp_path / "p"
    make_patch(trainer0, trainer1, patch, precision="bf16", device="cpu")

    result = apply_patch(worker, patch, tmp_path / "out", device="cpu")
    assert result.layout_from_base
    assert folder_bytes(tmp_path / "out") == folder_bytes(expected)  # the worker's tool's bytes exactly
    apply_patch(worker, patch, in_place=True, device="cpu")
    assert folder_bytes(worker) == folder_bytes(expected)

    # Through the CLI from a file, and from stdin (which cannot be read out of order: the patch's layout,
    # the same tensors).
    worker2 = save_sharded(_bf16(w0), tmp_path / "worker2", 2, metadata={"saved_by": "worker"})
    subprocess.run(CLI + ["apply", str(worker2), str(patch), "-o", str(tmp_path / "cli")], check=True, capture_output=True)
    assert folder_bytes(tmp_path / "cli") == folder_bytes(expected)
    with open(patch, "rb") as f:
        run = subprocess.run(CLI + ["apply", str(worker2), "-", "-o", str(tmp_path / "piped")], stdin=f,
                             capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert checkpoint_digest_of(tmp_path / "piped") == checkpoint_digest_of(expected)


def test_a_single_file_receiver_stays_a_single_file(tmp_path):
    w0, w1 = _steps(np.random.default_rng(4))
    trainer0, trainer1 = save_sharded(w0, tmp_path / "a", 2), save_sharded(w1, tmp_path / "b", 2)
    worker = save(_bf16(w0), tmp_path / "worker.safetensors", metadata={"step": "n/a"})
    expected = save(_bf16(w1), tmp_path / "expected.safetensors", metadata={"step": "n/a"})
    make_patch(trainer0, trainer1, tmp_path / "p", precision="bf16", device="cpu")
    apply_patch(worker, tmp_path / "p", tmp_path / "out.safetensors", device="cpu")
    assert (tmp_path / "out.safetensors").read_bytes() == expected.read_bytes()


def test_without_a_bf16_layout_the_trainers_layout_is_used(tmp_path):
    w0, w1 = _steps(np.random.default_rng(5))
    trainer0, trainer1 = save_sharded(w0, tmp_path / "a", 3), save_sharded(w1, tmp_path / "b", 3)
    make_patch(trainer0, trainer1, tmp_path / "p", precision="bf16", device="cpu")
    result = apply_patch(trainer0, tmp_path / "p", tmp_path / "out", device="cpu")  # the FP32 base itself
    assert not result.layout_from_base
    assert sorted(folder_bytes(tmp_path / "out")) == sorted(folder_bytes(trainer1))  # the trainer's file names
    assert checkpoint_digest_of(tmp_path / "out") == checkpoint_digest_of(trainer1, precision="bf16")


def _bf16_files(tmp_path):
    """A BF16 pair of files as a trainer that keeps BF16 weights saves them, each step in its metadata."""
    from safetensors.torch import save_file

    w0, w1 = _steps(np.random.default_rng(11))
    base, target = tmp_path / "step0.safetensors", tmp_path / "step1.safetensors"
    save_file(_bf16(w0), str(base), metadata={"step": "0"})
    save_file(_bf16(w1), str(target), metadata={"step": "1"})
    return base, target


def test_a_bf16_patch_of_files_already_bf16_writes_the_trainers_files(tmp_path):
    """Nothing cast (layout.cast false, format 1.5): the trainer's files are the target's, metadata and
    all; the base's layout would carry its own step."""
    from pulsediff.format.patch_file import read_patch_header

    base, target = _bf16_files(tmp_path)
    make_patch(base, target, tmp_path / "p.pulsediff", precision="bf16")
    assert read_patch_header(tmp_path / "p.pulsediff").layout.cast is False
    apply_patch(base, tmp_path / "p.pulsediff", tmp_path / "out.safetensors")
    assert (tmp_path / "out.safetensors").read_bytes() == target.read_bytes()


def test_an_exact_patch_relabelled_bf16_still_writes_the_target(tmp_path):
    """Issue 48, item 11: `precision` edited from exact to bf16 behind recomputed checksums applied with
    the base's layout and metadata ("step": "0" on a step-1 output). The edit now changes nothing: the
    patch does not say that its trainer cast anything, so its layout, checked by layout.digest, is
    written. (A preamble rewritten to a version before 1.5 as well is read by that version's rule:
    FORMAT.md §5.2.)"""
    from fuzz_cases import assemble, split_patch

    from pulsediff.format.container import FORMAT_MINOR

    base, target = _bf16_files(tmp_path)
    make_patch(base, target, tmp_path / "exact.pulsediff")
    header = split_patch((tmp_path / "exact.pulsediff").read_bytes())
    assert header["precision"] == "exact" and "cast" not in header["layout"]
    header["precision"] = "bf16"
    (tmp_path / "relabelled.pulsediff").write_bytes(assemble(header, minor=FORMAT_MINOR))
    apply_patch(base, tmp_path / "relabelled.pulsediff", tmp_path / "out.safetensors")
    assert (tmp_path / "out.safetensors").read_bytes() == target.read_bytes()


def test_layout_cast_must_be_true_or_false(tmp_path):
    from fuzz_cases import assemble, split_patch

    from pulsediff.errors import CorruptPatchError
    from pulsediff.format.patch_file import read_patch_header

    base, target = _bf16_files(tmp_path)
    make_patch(base, target, tmp_path / "p.pulsediff", precision="bf16")
    header = split_patch((tmp_path / "p.pulsediff").read_bytes())
    for value in (1, 0, "true", None, []):
        header["layout"]["cast"] = value
        (tmp_path / "edited.pulsediff").write_bytes(assemble(header))
        if value is None:  # null: not written (a 1.4 writer's patch, or an exact one)
            assert read_patch_header(tmp_path / "edited.pulsediff").layout.cast is None
            continue
        try:
            read_patch_header(tmp_path / "edited.pulsediff")
        except CorruptPatchError as exc:
            assert "layout.cast" in str(exc)
        else:
            raise AssertionError(f"layout.cast {value!r} was accepted")
