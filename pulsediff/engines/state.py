"""What an inference engine holds, in checkpoint coordinates: the base every patch is decoded against.

An engine's own parameters are a poor base. vLLM fuses q/k/v and gate/up, shards them across
tensor-parallel ranks and, on the CPU, repacks every Linear weight into an opaque oneDNN handle
(the `.weight` is then empty). Reading them back into checkpoint names would need every model's
loader run in reverse. So the engine side keeps `HostState`: the checkpoint the engine was started
from, as one host tensor per checkpoint name, kept at the engine's current step. A patch is
decoded and fully verified against it (apply_to_state_dict: the base's and every rebuilt
tensor's word sums, or XXH3 digests for patches older than format 1.2; signatures under trust)
before the engine is touched, and what changed is then
handed to the engine in checkpoint coordinates, which its own `load_weights` maps into fused and
sharded parameters.

Cost: one host copy of the checkpoint per machine (its size in host memory, never in device
memory): an engine's ranks on one machine share it (engines/shared_state.py), or, where they
cannot, each keeps its own.
`HostState` is independent of any engine: vLLM (engines/vllm.py) and a second engine share it.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pulsediff.errors import PulsediffError, UsageError

__all__ = ["HostState", "Advance", "load_host_state", "parse_update_request"]


@dataclass
class Advance:
    """What one update did to the host state."""

    status: str  # "applied" or "up-to-date"
    step: int | None  # the series' step for the digest reached (None for a lone patch file)
    digest: str  # the digest the state now has
    changes: dict = field(default_factory=dict)  # name -> flat positions written (each once), or None (whole)
    links: int = 0  # patch files applied
    prepared: bool = False  # whether it went on from a preparation (HostState.prepare)


@dataclass
class _Staged:
    """What a staged advance takes back: the undo log of its writes, and the state's fields before it."""

    undo: list
    digest: str | None
    step: int | None
    sums: dict


@dataclass
class _Prepared:
    """An advance prepared ahead (HostState.prepare): staged, until an advance of the same source takes it."""

    key: tuple  # (source, trust): what a later advance must share to go on from it
    advance: Advance


CHECK = "prefer-sums"  # apply_to_state_dict's: word sums where a patch carries them, else digests


