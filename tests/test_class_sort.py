"""kernels.class_sort (torch's stable sort as ctx-rans' rank <-> position map) against the plain
references, bit for bit, on CPU tensors: the same code runs on GPU tensors. Windows far smaller
than the tensors, so every class's ranks cross many windows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from reference import diff_ranks_ref, ranked_positions_ref

from pulsediff.kernels import class_sort

# (numpy bits dtype, shift, mask): BF16's exponent, F32's, F64's (top bit set matters), one class.
FIELDS = [(np.uint16, 7, 255), (np.uint32, 23, 255), (np.uint64, 52, 2047), (np.uint8, 3, 15), (np.uint16, 0, 0)]


def tensor_of(a: np.ndarray) -> torch.Tensor:
    signed = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[a.dtype.itemsize]
    return torch.from_numpy(a.view(signed).copy())


def few_classes(rng, n: int, dtype, shift: int, mask: int) -> np.ndarray:
    """Values whose classes come from a handful (skewed, like weights' exponents), other bits random."""
    width = np.dtype(dtype).itemsize * 8
    raw = rng.integers(0, 1 << min(width, 63), n, dtype=np.uint64)
    if width == 64:
        raw |= rng.integers(0, 2, n, dtype=np.uint64) << np.uint64(63)
    classes = rng.choice(np.arange(min(mask + 1, 6)) * max(1, mask // 7), n, p=None)
    field = np.uint64(mask) << np.uint64(shift)
    raw = (raw & ~field) | (classes.astype(np.uint64) << np.uint64(shift)) & field
    return raw.astype(dtype)


@pytest.mark.parametrize("dtype,shift,mask", FIELDS)
@pytest.mark.parametrize("density", [0.0, 0.003, 0.05, 1.0])
def test_diff_ranks_matches_reference(dtype, shift, mask, density):
    rng = np.random.default_rng(hash((np.dtype(dtype).str, shift, density)) & 0xFFFF)
    n = 3000
    old = few_classes(rng, n, dtype, shift, mask)
    new = old.copy()
    pick = rng.random(n) < density
    width = np.dtype(dtype).itemsize * 8
    noise = rng.integers(1, 1 << min(width, 62), n, dtype=np.uint64).astype(dtype)
    new[pick] = (old[pick] + noise[pick]).astype(dtype)  # wraps: every difference, both signs
    want = diff_ranks_ref(old, new, shift, mask)
    for window in (97, 1024, 1 << 20):
        zigzag, classes, ranks, sizes = class_sort.diff_ranks(tensor_of(old), tensor_of(new), shift, mask, window)
        np.testing.assert_array_equal(zigzag.numpy().astype(np.uint64).astype(dtype), want[0])
        np.testing.assert_array_equal(classes.numpy(), want[1].astype(np.int64))
        np.testing.assert_array_equal(ranks.numpy(), want[2])
        np.testing.assert_array_equal(sizes.numpy(), want[3])


def class_major(classes: np.ndarray, ranks: np.ndarray, mask: int):
    order = np.argsort(classes, kind="stable")
    offsets = np.zeros(mask + 2, np.int64)
    np.add.at(offsets, classes.astype(np.int64) + 1, 1)
    return np.cumsum(offsets), ranks[order]


@pytest.mark.parametrize("dtype,shift,mask", FIELDS)
def test_locate_ranked_matches_reference(dtype, shift, mask):
    """Entries made from real changes (every one found), plus hostile ones: ranks past the class,
    negative, repeated or falling; each must be -1, as ranked_positions_ref and the walks say."""
    rng = np.random.default_rng(7)
    n = 2500
    base = few_classes(rng, n, dtype, shift, mask)
    new = base.copy()
    pick = rng.random(n) < 0.04
    new[pick] = (base[pick] ^ dtype(1)).astype(dtype)
    _, classes, ranks, sizes = diff_ranks_ref(base, new, shift, mask)
    offsets, ranks_cm = class_major(classes, ranks, mask)
    for window in (61, 1000, 1 << 20):
        where, found, got_sizes = class_sort.locate_ranked(tensor_of(base), shift, mask, offsets, ranks_cm, window)
        want, want_found = ranked_positions_ref(base, shift, mask, offsets, ranks_cm)
        np.testing.assert_array_equal(where.numpy(), want)
        assert found == want_found == ranks_cm.size
        np.testing.assert_array_equal(got_sizes.numpy(), sizes)
    # hostile: a rank past its class and a negative one are not found
    c = int(classes[0])
    hostile = ranks_cm.copy()
    hostile[offsets[c + 1] - 1] = sizes[c] + 5
    where, found, _ = class_sort.locate_ranked(tensor_of(base), shift, mask, offsets, hostile, 300)
    assert found == ranks_cm.size - 1 and int(where[offsets[c + 1] - 1]) == -1
    if offsets[c + 1] - offsets[c] >= 2:  # a rank repeated within its class: the repeat is skipped
        hostile = ranks_cm.copy()
        hostile[offsets[c] + 1] = hostile[offsets[c]]
        where, found, _ = class_sort.locate_ranked(tensor_of(base), shift, mask, offsets, hostile, 300)
        assert int(where[offsets[c] + 1]) == -1 and found == ranks_cm.size - 1
    hostile = ranks_cm.copy()
    hostile[0] = -3
    where, found, _ = class_sort.locate_ranked(tensor_of(base), shift, mask, offsets, hostile, 300)
    assert int(where[0]) == -1


def test_empty_inputs():
    empty = torch.empty(0, dtype=torch.int16)
    z, c, r, s = class_sort.diff_ranks(empty, empty, 7, 255)
    assert z.numel() == c.numel() == r.numel() == 0 and s.numel() == 256 and int(s.sum()) == 0
    where, found, sizes = class_sort.locate_ranked(empty, 7, 255, np.zeros(257, np.int64), np.zeros(0, np.int64))
    assert where.numel() == 0 and found == 0
    with pytest.raises(ValueError):
        class_sort.diff_ranks(torch.zeros(4, dtype=torch.int16), torch.zeros(5, dtype=torch.int16), 7, 255)


def test_bad_class_offsets_are_refused_before_any_device_work():
    base = torch.zeros(10, dtype=torch.int16)
    ranks = np.array([0, 1], np.int64)
    good = np.zeros(257, np.int64)
    good[1:] = 2
    assert class_sort.locate_ranked(base, 7, 255, good, ranks)[1] == 2
    for bad in (good[:100], np.r_[1, good[1:]], np.r_[good[:-1], 3], np.r_[0, 2, 1, good[3:]]):
        with pytest.raises(ValueError, match="class_offsets"):
            class_sort.locate_ranked(base, 7, 255, bad, ranks)
