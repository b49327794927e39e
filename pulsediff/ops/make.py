"""`make_patch`: diff two checkpoints into a patch.

One pass over the target checkpoint in its file order, tensor by tensor: each
target tensor is read once (memory-mapped), its base counterpart once, the
kernel finds the changed elements, a codec encodes them into a section. The
sections are spooled (memory, then a temporary file past 256 MiB) because the
header, which leads the patch, holds digests known only at the end.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path
from typing import BinaryIO

from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Mapping

from pulsediff.version import __version__
from pulsediff.io.atomic import StagedFiles, check_inputs
from pulsediff.io.checkpoint import Checkpoint, TensorData, TensorView
from pulsediff.ops.live import StateDict, open_source
from pulsediff.codecs import DEFAULT_SPARSE_CODEC, SPARSE_CODECS, get_codec
from pulsediff.codecs.base import to_host, zstd_compress
from pulsediff.codecs.gap_zstd import gap_width
from pulsediff.format.digest import DEFAULT_SCHEME, DigestScheme, TensorId, format_word_sum
from pulsediff.errors import UsageError, refuse_existing, refuse_folder_for_file
from pulsediff.io.folder_files import file_hash, folder_files, read_folder_file
from pulsediff.format.container import (FORMAT_MAJOR, WRITE_VERSIONS, SectionRef, encode_header, encode_preamble,
                                        section_checksum)
from pulsediff.kernels import get_backend
from pulsediff.kernels.threads import inline, num_threads, parallel_map
from pulsediff.format.header import FILE_CODEC, LAYOUT_CODEC, FileRecord, Layout, LayoutFile, PatchHeader, TensorRecord
from pulsediff.runtime.progress import SILENT, Progress
from pulsediff.io.safetensors_header import build_header

SPOOL_IN_MEMORY = 256 * 1024 * 1024


@dataclass
class TargetSource:
    """The checkpoint a patch builds: its file layout and its tensors, in layout order."""

    precision: str
    kind: str
    layout_blob: bytes
    layout_files: list[LayoutFile]
    index_len: int | None
    entries: list[tuple[str, int]]  # (name, bytes as stored) in layout order, for progress
    get: Callable[[str], TensorData]
    # A folder's other files (config, tokenizer, ...): names in order, and their bytes on demand.
    file_names: list[str] = field(default_factory=list)
    read_file: Callable[[str], bytes] | None = None
    skipped: list[str] = field(default_factory=list)  # folder entries left out, to tell the user
    # True when `get` hands out buffers that the next `get` overwrites (squash rebuilds
    # tensors in reused scratch memory): then each tensor is encoded before the next is read.
    reuses_buffers: bool = False
    prefetch: Callable[[str], None] | None = None  # reads a tensor's bytes into memory ahead of `get`
    release: Callable[[str], None] | None = None  # done with a tensor's bytes: unmap them
    inputs: list | None = None  # the checkpoints `get` reads (None: unknown, so every mapped file is checked)
    # A tensor as `get` gives it, its bits already in GPU memory (a live CUDA tensor's own), or None.
    get_device: Callable[[str], TensorData | None] | None = None
    # bf16 mode: whether any of the trainer's tensors is cast (the patch's layout.cast, FORMAT.md §5.2).
    cast: bool | None = None

    @classmethod
    def of_view(cls, new: TensorView, skip_unsupported: bool = False) -> "TargetSource":
        blob, files, index_len, cast = _target_layout(new)
        entries = [(e.name, e.nbytes) for shard in new.ckpt.shards for e in shard.header.tensors]
        others = folder_files(new.ckpt, skip_unsupported=skip_unsupported)
        found = others.by_name()
        return cls(new.precision, new.ckpt.kind, blob, files, index_len, entries, new.get,
                   [f.name for f in others.files], lambda name: read_folder_file(found[name].path, found[name].size),
                   others.skipped, prefetch=new.ckpt.prefetch, release=new.ckpt.release,
                   inputs=[new.ckpt], get_device=_device_data_of(new),
                   cast=cast if new.precision == "bf16" else None)


def make_patch(
    old: str | Path | Mapping | None,
    new: str | Path | Mapping,
    out: str | Path | BinaryIO,
    *,
    precision: str = "exact",
    codec: str = DEFAULT_SPARSE_CODEC,
    device: str | None = None,
    progress: Progress = SILENT,
    skip_unsupported: bool = False,
    skipped: list[str] | None = None,
    force: bool = False,
    digest: str = DEFAULT_SCHEME.name,
    unrelated: list[str] | None = None,
    format_version: int = FORMAT_MAJOR,
) -> PatchHeader:
    """Write a patch that turns checkpoint `old` into `new` (or its BF16 cast) to `out`.

    `old` None makes an anchor: a patch from the empty checkpoint, every tensor
    carried whole (compressed). `old` and `new` may also be mappings of name ->
    torch tensor (a state dict, on CPU or CUDA), seen as the file
    `safetensors.torch.save_file` would write (pulsediff.ops.live). `out` is a path (written atomically), "-" for
    stdout, or a binary stream. Returns the patch header. A folder's other
    files travel with it (pulsediff/io/folder_files.py); weights in other formats
    and huge files are refused unless `skip_unsupported`, and what was left
    out is appended to `skipped`. An existing `out` file is refused (OutputExistsError) unless `force`; a
    folder (or a name ending in '/') is refused whatever `force` (UsageError). `digest`: how
    tensors are hashed (FORMAT.md §3): "tree", the default, or "flat", which pulsediff before
    format 1.4 reads too. `format_version`: the major version to write (FORMAT.md §11): 2, the
    default, or 1 (a 1.5 patch, which pulsediff before format 2.0 reads). `unrelated`: where to
    append unrelated_reason's phrase when the pair looks unrelated, found from the headers this
    make reads anyway (an 18k-tensor checkpoint's header takes a quarter of a second to read).
    """
    from pulsediff.ops.inspect import digest_scheme

    check_choices(codec, precision)
    if format_version not in WRITE_VERSIONS:
        raise UsageError(f"unknown format version {format_version!r}; choose one of "
                         f"{', '.join(map(str, sorted(WRITE_VERSIONS)))}")
    scheme = digest_scheme(digest)
    refuse_folder_for_file(out, "a patch is a single file", patch_name(new))
    refuse_existing(out, force)
    if new is None:
        raise UsageError("NEW must be a checkpoint or a mapping of tensors")
    with open_source(new) as new_ckpt:
        target = TargetSource.of_view(TensorView(new_ckpt, precision), skip_unsupported)
        if skipped is not None:
            skipped.extend(target.skipped)
        with open_source(old) as old_ckpt:  # after NEW's folder is read, as before: the same error first
            if unrelated is not None and (reason := _unrelated(old_ckpt, new_ckpt, precision)) is not None:
                unrelated.append(reason)
            return write_patch(old_ckpt, target, out, codec=codec, device=device, progress=progress,
                               scheme=scheme, major=format_version)


def _device_data_of(view: TensorView):
    """StateDict.device_data for the view's precision, where the checkpoint is a state dict."""
    if not isinstance(view.ckpt, StateDict):
        return None
    return lambda name: view.ckpt.device_data(name, view.precision)


def _backend_for(device: str | None, scheme: DigestScheme, inputs: list) -> object:
    """The kernels make runs on: for state dicts with tensors in GPU memory under the tree, the
    GPU's where it can run ("auto"; kernels.backend_for_gpu_data); else get_backend's (the CPU
    for "auto": files and CPU tensors are compared where they are)."""
    from pulsediff.kernels import backend_for_gpu_data, cpu_backend

    if scheme.tree and any(getattr(ckpt, "on_gpu", False) for ckpt in inputs):
        return backend_for_gpu_data(device) or cpu_backend()
    return get_backend(device)


def on_device(scheme: DigestScheme, backend) -> bool:
    """Whether make runs where a GPU holds the tensors: the CUDA backend, and hashes a GPU can take
    (the tree). Then each tensor is on the device once (a live CUDA tensor in place; else copied
    over once), hashed, summed and compared there, and only the compact changes (and tensors
    carried whole) cross to the host. Under the flat scheme the hashes are the host's."""
    return scheme.tree and not backend.__name__.endswith(".cpu")


def _getter_on_device(get: Callable[[str], TensorData], get_device, backend) -> Callable[[str], TensorData]:
    """`get`, its bits on the device: `get_device`'s where it has them, else `get`'s copied over."""
    def on_the_device(name: str) -> TensorData:
        t = get_device(name) if get_device is not None else None
        if t is None:
            t = get(name)
            t = TensorData(t.name, t.dtype, t.shape, backend.device_bits(t.bits))
        return t

    return on_the_device


def patch_name(new) -> str:
    """A file name to suggest for the patch to `new`: its own name, as a patch."""
    import os

    if not isinstance(new, (str, os.PathLike)):
        return "patch.pulsediff"
    name = Path(new).name
    return (name.removesuffix(".safetensors") or "patch") + ".pulsediff"


# Below this share of the target's elements in tensors the base has too (same name, shape and dtype), a
# pair looks unrelated: two different models, or a checkpoint and something else. Consecutive steps share
# every tensor; a resized vocabulary still leaves the layers (most elements) shared. A share of changed
# elements would not tell: consecutive FP32 steps change nearly every element too.
RELATED_SHARE = 0.5


def unrelated_reason(old, new, precision: str = "exact") -> str | None:
    """Why checkpoints `old` and `new` look unrelated, in a phrase; None when they do not (or `old` is None
    or empty: an anchor). Unrelated: less than RELATED_SHARE of `new`'s elements lie in tensors that `old`
    has too with the same name, shape and dtype (under `precision`), the part a patch can build on.

    Reads the checkpoints' headers only, so it is asked before the patch is made: once the patch is
    out, an input may change under its name without that being pulsediff's concern.
    """
    if old is None:
        return None
    with open_source(new) as new_ckpt, open_source(old) as old_ckpt:  # in make_patch's order: the same error first
        return _unrelated(old_ckpt, new_ckpt, precision)


def _unrelated(old_ckpt: Checkpoint, new_ckpt: Checkpoint, precision: str) -> str | None:
    """unrelated_reason of two open checkpoints."""
    if not old_ckpt.names:
        return None
    base, target = TensorView(old_ckpt, precision), TensorView(new_ckpt, precision)
    total = shared = 0
    for name in new_ckpt.names:
        numel = new_ckpt.entry(name).numel
        total += numel
        if (name in old_ckpt and base.dtype_of(name) is target.dtype_of(name)
                and tuple(base.shape_of(name)) == tuple(target.shape_of(name))):
            shared += numel
    if shared >= RELATED_SHARE * total:
        return None
    if shared == 0:
        return "they have no tensor in common (same name, shape and dtype), so the patch carries the target whole"
    share = 100 * shared / total
    return (f"only {f'{share:.0f}%' if share >= 1 else 'under 1%'} of the target's elements are in tensors the "
            "base has too (same name, shape and dtype); the patch carries the rest whole")


def make_patch_bytes(old, new, **options) -> bytes:
    """`make_patch` into memory: the patch file's bytes (for a trainer that sends them itself)."""
    import io

    buffer = io.BytesIO()
    make_patch(old, new, buffer, **options)
    return buffer.getvalue()


def check_choices(codec: str, precision: str) -> None:
    if codec not in SPARSE_CODECS:
        raise UsageError(f"unknown codec {codec!r}; choose one of {', '.join(SPARSE_CODECS)}")
    if precision not in ("exact", "bf16"):
        raise UsageError(f"unknown precision {precision!r}; choose exact or bf16")


def write_patch(old: str | Path | Checkpoint | None, target: TargetSource, out, *, codec: str, device: str | None,
                progress: Progress, scheme: DigestScheme = DEFAULT_SCHEME, major: int = FORMAT_MAJOR) -> PatchHeader:
    """Diff checkpoint `old` (None: empty; or one the caller opened, which this closes) against
    `target` and write the patch to `out`, its tensors hashed under `scheme`, as format `major`."""
    opened = old if isinstance(old, Checkpoint) else open_source(old)
    with opened as old_ckpt, tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY) as spool:
        backend = _backend_for(device, scheme, [old_ckpt, *(target.inputs or ())])
        header = _diff(TensorView(old_ckpt, target.precision), target, codec, backend, spool, progress, scheme)
        inputs = [old_ckpt, *target.inputs] if target.inputs is not None else None
        check_inputs(inputs)  # an input that shrank while read gave zeros: no patch is made of them
        # Every byte of both inputs is read (the patch is in the spool) and has just been checked: a
        # shrink from now on changes nothing in the patch, so closing must not report one after it is out.
        for ckpt in [old_ckpt, *(target.inputs or ())]:
            ckpt.close(verify=False)
        spool.seek(0)
        header_frame = encode_header(header.to_json(major))
        version = WRITE_VERSIONS[major]
        if isinstance(out, (str, Path)) and str(out) == "-":
            _emit(sys.stdout.buffer, header_frame, spool, version)
            sys.stdout.buffer.flush()
        elif isinstance(out, (str, Path)):
            with StagedFiles(inputs=()) as staged:  # the inputs were checked, then closed, above
                with staged.open(Path(out)) as f:
                    _emit(f, header_frame, spool, version)
                staged.commit()
        else:
            _emit(out, header_frame, spool, version)
    return header


