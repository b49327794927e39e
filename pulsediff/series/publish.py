"""Publishing a checkpoint series: patches and anchors into a folder, S3 prefix or Store.

A trainer's folder holds one checkpoint per step (a file or a sharded folder,
the step number in its name; steps.py). `publish` turns it into a patch folder:

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
sides talk to a `Store` (store.py; S3, HTTP and the cache: remote.py).
Workers follow it with catch_up.py.

Signed series (signing.py, docs/FORMAT.md §8.1): `publish(sign=KEYFILE)`
signs every manifest it writes and continues only a series whose manifest
it can verify (its own key, or keys given as `trust`, for a rotation).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from pulsediff.errors import CheckpointNotFoundError, OtherRunError, PulsediffError, UsageError
from pulsediff.format.manifest import MANIFEST, Entry, Manifest, file_sha256
from pulsediff.io.atomic import TMP_SUFFIX, temp_prefix
from pulsediff.runtime.progress import SILENT, Progress
from pulsediff.series.steps import (DEFAULT_SETTLE, DEFAULT_STEP_PATTERN, READY_RULES, checkpoint_candidates,
                                    fingerprint_or_none, no_checkpoints, not_ready, one_checkpoint, parses)
from pulsediff.series.remote import open_store
from pulsediff.series.store import Store

ONE_SHOT_WAIT = 60.0  # how long a publish without --watch waits for checkpoints that are still settling


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
    found: int = 0  # checkpoints in the training folder, published or not (those skipped not counted)
    made: list[tuple[int, int, float]] = field(default_factory=list)  # (step, bytes written, seconds) per step
    newest_found: int | None = None  # the newest step named in the training folder (complete or not)

    @property
    def settling(self) -> bool:
        return any(why == "settling" for why in self.pending.values())


def publish_once(train_dir: Path, out_dir: "Path | str | Store", *, anchor_every: int = 10, keep: int | None = None,
                 skips: bool = True, precision: str = "exact", codec: str | None = None, device: str | None = None,
                 pattern: str = DEFAULT_STEP_PATTERN, ready: str = "stable", settle: float = DEFAULT_SETTLE,
                 progress: Progress = SILENT, dry_run: bool = False, sign=None, trust=None,
                 trust_state: Path | None = None, empty_ok: bool = False, digest: str | None = None) -> PublishReport:
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
    A training folder without a checkpoint raises TrainingFolderError, unless
    `empty_ok` (a watch started before its trainer saved): then the report's
    `found` is 0. A folder that is one checkpoint is refused either way.
    `digest`: the digest scheme of a new series ("tree", the default, or "flat", which workers
    older than format 1.4 read); a series keeps the one it began with, and another is refused.
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
                             dry_run=dry_run, signing=signing, empty_ok=empty_ok, digest=digest)
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
    from pulsediff.series.signing import Trust, load_private_key, public_key_text, trusted_keys

    key = sign if not isinstance(sign, (str, os.PathLike)) else load_private_key(Path(sign))
    keys = (public_key_text(key),) + (trusted_keys(trust) if trust is not None else ())
    return _Signing(key, Trust(tuple(dict.fromkeys(keys)), Path(trust_state) if trust_state is not None else None))


def _read_dest_manifest(dest: Store, signing: "_Signing | None") -> Manifest | None:
    from pulsediff.errors import UntrustedManifestError

    if signing is None:
        if dest.read_signature() is not None:
            raise UsageError(f"{dest.location} is a signed series; publish to it with --sign KEYFILE (an unsigned "
                             f"manifest would be refused by every worker that trusts its key)")
        return dest.read_manifest()
    from pulsediff.series.signing import read_signed_manifest, recorded, sign_manifest

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
    if manifest.series is None:  # a new series (or one from before ids): its run's id, kept from now on
        import secrets

        manifest.series = secrets.token_hex(16)
    if signing is None:
        dest.save_manifest(manifest)
        return
    from pulsediff.series.signing import check_rollback, public_key_text, sign_manifest

    data = manifest.to_bytes()
    dest.save_manifest(manifest, sign_manifest(signing.key, data))
    newest = manifest.newest
    check_rollback(signing.trust.state, dest.identity, public_key_text(signing.key), manifest.serial,
                   newest.step if newest else None, data, dest.shown(MANIFEST), series=manifest.series)


def _publish_once(train_dir: Path, dest: Store, *, anchor_every, keep, skips, precision, codec, device, pattern, ready,
                  settle, progress, dry_run=False, signing=None, empty_ok=False, digest=None) -> PublishReport:
    from pulsediff.ops.inspect import checkpoint_digest_of, digest_scheme
    from pulsediff.ops.make import make_patch

    manifest = _read_dest_manifest(dest, signing) or Manifest(precision, [])
    if manifest.precision != precision:
        raise UsageError(f"{dest.location} holds {manifest.precision} patches; publish with --precision {manifest.precision}")
    if digest is not None:
        asked = digest_scheme(digest)
        if not manifest.entries:
            manifest.first_scheme = asked
        elif asked is not manifest.scheme:
            raise UsageError(f"{dest.location} holds {manifest.scheme.name}-hashed patches (its chains link by "
                             f"digest); publish with --digest {manifest.scheme.name}")
    # A series keeps the digest scheme it started with: its chains link by digest.
    kwargs = {"precision": precision, "device": device, "digest": manifest.scheme.name}
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
        before = fingerprint_or_none(path)
        why = not_ready(path, ready, settle, before)
        if why is None and not parses(path):
            if fingerprint_or_none(path) == before:  # complete by the rule and unchanged, yet no checkpoint
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
        started = time.perf_counter()
        staging = dest.staging()
        try:
            new_entries = []
            for kind, name, base_path, from_step in planned:
                tmp = staging / f"{temp_prefix(staging / name)}staged{TMP_SUFFIX}"
                staged.append((tmp, name))
                what = f"anchor {step}" if from_step is None else f"patch {from_step} to {step}"
                header = make_patch(base_path, path, tmp, progress=_Named(progress, what), **kwargs)
                if from_step is not None and digest_at.get(from_step, header.base_digest) != header.base_digest:
                    raise _other_run(train_dir, paths, digest_at, dest, precision, manifest.scheme, progress,
                                     (from_step, header.base_digest))
                new_entries.append(Entry(kind, name, step, from_step, header.base_digest, header.target_digest,
                                         tmp.stat().st_size, header.target_bytes, file_sha256(tmp)))
            # The second look: the checkpoint read while making the patches must be the one there now.
            again = checkpoint_digest_of(path, precision, _Named(progress, f"check {step}"), manifest.scheme)
            if fingerprint_or_none(path) != before or any(e.target != again for e in new_entries):
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
        report.made.append((step, sum(e.bytes for e in new_entries), time.perf_counter() - started))
        steps_done.append(step)
        digest_at[step] = new_entries[0].target
        prev, last_step = path, step
    if not report.steps:
        # Nothing new was made (a make from a published step checks that step's digest on the way), so
        # check here that the newest step both sides hold is the one published: else another run's folder
        # would be "up to date" with this series, and a worker on that run rebuilt to this one's weights.
        _check_same_run(train_dir, paths, digest_at, dest, precision, manifest.scheme, progress)
    report.found = len(candidates) - len(report.skipped)
    report.newest_found = candidates[-1][0] if candidates else None
    if not report.found:
        # An empty folder is a watch's normal start, and normal once DEST holds what it had (a trainer
        # that deletes what was published); one that is itself a checkpoint is refused even then.
        quiet_ok = empty_ok or newest is not None
        error = one_checkpoint(train_dir, pattern) if quiet_ok else no_checkpoints(train_dir, pattern, report.skipped)
        if error is not None:
            raise error
    if keep is not None and dry_run:
        report.would_prune = _to_prune(planned_kinds, keep)
    elif keep is not None:
        report.pruned = _prune(manifest, dest, keep, signing)
    return report


# A watch looks every few seconds: the checkpoint found to be the published step is not read again
# until its fingerprint (size, mtime, ...) changes. Keyed by (training path, DEST), a few entries.
_SAME_RUN_SEEN: dict[tuple[str, str], tuple] = {}
FIRST_DIFFERENCE_READS = 16  # checkpoints read, oldest common step first, to name where two runs part


def _check_same_run(train_dir: Path, paths: dict, digest_at: dict, dest: Store, precision: str, scheme,
                    progress: Progress) -> None:
    common = sorted(set(paths) & set(digest_at))
    if not common:
        return
    from pulsediff.ops.inspect import checkpoint_digest_of

    step = common[-1]
    key = (str(paths[step].resolve()), dest.location)
    before = fingerprint_or_none(paths[step])
    if before is not None and _SAME_RUN_SEEN.get(key) == before:
        return
    try:
        found = checkpoint_digest_of(paths[step], precision, _Named(progress, f"check {step}"), scheme)
    except (OSError, PulsediffError):
        # Deleted or rewritten while read (a trainer that keeps its last N checkpoints), or unreadable: no
        # verdict on this look. Only a digest read whole and found different refuses.
        return
    if found != digest_at[step]:
        raise _other_run(train_dir, paths, digest_at, dest, precision, scheme, progress, (step, found))
    if before is not None and fingerprint_or_none(paths[step]) == before:
        if len(_SAME_RUN_SEEN) > 64:
            _SAME_RUN_SEEN.clear()
        _SAME_RUN_SEEN[key] = before


def _other_run(train_dir: Path, paths: dict, digest_at: dict, dest: Store, precision: str, scheme,
               progress: Progress, differs: tuple[int, str]) -> OtherRunError:
    """The refusal of a training folder whose step `differs[0]` has digest `differs[1]`, not the one
    published, naming the first step (of the oldest few both sides hold) where the two runs part."""
    from pulsediff.ops.inspect import checkpoint_digest_of

    step, found = differs
    for s in sorted(set(paths) & set(digest_at))[:FIRST_DIFFERENCE_READS]:
        if s >= step:
            break
        try:
            d = checkpoint_digest_of(paths[s], precision, _Named(progress, f"check {s}"), scheme)
        except (OSError, PulsediffError):  # gone or unreadable now: name the step found first
            continue
        if d != digest_at[s]:
            step, found = s, d
            break
    return OtherRunError(f"{train_dir} is not the run published in {dest.location}: its step {step} "
                         f"({paths[step].name}) is {found}, the series' step {step} is {digest_at[step]}; a series "
                         f"belongs to one run: publish this one into a DEST of its own (or, if its checkpoint was "
                         f"rewritten after it was published, into a new DEST)")


class _Named(Progress):
    """Another's progress, each bar named for the file or step publish is at ("anchor 10", not "make")."""

    def __init__(self, progress: Progress, name: str):
        self.progress, self.name = progress, name

    def begin(self, description, total_bytes, total_tensors, unit="tensors"):
        self.progress.begin(self.name, total_bytes, total_tensors, unit)

    def advance(self, nbytes, tensors=1):
        self.progress.advance(nbytes, tensors)

    def end(self):
        self.progress.end()


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
    """`publish_once`, and with `watch` again every `interval` s.

    Without `watch`, it still waits (up to ONE_SHOT_WAIT s) for checkpoints
    that are only settling, so that publishing right after a trainer exits
    takes its last steps. `idle_exit` stops the watch that many seconds after
    the start or the last step published, whichever is later; a first
    checkpoint that is still being written is waited for. A watch that ends so
    without ever seeing a checkpoint raises TrainingFolderError, as a look
    without `watch` does at once: a wrong folder, or a trainer that never
    saved. The returned report's `pending` says what is not published.
    """
    if kwargs.get("dry_run"):
        if watch:
            raise UsageError("--dry-run looks once; it does not go with --watch")
        return publish_once(train_dir, out_dir, **kwargs)
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
    started = time.monotonic()
    published_before = dest.read_manifest_bytes() is not None
    last_change = started if published_before else None
    while True:
        report = publish_once(train_dir, dest, empty_ok=watch, **kwargs)
        for name in ("patches", "anchors", "pruned", "steps", "made"):
            setattr(total, name, getattr(total, name) + getattr(report, name))
        total.pending, total.skipped, total.found = report.pending, report.skipped, report.found
        total.newest_found = report.newest_found
        if report.patches or report.anchors:
            last_change = time.monotonic()
            if on_report:
                on_report(report)
        if watch:
            # Idle since the start while the folder holds no checkpoint (a watch on an empty or wrong folder
            # ends), but not while a first checkpoint is being written: a trainer's first save may take long.
            since = last_change if last_change is not None else started if not report.found else None
            if since is not None and idle_exit is not None and time.monotonic() - since >= idle_exit:
                if not report.found and not total.steps and not published_before:
                    raise no_checkpoints(train_dir, kwargs.get("pattern", DEFAULT_STEP_PATTERN), report.skipped,
                                         waited=idle_exit)
                return total
        elif not report.settling or time.monotonic() - started >= ONE_SHOT_WAIT:
            return total
        time.sleep(interval if watch else min(interval, 0.5))

