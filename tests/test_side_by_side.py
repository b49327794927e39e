"""apply rebuilding small tensors side by side on the worker threads (apply._SideBySide).

Each tensor of at most WINDOW_ELEMENTS is rebuilt on one worker thread with
Codec.decode_alone while others are rebuilt on the other threads and the
writer writes the one before; larger tensors keep the windowed rebuild. The
output must be the same bytes whichever way a tensor went, and a failure in
one rebuild must leave no output and no rebuild still running.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

import pulsediff.ops.apply as apply_mod
import pulsediff.ops.rebuild as rebuild_mod
from ckpt_factory import mutate, random_tensor, save
from pulsediff import apply_patch, make_patch
from pulsediff.ops.apply import apply_chain
from pulsediff.codecs import ctx_rans_batch, get_codec
from pulsediff.codecs.base import SectionContext
from pulsediff.io.dtypes import DTYPES
from pulsediff.errors import CorruptPatchError
from pulsediff.kernels import cpu
from pulsediff.io.memory import Scratch


@pytest.fixture
def three_threads(monkeypatch):
    monkeypatch.setenv("PULSEDIFF_THREADS", "3")
    monkeypatch.setattr(rebuild_mod, "WINDOW_ELEMENTS", 3000)  # tensors above this: the windowed rebuild


def many_tensors(rng, steps: int, densities=(0.2, 0.03)):
    """A checkpoint of small tensors of every kind (rebuilt side by side) and two above the window;
    step k changes a fraction densities[k % len(densities)] of each tensor."""
    t = {f"w{i}": random_tensor(rng, dtype, shape) for i, (dtype, shape) in enumerate(
        [("BF16", (40, 50)), ("F32", (700,)), ("F16", (30, 30)), ("BF16", (1,)), ("I64", (9,)),
         ("BF16", (100, 90)), ("F32", (5000,)), ("BF16", (20, 20)), ("F8_E4M3", (300,)), ("BF16", (64, 40))])}
    states = [t]
    for k in range(steps):
        t = {name: mutate(rng, x, densities[k % len(densities)]) for name, x in t.items()}
        states.append(t)
    return states


def chain_of(tmp_path, states) -> tuple[list, list]:
    """The states saved as checkpoints, and a patch from each to the next."""
    paths = [save(s, tmp_path / f"s{k}.safetensors") for k, s in enumerate(states)]
    patches = [tmp_path / f"p{k}.pulsediff" for k in range(len(states) - 1)]
    for k, patch in enumerate(patches):
        make_patch(paths[k], paths[k + 1], patch, device="cpu")
    return paths, patches


def chain_windows_results(monkeypatch) -> list:
    """What rebuild.chain_windows returns from now on, tensor by tensor (Windows or Rebuild)."""
    seen, real = [], apply_mod.chain_windows
    monkeypatch.setattr(apply_mod, "chain_windows", lambda *a: seen.append(r := real(*a)) or r)
    return seen


@pytest.mark.parametrize("codec", ["ctx-rans", "gap-zstd"])
def test_side_by_side_apply_writes_the_target(tmp_path, three_threads, codec):
    rng = np.random.default_rng(3)
    old, new = (save(s, tmp_path / f"s{k}.safetensors") for k, s in enumerate(many_tensors(rng, 1)))
    patch = tmp_path / "p.pulsediff"
    make_patch(old, new, patch, codec=codec, device="cpu")
    out = tmp_path / "out.safetensors"
    apply_patch(old, patch, out, device="cpu")
    assert out.read_bytes() == new.read_bytes()


def test_side_by_side_chain_writes_the_target(tmp_path, three_threads):
    """A chain (random access): each tensor carried through every link on one worker thread."""
    paths, patches = chain_of(tmp_path, many_tensors(np.random.default_rng(4), 3))
    out = tmp_path / "out.safetensors"
    apply_chain(paths[0], patches, out, device="cpu")
    assert out.read_bytes() == paths[-1].read_bytes()


def test_a_damaged_tensor_rebuilt_side_by_side_writes_nothing_and_leaves_no_rebuild_running(
        tmp_path, three_threads, monkeypatch):
    rng = np.random.default_rng(5)
    old, new = (save(s, tmp_path / f"s{k}.safetensors") for k, s in enumerate(many_tensors(rng, 1)))
    patch = tmp_path / "p.pulsediff"
    make_patch(old, new, patch, device="cpu")
    real = rebuild_mod.rebuild_tensor
    running, threads_seen = [], set()

    def slow_or_failing(rec, payload, base_bits, backend, source, scratch, alone=False, base_hash=None):
        running.append(rec.name)
        threads_seen.add(threading.current_thread().name)
        try:
            if rec.name == "w7":
                raise CorruptPatchError(source, f"tensor {rec.name!r}: forced")
            return real(rec, payload, base_bits, backend, source, scratch, alone, base_hash)
        finally:
            running.remove(rec.name)

    monkeypatch.setattr(rebuild_mod, "rebuild_tensor", slow_or_failing)
    # the per-tensor rebuilds side by side (batches of small ctx-rans tensors: test_ctx_rans_batch.py)
    monkeypatch.setattr(ctx_rans_batch, "BATCH_MAX_NUMEL", -1)
    out = tmp_path / "out.safetensors"
    with pytest.raises(CorruptPatchError, match="forced"):
        apply_patch(old, patch, out, device="cpu")
    assert not running  # every rebuild had finished when apply returned (the base unmaps next)
    assert any(name.startswith("pulsediff") for name in threads_seen)  # they did run on worker threads
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["p.pulsediff", "s0.safetensors",
                                                                               "s1.safetensors"]


@pytest.mark.parametrize("name,dtype,density", [("BF16", np.uint16, 0.02), ("BF16", np.uint16, 1.0),
                                                ("F32", np.uint32, 0.3), ("F8_E4M3", np.uint8, 0.1),
                                                ("I64", np.uint64, 0.05)])
def test_ctx_rans_decode_alone_matches_decode(name, dtype, density):
    rng = np.random.default_rng(int(density * 100))
    n = 70_001
    base = rng.integers(0, np.iinfo(dtype).max, n, dtype=dtype, endpoint=True)
    target = base.copy()
    hit = rng.random(n) < density
    target[hit] += rng.integers(1, 5, int(hit.sum())).astype(dtype)
    codec = get_codec("ctx-rans")
    _, enc = codec.encode_pair(base, target, dtype=DTYPES[name], kernels=cpu)
    payload, ctx = b"".join(enc.parts), SectionContext("t", n, base.itemsize, "test")
    alone = codec.decode_alone(base, payload, enc.params, ctx, cpu, Scratch())
    assert np.array_equal(alone, target)
    assert np.array_equal(alone, codec.decode(base, payload, enc.params, ctx, cpu, Scratch()))
    in_place = base.copy()  # a chain decodes onto the previous link's output, in its own buffer
    scratch = Scratch()
    scratch.take(n, in_place.dtype)[:] = in_place
    assert np.array_equal(codec.decode_alone(scratch.take(n, in_place.dtype), payload, enc.params, ctx, cpu, scratch),
                          target)



@pytest.mark.parametrize("threads", ["1", "3"])
def test_a_chain_rebuilds_large_tensors_window_by_window(tmp_path, monkeypatch, threads):
    """Tensors above the window go through every link window by window (rebuild.chain_windows):
    the output is the target's bytes, and the links' windows, not whole tensors, are in memory."""
    monkeypatch.setenv("PULSEDIFF_THREADS", threads)
    monkeypatch.setattr(rebuild_mod, "WINDOW_ELEMENTS", 300)
    rng = np.random.default_rng(6)
    states = many_tensors(rng, 3, densities=(0.02,))  # sparse links: the windowed way holds less
    states[2] = {**states[2], "w5": states[1]["w5"]}  # a link that keeps a large tensor as it is ("same")
    paths, patches = chain_of(tmp_path, states)
    seen = chain_windows_results(monkeypatch)
    out = tmp_path / "out.safetensors"
    apply_chain(paths[0], patches, out, device="cpu")
    assert out.read_bytes() == paths[-1].read_bytes()
    assert sum(isinstance(r, rebuild_mod.Windows) for r in seen) >= 2  # w5 and w6 at least


def test_a_chain_link_that_rebuilds_to_another_hash_is_refused_window_by_window(tmp_path, monkeypatch):
    monkeypatch.setattr(rebuild_mod, "WINDOW_ELEMENTS", 300)
    paths, patches = chain_of(tmp_path, many_tensors(np.random.default_rng(7), 2, densities=(0.02,)))
    real = rebuild_mod.hash_checked

    def wrong_hash(parts, rec, source):
        return real(parts, dataclasses.replace(rec, target_hash="0" * 32), source)

    monkeypatch.setattr(rebuild_mod, "hash_checked", wrong_hash)
    out = tmp_path / "out.safetensors"
    with pytest.raises(CorruptPatchError, match="does not rebuild to its recorded hash"):
        apply_chain(paths[0], patches, out, device="cpu")
    assert not out.exists()


def test_a_long_dense_chain_keeps_its_tensors_whole(tmp_path, monkeypatch):
    """Windows hold every link's windows and entries at once: where that is more than the whole
    tensor and one link's entries, the chain rebuilds the tensor whole (and still right)."""
    monkeypatch.setattr(rebuild_mod, "WINDOW_ELEMENTS", 300)
    paths, patches = chain_of(tmp_path, many_tensors(np.random.default_rng(8), 4, (0.3,)))
    seen = chain_windows_results(monkeypatch)
    out = tmp_path / "out.safetensors"
    apply_chain(paths[0], patches, out, device="cpu")
    assert out.read_bytes() == paths[-1].read_bytes()
    assert seen and not any(isinstance(r, rebuild_mod.Windows) for r in seen)


