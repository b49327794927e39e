"""Which kernels run where (issue 27): `auto` keeps file work on the CPU without touching CUDA;
a CUDA stack that cannot run is one line under `--device cuda` and a one-line notice and the
CPU under `auto` for GPU data; no Numba warning reaches the user.

The failures are forced by making numba-cuda's `to_device` raise the driver's own error type
(the simulator's twin of CudaAPIError), which stands in for a broken driver or a full GPU."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

from ckpt_factory import mutate, random_tensor, save

import pulsediff.kernels as kernels
from pulsediff.runtime import notices
from pulsediff.errors import DeviceUnavailableError

# Runs the CLI in a process whose CUDA "driver" fails every upload with out-of-memory.
BROKEN_CUDA_CLI = """
import sys
from numba import cuda
from numba.cuda.cudadrv.driver import CudaAPIError

def failing_upload(*args, **kwargs):
    raise CudaAPIError(2, "CUDA_ERROR_OUT_OF_MEMORY")

cuda.to_device = failing_upload
from pulsediff.__main__ import main
sys.argv = ["pulsediff", *sys.argv[1:]]
main()
"""


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("device")
    rng = np.random.default_rng(27)
    base = {"w": random_tensor(rng, "BF16", (512, 64)), "b": random_tensor(rng, "F32", (64,))}
    target = {"w": mutate(rng, base["w"], 0.02), "b": base["b"]}
    return save(base, tmp / "old.safetensors"), save(target, tmp / "new.safetensors")


@pytest.fixture
def fresh_probe(monkeypatch):
    """Forget this process's CUDA probe, so a test sees the stack it sets up, and notices said."""
    monkeypatch.setattr(kernels, "_cuda_state", (None, ""))
    monkeypatch.setattr(notices, "_said", set())
    monkeypatch.setattr(notices, "_quiet", False)


@pytest.fixture
def broken_upload(monkeypatch):
    from numba import cuda
    from numba.cuda.cudadrv.driver import CudaAPIError

    def failing_upload(*args, **kwargs):
        raise CudaAPIError(2, "CUDA_ERROR_OUT_OF_MEMORY")

    monkeypatch.setattr(cuda, "to_device", failing_upload)


def run_broken(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BROKEN_CUDA_CLI, *map(str, args)], capture_output=True,
                          timeout=300, env={**os.environ, "NUMBA_ENABLE_CUDASIM": "1"})


def test_auto_keeps_file_work_off_cuda(pair, tmp_path):
    """make and apply under `auto` never import numba-cuda: the data is in host memory."""
    old, new = pair
    code = (f"import sys, pulsediff\n"
            f"pulsediff.make_patch({str(old)!r}, {str(new)!r}, {str(tmp_path / 'p')!r}, device='auto')\n"
            f"pulsediff.apply_patch({str(old)!r}, {str(tmp_path / 'p')!r}, {str(tmp_path / 'o')!r}, device='auto')\n"
            "print(sorted(m for m in sys.modules if m.startswith(('numba.cuda', 'pulsediff.kernels.cuda'))))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=300,
                          env={**os.environ, "NUMBA_ENABLE_CUDASIM": "1"})
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode().strip() == "[]"
    assert (tmp_path / "o").read_bytes() == new.read_bytes()


def test_broken_cuda_under_device_cuda_is_one_line(pair, tmp_path):
    old, new = pair
    proc = run_broken("make", old, new, "-o", tmp_path / "p", "--device", "cuda")
    err = proc.stderr.decode()
    assert proc.returncode == 1, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("pulsediff: error:"), err
    assert "CUDA_ERROR_OUT_OF_MEMORY" in lines[0] and "CUDA kernels cannot run" in lines[0]
    assert not (tmp_path / "p").exists()


def test_broken_cuda_under_auto_runs_on_cpu(pair, tmp_path):
    old, new = pair
    proc = run_broken("make", old, new, "-o", tmp_path / "p", "--device", "auto", "-q")
    assert proc.returncode == 0 and proc.stderr == b"", proc.stderr.decode()
    proc = run_broken("apply", old, tmp_path / "p", "-o", tmp_path / "o", "-q")
    assert proc.returncode == 0 and proc.stderr == b"", proc.stderr.decode()
    assert (tmp_path / "o").read_bytes() == new.read_bytes()


