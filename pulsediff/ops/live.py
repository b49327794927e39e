"""Patches on live tensors: state dicts held in memory by a trainer or an inference worker.

A trainer holds its new policy in memory and a worker holds the old one;
neither should write a checkpoint file just to diff or patch it.

- `make_patch` (pulsediff.ops.make) accepts a mapping of name -> torch tensor for
  OLD and NEW (or a mapping for one and a checkpoint file for the other):
  `StateDict` presents the mapping as a checkpoint whose single file is
  what `safetensors.torch.save_file(mapping)` would write. So a patch made
  from live tensors applies to files, and one made from files applies to
  live tensors, bit for bit.
- `apply_to_state_dict` patches a mapping of live tensors in place, touching
  only the elements that change.

What is checked, and what it costs (docs/FORMAT.md §7.1), in one of two ways:

- `check="digests"` (the default for tensors in CPU memory, and for patches
  older than format 1.2): the live tensors' digest is computed before anything
  is written (every base tensor hashed, as for files), each tensor's rebuilt
  values are checked against the patch's target hash before any of them is
  written. CPU tensors are read in place; a CUDA tensor is copied to the host.
- `check="sums"` (the default when a tensor lives on a GPU and the patch is
  1.2 or later): every tensor's word sum (§3.1) is computed where it lives and
  compared with the patch's base sums before anything is written; each patched
  tensor is updated where it lives and its word sum checked against the
  target's. For ctx-rans sections nothing but the entropy decode runs on the
  host: the class counts, the rank walk and the in-place update run on the
  tensor's device (kernels' `chunk_class_starts`, `ranked_positions`,
  `add_at`), and only the changed elements' ranks and deltas cross the bus.

Either way a failure part-way through restores the tensors already changed
from an undo log of their old values at the changed positions.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import io
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from pulsediff.io.checkpoint import Checkpoint, ShardFile, TensorView
from pulsediff.format.digest import DEFAULT_SCHEME, DigestScheme
from pulsediff.io.dtypes import DTYPES, DType
from pulsediff.errors import BaseMismatchError, CorruptPatchError, TensorMismatchError, UsageError
from pulsediff.io.safetensors_header import ParsedHeader, TensorEntry, build_header

__all__ = ["StateDict", "apply_to_state_dict", "state_dict_digest", "LiveApplyResult", "revert"]

_BY_TORCH_NAME = {d.torch_name: d for d in DTYPES.values() if d.torch_name}
# safetensors writes tensors sorted by dtype, in the order of its Rust `Dtype` enum, last first, then
# by name; following it makes a state dict's patch the very patch of the file save_file writes
# (tests/test_live.py checks this against the installed safetensors).
_SAFETENSORS_DTYPE_RANK = {name: rank for rank, name in enumerate(
    ["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16", "BF16", "I32", "U32", "F32",
     "F64", "I64", "U64"])}


_BY_TORCH_DTYPE: dict = {}  # torch.dtype -> DType, filled as met (str(dtype) costs a microsecond a tensor)


def dtype_of(tensor) -> DType:
    dtype = _BY_TORCH_DTYPE.get(tensor.dtype)
    if dtype is None:
        dtype = _BY_TORCH_NAME.get(str(tensor.dtype).removeprefix("torch."))
        if dtype is None:
            raise UsageError(f"tensors of {tensor.dtype} cannot be patched (safetensors has no such dtype)")
        _BY_TORCH_DTYPE[tensor.dtype] = dtype
    return dtype


def host_bytes(tensor) -> np.ndarray:
    """The tensor's bytes as a uint8 array: a view of its memory for a contiguous CPU tensor, else a copy."""
    import torch

    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return np.empty(0, np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


class StateDict(Checkpoint):
    """A mapping of name -> torch tensor seen as a one-file checkpoint.

    The file is the one `safetensors.torch.save_file(tensors, metadata=...)`
    writes: tensors ordered by dtype (safetensors' own order, last first),
    then by name.
    """

    def __init__(self, tensors: Mapping, metadata: dict[str, str] | None = None):  # noqa: super() would open a path
        self.path = Path("<state dict>")
        self.kind = "file"
        self.index_bytes = None
        _check_items(tensors)
        self._tensors = dict(tensors)
        dtypes = {name: dtype_of(t) for name, t in self._tensors.items()}
        order = sorted(self._tensors, key=lambda n: (-_SAFETENSORS_DTYPE_RANK[dtypes[n].name], n))
        entries, offset = [], 0
        for name in order:
            t = self._tensors[name]
            nbytes = t.numel() * t.element_size()
            entries.append(TensorEntry(name, dtypes[name], tuple(t.shape), offset, offset + nbytes))
            offset += nbytes
        self.shards = [ShardFile("", self.path, _BuiltHeader(metadata, tuple(entries)), None)]
        self._where = {e.name: (self.shards[0], e) for e in entries}
        self._mapped = set()  # Checkpoint's prefetch and release bookkeeping (nothing is mapped here)
        self._views: dict = {}  # name -> a CPU tensor's bytes as a NumPy view of its memory
        self._unmapping = {}

    def raw_bytes(self, name: str) -> np.ndarray:
        t = self._tensors[name]
        if t.device.type != "cpu":
            return host_bytes(t)
        view = self._views.get(name)  # asked for by the digest, then by the rebuild
        if view is None:
            view = self._views[name] = device_bits(t).view(np.uint8)
        return view

    @property
    def on_gpu(self) -> bool:
        """Whether any tensor lives in GPU memory."""
        return any(t.device.type == "cuda" for t in self._tensors.values())

    def device_data(self, name: str, precision: str):
        """The tensor as TensorView(self, precision).get sees it, its bits a Numba device array
        over the CUDA tensor's own memory (no copy); None for a tensor on the CPU, or one that
        the view casts to BF16 (the cast is the host's: torch's CUDA cast may give NaNs other
        bits than its CPU cast, and a digest must not depend on where it was taken). Only for a
        caller that has the CUDA kernels (kernels.backend_for_gpu_data)."""
        from pulsediff.io.checkpoint import TensorData

        t = self._tensors[name]
        entry = self.entry(name)
        if t.device.type != "cuda" or TensorView(self, precision).casts(entry.dtype):
            return None
        return TensorData(name, entry.dtype, entry.shape, device_bits(t))

    def close(self, verify: bool = True) -> None:
        pass


class _BuiltHeader(ParsedHeader):
    """The header save_file would write for these entries, its bytes built when first asked for
    (make writes them into a patch's layout; an apply never reads them: 0.05 s at 18k tensors)."""

    def __init__(self, metadata: dict[str, str] | None, tensors: tuple):
        object.__setattr__(self, "metadata", metadata)
        object.__setattr__(self, "tensors", tensors)

    @functools.cached_property
    def raw(self) -> bytes:
        return build_header(self.metadata, [(e.name, e.dtype.name, e.shape, e.nbytes) for e in self.tensors])


def open_source(source) -> Checkpoint:
    """A checkpoint from a path, a mapping of live tensors, or None (the empty checkpoint)."""
    from pulsediff.io.checkpoint import open_checkpoint

    return StateDict(source) if isinstance(source, Mapping) else open_checkpoint(source)


def state_dict_digest(tensors: Mapping, precision: str = "exact", scheme: str | DigestScheme = DEFAULT_SCHEME,
                      device: str | None = None) -> str:
    """The digest a patch records for these tensors as base or target (same as for the saved file),
    under `scheme` (its name, "tree" or "flat", or itself). Tensors in GPU memory are hashed there
    under the tree (tensor_ids; `device` "cpu": on host copies)."""
    from pulsediff.ops.inspect import digest_scheme, tensor_ids

    scheme = digest_scheme(scheme)
    return scheme.digest(tensor_ids(TensorView(StateDict(tensors), precision), scheme=scheme, device=device).values())


@dataclass(frozen=True)
class LiveApplyResult:
    status: str  # "applied" or "up-to-date"
    changed_tensors: int  # tensors written to
    changed_elements: int
    target_digest: str


CHECKS = ("auto", "digests", "sums", "prefer-sums")


def apply_to_state_dict(tensors: MutableMapping, patches: list | str | Path | BinaryIO | bytes, *,
                        device: str | None = None, check: str = "auto", expect_target: str | None = None,
                        expect_where: str = "the signed manifest", changes: dict | None = None,
                        sums: dict | None = None, undo_log: list | None = None) -> LiveApplyResult:
    """Apply one patch, or a chain of patches in order, to live tensors in place.

    `tensors` maps names to torch tensors (CPU or CUDA), e.g. `model.state_dict()`
    (whose tensors share memory with the model's parameters). The patches'
    target must have the same tensor names, dtypes and shapes as `tensors`:
    a live model cannot grow or lose a tensor. Each patch is a path, a
    binary stream or bytes. On any error the tensors are as they were.

    `check` chooses how base and target are verified (module docstring):
    "digests", "sums", "auto" (sums when a tensor is on a GPU and the patch
    carries them) or "prefer-sums" (sums wherever the patch carries them, on
    the CPU too, where they cost a third of the digests; digests for a patch
    older than format 1.2). Chosen per patch of a chain. `device` chooses the kernels of the digests path
    (the sums path runs each tensor's kernels where the tensor is).
    `expect_target` (a signed series: its entry's target digest): the last
    patch must have that target, else UntrustedManifestError naming
    `expect_where`, and the tensors are as they were.

    `changes` (a dict, filled only on success): name -> the flat positions written
    in that tensor over the whole chain, an int64 NumPy array holding each once (in
    no particular order), or None where a tensor was written whole. For a consumer that must mirror the writes elsewhere
    (an inference engine's parameters, pulsediff.engines), at the cost of the
    positions' host copy on a GPU.

    `sums` (a dict, for a caller that alone writes the tensors between calls, as
    pulsediff.engines' host state does): name -> the word sum of each tensor as it is,
    which this function gave back last time; they stand in for the sums path's read of
    every tensor before the first patch (wrong ones would defeat that base check, so pass
    only what it gave). Replaced on success by the sums after; left as it was on failure.

    `undo_log` (a list, for a caller that may still have to take a verified apply back, as
    an engine whose other ranks failed does): on success it receives the apply's undo
    log, the old values at every written position, and `revert(undo_log)` puts them back.
    """
    if not isinstance(patches, list):
        patches = [patches]
    if not patches:
        raise UsageError("give at least one patch")
    if check not in CHECKS:
        raise UsageError(f"unknown check {check!r}; choose one of {', '.join(CHECKS)}")
    changed_tensors: set[str] = set()
    changed_elements = 0
    aliases: dict[str, str] = {}  # tied weights, written under one of their names
    undo: list[_Undo] = []  # in write order
    known: dict[str, int] = dict(sums or {})  # word sums known since the last patch (sums path)
    status = "up-to-date"
    target = ""
    try:
        for k, patch in enumerate(patches):
            expect = (expect_target, expect_where) if expect_target is not None and k == len(patches) - 1 else None
            with collector_paused():
                step = _apply_one(tensors, patch, device, check, undo, known, expect)
            target = step.target_digest
            if step.status == "applied":
                status = "applied"
                changed_tensors |= step.names
                changed_elements += step.elements
                aliases.update(step.aliases)
    except BaseException as exc:
        lost = _roll_back(undo)
        if lost:
            exc.add_note("not put back (interrupted during the write): " + ", ".join(sorted(set(lost))))
            if sums is not None:  # those tensors no longer have the sums vouched for
                for name in lost:
                    sums.pop(name, None)
        raise
    if changes is not None:
        written = _written_positions(undo)
        for alias, name in aliases.items():  # the positions of the memory they share
            if name in written:
                written.setdefault(alias, written[name])
        changes.update(written)
    if sums is not None:
        sums.clear()
        sums.update(known)
    if undo_log is not None:
        undo_log.extend(undo)
    return LiveApplyResult(status, len(changed_tensors), changed_elements, target)


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector paused for the block (and resumed after, if it ran before).

    A patch of many tensors makes several objects per tensor (its header's records, views,
    batch rows) while the caller holds many more (a model's modules and parameters): each full
    collection then walks all of them, and on an MoE state dict of 18k tensors those walks cost
    a third of the apply. Nothing made here forms a cycle; reference counting frees it all."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _written_positions(undo: list) -> dict:
    """name -> the positions written (host int64, each once, in no particular order), or None for a
    tensor written whole, from the undo log of a successful apply."""
    parts: dict[str, list | None] = {}
    for entry in _entries(undo):
        if entry.positions is None or parts.get(entry.name, []) is None:
            parts[entry.name] = None
            continue
        positions = entry.positions
        if not isinstance(positions, np.ndarray):  # a device array: a torch tensor, or a Numba one
            positions = positions.cpu().numpy() if hasattr(positions, "cpu") else positions.copy_to_host()
        parts.setdefault(entry.name, []).append(np.asarray(positions, dtype=np.int64))
    return {name: None if got is None else got[0] if len(got) == 1 else union_positions(got) for name, got in parts.items()}


def union_positions(arrays: list) -> np.ndarray:
    """The distinct values of several int64 arrays (a sort, not np.unique: NumPy 2.3's hash-based
    unique took 40 ms per million values)."""
    merged = np.sort(np.concatenate(arrays))
    keep = np.ones(merged.size, bool)
    keep[1:] = merged[1:] != merged[:-1]
    return merged[keep]


@dataclass
class _Step:
    status: str
    target_digest: str
    names: set
    elements: int
    aliases: dict = field(default_factory=dict)  # names written through another's memory (the sums path)


def _apply_one(tensors: MutableMapping, patch, device, check, undo, known, expect=None) -> _Step:
    from pulsediff.format.patch_file import open_patch, read_layout
    from pulsediff.ops.rebuild import rebuild_tensor
    from pulsediff.codecs.base import Scratch
    from pulsediff.ops.inspect import tensor_ids
    from pulsediff.kernels import backend_for_gpu_data, cuda_backend, get_backend, parse_device

    if isinstance(patch, (bytes, bytearray, memoryview)):
        patch = io.BytesIO(bytes(patch))
    reader, header, owned = open_patch(patch)
    try:
        if expect is not None and header.target_digest != expect[0]:
            from pulsediff.errors import UntrustedManifestError

            raise UntrustedManifestError(expect[1], f"the chain ending in {reader.source} rebuilds "
                                                    f"{header.target_digest}, not {expect[0]}, the target its signed "
                                                    f"entry names (a file changed between its check and its use?); "
                                                    f"the tensors are as they were")
        _check_structure(tensors, header.tensors)
        has_sums = all(r.target_sum is not None for r in header.tensors)
        if check == "sums" and not has_sums:
            raise UsageError(f"{reader.source} carries no word sums (format 1.2 added them); "
                             "apply it with check='digests'")
        on_gpu = any(t.device.type != "cpu" for t in tensors.values())
        use_sums = check == "sums" or (has_sums and (check == "prefer-sums" or (check == "auto" and on_gpu)))
        if use_sums and on_gpu:
            if check == "sums" and parse_device(device) != "cpu":
                cuda_backend()  # asked for: DeviceUnavailableError with the cause when CUDA cannot run
            elif check == "sums":
                raise UsageError("check='sums' on GPU tensors runs the CUDA kernels; device='cpu' excludes "
                                 "them (use check='digests')")
            elif backend_for_gpu_data(device) is None:
                # `cpu` asked for, or a CUDA stack that cannot run (said once): the digests path
                # checks on host copies and writes the changed elements through torch.
                use_sums = False
        if use_sums:
            aliases = _aliases(tensors)
            return apply_by_sums(LiveViews(tensors, aliases), reader, header, undo, known, aliases)
        known.clear()
        live = StateDict(tensors)
        scheme = header.scheme
        ids = tensor_ids(TensorView(live, header.precision), scheme=scheme, device=device)
        digest = scheme.digest(ids.values())
        if digest == header.target_digest:
            return _Step("up-to-date", digest, set(), 0)
        anchor = header.base_digest == scheme.empty  # every tensor carried whole: any live state takes it
        if digest != header.base_digest and not anchor:
            raise BaseMismatchError(header.base_digest, digest, "the live tensors are not the patch's base")
        # (the tensor hashes make up the target digest: PatchHeader.from_json refuses a header where not)
        backend = get_backend(device)  # the rebuild runs on host copies
        host_kernels = _kernels_for(np.empty(0))
        scratch = Scratch()
        # Decode and check every tensor first, keeping only its changes; write nothing yet.
        changes: list[tuple[str, np.ndarray, np.ndarray]] = []
        batches = _RebuiltInBatches(reader.source, changes)
        read_layout(reader, header, sequential=True)  # checked, though live tensors have no files
        for rec in header.tensors:  # sections are read in order: works on streams
            payload = reader.read_next(rec.section, f"tensor {rec.name!r}") if rec.section else None
            if payload is None:
                continue
            base = live.raw_bytes(rec.name).view(rec.dtype.bits_dtype)
            if batches.takes(rec):  # a small ctx-rans section: decoded in a batch, on a copy
                batches.add(rec, base, payload)
                continue
            batches.finish()  # earlier tensors are checked first: the first failure is the one raised
            new = rebuild_tensor(rec, payload, base if rec.op == "patch" else None, backend, reader.source, scratch)
            # One read of the pair across the threads (`new != base` and flatnonzero took two, and
            # a bool array of the tensor's size: 0.7 s of a 1.7 s apply into the 1 GB Qwen2 shape).
            positions, values = host_kernels.diff_compact(base, new)
            changes.append((rec.name, positions, values, base[positions]))
        batches.finish()
        for f in header.files:  # a model folder's config and tokenizer: checked, not used here
            if f.section is not None:
                reader.read_next(f.section, f"file {f.name!r}")
        reader.expect_end(header.sections_length)
        names, elements = set(), 0
        for name, positions, values, old in changes:
            if positions.size:
                view = _writable_bits(tensors[name]) if tensors[name].device.type != "cpu" else \
                    live.raw_bytes(name).view(values.dtype)
                undo.append(_Undo(name, view, positions, old))
                _scatter(view, positions, values)
                names.add(name)
                elements += int(positions.size)
        return _Step("applied", header.target_digest, names, elements)
    finally:
        if owned:
            owned.close()


class _RebuiltInBatches:
    """The digests path's small ctx-rans sections, rebuilt on copies of their bases in batches
    (ctx_rans_batch), as many batches at once as there are threads; each rebuilt copy is checked
    against its tensor's hash and only its changes are kept, in `changes`."""

    def __init__(self, source: str, changes: list):
        from pulsediff.kernels.threads import num_threads

        self.source, self.changes = source, changes
        self.closed: list = []  # batches full, not yet run
        self.batch = None
        self.records: dict = {}
        self.threads = num_threads()

    def takes(self, rec) -> bool:
        from pulsediff.codecs.ctx_rans_batch import batchable

        return batchable(rec)

    def add(self, rec, base: np.ndarray, payload: bytes) -> None:
        from pulsediff.codecs.base import SectionContext
        from pulsediff.codecs.ctx_rans_batch import BATCH_ELEMENTS, Batch
        from pulsediff.ops.rebuild import check_base_size

        check_base_size(rec, base, self.source)
        if self.batch is not None and (self.batch.dtype != base.dtype or self.batch.elements >= BATCH_ELEMENTS):
            self.closed.append(self.batch)
            self.batch = None
            if len(self.closed) >= self.threads:
                self._run()
        if self.batch is None:
            self.batch = Batch(base.dtype)
        self.batch.add(rec.name, base.copy(), payload, rec.section.params,
                       SectionContext(rec.name, rec.numel, rec.dtype.itemsize, self.source))
        self.records[rec.name] = rec

    def finish(self) -> None:
        if self.batch is not None:
            self.closed.append(self.batch)
            self.batch = None
        self._run()

    def _run(self) -> None:
        from pulsediff.kernels import cpu_batch
        from pulsediff.kernels.threads import parallel_map

        batches, self.closed = self.closed, []
        for result in parallel_map(lambda batch: batch.run(cpu_batch), [(b,) for b in batches]):
            for name, new, positions, old, _, _ in result.applied():
                rec = self.records.pop(name)
                if rec.scheme.tensor_hash(new) != rec.target_hash:
                    raise CorruptPatchError(self.source, f"tensor {name!r} does not rebuild to its recorded hash")
                values = new[positions]
                keep = values != old  # entries that change nothing are no change
                self.changes.append((name, positions[keep], values[keep], old[keep]))
            error = result.error()
            if error is not None:
                raise error


# -- the sums path: live tensors checked and patched where they live -------------------


def device_bits(tensor):
    """The tensor's elements as flat unsigned bit patterns over its own memory: a NumPy view of
    a CPU tensor, a Numba device array over a CUDA tensor's (zero-copy both)."""
    if tensor.device.type == "cpu":
        dtype = dtype_of(tensor)
        if tensor.is_contiguous():  # one torch view and its NumPy array (a third of host_bytes' cost)
            return tensor.detach().view(same_width_int(dtype.itemsize)).numpy().reshape(-1).view(dtype.bits_dtype)
        return host_bytes(tensor).view(dtype.bits_dtype)
    from pulsediff.kernels import cuda_backend

    return cuda_backend().device_bits(_bits_view(tensor))


def same_width_int(itemsize: int):
    """The torch integer type whose elements are `itemsize` bytes (what NumPy can view as bits)."""
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]


def _writable_bits(tensor):
    """The tensor's elements as flat bit patterns to write into, with no CUDA kernels: a NumPy
    view of a CPU tensor, a torch integer view of a GPU one (the digests path's writes)."""
    return host_bytes(tensor).view(dtype_of(tensor).bits_dtype) if tensor.device.type == "cpu" else _bits_view(tensor)


def _kernels_for(view):
    """The kernels that run where `view` lives (a NumPy array, or a Numba device array)."""
    from pulsediff.kernels import cuda_backend, get_backend

    return get_backend("cpu") if isinstance(view, np.ndarray) else cuda_backend()


def _scatter(view, positions: np.ndarray, values: np.ndarray) -> None:
    """view[positions] = values, where the view lives."""
    if _is_torch(view):
        import torch

        index = torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int64)).to(view.device)
        view[index] = torch.from_numpy(np.ascontiguousarray(values).view(_signed(view))).to(view.device)
    else:
        _kernels_for(view).scatter(view, positions, values)