def _emit(f: BinaryIO, header_frame: bytes, spool, version: tuple[int, int]) -> None:
    f.write(encode_preamble(header_frame, version))
    f.write(header_frame)
    shutil.copyfileobj(spool, f, 1 << 22)


def _diff(old: TensorView, target: TargetSource, codec_id: str, backend, spool, progress: Progress,
          scheme: DigestScheme) -> PatchHeader:
    sparse = get_codec(codec_id)
    full = get_codec("full-zstd")
    offset = 0

    def write_section(parts, codec, params) -> SectionRef:
        nonlocal offset
        data = b"".join(parts)
        spool.write(data)
        ref = SectionRef(offset, len(data), section_checksum(data), codec, params)
        offset += len(data)
        return ref

    layout_ref = write_section((zstd_compress(target.layout_blob),), LAYOUT_CODEC, {})
    layout_digest = file_hash(target.layout_blob)
    target_names = {name for name, _ in target.entries}
    total = sum(n for _, n in target.entries) + sum(old.ckpt.entry(n).nbytes for n in old.ckpt.names)
    progress.begin("make", total, len(target.entries) + len(old.ckpt.names))

    records: list[TensorRecord] = []
    base_ids: list[TensorId] = []
    get_target, get_base = target.get, old.get
    device_mode = on_device(scheme, backend)
    if device_mode:
        get_target = _getter_on_device(target.get, target.get_device, backend)
        get_base = _getter_on_device(old.get, _device_data_of(old), backend)

    def release(name: str) -> None:  # the tensor's record is final: its pages may go
        if target.release is not None:
            target.release(name)
        if name in old.ckpt:
            old.ckpt.release(name)

    def record_of(tgt, base, result) -> TensorRecord:
        """The record of a tensor with a base, from _check_and_encode's result; in order."""
        (tgt_hash, tgt_sum, base_hash, base_sum), kind, diffed = result
        base_ids.append(TensorId(base.name, base.dtype.name, base.shape, base_hash))
        progress.advance(old.ckpt.entry(base.name).nbytes)
        if kind == "same":
            record = TensorRecord(tgt.name, tgt.dtype, tgt.shape, "same", 0, tgt_hash, base_hash,
                                  target_sum=tgt_sum, base_sum=tgt_sum, scheme=scheme)
        else:
            changed, enc = diffed if kind == "diff" else (tgt.bits.size, None)
            codec, op = (sparse, "patch") if enc is not None else (full, "full")
            if enc is None:
                enc = full.encode(None, to_host(tgt.bits), None, None, dtype=tgt.dtype)
            record = TensorRecord(tgt.name, tgt.dtype, tgt.shape, op, changed, tgt_hash,
                                  base_hash if op == "patch" else None,
                                  write_section(enc.parts, codec.id, enc.params),
                                  tgt_sum, base_sum if op == "patch" else None, scheme)
        release(tgt.name)
        return record

    # Tensors are checked and encoded side by side (hashes and compares on the kernel
    # threads, each one's entropy coding on a thread of its own) while the next are
    # read; sections are written in order.
    # PULSEDIFF_THREADS=1 means one busy thread: then each tensor is encoded where it is read,
    # not on an encoding thread beside the main one's hashing (which made "1 thread" use two
    # cores: issue 27's thread scaling compared two cores with two cores).
    # On the device, the GPU checks and compares on this thread and the entropy coding of what it
    # found (host arrays only) runs on the encoding threads meanwhile.
    encoder = _Encoder(pipelined=num_threads() > 1 and (device_mode or backend.__name__.endswith(".cpu")
                                                        and not target.reuses_buffers))
    ahead = _ReadAhead(old.ckpt, target.prefetch, target.entries)
    # Small tensor pairs are compared and coded many to a call (_PairBatch), where the per-tensor
    # path costs more than the work: an MoE checkpoint's 18k experts.
    batchable = (not device_mode and backend.__name__.endswith(".cpu") and sparse.id == "ctx-rans"
                 and not target.reuses_buffers)
    batch = _PairBatch(scheme, batchable)
    try:
        for k, (name, stored_bytes) in enumerate(target.entries):
            ahead.reached(k)
            tgt = get_target(name)
            base = get_base(name) if name in old.ckpt else None
            joins = batch.takes(tgt, base)
            if not joins:  # the batch's sections come first; a pair of another dtype starts the next batch
                records.extend(batch.submit(encoder))
                joins = batch.takes(tgt, base)
            if base is None:  # no base tensor of that name: carried whole
                tgt_hash, tgt_sum = scheme.checks(tgt.bits, backend)
                records.extend(encoder.finish())  # its section comes first
                enc = full.encode(None, to_host(tgt.bits), None, None, dtype=tgt.dtype)
                records.append(TensorRecord(tgt.name, tgt.dtype, tgt.shape, "full", tgt.bits.size, tgt_hash,
                                            section=write_section(enc.parts, full.id, enc.params),
                                            target_sum=tgt_sum, scheme=scheme))
                release(name)
            elif joins:
                batch.add(tgt, base, partial(record_of, tgt, base))
                if batch.full():
                    records.extend(batch.submit(encoder))
            elif device_mode:
                result, tgt_meta, base_meta, held = _compare_on_device(tgt, base, sparse, backend, scheme)
                del tgt, base  # their device memory (a file's tensors copied over) goes now
                records.extend(encoder.submit(partial(_code_on_host, result), partial(record_of, tgt_meta, base_meta),
                                              held))
            else:
                # Hashing, compare and coding are one task, so that an unchanged tensor (its
                # hashes equal) does not drain the pipeline: the main thread only reads ahead
                # and writes the finished sections in order.
                alone = encoder.pipelined and tgt.bits.nbytes <= SPLIT_BYTES
                records.extend(encoder.submit(partial(_check_and_encode, tgt, base, sparse, backend, scheme, alone),
                                              partial(record_of, tgt, base), tgt.bits.nbytes + base.bits.nbytes))
            progress.advance(stored_bytes)
        records.extend(batch.submit(encoder))
        records.extend(encoder.finish())
    finally:
        ahead.close()
        encoder.close()

    removed = [n for n in old.ckpt.names if n not in target_names]
    for name in removed:
        base = get_base(name)
        base_ids.append(TensorId(name, base.dtype.name, base.shape, scheme.tensor_hash(base.bits, backend)))
        old.ckpt.release(name)
        progress.advance(old.ckpt.entry(name).nbytes)
    progress.end()

    files, removed_files = _diff_files(old.ckpt, target, write_section)
    target_ids = [TensorId(r.name, r.dtype.name, r.shape, r.target_hash) for r in records]
    target_bytes = sum(8 + f.header_len for f in target.layout_files) + sum(r.nbytes for r in records)
    target_bytes += (target.index_len or 0) + sum(f.size for f in files)
    return PatchHeader(
        tool=f"pulsediff {__version__}",
        precision=target.precision,
        base_digest=scheme.digest(base_ids),
        target_digest=scheme.digest(target_ids),
        base_tensors=len(base_ids),
        target_bytes=target_bytes,
        layout=Layout(target.kind, tuple(target.layout_files), target.index_len, layout_ref, layout_digest,
                      target.cast),
        tensors=tuple(records),
        removed=tuple(sorted(removed)),
        files=tuple(files),
        removed_files=tuple(removed_files),
    )


