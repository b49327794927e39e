"""Format 1.4's digest schemes: tree tensor hashes by default, flat ones (1.0-1.3) still read and
written where asked for; a patch or series never mixes them; an unknown scheme is a newer
version's, not damage."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pulsediff import apply_patch, make_patch, read_patch_header
from pulsediff.errors import ChainError, CorruptPatchError, InvalidManifestError, UnknownSchemeError
from pulsediff.format.digest import FLAT, SCHEMES, TREE, TREE_CHUNK_BYTES, TensorId, scheme_of
from pulsediff.ops.inspect import checkpoint_digest_of
from pulsediff.ops.live import state_dict_digest

from ckpt_factory import mutate, random_tensor, save
from cli_run import one_line_error, run
from fuzz_cases import assemble, split_patch
from reference import tree_hash_ref


def test_tree_hasher_fed_in_any_pieces_is_the_tree_hash():
    """Pieces that cut chunks anywhere, bytes and memoryviews among them, give tree_hash, which
    is the plain reference's."""
    rng = np.random.default_rng(7)
    for n in (0, 1, 63, TREE_CHUNK_BYTES - 1, TREE_CHUNK_BYTES, TREE_CHUNK_BYTES + 1, 3 * TREE_CHUNK_BYTES + 77,
              9 * TREE_CHUNK_BYTES + 5):  # the last spread over the worker threads
        data = rng.integers(0, 256, n, dtype=np.uint8)
        want = tree_hash_ref(data)
        assert TREE.tensor_hash(data) == want
        for _ in range(3):
            cuts = np.sort(rng.integers(0, n + 1, rng.integers(0, 6)))
            hasher = TREE.hasher()
            for k, (lo, hi) in enumerate(zip([0, *cuts], [*cuts, n])):
                piece = data[lo:hi]
                hasher.update(piece if k % 3 == 0 else bytes(piece) if k % 3 == 1 else memoryview(piece))
            assert hasher.hexdigest() == want, (n, cuts)


