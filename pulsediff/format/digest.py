"""Tensor hashes and checkpoint digests, under one of two schemes.

A checkpoint's digest identifies its tensors (names, dtypes, shapes and bytes)
and nothing of its file layout, so that the same weights saved by any tool, in
one file or in shards, have the same digest. Under `--precision bf16` the
tensors are those seen through the BF16 cast.

    tensor hash, tree (1.4) = XXH3-128 over u64 LE byte length || each 256 KiB chunk's
                              XXH3-128 (16 bytes, canonical)
    tensor hash, flat       = XXH3-128 of the tensor's bytes (little-endian elements)
    digest                  = XXH3-128 over, for each tensor in byte order of its UTF-8 name:
                              u32 len(name) | name | u32 len(dtype) | dtype | u32 ndim |
                              u64 dims... | 16-byte tensor hash
                              shown as the scheme's prefix ("xxh3tree:" or "xxh128:") + 32 hex digits

The digest's prefix names the scheme its tensor hashes were taken under (FORMAT.md §3): a
patch's tensor records use its digests' scheme, and a series keeps the scheme it started with.
The tree is the default since format 1.4 (issue 32): its chunks are hashed side by side, by the
CPU's threads or by a GPU where the tensor lives (kernels' chunk_digests), so a tensor on a GPU
is hashed without crossing to the host. The flat hash is what 1.0-1.3 wrote; patches and series
made with it keep applying and growing under it.

XXH3 is not cryptographic: digests catch mistakes and damage (wrong base,
flipped bits), not an attacker who controls both patch and checkpoint.

Since format 1.2 a patch also records each tensor's word sum (FORMAT.md §3.1,
kernels' `word_sum`): a sum over 8-byte words that a GPU computes in one
parallel pass, and that changes in the words an update touches only, so a live
apply checks base and target where the tensors live.
"""

from __future__ import annotations

import functools
import re
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

import xxhash

if TYPE_CHECKING:  # numpy is imported where it is used: reading a header needs none
    import numpy as np

# Bytes per leaf of the tree hash; FORMAT.md §3 fixes it (kernels.cpu.DIGEST_CHUNK_BYTES is the same).
TREE_CHUNK_BYTES = 1 << 18


@dataclass(frozen=True)
class TensorId:
    name: str
    dtype: str
    shape: tuple[int, ...]
    hash: str  # hex tensor hash, under the scheme of the digest it goes into


def _raw(bits) -> np.ndarray:
    """A numpy array's bytes in C order, as a flat uint8 view (a copy only when not contiguous)."""
    import numpy as np

    return np.ascontiguousarray(bits).reshape(-1).view(np.uint8)


class TreeHasher:
    """The tree hash taken piece by piece: `update(buffer)` in order, then `hexdigest()`. Whole
    chunks of a piece are hashed straight from it; a chunk split across pieces is carried."""

    def __init__(self, chunk: int = TREE_CHUNK_BYTES):
        self._chunk = chunk
        self._leaves: list[bytes] = []
        self._partial = xxhash.xxh3_128()
        self._partial_len = 0
        self._nbytes = 0

    def update(self, data) -> None:
        import numpy as np

        raw = _raw(np.frombuffer(data, np.uint8) if isinstance(data, (bytes, bytearray, memoryview)) else data)
        n, at, chunk = raw.size, 0, self._chunk
        self._nbytes += n
        if self._partial_len:
            at = min(n, chunk - self._partial_len)
            self._partial.update(raw[:at])
            self._partial_len += at
            if self._partial_len == chunk:
                self._leaves.append(self._partial.digest())
                self._partial, self._partial_len = xxhash.xxh3_128(), 0
        while n - at >= chunk:
            self._leaves.append(xxhash.xxh3_128_digest(raw[at:at + chunk]))
            at += chunk
        if at < n:
            self._partial.update(raw[at:])
            self._partial_len += n - at

    def hexdigest(self) -> str:
        tail = [self._partial.digest()] if self._partial_len else []
        return tree_root(self._nbytes, b"".join(self._leaves + tail))


def tree_root(nbytes: int, leaves: bytes) -> str:
    """The tree hash from the tensor's byte length and its chunks' canonical XXH3-128s in order."""
    h = xxhash.xxh3_128(struct.pack("<Q", nbytes))
    h.update(leaves)
    return h.hexdigest()