# A tensor pair of at most this many bytes a side is compared on its encoding thread alone when
# tensors are encoded side by side: as many of those run as there are cores, so handing its few
# ranges to the kernel threads only queued them behind other tensors' (1 GiB pair, 2 threads:
# 3-5% less time). Larger ones are spread over the kernel threads: a single tensor can be a
# quarter of a checkpoint (embeddings), too much for one core on a many-core host.
SPLIT_BYTES = 16 << 20


def _check_and_encode(tgt, base, sparse, backend, scheme: DigestScheme, alone: bool = False):
    """One tensor with a base, as a task: both tensors' hash and word sum, and, unless the base has
    another dtype or shape (then carried whole), the compare and the sparse coding. Where the codec
    fuses the checks into its compare (ctx-rans on the CPU), all in one read, and "same" means no
    element differs; otherwise the checks come first, and equal XXH3-128 hashes stand for equal
    bits (as they do for the digests) and skip the compare. Returns ((target hash, target sum,
    base hash, base sum), "same" | "full" | "diff", encode_pair's result).
    `alone`: run the kernels on this thread only (a small tensor while others are encoded)."""
    comparable = base.dtype is tgt.dtype and base.shape == tgt.shape
    if comparable and sparse.fuses_checks(backend):
        # The checks in the compare's own read of the pair: each byte crosses the memory bus
        # once instead of twice (issue 27).
        base_hasher, tgt_hasher = scheme.hasher(), scheme.hasher()
        with inline() if alone else nullcontext():
            changed, enc, base_sum, tgt_sum = sparse.encode_pair_checked(
                base.bits, tgt.bits, base_hasher, tgt_hasher, dtype=tgt.dtype, kernels=backend,
                max_changed=_max_changed(tgt))
        checks = (tgt_hasher.hexdigest(), format_word_sum(tgt_sum), base_hasher.hexdigest(), format_word_sum(base_sum))
        return checks, ("same" if changed == 0 else "diff"), (changed, enc)
    (tgt_hash, tgt_sum), (base_hash, base_sum) = parallel_map(scheme.checks, [(tgt.bits,), (base.bits,)])
    return _code_on_host(_compared(tgt, base, sparse, backend, (tgt_hash, tgt_sum, base_hash, base_sum)))


