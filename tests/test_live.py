"""Patches on live tensors (pulsediff.ops.live): state dicts in memory, interchangeable with files."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import pulsediff
from pulsediff.errors import BaseMismatchError, TensorMismatchError
from pulsediff.ops.inspect import checkpoint_digest_of

from ckpt_factory import TORCH_DTYPES, mutate, random_tensor


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                                        and _bits(a[k]) == _bits(b[k]) for k in a)


def _clone(d: dict) -> dict:
    return {k: v.clone() for k, v in d.items()}


def _pair(seed: int, dtypes=tuple(TORCH_DTYPES)):
    rng = np.random.default_rng(seed)
    old = {f"t.{name}.{i}": random_tensor(rng, name, shape)
           for i, shape in enumerate([(0,), (1,), (7, 3), (40, 9)]) for name in dtypes}
    new = {k: mutate(rng, v, 0.05) for k, v in old.items()}
    return old, new


@pytest.mark.parametrize("seed", [0, 1])
def test_patch_from_live_tensors_is_the_patch_from_their_files(tmp_path, seed):
    """Every dtype the file path supports: the same patch bytes from mappings as from the files
    save_file writes, and either patch rebuilds both the file and the live tensors bit for bit."""
    old, new = _pair(seed)
    save_file(old, str(tmp_path / "old.safetensors"))
    save_file(new, str(tmp_path / "new.safetensors"))
    from_files = tmp_path / "files.pulsediff"
    pulsediff.make_patch(tmp_path / "old.safetensors", tmp_path / "new.safetensors", from_files, device="cpu")
    from_live = pulsediff.make_patch_bytes(old, new, device="cpu")
    assert from_live == from_files.read_bytes()
    mixed = pulsediff.make_patch_bytes(old, tmp_path / "new.safetensors", device="cpu")  # a mapping and a file
    assert mixed == from_live
    assert pulsediff.state_dict_digest(new) == checkpoint_digest_of(tmp_path / "new.safetensors")

    pulsediff.apply_patch(tmp_path / "old.safetensors", io.BytesIO(from_live), tmp_path / "out.safetensors", device="cpu")
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "new.safetensors").read_bytes()
    live = _clone(old)
    pointers = {k: v.data_ptr() for k, v in live.items()}
    result = pulsediff.apply_to_state_dict(live, from_files, device="cpu")
    assert result.status == "applied" and _same(live, new)
    assert {k: v.data_ptr() for k, v in live.items()} == pointers  # in place, no tensor replaced
    assert pulsediff.apply_to_state_dict(live, from_files).status == "up-to-date"


def test_a_model_is_patched_through_its_state_dict(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(torch.bfloat16)
    trainer = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(torch.bfloat16)
    trainer.load_state_dict(model.state_dict())
    old = _clone(trainer.state_dict())
    with torch.no_grad():  # a small step: a few BF16 values move
        for p in trainer.parameters():
            p.add_(p * 0.01 * (torch.rand(p.shape) < 0.05))
    patch = pulsediff.make_patch_bytes(old, trainer.state_dict())
    result = pulsediff.apply_to_state_dict(model.state_dict(), patch)
    assert 0 < result.changed_elements < sum(p.numel() for p in model.parameters()) // 10
    x = torch.randn(3, 16).bfloat16()
    assert torch.equal(model(x), trainer(x))


def test_wrong_base_changes_nothing():
    old, new = _pair(3, ("BF16", "F32"))
    patch = pulsediff.make_patch_bytes(old, new)
    wrong = _clone(old)
    wrong["t.F32.3"].view(-1).view(torch.int32)[5] ^= 1  # one bit of one element
    before = _clone(wrong)
    with pytest.raises(BaseMismatchError):
        pulsediff.apply_to_state_dict(wrong, patch)
    assert _same(wrong, before)


def test_a_failure_part_way_through_a_chain_restores_every_tensor():
    """The first patch is written, the second is refused: the undo log puts the first one's writes back."""
    s0, s1 = _pair(4, ("BF16", "I32"))
    s2 = {k: mutate(np.random.default_rng(5), v, 0.05) for k, v in s1.items()}
    p01, p12 = pulsediff.make_patch_bytes(s0, s1), pulsediff.make_patch_bytes(s1, s2)
    live = _clone(s0)
    with pytest.raises(BaseMismatchError):
        pulsediff.apply_to_state_dict(live, [p01, p01 and pulsediff.make_patch_bytes(s2, s0)])
    assert _same(live, s0)
    assert pulsediff.apply_to_state_dict(live, [p01, p12]).status == "applied" and _same(live, s2)


def test_bf16_patch_from_fp32_masters_onto_a_bf16_model():
    rng = np.random.default_rng(6)
    masters0 = {f"w{i}": torch.from_numpy(rng.standard_normal((30, 20)).astype(np.float32)) for i in range(3)}
    masters1 = {k: v + 1e-2 * v * torch.from_numpy(rng.standard_normal(v.shape).astype(np.float32)) for k, v in masters0.items()}
    patch = pulsediff.make_patch_bytes(masters0, masters1, precision="bf16")
    live = {k: v.to(torch.bfloat16) for k, v in masters0.items()}
    pulsediff.apply_to_state_dict(live, patch)
    assert _same(live, {k: v.to(torch.bfloat16) for k, v in masters1.items()})
    with pytest.raises(TensorMismatchError, match="is F32"):  # FP32 live tensors cannot take BF16 values
        pulsediff.apply_to_state_dict(_clone(masters0), patch)


def test_structure_changes_are_refused_before_writing():
    old, new = _pair(7, ("BF16",))
    grown = dict(new, extra=torch.zeros(3))
    live = _clone(old)
    with pytest.raises(TensorMismatchError, match="added or removed"):
        pulsediff.apply_to_state_dict(live, pulsediff.make_patch_bytes(old, grown))
    reshaped = dict(new, **{"t.BF16.3": new["t.BF16.3"].reshape(9, 40)})
    with pytest.raises(TensorMismatchError, match="shape"):
        pulsediff.apply_to_state_dict(live, pulsediff.make_patch_bytes(old, reshaped))
    assert _same(live, old)


def test_an_anchor_sets_any_live_state_of_the_same_structure():
    old, new = _pair(8, ("BF16", "U8"))
    live = _clone(old)
    pulsediff.apply_to_state_dict(live, pulsediff.make_patch_bytes(None, new))
    assert _same(live, new)