class HostState:
    """name -> contiguous CPU torch tensor (checkpoint names, dtypes and shapes) and its digest."""

    def __init__(self, tensors: dict, digest: str, step: int | None = None, origin: str = ""):
        self.tensors = tensors
        self.digest = digest  # None: unknown (a revert that failed): the next update hashes the tensors
        self.step = step
        self.origin = origin  # where it was loaded from, for messages
        # The tensors' word sums as the last update left them: nothing else writes the tensors, so
        # the next update's base check need not read them all again (apply_to_state_dict's `sums`).
        self.sums: dict[str, int] = {}
        self.staged: _Staged | None = None  # an advance not yet committed (advance(stage=True), or prepare())
        self.prepared: _Prepared | None = None  # what prepare() left staged, for the next advance to go on from
        self.prepare_error = ""  # why the last preparation failed ("": it did not), for the engine's log
        self.prepare_seconds = 0.0  # how long the last preparation ran
        self._preparing: threading.Thread | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def advance(self, source: str, step: int | None = None, trust=None, trust_state=None,
                cache: Path | None = None, force: bool = False, stage: bool = False) -> Advance:
        """Bring the tensors to `step` of the series at `source` (a folder, s3:// or http(s):// URL, or a
        path to its manifest.json), or through the patch file `source` (a path, or a URL ending in
        .pulsediff). Every file is fetched and checked, and every tensor verified, before the first is
        written; on any error the tensors are as they were and PulsediffError says why.

        Tensors whose digest the series does not list (another run, or a step it no longer keeps) are
        moved onto it, from an anchor, only with `force`; to an earlier step only when `step` asks.

        `stage`: keep what it takes to go back (the old values at the written positions), until
        `commit()` or `revert()`: for an engine whose ranks must all take an update or none (a
        rank that succeeded takes it back when another failed). Without it, that is dropped on
        return (a failure after the tensors were written, in the housekeeping, puts them back).

        After `prepare()` (of the same source and trust) it goes on from where the preparation got:
        the returned Advance, the undo log and a failure's revert cover both, so that the state
        goes back to where it stood before the preparation, as the engine still is."""
        self.settle()
        return self._advance_staged(source, step, trust, trust_state, cache, force, stage)

    def prepare(self, source: str, step: int | None = None, trust=None, trust_state=None,
                cache: Path | None = None, force: bool = False) -> bool:
        """Start `advance(..., stage=True)` on a thread of its own and return at once: the fetch, the
        checks and the decode run while the engine goes on serving its current weights. The next
        advance waits for it and, for the same source and trust, goes on from it, so that only what
        is left (usually nothing) is on its critical path. False (nothing started) while an earlier
        preparation still runs. A failed preparation leaves the state as it was (prepare_error says
        why), and the next advance does the whole work itself."""
        running = self._preparing
        if running is not None and running.is_alive():
            return False
        self.settle()
        self.prepare_error = ""
        thread = threading.Thread(target=self._prepare, args=(source, step, trust, trust_state, cache, force),
                                  name="pulsediff-prepare", daemon=True)
        self._preparing = thread
        thread.start()
        return True

    @property
    def preparing(self) -> bool:
        running = self._preparing
        return running is not None and running.is_alive()

    def settle(self) -> None:
        """Wait for a running preparation (the tensors are its own until it ends). Called by the
        preparation's own thread (which never needs to), it does nothing."""
        thread = self._preparing
        if thread is None or thread is threading.current_thread():
            return
        thread.join()
        self._preparing = None

    def _prepare(self, source, step, trust, trust_state, cache, force) -> None:
        start = time.perf_counter()
        try:
            advance = self._advance_staged(source, step, trust, trust_state, cache, force, stage=True)
        except BaseException as exc:  # the state is as it was before; the next advance does the work
            self.prepare_error = str(exc) if isinstance(exc, PulsediffError) else f"{type(exc).__name__}: {exc}"
            return
        finally:
            self.prepare_seconds = time.perf_counter() - start
        self.prepared = _Prepared(_prepared_key(source, trust), advance)

    def _advance_staged(self, source, step, trust, trust_state, cache, force, stage: bool) -> Advance:
        prepared, self.prepared = self.prepared, None
        if prepared is not None and prepared.key != _prepared_key(source, trust):
            self._revert()  # prepared from another source (or under other keys): not a base to go on from
            prepared = None
        if self.staged is not None and prepared is None:
            raise RuntimeError("the host state holds a staged update: commit() or revert() it first")
        before = self.staged or _Staged([], self.digest, self.step, dict(self.sums))
        self.staged = None
        try:
            advance = self._advance(source, step, trust, trust_state, cache, force, before.undo)
        except BaseException:  # after a completed apply too (its housekeeping): as it was, every field
            self.staged = before
            self._revert()
            if prepared is None:
                raise
            # From where the preparation got, the way on may not exist (asked for a step before the
            # prepared one, where no chain leads back): the whole way again, from where the engine is.
            return self._advance_staged(source, step, trust, trust_state, cache, force, stage)
        if prepared is not None:
            advance = _joined(prepared.advance, advance)
        if stage:
            self.staged = before
        return advance

    def drop_unjudged(self) -> None:
        """Take back a staged advance whose caller never gave its verdict (an update interrupted
        between its stage and its commit or revert); a preparation's stage stays, for the next
        advance to go on from. Does nothing while a preparation runs: the state is its own."""
        if not self.preparing and self.staged is not None and self.prepared is None:
            self.revert()

    def commit(self) -> None:
        """Keep the staged update (drop what it took to go back)."""
        self.settle()
        self.staged = self.prepared = None

    def revert(self) -> None:
        """Take the staged update back: tensors, digest, step and kept sums as they were before it."""
        self.settle()
        self._revert()

    def _revert(self) -> None:
        staged, self.staged, self.prepared = self.staged, None, None
        if staged is None:
            return
        from pulsediff.ops.live import revert

        try:
            revert(staged.undo)
        except BaseException:
            # Some tensor may be neither before nor after: nothing vouches for its sum or the digest,
            # and the next update hashes the tensors again.
            self.sums.clear()
            self.digest = None
            raise
        self.digest, self.step, self.sums = staged.digest, staged.step, staged.sums

    def _advance(self, source, step, trust, trust_state, cache, force, undo_log) -> Advance:
        kind, where = classify_source(source)
        check_request_fits(kind, source, step, trust)
        # CHECK (FORMAT.md §7.1): the word sums of the base and of each rebuilt tensor, with the changes
        # located and added in place, 2-3x faster on the CPU than rebuilding every tensor and hashing it;
        # XXH3 digests for a patch older than format 1.2, which carries no sums. Each file's own
        # checksums, and under trust its SHA-256, are checked all the same.
        from pulsediff.ops.live import apply_to_state_dict

        changes: dict = {}
        if kind == "patch":
            if is_url(where):  # read after the request's checks, bounded by what an anchor of these tensors needs
                where = fetch_patch_url(where, limit=2 * self.nbytes + (1 << 20))
            result = apply_to_state_dict(self.tensors, [where], check=CHECK, changes=changes, sums=self.sums,
                                         undo_log=undo_log)
            self.digest = result.target_digest
            if result.status == "applied":
                self.step = None  # a lone patch names no step
            return Advance(result.status, self.step, result.target_digest, changes, 1)
        from pulsediff.series.catch_up import catch_up_state_dict

        result = catch_up_state_dict(self.tensors, where, check=CHECK, digest=self.digest, trust=trust,
                                     trust_state=trust_state, step=step, changes=changes, cache=cache,
                                     sums=self.sums, undo_log=undo_log, force=force,
                                     holder=f"the engine's weights (step {self.step})" if self.step is not None
                                     else "the engine's weights")
        self.digest, self.step = result.digest, result.step
        return Advance(result.status, result.step, result.digest, changes, result.links)


