"""Every error pulsediff raises on purpose.

One base class, `PulsediffError`, so that the CLI can turn any of them into a
single line and a non-zero exit. Subclasses also inherit the matching built-in
(`ValueError`, `FileNotFoundError`, ...) so that library callers can catch
what they already know.
"""

from __future__ import annotations


class PulsediffError(Exception):
    """Base class. `str(err)` is the one line the CLI prints."""


# --- checkpoints -----------------------------------------------------------


class CheckpointNotFoundError(PulsediffError, FileNotFoundError):
    def __init__(self, path: str, what: str = "checkpoint"):
        self.path = path
        super().__init__(f"{what} not found: {path}")


class InvalidCheckpointError(PulsediffError, ValueError):
    """A file or folder that is not a valid safetensors checkpoint."""

    def __init__(self, path: str, reason: str):
        self.path = path
        self.reason = reason
        super().__init__(f"not a valid safetensors checkpoint: {path}: {reason}")


class CheckpointChangedError(PulsediffError, OSError):
    """A checkpoint file that shrank while pulsediff read it (overwritten, truncated, replaced in place)."""

    def __init__(self, path: str, reason: str):
        self.path = path
        self.reason = reason
        super().__init__(f"{path} changed while being read: {reason}")


class CheckpointReadError(PulsediffError, OSError):
    """Reading a checkpoint file failed (an I/O error, a file system that went away)."""

    def __init__(self, path: str, reason: str):
        self.path = path
        self.reason = reason
        super().__init__(f"cannot read {path}: {reason}")


class FolderFileError(PulsediffError, ValueError):
    """A file beside a model folder's weights that a patch cannot carry (pulsediff/io/folder_files.py)."""

    def __init__(self, path: str, reason: str):
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}")


class UnsupportedDtypeError(PulsediffError, ValueError):
    def __init__(self, name: str, dtype: str):
        self.name = name
        self.dtype = dtype
        super().__init__(f"tensor {name!r} has dtype {dtype}, which pulsediff does not support")


# --- patches ---------------------------------------------------------------


class InvalidPatchError(PulsediffError, ValueError):
    """The patch stream is not a pulsediff patch, or is damaged."""


class NotAPatchError(InvalidPatchError):
    def __init__(self, source: str):
        super().__init__(f"{source} is not a pulsediff patch (bad magic bytes)")


class UnsupportedVersionError(InvalidPatchError):
    def __init__(self, major: int, minor: int, supported: tuple[int, ...]):
        self.major, self.minor = major, minor
        majors = " and ".join(map(str, supported))
        super().__init__(
            f"patch format version {major}.{minor} is not supported "
            f"(this pulsediff reads major version{'s' if len(supported) > 1 else ''} {majors}); upgrade pulsediff"
        )


class TruncatedPatchError(InvalidPatchError):
    def __init__(self, source: str, what: str):
        super().__init__(f"patch {source} is truncated ({what})")


class PatchReadError(PulsediffError, OSError):
    """Reading a patch failed (an I/O error, a connection or file system that went away)."""

    def __init__(self, source: str, reason: str):
        self.source = source
        self.reason = reason
        super().__init__(f"cannot read patch {source}: {reason}")


class CorruptPatchError(InvalidPatchError):
    def __init__(self, source: str, what: str):
        super().__init__(f"patch {source} is corrupt: {what}")


class UnknownCodecError(InvalidPatchError):
    def __init__(self, codec_id: str):
        self.codec_id = codec_id
        super().__init__(f"unknown codec {codec_id!r}; the patch needs a newer pulsediff")


class UnknownSchemeError(InvalidPatchError):
    def __init__(self, source: str, prefix: str):
        self.prefix = prefix
        super().__init__(f"patch {source} names its digests {prefix!r}, a scheme this pulsediff does not know; "
                         "the patch needs a newer pulsediff")


# --- series folders ---------------------------------------------------------


class InvalidManifestError(PulsediffError, ValueError):
    """A series folder's manifest.json that is malformed, or contradicts itself or the files it names."""

    def __init__(self, path: str, reason: str):
        self.path = path
        self.reason = reason
        super().__init__(f"not a valid pulsediff manifest: {path}: {reason}")