def test_gpu_data_falls_back_with_one_notice(fresh_probe, broken_upload, capsys):
    assert kernels.backend_for_gpu_data("auto") is None
    assert kernels.backend_for_gpu_data(None) is None  # said once, not twice
    err = capsys.readouterr().err.splitlines()
    # The simulator's CudaAPIError prints as (2, '...'), the real driver's as [2] ...
    assert len(err) == 1 and re.fullmatch(r"pulsediff: CUDA kernels cannot run \(CudaAPIError: "
                                          r"(\(2, 'CUDA_ERROR_OUT_OF_MEMORY'\)|\[2\] CUDA_ERROR_OUT_OF_MEMORY)\); "
                                          r"using the CPU instead", err[0]), err
    with pytest.raises(DeviceUnavailableError, match="CUDA_ERROR_OUT_OF_MEMORY"):
        kernels.backend_for_gpu_data("cuda")
    with pytest.raises(DeviceUnavailableError, match="CUDA_ERROR_OUT_OF_MEMORY"):
        kernels.get_backend("cuda")
    ok, reason = kernels.cuda_usable()
    assert not ok and "CUDA_ERROR_OUT_OF_MEMORY" in reason
    assert kernels.backend_for_gpu_data("cpu") is None


def test_quiet_silences_the_fallback_notice(fresh_probe, broken_upload, capsys):
    notices.set_quiet(True)
    assert kernels.backend_for_gpu_data("auto") is None
    assert capsys.readouterr().err == ""


def test_working_cuda_is_chosen_for_gpu_data(fresh_probe, capsys):
    backend = kernels.backend_for_gpu_data("auto")
    assert backend is not None and backend.__name__ == "pulsediff.kernels.cuda"
    said = capsys.readouterr().err.splitlines()  # on a GPU's first run, the one compile notice
    assert all(line.startswith("pulsediff: compiling CUDA kernels") for line in said), said


def test_failure_mid_operation_is_a_device_error(fresh_probe, monkeypatch):
    """After a good probe, a kernel call that fails in the CUDA stack is one DeviceUnavailableError
    (with the stack's exception as its cause), not a traceback from numba."""
    backend = kernels.cuda_backend()
    from numba import cuda
    from numba.cuda.cudadrv.driver import CudaAPIError

    def failing_upload(*args, **kwargs):
        raise CudaAPIError(700, "CUDA_ERROR_ILLEGAL_ADDRESS")

    monkeypatch.setattr(cuda, "to_device", failing_upload)
    with pytest.raises(DeviceUnavailableError, match="CUDA_ERROR_ILLEGAL_ADDRESS") as info:
        backend.word_sum(np.arange(100, dtype=np.uint16))
    assert isinstance(info.value.__cause__, CudaAPIError)


def test_own_checks_pass_through_the_guard():
    """A ValueError from the backend's own argument checks is not dressed as a device failure."""
    backend = kernels.cuda_backend()
    with pytest.raises(ValueError) as info:
        backend.scatter(np.zeros(4, np.uint16), np.zeros(2, np.int64), np.zeros(3, np.uint16))
    assert not isinstance(info.value, DeviceUnavailableError)


def test_no_numba_warning_leaves_a_kernel_call():
    from numba.cuda.core.errors import NumbaPerformanceWarning as CudaPerformanceWarning
    from numba.core.errors import NumbaPerformanceWarning

    from pulsediff.kernels import cuda as backend

    def launch_small_grid():
        warnings.warn("Grid size 1 will likely result in GPU under-utilization", CudaPerformanceWarning)
        warnings.warn("something numba says", NumbaPerformanceWarning)
        return 7

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert backend._guarded(launch_small_grid)() == 7
        warnings.warn("a user's own warning", UserWarning)  # the filter is lifted after the call
    assert [str(w.message) for w in seen] == ["a user's own warning"]


def test_cli_on_cuda_prints_nothing_but_its_result(tmp_path):
    """Kernels run through the CLI under `--device cuda -q`: stderr stays empty (no Numba
    warning, no simulator overflow warning). On a machine with a usable GPU the child uses it
    (the simulator is for machines without one: on a GPU host's many threads it hung); elsewhere
    the simulator, on a pair small enough for it (2,048 elements: the module's pair took 145 s)
    that still runs every kernel of make and apply, on grids too small for the GPU (what Numba
    warns about)."""
    rng = np.random.default_rng(27)
    base = {"w": random_tensor(rng, "BF16", (64, 32)), "b": random_tensor(rng, "F32", (64,))}
    old = save(base, tmp_path / "old.safetensors")
    new = save({"w": mutate(rng, base["w"], 0.02), "b": base["b"]}, tmp_path / "new.safetensors")
    on_gpu = kernels.cuda_usable() == (True, "gpu")
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0" if on_gpu else "1"}
    for args in (["make", old, new, "-o", tmp_path / "p"], ["apply", old, tmp_path / "p", "-o", tmp_path / "o"]):
        proc = subprocess.run([sys.executable, "-m", "pulsediff", *map(str, args), "--device", "cuda", "-q"],
                              capture_output=True, timeout=600, env=env)
        assert proc.returncode == 0 and proc.stderr == b"", proc.stderr.decode()
    assert (tmp_path / "o").read_bytes() == new.read_bytes()