def _is_torch(view) -> bool:
    return type(view).__module__.startswith("torch")


def _signed(view) -> np.dtype:
    return np.dtype(f"i{view.element_size()}") if view.element_size() > 1 else np.dtype(np.uint8)


def _host_copy(view) -> np.ndarray:
    """A host array of the view's values that later writes to the view do not change."""
    return view.copy() if isinstance(view, np.ndarray) else view.copy_to_host()


@dataclass
class _Undo:
    """Written elements of one tensor: `positions` None for the whole tensor. `old` is filled
    once the write returns; an entry without it cannot be put back (and is named). `where` is
    the tensor's view, or the LiveViews that makes it when a roll-back needs it."""

    name: str
    where: object
    positions: object
    old: object = None

    @property
    def view(self):
        return self.where[self.name] if isinstance(self.where, LiveViews) else self.where


class _BatchUndo:
    """The writes of a batch's tensors (ctx_rans_batch.BatchResult), logged as one entry; taken
    apart into each tensor's _Undo only when a roll-back or a caller's `changes` needs them."""

    def __init__(self, result):
        self.result = result

    def entries(self) -> list[_Undo]:
        return [_Undo(name, view, positions, old) for name, view, positions, old, _, _ in self.result.applied()]


def _entries(undo: list) -> list[_Undo]:
    """The undo log with batch entries taken apart, in write order."""
    out = []
    for entry in undo:
        if isinstance(entry, _BatchUndo):
            out.extend(entry.entries())
        else:
            out.append(entry)
    return out


