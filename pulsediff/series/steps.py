"""A trainer's folder as a series of steps: which entries are checkpoints, their step numbers,
and whether a checkpoint is complete enough to publish."""

from __future__ import annotations

import re
import time
from pathlib import Path

from pulsediff.errors import AmbiguousStepError, PulsediffError, UsageError
from pulsediff.io.checkpoint import Checkpoint

# The step is the number after "step" (step_12, global_step12), else the last number in the name
# (checkpoint-500): `fp32_step0` is step 0 and `step5_bf16` step 5. A user's pattern: its first group.
DEFAULT_STEP_PATTERN = r"(?i)step[_-]?(\d+)|(\d+)(?!.*\d)"
READY_RULES = ("stable", "marker")
DEFAULT_SETTLE = 2.0
MARKER_SUFFIX = ".done"


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


def fingerprint(path: Path) -> tuple:
    """(name, size, mtime_ns, inode) of every file of a checkpoint: any write changes it."""
    files = [path] if not path.is_dir() else sorted(p for p in path.iterdir() if p.is_file())
    out = []
    for f in files:
        st = f.stat()
        out.append((f.name, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


def marker_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name.removesuffix(".safetensors") + MARKER_SUFFIX)


def not_ready(path: Path, rule: str, settle: float, fingerprint: tuple | None) -> str | None:
    """Why `path`, whose files have `fingerprint` now, cannot be published yet ("settling" when
    waiting will do), or None."""
    if fingerprint is None:
        return "settling"  # a file vanished under us: the trainer is renaming or rewriting it
    if rule == "marker":
        return None if marker_path(path).is_file() else f"no {marker_path(path).name} yet"
    newest = max((mtime for _, _, mtime, _ in fingerprint), default=0)
    return "settling" if time.time() - newest / 1e9 < settle else None


def fingerprint_or_none(path: Path) -> tuple | None:
    try:
        return fingerprint(path)
    except OSError:
        return None
