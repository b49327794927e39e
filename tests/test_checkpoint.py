"""Reading checkpoints: agreement with the safetensors library, and hostile files refused."""

from __future__ import annotations

import errno
import json
import os
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from pulsediff import apply_patch, make_patch
from pulsediff.io.checkpoint import Checkpoint, TensorView
from pulsediff.errors import CheckpointNotFoundError, InvalidCheckpointError, OutputError

from ckpt_factory import TORCH_DTYPES, mutate, random_tensor, save, save_sharded


def test_views_agree_with_safetensors(tmp_path):
    rng = np.random.default_rng(21)
    tensors = {f"t_{name}": random_tensor(rng, name, (3, 5)) for name in TORCH_DTYPES}
    path = save(tensors, tmp_path / "all.safetensors")
    loaded = load_file(str(path))
    with Checkpoint(path) as ckpt:
        view = TensorView(ckpt, "exact")
        assert sorted(ckpt.names) == sorted(tensors)
        for name, t in loaded.items():
            got = view.get(name)
            assert got.shape == tuple(t.shape)
            expected = t.contiguous().view(torch.uint8).numpy().tobytes()
            assert got.bits.tobytes() == expected


def test_release_unmaps_pages_without_losing_bytes(tmp_path):
    """make drops a tensor's pages from its mapping once done with it: the file is untouched and
    a view taken before or after still reads the same bytes."""
    rng = np.random.default_rng(22)
    tensors = {f"w{i}": random_tensor(rng, "BF16", (700, 300)) for i in range(3)}  # ~420 KB each, many pages
    path = save(tensors, tmp_path / "m.safetensors")
    before = path.read_bytes()
    with Checkpoint(path) as ckpt:
        view = TensorView(ckpt, "exact")
        held = {name: view.get(name).bits for name in ckpt.names}
        want = {name: bits.tobytes() for name, bits in held.items()}
        for name in ckpt.names:
            ckpt.prefetch(name)
            ckpt.release(name)
            assert held[name].tobytes() == want[name]
            assert view.get(name).bits.tobytes() == want[name]
    assert path.read_bytes() == before


def test_a_prefetched_tensor_is_not_mapped_again_until_released(tmp_path, monkeypatch):
    """A view of a tensor whose pages a prefetch mapped takes no second populate (make's main
    thread paid ~0.65 ms per 16 MiB for it); after a release it populates again; the bytes are
    the same throughout."""
    from pulsediff.io import checkpoint as checkpoint_module

    rng = np.random.default_rng(23)
    tensors = {f"w{i}": random_tensor(rng, "BF16", (300, 300)) for i in range(2)}
    path = save(tensors, tmp_path / "m.safetensors")
    calls = []
    real = checkpoint_module.populate_read
    monkeypatch.setattr(checkpoint_module, "populate_read", lambda *a: (calls.append(a[1:]), real(*a)))
    with Checkpoint(path) as ckpt:
        want = ckpt.raw_bytes("w0").tobytes()
        assert len(calls) == 1
        ckpt.prefetch("w0")
        assert len(calls) == 2
        assert ckpt.raw_bytes("w0").tobytes() == want and len(calls) == 2  # mapped by the prefetch
        ckpt.raw_bytes("w1")
        assert len(calls) == 3  # not prefetched: populated where it is taken
        ckpt.release("w0")
        assert ckpt.raw_bytes("w0").tobytes() == want and len(calls) == 4  # released: mapped again


def write_raw(path, header: dict | bytes, data: bytes = b"", length: int | None = None):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


@pytest.mark.parametrize("header,data,length,reason", [
    (b"", b"", 2**40, "exceeds"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, 10**6, "past the end"),
    (b"not json", b"", None, "not valid JSON"),
    (b"\xff\xfe{}", b"", None, "not UTF-8"),
    (b"[" * 50_000 + b"]" * 50_000, b"", None, "nested deeper"),  # RecursionError inside json before
    (b'{"a": 1' + b"0" * 5000 + b"}", b"", None, "digits"),  # a bare ValueError before
    (b'{"a": {}, "a": {}}', b"", None, "appears twice"),
    (b"[1,2]", b"", None, "not a JSON object"),
    ({"a": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, None, "unsupported dtype"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, None, "do not match"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, None, "hole"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, None, "overlaps"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 9, None, "data region"),
    ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, None, "invalid shape"),
    ({"__metadata__": {"k": 1}}, b"", None, "__metadata__"),
])
def test_hostile_safetensors_are_refused(tmp_path, header, data, length, reason):
    path = write_raw(tmp_path / "bad.safetensors", header, data, length)
    with pytest.raises(InvalidCheckpointError, match=reason):
        Checkpoint(path)