def test_batches_of_small_tensors_are_rebuilt_two_at_a_time(tmp_path, monkeypatch, fresh_pool):
    """A batch of small ctx-rans tensors is one rebuild in flight, however many tensors it holds:
    with two threads, the next batch starts while the first runs (counted per tensor, a batch of
    many filled the queue and the batches ran one after the other)."""
    monkeypatch.setenv("PULSEDIFF_THREADS", "2")
    monkeypatch.setattr(apply_mod, "AHEAD_PER_THREAD", 1)  # two ahead: fewer than a batch's four tensors
    monkeypatch.setattr(ctx_rans_batch, "BATCH_ELEMENTS", 4 * 256)  # batches of four 256-element tensors
    rng = np.random.default_rng(11)
    old = {f"e{i:02d}": random_tensor(rng, "BF16", (16, 16)) for i in range(16)}
    new = {k: mutate(rng, v, 0.05) for k, v in old.items()}
    a, b = save(old, tmp_path / "a.safetensors"), save(new, tmp_path / "b.safetensors")
    make_patch(a, b, tmp_path / "p.pulsediff")
    both = threading.Barrier(2, timeout=20)  # broken (and the apply failing) if the second batch never starts
    real, runs = apply_mod._BatchedRebuilds.run, []

    def run(self):
        runs.append(len(self.items))
        if len(runs) <= 2:
            both.wait()
        return real(self)

    monkeypatch.setattr(apply_mod._BatchedRebuilds, "run", run)
    apply_patch(a, tmp_path / "p.pulsediff", tmp_path / "out.safetensors")
    assert runs == [4, 4, 4, 4]
    assert (tmp_path / "out.safetensors").read_bytes() == b.read_bytes()
