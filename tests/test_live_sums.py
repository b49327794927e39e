"""The word-sum path of live apply (FORMAT.md §3.1, §7.1): base and target checked where the
tensors live, ctx-rans changes located and written there, every write undone on failure.

On CPU tensors it runs through the public API (`check="sums"`); on the device it runs on
Numba device arrays under the CUDA simulator (conftest.py), with launches shrunk so that the
small tensors span many blocks: no torch CUDA tensor can exist without a GPU, so the step
from a torch tensor to its device array (`live.device_bits`) is the one part not run here.
"""

from __future__ import annotations

import io
import sys

import numpy as np
import pytest
import torch

import pulsediff
from pulsediff.codecs import ctx_rans_batch
from pulsediff.ops import live
from pulsediff.format.patch_file import open_patch
from pulsediff.errors import BaseMismatchError, CorruptPatchError, UsageError

from ckpt_factory import TORCH_DTYPES, mutate, random_tensor
from cuda_sim import SMALL_LAUNCH, fast_simulator, launch_config
from fuzz_cases import assemble, split_patch
from reference import word_sum_ref

GOLDEN_1_1 = "tests/golden/v1.1"


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().copy()


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(_bits(a[k]), _bits(b[k])) for k in a)


def _clone(d: dict) -> dict:
    return {k: v.clone() for k, v in d.items()}


def _pair(seed: int, dtypes=tuple(TORCH_DTYPES), density=0.05):
    rng = np.random.default_rng(seed)
    old = {f"t.{name}.{i}": random_tensor(rng, name, shape)
           for i, shape in enumerate([(0,), (1,), (7, 3), (40, 9)]) for name in dtypes}
    new = {k: mutate(rng, v, density) for k, v in old.items()}
    return old, new


def test_word_sums_in_the_patch_are_those_of_the_tensors():
    old, new = _pair(0)
    header = pulsediff.read_patch_header(io.BytesIO(pulsediff.make_patch_bytes(old, new)))
    for rec in header.tensors:
        assert int(rec.target_sum, 16) == word_sum_ref(_bits(new[rec.name]))
        if rec.base_sum is not None:
            assert int(rec.base_sum, 16) == word_sum_ref(_bits(old[rec.name]))
    assert {r.op for r in header.tensors} >= {"same", "patch"}


@pytest.mark.parametrize("scheme", ["tree", "flat"])
def test_tensor_checks_block_by_block_equal_the_references(scheme):
    """make's hash and word sum taken in cache-sized blocks (the tree's chunks): sizes around the
    block edge, tails; the hash as the scheme takes it alone, the sum as the reference."""
    from pulsediff.format.digest import _CHECK_BLOCK, SCHEMES

    scheme = SCHEMES[scheme]

    rng = np.random.default_rng(13)
    for nbytes in (0, 5, 8, _CHECK_BLOCK - 3, _CHECK_BLOCK, _CHECK_BLOCK + 8, 2 * _CHECK_BLOCK + 7):
        for dtype in (np.uint8, np.uint16, np.uint32, np.uint64):
            n = nbytes // np.dtype(dtype).itemsize
            a = rng.integers(0, np.iinfo(dtype).max, n, dtype=dtype, endpoint=True)
            digest, word_sum = scheme.checks(a)
            assert digest == scheme.tensor_hash(a) and int(word_sum, 16) == word_sum_ref(a)


@pytest.mark.parametrize("codec", ["ctx-rans", "ctx-ac", "gap-zstd"])
@pytest.mark.parametrize("seed", [1, 2])
def test_sums_path_matches_the_digests_path_for_every_dtype(codec, seed):
    old, new = _pair(seed)
    patch = pulsediff.make_patch_bytes(old, new, codec=codec)
    by_sums, by_digests = _clone(old), _clone(old)
    pointers = {k: v.data_ptr() for k, v in by_sums.items()}
    a = pulsediff.apply_to_state_dict(by_sums, patch, check="sums")
    b = pulsediff.apply_to_state_dict(by_digests, patch, check="digests")
    assert _same(by_sums, new) and _same(by_digests, new)
    assert {k: v.data_ptr() for k, v in by_sums.items()} == pointers
    assert (a.status, a.changed_tensors, a.changed_elements, a.target_digest) == \
        (b.status, b.changed_tensors, b.changed_elements, b.target_digest)
    assert pulsediff.apply_to_state_dict(by_sums, patch, check="sums").status == "up-to-date"