def _max_changed(tgt) -> int:
    """Sparse while the changes cost less than the dense tensor at a plain gap code's rate."""
    return (tgt.bits.nbytes - 1) // (gap_width(tgt.bits.size) + tgt.dtype.itemsize)


def _compared(tgt, base, sparse, backend, checks):
    """After both tensors' checks (target hash, target sum, base hash, base sum): "full" for a base
    of another dtype or shape, "same" for equal hashes (they stand for equal bits, as they do for
    the digests: no compare), else "diff" with sparse.compare_pair's result, its coding left to
    do. Returns (checks, kind, that result or None)."""
    if not (base.dtype is tgt.dtype and base.shape == tgt.shape):
        return checks, "full", None
    if checks[2] == checks[0]:
        return checks, "same", None
    return checks, "diff", sparse.compare_pair(base.bits, tgt.bits, dtype=tgt.dtype, kernels=backend,
                                               max_changed=_max_changed(tgt))


def _compare_on_device(tgt, base, sparse, backend, scheme: DigestScheme):
    """_check_and_encode's device half, for make on the device: both tensors' checks and the
    compare where the pair lives, the coding left to do (sparse.compare_pair: a callable holding
    the changes on the host). Returns (that result, the target and base as record_of needs them,
    host bytes the result holds): the tensors without their device bits, which record_of reads
    only for a tensor carried whole, whose bits then come to the host here."""
    (tgt_hash, tgt_sum), (base_hash, base_sum) = (scheme.checks(t.bits, backend) for t in (tgt, base))
    result = _compared(tgt, base, sparse, backend, (tgt_hash, tgt_sum, base_hash, base_sum))
    _, kind, compared = result
    whole = kind == "full" or kind == "diff" and compared[1] is None
    tgt_meta = TensorData(tgt.name, tgt.dtype, tgt.shape, to_host(tgt.bits) if whole else None)
    base_meta = TensorData(base.name, base.dtype, base.shape, None)
    # Host bytes the pending coding holds: the whole target, or its changes' zigzag, class (2 B) and
    # rank (8 B) arrays.
    held = tgt.bits.nbytes if whole else (compared[0] * (tgt.dtype.itemsize + 10) if compared else 0)
    return result, tgt_meta, base_meta, held


