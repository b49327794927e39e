"""One patch file onto its base reads the base once: its tensors are hashed as the rebuild
fetches them, and the base digest is checked before the output is committed (FORMAT.md §7).
A wrong base still fails with the same error and nothing visible; a base that already is the
target is still up to date."""

from __future__ import annotations

import numpy as np
import pytest

import pulsediff.apply as apply_module
from pulsediff import apply_patch, make_patch
from pulsediff.errors import BaseMismatchError, CorruptPatchError

from ckpt_factory import mutate, random_tensor, save


@pytest.fixture()
def pair(tmp_path):
    rng = np.random.default_rng(30)
    old = {f"w{i}": random_tensor(rng, "BF16", (64, 33)) for i in range(4)}
    old["f"] = random_tensor(rng, "F32", (100,))
    old["gone"] = random_tensor(rng, "U8", (7,))
    new = {k: mutate(rng, v, 0.05) for k, v in old.items() if k != "gone"}
    new["f"] = random_tensor(rng, "F32", (100,))  # carried whole: the base's copy is never fetched
    new["added"] = random_tensor(rng, "I32", (5,))
    paths = save(old, tmp_path / "old.safetensors"), save(new, tmp_path / "new.safetensors")
    make_patch(*paths, tmp_path / "p.pulsediff", device="cpu")
    return (*paths, tmp_path / "p.pulsediff")


def _no_hashing_pass(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the base was hashed in a pass of its own")

    monkeypatch.setattr(apply_module, "tensor_ids", refuse)


def test_the_base_is_hashed_as_it_is_rebuilt_not_before(pair, tmp_path, monkeypatch):
    old, new, patch = pair
    _no_hashing_pass(monkeypatch)
    fetched = []
    real_get = apply_module.TensorView.get
    monkeypatch.setattr(apply_module.TensorView, "get", lambda self, name: fetched.append(name) or real_get(self, name))
    result = apply_patch(old, patch, tmp_path / "out.safetensors", device="cpu")
    assert result.status == "applied"
    assert (tmp_path / "out.safetensors").read_bytes() == new.read_bytes()
    # every base tensor fetched once: by the rebuild, or at the end for those it did not need
    assert sorted(fetched) == sorted(["w0", "w1", "w2", "w3", "f", "gone"])


def test_a_wrong_base_fails_as_before_and_leaves_nothing(pair, tmp_path):
    old, new, patch = pair
    rng = np.random.default_rng(31)
    wrong = save({k: mutate(rng, random_tensor(rng, "BF16", (64, 33)), 0.0) for k in ("w0", "w1", "w2", "w3")}
                 | {"f": random_tensor(rng, "F32", (100,)), "gone": random_tensor(rng, "U8", (7,))},
                 tmp_path / "wrong.safetensors")
    out = tmp_path / "out.safetensors"
    with pytest.raises(BaseMismatchError, match="differs from the patch's base"):
        apply_patch(wrong, patch, out, device="cpu")
    assert not out.exists() and list(tmp_path.glob("*.tmp*")) == []


def test_a_base_that_differs_only_where_the_patch_carries_whole_is_refused_before_commit(pair, tmp_path):
    """The rebuild succeeds (tensor "f" is carried whole), so only the digest check at the end can
    tell: still refused, nothing visible."""
    from safetensors.torch import load_file

    old, new, patch = pair
    tensors = load_file(str(old))
    tensors["f"] = tensors["f"] + 1
    other = save(tensors, tmp_path / "other.safetensors")
    out = tmp_path / "out.safetensors"
    with pytest.raises(BaseMismatchError):
        apply_patch(other, patch, out, device="cpu")
    assert not out.exists()


def test_the_target_as_base_is_up_to_date_in_place(pair, tmp_path):
    old, new, patch = pair
    before = new.read_bytes()
    assert apply_patch(new, patch, in_place=True, device="cpu").status == "up-to-date"
    assert new.read_bytes() == before


def test_a_damaged_patch_on_the_right_base_is_reported_as_damage(pair, tmp_path):
    old, new, patch = pair
    data = bytearray(patch.read_bytes())
    data[-20] ^= 0xFF  # inside the last section: its checksum fails
    bad = tmp_path / "bad.pulsediff"
    bad.write_bytes(bytes(data))
    with pytest.raises(CorruptPatchError):
        apply_patch(old, bad, tmp_path / "out.safetensors", device="cpu")
    assert not (tmp_path / "out.safetensors").exists()
