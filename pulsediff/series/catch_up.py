"""Catching up: a worker follows a published series (publish.py) to its newest step.

`catch_up` reads the manifest, finds the cheapest path (in bytes) from a
worker's checkpoint (or from nothing, through an anchor) to the newest step,
checks every file on it and applies it as one chain; a missing or damaged file
is dropped from the graph and another path tried, so the result is the newest
checkpoint or an error, never a wrong checkpoint. `catch_up_state_dict` does
the same for live tensors in memory. The source is a folder, an S3 prefix or
an HTTP(S) URL, read through a `Store` (store.py; S3, HTTP and the download cache: remote.py).

Signed series (signing.py, docs/FORMAT.md §8.1): `catch_up(trust=KEYS)` uses
only a manifest signed by one of KEYS, not older than one it accepted before,
and only files whose SHA-256 is the one that manifest names.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from pathlib import Path

from pulsediff.errors import (CheckpointNotFoundError, InvalidManifestError, NotInSeriesError, PulsediffError, UsageError,
                              refuse_existing)
from pulsediff.format.manifest import MANIFEST, Entry, Manifest, cheapest_paths, file_sha256
from pulsediff.io.checkpoint import Checkpoint, TensorView
from pulsediff.runtime.progress import SILENT, Progress
from pulsediff.series.remote import series_source
from pulsediff.series.store import Folder, Store, size_problem

MAX_SEARCHES = 32  # chains tried by one catch-up before damaged files make it give up


# -- catching up -----------------------------------------------------------------------
#
# The manifest chooses the chain; the files decide what is true. Every file on
# the chain is checked before use: its size against its entry (a half-fetched
# file), its checksums (damage), and its own header's precision, base and
# target digests against its entry (a mislabelled file). A missing or damaged
# file is dropped and another chain tried; a file that is intact but says
# something else than the manifest makes the manifest untrustworthy, so
# catch-up stops. The step reported is the one the manifest lists for the
# digest of what was actually rebuilt.


@dataclass(frozen=True)
class CatchUpResult:
    status: str  # "up-to-date", "applied", or "partial" (the newest step is unreachable; `step` is how far it got)
    output: Path
    step: int
    files: list[str]  # the chain applied, in order
    from_anchor: bool
    skipped: list[str]  # files found missing or damaged on the way
    problems: dict[str, str] = field(default_factory=dict)  # skipped file -> what was wrong with it
    newest: int | None = None  # the newest published step
    stopped: str = ""  # "partial": why the newest step was not reached
    replaced: bool = False  # the checkpoint was no step of the series, and was replaced from an anchor (force)
    bytes: int = 0  # the chain's files (fetched, for a remote source)


@dataclass(frozen=True)
class CatchUpPlan:
    step: int  # the newest published step
    files: list[str]  # the chain catch-up would apply, in order; empty when already there
    from_anchor: bool
    urls: list[str] = field(default_factory=list)  # where each file is: its name in a folder, its URL remotely


def read_source_manifest(source: Store, trust, *, record: bool = True) -> Manifest | None:
    """The source's manifest; with `trust` (signing.Trust), only one signed by a trusted key, not older than
    one accepted before (recorded unless `record` is false)."""
    if trust is None:
        return source.read_manifest()
    from pulsediff.series.signing import read_signed_manifest

    return read_signed_manifest(source, trust, record=record)


def _where_we_are(checkpoint: Path, source: Store, progress: Progress, trust=None, record: bool = True):
    """(manifest, the checkpoint's tensor ids or None, its digest or None)."""
    from pulsediff.ops.inspect import tensor_ids

    _refuse_swapped(checkpoint, source)
    manifest = read_source_manifest(source, trust, record=record)
    if manifest is None or not manifest.entries:
        raise CheckpointNotFoundError(_shown(source, MANIFEST), "manifest")
    ids = None  # hashed once here, handed to apply
    if checkpoint.exists():
        with Checkpoint(checkpoint) as ckpt:
            ids = tensor_ids(TensorView(ckpt, manifest.precision), progress, manifest.scheme)
    return manifest, ids, manifest.scheme.digest(ids.values()) if ids is not None else None


def refuse_other_kind(out: Path, checkpoint: Path) -> None:
    """UsageError, before anything is read, when an existing `out` is a folder and the checkpoint a file,
    or the other way round: a series rebuilds its checkpoints' kind, so -f could not help (it replaces
    a file with a file, a folder with a folder), and is not advised."""
    if not (out.exists() and checkpoint.exists()) or out.is_dir() == checkpoint.is_dir():
        return
    kind = {True: "a folder", False: "a file"}
    raise UsageError(f"{out} is {kind[out.is_dir()]}, but {checkpoint} is {kind[checkpoint.is_dir()]}, as the series' "
                     f"steps are: give a new name for -o")


def _refuse_swapped(checkpoint: Path, source: Store) -> None:
    """UsageError when the arguments came the other way round: a series folder given as the checkpoint,
    and a SOURCE that holds no manifest (a checkpoint, or a name that is not there yet)."""
    if (isinstance(source, Folder) and not (source.folder / MANIFEST).exists()
            and (Path(checkpoint) / MANIFEST).is_file()):
        raise UsageError(f"{checkpoint} is a series folder and {source.location} is not: the worker's checkpoint "
                         f"comes first (pulsediff catch-up {source.location} {checkpoint})")


def _goals(manifest: Manifest, have: str | None) -> list[tuple[int, str]]:
    """(step, digest) of every step newer than the checkpoint's, newest first: when the newest cannot
    be reached (its only patch is damaged, say), the newest reachable step is still progress."""
    have_step = manifest.step_of(have) if have else None
    floor = -1 if have_step is None else have_step
    return sorted({(e.step, e.target) for e in manifest.entries if e.step > floor}, reverse=True)


def plan_catch_up(checkpoint: Path, patch_dir: "Path | str | Store", *, progress: Progress = SILENT, trust=None,
                  trust_state: Path | None = None, force: bool = False, out: Path | None = None,
                  step: int | None = None) -> CatchUpPlan:
    """The files catch-up would apply, judged from the manifest alone (the files need not be here).

    For fetching only what is needed: a worker that mirrors the whole folder
    would also download every anchor, each nearly the size of the checkpoint.
    `urls` holds where each file is: its name for a folder (for `rsync
    --files-from`), its URL for a remote source. `trust`: as catch_up's (the
    rollback record is checked, not written); `force` and `out`: as
    catch_up's (a checkpoint that is no step of the series is planned from an
    anchor with force in place, refused otherwise, as the run would be); `step` too.
    """
    from pulsediff.series.signing import as_trust

    trust = as_trust(trust, trust_state)
    source = series_source(patch_dir)
    manifest, _, have = _where_we_are(checkpoint, source, progress, trust, record=False)
    newest = step_entry(manifest, step, source.location)
    if have == newest.target:
        return CatchUpPlan(newest.step, [], False)
    if have is not None and not _in_series(manifest, have):
        _refuse_stranger(Path(checkpoint), source, manifest, out, force)
    paths = cheapest_paths(manifest.entries, have)
    if not paths.reaches(newest.target):
        raise PulsediffError(f"the manifest in {source.location} has no chain from {checkpoint} to step {newest.step}")
    path = paths.path_to(newest.target)
    return CatchUpPlan(newest.step, [e.file for e in path], path[0].kind == "anchor", [source.where(e.file) for e in path])


def catch_up(checkpoint: Path, patch_dir: "Path | str | Store", out: Path | None = None, *, device: str | None = None,
             cache: Path | None = None, progress: Progress = SILENT, force: bool = False, trust=None,
             trust_state: Path | None = None, step: int | None = None) -> CatchUpResult:
    """Bring `checkpoint` (or a new `out`) to the newest step published at `patch_dir`: a folder, an
    `s3://bucket/prefix` or `http(s)://` URL (files are fetched into `cache`), or a Store. An existing
    `out` (other than `checkpoint`) is refused unless `force`. A `checkpoint` that is no step of the
    series (another model, or a step older than those it keeps) raises NotInSeriesError rather than be
    replaced from an anchor, unless `force` and no other `out`. `step`: go to that step instead (an
    earlier one too: asked for, it is rebuilt from an anchor), never to a later one.

    `trust`: public keys (`ed25519:...` lines, files of them, or a signing.Trust). Then the manifest must
    be signed by one of them and not older than the newest accepted before from this source under any
    trusted key (the record in `trust_state`, default signing.default_state_file()), and every file must have the
    SHA-256 the manifest names; otherwise UntrustedManifestError, and nothing is written."""
    from pulsediff.series.signing import as_trust

    trust = as_trust(trust, trust_state)
    checkpoint = Path(checkpoint)
    if out is not None:
        out = Path(out)
        if not _same_path(out, checkpoint):
            refuse_other_kind(out, checkpoint)
            refuse_existing(out, force)
    source = series_source(patch_dir, cache=cache)
    # A trusting worker reads a local folder's files through private copies (a remote source's through its
    # own cache): a file the folder's writer swaps after its check is never the one applied.
    private = PrivateCopies(cache) if trust is not None and not source.remote else None
    try:
        return _catch_up(checkpoint, source, out, device, progress, trust, private, force, step)
    finally:
        if private is not None:
            private.close()
        if source is not patch_dir:
            source.close()


def _catch_up(checkpoint: Path, source: Store, out: Path | None, device: str | None,
              progress: Progress, trust=None, private: "PrivateCopies | None" = None,
              force: bool = False, step: int | None = None) -> CatchUpResult:
    from pulsediff.ops.apply import apply_chain

    manifest, ids, have = _where_we_are(checkpoint, source, progress, trust)
    newest = step_entry(manifest, step, source.location)  # the step asked for, or the newest
    out_path = out or checkpoint
    where = _shown(source, MANIFEST)

    def check(path: Path, e: Entry) -> str | None:
        if private is None:
            return check_file(path, e, manifest.precision, where, authenticate=trust is not None)
        return check_file(path, e, manifest.precision, where, authenticate=True, private=private.path(e.file))

    def used(name: str) -> Path:  # the file checked: its private copy, when one was made
        return private.path(name) if private is not None else source.path(name)

    def expect(digest: str) -> str | None:  # with trust, what the chain must rebuild: the signed entry's target
        return digest if trust is not None else None

    if have == newest.target:
        if out is not None and not _same_path(out, checkpoint):  # the copy goes through a checked file
            problem = source.fetch([newest], check, progress).get(newest.file)
            if problem is not None:
                raise PulsediffError(f"{checkpoint} is at step {newest.step}, but {out} cannot be written from "
                                     f"{newest.file}: {problem}")
            # An `out` that already is the target (given with force) is left as it is.
            apply_chain(checkpoint, [used(newest.file)], out, device=device, progress=progress, base_ids=ids,
                        force=True, expect_target=expect(newest.target), expect_where=where)
            source.forget([newest.file], {e.file for e in manifest.entries})
        return CatchUpResult("up-to-date", out_path, newest.step, [], False, [], newest=newest.step)
    stranger = ids is not None and not _in_series(manifest, have)
    if stranger:
        _refuse_stranger(checkpoint, source, manifest, out, force)
    problems = source.known_problems(manifest.entries)
    goals = [newest.target] if step is not None else [d for _, d in _goals(manifest, have)]
    goal, chain = _intact_chain(manifest, have, goals, source, check, problems, progress)
    if goal is None:
        raise PulsediffError(f"cannot reach any newer step from {checkpoint}: no intact chain in {source.location}"
                             + (f" ({_describe(problems)})" if problems else ""))
    if chain is None:
        raise PulsediffError(f"gave up after finding damaged files on {MAX_SEARCHES} chains in {source.location} "
                             f"({_describe(problems)})")
    from_anchor = chain[0].kind == "anchor"
    # force: the checkpoint itself is replaced (catch-up's job), and an existing `out` was refused before unless forced.
    result = apply_chain(None if from_anchor else checkpoint, [used(e.file) for e in chain], out_path,
                         device=device, progress=progress, base_ids=None if from_anchor else ids, force=True,
                         expect_target=expect(goal), expect_where=where)
    source.forget([e.file for e in chain], {e.file for e in manifest.entries})
    step = manifest.step_of(result.header.target_digest)  # the digest rebuilt and verified, not a label
    status = "applied" if step == newest.step else "partial"
    # Worth saying: what was found wrong, and files missing from the chain the manifest itself points to
    # (a worker that fetched only its plan lacks every other file, and that is no news).
    planned = cheapest_paths(manifest.entries, have)
    expected = [e.file for e in planned.path_to(newest.target)] if planned.reaches(newest.target) else []
    problems = {f: why for f, why in problems.items() if why != "missing" or f in expected}
    stopped = "" if status == "applied" else _stopped(problems, expected, newest.step)
    return CatchUpResult(status, out_path, step, [e.file for e in chain], from_anchor, sorted(problems), problems,
                         newest.step, stopped, stranger, sum(e.bytes for e in chain))


def _stopped(problems: dict[str, str], planned: list[str], newest: int) -> str:
    """Why a catch-up fell short, in a few words: the first file of the planned chain found wrong (the
    one the worker would have used), and how many others were."""
    if not problems:
        return f"no intact chain reaches step {newest}"
    first = next((f for f in planned if f in problems), min(problems))
    n = len(problems) - 1
    more = f" (and {n} more {'file' if n == 1 else 'files'} missing or damaged)" if n else ""
    return f"{first}: {problems[first]}{more}"


def _in_series(manifest: Manifest, digest: str) -> bool:
    """Whether a checkpoint with this digest is one of the series' steps (or the base of one of its patches)."""
    return any(digest in (e.target, e.base if e.kind == "patch" else None) for e in manifest.entries)


def _refuse_stranger(checkpoint: Path, source: Store, manifest: Manifest, out: Path | None, force: bool) -> None:
    """A checkpoint the manifest does not list would be replaced wholesale from an anchor: only with force, in
    place. Written to another `out`, it would not be the worker's model moved on, whatever the flags."""
    if out is not None and _same_path(Path(out), checkpoint):
        out = None  # in place
    what = _not_listed(str(checkpoint), source.location)
    if out is not None:
        raise NotInSeriesError(f"{what}; to build {out} from an anchor, catch up {out} on its own "
                               f"(pulsediff catch-up {out} {source.location})")
    if not force:
        raise NotInSeriesError(f"{what}; give -f/--force (force=True) to replace it with step "
                               f"{manifest.newest.step}, rebuilt from an anchor")


def _not_listed(what: str, location: str, verb: str = "is") -> str:
    """The words for a checkpoint (or live weights) a series does not list, the same on every path."""
    return (f"{what} {verb} not a step of the series in {location} (the manifest lists no step with "
            f"{'its' if verb == 'is' else 'their'} digest: another run or model, or a step older than those the series keeps)")


def _intact_chain(manifest: Manifest, have: str | None, goals: list[str], source: Store, check, problems: dict,
                  progress: Progress = SILENT) -> tuple[str | None, list[Entry] | None]:
    """(goal, chain): the cheapest chain from `have` to the first of `goals` (target digests, most wanted
    first) that a chain of files not in `problems` reaches, each of its files fetched (when remote) and
    found intact by `check`. A file found missing or damaged goes into `problems`, and the search starts
    again, at most MAX_SEARCHES times. goal None: no chain reaches any goal; chain None: the searches ran
    out."""
    trusted: set[str] = set()
    for _ in range(MAX_SEARCHES):  # one search, then again only after a file on the chosen chain turned out damaged
        paths = cheapest_paths(manifest.entries, have, set(problems))
        goal = next((digest for digest in goals if paths.reaches(digest)), None)
        if goal is None:
            return None, None
        chain = paths.path_to(goal)
        new = [e for e in chain if e.file not in trusted]
        found = source.fetch(new, check, progress)
        problems.update(found)
        trusted.update(e.file for e in new if e.file not in found)
        if all(e.file in trusted for e in chain):
            return goal, chain
    return goal, None


def _shown(store: Store, name: str) -> str:
    return store.shown(name)


def _same_path(a: Path, b: Path) -> bool:
    return a == b or a.resolve() == b.resolve()


def _describe(problems: dict[str, str]) -> str:
    shown = sorted(problems.items())[:10]
    more = f", and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
    return "; ".join(f"{name}: {why}" for name, why in shown) + more


def check_file(path: Path, e: Entry, precision: str, manifest_where: str, authenticate: bool = False,
                private: Path | None = None) -> str | None:
    """Why the file for entry `e`, at `path`, cannot be used (missing, half-fetched, damaged), or None.

    A file that is intact but whose header contradicts its entry raises:
    then the manifest is not telling the truth about the series. `authenticate`
    (a signed manifest): the file's SHA-256 must be its entry's, checked before
    the patch reader sees a byte of it; another file is not the publisher's,
    and is skipped like a damaged one. `private` (with `authenticate`): the
    file is copied there through the descriptor it is hashed from, and the
    copy is what is checked, and what the caller must apply (removed here
    when it cannot be used).
    """
    problem = size_problem(path, e)
    if problem is not None:
        return problem
    if authenticate:
        try:
            sha256 = file_sha256(path) if private is None else _copy_hashing(path, private, e.bytes)
        except OSError as exc:
            _discard(private)
            return f"unreadable ({exc.strerror or exc})"
        if sha256 != e.sha256:
            _discard(private)
            return "not the file the signed manifest names (its SHA-256 differs)"
        if private is not None:
            path = private
            problem = _checked_header(path, e, precision, manifest_where)
            if problem is not None:
                _discard(private)
            return problem
    return _checked_header(path, e, precision, manifest_where)


def _checked_header(path: Path, e: Entry, precision: str, manifest_where: str) -> str | None:
    from pulsediff.format.patch_file import verify_patch_file

    try:
        header = verify_patch_file(path)
    except PulsediffError as exc:
        return f"damaged ({exc})"
    said = (precision, e.base, e.target, e.target_bytes)
    found = (header.precision, header.base_digest, header.target_digest, header.target_bytes)
    if found != said:
        what = [w for w, a, b in zip(("precision", "base digest", "target digest", "target size"), said, found) if a != b]
        raise InvalidManifestError(manifest_where,
                                   f"the entry for {e.file} (step {e.step}) does not match the file's own header "
                                   f"({', '.join(what)} differ); nothing was applied")
    return None


# -- live tensors ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LiveCatchUp:
    status: str  # "applied" or "up-to-date"
    step: int | None  # the step the manifest lists for the digest the tensors now have
    links: int  # patch files applied
    changed_elements: int
    digest: str = ""  # the digest the tensors now have (pass it to the next catch-up)


def catch_up_state_dict(tensors: MutableMapping, source: "str | Path | Store", *, device: str | None = None,
                        check: str = "auto", digest: str | None = None, trust=None,
                        trust_state: str | Path | None = None, step: int | None = None,
                        changes: dict | None = None, cache: Path | None = None,
                        sums: dict | None = None, undo_log: list | None = None, force: bool = False,
                        holder: str = "the live tensors") -> LiveCatchUp:
    """`pulsediff catch-up` for live tensors: follow a published series (a folder, an `s3://` or
    `http(s)://` URL, or a Store) in place, by the cheapest chain of intact patches from the
    tensors' digest to `step` (default: the newest).

    `digest`: the digest the tensors are known to have (the `target_digest` of the last
    apply; one under another scheme than the series' is taken again), which spares hashing them on the host to find where they are in the series (on
    a GPU, a copy of every tensor); the chain's first patch checks the base all the same
    (by word sums under check="sums"), though a `digest` that names the target step is
    taken at its word. Tensors the series does not list (another run, or a step it no longer keeps;
    `holder` names them in the refusal) are replaced with a step of it, from an anchor, only with
    `force`: NotInSeriesError otherwise, as catch_up's. `check`, `changes`, `sums` and `undo_log` are apply_to_state_dict's. `trust` and
    `trust_state`: as `catch_up`'s (a signed series: the manifest signed by a trusted key
    and not older than one accepted before, each file's SHA-256 the one it names). Remote
    files are fetched into `cache` (default: remote.default_cache). Every file of the chain
    is fetched and checked before the first tensor is written; on any error the tensors are
    as they were."""
    from pulsediff.ops.live import apply_to_state_dict, state_dict_digest
    from pulsediff.series.signing import as_trust

    trust = as_trust(trust, trust_state)
    store = series_source(source, cache=cache)
    private = None
    try:
        where = _shown(store, MANIFEST)
        manifest = read_source_manifest(store, trust)
        if manifest is None or manifest.newest is None:
            raise CheckpointNotFoundError(where, "manifest")
        goal = step_entry(manifest, step, store.location)
        if digest is None or not digest.startswith(manifest.scheme.prefix):
            # Unknown, or known under the other scheme (a state loaded now, a series begun before 1.4).
            digest = state_dict_digest(tensors, manifest.precision, manifest.scheme, device)
        if digest == goal.target:
            return LiveCatchUp("up-to-date", goal.step, 0, 0, digest)
        if not force and not _in_series(manifest, digest):
            raise NotInSeriesError(f"{_not_listed(f'{holder} ({digest})', store.location, 'are')}; give force "
                                   f"(vllm-sync -f, update_info \"force\": true, force=True) to replace them with "
                                   f"step {goal.step}, rebuilt from an anchor")
        # With trust, every local file is copied while hashed and applied from that private copy: one swapped
        # in the folder after its check is never read (PrivateCopies, below). Remote files are private already.
        private = PrivateCopies(cache) if trust is not None and not store.remote else None

        def check_one(path: Path, e: Entry) -> str | None:
            return check_file(path, e, manifest.precision, where, authenticate=trust is not None,
                              private=private.path(e.file) if private is not None else None)

        problems: dict[str, str] = {}
        reached, links = _intact_chain(manifest, digest, [goal.target], store, check_one, problems)
        if reached is None:
            raise PulsediffError(f"no intact chain of patches in {store.location} leads from the live tensors "
                                 f"({digest}) to step {goal.step}" + (f" ({_describe(problems)})" if problems else ""))
        if links is None:
            raise InvalidManifestError(where, f"no intact chain after {MAX_SEARCHES} searches")
        result = apply_to_state_dict(
            tensors, [private.path(e.file) if private is not None else store.path(e.file) for e in links],
            device=device, check=check, expect_target=goal.target if trust is not None else None,
            expect_where=where, changes=changes, sums=sums, undo_log=undo_log)
        # The tensors have moved: what follows is housekeeping, and its failure must not hide that.
        try:
            store.forget([e.file for e in links], {e.file for e in manifest.entries})
        except OSError:
            pass
        return LiveCatchUp(result.status, manifest.step_of(result.target_digest), len(links),
                           result.changed_elements, result.target_digest)
    finally:
        for thing in (private, store if store is not source else None):  # a Store the caller passed stays open
            if thing is not None:
                try:
                    thing.close()
                except OSError:
                    pass


def step_entry(manifest: Manifest, step: int | None, location: str) -> Entry:
    """The manifest's entry for `step` (any entry with that step: they share one target), or the newest's."""
    if step is None:
        return manifest.newest
    found = next((e for e in manifest.entries if e.step == step), None)
    if found is None:
        steps = sorted({e.step for e in manifest.entries})
        raise CheckpointNotFoundError(f"step {step} in {location} (it has steps {_ranges(steps)})", "step")
    return found


def _ranges(steps: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


# -- private copies: what a trusting worker checks is what it applies --------------------------------------

PRIVATE_PREFIX = "pulsediff-trusted-"


class PrivateCopies:
    """A private temporary folder (mode 0700, in `parent` or the system's temporary folder) holding a copy
    of each file of a local series a trusting worker uses, made while the file is hashed (check_file):
    whoever can write the series folder cannot change a file between its check and its use. Removed by
    `close`."""

    def __init__(self, parent: Path | None = None):
        self.parent = Path(parent) if parent is not None else None
        self.folder: Path | None = None

    def path(self, name: str) -> Path:
        if self.folder is None:
            if self.parent is not None:
                self.parent.mkdir(parents=True, exist_ok=True)
            self.folder = Path(tempfile.mkdtemp(prefix=PRIVATE_PREFIX, dir=self.parent))
        return self.folder / name

    def close(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


def _copy_hashing(src: Path, dst: Path, size: int) -> str:
    """Copy `src` to `dst` (at most size + 1 bytes: a longer file is not the signed one) through one open
    descriptor; the SHA-256 of what was copied."""
    h = hashlib.sha256()
    dst.unlink(missing_ok=True)
    with open(src, "rb") as f, open(dst, "xb") as out:
        left = size + 1
        while left > 0 and (chunk := f.read(min(1 << 20, left))):
            h.update(chunk)
            out.write(chunk)
            left -= len(chunk)
    return h.hexdigest()


def _discard(path: Path | None) -> None:
    if path is not None:
        path.unlink(missing_ok=True)
