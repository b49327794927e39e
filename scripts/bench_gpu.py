#!/usr/bin/env python
"""GPU benchmark: copy bandwidth, each CUDA kernel's effective bandwidth, and applying a
ctx-rans patch to a 7B-shaped set of BF16 tensors held in GPU memory.

On a machine with an NVIDIA GPU, numba-cuda and a CUDA build of torch:

    python scripts/bench_gpu.py                      # 7B shape, 1% density, 5 repeats
    python scripts/bench_gpu.py --live               # also pulsediff.ops.live.apply_to_state_dict end to end
    python scripts/bench_gpu.py --make               # also pulsediff.make_patch_bytes from CUDA state dicts
    python scripts/bench_gpu.py --tiny               # a few thousand elements: checks the script runs

Prints markdown tables. Every timing is the median of --repeats runs after one warm-up
run (which also compiles the kernels), taken with the device synchronised before and
after (cuda.synchronize + time.perf_counter), so a row is the wall time a caller of
the entry point waits, its small host work and device-to-host reads of counts included.

What is measured:
- copy bandwidth: a device-to-device copy of --copy-mib MiB, reported as (bytes read +
  bytes written) / time like the kernels below; a host-to-device copy from pinned
  memory, reported as bytes copied / time.
- each kernel of pulsediff.kernels.cuda on one BF16 tensor of --elements elements with
  --density of them changed by +-1 ULP, all arrays already on the device (zero-copy:
  Numba device arrays): effective bandwidth = (bytes each kernel must read + bytes it
  must write) / time, the byte counts given in the table, not what the kernel really
  moves (diff_compact reads its inputs twice, for instance).
- the 7B shape (Llama-2-7B: 291 tensors, 6.74e9 BF16 elements, 13.5 GB): the dense
  baseline is `tensor.copy_(pinned_host_tensor)` for every tensor; the patch is applied
  in place from what the ctx-rans decoder hands over after its entropy decode (ranks
  int64 and zigzag deltas uint8 per change, class-major, in pinned host memory):
  their host-to-device copy, `chunk_class_starts` and `apply_ranked` per tensor. The
  entropy decode itself runs on the CPU and is not in this figure (the issue allows it
  to overlap with the device work; docs/BENCHMARKS.md has CPU decode figures). The
  result is checked bit for bit against the expected tensors.
- the same patch applied as `pulsediff.ops.live` does with check="sums" (the default for GPU
  tensors): word sum of the base, class counts, ranked_positions, add_at with its undo
  log, word sum of the target, per tensor.
- the same with `locate_ranked` in place of chunk_class_starts + ranked_positions: the tile
  kernels (two reads of the base, nothing sorted), the path `pulsediff.ops.live` takes now;
  on a real GPU also kernels.class_sort's stable sort of the class keys (torch, CUB), the path
  before them; and the plain-torch baseline of systems that ship raw indices
  and values: int32 positions and BF16 values from pinned memory, H2D, `index_copy_`.
- with --make: `pulsediff.make_patch_bytes(old, new, device="cuda")` from two state dicts in GPU memory, next
  to plain torch's compare (`nonzero(a != b)` and a gather) over the same tensors.
- with --live: `pulsediff.ops.live.apply_to_state_dict(tensors, patch)` on the same tensors
  with a real ctx-rans patch (made with make_patch_bytes from host copies), end to end:
  header and entropy decode on the CPU, everything else on the device.

--tiny: small sizes and blocks, for the Numba CUDA simulator (NUMBA_ENABLE_CUDASIM=1)
as well as a GPU: it checks the script runs and the results are right; its timings mean
nothing and are printed as such.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import alternate, medians  # noqa: E402

SHIFT, MASK = 7, 255  # BF16's exponent field: ctx-rans' class


def llama_7b_shapes(vocab=32000, hidden=4096, inter=11008, layers=32) -> list[tuple[str, tuple[int, ...]]]:
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + f"self_attn.{x}_proj.weight", (hidden, hidden)) for x in "qkvo"]
        shapes += [(p + "mlp.gate_proj.weight", (inter, hidden)), (p + "mlp.up_proj.weight", (inter, hidden)),
                   (p + "mlp.down_proj.weight", (hidden, inter)),
                   (p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,))]
    return shapes + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


# --- timing ------------------------------------------------------------------------------


def sync():
    from numba import cuda

    cuda.synchronize()


def timed(fn, repeats: int, setup=None) -> float:
    """Median seconds of fn() over `repeats` runs after one warm-up (benchlib.alternate with one case);
    setup() runs untimed before each, and the device is synchronised before and after each run."""
    def prepared():
        if setup:
            setup()
        sync()

    def run(_):
        fn()
        sync()

    return medians(alternate({"fn": run}, repeats, setup=prepared))["fn"]


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


def gbps(nbytes: float, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.1f}" if seconds > 0 else "-"


# --- inputs ------------------------------------------------------------------------------


def bf16_pool(rng, n: int) -> np.ndarray:
    """BF16 bit patterns of N(0, 0.02) weights (what an LLM's matrices look like)."""
    return ((rng.standard_normal(n) * 0.02).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def take(pool: np.ndarray, start: int, n: int) -> np.ndarray:
    """n consecutive elements of the pool (at least n long), from an offset that moves with
    `start`: cheap, distinct-looking tensors."""
    s = start % (pool.size - n + 1)
    return pool[s:s + n].copy()


def sparse_positions(rng, n: int, density: float) -> np.ndarray:
    """Ascending positions at `density`, from geometric gaps (no pass over all n elements)."""
    if n == 0 or density <= 0:
        return np.empty(0, np.int64)
    want = int(n * density * 1.2) + 16
    pos = np.cumsum(rng.geometric(density, want)) - 1
    while pos[-1] < n:  # rarely: more gaps needed
        pos = np.concatenate([pos, pos[-1] + np.cumsum(rng.geometric(density, want))])
    return pos[pos < n].astype(np.int64)


def plus_minus_one(rng, m: int) -> tuple[np.ndarray, np.ndarray]:
    """+-1 ULP changes: signed deltas (int64) and their zigzag codes (uint8: 2 for +1, 1 for -1)."""
    up = rng.random(m) < 0.5
    return np.where(up, 1, -1).astype(np.int64), np.where(up, 2, 1).astype(np.uint8)


def apply_deltas(bits: np.ndarray, positions: np.ndarray, deltas: np.ndarray) -> np.ndarray:
    out = bits.copy()
    out[positions] = (bits[positions].astype(np.int64) + deltas).astype(np.uint16)  # modulo 2**16
    return out


def class_major(classes: np.ndarray, ranks: np.ndarray, zigzag: np.ndarray):
    """What ctx-rans decode hands apply_ranked: offsets per class, ranks and deltas grouped by class."""
    order = np.argsort(classes, kind="stable")
    offsets = np.zeros(MASK + 2, np.int64)
    np.cumsum(np.bincount(classes, minlength=MASK + 1), out=offsets[1:])
    return offsets, np.ascontiguousarray(ranks[order]), np.ascontiguousarray(zigzag[order])


# --- where the tensors live ----------------------------------------------------------------


def pinned_numpy(a: np.ndarray) -> np.ndarray:
    from numba import cuda

    p = cuda.pinned_array(a.shape, a.dtype)
    p[...] = a
    return p


class NumbaArrays:
    """Numba device arrays of uint16 bits (also what runs under the simulator)."""

    what = "Numba device arrays (uint16 bits)"
    dense_copy = "dense copy from pinned host memory (Numba `copy_to_device`: no torch CUDA here)"

    def to_device(self, bits: np.ndarray):
        from numba import cuda

        return cuda.to_device(bits)

    def pinned(self, bits: np.ndarray):
        return pinned_numpy(bits)

    def host_bits(self, pinned) -> np.ndarray:
        return pinned.reshape(-1)

    def upload(self, dst, pinned) -> None:
        dst.copy_to_device(pinned)

    def to_host(self, d) -> np.ndarray:
        return d.copy_to_host().reshape(-1)


class TorchTensors:
    """torch CUDA tensors of dtype bfloat16, passed to the kernels as they are (zero-copy)."""

    what = "torch CUDA tensors (bfloat16)"
    dense_copy = "dense `tensor.copy_()` from pinned host memory"

    def __init__(self):
        import torch

        self.torch = torch

    def to_device(self, bits: np.ndarray):
        return self.torch.from_numpy(bits.view(np.int16)).view(self.torch.bfloat16).cuda()

    def pinned(self, bits: np.ndarray):
        return self.torch.from_numpy(bits.view(np.int16)).view(self.torch.bfloat16).pin_memory()

    def host_bits(self, pinned) -> np.ndarray:
        return pinned.view(self.torch.int16).numpy().view(np.uint16).reshape(-1)

    def upload(self, dst, pinned) -> None:
        dst.copy_(pinned, non_blocking=True)

    def to_host(self, t) -> np.ndarray:
        return t.view(self.torch.int16).cpu().numpy().view(np.uint16).reshape(-1)


# --- the benchmarks --------------------------------------------------------------------------


def copy_bandwidth(mib: float, repeats: int) -> list[list[str]]:
    from numba import cuda

    nbytes = int(mib * 2**20)
    src = cuda.to_device(np.ones(nbytes, np.uint8))
    dst = cuda.device_array(nbytes, np.uint8)
    host = cuda.pinned_array(nbytes, np.uint8)
    host[:] = 1
    d2d = timed(lambda: dst.copy_to_device(src), repeats)
    h2d = timed(lambda: dst.copy_to_device(host), repeats)
    return [["device-to-device copy", f"{2 * nbytes:,} (read + write)", f"{d2d * 1e3:.3f}", gbps(2 * nbytes, d2d)],
            ["pinned host-to-device copy", f"{nbytes:,} (copied)", f"{h2d * 1e3:.3f}", gbps(nbytes, h2d)]]


def kernel_bandwidth(n: int, density: float, repeats: int, rng) -> tuple[list[list[str]], bool]:
    from numba import cuda

    from pulsediff.kernels import cuda as K

    old = bf16_pool(rng, n)
    positions = sparse_positions(rng, n, density)
    deltas, zigzag = plus_minus_one(rng, positions.size)
    new = apply_deltas(old, positions, deltas)
    m, w = positions.size, 2
    d_old, d_new = cuda.to_device(old), cuda.to_device(new)
    d_work = cuda.device_array_like(old)
    restore = lambda: d_work.copy_to_device(d_old)  # noqa: E731

    rows, ok = [], True

    def row(name, fn, read, written, setup=None):
        t = timed(fn, repeats, setup)
        rows.append([name, f"{read:,}", f"{written:,}", f"{t * 1e3:.3f}", gbps(read + written, t)])

    d_pos, d_vals = K.diff_compact(d_old, d_new)
    ok &= np.array_equal(d_pos.copy_to_host(), positions)
    row("diff_compact", lambda: K.diff_compact(d_old, d_new), 2 * n * w, m * (8 + w))
    row("scatter", lambda: K.scatter(d_work, d_pos, d_vals), m * (8 + w), m * w, restore)
    ok &= np.array_equal(d_work.copy_to_host(), new)
    d_gaps = cuda.to_device(np.diff(positions, prepend=-1).astype(np.uint32))
    row("gaps_to_positions (uint32 gaps)", lambda: K.gaps_to_positions(d_gaps), m * 4, m * 8)
    starts, sizes = K.chunk_class_starts(d_old, SHIFT, MASK)
    row("chunk_class_starts", lambda: K.chunk_class_starts(d_old, SHIFT, MASK), n * w,
        starts.shape[0] * starts.shape[1] * 8)
    ranks, _ = K.class_ranks(d_old, SHIFT, MASK, d_pos)
    row("class_ranks", lambda: K.class_ranks(d_old, SHIFT, MASK, d_pos), n * w + m * (8 + w), m * 8)
    classes = (old[positions].astype(np.int64) >> SHIFT) & MASK
    offsets, ranks_cm, zig_cm = class_major(classes, ranks.copy_to_host(), zigzag)
    d_offsets, d_ranks, d_zig = cuda.to_device(offsets), cuda.to_device(ranks_cm), cuda.to_device(zig_cm)
    d_out = cuda.device_array_like(old)
    row("apply_ranked into a new tensor", lambda: K.apply_ranked(d_old, SHIFT, MASK, starts, d_offsets, d_ranks,
                                                                 d_zig, d_out), n * w + m * 9, n * w)
    ok &= np.array_equal(d_out.copy_to_host(), new)
    row("apply_ranked in place", lambda: K.apply_ranked(d_work, SHIFT, MASK, starts, d_offsets, d_ranks, d_zig,
                                                        d_work), n * w + m * 9, m * w, restore)
    ok &= np.array_equal(d_work.copy_to_host(), new)
    # The live path (check="sums"): word sums before and after, positions, then the in-place add.
    row("word_sum", lambda: K.word_sum(d_old), n * w, 0)
    where, found = K.ranked_positions(d_old, SHIFT, MASK, starts, d_offsets, d_ranks)
    ok &= found == m and np.array_equal(np.sort(where.copy_to_host()), positions)
    row("ranked_positions", lambda: K.ranked_positions(d_old, SHIFT, MASK, starts, d_offsets, d_ranks),
        n * w + m * 8, m * 8)
    row("add_at (with the undo log)", lambda: K.add_at(d_work, where, d_zig), m * (8 + 1 + w), m * 2 * w, restore)
    ok &= np.array_equal(d_work.copy_to_host(), new)
    # What live apply runs now: class sizes and positions together, by tiles (two reads of the base,
    # nothing sorted); and the stable sort of kernels.class_sort it replaced (a real GPU only).
    path = "class sort" if K.tiles.sort_on_gpu(d_old) else "walk"
    where2, found2, _ = K.locate_ranked(d_old, SHIFT, MASK, offsets, d_ranks)
    ok &= found2 == m and np.array_equal(_host(where2), _host(where))
    row("locate_ranked (tiles: two reads of the base)", lambda: K.locate_ranked(d_old, SHIFT, MASK, offsets, d_ranks),
        n * w + m * 8, m * 8)
    if path == "class sort":
        where3, found3 = class_sorted(d_old, offsets, d_ranks)
        ok &= found3 == m and np.array_equal(_host(where3), _host(where))
        row("locate_ranked (class sort)", lambda: class_sorted(d_old, offsets, d_ranks), n * w + m * 8, m * 8)
    row(f"diff_ranks ({path if path == 'class sort' else 'compact + class_ranks + gather'})",
        lambda: K.diff_ranks(d_old, d_new, SHIFT, MASK), 2 * n * w, m * (w + 2 + 8))
    zz, cls, rk, _ = K.diff_ranks(d_old, d_new, SHIFT, MASK)
    ok &= np.array_equal(_host(rk), ranks.copy_to_host())
    # The class sort's keys in one fused kernel (issue 32: 2 B in, 1 B out for BF16).
    d_keys = cuda.device_array(n, np.uint8)
    K.class_keys(d_old, SHIFT, MASK, d_keys)
    ok &= np.array_equal(d_keys.copy_to_host(), ((old.astype(np.int64) >> SHIFT) & MASK).astype(np.uint8))
    row("class_keys (fused)", lambda: K.class_keys(d_old, SHIFT, MASK, d_keys), n * w, n)
    # The parallel digest's leaves (issue 32): XXH3-128 of each chunk, a warp per chunk.
    from pulsediff.kernels import cpu as C

    ok &= np.array_equal(K.chunk_digests(d_old), C.chunk_digests(old))
    row(f"chunk_digests (XXH3-128 per {C.DIGEST_CHUNK_BYTES >> 10} KiB)", lambda: K.chunk_digests(d_old),
        n * w, -(-n * w // C.DIGEST_CHUNK_BYTES) * 16)
    return rows, bool(ok)


def class_sorted(base, offsets, ranks):
    """kernels.class_sort's locate (CUB's radix sort through torch): the real-GPU path before the tiles."""
    from pulsediff.kernels import class_sort
    from pulsediff.kernels import cuda as K

    where, found, _ = class_sort.locate_ranked(K.tiles.torch_of(base), SHIFT, MASK, offsets, K.tiles.torch_of(ranks),
                                               keys_of=K.tiles.torch_class_keys)
    return K.common.as_cuda_array(where), found


def _host(a) -> np.ndarray:
    return a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a)


@dataclass
class Tensor:
    name: str
    shape: tuple
    dev: object  # on the device, patched in place
    dense: object  # pinned host copy of the base: the dense baseline's source, and the restore
    expected: np.ndarray  # the target's bits
    offsets: np.ndarray
    h_ranks: np.ndarray  # pinned: what the entropy decoder hands over
    h_zigzag: np.ndarray
    d_ranks: object  # the device buffers they are copied into
    d_zigzag: object


def model_apply(shapes, arrays, density: float, repeats: int, rng, live: bool) -> tuple[list[list[str]], bool, dict, list]:
    from numba import cuda

    from pulsediff.kernels import cuda as K

    total = sum(int(np.prod(s)) for _, s in shapes)
    pool = bf16_pool(rng, max(int(np.prod(s)) for _, s in shapes) + 4096)
    tensors, start, changes = [], 0, 0
    for name, shape in shapes:
        n = int(np.prod(shape))
        bits = take(pool, start, n)
        start += n + 977
        positions = sparse_positions(rng, n, density)
        deltas, zigzag = plus_minus_one(rng, positions.size)
        dev = arrays.to_device(bits.reshape(shape))
        ranks, _ = K.class_ranks(dev, SHIFT, MASK, cuda.to_device(positions))  # as make computes them, on the device
        classes = (bits[positions].astype(np.int64) >> SHIFT) & MASK
        offsets, ranks_cm, zig_cm = class_major(classes, ranks.copy_to_host(), zigzag)
        tensors.append(Tensor(name, shape, dev, arrays.pinned(bits.reshape(shape)),
                              apply_deltas(bits, positions, deltas), offsets, pinned_numpy(ranks_cm),
                              pinned_numpy(zig_cm), cuda.device_array(ranks_cm.size, np.int64),
                              cuda.device_array(zig_cm.size, np.uint8)))
        changes += positions.size

    def dense():
        for t in tensors:
            arrays.upload(t.dev, t.dense)

    applied = [0]

    def patch(upload=True):
        applied[0] = 0
        for t in tensors:
            if upload:
                t.d_ranks.copy_to_device(t.h_ranks)
                t.d_zigzag.copy_to_device(t.h_zigzag)
            starts, _ = K.chunk_class_starts(t.dev, SHIFT, MASK)
            applied[0] += K.apply_ranked(t.dev, SHIFT, MASK, starts, t.offsets, t.d_ranks, t.d_zigzag, t.dev)

    def walk_positions(t):
        starts, _ = K.chunk_class_starts(t.dev, SHIFT, MASK)
        return K.ranked_positions(t.dev, SHIFT, MASK, starts, t.offsets, t.d_ranks)

    def located_positions(t):  # class sizes and positions in one call (by tiles)
        where, found, _ = K.locate_ranked(t.dev, SHIFT, MASK, t.offsets, t.d_ranks)
        return where, found

    def sorted_positions(t):  # the same by kernels.class_sort (a real GPU only)
        return class_sorted(t.dev, t.offsets, t.d_ranks)

    def checked(positions):
        # What pulsediff.ops.live's check="sums" runs per tensor after the entropy decode: the base's
        # word sum, the class sizes and positions, the add with its undo log, the target's sum.
        def run():
            applied[0] = 0
            for t in tensors:
                t.d_ranks.copy_to_device(t.h_ranks)
                t.d_zigzag.copy_to_device(t.h_zigzag)
                K.word_sum(t.dev)
                where, found = positions(t)
                K.add_at(t.dev, where, t.d_zigzag)
                K.word_sum(t.dev)
                applied[0] += found
        return run

    t_dense = timed(dense, repeats)
    t_patch = timed(patch, repeats, setup=dense)
    t_kernels = timed(lambda: patch(upload=False), repeats, setup=dense)  # the entries stay where patch put them
    ok = applied[0] == changes and all(np.array_equal(arrays.to_host(t.dev), t.expected) for t in tensors)
    t_checked = timed(checked(walk_positions), repeats, setup=dense)
    ok &= applied[0] == changes and all(np.array_equal(arrays.to_host(t.dev), t.expected) for t in tensors)
    t_located = timed(checked(located_positions), repeats, setup=dense)
    ok &= applied[0] == changes and all(np.array_equal(arrays.to_host(t.dev), t.expected) for t in tensors)
    t_sorted = None
    if isinstance(arrays, TorchTensors):
        t_sorted = timed(checked(sorted_positions), repeats, setup=dense)
        ok &= applied[0] == changes and all(np.array_equal(arrays.to_host(t.dev), t.expected) for t in tensors)
    baseline = torch_index_copy_baseline(tensors, arrays, repeats) if isinstance(arrays, TorchTensors) else None
    nbytes = 2 * total
    rows = [[arrays.dense_copy, f"{nbytes:,}", f"{t_dense * 1e3:.1f}", gbps(nbytes, t_dense),
             "1.00"],
            ["patch: H2D of the decoded entries + chunk_class_starts + apply_ranked in place",
             f"{changes * 9:,}", f"{t_patch * 1e3:.1f}", gbps(nbytes, t_patch), f"{t_dense / t_patch:.2f}"],
            ["same, kernels only (entries already on the device)", "0", f"{t_kernels * 1e3:.1f}",
             gbps(nbytes, t_kernels), f"{t_dense / t_kernels:.2f}"],
            ["checked as live apply does: H2D + word_sum + chunk_class_starts + ranked_positions + add_at + word_sum",
             f"{changes * 9:,}", f"{t_checked * 1e3:.1f}", gbps(nbytes, t_checked), f"{t_dense / t_checked:.2f}"],
            ["the same with locate_ranked (class sizes and positions in one call, by tiles: what live apply runs)",
             f"{changes * 9:,}", f"{t_located * 1e3:.1f}", gbps(nbytes, t_located), f"{t_dense / t_located:.2f}"]]
    if t_sorted is not None:
        rows.append(["the same with kernels.class_sort's stable sort (the path before the tiles)",
                     f"{changes * 9:,}", f"{t_sorted * 1e3:.1f}", gbps(nbytes, t_sorted), f"{t_dense / t_sorted:.2f}"])
    if baseline is not None:
        t_base, moved = baseline
        rows.append(["plain torch baseline: int32 indices + bf16 values H2D from pinned memory, then index_copy_",
                     f"{moved:,}", f"{t_base * 1e3:.1f}", gbps(nbytes, t_base), f"{t_dense / t_base:.2f}"])
    info = {"tensors": len(shapes), "elements": total, "changes": changes}
    if live:
        rows.append(live_apply(tensors, arrays, repeats, info))
        ok &= info["live_ok"]
    return rows, bool(ok), info, tensors


def torch_index_copy_baseline(tensors, arrays, repeats: int) -> tuple[float, int]:
    """What systems that ship raw indices and values do (vLLM's sparse updates: index_copy_):
    int32 positions and BF16 values in pinned memory, copied over and scattered per tensor."""
    import torch

    staged = []
    for t in tensors:
        target = torch.from_numpy(t.expected.view(np.int16))
        base = torch.from_numpy(arrays.host_bits(t.dense).reshape(-1).view(np.int16))
        idx = torch.nonzero(target != base).squeeze(1)
        staged.append((t, idx.to(torch.int32).pin_memory(), target[idx].pin_memory()))

    def run():
        for t, idx, vals in staged:
            flat = t.dev.view(-1).view(torch.int16)
            flat.index_copy_(0, idx.to("cuda", non_blocking=True).long(), vals.to("cuda", non_blocking=True))

    seconds = timed(run, repeats, setup=lambda: [t.dev.copy_(t.dense) for t in tensors])
    ok = all(np.array_equal(arrays.to_host(t.dev), t.expected) for t in tensors)
    if not ok:
        raise SystemExit("index_copy_ baseline did not rebuild the target")
    return seconds, sum(idx.numel() * 6 for _, idx, _ in staged)


class DeviceMemoryPeak:
    """The device's least free memory while the block runs, sampled every 2 ms on a thread of its
    own (torch.cuda.mem_get_info: the whole device, so Numba's allocations count as torch's do):
    `extra` is the peak it took beyond what was in use when the block began."""

    def __enter__(self):
        import threading

        import torch

        self._torch, self._stop = torch, threading.Event()
        self.before = self.least = torch.cuda.mem_get_info()[0]
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.least = min(self.least, self._torch.cuda.mem_get_info()[0])

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.least = min(self.least, self._torch.cuda.mem_get_info()[0])
        self.extra = self.before - self.least


def make_from_state_dicts(tensors, arrays, repeats: int, info: dict) -> list[list[str]]:
    """pulsediff.make_patch_bytes from two state dicts in GPU memory (format 1.4's tree hashes: every
    tensor hashed, summed and compared on the device, only the changes brought over), next to
    plain torch's compare (`nonzero(a != b)` and a gather of the new values) over the same tensors;
    with the peak extra device memory make took."""
    import torch

    from pulsediff.ops.make import make_patch_bytes

    old = {t.name: t.dev for t in tensors}
    new = {t.name: torch.from_numpy(t.expected.view(np.int16).reshape(t.shape)).view(torch.bfloat16).cuda()
           for t in tensors}
    for t in tensors:
        t.dev.copy_(t.dense)

    def compare():
        for name in old:
            a, b = old[name].view(-1).view(torch.int16), new[name].view(-1).view(torch.int16)
            idx = torch.nonzero(a != b).squeeze(1)
            b[idx]

    t_compare = timed(compare, repeats)
    # One run: at today's speed a 7B make takes tens of seconds, and the lease is minutes. The
    # kernels are warm from the rows before (--live made a patch from host copies already).
    sync()
    with DeviceMemoryPeak() as peak:
        start = time.perf_counter()
        patch = make_patch_bytes(old, new, device="cuda")
        sync()
        t_make = time.perf_counter() - start
    same = info.get("patch")
    info["make_ok"] = same is None or patch == same  # the same tensors on the host made this patch
    nbytes = 4 * info["elements"]
    check = "" if same is None else (", byte-identical to the patch made from host copies" if patch == same
                                     else ", DIFFERENT from the patch made from host copies")
    return [[f"`pulsediff.make_patch_bytes` from two CUDA state dicts ({len(patch):,}-byte patch{check}), one run; "
             f"peak extra device memory {peak.extra / 2**20:,.0f} MiB", f"{t_make * 1e3:.1f}", gbps(nbytes, t_make)],
            ["plain torch: nonzero(a != b) + gather of the new values, every tensor", f"{t_compare * 1e3:.1f}",
             gbps(nbytes, t_compare)]]


def model_digest(tensors, arrays, repeats: int) -> tuple[list[list[str]], bool]:
    """format.digest.tree_hash (format 1.4's tensor hash) of every tensor where it
    lives, one tensor after another (a launch each), against the same of the host's copies."""
    from pulsediff.format.digest import tree_hash
    from pulsediff.kernels import cuda as K

    device = [tree_hash(t.dev, K) for t in tensors]
    ok = device == [tree_hash(arrays.to_host(t.dev)) for t in tensors]
    seconds = timed(lambda: [tree_hash(t.dev, K) for t in tensors], repeats)
    nbytes = sum(t.expected.nbytes for t in tensors)
    return [[f"tree_hash of every tensor on the device ({len(tensors)} launches)", f"{seconds * 1e3:.1f}",
             gbps(nbytes, seconds)]], ok


def live_apply(tensors, arrays, repeats: int, info: dict) -> list[str]:
    """pulsediff.ops.live.apply_to_state_dict end to end, with a real ctx-rans patch."""
    import torch

    from pulsediff.ops.live import apply_to_state_dict
    from pulsediff.ops.make import make_patch_bytes

    def host(bits, shape):
        return torch.from_numpy(bits.view(np.int16).reshape(shape)).view(torch.bfloat16)

    old = {t.name: host(arrays.host_bits(t.dense), t.shape) for t in tensors}
    new = {t.name: host(t.expected, t.shape) for t in tensors}
    patch = make_patch_bytes(old, new, device="cpu")  # the CPU's patch: the one make on the device must equal
    info["patch"] = patch
    if isinstance(arrays, TorchTensors):
        live = {t.name: t.dev for t in tensors}
        restore = lambda: [t.dev.copy_(t.dense) for t in tensors]  # noqa: E731
    else:  # no torch CUDA here (the simulator): torch CPU tensors through the CUDA kernels
        live = {name: o.clone() for name, o in old.items()}
        restore = lambda: [live[n].copy_(old[n]) for n in live]  # noqa: E731
    seconds = timed(lambda: apply_to_state_dict(live, patch), repeats, setup=restore)
    info["live_ok"] = all(np.array_equal(live[t.name].view(torch.int16).cpu().numpy().view(np.uint16).reshape(-1),
                                         t.expected) for t in tensors)
    nbytes = 2 * info["elements"]
    return [f"`pulsediff.ops.live.apply_to_state_dict` end to end, ctx-rans patch file of {len(patch):,} bytes", "-",
            f"{seconds * 1e3:.1f}", gbps(nbytes, seconds), "-"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", type=int, default=1 << 27, help="elements of the kernel benchmark's tensor")
    ap.add_argument("--density", type=float, default=0.01, help="fraction of elements changed")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--copy-mib", type=float, default=1024.0, help="MiB copied for the copy bandwidth")
    ap.add_argument("--model", choices=["7b", "none"], default="7b")
    ap.add_argument("--live", action="store_true", help="also time pulsediff.ops.live.apply_to_state_dict")
    ap.add_argument("--make", action="store_true",
                    help="also time pulsediff.make_patch_bytes from two CUDA state dicts (needs torch with CUDA)")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes and blocks: a run that checks the script")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from numba import config, cuda

    simulated = bool(config.ENABLE_CUDASIM)
    if not cuda.is_available():
        print("no usable CUDA device (to try the script without one: NUMBA_ENABLE_CUDASIM=1 ... --tiny)",
              file=sys.stderr)
        return 2
    if simulated and not args.tiny:
        print("the Numba CUDA simulator measures nothing: use --tiny to check the script", file=sys.stderr)
        return 2
    from pulsediff.kernels import cuda as K

    shapes = llama_7b_shapes()
    if args.tiny:
        # Blocks of 8 threads: tiny tensors still span many ranges and blocks.
        K.common.THREADS_PER_BLOCK, K.common.ITEMS_PER_THREAD, K.common.MAX_BLOCKS = 8, 2, 4
        args.elements, args.copy_mib, args.repeats = 300, 0.01, 1
        args.density = max(args.density, 0.05)
        args.live = True
        # One tensor of each kind, of a toy size: the simulator's cost is per kernel call.
        keep = ("embed_tokens", "q_proj", "down_proj", "input_layernorm", "lm_head")
        shapes = [(n, s) for n, s in llama_7b_shapes(vocab=24, hidden=8, inter=12, layers=1)
                  if any(k in n for k in keep)]
        sys.setswitchinterval(1e-4)  # the simulator's barriers poll: a short GIL interval makes them fast
    try:
        import torch

        use_torch = bool(torch.cuda.is_available()) and not simulated
    except ImportError:
        use_torch = False
    arrays = TorchTensors() if use_torch else NumbaArrays()
    rng = np.random.default_rng(args.seed)

    device = "Numba CUDA simulator (no GPU: timings mean nothing)" if simulated else cuda.get_current_device().name
    if isinstance(device, bytes):
        device = device.decode()
    print(f"## pulsediff GPU benchmark: {device}\n")
    print(f"launch: {K.common.THREADS_PER_BLOCK} threads x {K.common.ITEMS_PER_THREAD} items per block, at most "
          f"{K.common.MAX_BLOCKS} blocks; tensors as {arrays.what}; medians of {args.repeats} after a warm-up")

    table("Copy bandwidth", ["what", "bytes", "ms", "GB/s"], copy_bandwidth(args.copy_mib, args.repeats))
    rows, ok = kernel_bandwidth(args.elements, args.density, args.repeats, rng)
    table(f"Kernels on one BF16 tensor of {args.elements:,} elements, {args.density:.0%} changed "
          "(effective GB/s = (read + written) / time)", ["what", "bytes read", "bytes written", "ms", "GB/s"], rows)
    print(f"\nkernel results bit for bit: {'yes' if ok else 'NO'}")
    if args.model != "none":
        rows, model_ok, info, model_tensors = model_apply(shapes, arrays, args.density, args.repeats, rng, args.live)
        shape_name = "a toy model (--tiny)" if args.tiny else "a 7B-shaped model"
        table(f"Applying a {args.density:.0%} patch to {shape_name} in GPU memory ({info['tensors']} tensors, "
              f"{info['elements']:,} BF16 elements, {info['changes']:,} changes)",
              ["what", "bytes moved host to device", "ms", "GB/s of weights", "x dense"], rows)
        print(f"\npatched tensors bit for bit: {'yes' if model_ok else 'NO'}")
        ok &= model_ok
        rows, digest_ok = model_digest(model_tensors, arrays, args.repeats)
        table(f"The 1.4 tensor hash of {shape_name} where it lives", ["what", "ms", "GB/s of weights"], rows)
        print(f"\ndevice tree hashes equal the host's: {'yes' if digest_ok else 'NO'}")
        ok &= digest_ok
        if args.make and isinstance(arrays, TorchTensors):
            rows = make_from_state_dicts(model_tensors, arrays, args.repeats, info)
            table(f"Making the patch from two CUDA state dicts ({shape_name})", ["what", "ms", "GB/s of both models"],
                  rows)
            ok &= info["make_ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
