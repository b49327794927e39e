"""A series folder's manifest.json: its strict reader, and the path search over it.

The manifest is read from folders that rsync, a CDN or another process may
have filled, so it is treated like a patch header: `Manifest.load` bounds its
size and nesting before parsing, checks every field's type and range, and
checks the relations that make it one series (docs/FORMAT.md §8):

- every file name is a plain `*.pulsediff` name inside the folder, listed once;
- an anchor's base is the empty checkpoint; a patch goes from an earlier step
  to a later one (`from_step < step`), so step labels can never form a cycle;
- all entries for one step agree on its target digest, and a patch's base is
  the target digest of its `from_step` wherever that step is listed;
- sizes are non-negative, steps below 2**48;
- `serial` (counted up by the publisher at every write) and each file's
  `sha256` are optional for unsigned series; a signed one needs both (§8.1);
  `series`, a signed series' id, is optional everywhere.

What the manifest cannot prove, the files do: catch-up checks each planned
file's own header digests against its entry before using it (series/catch_up.py).

`cheapest_paths` is one Dijkstra pass over digests, from the worker's
checkpoint and from the empty checkpoint, with predecessor links rather than
copied path lists, so a 20,000-entry manifest plans in milliseconds.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import re
import stat
from dataclasses import asdict, dataclass
from pathlib import Path

from pulsediff.io import strict_json
from pulsediff.io.atomic import StagedFiles
from pulsediff.io.names import PRECISIONS, is_plain_filename
from pulsediff.format.digest import DEFAULT_SCHEME, EMPTY_DIGESTS, DigestScheme, is_digest, scheme_of, unknown_scheme
from pulsediff.errors import InvalidManifestError, OutsideLinkError

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
PATCH_SUFFIX = ".pulsediff"
KINDS = ("patch", "anchor")
MAX_MANIFEST_BYTES = 64 * 1024 * 1024  # ~200,000 entries of ~300 bytes
MAX_ENTRIES = 200_000  # two files a step for 100,000 steps
MAX_STEP = 2**48 - 1
MAX_SERIAL = 2**53 - 1  # exact in every JSON reader
MAX_FILE_BYTES = 2**62
MAX_NAME_BYTES = 255  # one path component on common file systems
FETCH_WEIGHT = 8  # see cheapest_paths
_SHA256 = re.compile(r"[0-9a-f]{64}")


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
    sha256: str | None = None  # the file's SHA-256 (hex): what a signature vouches for, through the manifest

    def to_json(self) -> dict:
        obj = asdict(self)
        if self.sha256 is None:
            del obj["sha256"]
        return obj


def is_series_file_name(name: object) -> bool:
    """The one rule for names a manifest may give: a visible `*.pulsediff` file directly in the folder,
    in UTF-8 (JSON can spell a lone surrogate, which no file system call accepts)."""
    if not (is_plain_filename(name) and not name.startswith(".") and name.endswith(PATCH_SUFFIX)):
        return False
    try:
        return len(name.encode("utf-8")) <= MAX_NAME_BYTES
    except UnicodeEncodeError:
        return False


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class Manifest:
    precision: str
    entries: list[Entry]
    serial: int = 0  # one more at every manifest the publisher writes: a worker's rollback check compares it
    series: str | None = None  # a signed series' id, fixed at its first manifest: a worker pins it per source
    first_scheme: DigestScheme | None = None  # a series without entries yet: the scheme it will begin with

    def to_json(self) -> dict:
        head = {"version": MANIFEST_VERSION} | ({"series": self.series} if self.series is not None else {})
        return head | {"serial": self.serial, "precision": self.precision,
                       "entries": [e.to_json() for e in self.entries]}

    def to_bytes(self) -> bytes:
        """The bytes a publisher writes (and signs)."""
        return (json.dumps(self.to_json(), indent=1) + "\n").encode()

    @classmethod
    def load(cls, folder: Path) -> "Manifest | None":
        """The folder's manifest, fully validated; None when there is none."""
        path = Path(folder) / MANIFEST
        data = read_small_file(path, MAX_MANIFEST_BYTES, InvalidManifestError)
        return None if data is None else parse_manifest(data, str(path))

    def save(self, folder: Path) -> None:
        with StagedFiles(inputs=()) as staged:  # made of no mapped checkpoint
            with staged.open(Path(folder) / MANIFEST) as f:
                f.write(self.to_bytes())
            staged.commit()

    @property
    def scheme(self) -> DigestScheme:
        """The digest scheme of the series' entries (they share one); for a series without entries
        yet, the one it will begin with (first_scheme, else the default)."""
        if self.entries:
            return scheme_of(self.entries[0].target)
        return self.first_scheme or DEFAULT_SCHEME

    @property
    def newest(self) -> Entry | None:
        return max(self.entries, key=lambda e: (e.step, e.kind == "patch"), default=None)

    def step_of(self, digest: str) -> int | None:
        """The newest step whose checkpoint has this digest (a step that changed nothing shares its digest)."""
        return max((e.step for e in self.entries if e.target == digest), default=None)


