"""`apply_patch`: rebuild the target checkpoint from a base and a patch.

Order of checks, so that nothing is written unless everything holds:
  1. the patch preamble and header (magic, version, checksums, bounds);
  2. the base digest (every base tensor hashed) against the patch's base, or
     its target (then the base is already up to date); when the patches are
     files, taken during step 3 instead, each base tensor's hash checked as
     it is read (apply_chain);
  3. while rebuilding into temporary files: each section's checksum before it
     is decoded, each rebuilt tensor's hash against the header;
  4. the rebuilt checkpoint's digest; only then are the files renamed into place.
"""

from __future__ import annotations

import operator
import os
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from pulsediff.codecs import get_codec
from pulsediff.codecs.base import Scratch, SectionContext, zstd_decompress_exact
from pulsediff.errors import (BaseFileMismatchError, BaseMismatchError, ChainError, CorruptPatchError,
                              InvalidPatchError, PulsediffError, TargetMismatchError, TensorMismatchError, UsageError,
                              refuse_existing, refuse_folder_for_file)
from pulsediff.format.digest import TensorId
from pulsediff.format.header import FileRecord, PatchHeader, TensorRecord
from pulsediff.format.patch_file import Link, open_chain, read_layout
from pulsediff.io.atomic import StagedFiles
from pulsediff.io.checkpoint import INDEX_NAME, Checkpoint, TensorView, open_checkpoint
from pulsediff.io.folder_files import file_hash, read_folder_file
from pulsediff.kernels import get_backend
from pulsediff.ops.inspect import tensor_ids
from pulsediff.ops import rebuild  # rebuild.WINDOW_ELEMENTS read at each use: one setting for both modules
from pulsediff.ops.rebuild import (BaseCheck, BaseDiffers, Rebuild, Windows, chain_rebuild, chain_windows,
                                   rebuild_windows)
from pulsediff.runtime.progress import SILENT, Progress


@dataclass(frozen=True)
class ApplyResult:
    status: str  # "applied", "up-to-date", or for a dry run that would write, "would-apply"
    output: Path | None  # None: a dry run given no output
    header: PatchHeader = field(repr=False)  # the last patch applied (its target is the output)
    links_applied: int = 1
    base_is_target: bool = False  # the base already was the target (a patch made with OLD and NEW swapped?)
    dry_run: bool = False  # everything was checked, nothing written
    layout_from_base: bool = False  # bf16: the files keep the receiver's (base's) BF16 layout, not the patch's


def apply_patch(
    base: str | Path | None,
    patch: str | Path | BinaryIO,
    out: str | Path | None = None,
    *,
    in_place: bool = False,
    device: str | None = None,
    progress: Progress = SILENT,
    force: bool = False,
) -> ApplyResult:
    """Rebuild the target of `patch` from `base` (None: the empty checkpoint, for anchors) into `out`, or into
    `base` itself with `in_place`. An existing `out` is refused (OutputExistsError) unless `force`; with
    `force`, an `out` that already is the target is left as it is (status "up-to-date")."""
    return apply_chain(base, [patch], out, in_place=in_place, device=device, progress=progress, force=force)


def apply_chain(
    base: str | Path | None,
    patches: list,
    out: str | Path | None = None,
    *,
    in_place: bool = False,
    device: str | None = None,
    progress: Progress = SILENT,
    base_ids: dict[str, TensorId] | None = None,
    dry_run: bool = False,
    force: bool = False,
    expect_target: str | None = None,
    expect_where: str = "the signed manifest",
) -> ApplyResult:
    """Apply patches P1..Pn to `base` in one pass, tensor by tensor, with no intermediate checkpoints.

    Every link is checked (Pk's base digest is Pk-1's target digest) before
    anything is written. A base that already equals the target of some link
    starts the chain there. One patch may come from a stream (stdin); a chain
    of several needs seekable files. `base_ids`: the base's tensor ids under
    the patches' precision, when the caller has just hashed it (every rebuilt
    tensor is still checked against its recorded hash). `dry_run`: stop after
    the checks that precede writing (headers, links, base digest, output
    kind) and write nothing; it needs no output (then `output` is None). An
    existing `out` is refused unless `force`, as in `apply_patch`.
    `expect_target` (a signed series: the target digest its entry names):
    the chain's last patch must rebuild exactly that (the rebuilt tensors are
    checked against that patch's target digest), else UntrustedManifestError
    naming `expect_where`, before anything is written.

    The base is read once: when the patches are files and OUT does not exist
    yet, the base's digest is taken during the rebuild, assuming the base is
    the first patch's (BaseCheck), and checked before anything is committed.
    If it is not, or a failure a wrong base could cause happens, the base is
    hashed first after all and the apply runs in that checked order, so every
    error reads as it would.
    """
    if not patches:
        raise UsageError("give at least one patch")
    if in_place and out is not None or not (in_place or out is not None or dry_run):
        raise UsageError("give exactly one of an output path or in_place=True")
    if in_place and base is None:
        raise UsageError("in_place needs a base checkpoint")
    all_files = all(isinstance(p, (str, Path)) and str(p) != "-" for p in patches)
    if len(patches) > 1 and not all_files:
        raise UsageError("a chain of several patches must be files (stdin carries one patch)")
    args = (base, patches, out, in_place, device, progress, dry_run, force, expect_target, expect_where)
    if base_ids is None and not dry_run and base is not None and (in_place or not Path(out).exists()) and all_files:
        speculation = _Speculation()
        failure = None
        try:
            return _apply(*args, speculation=speculation)
        except BaseDiffers:
            pass  # the base is not the first patch's: hash it first, and find out what it is
        except _BASE_DEPENDENT as error:
            if speculation.check is not None and speculation.check.verified:
                raise  # past the base's check (the commit's own errors): what the checked order says too
            failure = error
        if failure is not None:
            # Hash the base first, as the checked order would have: a wrong base is reported as
            # that, whatever went wrong with it; the same failure again (with the base the first
            # patch's) is not run twice. The failed try's frames (its buffers) are let go first.
            traceback.clear_frames(failure.__traceback__)
        return _apply(*args, retrying=failure)
    return _apply(*args, base_ids=base_ids)