def test_short_file_and_missing_file(tmp_path):
    (tmp_path / "short.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(InvalidCheckpointError, match="shorter"):
        Checkpoint(tmp_path / "short.safetensors")
    with pytest.raises(CheckpointNotFoundError):
        Checkpoint(tmp_path / "nope.safetensors")


def test_hostile_index_is_refused(tmp_path):
    rng = np.random.default_rng(22)
    folder = save_sharded({"a": random_tensor(rng, "F32", (2,)), "b": random_tensor(rng, "F32", (2,))}, tmp_path / "m", 2)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["a"] = "../escape.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(InvalidCheckpointError, match="outside the folder"):
        Checkpoint(folder)
    index["weight_map"]["a"] = index["weight_map"]["b"]  # says a lives where it does not
    index_path.write_text(json.dumps(index))
    with pytest.raises(InvalidCheckpointError, match="does not match"):
        Checkpoint(folder)
    for hostile in ('{"weight_map": {"a": ["x"]}}', "[" * 50_000 + "]" * 50_000, '{"weight_map": []}', "[1]"):
        index_path.write_text(hostile)  # TypeError and RecursionError escaped before
        with pytest.raises(InvalidCheckpointError, match="not a valid index"):
            Checkpoint(folder)


def test_full_disk_during_apply_leaves_nothing(tmp_path, monkeypatch):
    rng = np.random.default_rng(23)
    base = {"w": random_tensor(rng, "BF16", (100, 10))}
    old = save(base, tmp_path / "old.safetensors")
    new = save({"w": mutate(rng, base["w"], 0.1)}, tmp_path / "new.safetensors")
    make_patch(old, new, tmp_path / "p", device="cpu")
    before = sorted(p.name for p in tmp_path.iterdir())

    def no_space(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(OutputError, match="no space left on device"):
        apply_patch(old, tmp_path / "p", tmp_path / "out.safetensors", device="cpu")
    with pytest.raises(OutputError):
        apply_patch(old, tmp_path / "p", in_place=True, device="cpu")
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert old.read_bytes() == save(base, tmp_path / "again.safetensors").read_bytes()


def test_a_fifo_is_refused_not_waited_on(tmp_path):
    """A FIFO given as a checkpoint (or as a shard of a folder) used to block forever."""
    import os

    from pulsediff.io.checkpoint import Checkpoint
    from pulsediff.errors import InvalidCheckpointError

    os.mkfifo(tmp_path / "pipe.safetensors")
    with pytest.raises(InvalidCheckpointError, match="not a regular file"):
        Checkpoint(tmp_path / "pipe.safetensors")
    with pytest.raises(InvalidCheckpointError, match="pipe.safetensors: not a regular file"):
        Checkpoint(tmp_path)  # a shard of a folder too, refused by name, not skipped


def _unreadable_entry(folder, kind: str):
    """An entry of `folder` named like a shard that cannot be read as one."""
    path = folder / "model-00002-of-00002.safetensors"
    if kind == "dangling link":
        path.symlink_to(folder / "gone.safetensors")
    elif kind == "link loop":
        path.symlink_to(path.name)
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    return path


UNREADABLE = {"dangling link": "dangling symbolic link", "link loop": "symbolic link loop",
              "fifo": "not a regular file", "folder": "a folder, not a file"}


@pytest.mark.parametrize("kind", UNREADABLE)
def test_unreadable_shards_of_a_folder_without_index_are_refused(tmp_path, kind):
    """They were skipped in silence: digest and stats covered fewer tensors than the folder has (issue 23)."""
    rng = np.random.default_rng(24)
    folder = tmp_path / "m"
    folder.mkdir()
    save({"a": random_tensor(rng, "F32", (4,))}, folder / "model-00001-of-00002.safetensors")
    path = _unreadable_entry(folder, kind)
    with pytest.raises(InvalidCheckpointError) as caught:
        Checkpoint(folder)
    assert str(path) in str(caught.value) and UNREADABLE[kind] in str(caught.value)


@pytest.mark.parametrize("kind", [*UNREADABLE, "file"])
def test_index_that_cannot_be_read_is_refused_not_ignored(tmp_path, kind):
    """An index that is a folder (or a link to nowhere, a FIFO) was ignored and the folder read as if it
    had none; a shard the index lists that is not a file was called missing."""
    rng = np.random.default_rng(25)
    folder = save_sharded({"a": random_tensor(rng, "F32", (2,)), "b": random_tensor(rng, "F32", (2,))},
                          tmp_path / "m", 2)
    if kind == "file":  # the index is fine; the second shard it lists is a folder
        shard = folder / "model-00002-of-00002.safetensors"
        shard.unlink()
        shard.mkdir()
        with pytest.raises(InvalidCheckpointError, match=f"{shard}: a folder, not a file"):
            Checkpoint(folder)
        return
    index = folder / "model.safetensors.index.json"
    index.unlink()
    if kind == "dangling link":
        index.symlink_to(folder / "gone.json")
    elif kind == "link loop":
        index.symlink_to(index.name)
    elif kind == "fifo":
        os.mkfifo(index)
    else:
        index.mkdir()
    with pytest.raises(InvalidCheckpointError) as caught:
        Checkpoint(folder)
    assert str(index) in str(caught.value) and UNREADABLE[kind] in str(caught.value)


@pytest.mark.parametrize("command", ["digest", "stats", "make", "apply"])
def test_unreadable_shard_is_one_line_for_every_command(tmp_path, command):
    import subprocess
    import sys

    rng = np.random.default_rng(26)
    good, bad = tmp_path / "good", tmp_path / "bad"
    for folder in (good, bad):
        folder.mkdir()
        save({"a": random_tensor(rng, "F32", (4,))}, folder / "model-00001-of-00002.safetensors")
    path = _unreadable_entry(bad, "dangling link")
    patch = tmp_path / "p.pulsediff"
    if command == "apply":
        make_patch(good, good, patch, device="cpu")
    args = {"digest": ["digest", bad], "stats": ["stats", good, bad], "make": ["make", good, bad, "-o", patch],
            "apply": ["apply", bad, patch, "-o", tmp_path / "out"]}[command]
    proc = subprocess.run([sys.executable, "-m", "pulsediff", *map(str, args)], capture_output=True, timeout=300)
    lines = proc.stderr.decode().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr.decode()
    assert str(path) in lines[0] and "dangling symbolic link" in lines[0]
    assert not (tmp_path / "out").exists() and (command == "apply" or not patch.exists())


def test_folder_file_reads_are_exact_and_bounded(tmp_path, monkeypatch):
    """A carried file is read whole; one past the limit, or not the size expected, is refused."""
    from pulsediff.io import folder_files
    from pulsediff.errors import FolderFileError

    path = tmp_path / "config.json"
    data = bytes(range(256)) * 40
    path.write_bytes(data)
    assert folder_files.read_folder_file(path) == data
    assert folder_files.read_folder_file(path, len(data)) == data
    with pytest.raises(FolderFileError, match="changed while it was read"):
        folder_files.read_folder_file(path, len(data) - 1)
    monkeypatch.setattr(folder_files, "MAX_FILE_BYTES", len(data) - 1)
    with pytest.raises(FolderFileError, match="larger than"):
        folder_files.read_folder_file(path)
    monkeypatch.setattr(folder_files, "MAX_FILE_BYTES", len(data))
    assert folder_files.read_folder_file(path) == data


def test_a_folder_file_that_grows_while_read_is_refused(tmp_path, monkeypatch):
    """fstat says one size, the read finds more: the file changed under us."""
    import os as os_module

    from pulsediff.io import folder_files
    from pulsediff.errors import FolderFileError

    path = tmp_path / "tokenizer.json"
    path.write_bytes(b"x" * 1000)
    real_fstat = os_module.fstat

    def stale_fstat(fd):  # the size as it was before a writer appended
        st = real_fstat(fd)
        return os_module.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, st.st_uid, st.st_gid,
                                      st.st_size - 10, st.st_atime, st.st_mtime, st.st_ctime))

    monkeypatch.setattr(folder_files.os, "fstat", stale_fstat)
    with pytest.raises(FolderFileError, match="changed while it was read"):
        folder_files.read_folder_file(path)