class LiveViews(dict):
    """name -> the live tensor's bits (device_bits), each view made when first asked for.

    A NumPy view of a tensor costs ~8 us, a tenth of what a small expert tensor's whole apply
    may cost; batches and word sums of host tensors need only where each one lies (`span`), and
    the undo log asks for a view only to put a tensor back. `aliases` maps a name to the name
    whose memory it shares."""

    def __init__(self, tensors: Mapping, aliases: Mapping):
        super().__init__()
        # The caller's tensors as they are now: the undo log makes views from them later, and must
        # reach this memory even where the caller has bound a name to another tensor since.
        self.tensors, self.aliases = dict(tensors), aliases
        self._spans: dict = {}  # asked for by the word sums, then by the batches
        self.names = [name for name in tensors if name not in aliases]  # one entry per memory
        self.all_on_host = all(tensors[name].device.type == "cpu" for name in self.names)

    @classmethod
    def made(cls, views: Mapping, aliases: Mapping = {}) -> "LiveViews":
        """Views made already (host or Numba device arrays), with no tensors behind them."""
        out = cls({}, aliases)
        out.update(views)
        out.update({alias: views[name] for alias, name in aliases.items()})
        out.names = list(views)
        out.all_on_host = all(isinstance(v, np.ndarray) for v in views.values())
        return out

    def __missing__(self, name: str):
        view = self[name] = device_bits(self.tensors[self.aliases.get(name, name)])
        return view

    def on_host(self, name: str) -> bool:
        if self.all_on_host:
            return True
        t = self.tensors.get(name)
        return isinstance(self[name], np.ndarray) if t is None else t.device.type == "cpu"

    def span(self, name: str) -> tuple[int, int]:
        """(address, elements) of a host tensor (contiguous: apply_to_state_dict checked)."""
        found = self._spans.get(name)
        if found is None:
            t = self.tensors.get(self.aliases.get(name, name))
            if t is None:
                view = self[name]
                found = view.__array_interface__["data"][0], view.size
            else:
                found = t.data_ptr(), t.numel()
            self._spans[name] = found
        return found

    def bits_dtype(self, name: str) -> np.dtype:
        t = self.tensors.get(name)
        return self[name].dtype if t is None else dtype_of(t).bits_dtype


