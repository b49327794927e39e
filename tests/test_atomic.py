"""Staged outputs: direct (O_DIRECT) writes give the same bytes as buffered ones, with every fallback."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from pulsediff.io import atomic
from pulsediff.io.atomic import StagedFiles
from pulsediff.errors import OutputError

STAGE = atomic._DIRECT_STAGE


def pieces(rng, sizes):
    return [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]


def write_staged(path, parts, direct=True):
    with StagedFiles() as staged:
        with staged.open(path, direct=direct) as f:
            for part in parts:
                f.write(part)
        staged.commit()


@pytest.mark.parametrize("sizes", [
    [], [1], [4095], [4096], [4097], [STAGE], [STAGE + 1], [3, STAGE - 3, 5000, 1],
    [STAGE // 3] * 7, [0, 0, 12345],
])
def test_direct_writes_give_the_exact_bytes(tmp_path, sizes):
    parts = pieces(np.random.default_rng(len(sizes) + sum(sizes)), sizes)
    write_staged(tmp_path / "out", parts)
    assert (tmp_path / "out").read_bytes() == b"".join(parts)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary left


def test_direct_path_is_taken_where_the_file_system_allows_it(tmp_path, monkeypatch):
    used = []
    real = atomic._DirectWriter.finish
    monkeypatch.setattr(atomic._DirectWriter, "finish", lambda self: used.append(self.size) or real(self))
    write_staged(tmp_path / "out", [b"x" * 10000])
    fd = os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT)
    try:
        supported = atomic._set_direct(fd)
    finally:
        os.close(fd)
    assert used == ([10000] if supported else [])


def test_buffered_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("PULSEDIFF_BUFFERED_WRITES", "1")
    monkeypatch.setattr(atomic, "_DirectWriter", None)  # would fail if used
    write_staged(tmp_path / "out", [b"abc" * 5000])
    assert (tmp_path / "out").read_bytes() == b"abc" * 5000


@pytest.mark.parametrize("sizes", [[1], [atomic._BUFFERED_PIECE], [3 * atomic._BUFFERED_PIECE + 5, 7, 0, 12345]])
def test_buffered_writes_in_pieces_give_the_exact_bytes(tmp_path, monkeypatch, sizes):
    monkeypatch.setenv("PULSEDIFF_BUFFERED_WRITES", "1")
    calls = []
    real_pwrite = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, at: calls.append(len(data)) or real_pwrite(fd, data, at))
    parts = pieces(np.random.default_rng(sum(sizes)), sizes)
    write_staged(tmp_path / "out", parts)
    assert (tmp_path / "out").read_bytes() == b"".join(parts)
    assert max(calls) <= atomic._BUFFERED_PIECE  # the kernel never gets one large write


@pytest.mark.parametrize("sizes", [[STAGE + 777, 3], [atomic._BUFFERED_PIECE]])
def test_a_file_system_refusing_direct_writes_gets_buffered_ones(tmp_path, monkeypatch, sizes):
    """Some accept O_DIRECT at open and refuse the write (EINVAL): the writer drops the flag."""
    real_pwrite = os.pwrite
    refused = []

    def picky_pwrite(fd, data, offset):
        import fcntl

        if hasattr(os, "O_DIRECT") and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        written.append(len(data))
        return real_pwrite(fd, data, offset)

    written = []
    monkeypatch.setattr(os, "pwrite", picky_pwrite)
    parts = pieces(np.random.default_rng(5), sizes)
    write_staged(tmp_path / "out", parts)
    assert (tmp_path / "out").read_bytes() == b"".join(parts)
    assert bool(refused) == direct_supported(tmp_path)
    assert max(written) <= atomic._BUFFERED_PIECE  # buffered from then on, in pieces


def direct_supported(folder) -> bool:
    fd = os.open(folder / "probe", os.O_WRONLY | os.O_CREAT)
    try:
        return atomic._set_direct(fd)
    finally:
        os.close(fd)
        os.unlink(folder / "probe")


class SlowDisk:
    """The real os.pwrite, each call held a random few milliseconds so that stages finish out of order;
    records how many were in flight at once, and whether one still was when the file closed."""

    def __init__(self, monkeypatch, seed, fail_at=None):
        import threading

        self.rng = np.random.default_rng(seed)
        self.lock = threading.Lock()
        self.active = self.most = self.calls = 0
        self.active_at_close = []
        self.fail_at = fail_at
        self.real_pwrite, self.real_close = os.pwrite, os.close
        monkeypatch.setattr(os, "pwrite", self.pwrite)
        monkeypatch.setattr(os, "close", self.close)

    def pwrite(self, fd, data, offset):
        import time

        with self.lock:
            self.calls += 1
            call = self.calls
            self.active += 1
            self.most = max(self.most, self.active)
            delay = float(self.rng.uniform(0, 0.004))
        try:
            time.sleep(delay)
            if call == self.fail_at:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.real_pwrite(fd, data, offset)
        finally:
            with self.lock:
                self.active -= 1

    def close(self, fd):
        self.active_at_close.append(self.active)
        return self.real_close(fd)


@pytest.mark.parametrize("seed", range(4))
def test_stages_written_out_of_order_give_the_exact_bytes(tmp_path, monkeypatch, seed):
    monkeypatch.setattr(atomic, "_DIRECT_STAGE", 3 * atomic._DIRECT_BLOCK)
    disk = SlowDisk(monkeypatch, seed)
    rng = np.random.default_rng(seed)
    parts = pieces(rng, rng.integers(0, 5 * atomic._DIRECT_STAGE, 25))
    write_staged(tmp_path / "out", parts)
    assert (tmp_path / "out").read_bytes() == b"".join(parts)
    if direct_supported(tmp_path):
        assert disk.most == atomic._DIRECT_IN_FLIGHT  # the stages did overlap


def test_a_stage_failing_while_others_are_in_flight_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "_DIRECT_STAGE", 2 * atomic._DIRECT_BLOCK)
    disk = SlowDisk(monkeypatch, 9, fail_at=6)
    parts = pieces(np.random.default_rng(9), [20 * atomic._DIRECT_STAGE + 5])
    with pytest.raises(OutputError, match="no space left on device"):
        write_staged(tmp_path / "out", parts)
    assert list(tmp_path.iterdir()) == []
    if direct_supported(tmp_path):
        assert disk.calls >= 6 and disk.active_at_close[:1] == [0]  # nothing still writing into the closed file


def test_a_failed_direct_write_leaves_nothing(tmp_path, monkeypatch):
    def no_space(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", no_space)
    with pytest.raises(OutputError, match="no space left on device"):
        write_staged(tmp_path / "out", [b"y" * (STAGE + 1)])
    assert list(tmp_path.iterdir()) == []


def test_a_writer_that_cannot_get_its_buffer_closes_the_file(tmp_path, monkeypatch):
    from pulsediff.io import memory

    def no_memory(nbytes):
        raise MemoryError

    monkeypatch.setattr(memory, "fresh_buffer", no_memory)
    fds = set(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    with pytest.raises(MemoryError):
        write_staged(tmp_path / "out", [b"z"])
    if fds is None:
        pytest.skip("no /proc/self/fd to count open files")
    assert set(os.listdir("/proc/self/fd")) <= fds
    assert list(tmp_path.iterdir()) == []


def test_a_swallowed_ctrl_c_still_stops_the_commit(tmp_path, monkeypatch):
    """A KeyboardInterrupt raised inside a finalizer is swallowed by Python; the CLI's handler records it
    (pulsediff.runtime.interrupt) and the commit refuses to make anything visible."""
    import pytest

    from pulsediff.runtime import interrupt
    from pulsediff.io.atomic import StagedFiles

    monkeypatch.setattr(interrupt, "_seen", True)
    with pytest.raises(KeyboardInterrupt):
        with StagedFiles() as staged:
            with staged.open(tmp_path / "out") as f:
                f.write(b"x")
            staged.commit()
    assert list(tmp_path.iterdir()) == []


def test_a_failure_between_windows_lets_the_write_in_flight_finish_before_the_file_closes(tmp_path, monkeypatch):
    """apply writes window k on a thread while it makes window k+1; when making k+1 fails, the
    output's descriptor must stay open until write k is done (else it writes to a closed, or
    reused, descriptor: found by review)."""
    import threading
    import time

    import torch
    from safetensors.torch import save_file

    import pulsediff.ops.apply as apply_mod
    import pulsediff.ops.rebuild
    from pulsediff import apply_patch, make_patch
    from pulsediff.codecs.ctx_rans import CtxRans
    from pulsediff.errors import CorruptPatchError

    rng = np.random.default_rng(3)
    base = rng.normal(0, 0.02, 1 << 16).astype(np.float32)
    target = base.copy()
    target[::50] *= 1.01
    save_file({"w": torch.from_numpy(base).to(torch.bfloat16)}, tmp_path / "b.safetensors")
    save_file({"w": torch.from_numpy(target).to(torch.bfloat16)}, tmp_path / "t.safetensors")
    make_patch(tmp_path / "b.safetensors", tmp_path / "t.safetensors", tmp_path / "p", device="cpu")
    monkeypatch.setattr(pulsediff.ops.rebuild, "WINDOW_ELEMENTS", 1 << 12)

    real_windows = CtxRans.decode_stream

    def failing_windows(self, *args, **kwargs):
        parts = real_windows(self, *args, **kwargs)
        yield next(parts)
        time.sleep(0.05)  # the first window's write is under way
        raise CorruptPatchError("p", "a check that fails after the first window")

    seen, real_write = [], apply_mod._PipelinedWriter._write

    def slow_write(f, data, hasher, then):
        time.sleep(0.3)  # a slow disk: still writing when the rebuild fails
        fd = f.fd if hasattr(f, "fd") else f.fileno()
        try:
            os.fstat(fd)
            seen.append("open")
        except OSError:
            seen.append("closed")
        real_write(f, data, hasher, then)

    monkeypatch.setattr(CtxRans, "decode_stream", failing_windows)
    monkeypatch.setattr(apply_mod._PipelinedWriter, "_write", staticmethod(slow_write))
    with pytest.raises(CorruptPatchError, match="after the first window"):
        apply_patch(tmp_path / "b.safetensors", tmp_path / "p", tmp_path / "out.safetensors", device="cpu")
    assert seen and set(seen) == {"open"}
    assert not (tmp_path / "out.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.safetensors", "p", "t.safetensors"]
    assert not [t for t in threading.enumerate() if t.name.startswith("pulsediff-writer")]  # stopped


def test_memory_hints_leave_maps_whole_and_closable(tmp_path):
    """populate_read, unmap_pages and fresh_buffer go through libc's madvise (which lets go
    of the GIL) on a view of the map: the bytes read back unchanged, no view outlives the
    call (the map still closes), and ranges past the end or empty are harmless."""
    import mmap

    from pulsediff.io import memory

    # past POPULATE_MIN_BYTES, so that populate_read does call madvise
    size = memory.POPULATE_MIN_BYTES + 5 * mmap.PAGESIZE + 123
    data = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8).tobytes()
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        memory.populate_read(mapped, 7, len(data))  # unaligned start, length past the end
        memory.unmap_pages(mapped, mmap.PAGESIZE + 1, 2 * mmap.PAGESIZE)
        memory.populate_read(mapped, len(data), 0)
        memory.unmap_pages(mapped, 0, 0)
        assert mapped[:] == data
        mapped.close()  # would raise BufferError if a hint had left a view behind
    buf = memory.fresh_buffer(3 << 20)
    assert buf.size == 3 << 20 and not buf.any()
    buf[:] = 7
    assert (buf == 7).all()


@pytest.mark.parametrize("direct", [True, False])
def test_a_read_error_inside_an_output_is_not_called_a_write_error(tmp_path, direct):
    """StagedFiles.open reported any OSError raised while its file was open as "cannot write OUT",
    even one the caller raised reading its input (issue 23): it goes through as it is now, and the
    temporary goes; the writer's own failures still name OUT."""
    read_error = OSError(errno.EIO, os.strerror(errno.EIO), "input.bin")
    with pytest.raises(OSError) as caught:
        with StagedFiles() as staged:
            with staged.open(tmp_path / "out.bin", direct=direct) as f:
                f.write(b"x" * 10_000)
                raise read_error
    assert caught.value is read_error and not isinstance(caught.value, OutputError)
    assert list(tmp_path.iterdir()) == []


