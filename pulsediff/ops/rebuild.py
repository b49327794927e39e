"""Rebuilding one target tensor: a patch's section decoded onto its base (rebuild_tensor), through
every link of a chain (chain_rebuild), or window by window for a tensor larger than a window
(rebuild_windows, chain_windows), each checked against its recorded hash."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from pulsediff.codecs import get_codec
from pulsediff.codecs.base import Scratch, SectionContext
from pulsediff.errors import ChainError, CorruptPatchError
from pulsediff.format.digest import TensorId
from pulsediff.format.header import PatchHeader, TensorRecord
from pulsediff.format.patch_file import Link
from pulsediff.io.checkpoint import TensorView

# Elements per window of a windowed rebuild: 16 MiB of BF16, large enough to
# keep every worker thread busy, small enough to stay near the cache.
WINDOW_ELEMENTS = 1 << 23


def carry_through(name: str, links: list[Link], view: TensorView, backend, scratch: Scratch) -> np.ndarray:
    """The tensor after the last link: from the last link that carries it whole, or from the base."""
    return chain_rebuild(name, links, view, backend).run(scratch)


class BaseDiffers(Exception):
    """The base is not the first link's (BaseCheck): not an error to report, a signal to check the
    base first after all, which tells what it is instead (the target, a later link's base, or
    neither) and says so in the usual words."""


class BaseCheck:
    """The base's digest taken while the rebuild reads each base tensor, in place of a pass of its
    own before it: apply then reads the base once. It assumes that the base is the first link's.

    Each base tensor's hash is compared with the first link's record as soon as it is known, and
    the whole digest (with the tensors the rebuild never read hashed at the end) before anything
    is committed. Any difference raises BaseDiffers. Thread-safe: whole tensors are checked on
    the worker threads that rebuild them (each name once).
    """

    def __init__(self, header: PatchHeader, view: TensorView):
        self.header, self.view = header, view
        self._hashes: dict[str, str] = {}
        self.verified = False  # finish() found the base to be the patch's

    def _seen(self, rec: TensorRecord, digest: str) -> None:
        if digest != rec.base_hash:
            raise BaseDiffers(rec.name)
        self._hashes[rec.name] = digest

    def whole(self, rec: TensorRecord, bits: np.ndarray) -> str:
        """Check the base tensor `bits` that `rec` (the first link's record) decodes onto; its hash."""
        digest = rec.scheme.tensor_hash(bits)
        self._seen(rec, digest)
        return digest

    def windows(self, rec: TensorRecord, bits: np.ndarray, window: int):
        """The base tensor as windows of `window` elements, each hashed once the consumer has walked
        it (it asks for the next one), so from the cache; checked after the last."""
        hasher = rec.scheme.hasher()
        for lo in range(0, bits.size, window):
            part = bits[lo:lo + window]
            yield part
            hasher.update(part)
        self._seen(rec, hasher.hexdigest())

    def finish(self) -> None:
        """Hash the base tensors the rebuild did not read (carried whole, or removed), then compare
        the base's digest with the first link's."""
        from pulsediff.kernels.threads import num_threads, parallel_map

        view, scheme = self.view, self.header.scheme
        rest = [name for name in view.ckpt.names if name not in self._hashes]
        batch = num_threads()  # as tensor_ids: views (bf16 casts) taken here, only the hashing spread
        for first in range(0, len(rest), batch):
            tensors = [view.get(name) for name in rest[first:first + batch]]
            for t, digest in zip(tensors, parallel_map(scheme.tensor_hash, [(t.bits,) for t in tensors])):
                self._hashes[t.name] = digest
        ids = [TensorId(name, view.dtype_of(name).name, view.shape_of(name), digest)
               for name, digest in self._hashes.items()]
        if len(ids) != len(view.ckpt.names) or scheme.digest(ids) != self.header.base_digest:
            raise BaseDiffers(None)
        self.verified = True


@dataclass
class Rebuild:
    """A target tensor to rebuild: its sections already read (in the patch's order, so a patch on
    stdin is read front to back), the decoding left to `run`, which may happen on another thread."""

    numel: int
    steps: list  # (record, payload or None, source) per link, oldest first: each decodes onto the last
    base_bits: np.ndarray | None  # what the first step decodes onto (None: it carries the tensor whole)
    backend: object
    base_check: BaseCheck | None = None  # checks base_bits against the first step's record first

    def run(self, scratch: Scratch, alone: bool = False) -> np.ndarray:
        bits = self.base_bits
        check = self.base_check if bits is not None else None
        for k, (rec, payload, source) in enumerate(self.steps):
            checked = k == 0 and check is not None
            # The target is the base (no payload): one hash checks both.
            known_hash = check.whole(rec, bits) if checked and payload is None else None
            rebuilt = rebuild_tensor(rec, payload, bits, self.backend, source, scratch, alone, known_hash)
            if checked and payload is not None:
                check.whole(rec, bits)  # after the decode, which read the base into the cache
            bits = rebuilt
        return bits


def chain_rebuild(name: str, links: list[Link], view: TensorView, backend,
                  base_check: BaseCheck | None = None) -> Rebuild:
    """How to carry one tensor through every link, from the last link that carries it whole
    (or from the base, checked by `base_check` when given); reads its sections now."""
    start = len(links) - 1
    while start >= 0:
        rec = links[start].records.get(name)
        if rec is None:
            raise ChainError(f"{links[start].reader.source} lacks tensor {name!r} that a later patch builds on")
        if rec.op == "full":
            break
        start -= 1
    if start < 0:
        if name not in view.ckpt:
            raise ChainError(f"the base lacks tensor {name!r} that the chain builds on")
        bits = view.get(name).bits
    else:
        bits = None
    steps = []
    for link in links[max(start, 0):]:
        rec = link.records[name]
        payload = link.reader.read_section(rec.section, f"tensor {name!r}") if rec.section else None
        steps.append((rec, payload, link.reader.source))
    return Rebuild(steps[-1][0].numel if steps else bits.size, steps, bits, backend,
                   base_check if bits is not None else None)


def chain_windows(rebuild: Rebuild, link_scratch: list[Scratch]) -> "Windows | Rebuild":
    """A tensor larger than a window, carried from the base through links that each patch it with
    a windowed codec or keep it, as windows: every link rebuilds each window of the one before
    while it is in the cache, and memory holds two windows per link instead of the whole tensor.
    Each link's hash is checked once its last window has gone through. Anything else, or a chain
    so long that the windowed way would hold more: the Rebuild as it is."""
    base, steps = rebuild.base_bits, rebuild.steps
    if rebuild.numel <= WINDOW_ELEMENTS or base is None or not steps or len(steps) > len(link_scratch):
        return rebuild
    # Windows hold every link's two windows and decoded entries (~9 bytes per change) at once, the
    # whole-tensor way one tensor and one link's entries: a long chain is cheaper whole.
    entry_bytes = [9 * rec.changed for rec, _, _ in steps]
    if (sum(entry_bytes) + len(steps) * 2 * WINDOW_ELEMENTS * base.itemsize
            >= rebuild.numel * base.itemsize + max(entry_bytes)):
        return rebuild
    for rec, payload, _ in steps:
        if (rec.numel, rec.dtype.itemsize) != (base.size, base.dtype.itemsize):
            return rebuild  # the Rebuild refuses it with the error that fits
        if not (rec.op == "same" and payload is None
                or rec.op == "patch" and hasattr(get_codec(rec.section.codec), "decode_stream")):
            return rebuild
    parts = base_windows(base, steps[0][0], rebuild.base_check)
    for k, (rec, payload, source) in enumerate(steps):
        if rec.op == "patch":
            ctx = SectionContext(rec.name, rec.numel, rec.dtype.itemsize, source)
            parts = get_codec(rec.section.codec).decode_stream(parts, payload, rec.section.params, ctx,
                                                               rebuild.backend, link_scratch[k])
        if k < len(steps) - 1:
            parts = hash_checked(parts, rec, source)
    last, _, source = steps[-1]
    return Windows(last, source, parts)  # the writer checks the last link's hash


def base_windows(base: np.ndarray, rec: TensorRecord, base_check: BaseCheck | None):
    """The base tensor that `rec` decodes onto, as windows (checked by `base_check` when given)."""
    if base_check is not None:
        return base_check.windows(rec, base, WINDOW_ELEMENTS)
    return (base[lo:lo + WINDOW_ELEMENTS] for lo in range(0, base.size, WINDOW_ELEMENTS))


def hash_checked(parts, rec: TensorRecord, source: str):
    """The windows as they are, and once the last has gone by, the check of the tensor's hash
    (the one the writer makes of the last link's windows: Windows.check)."""
    windows = Windows(rec, source, parts)
    for part in parts:
        windows.hasher.update(part)
        yield part
    windows.check()


def check_base_size(rec: TensorRecord, base_bits: np.ndarray, source: str) -> None:
    """A patched tensor's base must have the element count and width its record says."""
    if (base_bits.size, base_bits.dtype.itemsize) != (rec.numel, rec.dtype.itemsize):
        raise CorruptPatchError(source, f"tensor {rec.name!r}: base has {base_bits.size} elements of "
                                        f"{base_bits.dtype.itemsize} bytes, patch expects {rec.numel} of "
                                        f"{rec.dtype.itemsize}")


def rebuild_tensor(rec: TensorRecord, payload: bytes | None, base_bits: np.ndarray | None, backend, source: str,
                   scratch: Scratch, alone: bool = False, base_hash: str | None = None) -> np.ndarray:
    """One target tensor's bits, checked against its recorded hash.

    `payload` None means the target tensor is `base_bits` as they are (op
    "same", or a base that already is the target). `alone`: this runs on one
    worker thread beside other rebuilds (Codec.decode_alone). `base_hash`:
    base_bits' hash, when the caller has just taken it (not taken twice).
    """
    if payload is None:
        bits = base_bits
    else:
        codec = get_codec(rec.section.codec)
        if base_bits is not None and rec.op == "patch":
            check_base_size(rec, base_bits, source)
        ctx = SectionContext(rec.name, rec.numel, rec.dtype.itemsize, source)
        decode = codec.decode_alone if alone else codec.decode
        bits = decode(base_bits if rec.op == "patch" else None, payload, rec.section.params, ctx, backend, scratch)
    digest = base_hash if payload is None and base_hash is not None else rec.scheme.tensor_hash(bits)
    if digest != rec.target_hash:
        raise CorruptPatchError(source, f"tensor {rec.name!r} does not rebuild to its recorded hash")
    # The hash says nothing of the size when the header lies about it consistently (a "same" tensor given
    # another shape or dtype): the file header would promise bytes that are not written.
    if (bits.size, bits.dtype.itemsize) != (rec.numel, rec.dtype.itemsize):
        raise CorruptPatchError(source, f"tensor {rec.name!r} rebuilds to {bits.size} elements of "
                                        f"{bits.dtype.itemsize} bytes; the header says {rec.numel} of {rec.dtype.itemsize}")
    return bits


def rebuild_windows(rec: TensorRecord, payload: bytes, base_bits: np.ndarray, backend, source: str,
                    scratch: Scratch, base_check: BaseCheck | None = None) -> "Windows":
    """One patched tensor as consecutive windows (codec.decode_stream); its hash is checked by
    whoever consumes them (`Windows.hasher`), since it is known only after the last one. The
    base's, with `base_check`, is checked before that."""
    check_base_size(rec, base_bits, source)
    ctx = SectionContext(rec.name, rec.numel, rec.dtype.itemsize, source)
    codec = get_codec(rec.section.codec)
    return Windows(rec, source, codec.decode_stream(base_windows(base_bits, rec, base_check), payload,
                                                    rec.section.params, ctx, backend, scratch))


@dataclass
class Windows:
    """A tensor rebuilt window by window, and the check of its hash once all are seen."""

    rec: TensorRecord
    source: str
    parts: Iterator[np.ndarray]

    def __post_init__(self) -> None:
        self.hasher = self.rec.scheme.hasher()

    def check(self) -> None:
        if self.hasher.hexdigest() != self.rec.target_hash:
            raise CorruptPatchError(self.source, f"tensor {self.rec.name!r} does not rebuild to its recorded hash")