# What a base other than the first patch's can cause, and so what the checked order might report
# otherwise: any other error (an input changed while read, the disk, memory) is the error either way,
# and a second try would read what the first one saw change.
_BASE_DEPENDENT = (InvalidPatchError, BaseMismatchError, BaseFileMismatchError, TensorMismatchError, ChainError,
                   TargetMismatchError)


@dataclass
class _Speculation:
    """apply_chain's try with the base's digest taken during the rebuild: its BaseCheck, once made
    (None: the headers ruled the try out, and it ran in the checked order)."""

    check: BaseCheck | None = None


def _apply(base, patches, out, in_place, device, progress, dry_run, force, expect_target, expect_where,
           base_ids: dict[str, TensorId] | None = None, speculation: _Speculation | None = None,
           retrying: PulsediffError | None = None) -> ApplyResult:
    """apply_chain's work. `speculation`: the base's digest taken during the rebuild (BaseCheck),
    assuming the first patch's base, where the headers allow it. `retrying`: what that try failed
    with, raised again if the base turns out to be the first patch's."""
    out_path = Path(base) if in_place else Path(out) if out is not None else None
    with open_chain(patches) as links:
        first_link, final_link = links[0], links[-1]
        final = final_link.header
        if expect_target is not None and final.target_digest != expect_target:
            from pulsediff.errors import UntrustedManifestError

            raise UntrustedManifestError(expect_where, f"the chain ending in {final_link.reader.source} rebuilds "
                                                       f"{final.target_digest}, not {expect_target}, the target its "
                                                       f"signed entry names (a file changed between its check and "
                                                       f"its use?); nothing was written")
        with open_checkpoint(base) as base_ckpt:
            view = TensorView(base_ckpt, final.precision)
            # What the output will be (a file or a folder) is known from the headers alone: an output that
            # cannot hold it is refused before the base is hashed, and before an existing one is (force
            # would not help).
            receiver = _receiver_layout(base_ckpt, view, final, final_link.reader.version)
            sequential = len(patches) == 1  # one patch, maybe on stdin: read it front to back
            if receiver is not None and sequential and receiver.order != [r.name for r in final.tensors]:
                if _seekable(first_link.reader.stream):
                    sequential = False  # the receiver's order: read the sections where they lie
                else:
                    receiver = None  # stdin cannot be read out of order: the patch's layout
            rebuilds = _Rebuilds(receiver.kind if receiver else final.layout.kind,
                                 len(receiver.files) if receiver else len(final.layout.files), len(links))
            if in_place:
                _check_in_place_kind(rebuilds, Path(base))
            elif out is not None:
                _check_output_kind(rebuilds, out)
                refuse_existing(out, force)
            base_is_target = False
            # The try assumes the base is the first patch's. When the headers say that base could
            # also be the target, or a later link's base, the checked order would pick another
            # start: the base is hashed first then.
            first = first_link.header
            speculate = (speculation is not None and first.base_digest != final.target_digest
                         and all(link.header.base_digest != first.base_digest for link in links[1:]))
            base_check = BaseCheck(first, view) if speculate else None
            if speculation is not None:
                speculation.check = base_check
            if not speculate:
                if base_ids is None:
                    base_ids = tensor_ids(view, progress, first.scheme)
                digest = first.scheme.digest(base_ids.values())
                base_is_out = base is not None and out_path is not None and out_path.resolve() == Path(base).resolve()
                base_is_target = digest == final.target_digest
                if base_is_target:
                    if in_place or base_is_out or out_path is None or _already_target(out_path, final):
                        return ApplyResult("up-to-date", out_path, final, 0, True, dry_run)
                    links = []  # the base is the target: only the layout may differ
                else:
                    later = [k for k, link in enumerate(links) if link.header.base_digest == digest]
                    if not later:
                        raise _base_mismatch(links[0].header, base_ids, digest)
                    if retrying is not None and later[-1] == 0:
                        raise retrying
                    links = links[later[-1]:]
                    if out_path is not None and _already_target(out_path, final):
                        return ApplyResult("up-to-date", out_path, final, 0, dry_run=dry_run)
            files = FolderFileSources(links or [final_link], base_ckpt, final, in_place, sequential)
            if dry_run:
                return ApplyResult("would-apply", out_path, final, len(links), base_is_target, True,
                                   receiver is not None)
            backend = get_backend(device)
            if in_place:  # removed with the renames, under the same intent record
                files.stale = _stale_paths(base_ckpt, receiver or _TargetFiles.of_patch(final, None, ""), files.removed)
            if sequential:
                _apply_streaming(first_link, view, backend, out_path, progress, files, receiver, copy_all=not links,
                                 base_check=base_check)
            else:
                _apply_random_access(links, final_link, view, backend, out_path, progress, files, receiver,
                                     base_check=base_check)
            # Committed: every rebuilt tensor matched the target and the base had not changed (the
            # commit's check_intact). A base cut short from now on is read by nothing; no error after it.
            base_ckpt.close(verify=False)
        return ApplyResult("applied", out_path, final, len(links), base_is_target,
                           layout_from_base=receiver is not None)


