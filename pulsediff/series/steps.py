"""A trainer's folder as a series of steps: which entries are checkpoints, their step numbers,
and whether a checkpoint is complete enough to publish."""

from __future__ import annotations

import re
import time
from pathlib import Path

from pulsediff.errors import AmbiguousStepError, PulsediffError, TrainingFolderError, UsageError
from pulsediff.io.checkpoint import INDEX_NAME, Checkpoint

# The step is the number after "step" (step_12, global_step12), else the last number in the name
# (checkpoint-500): `fp32_step0` is step 0 and `step5_bf16` step 5. A user's pattern: its first group.
DEFAULT_STEP_PATTERN = r"(?i)step[_-]?(\d+)|(\d+)(?!.*\d)"
READY_RULES = ("stable", "marker")
DEFAULT_SETTLE = 2.0
MARKER_SUFFIX = ".done"
# Hugging Face's shard names (model-00001-of-00003.safetensors, always five digits each): the numbers
# are a shard's place and count, not a step, and the shards are parts of the folder's one checkpoint.
# Other "-N-of-M" names (a trainer's step-100-of-1000.safetensors) are steps like any other.
SHARD_NAME = re.compile(r"-\d{5}-of-\d{5}\.safetensors$")


def step_in_name(name: str, regex: re.Pattern) -> int | None:
    """The step number a checkpoint's name carries: the first group of `regex` that matched."""
    match = regex.search(name.removesuffix(".safetensors"))
    if not match:
        return None
    digits = next((g for g in match.groups() if g is not None), None)
    return int(digits) if digits is not None and len(digits) <= 15 else None


def checkpoint_candidates(train_dir: Path, pattern: str = DEFAULT_STEP_PATTERN) -> list[tuple[int, Path]]:
    """Everything in `train_dir` named like a step's checkpoint (a `.safetensors` file or a folder), by step.

    Shards named like Hugging Face's are not steps: read as steps, those of one model gave "two checkpoints
    for step 3" (model-00001-of-00003 and model-00002-of-00003), and moving one away breaks the model.
    """
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
        if SHARD_NAME.search(path.name):
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


def no_checkpoints(train_dir: Path, pattern: str = DEFAULT_STEP_PATTERN, skipped: dict[str, str] | None = None,
                   waited: float | None = None) -> TrainingFolderError:
    """The error for a trainer's folder in which publish found no checkpoint, saying what it found instead:
    that the folder is one checkpoint itself, checkpoints one level down, entries named like steps that do not
    open, or .safetensors files without a step number. `waited`: the seconds a watch looked in vain."""
    refusal = one_checkpoint(train_dir, pattern)
    if refusal is not None:
        return refusal
    message = f"no checkpoints found in {train_dir}" + (f" in {waited:g} s of --watch (--idle-exit)" if waited else "")
    below = [sub for sub in _subfolders(train_dir) if _holds_steps(sub, pattern)]
    unnamed = sorted(p.name for p in _entries(train_dir) if p.suffix == ".safetensors" and not p.name.startswith("."))
    if below:
        more = f" and {len(below) - 1} other folder{'s' if len(below) > 2 else ''}" if len(below) > 1 else ""
        message += f"; found some one level down in {below[0]}{more}: give {'one of them' if more else 'that folder'}"
    elif skipped:
        message += f"; {_some(sorted(skipped))} {'does' if len(skipped) == 1 else 'do'} not open as a checkpoint"
    elif unnamed:
        message += f"; no step number in the name of {_some(unnamed)} (see --step-pattern)"
    elif not any(not p.name.startswith(".") for p in _entries(train_dir)):
        message += "; it is empty"
    else:  # what publish looks for, for a folder of other things
        message += ("; a checkpoint is a .safetensors file or a folder of them, with its step in its name: "
                    "step_N.safetensors, checkpoint-N/")
    return TrainingFolderError(str(train_dir), message)


def one_checkpoint(folder: Path, pattern: str = DEFAULT_STEP_PATTERN) -> TrainingFolderError | None:
    """The error for a folder with no steps that is one model's checkpoint (its shard index, shards named
    like Hugging Face's, or model.safetensors), given as a trainer's folder; None if it is not one."""
    if (folder / INDEX_NAME).is_file():
        evidence = INDEX_NAME
    else:
        names = sorted(p.name for p in _entries(folder) if SHARD_NAME.search(p.name) or p.name == "model.safetensors")
        if not names:
            return None
        evidence = _some(names)
    return TrainingFolderError(str(folder), f"{folder} is one checkpoint (it holds {evidence}), not a folder of "
                                            f"steps; give the folder that holds one checkpoint per step"
                                            f"{_as_a_step_of_its_parent(folder, pattern)}")


def _as_a_step_of_its_parent(folder: Path, pattern: str) -> str:
    """", e.g. PARENT, where it is step N" when the folder above holds `folder` as one of its steps."""
    try:
        step = next((s for s, p in checkpoint_candidates(folder.absolute().parent, pattern) if p.name == folder.name),
                    None)
    except (PulsediffError, OSError):
        return ""
    parent = folder.parent if folder.parent != Path(".") else folder.absolute().parent
    return "" if step is None else f", e.g. {parent}, where it is step {step}"


def _holds_steps(folder: Path, pattern: str) -> bool:
    try:
        return bool(checkpoint_candidates(folder, pattern))
    except AmbiguousStepError:
        return True  # two checkpoints named for one step: checkpoints all the same
    except (PulsediffError, OSError):
        return False


def _entries(folder: Path) -> list[Path]:
    try:
        return sorted(folder.iterdir())
    except OSError:
        return []


def _subfolders(folder: Path) -> list[Path]:
    return [p for p in _entries(folder) if not p.name.startswith(".") and p.is_dir()]


def _some(names: list[str], shown: int = 3) -> str:
    """'a', 'a, b and c', 'a, b, c and 4 more'."""
    if len(names) > shown:
        return f"{', '.join(names[:shown])} and {len(names) - shown} more"
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


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