def read_small_file(path: Path, limit: int, error=InvalidManifestError, root: str | None = None) -> bytes | None:
    """The bytes of the regular file `path` (None when there is none), refused past `limit` bytes with
    `error(str(path), reason)`: a directory, a FIFO or a device is an error, never a hang. `root` (a
    real path): the file must lie inside that folder, else OutsideLinkError (see `outside`)."""
    if root is not None and not within(os.path.realpath(path), root):  # never even opened
        raise OutsideLinkError(str(path), os.path.realpath(path))
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO must not block us
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise error(str(path), exc.strerror or str(exc)) from None
    try:
        if root is not None and (real := outside(fd, path, root)) is not None:
            raise OutsideLinkError(str(path), real)
        # Checked on the descriptor before wrapping it: os.fdopen refuses a directory with an
        # error naming the descriptor, not the path, and leaves the descriptor open.
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a pipe, socket or device"
            raise error(str(path), f"not a regular file ({kind})")
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    try:
        with f:
            # read(n) allocates n bytes up front: ask for what is there (and one more, in case it grew).
            data = f.read(min(st.st_size, limit) + 1)
    except OSError as exc:
        raise error(str(path), exc.strerror or str(exc)) from None
    if len(data) > limit:
        raise error(str(path), f"larger than {limit} bytes")
    return data


def within(real: str, root: str) -> bool:
    """Whether the real path `real` is the folder `root` (a real path) or inside it."""
    return os.path.commonpath([real, root]) == root


def outside(fd: int, path: Path, root: str) -> str | None:
    """Where the file open at `fd` (opened as `path`) really is, when that is outside the folder `root`
    (a real path); None when it is inside. Asked of the descriptor, not the name: a link swapped
    between a check of the name and the open cannot pass for the file that was opened."""
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")  # Linux: the opened file's own path
    except OSError:  # elsewhere: the name's real path, if that still is the file that was opened
        real = os.path.realpath(path)
        try:
            if not os.path.samestat(os.fstat(fd), os.stat(real)):
                return real
        except OSError:
            return real
    return None if within(real, root) else real


SERIES_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")

