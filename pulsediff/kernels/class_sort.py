"""ctx-rans' rank <-> position maps by a stable sort of the base's classes, in torch.

The codec names a changed element by (class, rank): its base class, and how many elements of
that class come before it (FORMAT.md §6.3). Sorting the base's class keys stably gives both
directions at once: in the sorted order, the elements of class c sit at [start[c], start[c] +
size[c]) in position order, so

    position of (c, r)      = perm[start[c] + r]                 (apply: a gather)
    rank of the element at perm[s] = s - start[c]                 (make: read off the order)

where perm is the stable argsort of the class keys and start the exclusive prefix sum of the
class sizes. On a GPU, torch's stable sort of 1-byte keys is CUB's onesweep radix sort (Adinets
and Merrill, "Onesweep: A Faster Least Significant Digit Radix Sort for GPUs", 2022): one
digit pass for BF16's 256 exponent classes, at memory speed, written and tuned by NVIDIA. That
replaces a hand-written rank walk whose speed depends on how the changes fall (issue 26
measured the Numba walk at 16-32 GB/s on an H100, under 2% of its copy bandwidth).

Byte budget per base element, BF16 (mask 255): the keys come from one fused kernel
(kernels.cuda.class_keys: reads 2 B, writes 1 B; torch's shift, mask and narrowing took 11 B),
the histogram reads 1; the sort writes the int64 index sequence (8), then reads key and index
and writes both (CUB's onesweep: 1 + 8 + 1 + 8, plus a digit-histogram pass over the keys, 1).
About 31 B per element against the 2 B a plain read of the tensor costs: a 6.74e9-element 7B
model is ~210 GB of traffic, ~80 ms at the 2.4-2.7 TB/s an H100 copies at. The gathers touch
only the ~1% of listed entries. scripts/bench_gpu.py measures it next to the Numba walk.

Host synchronisations, counted: locate_ranked, one per window (the nonzero of the entries that
fall in it) and one per call (the found count); diff_ranks, two per window that has a change
(whether it has one; the nonzero of its changed slots), one for a window without, and the
final gathers' none. The key kernel adds none (it runs on torch's current stream).

Memory: the tensor is taken in windows of WINDOW elements (the two 2-byte temporaries, keys,
sorted keys, int64 permutation and CUB's scratch: ~30 B per element of a window, ~0.5 GiB at
2**24), whatever the tensor's size; a class's ranks then continue from the windows before
(`seen`), as in the CPU backend's `ranked_window`.

Since the tile kernels (kernels.cuda.tile_locate_ranked: two reads of the base, nothing sorted),
the live apply takes this locate only for a section listing more classes than a tile counts; make's
diff_ranks still takes this sort.

The same code runs on CPU tensors, which is how it is checked against tests/reference.py on
machines without a GPU; the CUDA backend uses it for tensors in GPU memory
(`kernels.cuda.locate_ranked`, `kernels.cuda.diff_ranks`).
"""

from __future__ import annotations

import numpy as np

# Elements per window: bounds the extra device memory (~20 B per element) whatever the tensor.
WINDOW = 1 << 24


def _torch():
    import torch

    return torch


def signed_view(t):
    """A flat tensor of integer bit patterns, as signed integers of its width (torch's shifts
    on these are arithmetic, which is the kernels' definition for 8-byte elements and, under
    FORMAT.md's s + b <= W, gives the same class as a logical shift for narrower ones)."""
    torch = _torch()
    t = t.reshape(-1)
    signed = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t if t.dtype == signed else t.view(signed)


def class_keys(bits, shift: int, mask: int):
    """(bits >> shift) & mask, as the narrowest integer that holds mask (uint8 for <= 255:
    a one-digit radix sort). Computed in the bits' own signed width: FORMAT.md's s + b <= W
    keeps the field inside the element, so the arithmetic shift's copies of the sign bit are
    masked off, and no wider temporary is made. (On a GPU, kernels.cuda passes its fused
    kernel in its place: `keys_of` below.)"""
    torch = _torch()
    keys = bits >> shift
    keys &= mask
    return keys.to(torch.uint8 if mask <= 255 else torch.int16)


def check_offsets(class_offsets, ncls: int, m: int) -> np.ndarray:
    """Class-major entry offsets as the walks require them (kernels.cuda.ranks.walk_tables):
    ncls + 1 of them, from 0, never falling, ending at the entry count. Checked on the host
    before anything reaches a device, where a bad one would trip a device-side assert."""
    offsets = np.ascontiguousarray(class_offsets, np.int64).reshape(-1)
    if offsets.size < ncls + 1 or offsets[0] != 0 or offsets[ncls] != m or (np.diff(offsets[:ncls + 1]) < 0).any():
        raise ValueError("class_offsets must rise from 0 to the number of entries, one per class and one more")
    return offsets[:ncls + 1]


def _windows(n: int, window: int):
    window = max(1, int(window))
    return ((lo, min(n, lo + window)) for lo in range(0, n, window))