def _prepared_key(source: str, trust) -> tuple:
    return source, tuple(trust) if trust else None


def _joined(first: Advance, then: Advance) -> Advance:
    """Two advances one after the other, as one: every position either wrote, the second's target."""
    from pulsediff.ops.live import union_positions

    changes = dict(first.changes)
    for name, positions in then.changes.items():
        if name not in changes:
            changes[name] = positions
        elif positions is None or changes[name] is None:
            changes[name] = None
        else:
            changes[name] = union_positions([changes[name], positions])
    status = "applied" if "applied" in (first.status, then.status) else then.status
    return Advance(status, then.step, then.digest, changes, first.links + then.links, prepared=True)


def check_request_fits(kind: str, source: str, step, trust) -> None:
    if kind == "patch" and (step is not None or trust):
        raise UsageError(f"{source} is one patch file: a step and trusted keys need a published series")


def is_url(source: str) -> bool:
    from pulsediff.series.remote import is_remote

    return is_remote(source)


def classify_source(source: str) -> tuple[str, str]:
    """("patch", a local path or a patch URL) or ("series", what open_store takes). Reads nothing
    remote."""
    if not isinstance(source, str) or not source:
        raise UsageError("'source' must be a non-empty string (a patch file, a series folder or URL), not "
                         f"{_described(source)}")
    if is_url(source):
        if source.split("?", 1)[0].endswith(".pulsediff"):
            if "?" in source:
                raise UsageError(f"{source}: a patch URL with a query string is not supported; publish a series")
            return "patch", source
        return "series", source.rstrip("/")
    path = Path(source)
    if path.name == "manifest.json":
        return "series", str(path.parent)
    if path.is_dir():
        return "series", source
    if path.is_file():
        return "patch", source
    raise PulsediffError(f"{source}: no such patch file or series folder")


def fetch_patch_url(url: str, limit: int) -> bytes:
    """The bytes of one patch file over HTTP(S) or S3, at most `limit` (its own checksums are checked
    when it is read)."""
    from urllib.parse import unquote

    from pulsediff.series.remote import open_store

    parent, _, name = url.rpartition("/")
    store = open_store(parent + "/")
    try:
        return store.read_object(unquote(name), limit)
    finally:
        store.close()


