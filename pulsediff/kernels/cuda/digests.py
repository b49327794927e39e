"""XXH3-128 of each chunk of a tensor where it lives: the leaves of format 1.4's tree hash."""

from __future__ import annotations

import numpy as np
from numba import cuda, uint64

from pulsediff.kernels.cpu import DIGEST_CHUNK_BYTES, check_digest_chunk, xxh3_leaf
from pulsediff.kernels.cuda.common import address_of, as_arg, as_bits, launch_config


# --- chunk digests: XXH3-128 of each chunk, a warp per chunk ---------------------------
#
# The device twin of kernels.cpu.chunk_digests, for a digest the GPU computes where the
# tensors live. XXH3's long-input path (Collet, xxHash 0.8, doc/xxhash_spec.md) keeps eight
# 64-bit accumulators over 64-byte stripes, 16 stripes to a 1 KiB block, and scrambles them
# after each block. Within a block the stripes' contributions are plain sums, so they can be
# taken in any order: a warp reads a block as four rounds of 256 contiguous bytes (lane l
# reads word l % 8 of stripe 4r + l // 8; every load coalesced), each lane adds its own
# stripe's term and its neighbour's word (the XXH3 lane swap, through shared memory), the four
# stripe groups are summed, and each lane scrambles accumulator l % 8. The chunk's last stripe
# (64 bytes that may start anywhere) is read byte by byte; lane 0 merges the accumulators.
#
# Byte budget: every byte of the array read once (four independent 8-byte loads per lane per
# block, the next block's issued before this one's sums), 16 bytes written per chunk. Chunks of
# 240 bytes or less take XXH3's other paths; only a tensor's last chunk can be that short, and its
# few bytes are hashed on the host.
# Blocks are one warp, so that the block barrier is the warp's (and the simulator's) own.

_XXH_SECRET = bytes.fromhex(  # XXH3's default secret (xxhash.h, XXH3_kSecret)
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671fcb79e64eccc0e578825ad07dccff7221"
    "b8084674f743248ee03590e6813a264c3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364eac5ac8334d3ebc3c581a0fffa1363eb"
    "170ddd51b7f0da49d316552629d4689e2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")


def _secret_words(offset: int, count: int) -> np.ndarray:
    return np.frombuffer(_XXH_SECRET[offset:offset + 8 * count], "<u8").astype(np.uint64)


# Keys per use: [0, 24) stripe s, lane i: word s + i (bytes 8s + 8i); scramble: word 16 + i;
# [24, 32) the last stripe (byte 121); [32, 40) and [40, 48) the low and high merges (11, 117).
_XXH_KEYS = np.concatenate([_secret_words(0, 24), _secret_words(121, 8), _secret_words(11, 8),
                            _secret_words(117, 8)])
_XXH_INIT = np.array([0xC2B2AE3D, 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                      0x85EBCA77C2B2AE63, 0x85EBCA77, 0x27D4EB2F165667C5, 0x9E3779B1], np.uint64)
_XXH_P32_1 = np.uint64(0x9E3779B1)
_XXH_P64_1 = np.uint64(0x9E3779B185EBCA87)
_XXH_P64_2 = np.uint64(0xC2B2AE3D27D4EB4F)
_XXH_MX1 = np.uint64(0x165667919E3779F9)
_LO32 = np.uint64(0xFFFFFFFF)
_U32 = np.uint64(32)
_U37 = np.uint64(37)
_U47 = np.uint64(47)
_XXH_TABLES: list = []  # _XXH_KEYS and _XXH_INIT on the device, uploaded at the first call
_XXH_SHORT = 240  # XXH3 hashes inputs up to this length another way
_WARP = 32


@cuda.jit(device=True)
def _xxh_term(v, key):
    # A lane's own term: the low and high halves of v ^ key multiplied (32 x 32 -> 64 bits).
    k = v ^ key
    return (k & _LO32) * (k >> _U32)


@cuda.jit(device=True)
def _xxh_fold(a, b):
    # The 128-bit product a * b, its halves xored (XXH3's mul128_fold64), from 32-bit halves.
    a0, a1, b0, b1 = a & _LO32, a >> _U32, b & _LO32, b >> _U32
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> _U32) + (p01 & _LO32) + (p10 & _LO32)
    high = p11 + (p01 >> _U32) + (p10 >> _U32) + (mid >> _U32)
    low = (mid << _U32) | (p00 & _LO32)
    return low ^ high


@cuda.jit(device=True)
def _xxh_avalanche(h):
    h ^= h >> _U37
    h *= _XXH_MX1
    return h ^ (h >> _U32)


@cuda.jit(device=True)
def _xxh_block_words(words, w0, b, full, n, group, li):
    # The lane's four words of 1 KiB block b (stripes group, group + 4, ...), zeros past the
    # stripes the block has (the last, partial block); and how many stripes it has.
    stripes = 16 if b < full else ((n - 1) - 1024 * full) // 64
    first = w0 + b * 128 + group * 8 + li
    v0 = words[first] if group < stripes else uint64(0)
    v1 = words[first + 32] if group + 4 < stripes else uint64(0)
    v2 = words[first + 64] if group + 8 < stripes else uint64(0)
    v3 = words[first + 96] if group + 12 < stripes else uint64(0)
    return v0, v1, v2, v3, stripes