def _apply_streaming(link: Link, view: TensorView, backend, out_path: Path, progress: Progress,
                     files: "FolderFileSources", receiver: "_TargetFiles | None", copy_all: bool = False,
                     base_check: BaseCheck | None = None) -> None:
    """One patch, read front to back (works on stdin): each section is decoded as it arrives.

    `copy_all`: the base already is the target, so every tensor comes from it
    (the sections are still read, to check the stream, but not decoded).
    `base_check`: the base's digest is taken as its tensors are read.
    """
    reader, header = link.reader, link.header
    layout_blob = read_layout(reader, header, sequential=True)
    scratch = Scratch()

    def base_bits(rec: TensorRecord) -> np.ndarray:
        if rec.name not in view.ckpt:  # a header may say so even when the base digest matched
            raise CorruptPatchError(reader.source, f"tensor {rec.name!r} is {rec.op!r} but the base lacks it")
        return view.get(rec.name).bits

    def target_bits(rec: TensorRecord) -> "Windows | Rebuild":
        payload = reader.read_next(rec.section, f"tensor {rec.name!r}") if rec.section else None
        if copy_all:
            return Rebuild(rec.numel, [(rec, None, reader.source)], base_bits(rec), backend)
        if (rec.op == "patch" and rec.numel > rebuild.WINDOW_ELEMENTS
                and hasattr(get_codec(rec.section.codec), "decode_stream")):
            return rebuild_windows(rec, payload, base_bits(rec), backend, reader.source, scratch, base_check)
        if rec.op == "full":
            return Rebuild(rec.numel, [(rec, payload, reader.source)], None, backend)
        return Rebuild(rec.numel, [(rec, payload, reader.source)], base_bits(rec), backend, base_check)

    def before_commit() -> None:
        reader.expect_end(header.sections_length)
        if base_check is not None:
            base_check.finish()

    target = receiver or _TargetFiles.of_patch(header, layout_blob, reader.source)
    _write_target(header, target, target_bits, files, out_path, progress, before_commit, scratch, backend,
                  inputs=[view.ckpt])


def _apply_random_access(links: list[Link], final_link: Link, view: TensorView, backend, out_path: Path,
                         progress: Progress, files: "FolderFileSources", receiver: "_TargetFiles | None",
                         base_check: BaseCheck | None = None) -> None:
    """A chain: each target tensor is carried through every link in turn, in memory.

    `links` may be empty (the base already is the target): then only the
    final patch's layout is used.
    """
    for link in links:
        link.reader.check_size(link.header.sections_length)
    final = final_link.header
    layout_blob = read_layout(final_link.reader, final, sequential=False)
    scratch = Scratch()
    link_scratch = [Scratch() for _ in links]  # each link's windows, kept from tensor to tensor

    def target_bits(rec: TensorRecord) -> "Windows | Rebuild":
        rebuilt = chain_rebuild(rec.name, links, view, backend, base_check)
        if not rebuilt.steps:
            # No links: the base is the target, by ids the caller may have hashed at an earlier open
            # (catch-up). Its tensors go out as they are, each checked against the target's record.
            rebuilt.steps = [(rec, None, final_link.reader.source)]
        return chain_windows(rebuilt, link_scratch)

    target = receiver or _TargetFiles.of_patch(final, layout_blob, final_link.reader.source)
    _write_target(final, target, target_bits, files, out_path, progress,
                  base_check.finish if base_check is not None else lambda: None, scratch, backend,
                  inputs=[view.ckpt])


