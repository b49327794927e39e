"""Checkpoint series: publishing patches and anchors, and catching up from them.

A trainer's folder holds one checkpoint per step (a file or a sharded folder,
the step number in its name). `publish` turns it into a patch folder:

    anchor-00000010.pulsediff        a patch from the empty checkpoint: every tensor, compressed
    patch-00000010-00000011.pulsediff
    patch-00000008-00000012.pulsediff   a skip patch (below)
    manifest.json                    every file with its step, base and target digests and size

Skip patches keep catch-up short. Besides the patch from the previous step,
the i-th published step also gets a patch from step i - 2**j for every j >= 1
with 2**j dividing i (i = 4: from 3 and 2 and 0; i = 6: from 5 and 4): two
patches per step on average, and any older step reaches the newest in about
2·log2(distance) links instead of one link per step. Applying a link costs
about one pass over the checkpoint whatever its size, so fewer links is what
makes a worker 20 steps behind fast.

Every file appears atomically (written under a temporary name, then renamed),
and the manifest is replaced last, so an rsync running at any moment copies
either the old state or the new one, never half a file. The folder may also
be an S3 prefix, and catch-up's source an S3 prefix or an HTTP(S) URL: both
sides talk to a `Store` (store.py), which uploads, downloads and caches.
`catch_up` reads the
manifest, finds the cheapest path (in bytes) from a worker's checkpoint (or
from nothing, through an anchor) to the newest step, checks every file on it
and applies it as one chain; a missing or damaged file is dropped from the
graph and another path tried, so the result is the newest checkpoint or an
error, never a wrong checkpoint.

Signed series (signing.py, docs/FORMAT.md §8.1): `publish(sign=KEYFILE)`
signs every manifest it writes and continues only a series whose manifest
it can verify (its own key, or keys given as `trust`, for a rotation);
`catch_up(trust=KEYS)` uses only a manifest signed by one of KEYS, not older
than one it accepted before, and only files whose SHA-256 is the one that
manifest names.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .atomic import TMP_SUFFIX, temp_prefix
from .checkpoint import Checkpoint, TensorView
from .digest import checkpoint_digest
from .errors import (AmbiguousStepError, CheckpointNotFoundError, InvalidManifestError, PulsediffError, UsageError,
                     refuse_existing)
from .manifest import MANIFEST, Entry, Manifest, cheapest_paths, file_sha256
from .progress import SILENT, Progress
from .store import Store, open_store, size_problem

# The step is the number after "step" (step_12, global_step12), else the last number in the name
# (checkpoint-500): `fp32_step0` is step 0 and `step5_bf16` step 5. A user's pattern: its first group.
DEFAULT_STEP_PATTERN = r"(?i)step[_-]?(\d+)|(\d+)(?!.*\d)"
READY_RULES = ("stable", "marker")
DEFAULT_SETTLE = 2.0
MARKER_SUFFIX = ".done"
ONE_SHOT_WAIT = 60.0
MAX_SEARCHES = 32  # chains tried by one catch-up before damaged files make it give up  # how long a publish without --watch waits for checkpoints that are still settling


# -- publishing ------------------------------------------------------------------


def step_in_name(name: str, regex: re.Pattern) -> int | None:
    """The step number a checkpoint's name carries: the first group of `regex` that matched."""
    match = regex.search(name.removesuffix(".safetensors"))
    if not match:
        return None
    digits = next((g for g in match.groups() if g is not None), None)
    return int(digits) if digits is not None and len(digits) <= 15 else None


def checkpoint_candidates(train_dir: Path, pattern: str = DEFAULT_STEP_PATTERN) -> list[tuple[int, Path]]:
    """Everything in `train_dir` named like a step's checkpoint (a `.safetensors` file or a folder), by step."""
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        raise UsageError(f"--step-pattern {pattern!r} is not a regular expression: {exc}") from None
    if regex.groups < 1:
        raise UsageError(f"--step-pattern {pattern!r} needs a group around the step number, e.g. 'step_(\\d+)'")
    found: dict[int, Path] = {}
    for path in sorted(train_dir.iterdir()):
        if path.name.startswith(".") or not (path.suffix == ".safetensors" or _may_hold_a_checkpoint(path)):
            continue
        step = step_in_name(path.name, regex)
        if step is None:
            continue
        if step in found:
            raise AmbiguousStepError(str(train_dir), step, (found[step].name, path.name))
        found[step] = path
    return sorted(found.items())