def test_sums_path_anchor_chain_and_bf16():
    s0, s1 = _pair(3, ("BF16", "F32", "I64"))
    s2 = {k: mutate(np.random.default_rng(4), v, 0.05) for k, v in s1.items()}
    live_tensors = {k: torch.zeros_like(v) for k, v in s0.items()}
    chain = [pulsediff.make_patch_bytes(None, s0), pulsediff.make_patch_bytes(s0, s1), pulsediff.make_patch_bytes(s1, s2)]
    assert pulsediff.apply_to_state_dict(live_tensors, chain, check="sums").status == "applied"
    assert _same(live_tensors, s2)
    masters = {k: v.float() for k, v in s1.items() if v.dtype == torch.bfloat16}
    moved = {k: v * 1.01 for k, v in masters.items()}
    worker = {k: v.bfloat16() for k, v in masters.items()}
    pulsediff.apply_to_state_dict(worker, pulsediff.make_patch_bytes(masters, moved, precision="bf16"), check="sums")
    assert _same(worker, {k: v.bfloat16() for k, v in moved.items()})


def test_wrong_base_is_refused_before_any_write():
    old, new = _pair(5, ("BF16", "F32"))
    patch = pulsediff.make_patch_bytes(old, new)
    for name in ("t.F32.3", "t.BF16.2"):
        wrong = _clone(old)
        wrong[name].view(-1).view(torch.int16 if "BF16" in name else torch.int32)[2] ^= 1
        before = _clone(wrong)
        with pytest.raises(BaseMismatchError, match=name.replace(".", r"\.")):
            pulsediff.apply_to_state_dict(wrong, patch, check="sums")
        assert _same(wrong, before)


def test_sums_a_caller_keeps_stand_in_for_the_read_and_come_back_updated():
    """`sums`: what the call gives back is every tensor's word sum after it; given back in,
    they are taken at their word for the base check (a wrong one is refused as a wrong base,
    nothing written, the dict left as it was), and a failed apply leaves them as they were."""
    old, new = _pair(9, ("BF16", "F32"))
    first = pulsediff.make_patch_bytes(old, new)
    newer = {k: mutate(np.random.default_rng(10), v, 0.05) for k, v in new.items()}
    second = pulsediff.make_patch_bytes(new, newer)
    live_tensors, sums = _clone(old), {}
    pulsediff.apply_to_state_dict(live_tensors, first, check="sums", sums=sums)
    assert sums == {k: word_sum_ref(_bits(t)) for k, t in new.items()}
    vouched = dict(sums)
    vouched["t.F32.3"] ^= 1  # a sum that is not the tensor's: believed, so the base looks wrong
    with pytest.raises(BaseMismatchError, match=r"t\.F32\.3"):
        pulsediff.apply_to_state_dict(live_tensors, second, check="sums", sums=vouched)
    assert _same(live_tensors, new) and vouched["t.F32.3"] == sums["t.F32.3"] ^ 1
    def lie(header):  # the last patched tensor's target sum is off: found after the writes
        last = [t for t in header["tensors"] if t["op"] == "patch"][-1]
        last["target_sum"] = f"{(int(last['target_sum'], 16) + 1) % 2**64:016x}"

    with pytest.raises(CorruptPatchError, match="word sum"):
        pulsediff.apply_to_state_dict(live_tensors, _forged(second, lie), check="sums", sums=sums)
    assert _same(live_tensors, new) and sums == {k: word_sum_ref(_bits(t)) for k, t in new.items()}
    pulsediff.apply_to_state_dict(live_tensors, second, check="sums", sums=sums)
    assert _same(live_tensors, newer) and sums == {k: word_sum_ref(_bits(t)) for k, t in newer.items()}