def _aliases(tensors: Mapping) -> dict[str, str]:
    """Names whose tensor is another name's very memory (tied weights: the same tensor under two
    names), mapped to that name; tensors that overlap otherwise are refused."""
    spans = sorted((((t.device.type, t.device.index or 0), t.data_ptr(), t.nbytes, name)
                    for name, t in tensors.items() if t.numel()), key=lambda x: x[:2])
    aliases, previous = {}, None
    for span in spans:
        if previous and span[0] == previous[0] and span[1] < previous[1] + previous[2]:
            if span[1:3] != previous[1:3] or tensors[span[3]].dtype != tensors[previous[3]].dtype:
                raise UsageError(f"live tensors {previous[3]!r} and {span[3]!r} overlap in memory")
            aliases[span[3]] = previous[3]
            continue
        previous = span
    return aliases


def apply_by_sums(views: LiveViews, reader, header, undo: list, known: dict, aliases: Mapping = {}) -> "_Step":
    """One patch into `views` (name -> flat bit patterns, host or device arrays), checked by
    word sums (FORMAT.md §7.1). `known` holds sums verified by the previous patch of a chain
    and is updated; every write is logged in `undo` before it happens. `aliases` maps a name
    to the name whose memory it shares: it is written through that one, and must end with the
    same target. Plain views (a mapping of arrays) are taken as LiveViews.made."""
    from pulsediff.format.patch_file import read_layout
    from pulsediff.ops.rebuild import rebuild_tensor
    from pulsediff.codecs import get_codec
    from pulsediff.codecs.base import Scratch, SectionContext
    from pulsediff.codecs.ctx_rans_batch import BATCH_ELEMENTS, Batch
    from pulsediff.codecs.ctx_rans_batch import batchable as small_ctx_rans

    if not isinstance(views, LiveViews):
        views = LiveViews.made(views, aliases)
    records = header.tensors
    by_name = {r.name: r for r in records}
    for alias, name in aliases.items():
        if by_name[alias].target_sum != by_name[name].target_sum or by_name[alias].target_hash != by_name[name].target_hash:
            raise UsageError(f"live tensors {name!r} and {alias!r} share memory, but the patch gives them "
                             "different values")
    sums = _word_sums(views, [r.name for r in records], known)
    known.clear()
    known.update(sums)
    if all(sums[r.name] == int(r.target_sum, 16) for r in records):
        return _Step("up-to-date", header.target_digest, set(), 0)
    if header.base_digest != header.scheme.empty:  # an anchor's base is any tensors of the target's shapes
        for r in records:
            if r.base_sum is not None and sums[r.name] != int(r.base_sum, 16):
                raise BaseMismatchError(header.base_digest, f"word sum {sums[r.name]:016x} for {r.name!r}",
                                        f"the live tensor {r.name!r} is not the patch's base (base word sum "
                                        f"{r.base_sum})")
    # (the tensor hashes make up the target digest: PatchHeader.from_json refuses a header where not)
    read_layout(reader, header, sequential=True)  # checked, though live tensors have no files
    names, elements, counts = set(), 0, {}

    def place(rec, payload, decoded, scratch, alone: bool = False) -> int:
        """One tensor's section written into its view, logged in `undo` first and checked by
        its target sum after; returns the elements it changed. `alone`: on this thread alone,
        with the CPU kernels, so the sum after comes from the words written (add_at_summed),
        not from another read of the tensor."""
        view = views[rec.name]
        kernels = _kernels_for(view)
        after = None  # the word sum once written, where the writes tell it
        ctx = SectionContext(rec.name, rec.numel, rec.dtype.itemsize, reader.source)
        codec = get_codec(rec.section.codec)
        if rec.op == "patch" and hasattr(codec, "add_in_place") and hasattr(kernels, "locate_add_summed"):
            # the CPU's walk writes what it finds and sums the words it writes: one read, not three
            entries = decoded if decoded is not None else codec.decode_changes(payload, rec.section.params, ctx)
            on_host = isinstance(view, np.ndarray)
            if on_host:
                where, old = np.full(entries.count, -1, np.int64), np.zeros(entries.count, view.dtype)
            else:  # the GPU's tile kernels, one host synchronisation for the tensor
                where, old = kernels.located_buffers(entries.count, view.dtype)
            entry = _Undo(rec.name, view, where)
            undo.append(entry)
            try:
                change = codec.add_in_place(view, entries, ctx, kernels, where, old)
            finally:  # whatever was written, even when interrupted, is in the undo log
                if on_host:
                    written = where >= 0
                    entry.positions, entry.old = where[written], old[written]
                else:  # kept whole on the device: a roll-back's scatter skips the -1 of entries not found
                    entry.positions, entry.old = where, old
            after = (sums[rec.name] + change) & 0xFFFFFFFFFFFFFFFF
            count = rec.changed
        elif rec.op == "patch" and (located := codec.locate(view, payload, rec.section.params, ctx, kernels,
                                                            scratch, decoded)) is not None:
            positions, deltas = located
            count = rec.changed
            entry = _Undo(rec.name, view, positions)
            undo.append(entry)
            if alone:
                entry.old, bad, change = kernels.add_at_summed(view, positions, deltas)
                after = (sums[rec.name] + change) & 0xFFFFFFFFFFFFFFFF
            else:
                entry.old, bad = kernels.add_at(view, positions, deltas)
            if bad:  # cannot happen once every entry was found; the kernel checks all the same
                raise CorruptPatchError(reader.source, f"tensor {rec.name!r}: positions fall outside the tensor")
        else:  # another codec, or a tensor carried whole: rebuilt and hash-checked on the host
            base = _host_copy(view) if rec.op == "patch" else None
            new = rebuild_tensor(rec, payload, base, _kernels_for(np.empty(0)), reader.source, scratch)
            if base is None:
                entry = _Undo(rec.name, view, None)
                undo.append(entry)
                entry.old = _host_copy(view)
                count = int(np.count_nonzero(new != entry.old))
                _overwrite(view, new)
            else:
                positions = np.flatnonzero(new != base)
                count = int(positions.size)
                entry = _Undo(rec.name, view, positions, base[positions])
                undo.append(entry)
                kernels.scatter(view, positions, new[positions])
        if after is None:
            after = kernels.word_sum(view)
        if after != int(rec.target_sum, 16):
            raise CorruptPatchError(reader.source, f"tensor {rec.name!r} does not rebuild to its recorded word sum")
        return count

    def batchable(rec) -> bool:  # small ctx-rans sections into host tensors: batched (ctx_rans_batch)
        return small_ctx_rans(rec) and views.on_host(rec.name)

    def batch_of(rec, payload, batch):
        """`batch` with this section added, or a new batch where it cannot take it."""
        dtype = rec.dtype.bits_dtype  # the live tensor's (apply_to_state_dict checked)
        if batch is None or batch.dtype != dtype or batch.elements >= BATCH_ELEMENTS:
            batch = Batch(dtype)
        batch.add(rec.name, views, payload, rec.section.params,
                  SectionContext(rec.name, rec.numel, rec.dtype.itemsize, reader.source), sums[rec.name],
                  int(rec.target_sum, 16), views.span(rec.name))
        return batch

    # sections in order (works on streams); the generator is closed, its pool joined, on any exit
    with contextlib.closing(_decoded_ahead(records, reader, aliases, batchable)) as sections:
        units = _work_units(sections, batchable, batch_of)
        if _side_by_side(views):
            placed = _placed_side_by_side(units, place, undo)
        else:
            scratch = Scratch()
            placed = _placed_in_turn(units, place, scratch, undo)
        # Closed on any exit, an interrupt in this loop's body included: the side-by-side
        # generator then waits for every placement still writing before the caller rolls back.
        with contextlib.closing(placed):
            for unit_names, unit_counts, afters in placed:
                known.update(zip(unit_names, afters))
                counts.update(zip(unit_names, unit_counts))
                names.update(name for name, count in zip(unit_names, unit_counts) if count)
                elements += sum(unit_counts)
    for f in header.files:  # a model folder's config and tokenizer: checked, not used here
        if f.section is not None:
            reader.read_next(f.section, f"file {f.name!r}")
    reader.expect_end(header.sections_length)
    for alias, name in aliases.items():  # counted per name, as the digests path does
        known[alias] = known[name]
        if counts.get(name):
            names.add(alias)
            elements += counts[name]
    return _Step("applied", header.target_digest, names, elements, dict(aliases))