# -- base checks --------------------------------------------------------------


def _already_target(out_path: Path, header: PatchHeader) -> bool:
    """True when OUT already holds the target (applying twice is harmless)."""
    if not out_path.exists():
        return False
    try:
        with Checkpoint(out_path) as existing:
            ids = tensor_ids(TensorView(existing, header.precision), scheme=header.scheme)
            return header.scheme.digest(ids.values()) == header.target_digest
    except PulsediffError:
        return False


def _base_mismatch(header: PatchHeader, base_ids: dict[str, TensorId], digest: str) -> PulsediffError:
    """The most specific explanation of why the base is not the patch's base."""
    expected = [r for r in header.tensors if r.base_hash is not None]
    for rec in expected:  # a wrong shape or dtype says most about what went wrong
        have = base_ids.get(rec.name)
        if have is not None and (have.dtype != rec.dtype.name or have.shape != rec.shape):
            return TensorMismatchError(
                f"base tensor {rec.name!r} is {have.dtype}{list(have.shape)}, "
                f"the patch expects {rec.dtype.name}{list(rec.shape)}: this patch was made from another base"
            )
    for rec in expected:
        have = base_ids.get(rec.name)
        if have is None:
            return BaseMismatchError(header.base_digest, digest, f"tensor {rec.name!r} is missing from the base")
        if have.hash != rec.base_hash:
            return BaseMismatchError(header.base_digest, digest, f"tensor {rec.name!r} differs from the patch's base")
    if len(base_ids) != header.base_tensors:
        return BaseMismatchError(header.base_digest, digest, f"the base holds {len(base_ids)} tensor(s), the "
                                                             f"patch's base {header.base_tensors}")
    # Every tensor the patch builds on matches: the difference is in one it does not build on
    # (carried whole, or removed), whose hash the patch does not record.
    unchecked = sorted(set(base_ids) - {r.name for r in expected})
    return BaseMismatchError(header.base_digest, digest,
                             "the base differs in a tensor the patch carries whole or removes"
                             + (f" (one of {', '.join(map(repr, unchecked[:3]))}{', ...' if len(unchecked) > 3 else ''})"
                                if unchecked else ""))


# -- the target folder's other files ---------------------------------------------


class FolderFileSources:
    """Where each of the target folder's other files comes from, checked before anything is written.

    A file is carried whole by the last link that changed it, else it is the
    base folder's file. In exact mode that base file must have the recorded
    hash (else the rebuilt folder would not be the target). In bf16 mode the
    receiver's folder is typically saved by another tool, so its unchanged
    files are kept as they are (or stay absent).
    """

    def __init__(self, links: list[Link], base: Checkpoint, final: PatchHeader, in_place: bool, sequential: bool):
        self.final = final.files
        self.sequential = sequential  # one patch is read front to back (it may be stdin)
        self.strict = final.precision == "exact"
        self.in_place = in_place
        self.stale: list[Path] = []  # in place: base files the target does not have, removed at commit
        self.base_dir = base.path if base.kind == "dir" else None
        self.from_link: dict[str, tuple[Link, FileRecord]] = {}
        for rec in self.final:
            for link in reversed(links):
                own = link.files.get(rec.name)
                if own is not None and own.op == "full":
                    self.from_link[rec.name] = (link, own)
                    break
            else:
                self.base_bytes(rec)  # checked now: before any output exists
        gone = {n for link in links for n in link.header.removed_files} - {r.name for r in self.final}
        self.removed = sorted(gone)

    def base_bytes(self, rec: FileRecord) -> bytes | None:
        """The base folder's copy of `rec`; None where bf16 mode keeps it absent."""
        path = self.base_dir / rec.name if self.base_dir is not None else None
        if path is None or not path.is_file():
            if not self.strict:
                return None
            raise BaseFileMismatchError(f"the base {'folder' if path else 'checkpoint'} lacks {rec.name}, which the "
                                        "patch keeps unchanged: the rebuilt folder would not be the target")
        data = read_folder_file(path)
        if self.strict and (len(data) != rec.size or file_hash(data) != rec.hash):
            raise BaseFileMismatchError(f"{path} is not the file the patch was made against (its hash differs): "
                                        "the rebuilt folder would not be the target")
        return data

    def section(self, rec: FileRecord) -> tuple[bytes | None, str]:
        """The section that carries `rec` whole (None: the base's file), and which patch it is from."""
        found = self.from_link.get(rec.name)
        if found is None:
            return None, ""
        link, own = found
        read = link.reader.read_next if self.sequential else link.reader.read_section
        return read(own.section, f"file {rec.name!r}"), link.reader.source

    def contents(self, rec: FileRecord, section: bytes | None, source: str) -> bytes | None:
        """The bytes to write for `rec`, or None: nothing to write (kept or absent)."""
        if section is not None:
            data = zstd_decompress_exact(section, rec.size, SectionContext(rec.name, rec.size, 1, source), "file")
            if file_hash(data) != rec.hash:
                raise CorruptPatchError(source, f"folder file {rec.name!r} does not rebuild to its recorded hash")
            return data
        if self.in_place:
            return None  # the base's own file, checked above
        return self.base_bytes(rec)


