"""Checks that a later check would back up, each pinned by an input only it refuses.

A hostile patch meets several checks in turn: a rank past its class is refused by the class check,
and were that check lost, by the count of entries found, then by the word sum or digest. The
outcome tests (tests/test_fuzz.py, test_corruption.py) see the patch refused either way, so a
check that stopped working would go unnoticed. Each test here feeds one check the boundary case
it exists for, and expects that check's own answer. Issue 47's sample of 20 hand-made mutants found
these five checks unpinned (each mutant survived the suite; each is caught here).
"""

from __future__ import annotations

import io

import numpy as np
import pytest

import pulsediff
from pulsediff.codecs.base import SectionContext
from pulsediff.errors import CorruptPatchError
from pulsediff.format.header import PatchHeader
from pulsediff.format.patch_file import open_patch
from pulsediff.kernels import entropy

from ckpt_factory import mutate, random_tensor


def test_rans_refuses_a_stream_that_does_not_end_in_the_encoders_first_state():
    """A damaged state word decodes to other symbols, reads every byte and ends elsewhere than the
    encoder began: BAD_STATE, not OK with wrong symbols."""
    rng = np.random.default_rng(3)
    symbols = rng.integers(0, 6, 3000).astype(np.uint8)
    freqs = entropy.quantise_frequencies(np.bincount(symbols, minlength=256))
    cums, slots = entropy.rans_tables(freqs)
    buf = np.empty(2 * symbols.size + 16, np.uint8)
    stream = buf[entropy.rans_encode(symbols, freqs, cums, buf):].copy()
    out = np.empty(symbols.size, np.uint8)
    assert entropy.rans_decode(stream, freqs, cums, slots, out) == entropy.OK
    statuses = []
    for byte in range(4):
        damaged = stream.copy()
        damaged[byte] ^= 0x01
        statuses.append(entropy.rans_decode(damaged, freqs, cums, slots, out))
    assert entropy.OK not in statuses
    assert entropy.BAD_STATE in statuses  # the final-state check's own answer, not only truncation


def test_ctx_rans_class_check_refuses_a_rank_equal_to_its_class_size():
    """Ranks count from 0: a class of 5 elements has ranks 0..4, and rank 5 is past it."""
    from pulsediff.codecs.ctx_rans import Entries

    entries = Entries(count=2, shift=7, mask=255, classes=np.array([3, 9]), counts=np.array([1, 1]),
                      ranks=np.array([4, 5], np.int64), deltas=np.array([1, 1], np.uint16),
                      offsets=np.zeros(257, np.int64))
    sizes = np.zeros(256, np.int64)
    sizes[[3, 9]] = 5
    ctx = SectionContext("w", 10, 2, "p")
    with pytest.raises(CorruptPatchError, match="outside their class"):
        entries.check_classes(sizes, ctx)
    entries.ranks[1] = 4
    entries.check_classes(sizes, ctx)  # the last rank of each class: inside


def test_a_header_with_a_hole_between_sections_is_refused_as_such():
    """Sections lie back to back: a section that starts past the previous one's end leaves bytes
    no checksum covers. Refused at the header, before any section is read."""
    rng = np.random.default_rng(5)
    old = {"a": random_tensor(rng, "BF16", (64,)), "b": random_tensor(rng, "BF16", (48,))}
    new = {k: mutate(rng, v, 0.2) for k, v in old.items()}
    _, header, _ = open_patch(io.BytesIO(pulsediff.make_patch_bytes(old, new)))
    obj = header.to_json(1)  # 1.5's entries: a 2.0 table has no offsets to edit
    PatchHeader.from_json(obj, "p", 1)  # as made: accepted
    obj["tensors"][-1]["section"]["offset"] += 1
    with pytest.raises(CorruptPatchError, match="sections are not contiguous"):
        PatchHeader.from_json(obj, "p", 1)


def test_cuda_add_at_counts_the_position_just_past_the_end_and_writes_nothing_there():
    """The boundary of the bound check: position n is out of range like n + 5 and -1."""
    numba_cuda = pytest.importorskip("numba.cuda")
    from cuda_sim import SMALL_LAUNCH, fast_simulator, launch_config

    from pulsediff.kernels import cuda

    base = np.arange(40, dtype=np.uint16)
    positions = np.array([0, 39, 40, -1, 45], np.int64)
    deltas = np.full(positions.size, 2, np.uint8)  # zigzag 2: +1
    with launch_config(cuda.common, **SMALL_LAUNCH), fast_simulator():
        padded = numba_cuda.to_device(np.concatenate([base, np.full(8, 0xABCD, np.uint16)]))
        out = padded[:40]  # a view: element 40 exists in memory, past the tensor's end
        old, bad = cuda.add_at(out, numba_cuda.to_device(positions), numba_cuda.to_device(deltas))
        got = padded.copy_to_host()
    assert bad == 3
    assert got[0] == 1 and got[39] == 40 and (got[1:39] == base[1:39]).all()
    assert (got[40:] == 0xABCD).all()  # nothing written past the end


def test_a_tensor_kept_the_same_cannot_claim_changed_elements():
    """op "same" carries no section, so no codec count contradicts it: only the op check does."""
    rng = np.random.default_rng(6)
    old = {"a": random_tensor(rng, "BF16", (64,)), "b": random_tensor(rng, "BF16", (48,))}
    new = {"a": mutate(rng, old["a"], 0.2), "b": old["b"].clone()}
    _, header, _ = open_patch(io.BytesIO(pulsediff.make_patch_bytes(old, new)))
    obj = header.to_json(1)
    same = next(t for t in obj["tensors"] if t["op"] == "same")
    same["changed"] = 3
    with pytest.raises(CorruptPatchError, match="changed contradicts its op"):
        PatchHeader.from_json(obj, "p", 1)
    table = header.to_json(2)
    table["tensors"]["changed"][table["tensors"]["op"].index("same")] = 3
    with pytest.raises(CorruptPatchError, match="changed contradicts an op"):
        PatchHeader.from_json(table, "p", 2)