def _word_sums(views: LiveViews, names: list, known: Mapping) -> dict:
    """name -> word sum of each view: from `known` where it has one, small host tensors in one
    kernel call (ctx_rans_batch.word_sums_at), the rest where they live."""
    from pulsediff.codecs.ctx_rans_batch import BATCH_MAX_NUMEL, word_sums_at
    from pulsediff.kernels import cpu_batch
    from pulsediff.kernels.threads import num_threads, parallel_map

    sums = {name: known[name] for name in names if name in known}
    spans = {name: views.span(name) for name in names if name not in sums and views.on_host(name)}
    small = [name for name, (_, size) in spans.items() if size <= BATCH_MAX_NUMEL]
    addresses = [spans[name][0] for name in small]
    nbytes = [spans[name][1] * views.bits_dtype(name).itemsize for name in small]
    # One call per thread, each over a run of tensors of about equal bytes (the read of every
    # base is most of this; one thread reads about 5 GB/s).
    threads = num_threads()
    shares = [sum(nbytes) * j / threads for j in range(1, threads)]
    cuts = [0, *np.searchsorted(np.cumsum(nbytes), shares).tolist(), len(small)]
    runs = [(addresses[lo:hi], nbytes[lo:hi], cpu_batch) for lo, hi in zip(cuts, cuts[1:]) if hi > lo]
    sums.update(zip(small, (s for run in parallel_map(word_sums_at, runs) for s in run)))
    on_device = [name for name in names if name not in sums and not views.on_host(name)]
    if on_device:  # launched together, read back once
        sums.update(zip(on_device, _kernels_for(views[on_device[0]]).word_sums([views[n] for n in on_device])))
    for name in names:
        if name not in sums:
            sums[name] = _kernels_for(views[name]).word_sum(views[name])
    return sums