def test_compile_notice_only_without_a_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(notices, "_said", set())
    monkeypatch.setattr(notices, "_quiet", False)
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    module = tmp_path / "kern.py"
    module.write_text("")
    kernels.compile_notice(str(module), "CUDA")
    assert capsys.readouterr().err == ("pulsediff: compiling CUDA kernels (the first run on this machine; "
                                       "they are cached for the next ones)\n")
    monkeypatch.setattr(notices, "_said", set())
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "kern._count-12.py311.nbi").write_bytes(b"")
    kernels.compile_notice(str(module), "CUDA")
    assert capsys.readouterr().err == ""
    # NUMBA_CACHE_DIR set: Numba caches only there, so the entry beside the source does not count
    monkeypatch.setattr(notices, "_said", set())
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "elsewhere"))
    kernels.compile_notice(str(module), "CUDA")
    assert "compiling CUDA kernels" in capsys.readouterr().err
    # not to a pipe
    monkeypatch.setattr(notices, "_said", set())
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    kernels.compile_notice(str(module), "CUDA")
    assert capsys.readouterr().err == ""


def test_first_make_on_a_cold_cache_says_it_compiles(tmp_path):
    """On a terminal, a make with an empty Numba cache says once that it compiles the CPU kernels;
    the next make, with the cache filled, says nothing. (A pty stands in for the terminal.)"""
    import pty

    rng = np.random.default_rng(3)
    base = {"w": random_tensor(rng, "BF16", (64, 64))}
    old = save(base, tmp_path / "old.safetensors")
    new = save({"w": mutate(rng, base["w"], 0.05)}, tmp_path / "new.safetensors")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba-cache")}
    said = []
    for k in range(2):
        out = tmp_path / f"p{k}"
        master, slave = pty.openpty()
        proc = subprocess.Popen([sys.executable, "-m", "pulsediff", "make", str(old), str(new), "-o", str(out)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=slave, env=env)
        os.close(slave)
        # Read while the child runs: its progress redraws can fill the pty's buffer (a few KB), and a child
        # that cannot write blocks until someone reads (issue 33: this test once hung for 600 s).
        chunks = []
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if not select.select([master], [], [], 1.0)[0]:
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed its end
                break
            if not chunk:
                break
            chunks.append(chunk)
        os.close(master)
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        assert proc.returncode == 0
        said.append(b"".join(chunks).decode(errors="replace"))
    assert said[0].count("compiling CPU kernels") == 1, said[0]
    assert "compiling" not in said[1], said[1]


def test_live_writes_through_torch_views_match_numpy():
    """The digests path writes GPU tensors through torch integer views (no CUDA kernels needed);
    checked here on CPU tensors against the NumPy scatter, bit for bit, and the undo."""
    import torch

    from pulsediff.ops.live import _Undo, _bits_view, _roll_back, _scatter

    rng = np.random.default_rng(5)
    for dtype in (torch.bfloat16, torch.float32, torch.uint8, torch.float64):
        t = torch.from_numpy(rng.integers(0, 255, 4096, dtype=np.uint8)).view(torch.uint8)
        t = t.view(dtype).clone()
        view = _bits_view(t)
        before = view.numpy().copy()
        positions = np.sort(rng.choice(before.size, 37, replace=False))
        values = rng.integers(0, 1 << 16, 37).astype(before.dtype)
        expected = before.copy()
        expected[positions] = values
        _scatter(view, positions, values.view(np.dtype(f"u{before.itemsize}")))
        assert np.array_equal(view.numpy(), expected)
        undo = [_Undo("t", view, positions, before[positions].view(np.dtype(f"u{before.itemsize}")))]
        assert _roll_back(undo) == []
        assert np.array_equal(view.numpy(), before)


@pytest.mark.parametrize("make_error", [
    lambda: __import__("torch").OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    lambda: RuntimeError("CUDA error: an illegal memory access was encountered"),
])
def test_torch_failures_on_the_sort_path_are_device_errors(make_error):
    """The class-sort path runs torch on the GPU: its out-of-memory and CUDA errors are the
    stack's failures too (one line; auto falls back), not pulsediff bugs."""
    from pulsediff.kernels import cuda as backend

    def sort_that_fails():
        raise make_error()

    with pytest.raises(DeviceUnavailableError, match="CUDA") as info:
        backend._guarded(sort_that_fails)()
    assert "Traceback" not in str(info.value) and "\n" not in str(info.value)


def test_an_out_of_memory_probe_is_tried_again(fresh_probe, monkeypatch):
    """A full device may have room later: the probe forgets an out-of-memory failure (and
    remembers a lasting one)."""
    from numba import cuda
    from numba.cuda.cudadrv.driver import CudaAPIError

    real = cuda.to_device

    def failing_upload(*args, **kwargs):
        raise CudaAPIError(2, "CUDA_ERROR_OUT_OF_MEMORY")

    monkeypatch.setattr(cuda, "to_device", failing_upload)
    with pytest.raises(DeviceUnavailableError):
        kernels.cuda_backend()
    monkeypatch.setattr(cuda, "to_device", real)
    assert kernels.cuda_backend().__name__ == "pulsediff.kernels.cuda"