@dataclass(frozen=True)
class _Rebuilds:
    """What a chain rebuilds, in words for a refusal: a file or a folder of `shards` shards."""

    kind: str
    shards: int
    patches: int

    def __str__(self) -> str:
        what = (f"a model folder ({self.shards} shard{'' if self.shards == 1 else 's'})" if self.kind == "dir"
                else "a single .safetensors file")
        return f"{'this patch rebuilds' if self.patches == 1 else 'these patches rebuild'} {what}"


def _check_output_kind(rebuilds: _Rebuilds, out: str | Path) -> None:
    """OUT (as given: a trailing '/' says "a folder") can hold what the patches rebuild, whatever `force`:
    force replaces a file or fills a folder, it never turns one into the other."""
    text = os.fspath(out)
    path = Path(text)
    if rebuilds.kind == "file":
        refuse_folder_for_file(text, str(rebuilds), "model.safetensors")
        return
    if path.exists() and not path.is_dir():
        raise UsageError(f"{text} is a file, but {rebuilds}; give a new folder name")
    if not path.exists() and path.suffix == ".safetensors":
        raise UsageError(f"{rebuilds}; give a folder name, not {text}")


def _check_in_place_kind(rebuilds: _Rebuilds, base: Path) -> None:
    if (rebuilds.kind == "dir") != base.is_dir():
        raise UsageError(f"{base} is a {'folder' if base.is_dir() else 'file'}, but {rebuilds}, so it cannot be "
                         f"replaced in place; give -o with a new {'folder' if rebuilds.kind == 'dir' else 'file'} name")


@dataclass
class _TargetFiles:
    """The checkpoint files apply writes: kind, and per file its safetensors header and tensors in data order."""

    kind: str
    files: list[tuple[str, bytes, tuple[TensorRecord, ...]]]
    index: bytes | None

    @property
    def order(self) -> list[str]:
        return [r.name for _, _, records in self.files for r in records]

    @classmethod
    def of_patch(cls, header: PatchHeader, blob: bytes | None, source: str) -> "_TargetFiles":
        """The patch's own layout from `blob`, as read_layout returned it, which checked each file's
        header against its tensors (with `blob` None: names only, for cleaning up after in-place)."""
        files, pos, first = [], 0, 0
        for lf in header.layout.files:
            records = header.tensors[first : first + lf.tensors]
            raw = blob[pos : pos + lf.header_len] if blob is not None else b""
            files.append((lf.name, raw, records))
            pos, first = pos + lf.header_len, first + lf.tensors
        index = None
        if header.layout.index_len is not None:
            index = blob[pos : pos + header.layout.index_len] if blob is not None else b""
        return cls(header.layout.kind, files, index)


def _receiver_layout(base: Checkpoint, view: TensorView, final: PatchHeader,
                     version: tuple[int, int]) -> _TargetFiles | None:
    """In bf16 mode, the base's own file layout when the base already is a BF16 checkpoint of the same
    tensors: the receiver keeps its files as its own tool saved them (names, sharding, metadata, order),
    rather than the layout of the trainer's FP32 files. None when that does not hold, and (format 1.5)
    when the patch says the trainer cast nothing: its files were BF16 already, and their layout, checked
    by layout.digest, is the target's own (a relabelled exact patch writes the target, FORMAT.md §5.2)."""
    if final.precision != "bf16" or not base.shards:
        return None
    if version >= (1, 5) and not final.layout.cast:
        return None
    records = {r.name: r for r in final.tensors}
    if set(base.names) != set(records) or any(view.casts(base.entry(n).dtype) for n in base.names):
        return None
    files = []
    for shard in base.shards:
        entries = shard.header.tensors
        if any((e.dtype.name, e.shape) != (records[e.name].dtype.name, records[e.name].shape) for e in entries):
            return None
        files.append((shard.name, shard.header.raw, tuple(records[e.name] for e in entries)))
    return _TargetFiles(base.kind, files, base.index_bytes)