_ODD_VALUES = [None, True, False, -1, 0, 1, 7, 2**63 - 1, 2**63, 1.0, "4", [], {}, [2], [2, 3], [0, 8], [8, 0],
               [0, 16], [0, 2**63], [True, 8], [0, 8.0], list(range(65)), [1] * 64, [2, 4, 6], "BF16", "F32",
               "bf16", "I64", "BOOL"]
_NAMES = ["w", "", "x" * 4096, "x" * 4097, "é" * 2048, "é" * 2049, "model.layers.0.weight", "\u0000"]


@settings(max_examples=400, deadline=None)
@given(name=st.sampled_from(_NAMES), dtype=st.sampled_from(_ODD_VALUES), shape=st.sampled_from(_ODD_VALUES),
       offsets=st.sampled_from(_ODD_VALUES), extra=st.booleans(), info_kind=st.sampled_from(["dict", "list", "str"]))
def test_fast_entry_reading_accepts_only_what_the_field_by_field_check_does(name, dtype, shape, offsets, extra,
                                                                            info_kind):
    """safetensors_header._entry_checked, the fast reading of a tensor entry, gives the entry
    _entry gives, and nothing (so that _entry refuses it in words) for anything _entry refuses."""
    from pulsediff.io.safetensors_header import HeaderError, _entry, _entry_checked

    info = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
    if extra:
        info["note"] = "kept out of the entry"
    if info_kind != "dict":
        info = list(info.values()) if info_kind == "list" else "x"
    fast = _entry_checked(name, info)
    try:
        slow = _entry(name, info)
    except HeaderError:
        assert fast is None
        return
    assert fast is None or (fast == slow and type(fast.shape) is tuple)


def test_fast_entry_reading_takes_ordinary_entries():
    from pulsediff.io.safetensors_header import _entry, _entry_checked

    for info in ({"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, {"dtype": "BF16", "shape": [], "data_offsets": [6, 8]},
                 {"dtype": "I64", "shape": [0, 3], "data_offsets": [8, 8]}):
        assert _entry_checked("model.w", info) == _entry("model.w", info)