def _work_units(sections, batchable, batch_of):
    """The sections as units of work, in order: a Batch of consecutive small ctx-rans sections of
    one width (closed when full, when the width changes or when another section comes), or one
    section as (record, payload, decoded entries)."""
    batch = None
    for rec, payload, decoded in sections:
        if batchable(rec):
            grown = batch_of(rec, payload, batch)
            if batch is not None and grown is not batch:
                yield batch
            batch = grown
            continue
        if batch is not None:
            yield batch
            batch = None
        yield rec, payload, decoded
    if batch is not None:
        yield batch


def _run_unit(unit, place, scratch, alone: bool = False):
    """Place one unit; returns its placements ((names), (elements changed), (word sums after)),
    the undo entries it logged (a batch's all at once, as one entry: its kernel puts back the
    tensor it fails on, and raises nothing else), and its error or None."""
    from pulsediff.codecs.ctx_rans_batch import Batch

    if isinstance(unit, Batch):
        from pulsediff.kernels import cpu_batch

        result = unit.run(cpu_batch)
        return result.columns(), [_BatchUndo(result)] if result.done else [], result.error()
    rec, payload, decoded = unit
    count = place(rec, payload, decoded, scratch, alone)
    return ((rec.name,), (count,), (int(rec.target_sum, 16),)), [], None