class _PipelinedWriter:
    """Writes (and hashes) on a worker thread while the caller computes the next buffer.

    At most one write is in flight: `put` first waits for the previous one, so
    a buffer handed over is free again once the next `put` returns (windows
    alternate between two buffers for that reason). Errors surface at the
    next `put` or `drain`.
    """

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from pulsediff.kernels.threads import num_threads

        # PULSEDIFF_THREADS=1 means one busy thread: the hashing then runs where the tensors are
        # rebuilt (the writes still go to the disk in the background, see atomic._DirectWriter).
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pulsediff-writer") \
            if num_threads() > 1 else None
        self._pending = None

    @staticmethod
    def _write(f, data: memoryview, hasher, then) -> None:
        if hasher is not None:
            hasher.update(data)
        f.write(data)
        if then is not None:
            then()

    def put(self, f, data: memoryview, hasher=None, then=None) -> None:
        self.drain()
        if self._pool is None:
            self._write(f, data, hasher, then)
        else:
            self._pending = self._pool.submit(self._write, f, data, hasher, then)

    def drain(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def abandon(self) -> None:
        """Wait for the write in flight, dropping its error: the caller is already failing."""
        from concurrent.futures import wait

        pending, self._pending = self._pending, None
        while pending is not None and not pending.done():
            try:
                wait([pending])
            except BaseException:  # noqa: BLE001 - even a second Ctrl-C waits: the file closes next
                pass

    def close(self) -> None:
        self.abandon()
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _seekable(stream) -> bool:
    """A file on disk (random access checks its size through the descriptor)."""
    try:
        return stream.seekable() and stream.fileno() >= 0
    except (AttributeError, OSError, ValueError):
        return False


# At most this many tensors rebuilt ahead, whatever the thread count: each holds a scratch of
# its own (up to one window of output, and its decoded entries) until written, so memory stays
# bounded (worst case about 10 x 136 MiB: F64 windows with every element changed; 2% BF16: 170 MiB).
MAX_SIDE_BY_SIDE = 8
# Rebuilds started ahead per worker thread: with one, a thread that finished a small tensor waited
# for the oldest (taken in order) before the next could start.
AHEAD_PER_THREAD = 2


class _SideBySide:
    """The target tensors in file order, the small ones rebuilt ahead on the worker threads.

    `prepare(rec)` runs on the caller's thread in record order (it reads the
    record's sections: a patch on stdin is read front to back) and returns a
    `Windows` (a tensor of more than WINDOW_ELEMENTS, rebuilt when its turn
    comes, each window's walk spread over the threads) or a `Rebuild`. With
    `ahead` > 0, a Rebuild of at most WINDOW_ELEMENTS runs on a worker thread
    of its own (`alone`), up to `ahead` of them past the tensor being
    written, each into a Scratch of its own that returns to the pool once the
    writer is done with it; so the entropy decoders of one tensor run beside
    the walks of others, and no walk pays for a class count pass (measured on
    the 1 GiB pair of docs/BENCHMARKS.md, 2 threads: apply 2.28 -> 1.89 s).
    Larger Rebuilds run on the caller's thread into `scratch`.
    """

    def __init__(self, records: list[TensorRecord], prepare, scratch: Scratch, ahead: int):
        from collections import deque

        self._records, self._prepare, self._scratch, self._ahead = records, prepare, scratch, ahead
        self._next = 0  # the first record not prepared yet
        self._queue = deque()  # (record, Future | Windows | Rebuild | _InBatch), in record order
        # Queue entries past the first of each batch still queued: a batch is one rebuild in flight,
        # however many records it holds (counted per record, a batch of 128 experts kept the next
        # one from starting until the writer had taken nearly all of it: one worker busy at a time).
        self._batched = 0
        self._free = deque(Scratch() for _ in range(ahead + 2))  # the writer returns them (deque: thread-safe)

    def take(self, rec: TensorRecord):
        """(bits or Windows, release): `release`, when not None, frees the bits' buffer once they are
        written; None means they live in the caller's scratch, which the next rebuild reuses."""
        self._top_up()
        if not self._queue:
            self._prepare_next()
        queued, item = self._queue.popleft()
        if isinstance(item, _InBatch) and not item.last:
            self._batched -= 1
        if queued.name != rec.name:
            raise AssertionError(f"tensors taken out of order: {rec.name!r} asked, {queued.name!r} next")
        self._top_up()  # the next ones start before this one is waited for
        if isinstance(item, _InBatch):  # a slice of the batch's buffer (_Span writes neighbours in one go)
            return item.future.result()[item.index], _nothing
        if isinstance(item, tuple):
            future, scratch = item
            return future.result(), lambda: self._free.append(scratch)
        if isinstance(item, Rebuild):
            return item.run(self._scratch), None
        return item, None

    def _prepare_next(self) -> None:
        rec = self._records[self._next]
        self._next += 1
        item = self._prepare(rec)
        if self._ahead and _BatchedRebuilds.takes(item):  # it and the small ones after it: one call
            self._prepare_batch(rec, item)
            return
        self._queue.append((rec, self._started(item)))

    def _started(self, item):
        """A small Rebuild started on a worker thread, into a Scratch of its own; else as it is."""
        if self._ahead and isinstance(item, Rebuild) and item.numel <= rebuild.WINDOW_ELEMENTS and self._free:
            from pulsediff.kernels.threads import pool

            scratch = self._free.popleft()
            return pool().submit(item.run, scratch, True), scratch
        return item

    def _prepare_batch(self, rec: TensorRecord, item: Rebuild) -> None:
        """`item` and the records after it while they are small ctx-rans rebuilds of its width,
        up to a batch's elements, rebuilt by one batch on a worker thread."""
        from pulsediff.codecs.ctx_rans_batch import BATCH_ELEMENTS
        from pulsediff.kernels.threads import pool

        batch = _BatchedRebuilds(item)
        taken = [rec]
        while self._next < len(self._records) and batch.elements < BATCH_ELEMENTS:
            following = self._records[self._next]
            if not batch.fits(following):
                break
            self._next += 1
            nxt = self._prepare(following)  # its sections are read now, in order, whatever it is
            if batch.takes(nxt) and nxt.base_bits.dtype == batch.dtype:
                batch.add(nxt)
                taken.append(following)
                continue
            self._queue_batch(batch, taken, pool)
            self._queue.append((following, self._started(nxt)))  # not one of them: on its own
            return
        self._queue_batch(batch, taken, pool)

    def _queue_batch(self, batch: "_BatchedRebuilds", records: list, pool) -> None:
        future = pool().submit(batch.run)
        last = len(records) - 1
        self._queue.extend((rec, _InBatch(future, k, k == last)) for k, rec in enumerate(records))
        self._batched += last

    def _top_up(self) -> None:
        # At most `ahead` prepared: each holds its sections in memory, and a Windows its patch's share.
        while self._next < len(self._records) and len(self._queue) - self._batched < self._ahead:
            self._prepare_next()

    def close(self) -> None:
        """Wait for every rebuild still running: they read the base, which closes next."""
        from concurrent.futures import wait

        futures = [item[0] for _, item in self._queue if isinstance(item, tuple)]
        futures += list({item.future for _, item in self._queue if isinstance(item, _InBatch)})
        for future in futures:
            future.cancel()
        while futures:
            try:
                wait(futures)
                break
            except BaseException:  # noqa: BLE001 - even a second Ctrl-C waits: the base unmaps next
                pass
        self._queue.clear()
        self._batched = 0


def _nothing() -> None:
    pass


@dataclass(frozen=True)
class _InBatch:
    """A tensor rebuilt by a batch: the batch's future (its rebuilt tensors, slices of one buffer
    back to back in record order) and its place among them."""

    future: object
    index: int
    last: bool  # the batch's last tensor


class _BatchedRebuilds:
    """Consecutive small tensors of one width, each a ctx-rans section decoded onto its base, rebuilt
    on copies of their bases by one ctx_rans_batch call (file apply's many-small-tensors path: an
    MoE checkpoint's 18k experts cost a future, a scratch and a dozen kernel calls each). Each
    rebuilt tensor is checked against its hash, and its base by `base_check`, as Rebuild.run does."""

    def __init__(self, first: Rebuild):
        self.items: list[Rebuild] = [first]
        self.dtype = first.base_bits.dtype
        self.elements = first.numel

    @staticmethod
    def takes(item) -> bool:
        from pulsediff.codecs.ctx_rans_batch import batchable

        if not isinstance(item, Rebuild) or len(item.steps) != 1 or item.base_bits is None:
            return False
        rec, payload, _ = item.steps[0]
        return batchable(rec) and payload is not None and item.base_bits.dtype.itemsize == rec.dtype.itemsize

    def fits(self, rec: TensorRecord) -> bool:
        """Whether a record could join, from its header record (before its sections are read)."""
        from pulsediff.codecs.ctx_rans_batch import batchable

        return batchable(rec) and rec.dtype.bits_dtype == self.dtype

    def add(self, item: Rebuild) -> None:
        self.items.append(item)
        self.elements += item.numel

    def run(self) -> list:
        from pulsediff.codecs.ctx_rans_batch import Batch
        from pulsediff.kernels import cpu_batch
        from pulsediff.ops.rebuild import check_base_size

        out = np.empty(self.elements, self.dtype)
        batch, copies, at = Batch(self.dtype), [], 0
        for item in self.items:
            rec, payload, source = item.steps[0]
            check_base_size(rec, item.base_bits, source)
            copy = out[at:at + item.numel]
            copy[...] = item.base_bits
            at += item.numel
            batch.add(rec.name, copy, payload, rec.section.params,
                      SectionContext(rec.name, rec.numel, rec.dtype.itemsize, source))
            copies.append(copy)
        result = batch.run(cpu_batch)
        for k in range(result.done):  # each as Rebuild.run checks it: its target hash, then its base
            item = self.items[k]
            rec, _, source = item.steps[0]
            if rec.scheme.tensor_hash(copies[k]) != rec.target_hash:
                raise CorruptPatchError(source, f"tensor {rec.name!r} does not rebuild to its recorded hash")
            if item.base_check is not None:
                item.base_check.whole(rec, item.base_bits)
        error = result.error()
        if error is not None:
            raise error
        return copies


class _Span:
    """Tensors that lie back to back in one buffer (a batch's), written by one call when the next
    one does not follow them or the file ends: 18k expert tensors were 18k writes."""

    def __init__(self, writer: "_PipelinedWriter"):
        self.writer, self.buffer, self.lo, self.hi = writer, None, 0, 0

    def add(self, f, bits: np.ndarray) -> None:
        buffer = bits.base
        start = bits.__array_interface__["data"][0] - buffer.__array_interface__["data"][0]
        if buffer is not self.buffer or start != self.hi:
            self.flush(f)
            self.buffer, self.lo = buffer, start
        self.hi = start + bits.nbytes

    def flush(self, f) -> None:
        if self.buffer is not None:
            self.writer.put(f, memoryview(self.buffer.view(np.uint8)[self.lo:self.hi]))
            self.buffer = None


def _write_target(header: PatchHeader, target: _TargetFiles, target_bits, files: FolderFileSources, out_path: Path,
                  progress: Progress, before_commit, scratch: Scratch, backend, inputs: list) -> None:
    """Write the target's files from staged temporaries; rename only once all is verified.

    A new output folder is built whole under a temporary name and renamed
    into place, so a failure or a kill never leaves a folder behind.
    """
    progress.begin("apply", sum(r.nbytes for r in header.tensors), len(header.tensors))
    rebuilt: list[TensorRecord] = []  # what was written, each checked against its record's hash
    writer = _PipelinedWriter()  # tensor data goes out while the next is rebuilt
    tensors = _SideBySide([rec for _, _, records in target.files for rec in records], target_bits, scratch,
                          min(AHEAD_PER_THREAD * backend.side_by_side(), MAX_SIDE_BY_SIDE))
    with StagedFiles(inputs) as staged:  # the base: the one mapped input the output is made from
        if target.kind == "dir" and not out_path.exists():
            staged.new_folder(out_path)
        try:
            for name, raw, records in target.files:
                with staged.open(out_path if target.kind == "file" else out_path / name, direct=True) as f:
                    try:
                        f.write(len(raw).to_bytes(8, "little"))
                        f.write(raw)
                        span = _Span(writer)
                        for rec in records:
                            bits, release = tensors.take(rec)
                            if release is _nothing:  # a batch's slice: its bytes join the span
                                span.add(f, bits)
                            elif isinstance(bits, Windows):
                                span.flush(f)
                                for part in bits.parts:
                                    writer.put(f, memoryview(part).cast("B"), bits.hasher)
                                writer.put(f, memoryview(b""), bits.hasher, bits.check)
                            elif bits.size:
                                span.flush(f)
                                writer.put(f, memoryview(np.ascontiguousarray(bits)).cast("B"), then=release)
                                if release is None:
                                    writer.drain()  # in the caller's scratch, which the next rebuild reuses
                            elif release is not None:
                                release()
                            rebuilt.append(rec)
                            progress.advance(rec.nbytes)
                        span.flush(f)
                        writer.drain()  # the file closes next
                    except BaseException:
                        writer.abandon()  # no write may still be in flight when the file closes
                        raise
        finally:
            tensors.close()
            writer.close()
        if target.index is not None:
            with staged.open(out_path / INDEX_NAME) as f:
                f.write(target.index)
        for rec in files.final:
            data = files.contents(rec, *files.section(rec))
            if data is not None:
                with staged.open(out_path / rec.name) as f:
                    f.write(data)
        before_commit()
        _check_target_digest(header, rebuilt)
        for path in files.stale:
            staged.remove_at_commit(path)
        staged.commit()
    progress.end()


def _check_target_digest(header: PatchHeader, rebuilt: list[TensorRecord]) -> None:
    """The tensors written (each checked against its record's hash) make the target's digest. Where
    they are the header's own records, in its order, it does by the header's check (its target digest
    is the digest of its entries; PatchHeader.from_json): an 18k-tensor patch's digest is not taken
    twice. Records from elsewhere (the receiver's layout) are digested."""
    if len(rebuilt) == len(header.tensors) and all(map(operator.is_, rebuilt, header.tensors)):
        return
    ids = [TensorId(rec.name, rec.dtype.name, rec.shape, rec.target_hash) for rec in rebuilt]
    if header.scheme.digest(ids) != header.target_digest:
        raise TargetMismatchError(header.target_digest, header.scheme.digest(ids))


def _stale_paths(base: Checkpoint, target: _TargetFiles, removed_files: list[str]) -> list[Path]:
    """For an in-place apply to a folder: base shards (and index) the target no longer has, and the
    other files the patches say the target lost."""
    if base.kind != "dir":
        return []
    keep = {name for name, _, _ in target.files}
    stale = [shard.path for shard in base.shards if shard.name not in keep]
    if target.index is None and base.index_bytes is not None:
        stale.append(base.path / INDEX_NAME)
    return stale + [base.path / name for name in removed_files]