def load_host_state(folder: str | os.PathLike) -> HostState:
    """The checkpoint at `folder` (a .safetensors file, or a model folder of shards with an index)
    copied into host memory, with its digest (docs/FORMAT.md §3). The file is only read."""
    import torch

    from pulsediff.io.checkpoint import Checkpoint

    path = Path(folder)
    tensors = {}
    with Checkpoint(path) as ckpt:
        for name, dtype, shape, _ in host_entries(ckpt, path):
            raw = np.array(ckpt.raw_bytes(name), copy=True)  # a private copy: the file's pages stay untouched
            tensors[name] = torch.from_numpy(raw).view(getattr(torch, dtype)).reshape(shape)
    return host_state_over(tensors, path)


def host_entries(ckpt, path: Path) -> list[tuple[str, str, list[int], int]]:
    """(name, torch dtype name, shape, bytes) of each tensor of an open Checkpoint, in its order;
    UsageError for a tensor of a dtype torch cannot hold."""
    out = []
    for name in ckpt.names:
        entry = ckpt.entry(name)
        if not entry.dtype.torch_name:
            raise UsageError(f"{path}: tensor {name!r} is {entry.dtype.name}, which torch cannot hold")
        out.append((name, entry.dtype.torch_name, list(entry.shape), entry.nbytes))
    return out


def host_state_over(tensors: dict, path: Path) -> HostState:
    """A HostState of the tensors just read from `path`, with their digest; refused where there are none."""
    from pulsediff.ops.live import state_dict_digest

    if not tensors:
        raise PulsediffError(f"{path} holds no tensors")
    return HostState(tensors, state_dict_digest(tensors), origin=str(path))


# -- the request an engine's update takes ---------------------------------------------------------

UPDATE_KEYS = ("source", "step", "trust", "prepare", "force")
KEY_PREFIX = "ed25519:"  # signing.KEY_PREFIX (not imported: that module needs cryptography)


@dataclass(frozen=True)
class UpdateRequest:
    source: str
    step: int | None = None
    trust: tuple[str, ...] | None = None  # public keys (ed25519:... lines) or files of them
    prepare: bool = False  # verify and decode in the background, touching nothing (HostState.prepare)
    force: bool = False  # weights the series does not list may be replaced with a step of it, from an anchor


def parse_update_request(info) -> UpdateRequest:
    """{"source": S, "step": N, "trust": K, "prepare": P} checked for type and range (UsageError, one line)."""
    if not isinstance(info, dict):
        raise UsageError(f"update_info must be an object with 'source' (and optionally 'step', 'trust'), "
                         f"not {type(info).__name__}")
    unknown = sorted(str(k)[:40] for k in set(info) - set(UPDATE_KEYS))
    if unknown:
        raise UsageError(f"update_info has unknown key {unknown[0]!r}; it takes {', '.join(UPDATE_KEYS)}")
    if "source" not in info:
        raise UsageError("update_info needs 'source': a patch file, a series folder, or an s3:// or http(s):// URL")
    source = info["source"]
    if not isinstance(source, str) or not source or len(source) > 4096 or "\0" in source:
        raise UsageError(f"update_info 'source' must be a path or URL string of at most 4096 characters, not "
                         f"{_described(source)}")
    step = info.get("step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 1 << 63):
        raise UsageError(f"update_info 'step' must be a non-negative integer, not {_described(step)}")
    trust = info.get("trust")
    if trust is not None:
        keys = [trust] if isinstance(trust, str) else trust
        # Keys inline only: a request names no file on the engine's machine (one would be read there).
        if not isinstance(keys, list) or not keys or not all(
                isinstance(k, str) and k.startswith(KEY_PREFIX) and len(k) < 200 for k in keys):
            raise UsageError(f"update_info 'trust' must be a public key ({KEY_PREFIX}...) or a list of them")
        trust = tuple(keys)
    prepare = info.get("prepare", False)
    if not isinstance(prepare, bool):
        raise UsageError(f"update_info 'prepare' must be true or false, not {_described(prepare)}")
    force = info.get("force", False)
    if not isinstance(force, bool):
        raise UsageError(f"update_info 'force' must be true or false, not {_described(force)}")
    return UpdateRequest(source, step, trust, prepare, force)


def _described(value) -> str:
    """A request's value for a message: short, and safe for any value (a repr of a list nested 10,000
    deep would recurse past Python's limit, a huge string flood the line)."""
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        text = repr(value)
        return text if len(text) <= 60 else text[:57] + "..."
    return f"a {type(value).__name__}"