def test_a_patch_that_cannot_be_read_while_applied_names_the_patch(tmp_path):
    """A read error of the patch in the middle of apply (its output open) was "cannot write OUT"."""
    import io

    from ckpt_factory import mutate, random_tensor, save
    from pulsediff import apply_patch, make_patch
    from pulsediff.errors import PatchReadError

    rng = np.random.default_rng(41)
    base = {f"w{i}": random_tensor(rng, "BF16", (256, 256)) for i in range(4)}
    old = save(base, tmp_path / "old.safetensors")
    new = save({k: mutate(rng, v, 0.05) for k, v in base.items()}, tmp_path / "new.safetensors")
    patch = tmp_path / "p.pulsediff"
    make_patch(old, new, patch, device="cpu")
    data = patch.read_bytes()

    class FailingStream(io.RawIOBase):
        """The patch's bytes, then EIO two thirds of the way in."""

        def __init__(self):
            self.pos = 0

        def readable(self):
            return True

        def readinto(self, b):
            if self.pos >= 2 * len(data) // 3:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            n = min(len(b), 2 * len(data) // 3 - self.pos, 4096)
            b[:n] = data[self.pos:self.pos + n]
            self.pos += n
            return n

    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(PatchReadError, match="cannot read patch .*Input/output error"):
        apply_patch(old, io.BufferedReader(FailingStream()), out / "new.safetensors", device="cpu")
    assert list(out.iterdir()) == []