def _placed_in_turn(units, place, scratch, undo):
    """The placements of each unit (_run_unit's), placed on this thread in order."""
    for unit in units:
        yield _settled(_run_unit(unit, place, scratch), undo)


def _settled(outcome, undo: list) -> tuple:
    """A unit's placements, its undo entries logged first; its error raised after that."""
    placed, logged, error = outcome
    undo.extend(logged)
    if error is not None:
        raise error
    return placed


def _settled_first(running, undo: list) -> tuple:
    """_settled of the oldest running unit, taken off `running` only once its undo entries are
    logged: a Ctrl-C while it runs leaves it there, for the caller's wait and log (entries logged
    twice are put back twice: the same old values)."""
    placed, logged, error = running[0].result()
    undo.extend(logged)
    running.popleft()
    if error is not None:
        raise error
    return placed


def _side_by_side(views: LiveViews) -> bool:
    """Whether tensors are placed side by side, one per worker thread, each walked on its thread
    alone (the CPU's one-pass walk, without the class counts a range-parallel walk needs)."""
    from pulsediff.kernels import cpu_backend
    from pulsediff.kernels.threads import serial

    # Not from a worker thread itself: its placements would wait on the pool it occupies.
    return len(views.names) > 1 and views.all_on_host \
        and cpu_backend().side_by_side() > 0 and not serial()


# Units handed to the worker threads ahead of the oldest one still running, per thread: with one,
# a thread that finished a small unit waited idle until the oldest (a large tensor's walk) was
# done, since results are taken in order.
UNITS_PER_THREAD = 2


def _placed_side_by_side(units, place, undo):
    """The placements of each unit (_run_unit's), in order, the unit (a batch, or
    one section placed alone by `place`) run on the worker threads, as many at once as there are
    threads. A failure is raised once every unit that started has finished, so none still writes
    while the caller rolls back; the undo entries of every batch that ran are in `undo` by then."""
    from collections import deque
    from concurrent.futures import wait

    from pulsediff.codecs.base import Scratch
    from pulsediff.kernels.threads import num_threads, pool

    running: deque = deque()
    try:
        for unit in units:
            running.append(pool().submit(_run_unit, unit, place, Scratch(), True))
            if len(running) >= UNITS_PER_THREAD * num_threads():
                yield _settled_first(running, undo)
        while running:
            yield _settled_first(running, undo)
    finally:
        wait(running)
        for future in running:  # batches that finished unseen: their writes must be undone too
            if not future.cancelled() and future.exception() is None:
                undo.extend(future.result()[1])


# Sections decoded ahead of the one being placed: bounded by count (the worker threads, at
# most DECODE_AHEAD_SECTIONS) and by what they hold once decoded (~9 bytes per change: an int64
# rank and a delta, about ten times the payload's ~1 byte), so memory stays near this whatever
# the patch.
DECODE_AHEAD_BYTES = 1 << 30
DECODE_AHEAD_SECTIONS = 16


