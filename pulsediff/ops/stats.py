"""Sparsity and size statistics of a patch, computed from its header alone."""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from pulsediff.codecs.facts import facts_of
from pulsediff.format.header import PatchHeader


@dataclass(frozen=True)
class TensorStats:
    name: str
    dtype: str
    shape: list[int]
    op: str
    codec: str | None
    elements: int
    changed: int
    density: float
    index_bytes: int
    value_bytes: int

    @property
    def bytes(self) -> int:
        return self.index_bytes + self.value_bytes


@dataclass(frozen=True)
class PatchStats:
    precision: str
    codec: list[str]
    base_digest: str
    target_digest: str
    tensors: int
    changed_tensors: int
    whole_tensors: int  # carried whole: added, reshaped, retyped or densely changed
    removed_tensors: int
    elements: int
    changed: int
    density: float
    patch_bytes: int
    header_bytes: int  # preamble, header and layout section
    index_bytes: int  # bytes that carry positions
    value_bytes: int  # bytes that carry values (whole tensors included)
    bits_per_changed: float | None
    target_bytes: int  # the dense rebuilt checkpoint
    ratio: float | None  # target_bytes / patch_bytes
    per_tensor: list[TensorStats]
    # |new - base| in bit-pattern units (ULPs, for same-sign floats) -> count, over the
    # sections whose codec stores differences; None when no section does.
    ulp_histogram: dict[str, int] | None = None

    def to_json(self) -> dict:
        out = asdict(self)
        out["per_tensor"] = [asdict(t) for t in self.per_tensor]
        return out


def patch_stats(header: PatchHeader, header_bytes: int) -> PatchStats:
    """Statistics of a patch whose preamble and header took `header_bytes`."""
    per_tensor = []
    for rec in header.tensors:
        index = value = 0
        codec_id = None
        if rec.section is not None:
            codec_id = rec.section.codec
            index = facts_of(codec_id).index_bytes(rec.section.params)
            value = rec.section.length - index
        per_tensor.append(TensorStats(
            rec.name, rec.dtype.name, list(rec.shape), rec.op, codec_id, rec.numel, rec.changed,
            rec.changed / rec.numel if rec.numel else 0.0, index, value,
        ))
    elements = sum(t.elements for t in per_tensor)
    changed = sum(t.changed for t in per_tensor)
    index_bytes = sum(t.index_bytes for t in per_tensor)
    value_bytes = sum(t.value_bytes for t in per_tensor)
    total = header_bytes + header.layout.section.length + index_bytes + value_bytes
    return PatchStats(
        precision=header.precision,
        codec=sorted({t.codec for t in per_tensor if t.codec}),
        base_digest=header.base_digest,
        target_digest=header.target_digest,
        tensors=len(per_tensor),
        changed_tensors=sum(1 for t in per_tensor if t.op != "same"),
        whole_tensors=sum(1 for t in per_tensor if t.op == "full"),
        removed_tensors=len(header.removed),
        elements=elements,
        changed=changed,
        density=changed / elements if elements else 0.0,
        patch_bytes=total,
        header_bytes=header_bytes + header.layout.section.length,
        index_bytes=index_bytes,
        value_bytes=value_bytes,
        bits_per_changed=8 * total / changed if changed else None,
        target_bytes=header.target_bytes,
        ratio=header.target_bytes / total if total else None,
        per_tensor=per_tensor,
    )


ULP_BUCKETS = [(1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 256), (257, 65535), (65536, 2**64)]


def _bucket_name(lo: int, hi: int) -> str:
    if lo == hi:
        return str(lo)
    return f">={lo}" if hi == 2**64 else f"{lo}-{hi}"


def ulp_histogram(reader, header: PatchHeader) -> dict[str, int] | None:
    """Histogram of |value difference| over the sections that store differences."""
    import numpy as np

    from pulsediff.codecs import get_codec
    from pulsediff.codecs.base import SectionContext

    counts = np.zeros(len(ULP_BUCKETS), np.int64)
    seen = False
    reader.read_next(header.layout.section, "layout")
    for rec in header.tensors:
        if rec.section is None:
            continue
        payload = reader.read_next(rec.section, f"tensor {rec.name!r}")
        ctx = SectionContext(rec.name, rec.numel, rec.dtype.itemsize, reader.source)
        deltas = get_codec(rec.section.codec).value_deltas(payload, rec.section.params, ctx)
        if deltas is None:
            continue
        seen = True
        mags = np.abs(deltas.astype(np.float64))  # float: |INT64_MIN| has no int64
        edges = np.array([lo for lo, _ in ULP_BUCKETS[1:]], np.float64)
        counts += np.bincount(np.searchsorted(edges, mags, side="right"), minlength=len(ULP_BUCKETS))
    if not seen:
        return None
    return {_bucket_name(lo, hi): int(c) for (lo, hi), c in zip(ULP_BUCKETS, counts)}


def _stats_from_stream(patch, values: bool = True) -> PatchStats:
    from pulsediff.format.patch_file import open_patch

    reader, header, owned = open_patch(patch)
    try:
        s = patch_stats(header, reader.header_bytes)
        return replace(s, ulp_histogram=ulp_histogram(reader, header)) if values else s
    finally:
        if owned:
            owned.close()


def stats_of_patch_file(path: str | Path, values: bool = True) -> PatchStats:
    """The patch's statistics; with `values`, its changed values are decoded too, for the ULP histogram
    (that loads the codecs' kernels; without it only the header is read, in milliseconds)."""
    return _stats_from_stream(path, values)


def stats_of_pair(old: str | Path, new: str | Path, **make_kwargs) -> PatchStats:
    """Statistics of the patch `make` would write for OLD -> NEW (made in a temporary file)."""
    from pulsediff.ops.make import make_patch

    with tempfile.TemporaryFile() as f:
        make_patch(old, new, f, **make_kwargs)
        f.seek(0)
        return _stats_from_stream(f)