def _code_on_host(result):
    """_compared's result with its coding done: _check_and_encode's result."""
    checks, kind, compared = result
    if compared is None:
        return checks, kind, None
    changed, code = compared
    return checks, kind, (changed, None if code is None else code())


# How far ahead of the tensor being compared the pair is read into memory (page cache, not
# private memory): enough to keep the disk busy through a large tensor's compare.
READ_AHEAD_BYTES = 512 << 20
# Consecutive tensors are read ahead in groups of about this many bytes, one task each.
READ_GROUP_BYTES = 4 << 20


class _ReadAhead:
    """Reads the tensors after the current one, up to READ_AHEAD_BYTES of the target's, into
    memory on a thread of its own (both checkpoints): on a pair larger than the page cache the
    disk then streams while the CPU hashes and compares, instead of the two taking turns (each
    `get` maps a tensor in whole, waiting for the disk). Measured on the 7B pair (two 13.9 GB
    files, cold caches, alternating): make 34.3 s against 36.6 s without (medians of 3)."""

    def __init__(self, old: Checkpoint, target_prefetch, entries: list[tuple[str, int]]):
        from concurrent.futures import ThreadPoolExecutor

        self._old = old
        self._target = target_prefetch
        self._entries = entries
        self._next = 0  # first entry not handed to the thread yet
        self._ahead = 0  # target bytes handed over past the current entry
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pulsediff-read-ahead")
        self._pending: list = []

    def reached(self, k: int) -> None:
        """The caller is at entry k: keep the entries after it queued up to the budget."""
        if self._target is None:
            return
        if self._next <= k:
            self._next, self._ahead = k + 1, 0
        else:
            self._ahead -= self._entries[k][1]
            if self._ahead > READ_AHEAD_BYTES - READ_GROUP_BYTES:
                return  # topped up once a group's worth is read: else each small tensor would be a task
        while self._next < len(self._entries) and self._ahead < READ_AHEAD_BYTES:
            names, nbytes = [], 0  # small tensors go a group to a task: a future each cost more than their read
            while self._next < len(self._entries) and self._ahead < READ_AHEAD_BYTES and nbytes < READ_GROUP_BYTES:
                name, size = self._entries[self._next]
                names.append(name)
                nbytes += size
                self._ahead += size
                self._next += 1
            self._pending.append(self._pool.submit(self._read, names))
        self._pending = [f for f in self._pending if not f.done()]

    def _read(self, names: list[str]) -> None:
        for name in names:
            self._target(name)
            if name in self._old:
                self._old.prefetch(name)

    def close(self) -> None:
        from concurrent.futures import wait

        for f in self._pending:
            f.cancel()
        wait(self._pending)  # none may still touch a mapping the caller closes next
        self._pool.shutdown()