def _decoded_ahead(records, reader, aliases, batched=lambda rec: False):
    """(record, payload, decoded entries or None) for every section that is written, in order.

    The payloads are read in order (a patch may be a stream); the host half of each `patch`
    section's locate (its entropy decode, `Codec.decode_changes`) runs on worker threads, as
    many sections ahead as there are threads, so the CPU decodes the next tensors while this
    one is placed and added on its device. A failed decode is raised when its turn comes;
    nothing decoded is used before its turn."""
    from collections import deque
    from concurrent.futures import wait

    from pulsediff.codecs import get_codec
    from pulsediff.codecs.base import SectionContext
    from pulsediff.kernels.threads import decode_pool, num_threads

    depth = min(num_threads(), DECODE_AHEAD_SECTIONS)
    pending: deque = deque()
    in_flight = 0
    pool = decode_pool(depth) if depth > 1 else None
    try:
        for rec in records:
            payload = reader.read_next(rec.section, f"tensor {rec.name!r}") if rec.section else None
            if payload is None or rec.name in aliases:  # an alias is written through its own name
                continue
            future = None
            if pool is not None and rec.op == "patch" and not batched(rec):  # a batch decodes in its kernel
                codec = get_codec(rec.section.codec)
                ctx = SectionContext(rec.name, rec.numel, rec.dtype.itemsize, reader.source)
                future = pool.submit(codec.decode_changes, payload, rec.section.params, ctx)
            elif not pending:  # nothing decoded ahead of it (a batch's section): its turn is now
                yield rec, payload, None
                continue
            pending.append((rec, payload, future))
            in_flight += _decoded_bytes(rec, payload)
            while len(pending) > depth or (len(pending) > 1 and in_flight > DECODE_AHEAD_BYTES):
                rec0, payload0, future0 = pending.popleft()
                in_flight -= _decoded_bytes(rec0, payload0)
                yield rec0, payload0, future0.result() if future0 is not None else None
        while pending:
            rec0, payload0, future0 = pending.popleft()
            yield rec0, payload0, future0.result() if future0 is not None else None
    finally:
        if pool is not None:
            for _, _, future in pending:
                if future is not None:
                    future.cancel()
            wait([f for _, _, f in pending if f is not None])


def _decoded_bytes(rec, payload: bytes) -> int:
    """What a section holds in memory until its turn: its payload and its decoded entries."""
    return len(payload) + 9 * rec.changed


def _overwrite(view, values: np.ndarray) -> None:
    if _is_torch(view):
        import torch

        view.copy_(torch.from_numpy(np.ascontiguousarray(values).view(_signed(view))))
    elif isinstance(view, np.ndarray):
        view[...] = values.view(view.dtype)
    else:
        view.copy_to_device(np.ascontiguousarray(values).view(view.dtype))


def _check_items(tensors: Mapping) -> None:
    """A state dict as pulsediff takes one: non-empty string keys, torch tensors."""
    import torch

    for name, t in tensors.items():
        if not isinstance(name, str) or not name:
            raise UsageError(f"state dict keys must be non-empty strings, not {name!r}")
        if not isinstance(t, torch.Tensor):
            raise UsageError(f"{name!r} is a {type(t).__name__}, not a torch tensor")


def _check_structure(tensors: Mapping, records: tuple) -> None:
    """The live tensors are the patch's target's in names, shapes and dtypes (written as stored: a
    bf16 patch needs BF16 live tensors), each contiguous (a write through a copy would be lost)."""
    _check_items(tensors)
    if len(records) != len(tensors) or any(r.name not in tensors for r in records):
        have, want = set(tensors), {r.name for r in records}
        extra, missing = sorted(have - want), sorted(want - have)
        what = f"the patch lacks {extra[0]!r}" if extra else f"the live tensors lack {missing[0]!r}"
        raise TensorMismatchError(f"the patch's target has other tensors than the live ones ({what}); "
                                  "live tensors can only be patched, not added or removed")
    for rec in records:
        t = tensors[rec.name]
        if t.shape != rec.shape:  # torch.Size is a tuple
            raise TensorMismatchError(f"live tensor {rec.name!r} has shape {list(t.shape)}, "
                                      f"the patch's target {list(rec.shape)}")
        if dtype_of(t) is not rec.dtype:
            raise TensorMismatchError(f"live tensor {rec.name!r} is {dtype_of(t).name}, "
                                      f"the patch's target {rec.dtype.name}")
        if not t.is_contiguous():
            raise UsageError(f"live tensor {rec.name!r} is not contiguous; patch contiguous tensors "
                             "(e.g. model.state_dict())")


def _bits_view(tensor):
    """The tensor's elements as signed integers of the same width (torch has few unsigned types)."""
    from pulsediff.kernels.class_sort import signed_view

    return signed_view(tensor.detach())


def revert(undo_log: list) -> None:
    """Take back the applies whose undo logs `undo_log` holds (apply_to_state_dict's `undo_log`),
    newest first, leaving it empty. The tensors must not have been written since."""
    lost = _roll_back(undo_log)
    if lost:  # only an interrupted write leaves an entry without its old values, never a finished apply
        raise RuntimeError("not put back: " + ", ".join(sorted(set(lost))))


def _roll_back(undo: list) -> list:
    """Put back every logged write, newest first; returns the names of tensors that could not be
    (a write interrupted before its old values came back)."""
    lost = []
    for entry in reversed(_entries(undo)):
        if entry.old is None:
            lost.append(entry.name)
        elif entry.positions is None:
            _overwrite(entry.view, entry.old)
        else:
            _scatter(entry.view, entry.positions, entry.old)
    undo.clear()
    return lost