def _may_hold_a_checkpoint(path: Path) -> bool:
    """A folder with a .safetensors file (or a shard index) in it: a checkpoint, maybe still being written.

    Trainers keep other folders beside their checkpoints (logs2, events_v1, wandb): those are not steps.
    """
    try:
        return path.is_dir() and any(p.name.endswith((".safetensors", ".safetensors.index.json"))
                                     for p in path.iterdir())
    except OSError:  # removed meanwhile, or unreadable: not a checkpoint publish can read
        return False


def parses(path: Path) -> bool:
    """Whether `path` opens as a checkpoint (header parses, sizes add up, shards present)."""
    try:
        Checkpoint(path).close()
        return True
    except PulsediffError:
        return False


def find_checkpoints(train_dir: Path, pattern: str = DEFAULT_STEP_PATTERN) -> list[tuple[int, Path]]:
    """Checkpoints in `train_dir` that open, by step (for reading a finished series, not a running one)."""
    return [(step, path) for step, path in checkpoint_candidates(train_dir, pattern) if parses(path)]


# -- when is a checkpoint complete? ------------------------------------------------------------
#
# "It parses and its sizes add up" is not enough: a writer that preallocates the
# file, or writes its tail first, makes a file that parses while its middle is
# still zeros. So publish takes a step only when its trainer says it is done:
#   stable  every file of the checkpoint unchanged (size, mtime) for `settle`
#           seconds before publish reads it, and unchanged (same fingerprint,
#           same digest computed a second time) after the patches are made;
#   marker  a file NAME.done beside the checkpoint (the strong form: the
#           trainer writes it after the checkpoint is closed), plus the same
#           after-the-fact check.