class OutsideLinkError(PulsediffError, ValueError):
    """A file of a series folder that is a symbolic link leading out of it: not followed (rsync's
    --safe-links). Links that stay inside the folder are fine."""

    def __init__(self, path: str, real: str):
        self.path, self.real = path, real
        super().__init__(f"{path} is a symbolic link out of its series folder (to {real}); not followed")


class NotInSeriesError(PulsediffError, ValueError):
    """catch-up given a checkpoint the series does not list (another model, or a step it no longer
    keeps): replacing it from an anchor needs force, and is never done for another output."""


class PartialCatchUpError(PulsediffError):
    """A catch-up that moved the checkpoint to a verified step short of the newest (the CLI's exit 4)."""

    def __init__(self, output: str, step: int, newest: int, reason: str):
        self.output, self.step, self.newest, self.reason = output, step, newest, reason
        super().__init__(f"{output} is now at step {step} of {newest}; stopped: {reason}")


class SigningKeyError(PulsediffError, ValueError):
    """A key file or public key (`keygen`, `publish --sign`, `--trust`) that cannot be used."""


class UntrustedManifestError(PulsediffError, ValueError):
    """A manifest that a worker configured with trusted keys must not use: unsigned, signed by another key,
    altered after signing, or older than one already accepted (docs/FORMAT.md §8.1)."""

    def __init__(self, path: str, reason: str):
        self.path = path
        self.reason = reason
        super().__init__(f"refusing {path}: {reason}")


class RollbackError(UntrustedManifestError):
    """A validly signed manifest older than one already accepted from the same source (under any key)."""


class FetchError(PulsediffError, OSError):
    """A remote series that cannot be reached, or refuses us, past the retries: no path around it."""


class OtherRunError(PulsediffError, ValueError):
    """publish given a training folder whose checkpoints are not the steps its DEST lists: another run
    (or a checkpoint rewritten after it was published). A series belongs to one run."""


class PublishConflictError(PulsediffError, FileExistsError):
    """Another publisher's object or manifest is where this publish would write."""


# --- applying --------------------------------------------------------------


class BaseMismatchError(PulsediffError, ValueError):
    """The checkpoint given as base is not the one the patch was made from."""

    def __init__(self, expected: str, actual: str, detail: str = ""):
        self.expected, self.actual = expected, actual
        msg = f"base checkpoint does not match the patch (patch expects base {expected}, got {actual})"
        super().__init__(msg + (f": {detail}" if detail else ""))


class BaseFileMismatchError(PulsediffError, ValueError):
    """In exact mode, a file of the base folder that the patch keeps (config, tokenizer) is missing or differs."""


class TensorMismatchError(PulsediffError, ValueError):
    """A base tensor has another shape or dtype than the patch expects."""


class ChainError(PulsediffError, ValueError):
    """Patches given as a chain do not link up."""


class TargetMismatchError(PulsediffError, ValueError):
    """The rebuilt checkpoint does not hash to the patch's target digest."""

    def __init__(self, expected: str, actual: str):
        super().__init__(f"rebuilt checkpoint has digest {actual}, expected {expected}; nothing was written")


class OutputError(PulsediffError, OSError):
    """Writing the output failed (disk full, permissions, ...). No partial output is left."""


class OutOfMemoryError(PulsediffError, MemoryError):
    """Memory ran out, whatever form it took: an allocation, a thread that could not start, a shared
    library that could not be mapped while a module loaded (numba, torch: imported when first needed)."""


