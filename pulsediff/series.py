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
either the old state or the new one, never half a file. `catch_up` reads the
manifest, finds the cheapest path (in bytes) from a worker's checkpoint (or
from nothing, through an anchor) to the newest step, checks every file on it
and applies it as one chain; a missing or damaged file is dropped from the
graph and another path tried, so the result is the newest checkpoint or an
error, never a wrong checkpoint.
"""

from __future__ import annotations

import heapq
import json
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .atomic import StagedFiles
from .checkpoint import Checkpoint, TensorView
from .digest import checkpoint_digest, is_digest
from .errors import CheckpointNotFoundError, InvalidCheckpointError, PulsediffError, UsageError
from .progress import SILENT, Progress

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
EMPTY_DIGEST = checkpoint_digest([])
DEFAULT_STEP_PATTERN = r"(\d+)"
FETCH_WEIGHT = 8  # see _cheapest_path


@dataclass(frozen=True)
class Entry:
    kind: str  # "patch" or "anchor"
    file: str
    step: int  # the target's step
    from_step: int | None  # the base's step (None for an anchor)
    base: str  # base digest (the empty checkpoint's for an anchor)
    target: str
    bytes: int  # the file's size
    target_bytes: int  # the rebuilt checkpoint's size: applying any file costs about one pass over it


@dataclass
class Manifest:
    precision: str
    entries: list[Entry]

    def to_json(self) -> dict:
        return {"version": MANIFEST_VERSION, "precision": self.precision, "entries": [asdict(e) for e in self.entries]}

    @classmethod
    def load(cls, folder: Path) -> "Manifest | None":
        path = folder / MANIFEST
        if not path.is_file():
            return None
        try:
            obj = json.loads(path.read_text())
            if obj.get("version") != MANIFEST_VERSION:
                raise ValueError(f"manifest version {obj.get('version')!r} is not supported")
            entries = [Entry(**e) for e in obj["entries"]]
            for e in entries:
                if e.kind not in ("patch", "anchor") or not (is_digest(e.base) and is_digest(e.target)) \
                        or "/" in e.file or e.file.startswith("."):
                    raise ValueError(f"bad entry for {e.file!r}")
            return cls(obj["precision"], entries)
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidCheckpointError(str(path), f"not a valid pulsediff manifest ({exc})") from None

    def save(self, folder: Path) -> None:
        with StagedFiles() as staged:
            with staged.open(folder / MANIFEST) as f:
                f.write((json.dumps(self.to_json(), indent=1) + "\n").encode())
            staged.commit()

    @property
    def newest(self) -> Entry | None:
        return max(self.entries, key=lambda e: (e.step, e.kind == "patch"), default=None)


# -- publishing ------------------------------------------------------------------


def find_checkpoints(train_dir: Path, pattern: str = DEFAULT_STEP_PATTERN) -> list[tuple[int, Path]]:
    """Complete checkpoints in `train_dir`, by step. One still being written does not parse yet."""
    regex = re.compile(pattern)
    found: dict[int, Path] = {}
    for path in sorted(train_dir.iterdir()):
        if path.name.startswith("."):
            continue
        if not (path.is_dir() or path.suffix == ".safetensors"):
            continue
        match = regex.search(path.name.removesuffix(".safetensors"))
        if not match:
            continue
        step = int(match.group(1))
        try:
            Checkpoint(path).close()  # complete? (header parses, sizes add up, shards present)
        except PulsediffError:
            continue
        if step in found:
            raise UsageError(f"two checkpoints for step {step}: {found[step].name} and {path.name}")
        found[step] = path
    return sorted(found.items())


@dataclass
class PublishReport:
    patches: int = 0
    anchors: int = 0
    pruned: int = 0


def publish_once(train_dir: Path, out_dir: Path, *, anchor_every: int = 10, keep: int | None = None,
                 skips: bool = True, precision: str = "exact", codec: str | None = None, device: str | None = None,
                 pattern: str = DEFAULT_STEP_PATTERN, progress: Progress = SILENT) -> PublishReport:
    """Publish every checkpoint newer than the manifest's newest step."""
    from .make import make_patch

    if anchor_every < 1:
        raise UsageError("--anchor-every must be at least 1")
    if not train_dir.is_dir():
        raise CheckpointNotFoundError(str(train_dir), "training folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = Manifest.load(out_dir) or Manifest(precision, [])
    if manifest.precision != precision:
        raise UsageError(f"{out_dir} holds {manifest.precision} patches; publish with --precision {manifest.precision}")
    kwargs = {"precision": precision, "device": device, "progress": progress}
    if codec:
        kwargs["codec"] = codec
    report = PublishReport()
    checkpoints = find_checkpoints(train_dir, pattern)
    newest = manifest.newest
    last_step = newest.step if newest else None
    prev = dict(checkpoints).get(last_step) if last_step is not None else None
    steps_done = sorted({e.step for e in manifest.entries})
    paths = dict(checkpoints)

    def add(kind: str, name: str, base_path: Path | None, path: Path, step: int, from_step: int | None) -> Entry:
        header = make_patch(base_path, path, out_dir / name, **kwargs)
        return Entry(kind, name, step, from_step, header.base_digest, header.target_digest,
                     (out_dir / name).stat().st_size, header.target_bytes)

    for step, path in checkpoints:
        if last_step is not None and step <= last_step:
            continue
        index = len(steps_done)  # this step's position in the published sequence
        new_entries = []
        if prev is not None:
            new_entries.append(add("patch", f"patch-{last_step:08d}-{step:08d}.pulsediff", prev, path, step, last_step))
            report.patches += 1
        jump = 2
        while skips and index and index % jump == 0:
            from_step = steps_done[index - jump]
            if from_step in paths:  # the trainer may have deleted old checkpoints: then no skip from there
                new_entries.append(add("patch", f"patch-{from_step:08d}-{step:08d}.pulsediff", paths[from_step],
                                       path, step, from_step))
                report.patches += 1
            jump *= 2
        # An anchor every anchor_every steps, and whenever there is nothing to diff against
        # (the first step, or the previous checkpoint is gone from the training folder).
        if prev is None or index % anchor_every == 0:
            new_entries.append(add("anchor", f"anchor-{step:08d}.pulsediff", None, path, step, None))
            report.anchors += 1
        manifest.entries.extend(new_entries)
        manifest.save(out_dir)  # last: the files it names are already in place
        steps_done.append(step)
        prev, last_step = path, step
    if keep is not None:
        report.pruned = _prune(manifest, out_dir, keep)
    return report


def _prune(manifest: Manifest, out_dir: Path, keep: int) -> int:
    """Keep the newest `keep` anchors and everything after the oldest of them."""
    if keep < 1:
        raise UsageError("--keep must be at least 1")
    anchors = sorted((e for e in manifest.entries if e.kind == "anchor"), key=lambda e: e.step)
    if len(anchors) <= keep:
        return 0
    oldest_kept = anchors[-keep].step
    drop = [e for e in manifest.entries if e.step < oldest_kept or (e.kind == "patch" and e.step == oldest_kept)]
    manifest.entries = [e for e in manifest.entries if e not in drop]
    manifest.save(out_dir)  # first the manifest stops naming them, then they go
    for e in drop:
        (out_dir / e.file).unlink(missing_ok=True)
    return len(drop)


def publish(train_dir: Path, out_dir: Path, *, watch: bool = False, interval: float = 2.0,
            idle_exit: float | None = None, on_report=None, **kwargs) -> PublishReport:
    """`publish_once`, and with `watch` again every `interval` s.

    `idle_exit` stops the watch that many seconds after the last new
    checkpoint; the clock starts once something has been published, so a
    publisher started before its trainer waits for the first checkpoint.
    """
    total = PublishReport()
    last_change = time.monotonic() if Manifest.load(out_dir) else None
    while True:
        report = publish_once(train_dir, out_dir, **kwargs)
        for field in ("patches", "anchors", "pruned"):
            setattr(total, field, getattr(total, field) + getattr(report, field))
        if report.patches or report.anchors:
            last_change = time.monotonic()
            if on_report:
                on_report(report)
        idle = last_change is not None and idle_exit is not None and time.monotonic() - last_change >= idle_exit
        if not watch or idle:
            return total
        time.sleep(interval)


# -- catching up -----------------------------------------------------------------------


@dataclass(frozen=True)
class CatchUpResult:
    status: str  # "up-to-date", "applied", or "partial" (the newest step is unreachable; `step` is how far it got)
    output: Path
    step: int
    files: list[str]  # the chain applied, in order
    from_anchor: bool
    skipped: list[str]  # files found missing or damaged on the way


@dataclass(frozen=True)
class CatchUpPlan:
    step: int  # the newest published step
    files: list[str]  # the chain catch-up would apply, in order; empty when already there
    from_anchor: bool


def _where_we_are(checkpoint: Path, patch_dir: Path, progress: Progress):
    """(manifest, the checkpoint's tensor ids or None, its digest or None)."""
    from .inspect import tensor_ids

    manifest = Manifest.load(patch_dir)
    if manifest is None or not manifest.entries:
        raise CheckpointNotFoundError(str(patch_dir / MANIFEST), "manifest")
    ids = None  # hashed once here, handed to apply
    if checkpoint.exists():
        with Checkpoint(checkpoint) as ckpt:
            ids = tensor_ids(TensorView(ckpt, manifest.precision), progress)
    return manifest, ids, checkpoint_digest(ids.values()) if ids is not None else None


def plan_catch_up(checkpoint: Path, patch_dir: Path, *, progress: Progress = SILENT) -> CatchUpPlan:
    """The files catch-up would apply, judged from the manifest alone (the files need not be here).

    For fetching only what is needed: a worker that mirrors the whole folder
    would also download every anchor, each nearly the size of the checkpoint.
    """
    manifest, _, have = _where_we_are(checkpoint, patch_dir, progress)
    newest = manifest.newest
    if have == newest.target:
        return CatchUpPlan(newest.step, [], False)
    path = _cheapest_path(manifest.entries, have, newest.target, set())
    if path is None:
        raise PulsediffError(f"the manifest in {patch_dir} has no chain from {checkpoint} to step {newest.step}")
    return CatchUpPlan(newest.step, [e.file for e in path], path[0].kind == "anchor")


def catch_up(checkpoint: Path, patch_dir: Path, out: Path | None = None, *, device: str | None = None,
             progress: Progress = SILENT) -> CatchUpResult:
    from .apply import apply_chain, verify_patch_file

    manifest, ids, have = _where_we_are(checkpoint, patch_dir, progress)
    newest = manifest.newest
    out_path = out or checkpoint
    if have == newest.target:
        if out is not None and out != checkpoint and not out.exists():
            apply_chain(checkpoint, [patch_dir / newest.file], out, device=device, progress=progress, base_ids=ids)
        return CatchUpResult("up-to-date", out_path, newest.step, [], False, [])
    have_step = max((e.step for e in manifest.entries if e.target == have), default=-1)
    # Targets to aim for, newest first: when the newest cannot be reached (its only
    # patch is damaged, say), the newest reachable step is still progress.
    goals = sorted({(e.step, e.target) for e in manifest.entries if e.step > have_step}, reverse=True)
    bad: set[str] = set()
    for step, goal in goals:
        while True:
            path = _cheapest_path(manifest.entries, have, goal, bad)
            if path is None:
                break
            damaged = [e.file for e in path if not _intact(patch_dir / e.file, verify_patch_file)]
            if damaged:
                bad.update(damaged)
                continue
            from_anchor = path[0].kind == "anchor"
            files = [patch_dir / e.file for e in path]
            apply_chain(None if from_anchor else checkpoint, files, out_path, device=device, progress=progress,
                        base_ids=None if from_anchor else ids)
            status = "applied" if step == newest.step else "partial"
            return CatchUpResult(status, out_path, step, [e.file for e in path], from_anchor, sorted(bad))
    raise PulsediffError(
        f"cannot reach any newer step from {checkpoint}: no intact chain in {patch_dir}"
        + (f" (missing or damaged: {', '.join(sorted(bad))})" if bad else ""))


def _intact(path: Path, verify) -> bool:
    try:
        verify(path)
        return True
    except PulsediffError:
        return False


def _cheapest_path(entries: list[Entry], have: str | None, goal: str, bad: set[str]) -> list[Entry] | None:
    """Dijkstra over digests, from the checkpoint's digest or the empty one.

    A link costs its file's bytes, weighted by FETCH_WEIGHT (they cross the
    network: at 1 Gbit/s a byte takes about as long as decoding 8 bytes of
    checkpoint), plus the checkpoint's size (applying any link is about one
    pass over the whole checkpoint). So a long chain of tiny patches loses to
    a few skip patches, and an anchor wins only when no short chain exists.
    """
    edges: dict[str, list[Entry]] = {}
    for e in entries:
        if e.file not in bad:
            edges.setdefault(e.base, []).append(e)
    starts = {EMPTY_DIGEST} | ({have} if have else set())
    queue = [(0, i, d) for i, d in enumerate(sorted(starts))]
    best: dict[str, tuple[int, list[Entry]]] = {d: (0, []) for d in starts}
    counter = len(queue)
    while queue:
        cost, _, node = heapq.heappop(queue)
        if node == goal:
            return best[node][1]
        if cost > best[node][0]:
            continue
        for e in edges.get(node, []):
            new_cost = cost + FETCH_WEIGHT * e.bytes + e.target_bytes
            if e.target not in best or new_cost < best[e.target][0]:
                best[e.target] = (new_cost, best[node][1] + [e])
                counter += 1
                heapq.heappush(queue, (new_cost, counter, e.target))
    return None