class _PairBatch:
    """Consecutive small tensor pairs of one dtype, each with a base of its dtype and shape, checked,
    compared and ctx-rans-coded by one kernel call (kernels.cpu_batch.diff_encode_batch) on an
    encoding thread: what _check_and_encode does per tensor, with the same results, where the
    per-tensor path's future, buffers and dozen kernel calls cost more than the work (an MoE
    checkpoint's 18k experts: ~0.6 ms a tensor, against a few microseconds of compare). The
    patch is the same bytes either way (tests/test_make_batch.py)."""

    # Pairs up to this many bytes a side are batched: the per-tensor path's fixed cost is small
    # against a larger pair's compare, and spreads its compare over the kernel threads.
    MAX_BYTES = 1 << 20
    # A batch is handed over once its pairs hold this many bytes a side: large enough that the
    # call's set-up is noise, small enough that both encoding threads get batches to code.
    FULL_BYTES = 4 << 20
    # The sections' first buffer; the kernel grows it (doubling) when the sections need more.
    FIRST_OUT_BYTES = 1 << 16

    def __init__(self, scheme: DigestScheme, enabled: bool):
        self._scheme, self._enabled = scheme, enabled
        self._clear()

    def _clear(self) -> None:
        self._pairs: list = []
        self._records_of: list = []
        self._key = None
        self._bytes = 0

    def takes(self, tgt: TensorData, base: TensorData | None) -> bool:
        """Whether the pair may join (it may start a new batch once this one is handed over)."""
        return (self._enabled and base is not None and base.dtype is tgt.dtype and base.shape == tgt.shape
                and base.bits.size == tgt.bits.size and base.bits.dtype == tgt.bits.dtype  # the kernel reads both
                and 0 < tgt.bits.nbytes <= self.MAX_BYTES and tgt.bits.dtype.itemsize in (1, 2, 4, 8)
                and (self._key is None or self._key == (tgt.dtype, tgt.bits.dtype)))

    def add(self, tgt: TensorData, base: TensorData, record_of) -> None:
        self._key = (tgt.dtype, tgt.bits.dtype)
        self._pairs.append((tgt, base))
        self._records_of.append(record_of)
        self._bytes += tgt.bits.nbytes

    def full(self) -> bool:
        return self._bytes >= self.FULL_BYTES

    def submit(self, encoder: "_Encoder") -> list[TensorRecord]:
        """Hand the batch to `encoder` (nothing when empty); the records finished by then."""
        if not self._pairs:
            return []
        pairs, records_of, nbytes = self._pairs, self._records_of, 2 * self._bytes
        self._clear()
        return encoder.submit_many(partial(_encode_pairs, pairs, self._scheme, self.FIRST_OUT_BYTES),
                                   lambda results: [f(r) for f, r in zip(records_of, results)], nbytes)