def as_out_of_memory(exc: BaseException) -> OutOfMemoryError | None:
    """`exc` as the OutOfMemoryError it is in disguise, else None.

    Memory that runs out while a library loads does not raise MemoryError:
    the dynamic loader fails with "failed to map segment from shared object"
    (llvmlite then says it could not find libllvmlite.so), and a thread
    whose stack cannot be mapped is "can't start new thread". Reported as
    they come, the first looks like a broken install and the second like a
    bug (exit 3). The causes and contexts are searched too.
    """
    import errno

    seen = 0
    while exc is not None and seen < 20:
        text = str(exc)
        if isinstance(exc, MemoryError):
            return exc if isinstance(exc, OutOfMemoryError) else OutOfMemoryError("out of memory")
        if isinstance(exc, RuntimeError) and "can't start new thread" in text:
            return OutOfMemoryError("out of memory: cannot start a thread (or the limit on threads is reached)")
        if isinstance(exc, OSError) and (exc.errno == errno.ENOMEM or "failed to map segment" in text
                                         or "cannot allocate memory" in text.lower()):
            return OutOfMemoryError(f"out of memory while loading a library ({text})")
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


class DeviceUnavailableError(PulsediffError, RuntimeError):
    """The CUDA kernels cannot run here: no GPU or driver, numba-cuda missing or broken, or a
    compile, launch or allocation that failed. `reason` is the cause, in one line."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(f"the CUDA kernels cannot run: {reason}")


class AmbiguousStepError(PulsediffError, ValueError):
    """A trainer's folder holds two checkpoints whose names give the same step."""

    def __init__(self, folder: str, step: int, names: tuple[str, str]):
        self.folder, self.step, self.names = folder, step, names
        super().__init__(f"two checkpoints for step {step} in {folder}: {names[0]} and {names[1]}; move one "
                         "away, or give --step-pattern to read the step from the names differently")


class TrainingFolderError(PulsediffError, ValueError):
    """A folder given as a trainer's folder (publish's TRAIN_DIR) that holds no checkpoint to publish:
    empty, its checkpoints one level down, or itself one checkpoint (a model folder). `reason` is the line."""

    def __init__(self, folder: str, reason: str):
        self.folder, self.reason = folder, reason
        super().__init__(reason)


class MissingExtraError(PulsediffError, ImportError):
    """A feature asked for needs an optional package that is not installed (exit 1: the command was right)."""

    def __init__(self, feature: str, package: str, extra: str):
        self.feature, self.package, self.extra = feature, package, extra
        super().__init__(f"{feature} needs {package}, which is not installed: pip install 'pulsediff[{extra}]' "
                         f"(or pip install {package})")


class UsageError(PulsediffError, ValueError):
    """Arguments that do not fit together."""


class OutputExistsError(PulsediffError, FileExistsError):
    """The output path exists and the caller did not ask to replace it (the CLI's -f/--force, the API's force=True)."""

    def __init__(self, path: str, how: str = "give -f/--force"):
        self.path = path
        super().__init__(f"{path} already exists; {how} to overwrite it")


def refuse_existing(out, force: bool) -> None:
    """Raise OutputExistsError if `out` names an existing file or folder (or a link) and not `force`.

    `out` may also be "-" (stdout), a stream or None: nothing to refuse. Like zstd and rsync, every
    function that writes an output leaves an existing one alone unless told to replace it.
    """
    import os

    if not force and isinstance(out, (str, os.PathLike)) and str(out) != "-" and os.path.lexists(out):
        raise OutputExistsError(str(out), "pass force=True")


def refuse_folder_for_file(out, why: str, example: str) -> None:
    """Raise UsageError if `out`, where a single file is to be written, names a folder: an existing one, or
    a name ending in '/'. `why` says what makes it one file ("a patch is a single file"); `example` is a
    file name to suggest inside the folder.

    Checked before refuse_existing, so that no one is told to give -f/--force: force replaces a file, it
    cannot turn a folder into one.
    """
    import os

    if not isinstance(out, (str, os.PathLike)) or str(out) == "-":
        return
    text = os.fspath(out)
    trailing = text.endswith(("/", os.sep))
    if trailing or (os.path.isdir(text) and not os.path.islink(text)):
        folder = text.rstrip("/" + os.sep) or text
        state = "names a folder" if trailing and not os.path.isdir(text) else "is a folder"
        raise UsageError(f"{text} {state}, but {why}; give a file name, such as {os.path.join(folder, example)}")