def test_a_tensor_hash_of_any_dtype_is_of_its_bytes():
    rng = np.random.default_rng(8)
    a = rng.integers(0, 2**16, TREE_CHUNK_BYTES // 2 + 5, dtype=np.uint16)
    assert TREE.tensor_hash(a) == TREE.tensor_hash(a.view(np.uint8)) == tree_hash_ref(a)
    assert TREE.tensor_hash(a) != FLAT.tensor_hash(a)


def _pair(tmp_path, seed=3):
    rng = np.random.default_rng(seed)
    # One tensor of several chunks (3 leaves), and small ones.
    old = {"big": random_tensor(rng, "BF16", (3 * TREE_CHUNK_BYTES // 2 // 64 + 1, 64)),
           "w": random_tensor(rng, "F32", (16, 8)), "ids": torch.arange(7)}
    new = {k: mutate(rng, v, 0.01) if v.is_floating_point() else v for k, v in old.items()}
    return save(old, tmp_path / "old.safetensors"), save(new, tmp_path / "new.safetensors")


@pytest.mark.parametrize("scheme", ["tree", "flat"])
def test_make_writes_the_scheme_asked_for_and_apply_takes_either(tmp_path, scheme):
    old, new = _pair(tmp_path)
    patch = tmp_path / "p.pulsediff"
    header = make_patch(old, new, patch, digest=scheme)
    assert header.scheme is SCHEMES[scheme] and header.base_digest.startswith(SCHEMES[scheme].prefix)
    assert header.target_digest == checkpoint_digest_of(new, scheme=scheme)
    assert header.base_digest == checkpoint_digest_of(old, scheme=scheme)
    assert read_patch_header(patch).scheme is SCHEMES[scheme]
    out = tmp_path / "out.safetensors"
    apply_patch(old, patch, out)
    assert out.read_bytes() == new.read_bytes()


def test_the_default_is_the_tree_and_state_dicts_agree_with_files(tmp_path):
    from safetensors.torch import load_file

    old, new = _pair(tmp_path)
    header = make_patch(old, new, tmp_path / "p.pulsediff")
    assert header.scheme is TREE
    tensors = load_file(str(new))
    for scheme in SCHEMES:
        assert state_dict_digest(tensors, scheme=scheme) == checkpoint_digest_of(new, scheme=scheme)
    assert state_dict_digest(tensors) == header.target_digest


def test_a_chain_does_not_cross_schemes(tmp_path):
    old, new = _pair(tmp_path)
    from safetensors.torch import load_file

    rng = np.random.default_rng(4)
    newer = save({k: mutate(rng, v, 0.01) if v.is_floating_point() else v for k, v in load_file(str(new)).items()},
                 tmp_path / "newer.safetensors")
    make_patch(old, new, tmp_path / "a.pulsediff", digest="flat")
    make_patch(new, newer, tmp_path / "b.pulsediff", digest="tree")
    from pulsediff.ops.apply import apply_chain

    with pytest.raises(ChainError):
        apply_chain(old, [tmp_path / "a.pulsediff", tmp_path / "b.pulsediff"], tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def _rewritten(patch, edit) -> bytes:
    h = split_patch(patch.read_bytes())
    edit(h)
    return assemble(h)


def test_mixed_and_unknown_schemes_are_refused_with_one_line(tmp_path):
    old, new = _pair(tmp_path)
    patch = tmp_path / "p.pulsediff"
    make_patch(old, new, patch)
    # Base flat, target tree: the hashes are of one scheme, so one of the two lies.
    mixed = tmp_path / "mixed.pulsediff"
    mixed.write_bytes(_rewritten(patch, lambda h: h["base"].update(
        digest=FLAT.prefix + h["base"]["digest"].split(":")[1])))
    with pytest.raises(CorruptPatchError, match="different schemes"):
        read_patch_header(mixed)
    # A scheme a later version may add: said as such, not as damage or as a wrong base.
    later = tmp_path / "later.pulsediff"

    def renamed(h):
        for side in ("base", "target"):
            h[side]["digest"] = "blake3:" + h[side]["digest"].split(":")[1]
    later.write_bytes(_rewritten(patch, renamed))
    with pytest.raises(UnknownSchemeError, match="needs a newer pulsediff"):
        read_patch_header(later)
    line = one_line_error(run("apply", old, later, "-o", tmp_path / "out.safetensors", check=False), 1)
    assert "'blake3:'" in line and "newer pulsediff" in line
    assert not (tmp_path / "out.safetensors").exists()


def test_tensor_hashes_lie_under_the_other_scheme(tmp_path):
    """A patch relabelled flat, its target digest recomputed from its (tree) tensor hashes so the
    header is consistent, still fails: the rebuilt tensors do not hash to those under the flat scheme."""
    old, new = _pair(tmp_path)
    patch = tmp_path / "p.pulsediff"
    make_patch(old, new, patch)

    def relabel(h):
        h["base"]["digest"] = FLAT.prefix + h["base"]["digest"].split(":")[1]
        h["target"]["digest"] = FLAT.digest(TensorId(t["name"], t["dtype"], tuple(t["shape"]), t["target_hash"])
                                            for t in h["tensors"])
    forged = tmp_path / "forged.pulsediff"
    forged.write_bytes(_rewritten(patch, relabel))
    proc = run("apply", old, forged, "-o", tmp_path / "out.safetensors", check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert not (tmp_path / "out.safetensors").exists()


def test_cli_make_and_digest_take_the_scheme(tmp_path):
    old, new = _pair(tmp_path)
    run("make", old, new, "-o", tmp_path / "p.pulsediff", "--digest", "flat", "-q")
    flat = run("digest", new, "--digest", "flat").stdout.strip()
    tree = run("digest", new).stdout.strip()
    assert scheme_of(flat) is FLAT and scheme_of(tree) is TREE
    assert read_patch_header(tmp_path / "p.pulsediff").target_digest == flat
    assert json.loads(run("digest", new, "--json").stdout)["scheme"] == "tree"


def test_a_series_keeps_its_scheme(tmp_path):
    """A series begun flat (publish --digest flat, or before 1.4) grows flat; one begun now is a
    tree; catch-up follows either; another scheme is refused; a manifest that mixes them is refused."""
    from pulsediff.errors import UsageError
    from pulsediff.format.manifest import Manifest
    from pulsediff.series.catch_up import catch_up
    from pulsediff.series.publish import publish_once

    from ckpt_factory import save_series

    train = tmp_path / "train"
    train.mkdir()
    save_series(train, 4, seed=5, shape=(64, 32), tensors=2, density=0.02)
    steps = sorted(train.iterdir())
    hidden = tmp_path / "later"
    hidden.mkdir()
    for p in steps[3:]:
        p.rename(hidden / p.name)
    for name, first in (("flat", FLAT), ("tree", TREE)):
        pub = tmp_path / f"pub-{name}"
        publish_once(train, pub, settle=0, **({"digest": "flat"} if first is FLAT else {}))
        assert Manifest.load(pub).scheme is first
    with pytest.raises(UsageError, match="--digest flat"):
        publish_once(train, tmp_path / "pub-flat", settle=0, digest="tree")
    for p in hidden.iterdir():
        p.rename(train / p.name)
    for first, name in ((FLAT, "flat"), (TREE, "tree")):
        pub = tmp_path / f"pub-{name}"
        publish_once(train, pub, settle=0)
        manifest = Manifest.load(pub)
        assert {scheme_of(d) for e in manifest.entries for d in (e.base, e.target)} == {first}
        assert manifest.newest.step == 4
        worker = tmp_path / f"worker-{name}.safetensors"
        worker.write_bytes(steps[1].read_bytes())
        catch_up(worker, pub)
        assert worker.read_bytes() == steps[-1].read_bytes()
        # Live tensors whose known digest is of the default (tree) scheme: hashed again under the series'.
        from safetensors.torch import load_file

        from pulsediff.series.catch_up import catch_up_state_dict

        tensors = load_file(str(steps[1]))
        result = catch_up_state_dict(tensors, pub, digest=state_dict_digest(tensors))
        assert result.step == 4 and result.digest == manifest.newest.target
        assert state_dict_digest(tensors, scheme=first) == manifest.newest.target
    # One entry relabelled into the other scheme: the manifest is refused whole.
    pub = tmp_path / "pub-flat"
    obj = json.loads((pub / "manifest.json").read_text())
    e = obj["entries"][-1]
    e["base"], e["target"] = (TREE.prefix + d.split(":")[1] for d in (e["base"], e["target"]))
    (pub / "manifest.json").write_text(json.dumps(obj))
    with pytest.raises(InvalidManifestError, match="more than one scheme"):
        Manifest.load(pub)


def test_unknown_scheme_in_a_manifest_is_said_as_such(tmp_path):
    from pulsediff.format.manifest import parse_manifest

    entry = {"kind": "anchor", "file": "anchor-1.pulsediff", "step": 1, "from_step": None,
             "base": "blake3:" + "0" * 32, "target": "blake3:" + "1" * 32, "bytes": 10, "target_bytes": 10}
    data = json.dumps({"version": 1, "precision": "exact", "entries": [entry]}).encode()
    with pytest.raises(InvalidManifestError, match="'blake3:'.*newer pulsediff"):
        parse_manifest(data, "m.json")


def test_gpu_tensors_are_hashed_on_the_host_where_the_gpu_kernels_are_not_asked_for(monkeypatch, tmp_path):
    """A state dict that holds GPU tensors, hashed with device="cpu" (or CUDA kernels that cannot
    run): host copies, never the device path."""
    from pulsediff.ops.live import StateDict

    old, _ = _pair(tmp_path)
    from safetensors.torch import load_file

    tensors = load_file(str(old))

    def never(*_args):
        raise AssertionError("device_data called though the GPU kernels were not to run")

    monkeypatch.setattr(StateDict, "on_gpu", property(lambda self: True))
    monkeypatch.setattr(StateDict, "device_data", never)
    assert state_dict_digest(tensors, device="cpu") == checkpoint_digest_of(old)