@cuda.jit(cache=True)
def _chunk_xxh3(words, raw, nbytes, chunk, keys, init, out):
    sh = cuda.shared.array(0, uint64)  # four words per lane: the round's reads, then sums
    lane = cuda.threadIdx.x
    group, li = lane // 8, lane % 8
    for c in range(cuda.blockIdx.x, out.shape[0], cuda.gridDim.x):
        start = c * chunk
        n = min(chunk, nbytes - start)
        if n <= _XXH_SHORT:
            continue  # the host's (only a last chunk is this short)
        acc = init[li]
        full = (n - 1) // 1024
        w0 = start // 8
        v0, v1, v2, v3, stripes = _xxh_block_words(words, w0, 0, full, n, group, li)
        for b in range(full + 1):
            # The next block's loads are issued before this block's sums: two in flight.
            n0, n1, n2, n3, next_stripes = _xxh_block_words(words, w0, b + 1, full, n, group, li) \
                if b < full else (uint64(0), uint64(0), uint64(0), uint64(0), 0)
            sh[4 * lane] = v0
            sh[4 * lane + 1] = v1
            sh[4 * lane + 2] = v2
            sh[4 * lane + 3] = v3
            cuda.syncthreads()
            mate = 4 * (lane ^ 1)
            part = uint64(0)
            if group < stripes:
                part += _xxh_term(v0, keys[group + li]) + sh[mate]
            if group + 4 < stripes:
                part += _xxh_term(v1, keys[group + 4 + li]) + sh[mate + 1]
            if group + 8 < stripes:
                part += _xxh_term(v2, keys[group + 8 + li]) + sh[mate + 2]
            if group + 12 < stripes:
                part += _xxh_term(v3, keys[group + 12 + li]) + sh[mate + 3]
            cuda.syncthreads()
            sh[lane] = part
            cuda.syncthreads()
            acc += sh[li] + sh[8 + li] + sh[16 + li] + sh[24 + li]
            cuda.syncthreads()
            if b < full:
                acc ^= acc >> _U47
                acc ^= keys[16 + li]
                acc *= _XXH_P32_1
            v0, v1, v2, v3, stripes = n0, n1, n2, n3, next_stripes
        p = start + n - 64 + 8 * li  # the last stripe
        v = uint64(0)
        for j in range(8):
            v |= uint64(raw[p + j]) << uint64(8 * j)
        sh[lane] = v
        cuda.syncthreads()
        acc += _xxh_term(v, keys[24 + li]) + sh[lane ^ 1]
        cuda.syncthreads()
        sh[lane] = acc
        cuda.syncthreads()
        if lane == 0:
            low = uint64(n) * _XXH_P64_1
            high = ~(uint64(n) * _XXH_P64_2)
            for i in range(4):
                a0, a1 = sh[2 * i], sh[2 * i + 1]
                low += _xxh_fold(a0 ^ keys[32 + 2 * i], a1 ^ keys[33 + 2 * i])
                high += _xxh_fold(a0 ^ keys[40 + 2 * i], a1 ^ keys[41 + 2 * i])
            out[c, 0] = _xxh_avalanche(low)
            out[c, 1] = _xxh_avalanche(high)
        cuda.syncthreads()


def chunk_digests(data, chunk: int = DIGEST_CHUNK_BYTES) -> np.ndarray:
    """kernels.cpu.chunk_digests on the device: XXH3-128 of each `chunk` bytes of the array's
    bytes, as host rows of (low, high) uint64. A device array is read where it lives; only a
    last chunk of at most 240 bytes comes to the host. Launch: one warp per block, up to
    MAX_BLOCKS blocks, each taking chunks grid-stride."""
    check_digest_chunk(chunk)
    d = as_bits(as_arg(data))  # on the device: a host array is copied over
    nbytes = d.size * np.dtype(d.dtype).itemsize
    m = -(-nbytes // chunk)
    if m == 0:
        return np.empty((0, 2), np.uint64)
    if address_of(d)[1] % 8:
        copy = cuda.device_array(d.size, d.dtype)  # words need 8-byte alignment: an odd view is copied
        copy.copy_to_device(d)
        d = copy
    raw = d.view(np.uint8)
    words = raw[:nbytes // 8 * 8].view(np.uint64)
    short_tail = nbytes - (m - 1) * chunk <= _XXH_SHORT
    out = np.zeros((m, 2), np.uint64)
    if m > 1 or not short_tail:
        _, _, max_blocks = launch_config()
        d_out = cuda.device_array((m, 2), np.uint64)
        if not _XXH_TABLES:
            _XXH_TABLES.extend((cuda.to_device(_XXH_KEYS), cuda.to_device(_XXH_INIT)))
        keys, init = _XXH_TABLES
        _chunk_xxh3[min(m, max_blocks), _WARP, 0, _WARP * 4 * 8](words, raw, nbytes, chunk, keys, init, d_out)
        out = d_out.copy_to_host()
    if short_tail:
        out[m - 1] = xxh3_leaf(raw[(m - 1) * chunk:].copy_to_host().tobytes())
    return out