def tree_hash(bits, backend=None, chunk: int | None = None) -> str:
    """A tensor's tree hash, its chunks hashed by `backend`'s chunk_digests (kernels.cpu by
    default, across its threads; kernels.cuda reads a device array in place). `chunk`: another
    chunk size, for tests."""
    if backend is None or backend.__name__.endswith(".cpu"):
        raw, chunk = _raw(bits), chunk or TREE_CHUNK_BYTES
        if raw.size <= chunk:  # one leaf or none: 2 us, where the threaded path's set-up costs 20-60
            return tree_root(raw.size, xxhash.xxh3_128_digest(raw) if raw.size else b"")
        return _tree_on_host(raw, chunk, with_sum=False)[0]
    return _root_of_rows(bits.nbytes, backend.chunk_digests(bits, chunk or TREE_CHUNK_BYTES))


def _leaves(raw: np.ndarray, lo: int, hi: int, chunk: int, with_sum: bool) -> tuple[bytes, int]:
    """The canonical leaves of chunks [lo, hi), joined (xxhash's digest() is the canonical form),
    and with `with_sum` those chunks' part of the word sum, each taken from cache right after its
    leaf read the chunk (chunks are whole words, so the parts add up)."""
    from pulsediff.kernels.cpu import word_sum_part

    view, leaves, total = memoryview(raw), [], 0
    for c in range(lo, hi):
        leaves.append(xxhash.xxh3_128_digest(view[c * chunk:(c + 1) * chunk]))
        if with_sum:
            total += word_sum_part(raw, c * chunk, (c + 1) * chunk)
    return b"".join(leaves), total