def _encode_pairs(pairs: list, scheme: DigestScheme, first_out: int) -> list:
    """_check_and_encode's result for each (target, base) pair of a _PairBatch, in one kernel call."""
    import numpy as np

    from pulsediff.codecs.ctx_rans import class_field, encoded_at
    from pulsediff.kernels import cpu_batch as kb

    tgt0 = pairs[0][0]
    shift, bits = class_field(tgt0.dtype.name)
    news = [np.ascontiguousarray(t.bits).reshape(-1) for t, _ in pairs]  # held until the call returns
    olds = [np.ascontiguousarray(b.bits).reshape(-1) for _, b in pairs]
    with inline():  # on this encoding thread, as _check_and_encode hashes a small tensor
        hashes = [(scheme.tensor_hash(n), scheme.tensor_hash(o)) for n, o in zip(news, olds)]
    rows = np.empty((len(pairs), kb.ROW_COLUMNS), np.int64)
    out = kb.diff_encode_batch(np.array([o.__array_interface__["data"][0] for o in olds], np.int64),
                               np.array([n.__array_interface__["data"][0] for n in news], np.int64),
                               np.array([n.size for n in news], np.int64), np.empty(0, news[0].dtype), shift, bits,
                               np.array([_max_changed(t) for t, _ in pairs], np.int64), rows,
                               np.empty(first_out, np.uint8))
    data = memoryview(out)
    results = []
    for (tgt_hash, base_hash), row in zip(hashes, rows.tolist()):
        changed = row[kb.R_CHANGED]
        checks = (tgt_hash, format_word_sum(row[kb.R_NEW_SUM] & _U64), base_hash, format_word_sum(row[kb.R_OLD_SUM] & _U64))
        if changed == 0:
            results.append((checks, "same", (0, None)))
            continue
        at = row[kb.R_SECTION]
        if at < 0:  # denser than a sparse section pays for: carried whole, as _max_changed says
            results.append((checks, "diff", (changed, None)))
            continue
        lengths = (row[kb.R_TABLE], row[kb.R_POSITIONS], row[kb.R_FREQUENCIES], row[kb.R_VALUES])
        results.append((checks, "diff", (changed, encoded_at(data, at, changed, shift, bits, lengths,
                                                             row[kb.R_ESCAPES], news[0].itemsize))))
    return results


_U64 = (1 << 64) - 1