def _forged(patch: bytes, edit) -> bytes:
    header = split_patch(patch)
    edit(header)
    return assemble(header)


def test_a_target_sum_that_does_not_hold_undoes_every_write():
    """Behind valid checksums: the last patched tensor's target sum is wrong. Earlier tensors
    were already written when it fails; all are put back."""
    old, new = _pair(6, ("BF16", "I32"))
    patch = pulsediff.make_patch_bytes(old, new)
    patched = [t for t in split_patch(patch)["tensors"] if t["op"] == "patch"]
    assert len(patched) >= 2

    def lie(header):
        last = [t for t in header["tensors"] if t["op"] == "patch"][-1]
        last["target_sum"] = f"{(int(last['target_sum'], 16) + 1) % 2**64:016x}"

    live_tensors = _clone(old)
    with pytest.raises(CorruptPatchError, match="word sum"):
        pulsediff.apply_to_state_dict(live_tensors, _forged(patch, lie), check="sums")
    assert _same(live_tensors, old)


def test_a_damaged_section_part_way_through_undoes_every_write():
    old, new = _pair(7, ("BF16",))
    patch = pulsediff.make_patch_bytes(old, new)

    def damage(header):
        last = [t for t in header["tensors"] if t["op"] == "patch"][-1]
        body = bytearray(last["section"]["__body__"])
        body[len(body) // 2] ^= 0xFF
        last["section"]["__body__"] = bytes(body)

    live_tensors = _clone(old)
    with pytest.raises(CorruptPatchError):
        pulsediff.apply_to_state_dict(live_tensors, _forged(patch, damage), check="sums")
    assert _same(live_tensors, old)


def test_sums_on_some_tensors_only_or_malformed_are_refused():
    old, new = _pair(8, ("BF16",))
    patch = pulsediff.make_patch_bytes(old, new)

    def drop_one(header):
        del header["tensors"][0]["target_sum"]
        header["tensors"][0].pop("base_sum", None)

    def same_twice(header):
        same = next(t for t in header["tensors"] if t["op"] == "same")
        same["base_sum"] = f"{(int(same['base_sum'], 16) ^ 1):016x}"

    def upper_case(header):
        header["tensors"][0]["target_sum"] = header["tensors"][0]["target_sum"].upper() + ""

    for edit, message in ((drop_one, "some tensors only"), (same_twice, "two word sums")):
        with pytest.raises(CorruptPatchError, match=message):
            pulsediff.read_patch_header(io.BytesIO(_forged(patch, edit)))
    header = split_patch(patch)
    if any(c.isalpha() for c in header["tensors"][0]["target_sum"]):
        with pytest.raises(CorruptPatchError, match="malformed"):
            pulsediff.read_patch_header(io.BytesIO(_forged(patch, upper_case)))


def test_patches_without_sums_use_the_digests(tmp_path):
    """A format 1.1 patch (golden file) applies with check='auto' and 'prefer-sums' and is refused with 'sums'."""
    from safetensors.torch import load_file

    base = load_file(f"{GOLDEN_1_1}/base32.safetensors")
    target = load_file(f"{GOLDEN_1_1}/target32.as-bf16.safetensors")
    patch = f"{GOLDEN_1_1}/bf16.ctx-rans.pulsediff"
    live_tensors = {k: v.bfloat16() for k, v in base.items()}
    with pytest.raises(UsageError, match="no word sums"):
        pulsediff.apply_to_state_dict(live_tensors, patch, check="sums")
    with pytest.raises(UsageError, match="unknown check"):
        pulsediff.apply_to_state_dict(live_tensors, patch, check="fast")
    by_preference = {k: v.clone() for k, v in live_tensors.items()}
    assert pulsediff.apply_to_state_dict(live_tensors, patch).status == "applied"
    assert _same(live_tensors, target)
    assert pulsediff.apply_to_state_dict(by_preference, patch, check="prefer-sums").status == "applied"  # digests
    assert _same(by_preference, target)


def test_non_contiguous_tensors_are_refused():
    old, new = _pair(9, ("F32",))
    live_tensors = _clone(old)
    live_tensors["t.F32.3"] = old["t.F32.3"].t().contiguous().t()  # same shape, strided: writes through a copy would be lost
    with pytest.raises(UsageError, match="not contiguous"):
        pulsediff.apply_to_state_dict(live_tensors, pulsediff.make_patch_bytes(old, new), check="digests")


# --- on the device (Numba CUDA simulator) -------------------------------------------------

numba_cuda = pytest.importorskip("numba.cuda")


@pytest.fixture()
def small_launch():
    from pulsediff.kernels import cuda

    with launch_config(cuda.common, **SMALL_LAUNCH), fast_simulator():
        yield


def _apply_on_device(arrays: dict, patches: list[bytes]):
    """apply_to_state_dict's sums path with Numba device arrays standing for CUDA tensors."""
    views = {k: numba_cuda.to_device(_bits(v).view(live.dtype_of(v).bits_dtype)) for k, v in arrays.items()}
    undo, known = [], {}
    try:
        steps = []
        for patch in patches:
            reader, header, _ = open_patch(io.BytesIO(patch))
            steps.append(live.apply_by_sums(views, reader, header, undo, known))
    except BaseException:
        assert live._roll_back(undo) == []
        raise
    finally:
        after = {k: torch.from_numpy(v.copy_to_host().view(np.uint8)).view(arrays[k].dtype).reshape(arrays[k].shape)
                 for k, v in views.items()}
    return steps, after


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_device_path_rebuilds_the_target_bit_for_bit(small_launch):
    """BF16, F32 and I64 tensors of a few hundred elements (dozens of 16-element tiles over
    4 blocks), a chain with an anchor, ctx-rans located and written on the device."""
    rng = np.random.default_rng(10)
    # "w" and "f" are not whole 8-byte words (the separate kernels), "v" and "i" are (the tiles)
    s0 = {"w": random_tensor(rng, "BF16", (300,)), "f": random_tensor(rng, "F32", (17, 9)),
          "i": random_tensor(rng, "I64", (40,)), "e": random_tensor(rng, "BF16", (0,)),
          "v": random_tensor(rng, "BF16", (8, 38))}
    s1 = {k: mutate(rng, v, 0.08) for k, v in s0.items()}
    s2 = {k: mutate(rng, v, 0.08) for k, v in s1.items()}
    patches = [pulsediff.make_patch_bytes(None, s0), pulsediff.make_patch_bytes(s0, s1), pulsediff.make_patch_bytes(s1, s2)]
    assert any(t["op"] == "patch" and t["section"]["codec"] == "ctx-rans" for t in split_patch(patches[2])["tensors"])
    steps, after = _apply_on_device({k: torch.zeros_like(v) for k, v in s0.items()}, patches)
    assert [s.status for s in steps] == ["applied"] * 3
    assert _same(after, s2)
    host = _clone(s0)
    expected = pulsediff.apply_to_state_dict(host, patches[1:], check="digests")
    assert steps[1].elements + steps[2].elements == expected.changed_elements


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_device_path_refuses_a_wrong_base_and_undoes_a_bad_target(small_launch):
    rng = np.random.default_rng(11)
    s0 = {"a": random_tensor(rng, "BF16", (200,)), "b": random_tensor(rng, "BF16", (150,))}
    s1 = {k: mutate(rng, v, 0.1) for k, v in s0.items()}
    patch = pulsediff.make_patch_bytes(s0, s1)
    wrong = _clone(s0)
    wrong["b"].view(torch.int16)[7] ^= 1
    with pytest.raises(BaseMismatchError):
        _apply_on_device(wrong, [patch])

    def lie(header):
        header["tensors"][-1]["target_sum"] = f"{(int(header['tensors'][-1]['target_sum'], 16) ^ 4):016x}"

    forged = _forged(patch, lie)
    with pytest.raises(CorruptPatchError, match="word sum"):
        _apply_on_device(s0, [forged])


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_device_path_puts_back_what_the_tiles_wrote(small_launch):
    """A target sum that lies on the last tensor: the tensors before it were written by the tile
    path (whole words), the last one too; the roll-back (undo entries kept whole on the device,
    entries not found at -1) leaves every tensor bit for bit as it was."""
    rng = np.random.default_rng(13)
    s0 = {"a": random_tensor(rng, "BF16", (256,)), "b": random_tensor(rng, "BF16", (4, 50))}
    s1 = {k: mutate(rng, v, 0.1) for k, v in s0.items()}

    def lie(header):
        header["tensors"][-1]["target_sum"] = f"{(int(header['tensors'][-1]['target_sum'], 16) ^ 4):016x}"

    forged = _forged(pulsediff.make_patch_bytes(s0, s1), lie)
    views = {k: numba_cuda.to_device(_bits(v).view(live.dtype_of(v).bits_dtype)) for k, v in s0.items()}
    reader, header, _ = open_patch(io.BytesIO(forged))
    undo = []
    with pytest.raises(CorruptPatchError, match="word sum"):
        live.apply_by_sums(views, reader, header, undo, {})
    assert len(undo) == 2 and all(not isinstance(e.positions, np.ndarray) for e in undo)  # on the device
    assert live._roll_back(undo) == []
    for k, v in views.items():
        np.testing.assert_array_equal(v.copy_to_host(), _bits(s0[k]).view(live.dtype_of(s0[k]).bits_dtype))


def test_tied_weights_are_patched_once_through_either_path():
    """Two names for one tensor (tied embeddings): written once, both checked; overlapping
    tensors that are not the same are refused."""
    rng = np.random.default_rng(12)
    w0, b0 = random_tensor(rng, "BF16", (40, 9)), random_tensor(rng, "F32", (9,))
    w1, b1 = mutate(rng, w0, 0.1), mutate(rng, b0, 0.1)
    patch = pulsediff.make_patch_bytes({"embed": w0, "lm_head": w0, "b": b0}, {"embed": w1, "lm_head": w1, "b": b1})
    results, written = [], []
    for check in ("sums", "digests"):
        tied = w0.clone()
        live_tensors = {"embed": tied, "lm_head": tied, "b": b0.clone()}
        changes = {}
        results.append(pulsediff.apply_to_state_dict(live_tensors, patch, check=check, changes=changes))
        assert torch.equal(tied.view(torch.int16), w1.view(torch.int16)) and torch.equal(live_tensors["b"], b1)
        written.append({name: sorted(p.tolist()) for name, p in changes.items()})
    assert results[0] == results[1] and results[0].changed_tensors >= 2
    # `changes` names both (a consumer mirrors the writes per name); the sums path left the alias out
    assert written[0] == written[1] and {"embed", "lm_head"} <= set(written[0])
    flat = w0.clone().reshape(-1)
    overlapping = {"embed": flat[:360].view(40, 9), "lm_head": flat[:360].view(40, 9)[1:].clone(), "b": b0.clone()}
    overlapping["lm_head"] = flat[9:].view(39, 9)
    with pytest.raises(UsageError, match="overlap"):
        live._aliases(overlapping)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_fuzzed_sections_behind_valid_checksums_on_the_sums_path():
    """300 ctx-rans, ctx-ac and gap-zstd sections mutated as deep as their codecs allow (tests/fuzz_cases),
    checksums recomputed: the sums path either refuses with a PulsediffError and leaves every
    tensor as it was, or accepts, and then the digests path accepts too with the same tensors."""
    import random

    from pulsediff.errors import PulsediffError

    from fuzz_cases import mutate_section

    old, new = _pair(14, ("BF16", "F32", "I16"), density=0.1)
    codecs = ("ctx-rans", "ctx-ac", "gap-zstd")
    patches = {codec: split_patch(pulsediff.make_patch_bytes(old, new, codec=codec)) for codec in codecs}
    outcomes = {"refused": 0, "accepted": 0}
    for seed in range(300):
        rng = random.Random(seed)
        header = split_patch(assemble(patches[codecs[seed % 3]]))
        entry = rng.choice([t for t in header["tensors"] if t["op"] == "patch"])
        mutate_section(rng, None, entry)
        data = assemble(header)
        by_sums = _clone(old)
        try:
            pulsediff.apply_to_state_dict(by_sums, data, check="sums")
        except PulsediffError:
            outcomes["refused"] += 1
            assert _same(by_sums, old), f"seed {seed}: a refused patch changed the tensors"
            continue
        outcomes["accepted"] += 1
        by_digests = _clone(old)
        pulsediff.apply_to_state_dict(by_digests, data, check="digests")
        assert _same(by_sums, by_digests), f"seed {seed}"
    print(outcomes)
    assert outcomes["refused"] > 100, outcomes


def test_an_apply_from_a_worker_thread_places_its_tensors_on_that_thread():
    """Called from one of pulsediff's own worker threads (a caller running applies side by side),
    the sums path places its tensors on that thread instead of queueing them on the pool it
    occupies; the result is the target all the same."""
    from pulsediff.kernels import threads

    old, new = _pair(11, ("BF16", "F32"))
    patch = pulsediff.make_patch_bytes(old, new)
    live_tensors = _clone(old)
    seen = {}

    def job():
        seen["serial"] = threads.serial()
        return pulsediff.apply_to_state_dict(live_tensors, patch, check="sums")

    threads.pool().submit(job).result(timeout=120)
    assert seen["serial"] and _same(live_tensors, new)


def test_an_interrupt_while_tensors_are_placed_side_by_side_undoes_every_write(monkeypatch):
    """Ctrl-C in the main thread while worker threads place tensors: every placement still
    writing finishes before the rollback, so all tensors are put back (before, one could be
    left written and unlisted)."""

    from pulsediff.kernels import cpu

    if cpu.side_by_side() == 0:
        pytest.skip("one worker thread: no tensors are placed side by side")
    rng = np.random.default_rng(12)
    old = {"a": random_tensor(rng, "BF16", (1000,)), "b": random_tensor(rng, "BF16", (4000, 1000))}
    new = {k: mutate(rng, v, 0.2) for k, v in old.items()}
    patch = pulsediff.make_patch_bytes(old, new)
    live_tensors = _clone(old)
    body = live.apply_by_sums.__code__
    fired = []

    def trace(frame, event, arg):
        if frame.f_code is body:
            def local(frame, event, arg):
                if event == "line" and not fired and "known.update(zip(unit_names" in _source_line(frame):
                    fired.append(frame.f_lineno)
                    raise KeyboardInterrupt
                return local
            return local
        return None

    sys.settrace(trace)
    try:
        with pytest.raises(KeyboardInterrupt):
            pulsediff.apply_to_state_dict(live_tensors, patch, check="sums")
    finally:
        sys.settrace(None)
    assert fired
    assert _same(live_tensors, old)


def _source_line(frame) -> str:
    import linecache

    return linecache.getline(frame.f_code.co_filename, frame.f_lineno)


def test_sums_of_tensors_that_could_not_be_put_back_are_forgotten(monkeypatch):
    """A write interrupted before its old values came back cannot be undone: the caller's kept
    sums then drop that tensor, so its next apply reads it again instead of trusting them."""
    from pulsediff.kernels import cpu

    old, new = _pair(13, ("BF16",))
    patch = pulsediff.make_patch_bytes(old, new)
    live_tensors, sums = _clone(old), {}
    patched = [t["name"] for t in split_patch(patch)["tensors"] if t["op"] == "patch" and t["changed"]]

    def interrupted(real):
        def write(view, positions, deltas):
            real(view, positions, deltas)
            raise KeyboardInterrupt  # after the write, before its old values are returned
        return write

    # A batch (codecs/ctx_rans_batch.py) returns its old values with its writes, all or nothing, and
    # the CPU's walk that writes as it finds (CtxRans.add_in_place) fills them as it writes: only
    # locate, then add_at (the GPU's way) can be interrupted in between.
    from pulsediff.codecs.ctx_rans import CtxRans

    monkeypatch.setattr(ctx_rans_batch, "BATCH_MAX_NUMEL", -1)
    monkeypatch.delattr(CtxRans, "add_in_place")
    monkeypatch.setattr(cpu, "add_at", interrupted(cpu.add_at))
    monkeypatch.setattr(cpu, "add_at_summed", interrupted(cpu.add_at_summed))
    pulsediff.apply_to_state_dict(_clone(old), pulsediff.make_patch_bytes(old, old), check="sums", sums=sums)
    assert sums  # the sums of `old`, as a caller keeps them
    with pytest.raises(KeyboardInterrupt) as info:
        pulsediff.apply_to_state_dict(live_tensors, patch, check="sums", sums=sums)
    lost = info.value.__notes__[0]
    assert "not put back" in lost
    assert any(name in lost for name in patched)
    assert all(name not in sums for name in patched if name in lost)


def test_an_interrupt_while_waiting_for_a_batch_undoes_its_writes(monkeypatch):
    """Ctrl-C while the main thread waits for a batch placed on a worker thread: the batch still
    writes, and its undo entries must reach the log (before, the unit was taken off the running
    queue before the wait, and its writes stayed)."""
    from concurrent.futures import Future

    from pulsediff.kernels import cpu

    if cpu.side_by_side() == 0:
        pytest.skip("one worker thread: no tensors are placed side by side")
    rng = np.random.default_rng(13)
    old = {f"e{i}": random_tensor(rng, "BF16", (300, 1000)) for i in range(16)}  # two batches of small sections
    new = {k: mutate(rng, v, 0.05) for k, v in old.items()}
    patch = pulsediff.make_patch_bytes(old, new)
    live_tensors = _clone(old)
    result, fired = Future.result, []

    def interrupted(self, timeout=None):
        caller = sys._getframe(1).f_code.co_name
        if not fired and caller in ("_settled_first", "_placed_side_by_side"):
            fired.append(caller)
            result(self)  # the batch has written by now
            raise KeyboardInterrupt
        return result(self, timeout)

    monkeypatch.setattr(Future, "result", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pulsediff.apply_to_state_dict(live_tensors, patch, check="sums")
    assert fired
    assert _same(live_tensors, old)


def test_revert_puts_back_the_memory_written_even_where_a_name_was_bound_again():
    """The undo log reaches the tensors an apply wrote, not whatever the caller's mapping holds by the
    time of revert (batched tensors' views are made when needed)."""
    rng = np.random.default_rng(14)
    old = {f"e{i}": random_tensor(rng, "BF16", (40, 50)) for i in range(6)}
    new = {k: mutate(rng, v, 0.1) for k, v in old.items()}
    patch = pulsediff.make_patch_bytes(old, new)
    live_tensors = _clone(old)
    written = dict(live_tensors)
    undo_log = []
    pulsediff.apply_to_state_dict(live_tensors, patch, check="sums", undo_log=undo_log)
    assert _same(written, new)
    live_tensors["e0"] = live_tensors["e0"].clone()  # the caller binds a name to another tensor
    rebound = live_tensors["e0"].clone()
    live.revert(undo_log)
    assert _same(written, old)  # the memory the apply wrote is as it was
    assert _same({"e0": live_tensors["e0"]}, {"e0": rebound})  # and the other tensor untouched