def _tree_on_host(raw: np.ndarray, chunk: int, with_sum: bool) -> tuple[str, int]:
    """The tree hash of host bytes and, with `with_sum`, their word sum (else 0): the leaves
    straight from xxhash as bytes, spread over the worker threads where this runs on the
    caller's thread (kernels.cpu.chunk_digests' rows, the form a device returns, cost 22% more
    in conversions: 1 GB checkpoint, 2 threads)."""
    from pulsediff.kernels.cpu import chunk_ranges
    from pulsediff.kernels.threads import num_threads, parallel_map, serial

    m = -(-raw.size // chunk)
    ranges = [(0, m)] if serial() or m <= 4 else chunk_ranges(m, min(m, num_threads()))
    parts = parallel_map(_leaves, [(raw, lo, hi, chunk, with_sum) for lo, hi in ranges])
    return tree_root(raw.size, b"".join(p[0] for p in parts)), sum(p[1] for p in parts) & 0xFFFFFFFFFFFFFFFF


def _root_of_rows(nbytes: int, rows) -> str:
    """tree_root from chunk_digests' rows of (low 64 bits, high 64 bits); the canonical form of a
    leaf is high then low, big-endian."""
    import numpy as np

    leaves = np.asarray(rows, np.uint64).reshape(-1, 2)
    return tree_root(nbytes, np.ascontiguousarray(leaves[:, ::-1]).astype(">u8").tobytes())


def _flat_hash(bits) -> str:
    if bits.size == 0:
        return xxhash.xxh3_128_hexdigest(b"")
    return xxhash.xxh3_128_hexdigest(_raw(bits))


_CHECK_BLOCK = TREE_CHUNK_BYTES  # bytes hashed and summed in turn: a block stays in cache for the second pass


def _flat_checks(bits) -> tuple[str, str]:
    from pulsediff.kernels.cpu import word_sum_part

    raw = _raw(bits)
    h = xxhash.xxh3_128()
    total = 0
    for lo in range(0, raw.size, _CHECK_BLOCK):
        h.update(raw[lo:lo + _CHECK_BLOCK])
        total += word_sum_part(raw, lo, lo + _CHECK_BLOCK)
    return h.hexdigest(), format_word_sum(total & 0xFFFFFFFFFFFFFFFF)


def _tree_checks(bits) -> tuple[str, str]:
    digest, total = _tree_on_host(_raw(bits), TREE_CHUNK_BYTES, with_sum=True)
    return digest, format_word_sum(total)


@dataclass(frozen=True)
class DigestScheme:
    """How tensor hashes are taken, and the prefix that names it on every digest."""

    name: str  # "tree" or "flat", as make's --digest takes it
    prefix: str

    @property
    def tree(self) -> bool:
        return self.name == "tree"

    def tensor_hash(self, bits, backend=None) -> str:
        """Hex hash of a tensor's bytes (C order): a numpy array, or under the tree with
        kernels.cuda as `backend`, a device array hashed where it lives."""
        if self.tree:
            return tree_hash(bits, backend)
        return _flat_hash(bits)

    def hasher(self):
        """The tensor hash taken piece by piece: `update(buffer)` in order, then `hexdigest()`
        (for a compare that reads the tensor anyway)."""
        return TreeHasher() if self.tree else xxhash.xxh3_128()

    def checks(self, bits, backend=None) -> tuple[str, str]:
        """A tensor's hash and its word sum (FORMAT.md §3.1), both as hex: what a patch records
        for each base and target tensor. Under the tree with a device backend (kernels.cuda),
        both are taken where the array lives: only the 16-byte leaves and the block sums come
        back (two reads of the tensor on the device; on the CPU, one)."""
        if self.tree and backend is not None and not backend.__name__.endswith(".cpu"):
            return tree_hash(bits, backend), format_word_sum(backend.word_sum(bits))
        return _tree_checks(bits) if self.tree else _flat_checks(bits)

    def digest(self, tensors: Iterable[TensorId]) -> str:
        return self.digest_of_rows((t.name, t.dtype, t.shape, t.hash) for t in tensors)

    def digest_of_rows(self, rows: Iterable[tuple[str, str, tuple[int, ...], str]]) -> str:
        """The digest of entries given as (name, dtype name, shape, hex hash) tuples."""
        # One XXH3 over the entries' bytes joined (the same bytes as one update per field, a
        # third of the time: a header of 18k tensors is checked against its digest on every read).
        parts = []
        extend = parts.extend
        # Entries sort by their names' UTF-8 bytes (not by code points: they differ past U+FFFF).
        for name, (_, dtype, shape, hash_hex) in sorted([(row[0].encode("utf-8"), row) for row in rows], key=_first):
            extend((len(name).to_bytes(4, "little"), name, _dtype_field(dtype), _shape_struct(len(shape)).pack(
                len(shape), *shape), bytes.fromhex(hash_hex)))
        return self.prefix + xxhash.xxh3_128_hexdigest(b"".join(parts))

    @property
    def empty(self) -> str:
        """The digest of the checkpoint without tensors (an anchor's base)."""
        return self.digest([])


def _first(pair):
    return pair[0]


@functools.lru_cache(maxsize=64)
def _dtype_field(dtype: str) -> bytes:
    """A dtype name as a digest entry holds it: its length (u32) and its ASCII bytes."""
    raw = dtype.encode("ascii")
    return len(raw).to_bytes(4, "little") + raw


@functools.lru_cache(maxsize=128)
def _shape_struct(ndim: int) -> struct.Struct:
    """A shape as a digest entry holds it: ndim (u32) and each dimension (u64)."""
    return struct.Struct(f"<I{ndim}Q")


TREE = DigestScheme("tree", "xxh3tree:")
FLAT = DigestScheme("flat", "xxh128:")
SCHEMES = {s.name: s for s in (TREE, FLAT)}
DEFAULT_SCHEME = TREE
EMPTY_DIGESTS = frozenset(s.empty for s in SCHEMES.values())

_DIGEST = re.compile("(" + "|".join(re.escape(s.prefix) for s in SCHEMES.values()) + ")[0-9a-f]{32}")
_TENSOR_HASH = re.compile("[0-9a-f]{32}")
_WORD_SUM = re.compile("[0-9a-f]{16}")


def is_digest(value: object) -> bool:
    return isinstance(value, str) and _DIGEST.fullmatch(value) is not None


# A digest of a scheme a later version may add: a lowercase letter and up to 15 more lowercase
# letters or digits, a colon, 32 hex digits (FORMAT.md §3).
_ANY_SCHEME = re.compile(r"([a-z][a-z0-9]{0,15}:)[0-9a-f]{32}")


def unknown_scheme(value: object) -> str | None:
    """The prefix of a value that is a digest of a scheme this version does not know, else None."""
    if not isinstance(value, str) or is_digest(value):
        return None
    match = _ANY_SCHEME.fullmatch(value)
    return match.group(1) if match else None


def scheme_of(digest: str) -> DigestScheme:
    """The scheme a well-formed digest (is_digest) was taken under."""
    for scheme in SCHEMES.values():
        if digest.startswith(scheme.prefix):
            return scheme
    raise ValueError(f"{digest!r} is not a digest")


def is_tensor_hash(value: object) -> bool:
    return isinstance(value, str) and _TENSOR_HASH.fullmatch(value) is not None


def is_word_sum(value: object) -> bool:
    return isinstance(value, str) and _WORD_SUM.fullmatch(value) is not None


def format_word_sum(value: int) -> str:
    return f"{value:016x}"