def _fingerprint(path: Path) -> tuple:
    """(name, size, mtime_ns, inode) of every file of a checkpoint: any write changes it."""
    files = [path] if not path.is_dir() else sorted(p for p in path.iterdir() if p.is_file())
    out = []
    for f in files:
        st = f.stat()
        out.append((f.name, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


def marker_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name.removesuffix(".safetensors") + MARKER_SUFFIX)


def _not_ready(path: Path, rule: str, settle: float, fingerprint: tuple | None) -> str | None:
    """Why `path`, whose files have `fingerprint` now, cannot be published yet ("settling" when
    waiting will do), or None."""
    if fingerprint is None:
        return "settling"  # a file vanished under us: the trainer is renaming or rewriting it
    if rule == "marker":
        return None if marker_path(path).is_file() else f"no {marker_path(path).name} yet"
    newest = max((mtime for _, _, mtime, _ in fingerprint), default=0)
    return "settling" if time.time() - newest / 1e9 < settle else None


@dataclass
class PublishReport:
    patches: int = 0
    anchors: int = 0
    pruned: int = 0
    steps: list[int] = field(default_factory=list)  # the steps published, in order (a dry run: would be)
    pending: dict[str, str] = field(default_factory=dict)  # checkpoint name -> why it is not published yet
    skipped: dict[str, str] = field(default_factory=dict)  # named like a step, complete, but no checkpoint
    would_write: list[str] = field(default_factory=list)  # dry run: the files a real run would publish, in order
    would_prune: list[str] = field(default_factory=list)  # dry run: the files --keep would delete

    @property
    def settling(self) -> bool:
        return any(why == "settling" for why in self.pending.values())


def publish_once(train_dir: Path, out_dir: "Path | str | Store", *, anchor_every: int = 10, keep: int | None = None,
                 skips: bool = True, precision: str = "exact", codec: str | None = None, device: str | None = None,
                 pattern: str = DEFAULT_STEP_PATTERN, ready: str = "stable", settle: float = DEFAULT_SETTLE,
                 progress: Progress = SILENT, dry_run: bool = False, sign=None, trust=None,
                 trust_state: Path | None = None) -> PublishReport:
    """Publish every complete checkpoint newer than the manifest's newest step, in step order.

    Stops at the first step that is not complete yet (see above), so steps are
    never published out of order; an old file that never opens is skipped.
    `out_dir` is a folder, an `s3://bucket/prefix` URL, or a Store. `dry_run`:
    judge every step as a real run would, make and write nothing, and list in
    the report the files it would publish and prune. `sign`: a private key
    file (or a loaded key) that signs every manifest written; an existing
    manifest must then be signed by that key or by one of `trust` (the old
    key, while rotating), and is checked against the rollback record in
    `trust_state` as a worker's would be. Without `sign`, a signed series is
    refused (an unsigned manifest there would lock out every trusting worker).
    """
    if anchor_every < 1:
        raise UsageError("--anchor-every must be at least 1")
    if ready not in READY_RULES:
        raise UsageError(f"unknown --ready rule {ready!r}; choose {' or '.join(READY_RULES)}")
    if not settle >= 0:
        raise UsageError("--settle must be a number of seconds, 0 or more")
    if not train_dir.is_dir():
        raise CheckpointNotFoundError(str(train_dir), "training folder")
    signing = _signing(sign, trust, trust_state)
    dest = open_store(out_dir)
    dest.writable()
    try:
        return _publish_once(train_dir, dest, anchor_every=anchor_every, keep=keep, skips=skips, precision=precision,
                             codec=codec, device=device, pattern=pattern, ready=ready, settle=settle, progress=progress,
                             dry_run=dry_run, signing=signing)
    finally:
        if dest is not out_dir:
            dest.close()


@dataclass(frozen=True)
class _Signing:
    key: object  # the Ed25519 private key
    trust: object  # signing.Trust: its own public key and those given to continue from


def _signing(sign, trust, trust_state) -> "_Signing | None":
    if isinstance(sign, _Signing) or sign is None:
        if sign is None and trust is not None:
            raise UsageError("--trust on publish names the keys whose series --sign may continue; give --sign too")
        return sign
    from .signing import Trust, load_private_key, public_key_text, trusted_keys

    key = sign if not isinstance(sign, (str, os.PathLike)) else load_private_key(Path(sign))
    keys = (public_key_text(key),) + (trusted_keys(trust) if trust is not None else ())
    return _Signing(key, Trust(tuple(dict.fromkeys(keys)), Path(trust_state) if trust_state is not None else None))


def _read_dest_manifest(dest: Store, signing: "_Signing | None") -> Manifest | None:
    from .errors import UntrustedManifestError

    if signing is None:
        if dest.read_signature() is not None:
            raise UsageError(f"{dest.location} is a signed series; publish to it with --sign KEYFILE (an unsigned "
                             f"manifest would be refused by every worker that trusts its key)")
        return dest.read_manifest()
    from .signing import read_signed_manifest, recorded, sign_manifest

    try:
        return read_signed_manifest(dest, signing.trust)
    except UntrustedManifestError as exc:
        # A publish interrupted between manifest.json.sig and manifest.json leaves the new signature over
        # the old manifest. When the manifest's bytes are exactly those this publisher's record last
        # accepted (read verified, or written and signed) under a key it trusts now, they are re-signed
        # and the series goes on;
        # any other bytes are refused, since signing them would vouch for what someone else put there.
        data = dest.read_manifest_bytes()
        if data is not None and dest.read_signature() is not None and recorded(signing.trust.state, dest.identity,
                                                                               data, signing.trust.keys):
            dest.save_signature(sign_manifest(signing.key, data))
            return read_signed_manifest(dest, signing.trust)
        recovery = (f"; after a publish interrupted between {dest.shown('manifest.json.sig')} and the manifest, run "
                    f"publish --sign again with the rollback record of the publisher that wrote it (its "
                    f"--trust-state), which re-signs the manifest it recorded") if "does not match" in str(exc) else ""
        exc.args = (f"{exc}; publish --sign continues only a series its key signed (give the previous key's "
                    f"public key with --trust while rotating), or publish into a new DEST{recovery}",)
        raise


def _save_manifest(dest: Store, manifest: Manifest, signing: "_Signing | None") -> None:
    """Write the next version of the manifest (serial + 1), signed when publishing a signed series."""
    manifest.serial += 1
    if signing is None:
        dest.save_manifest(manifest)
        return
    from .signing import check_rollback, public_key_text, sign_manifest

    if manifest.series is None:  # a new signed series (or one from before ids): its id, kept from now on
        import secrets

        manifest.series = secrets.token_hex(16)
    data = manifest.to_bytes()
    dest.save_manifest(manifest, sign_manifest(signing.key, data))
    newest = manifest.newest
    check_rollback(signing.trust.state, dest.identity, public_key_text(signing.key), manifest.serial,
                   newest.step if newest else None, data, dest.shown(MANIFEST), series=manifest.series)


def _publish_once(train_dir: Path, dest: Store, *, anchor_every, keep, skips, precision, codec, device, pattern, ready,
                  settle, progress, dry_run=False, signing=None) -> PublishReport:
    from .inspect import checkpoint_digest_of
    from .make import make_patch

    manifest = _read_dest_manifest(dest, signing) or Manifest(precision, [])
    if manifest.precision != precision:
        raise UsageError(f"{dest.location} holds {manifest.precision} patches; publish with --precision {manifest.precision}")
    kwargs = {"precision": precision, "device": device, "progress": progress}
    if codec:
        kwargs["codec"] = codec
    report = PublishReport()
    candidates = checkpoint_candidates(train_dir, pattern)
    paths = dict(candidates)
    newest = manifest.newest
    last_step = newest.step if newest else None
    prev = paths.get(last_step) if last_step is not None else None
    steps_done = sorted({e.step for e in manifest.entries})
    digest_at = {e.step: e.target for e in manifest.entries}
    planned_kinds = [(e.kind, e.step, e.file) for e in manifest.entries]  # a dry run's view of the manifest

    for step, path in candidates:
        if last_step is not None and step <= last_step:
            continue
        before = _fingerprint_or_none(path)
        why = _not_ready(path, ready, settle, before)
        if why is None and not parses(path):
            if _fingerprint_or_none(path) == before:  # complete by the rule and unchanged, yet no checkpoint
                report.skipped[path.name] = "does not open as a checkpoint"
                continue
            why = "settling"
        if why is not None:
            report.pending[path.name] = why
            break
        index = len(steps_done)  # this step's position in the published sequence
        planned = []  # (kind, file name, base checkpoint or None, from_step)
        if prev is not None:
            planned.append(("patch", f"patch-{last_step:08d}-{step:08d}.pulsediff", prev, last_step))
        jump = 2
        while skips and index and index % jump == 0:
            from_step = steps_done[index - jump]
            if from_step in paths:  # the trainer may have deleted old checkpoints: then no skip from there
                planned.append(("patch", f"patch-{from_step:08d}-{step:08d}.pulsediff", paths[from_step], from_step))
            jump *= 2
        # An anchor every anchor_every steps, and whenever there is nothing to diff against
        # (the first step, or the previous checkpoint is gone from the training folder).
        if prev is None or index % anchor_every == 0:
            planned.append(("anchor", f"anchor-{step:08d}.pulsediff", None, None))
        if dry_run:
            report.would_write += [name for _, name, _, _ in planned]
            report.patches += sum(kind == "patch" for kind, *_ in planned)
            report.anchors += sum(kind == "anchor" for kind, *_ in planned)
            report.steps.append(step)
            steps_done.append(step)
            prev, last_step = path, step
            planned_kinds.extend((kind, step, name) for kind, name, _, _ in planned)
            continue
        staged: list[tuple[Path, str]] = []
        staging = dest.staging()
        try:
            new_entries = []
            for kind, name, base_path, from_step in planned:
                tmp = staging / f"{temp_prefix(staging / name)}staged{TMP_SUFFIX}"
                staged.append((tmp, name))
                header = make_patch(base_path, path, tmp, **kwargs)
                if from_step is not None and digest_at.get(from_step, header.base_digest) != header.base_digest:
                    raise PulsediffError(f"{base_path} changed after step {from_step} was published; "
                                         f"its digest is no longer the one in {_shown(dest, MANIFEST)}")
                new_entries.append(Entry(kind, name, step, from_step, header.base_digest, header.target_digest,
                                         tmp.stat().st_size, header.target_bytes, file_sha256(tmp)))
            # The second look: the checkpoint read while making the patches must be the one there now.
            again = checkpoint_digest_of(path, precision)
            if _fingerprint_or_none(path) != before or any(e.target != again for e in new_entries):
                report.pending[path.name] = "settling"  # it changed while we read it: try again later
                break
            dest.commit(staged)  # every file in place (uploaded) before the manifest names it
            staged.clear()
        finally:
            for tmp, _ in staged:
                tmp.unlink(missing_ok=True)
        manifest.entries.extend(new_entries)
        _save_manifest(dest, manifest, signing)  # last: the files it names are already in place
        report.patches += sum(e.kind == "patch" for e in new_entries)
        report.anchors += sum(e.kind == "anchor" for e in new_entries)
        report.steps.append(step)
        steps_done.append(step)
        digest_at[step] = new_entries[0].target
        prev, last_step = path, step
    if keep is not None and dry_run:
        report.would_prune = _to_prune(planned_kinds, keep)
    elif keep is not None:
        report.pruned = _prune(manifest, dest, keep, signing)
    return report


def _fingerprint_or_none(path: Path) -> tuple | None:
    try:
        return _fingerprint(path)
    except OSError:
        return None


def _to_prune(entries: list[tuple[str, int, str]], keep: int) -> list[str]:
    """The files (of (kind, step, file) entries) that keeping the newest `keep` anchors and everything
    after the oldest of them drops."""
    if keep < 1:
        raise UsageError("--keep must be at least 1")
    anchors = sorted(step for kind, step, _ in entries if kind == "anchor")
    if len(anchors) <= keep:
        return []
    oldest_kept = anchors[-keep]
    return [file for kind, step, file in entries if step < oldest_kept or (kind == "patch" and step == oldest_kept)]


def _prune(manifest: Manifest, dest: Store, keep: int, signing: "_Signing | None" = None) -> int:
    """Keep the newest `keep` anchors and everything after the oldest of them."""
    gone = set(_to_prune([(e.kind, e.step, e.file) for e in manifest.entries], keep))
    if not gone:
        return 0
    drop = [e for e in manifest.entries if e.file in gone]
    manifest.entries = [e for e in manifest.entries if e not in drop]
    _save_manifest(dest, manifest, signing)  # first the manifest stops naming them, then they go
    dest.delete([e.file for e in drop])
    return len(drop)


def publish(train_dir: Path, out_dir: "Path | str | Store", *, watch: bool = False, interval: float = 2.0,
            idle_exit: float | None = None, on_report=None, **kwargs) -> PublishReport:
    if kwargs.get("dry_run"):
        if watch:
            raise UsageError("--dry-run looks once; it does not go with --watch")
        return publish_once(train_dir, out_dir, **kwargs)
    """`publish_once`, and with `watch` again every `interval` s.

    Without `watch`, it still waits (up to ONE_SHOT_WAIT s) for checkpoints
    that are only settling, so that publishing right after a trainer exits
    takes its last steps. `idle_exit` stops the watch that many seconds after
    the last new checkpoint; the clock starts once something has been
    published, so a publisher started before its trainer waits for the first
    checkpoint. The returned report's `pending` says what is not published.
    """
    if not interval > 0:
        raise UsageError("--interval must be a positive number of seconds")
    kwargs["sign"] = _signing(kwargs.get("sign"), kwargs.pop("trust", None), kwargs.pop("trust_state", None))
    dest = open_store(out_dir)
    dest.writable()
    try:
        return _publish_loop(train_dir, dest, watch, interval, idle_exit, on_report, kwargs)
    finally:
        if dest is not out_dir:
            dest.close()


def _publish_loop(train_dir, dest: Store, watch, interval, idle_exit, on_report, kwargs) -> PublishReport:
    total = PublishReport()
    last_change = time.monotonic() if dest.read_manifest_bytes() is not None else None
    started = time.monotonic()
    while True:
        report = publish_once(train_dir, dest, **kwargs)
        for name in ("patches", "anchors", "pruned", "steps"):
            setattr(total, name, getattr(total, name) + getattr(report, name))
        total.pending, total.skipped = report.pending, report.skipped
        if report.patches or report.anchors:
            last_change = time.monotonic()
            if on_report:
                on_report(report)
        if watch:
            if last_change is not None and idle_exit is not None and time.monotonic() - last_change >= idle_exit:
                return total
        elif not report.settling or time.monotonic() - started >= ONE_SHOT_WAIT:
            return total
        time.sleep(interval if watch else min(interval, 0.5))


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
    from .signing import read_signed_manifest

    return read_signed_manifest(source, trust, record=record)


def _where_we_are(checkpoint: Path, source: Store, progress: Progress, trust=None, record: bool = True):
    """(manifest, the checkpoint's tensor ids or None, its digest or None)."""
    from .inspect import tensor_ids

    manifest = read_source_manifest(source, trust, record=record)
    if manifest is None or not manifest.entries:
        raise CheckpointNotFoundError(_shown(source, MANIFEST), "manifest")
    ids = None  # hashed once here, handed to apply
    if checkpoint.exists():
        with Checkpoint(checkpoint) as ckpt:
            ids = tensor_ids(TensorView(ckpt, manifest.precision), progress)
    return manifest, ids, checkpoint_digest(ids.values()) if ids is not None else None


def _goals(manifest: Manifest, have: str | None) -> list[tuple[int, str]]:
    """(step, digest) of every step newer than the checkpoint's, newest first: when the newest cannot
    be reached (its only patch is damaged, say), the newest reachable step is still progress."""
    have_step = manifest.step_of(have) if have else None
    floor = -1 if have_step is None else have_step
    return sorted({(e.step, e.target) for e in manifest.entries if e.step > floor}, reverse=True)


def plan_catch_up(checkpoint: Path, patch_dir: "Path | str | Store", *, progress: Progress = SILENT, trust=None,
                  trust_state: Path | None = None) -> CatchUpPlan:
    """The files catch-up would apply, judged from the manifest alone (the files need not be here).

    For fetching only what is needed: a worker that mirrors the whole folder
    would also download every anchor, each nearly the size of the checkpoint.
    `urls` holds where each file is: its name for a folder (for `rsync
    --files-from`), its URL for a remote source. `trust`: as catch_up's (the
    rollback record is checked, not written).
    """
    from .signing import as_trust

    trust = as_trust(trust, trust_state)
    source = open_store(patch_dir)
    manifest, _, have = _where_we_are(checkpoint, source, progress, trust, record=False)
    newest = manifest.newest
    if have == newest.target:
        return CatchUpPlan(newest.step, [], False)
    paths = cheapest_paths(manifest.entries, have)
    if not paths.reaches(newest.target):
        raise PulsediffError(f"the manifest in {source.location} has no chain from {checkpoint} to step {newest.step}")
    path = paths.path_to(newest.target)
    return CatchUpPlan(newest.step, [e.file for e in path], path[0].kind == "anchor", [source.where(e.file) for e in path])


def catch_up(checkpoint: Path, patch_dir: "Path | str | Store", out: Path | None = None, *, device: str | None = None,
             cache: Path | None = None, progress: Progress = SILENT, force: bool = False, trust=None,
             trust_state: Path | None = None) -> CatchUpResult:
    """Bring `checkpoint` (or a new `out`) to the newest step published at `patch_dir`: a folder, an
    `s3://bucket/prefix` or `http(s)://` URL (files are fetched into `cache`), or a Store. An existing
    `out` (other than `checkpoint`) is refused unless `force`.

    `trust`: public keys (`ed25519:...` lines, files of them, or a signing.Trust). Then the manifest must
    be signed by one of them and not older than the newest accepted before from this source under any
    trusted key (the record in `trust_state`, default signing.default_state_file()), and every file must have the
    SHA-256 the manifest names; otherwise UntrustedManifestError, and nothing is written."""
    from .signing import as_trust

    trust = as_trust(trust, trust_state)
    checkpoint = Path(checkpoint)
    if out is not None:
        out = Path(out)
        if not _same_path(out, checkpoint):
            refuse_existing(out, force)
    source = open_store(patch_dir, cache=cache)
    # A trusting worker reads a local folder's files through private copies (a remote source's through its
    # own cache): a file the folder's writer swaps after its check is never the one applied.
    private = PrivateCopies(cache) if trust is not None and not source.remote else None
    try:
        return _catch_up(checkpoint, source, out, device, progress, trust, private)
    finally:
        if private is not None:
            private.close()
        if source is not patch_dir:
            source.close()


def _catch_up(checkpoint: Path, source: Store, out: Path | None, device: str | None,
              progress: Progress, trust=None, private: "PrivateCopies | None" = None) -> CatchUpResult:
    from .apply import apply_chain

    manifest, ids, have = _where_we_are(checkpoint, source, progress, trust)
    newest = manifest.newest
    out_path = out or checkpoint
    where = _shown(source, MANIFEST)

    def check(path: Path, e: Entry) -> str | None:
        if private is None:
            return _check_file(path, e, manifest.precision, where, authenticate=trust is not None)
        return _check_file(path, e, manifest.precision, where, authenticate=True, private=private.path(e.file))

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
        return CatchUpResult("up-to-date", out_path, newest.step, [], False, [])
    goals = _goals(manifest, have)
    problems = source.known_problems(manifest.entries)
    trusted: set[str] = set()
    for _ in range(MAX_SEARCHES):  # one search, then again only after a file on the chosen chain turned out damaged
        paths = cheapest_paths(manifest.entries, have, set(problems))
        goal = next((digest for _, digest in goals if paths.reaches(digest)), None)
        if goal is None:
            raise PulsediffError(
                f"cannot reach any newer step from {checkpoint}: no intact chain in {source.location}"
                + (f" ({_describe(problems)})" if problems else ""))
        chain = paths.path_to(goal)
        new = [e for e in chain if e.file not in trusted]
        found = source.fetch(new, check, progress)  # fetched (when remote) and checked
        problems.update(found)
        trusted.update(e.file for e in new if e.file not in found)
        if all(e.file in trusted for e in chain):
            break
    else:
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
    expected = {e.file for e in planned.path_to(newest.target)} if planned.reaches(newest.target) else set()
    problems = {f: why for f, why in problems.items() if why != "missing" or f in expected}
    return CatchUpResult(status, out_path, step, [e.file for e in chain], from_anchor, sorted(problems), problems)


def _shown(store: Store, name: str) -> str:
    return store.shown(name)


def _same_path(a: Path, b: Path) -> bool:
    return a == b or a.resolve() == b.resolve()


def _describe(problems: dict[str, str]) -> str:
    shown = sorted(problems.items())[:10]
    more = f", and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
    return "; ".join(f"{name}: {why}" for name, why in shown) + more


def _check_file(path: Path, e: Entry, precision: str, manifest_where: str, authenticate: bool = False,
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
    from .apply import verify_patch_file

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


# -- private copies: what a trusting worker checks is what it applies --------------------------------------

PRIVATE_PREFIX = "pulsediff-trusted-"


class PrivateCopies:
    """A private temporary folder (mode 0700, in `parent` or the system's temporary folder) holding a copy
    of each file of a local series a trusting worker uses, made while the file is hashed (_check_file):
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
