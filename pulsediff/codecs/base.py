"""The codec contract and the checked helpers every codec shares."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import numpy as np
import zstandard

from pulsediff.errors import CorruptPatchError
from pulsediff.codecs.facts import facts_of
from pulsediff.io.memory import Scratch  # noqa: F401  (part of the codec contract: decode's scratch)

# Level 3 is zstd's default: on gaps and weight bits, higher levels gain under 2%
# and cost several times the time.
ZSTD_LEVEL = 3


@dataclass(frozen=True)
class Encoded:
    parts: tuple[bytes, ...]  # written back to back as the section
    params: dict  # recorded in the header; everything decode needs besides the bytes
    index_bytes: int = 0  # how many section bytes carry positions (for stats)

    @property
    def length(self) -> int:
        return sum(len(p) for p in self.parts)


@dataclass(frozen=True)
class SectionContext:
    """What the header says of the tensor a section rebuilds; codecs check params against it."""

    name: str
    numel: int
    itemsize: int
    source: str  # for error messages


class Codec(ABC):
    """Encode one changed tensor against its base; decode it back bit for bit.

    `encode` receives the base and target bits (same width, same length, or
    base None for a tensor that has no base), for sparse codecs the changed
    positions and values found by the kernel, and the tensor's DType. `decode` receives the
    section bytes and params and returns the target bits; it must validate
    every number it reads before using it, raising CorruptPatchError. Both
    get the kernel backend (`kernels.Backend`) to run their hot loops on;
    a codec never imports a backend itself.
    """

    id: str  # its entry in facts.FACTS says what its header-level methods below answer

    @abstractmethod
    def encode(self, base: np.ndarray | None, target: np.ndarray, positions: np.ndarray | None,
               values: np.ndarray | None, dtype=None, kernels: ModuleType | None = None) -> Encoded: ...

    def encode_pair(self, base: np.ndarray, target: np.ndarray, dtype=None, kernels: ModuleType | None = None,
                    max_changed: int | None = None) -> tuple[int, Encoded | None]:
        """(changed elements, section) for a base and target of equal shape; section None when
        more than `max_changed` changed. Codecs that can fuse the compare into their own
        pass over the pair override this (ctx-rans does)."""
        kernels = cpu_if_none(kernels)
        positions, values = kernels.diff_compact(base, target)
        if max_changed is not None and positions.size > max_changed:
            return positions.size, None
        positions, values = to_host(positions), to_host(values)  # device arrays in: the changes cross
        return positions.size, self.encode(base, target, positions, values, dtype=dtype, kernels=kernels)

    def compare_pair(self, base, target, dtype=None, kernels: ModuleType | None = None,
                     max_changed: int | None = None) -> tuple[int, Callable[[], Encoded] | None]:
        """encode_pair in two halves: the compare now, on `kernels` (where the pair lives, a GPU's
        included), and the coding of what it found as a callable to run later on any thread,
        holding host arrays only (make on the device codes on the host's threads while the GPU
        compares the next tensors). None in place of it as encode_pair's section would be. Codecs
        whose coding is cheap do it all now."""
        changed, enc = self.encode_pair(base, target, dtype=dtype, kernels=kernels, max_changed=max_changed)
        return changed, (None if enc is None else lambda: enc)

    def fuses_checks(self, kernels: ModuleType) -> bool:
        """Whether encode_pair_checked takes both tensors' hashes and word sums in the compare's
        own read of the pair on these kernels (else a caller takes them in a pass of their own)."""
        return False

    def encode_pair_checked(self, base: np.ndarray, target: np.ndarray, base_hasher, target_hasher, dtype=None,
                            kernels: ModuleType | None = None,
                            max_changed: int | None = None) -> tuple[int, Encoded | None, int, int]:
        """encode_pair, with each tensor's bytes fed in order to its hasher (`update(buffer)`)
        and its word sum (FORMAT.md §3.1) taken in the same read: (changed elements, section,
        base's sum, target's sum); the section is None when more than `max_changed` changed
        or none did (the tensors are the same). Only where fuses_checks(kernels)."""
        raise NotImplementedError(f"codec {self.id!r} does not fuse the checks into its compare")

    @abstractmethod
    def decode(self, base: np.ndarray | None, payload: bytes, params: dict, ctx: SectionContext,
               kernels: ModuleType, scratch: "Scratch") -> np.ndarray:
        """The target bits; may live in `scratch`, so use them before the next decode."""

    def decode_alone(self, base: np.ndarray | None, payload: bytes, params: dict, ctx: SectionContext,
                     kernels: ModuleType, scratch: "Scratch") -> np.ndarray:
        """decode() when the caller runs it on one worker thread, beside other tensors' decodes
        (kernels called from a worker thread run on it alone): a codec whose decode does work
        only to spread itself over threads leaves that out here."""
        return self.decode(base, payload, params, ctx, kernels, scratch)

    def locate(self, base, payload: bytes, params: dict, ctx: SectionContext, kernels: ModuleType,
               scratch: "Scratch", decoded=None):
        """The changes as (positions, zigzag deltas), positions in the memory `base` lives in (a
        device array stays on the device): what patching a live tensor in place needs, without
        rebuilding it. None when the codec cannot (the caller decodes on the host instead).
        `decoded`: what `decode_changes` returned for this section, if the caller ran it ahead."""
        return None

    def decode_changes(self, payload: bytes, params: dict, ctx: SectionContext):
        """The host-side half of `locate`, which needs no base: the section's entropy decode,
        thread-safe, so that a caller can run it for the next tensors on worker threads while
        this one is placed on its device. None when the codec has no such half."""
        return None

    def value_deltas(self, payload: bytes, params: dict, ctx: SectionContext) -> np.ndarray | None:
        """Signed bit-pattern differences (new - base) of the changed elements, when the
        section holds them without needing the base; None otherwise."""
        return None

    @property
    def needs_base(self) -> bool:
        return facts_of(self.id).needs_base

    def changed_count(self, params: dict) -> int | None:
        """Changed elements the section carries, when the codec knows it without decoding."""
        return facts_of(self.id).changed_count(params)

    def index_bytes(self, params: dict) -> int:
        return facts_of(self.id).index_bytes(params)


# -- shared, checked helpers -------------------------------------------------


def to_host(a):
    """A kernel's result on the host: a device array copied over (compact entries, never a whole
    tensor), a host array as it is."""
    return a.copy_to_host() if hasattr(a, "copy_to_host") else a


def cpu_if_none(kernels: ModuleType | None) -> ModuleType:
    """The backend a caller handed an encoder, or the CPU one (encoders called without one)."""
    if kernels is None:
        from pulsediff.kernels import get_backend

        kernels = get_backend("cpu")
    return kernels


# One compressor per thread: a ZstdCompressor must not be used by two threads at
# once (python-zstandard's rule), and make encodes several tensors side by side.
# Sharing one corrupted frames in the fuzz corpus of a CI run.
_compressors = threading.local()


def zstd_compress(data) -> bytes:
    cctx = getattr(_compressors, "cctx", None)
    if cctx is None:
        cctx = _compressors.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True,
                                                            write_checksum=False)
    return cctx.compress(data)


# A zstd block decompresses to at most 128 KiB and takes at least its 3-byte header (RFC 8878, 3.1.1.2),
# so a frame of n bytes cannot hold more than about n / 3 blocks of 128 KiB.
_ZSTD_BLOCK_MAX = 128 * 1024


def zstd_max_content(frame_len: int) -> int:
    """The most a zstd frame of `frame_len` bytes can decompress to."""
    return (frame_len // 3 + 1) * _ZSTD_BLOCK_MAX


def zstd_decompress_exact(data: bytes, expected: int, ctx: SectionContext, what: str) -> bytes:
    """Decompress one zstd frame that must hold exactly `expected` bytes.

    The frame's declared size is checked before anything is allocated, against
    the header's size and against what a frame of its length can hold: the
    header's size may itself be a consistent lie (a tensor reshaped to 4 TiB
    in the header and its layout alike, carried by a 30-byte frame).
    """
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError:
        raise CorruptPatchError(ctx.source, f"tensor {ctx.name!r}: {what} is not a zstd frame") from None
    if declared != expected:
        raise CorruptPatchError(ctx.source, f"tensor {ctx.name!r}: {what} declares {declared} bytes, expected {expected}")
    if declared > zstd_max_content(len(data)):
        raise CorruptPatchError(ctx.source, f"tensor {ctx.name!r}: {what} declares {declared} bytes, more than a "
                                            f"frame of {len(data)} bytes can hold")
    try:
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=expected)
    except zstandard.ZstdError as exc:
        raise CorruptPatchError(ctx.source, f"tensor {ctx.name!r}: {what}: {exc}") from None
    if len(out) != expected:
        raise CorruptPatchError(ctx.source, f"tensor {ctx.name!r}: {what} decodes to the wrong size")
    return out


def parse_uint(params: dict, key: str, ctx: SectionContext, upper: int) -> int:
    value = params.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= upper:
        raise CorruptPatchError(ctx.source, f"tensor {ctx.name!r}: codec parameter {key!r} is missing or out of range")
    return value


def parse_choice(params: dict, key: str, ctx: SectionContext, choices: tuple) -> object:
    value = params.get(key)
    if value not in choices:
        raise CorruptPatchError(ctx.source, f"tensor {ctx.name!r}: codec parameter {key!r} must be one of {choices}")
    return value