def parse_manifest(data: bytes, source: str) -> Manifest:
    def fail(reason: str) -> InvalidManifestError:
        return InvalidManifestError(source, reason)

    try:
        obj = strict_json.loads(data, max_depth=4, max_containers=MAX_ENTRIES + 2)
    except strict_json.JsonError as exc:
        raise fail(f"not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise fail("not a JSON object")
    if obj.get("version") != MANIFEST_VERSION or isinstance(obj.get("version"), bool):
        raise fail(f"version {str(obj.get('version'))[:20]!r} is not supported (this pulsediff reads {MANIFEST_VERSION})")
    precision = obj.get("precision")
    if precision not in PRECISIONS:
        raise fail(f"precision must be one of {', '.join(PRECISIONS)}")
    raw_entries = obj.get("entries")
    if not isinstance(raw_entries, list):
        raise fail("entries is not a list")
    if len(raw_entries) > MAX_ENTRIES:
        raise fail(f"more than {MAX_ENTRIES} entries")
    serial = _uint(obj, "serial", MAX_SERIAL, "manifest", fail) if "serial" in obj else 0
    series = obj.get("series")
    if "series" in obj and not (isinstance(series, str) and SERIES_ID.fullmatch(series)):
        raise fail("series must be 1 to 64 letters, digits, '-' or '_'")
    entries = [_entry(e, i, fail) for i, e in enumerate(raw_entries)]
    _check_relations(entries, fail)
    return Manifest(precision, entries, serial, series)


def _uint(e: dict, key: str, upper: int, where: str, fail) -> int:
    value = e.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= upper:
        raise fail(f"{where}.{key} must be a whole number from 0 to {upper}")
    return value


def _entry(e: object, i: int, fail) -> Entry:
    where = f"entries[{i}]"
    if not isinstance(e, dict):
        raise fail(f"{where} is not an object")
    kind = e.get("kind")
    if kind not in KINDS:
        raise fail(f"{where}.kind must be patch or anchor")
    name = e.get("file")
    if not is_series_file_name(name):
        raise fail(f"{where}.file must be a plain *{PATCH_SUFFIX} name in the folder")
    step = _uint(e, "step", MAX_STEP, where, fail)
    if kind == "anchor":
        if e.get("from_step", None) is not None:
            raise fail(f"{where} is an anchor with a from_step")
        from_step = None
    else:
        from_step = _uint(e, "from_step", MAX_STEP, where, fail)
        if from_step >= step:
            raise fail(f"{where} ({name}) goes from step {from_step} to step {step}: patches go forward")
    base, target = e.get("base"), e.get("target")
    if not (is_digest(base) and is_digest(target)):
        unknown = unknown_scheme(base) or unknown_scheme(target)
        if unknown:
            raise fail(f"{where} has digests of scheme {unknown!r}, which this pulsediff does not know; "
                       "the series needs a newer pulsediff")
        raise fail(f"{where} has a malformed digest")
    if scheme_of(base) != scheme_of(target):
        raise fail(f"{where} has digests of two schemes")
    if kind == "anchor" and base != scheme_of(base).empty:
        raise fail(f"{where} is an anchor whose base is not the empty checkpoint")
    if target in EMPTY_DIGESTS:
        raise fail(f"{where} has the empty checkpoint (no tensors) as its target")
    sha256 = e.get("sha256")
    if sha256 is not None and not (isinstance(sha256, str) and _SHA256.fullmatch(sha256)):
        raise fail(f"{where}.sha256 must be 64 lowercase hex digits")
    return Entry(kind, name, step, from_step, base, target,
                 _uint(e, "bytes", MAX_FILE_BYTES, where, fail), _uint(e, "target_bytes", MAX_FILE_BYTES, where, fail),
                 sha256)


def _check_relations(entries: list[Entry], fail) -> None:
    files: set[str] = set()
    digest_at: dict[int, str] = {}
    if len({scheme_of(e.target) for e in entries}) > 1:  # a chain never crosses schemes: its digests differ
        raise fail("entries have digests of more than one scheme")
    for e in entries:
        if e.file in files:
            raise fail(f"{e.file} is listed twice")
        files.add(e.file)
        if digest_at.setdefault(e.step, e.target) != e.target:
            raise fail(f"step {e.step} has two different target digests")
    for e in entries:
        if e.kind == "patch" and e.from_step in digest_at and digest_at[e.from_step] != e.base:
            raise fail(f"{e.file} starts from step {e.from_step}, but its base digest is not that step's")


# -- the path search -------------------------------------------------------------


class Paths:
    """The cheapest way to every digest reachable from the start digests."""

    def __init__(self, cost: dict[str, int], via: dict[str, Entry]):
        self.cost = cost
        self._via = via  # digest -> the last link of its cheapest path (absent for a start)

    def reaches(self, digest: str) -> bool:
        return digest in self.cost

    def path_to(self, digest: str) -> list[Entry]:
        path = []
        while digest in self._via:
            link = self._via[digest]
            path.append(link)
            digest = link.base
        return path[::-1]


def link_cost(e: Entry) -> int:
    return FETCH_WEIGHT * e.bytes + e.target_bytes


def cheapest_paths(entries: list[Entry], have: str | None, drop: set[str] = frozenset()) -> Paths:
    """Dijkstra over digests, from the checkpoint's digest and the empty one, skipping files in `drop`.

    A link costs its file's bytes, weighted by FETCH_WEIGHT (they cross the
    network: at 1 Gbit/s a byte takes about as long as decoding 8 bytes of
    checkpoint), plus the checkpoint's size (applying any link is about one
    pass over the whole checkpoint). So a long chain of tiny patches loses to
    a few skip patches, and an anchor wins only when no short chain exists.
    Costs are non-negative (the manifest reader guarantees it), so each node
    settles once; a patch whose base is its target (a step that changed
    nothing) leads nowhere and is skipped.
    """
    edges: dict[str, list[Entry]] = {}
    for e in entries:
        if e.file not in drop and e.base != e.target:
            edges.setdefault(e.base, []).append(e)
    starts = sorted(EMPTY_DIGESTS | ({have} if have else set()))
    cost = {d: 0 for d in starts}
    via: dict[str, Entry] = {}
    queue = [(0, i, d) for i, d in enumerate(starts)]
    counter = len(queue)
    settled: set[str] = set()
    while queue:
        c, _, node = heapq.heappop(queue)
        if node in settled:
            continue
        settled.add(node)
        for e in edges.get(node, ()):
            new_cost = c + link_cost(e)
            if new_cost < cost.get(e.target, new_cost + 1):
                cost[e.target] = new_cost
                via[e.target] = e
                counter += 1
                heapq.heappush(queue, (new_cost, counter, e.target))
    return Paths(cost, via)
