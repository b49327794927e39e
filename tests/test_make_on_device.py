"""make with the CUDA backend (issue 32): every tensor hashed, summed and compared where it lives,
only the compact changes and tensors carried whole brought to the host. Under the CUDA simulator
here (state dicts of CPU tensors are copied over once, as a file's tensors are; a CUDA tensor's
own memory is read in place on a GPU), the patch must be byte for byte the CPU's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from pulsediff import apply_patch, make_patch
from pulsediff.kernels import cuda_usable

from ckpt_factory import mutate, random_tensor
from cuda_sim import SMALL_LAUNCH, fast_simulator, launch_config

pytestmark = pytest.mark.skipif(not cuda_usable()[0], reason="no CUDA (real or simulated)")


def _state_dicts(seed: int):
    rng = np.random.default_rng(seed)
    old = {
        "layers.0.w": random_tensor(rng, "BF16", (40, 64)),  # several blocks of the small launch
        "layers.1.w": random_tensor(rng, "BF16", (33, 17)),
        "same": random_tensor(rng, "BF16", (8, 8)),
        "f32": random_tensor(rng, "F32", (50,)),
        "ids": torch.arange(12),
        "dense": random_tensor(rng, "F16", (64,)),  # changed everywhere: carried whole
        "reshaped": random_tensor(rng, "BF16", (4, 6)),
        "empty": torch.zeros(0, dtype=torch.bfloat16),
        "gone": random_tensor(rng, "BF16", (5,)),
    }
    new = dict(old)
    for name in ("layers.0.w", "layers.1.w", "f32"):
        new[name] = mutate(rng, old[name], 0.02)
    new["dense"] = old["dense"] + 1
    new["reshaped"] = old["reshaped"].reshape(6, 4).clone()
    del new["gone"]
    new["added"] = random_tensor(rng, "BF16", (7, 3))
    return old, new


# ctx-rans exact on 3 threads is what the two cases after it cover apart: the slow tier.
@pytest.mark.parametrize("codec,precision,threads", [pytest.param("ctx-rans", "exact", "3", marks=pytest.mark.slow),
                                                      ("gap-zstd", "exact", "3"), ("ctx-rans", "bf16", "3"),
                                                      ("ctx-ac", "exact", "1")])
def test_make_on_the_device_is_make_on_the_cpu_byte_for_byte(tmp_path, monkeypatch, fresh_pool, codec, precision,
                                                             threads):
    """With several threads the device's compares run ahead of the host's coding (pipelined);
    with one, each tensor is coded as it is compared."""
    from pulsediff.format import digest
    from pulsediff.kernels import cpu, cuda

    monkeypatch.setenv("PULSEDIFF_THREADS", threads)
    old, new = _state_dicts(11)
    save_file(old, str(tmp_path / "old.safetensors"))
    save_file(new, str(tmp_path / "new.safetensors"))
    on_cpu = tmp_path / "cpu.pulsediff"
    make_patch(tmp_path / "old.safetensors", tmp_path / "new.safetensors", on_cpu, codec=codec,
               precision=precision, device="cpu")

    # On the device, no tensor is hashed, summed or compared on the host: those paths fail here.
    def host_only(*_args, **_kwargs):
        raise AssertionError("a host kernel ran in make on the device")

    with monkeypatch.context() as m:
        for name in ("diff_ranks", "diff_ranks_checked", "diff_compact", "chunk_digests", "word_sum"):
            m.setattr(cpu, name, host_only)
        for name in ("_flat_checks", "_tree_on_host"):
            m.setattr(digest, name, host_only)
        for sources in ((old, new), (tmp_path / "old.safetensors", tmp_path / "new.safetensors")):
            on_gpu = tmp_path / "gpu.pulsediff"
            with launch_config(cuda.common, **SMALL_LAUNCH), fast_simulator():
                make_patch(*sources, on_gpu, codec=codec, precision=precision, device="cuda", force=True)
            assert on_gpu.read_bytes() == on_cpu.read_bytes(), type(sources[0])
    out = tmp_path / "out.safetensors"
    apply_patch(tmp_path / "old.safetensors", on_gpu, out)
    if precision == "exact":
        assert out.read_bytes() == (tmp_path / "new.safetensors").read_bytes()


def test_an_anchor_on_the_device(tmp_path):
    """No base: every tensor carried whole, hashed on the device, compressed on the host."""
    _, new = _state_dicts(12)
    save_file(new, str(tmp_path / "new.safetensors"))
    make_patch(None, tmp_path / "new.safetensors", tmp_path / "cpu.pulsediff", device="cpu")
    from pulsediff.kernels import cuda

    with launch_config(cuda.common, **SMALL_LAUNCH), fast_simulator():
        make_patch(None, new, tmp_path / "gpu.pulsediff", device="cuda")
    assert (tmp_path / "gpu.pulsediff").read_bytes() == (tmp_path / "cpu.pulsediff").read_bytes()


def test_flat_hashes_stay_on_the_host(tmp_path):
    """--digest flat has no device form: the hashes are the host's, the patch the same."""
    old, new = _state_dicts(13)
    save_file(old, str(tmp_path / "old.safetensors"))
    save_file(new, str(tmp_path / "new.safetensors"))
    make_patch(tmp_path / "old.safetensors", tmp_path / "new.safetensors", tmp_path / "cpu.pulsediff",
               device="cpu", digest="flat")
    from pulsediff.kernels import cuda

    with launch_config(cuda.common, **SMALL_LAUNCH), fast_simulator():
        make_patch(old, new, tmp_path / "gpu.pulsediff", device="cuda", digest="flat")
    assert (tmp_path / "gpu.pulsediff").read_bytes() == (tmp_path / "cpu.pulsediff").read_bytes()


