"""Read-only questions about checkpoints."""

from __future__ import annotations

from pathlib import Path

from pulsediff.io.checkpoint import PRECISIONS, Checkpoint, TensorView
from pulsediff.format.digest import DEFAULT_SCHEME, SCHEMES, TREE_CHUNK_BYTES, DigestScheme, TensorId
from pulsediff.errors import UsageError
from pulsediff.runtime.progress import SILENT, Progress


def tensor_ids(view: TensorView, progress: Progress = SILENT, scheme: DigestScheme = DEFAULT_SCHEME,
               device: str | None = None) -> dict[str, TensorId]:
    """Name, dtype, shape and hash (under `scheme`) of every tensor as the view sees it. Tensors in
    GPU memory (a state dict's) are hashed there under the tree, unless `device` is "cpu" or the
    CUDA kernels cannot run ("auto" says so once): then on host copies."""
    from pulsediff.kernels.threads import num_threads, parallel_map

    ckpt = view.ckpt
    progress.begin("hash", sum(ckpt.entry(n).nbytes for n in ckpt.names), len(ckpt.names))
    ids = {}
    names = list(ckpt.names)
    # Live CUDA tensors under the tree: hashed where they are (ops.live.StateDict.device_data),
    # never copied to the host.
    gpu = None
    if scheme.tree and getattr(ckpt, "on_gpu", False):
        from pulsediff.kernels import backend_for_gpu_data

        gpu = backend_for_gpu_data(device)
    on_host = []
    for name in names:
        t = ckpt.device_data(name, view.precision) if gpu is not None else None
        if t is None:
            on_host.append(name)
            continue
        ids[name] = TensorId(name, t.dtype.name, t.shape, scheme.tensor_hash(t.bits, gpu))
        progress.advance(ckpt.entry(name).nbytes)
    small = TREE_CHUNK_BYTES // 2  # hashed here, one after another: a few us each, a thread handoff costs 20
    for name in [n for n in on_host if ckpt.entry(n).nbytes <= small]:
        t = view.get(name)
        ids[name] = TensorId(name, t.dtype.name, t.shape, scheme.tensor_hash(t.bits))
        progress.advance(ckpt.entry(name).nbytes)
    names = [n for n in on_host if n not in ids]
    batch = num_threads()  # tensors hashed at once (XXH3 releases the GIL); casts keep a batch in memory
    for first in range(0, len(names), batch):
        tensors = [view.get(name) for name in names[first:first + batch]]
        for t, digest in zip(tensors, parallel_map(scheme.tensor_hash, [(t.bits,) for t in tensors])):
            ids[t.name] = TensorId(t.name, t.dtype.name, t.shape, digest)
            progress.advance(ckpt.entry(t.name).nbytes)
    progress.end()
    return ids


def checkpoint_digest_of(path: str | Path, precision: str = "exact", progress: Progress = SILENT,
                         scheme: str | DigestScheme = DEFAULT_SCHEME) -> str:
    """The digest a patch records for this checkpoint as base or target, under `scheme` (a
    DigestScheme or its name: "tree", the default since format 1.4, or "flat")."""
    if precision not in PRECISIONS:
        raise UsageError(f"unknown precision {precision!r}; choose exact or bf16")
    scheme = digest_scheme(scheme)
    with Checkpoint(path) as ckpt:
        return scheme.digest(tensor_ids(TensorView(ckpt, precision), progress, scheme).values())


def digest_scheme(scheme: str | DigestScheme) -> DigestScheme:
    """A scheme given by name (a user's choice) or as itself; UsageError for an unknown name."""
    if isinstance(scheme, DigestScheme):
        return scheme
    if scheme not in SCHEMES:
        raise UsageError(f"unknown digest scheme {scheme!r}; choose {' or '.join(SCHEMES)}")
    return SCHEMES[scheme]