def _sizes(keys, ncls: int):
    """Elements per class (int64, ncls): bincount of the keys as they are (uint8 or int16)."""
    torch = _torch()
    return torch.bincount(keys if keys.dtype == torch.uint8 else keys.to(torch.int32), minlength=ncls)[:ncls]


def _stable_order(keys, mask: int):
    """The stable argsort of the class keys; with one class, position order itself."""
    torch = _torch()
    if mask == 0:
        return torch.arange(keys.numel(), device=keys.device)
    return torch.sort(keys, stable=True).indices


def locate_ranked(base, shift: int, mask: int, class_offsets, ranks, window: int = WINDOW, keys_of=class_keys):
    """Where each (class, rank) entry lies in `base` (flat integer bit patterns, any device):
    int64 positions in entry order, -1 for an entry whose rank is outside its class or not
    above the previous entry's of its class; how many were found; and the base's class sizes
    (int64, mask + 1). `keys_of(bits, shift, mask)` makes a window's sort keys (class_keys,
    or on a GPU kernels.cuda's fused kernel). Entries are class-major: entries class_offsets[c] .. class_offsets[c +
    1] - 1 belong to class c (checked: ValueError otherwise). Ranks that do not rise within a
    class mean a damaged patch: the walks may find a different number of such entries, but
    never all of them, so a caller that requires every entry found refuses it either way."""
    torch = _torch()
    bits = signed_view(base)
    dev = bits.device
    ncls = mask + 1
    ranks = torch.as_tensor(np.ascontiguousarray(ranks, np.int64)).to(dev) if not torch.is_tensor(ranks) \
        else ranks.to(dev, torch.int64)
    m = ranks.numel()
    counts = torch.as_tensor(np.diff(check_offsets(class_offsets, ncls, m))).to(dev)
    entry_class = torch.repeat_interleave(torch.arange(ncls, device=dev), counts, output_size=m)
    where = torch.full((m,), -1, dtype=torch.int64, device=dev)
    seen = torch.zeros(ncls, dtype=torch.int64, device=dev)
    for lo, hi in _windows(bits.numel(), window):
        keys = keys_of(bits[lo:hi], shift, mask)
        sizes = _sizes(keys, ncls)
        if m:
            perm = _stable_order(keys, mask)
            first = seen[entry_class]
            inside = (ranks >= first) & (ranks < first + sizes[entry_class])
            k = torch.nonzero(inside).squeeze(1)
            if k.numel():
                start = torch.cumsum(sizes, 0) - sizes
                cls = entry_class[k]
                where[k] = lo + perm[start[cls] + ranks[k] - first[k]]
        seen += sizes
    if m > 1:  # ranks must rise within a class: an entry that does not is skipped, as the walks skip it
        stalled = (entry_class[1:] == entry_class[:-1]) & (ranks[1:] <= ranks[:-1])
        where[1:][stalled] = -1
    found = int((where >= 0).sum())
    return where, found, seen


def diff_ranks(old, new, shift: int, mask: int, window: int = WINDOW, keys_of=class_keys):
    """make's compare and ranking: for each element whose bits differ, in position order, the
    zigzag-coded difference new - old modulo 2**width (int64), its base class (int64) and its
    rank within that class (int64); and the class sizes (int64, mask + 1). Any device.
    `keys_of` as in locate_ranked."""
    torch = _torch()
    a, b = signed_view(old), signed_view(new)
    if a.numel() != b.numel() or a.element_size() != b.element_size():
        raise ValueError("diff_ranks needs arrays of equal length and element width")
    dev = a.device
    ncls = mask + 1
    width = 8 * a.element_size()
    seen = torch.zeros(ncls, dtype=torch.int64, device=dev)
    parts = []
    for lo, hi in _windows(a.numel(), window):
        wa, wb = a[lo:hi], b[lo:hi]
        keys = keys_of(wa, shift, mask)
        sizes = _sizes(keys, ncls)
        changed = wa != wb
        if bool(changed.any()):
            perm = _stable_order(keys, mask)
            s = torch.nonzero(changed[perm]).squeeze(1)  # sorted slots of the changed elements
            pos = perm[s]
            cls = keys[pos].to(torch.int64)
            start = torch.cumsum(sizes, 0) - sizes
            parts.append((lo + pos, cls, seen[cls] + s - start[cls]))
        seen += sizes
    if not parts:
        empty = torch.empty(0, dtype=torch.int64, device=dev)
        return empty, empty, empty, seen
    pos, cls, rank = (torch.cat(x) for x in zip(*parts))
    order = torch.argsort(pos)  # class-major within each window: back to position order
    pos, cls, rank = pos[order], cls[order], rank[order]
    d = b[pos].to(torch.int64) - a[pos].to(torch.int64)  # exact for widths < 8; wraps for 8, as it must
    if width < 64:
        d = d & ((1 << width) - 1)
        d = torch.where(d >= 1 << (width - 1), d - (1 << width), d)
    zigzag = (d << 1) ^ (d >> 63)
    if width < 64:
        zigzag = zigzag & ((1 << width) - 1)
    return zigzag, cls, rank, seen