def test_live_cuda_tensors_are_hashed_where_they_are(tmp_path, monkeypatch):
    """state_dict_digest (catch-up of live tensors, the engine state) of tensors that StateDict
    finds on the device: tree hashes taken there, equal to the file's digest; BF16 casts and the
    flat scheme on the host. (The simulator has no CUDA tensors: device_data is made to hand out
    simulated device copies of them.)"""
    from numba import cuda as numba_cuda

    from pulsediff.io.checkpoint import TensorData
    from pulsediff.ops.inspect import checkpoint_digest_of
    from pulsediff.ops.live import StateDict, state_dict_digest

    _, new = _state_dicts(14)
    save_file(new, str(tmp_path / "new.safetensors"))
    seen = []

    def on_device(self, name, precision):
        from pulsediff.io.checkpoint import TensorView

        if TensorView(self, precision).casts(self.entry(name).dtype):
            return None
        seen.append(name)
        bits = TensorView(self, precision).get(name).bits
        return TensorData(name, self.entry(name).dtype, self.entry(name).shape, numba_cuda.to_device(bits))

    monkeypatch.setattr(StateDict, "device_data", on_device)
    monkeypatch.setattr(StateDict, "on_gpu", property(lambda self: True))
    from pulsediff.kernels import cuda

    with launch_config(cuda.common, **SMALL_LAUNCH), fast_simulator():
        for precision in ("exact", "bf16"):
            seen.clear()
            assert state_dict_digest(new, precision) == checkpoint_digest_of(tmp_path / "new.safetensors", precision)
            assert seen and (precision == "bf16") == (len(seen) < len(new))
        seen.clear()
        assert state_dict_digest(new, scheme="flat") == checkpoint_digest_of(tmp_path / "new.safetensors", scheme="flat")
        assert not seen


def test_auto_takes_the_gpu_for_gpu_state_dicts_only(tmp_path, monkeypatch):
    """device "auto" (the default): make runs on the device for a state dict holding GPU tensors
    (seen so here), on the CPU for files, and on the CPU for anything under the flat scheme."""
    from pulsediff.kernels import cuda
    from pulsediff.ops import make as make_module
    from pulsediff.ops.live import StateDict

    old, new = _state_dicts(15)
    monkeypatch.setattr(StateDict, "on_gpu", property(lambda self: True))
    chosen = []
    real = make_module.on_device
    monkeypatch.setattr(make_module, "on_device", lambda scheme, backend: chosen.append(real(scheme, backend)) or
                        chosen[-1])
    with launch_config(cuda.common, **SMALL_LAUNCH), fast_simulator():
        make_patch(old, new, tmp_path / "a.pulsediff")
        make_patch(old, new, tmp_path / "b.pulsediff", digest="flat")
        make_patch(old, new, tmp_path / "c.pulsediff", device="cpu")
    assert chosen == [True, False, False]
    save_file(old, str(tmp_path / "old.safetensors"))
    save_file(new, str(tmp_path / "new.safetensors"))
    make_patch(tmp_path / "old.safetensors", tmp_path / "new.safetensors", tmp_path / "d.pulsediff")
    assert chosen[-1] is False
    assert (tmp_path / "a.pulsediff").read_bytes() == (tmp_path / "c.pulsediff").read_bytes() \
        == (tmp_path / "d.pulsediff").read_bytes()
