"""`squash_patches`: one patch from a base straight to the end of a chain.

For a worker many steps behind: the squashed patch carries each tensor's net
change only, so it is at most about the size of the union of the links'
changes, and usually much less than their sum (an element that moves at
several steps is carried once).
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

from pulsediff.ops.apply import FolderFileSources
from pulsediff.ops.rebuild import carry_through
from pulsediff.format.patch_file import open_chain, read_layout
from pulsediff.io.checkpoint import TensorData, TensorView, open_checkpoint
from pulsediff.codecs import DEFAULT_SPARSE_CODEC
from pulsediff.codecs.base import Scratch
from pulsediff.errors import BaseMismatchError, UsageError, refuse_existing, refuse_folder_for_file
from pulsediff.ops.inspect import tensor_ids
from pulsediff.kernels import get_backend
from pulsediff.ops.make import TargetSource, check_choices, write_patch
from pulsediff.format.header import PatchHeader
from pulsediff.runtime.progress import SILENT, Progress

SQUASHED_NAME = "squashed.pulsediff"  # the name suggested inside a folder given as the output


def squash_patches(
    base: str | Path | None,
    patches: list[str | Path],
    out: str | Path | BinaryIO,
    *,
    codec: str = DEFAULT_SPARSE_CODEC,
    device: str | None = None,
    progress: Progress = SILENT,
    force: bool = False,
) -> PatchHeader:
    """Write one patch equal in effect to applying `patches` to `base` in order (an existing `out` file only
    with `force`; a folder never)."""
    if not patches:
        raise UsageError("give at least one patch to squash")
    refuse_folder_for_file(out, "a patch is a single file", SQUASHED_NAME)
    refuse_existing(out, force)
    if any(str(p) == "-" for p in patches):
        raise UsageError("squash reads patches from files, not stdin")
    with open_chain(patches) as links:
        final = links[-1].header
        check_choices(codec, final.precision)
        for link in links:
            link.reader.check_size(link.header.sections_length)
        backend = get_backend(device)
        with open_checkpoint(base) as base_ckpt:
            view = TensorView(base_ckpt, final.precision)
            scheme = links[0].header.scheme  # a chain's links share it (their digests link up)
            digest = scheme.digest(tensor_ids(view, scheme=scheme).values())
            if digest != links[0].header.base_digest:
                raise BaseMismatchError(links[0].header.base_digest, digest, "squash needs the first patch's base")
            scratch = Scratch()
            records = {r.name: r for r in final.tensors}

            def get(name: str) -> TensorData:
                rec = records[name]
                return TensorData(name, rec.dtype, rec.shape, carry_through(name, links, view, backend, scratch))

            # The chain's end state of the folder's other files (small: read them now).
            folder = FolderFileSources(links, base_ckpt, final, in_place=False, sequential=False)
            file_bytes = {rec.name: folder.contents(rec, *folder.section(rec)) for rec in folder.final}
            file_bytes = {name: data for name, data in file_bytes.items() if data is not None}
            target = TargetSource(
                precision=final.precision, kind=final.layout.kind,
                layout_blob=read_layout(links[-1].reader, final, sequential=False),
                layout_files=list(final.layout.files), index_len=final.layout.index_len,
                entries=[(r.name, r.nbytes) for r in final.tensors], get=get,
                file_names=list(file_bytes), read_file=file_bytes.__getitem__,
                reuses_buffers=True,  # `get` rebuilds into `scratch`
                inputs=[base_ckpt],  # write_patch checks it, then closes it unverified: no error after the commit
                # Which layout the chain's appliers write (§5.2): before 1.5 a bf16 patch did not say
                # whether it cast, and the receiver's layout was written wherever the base allowed.
                cast=final.layout.cast if links[-1].reader.version >= (1, 5) else
                (True if final.precision == "bf16" else None),
            )
            header = write_patch(base, target, out, codec=codec, device=device, progress=progress, scheme=scheme)
        if header.target_digest != final.target_digest:  # cannot happen unless a bug: refuse loudly
            raise AssertionError("squashed patch does not reach the chain's target")
        return header