class _Encoder:
    """Encodes tensors on threads of their own while the caller reads the next ones.

    The entropy coders are sequential per tensor, so tensors are coded side
    by side, as many at once as there are worker threads (their compares
    share the kernel threads). `submit` hands over one tensor and returns the
    records finished by then, oldest first, so sections are written in
    order; `finish` waits for all. Not pipelined (`pipelined` False: one
    thread, or buffers that the next read reuses), each encoding runs at once.
    On the device, what runs here is the coding alone (_code_on_host).
    """

    def __init__(self, pipelined: bool):
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor

        self._depth = num_threads()
        self._pool = ThreadPoolExecutor(max_workers=self._depth, thread_name_prefix="pulsediff-encode") \
            if pipelined else None
        self._pending = deque()

    @property
    def pipelined(self) -> bool:
        return self._pool is not None

    # Tensors in flight hold their inputs (memory of their own when cast to BF16):
    # past this many bytes, wait for the oldest before taking more. Checked once a
    # tensor is handed over, so the peak is about max(this, one tensor) plus the
    # next tensor, read while the oldest finishes.
    MAX_BYTES_IN_FLIGHT = 1 << 30

    def submit(self, encode, record_of, nbytes: int = 0) -> list[TensorRecord]:
        return self.submit_many(encode, lambda result: [record_of(result)], nbytes)

    def submit_many(self, encode, records_of, nbytes: int = 0) -> list[TensorRecord]:
        """`submit` for a task that codes several tensors: `records_of` turns its result into their
        records, in order."""
        if self._pool is None:
            return records_of(encode())
        self._pending.append((self._pool.submit(encode), records_of, nbytes))
        done = []
        while len(self._pending) > 1 and (len(self._pending) > self._depth or
                                          sum(p[2] for p in self._pending) > self.MAX_BYTES_IN_FLIGHT):
            done.extend(self._take())
        return done

    def _take(self) -> list[TensorRecord]:
        future, records_of, _ = self._pending.popleft()
        return records_of(future.result())

    def finish(self) -> list[TensorRecord]:
        return [record for _ in range(len(self._pending)) for record in self._take()]

    def close(self) -> None:
        if self._pool is not None:
            for future, _, _ in self._pending:
                future.cancel()
            self._pool.shutdown(wait=True)


def _diff_files(old: Checkpoint, target: TargetSource, write_section) -> tuple[list[FileRecord], list[str]]:
    """The target folder's other files: by hash when the base folder has the same bytes, else whole."""
    if target.kind != "dir":
        return [], []
    base_files = folder_files(old, skip_unsupported=True).by_name()
    records = []
    for name in target.file_names:
        data = target.read_file(name)
        digest = file_hash(data)
        base = base_files.get(name)
        if base is not None and base.size == len(data) and file_hash(read_folder_file(base.path)) == digest:
            records.append(FileRecord(name, len(data), digest, "same"))
        else:
            records.append(FileRecord(name, len(data), digest, "full",
                                      write_section((zstd_compress(data),), FILE_CODEC, {})))
    removed = sorted(set(base_files) - set(target.file_names))
    return records, removed


def _target_layout(new: TensorView) -> tuple[bytes, list[LayoutFile], int | None, bool]:
    """The target's file headers (and index), as the bytes apply will write, and whether the
    view casts any tensor (layout.cast, FORMAT.md §5.2).

    Exact mode keeps NEW's header bytes verbatim, so the rebuilt files are
    byte-identical. In bf16 mode a shard with cast tensors gets a canonical
    header describing the BF16 tensors; one without keeps its bytes.
    """
    blobs: list[bytes] = []
    files: list[LayoutFile] = []
    for shard in new.ckpt.shards:
        entries = shard.header.tensors
        if any(new.casts(e.dtype) for e in entries):
            raw = build_header(shard.header.metadata, [
                (e.name, new.dtype_of(e.name).name, e.shape, e.numel * new.dtype_of(e.name).itemsize) for e in entries
            ])
        else:
            raw = shard.header.raw
        blobs.append(raw)
        files.append(LayoutFile(shard.name, len(raw), len(entries)))
    cast = any(new.casts(new.ckpt.entry(n).dtype) for n in new.ckpt.names)
    index = new.ckpt.index_bytes
    if index is not None and new.precision == "bf16" and cast:
        index = _bf16_index(index, new)
    if index is not None:
        blobs.append(index)
    return b"".join(blobs), files, (len(index) if index is not None else None), cast


def _bf16_index(index_bytes: bytes, new: TensorView) -> bytes:
    """The index with `metadata.total_size` updated to the BF16 tensors' size."""
    index = json.loads(index_bytes)
    metadata = index.get("metadata")
    if isinstance(metadata, dict) and "total_size" in metadata:
        metadata["total_size"] = sum(
            new.ckpt.entry(n).numel * new.dtype_of(n).itemsize for n in new.ckpt.names
        )
    return (json.dumps(index, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
