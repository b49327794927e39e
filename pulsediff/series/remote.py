"""Remote series: `ObjectStoreSource` reaches S3 (`s3://bucket/prefix`) and HTTP(S) base URLs
through obstore, and downloads into a cache folder:

- only the files asked for, in parallel (FETCH_THREADS), each in one GET;
- into a hidden `.NAME.part` file, locked while written, renamed to NAME
  only after its size and `check` pass: a file under its real name in the
  cache has been checked, and is checked again before each use, through a
  hard link of this process's own (another catch-up on the same cache may
  remove the name once it has applied the file);
- a `.part` left by a dropped connection or a killed run is resumed with a
  Range request; a server that ignores the range, or a resumed file that
  fails its check, is fetched once more from the start;
- never more than the manifest's size is written: a longer object is refused
  when its extra byte arrives, a shorter one is "incomplete";
- a 404 is "missing"; any other failure that outlasts the retries (a 5xx, a
  body reset again and again, a server that went away) makes the object
  unavailable the same way, with its reason, and keeps the `.part` for the
  next run: catch-up then takes another chain where one is intact, and stops
  with one line naming the failures where none is. Only a refusal (access
  denied) stops it at once: no other object would be served either.

Why obstore (not fsspec+s3fs, not boto3): see README "Series over S3 and HTTP".

`open_store` turns a command line's DEST or SOURCE (a folder, `s3://...`, `http(s)://...`) into a
Store: the one place that knows every kind.
"""

from __future__ import annotations

import configparser
import fcntl
import hashlib
import importlib.util
import os
import re
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from urllib.parse import quote, urlsplit

from pulsediff.io.atomic import TMP_SUFFIX, output_error, remove_stale_temporaries, temp_prefix
from pulsediff.errors import (CheckpointNotFoundError, FetchError, InvalidManifestError, MissingExtraError,
                              PublishConflictError, PulsediffError, UsageError)
from pulsediff.format.manifest import MANIFEST, MAX_MANIFEST_BYTES, PATCH_SUFFIX, Entry, Manifest
from pulsediff.runtime.progress import SILENT, Progress
from pulsediff.series.store import Check, Folder, Store

FETCH_THREADS = 8  # files downloaded at once: enough to fill a link, few enough for a small worker
CHUNK = 64 << 10  # bytes per write to the cache file: what a dropped connection can lose, at most
IN_RUN_RESUMES = 2  # a connection that drops mid-file is resumed this often before catch-up gives up
SINGLE_PUT_LIMIT = 256 << 20  # larger files go up in parts (conditional puts are single requests, held in memory)
PART_SUFFIX = ".part"
REMOTE_SCHEMES = ("s3", "http", "https")
REMOTE_EXTRA = "pip install 'pulsediff[remote]'"


def is_remote(spec: str | os.PathLike) -> bool:
    return isinstance(spec, str) and re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", spec) is not None


_DEFAULT_PORTS = {"http": 80, "https": 443}


def url_identity(url: str) -> str:
    """One spelling per remote series, under which a signed series' rollback record is kept: the scheme
    and host in lower case (both are case-insensitive), no user name or password, no default port, no
    query, and the path without empty or '.' segments, '..' resolved, no trailing slash (s3://b/x/,
    s3://b//x, s3://B/x and https://h/a/../x?token=1 against https://h/x are one series each). Another
    spelling of one series would start a fresh record, and the record is what refuses a replayed older
    manifest; two series merged under one spelling only make a worker refuse more, never accept more."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise UsageError(f"{url}: not a URL pulsediff can read ({exc})") from None
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"  # an IPv6 literal keeps its brackets
    netloc = host if port in (None, _DEFAULT_PORTS.get(scheme)) else f"{host}:{port}"
    segments: list[str] = []
    for part in parts.path.split("/"):
        if part == "..":
            if segments:
                segments.pop()
        elif part not in ("", "."):
            segments.append(part)
    return f"{scheme}://{netloc}" + "".join("/" + part for part in segments)


def open_store(spec: "str | os.PathLike | Store", *, cache: Path | None = None) -> "Store":
    """The store a command-line DEST or SOURCE names: `s3://bucket/prefix`, `http(s)://...`, else a folder."""
    if isinstance(spec, Store):
        return spec
    if not is_remote(spec):
        return Folder(Path(spec))
    scheme = spec.split("://", 1)[0].lower()
    if scheme not in REMOTE_SCHEMES:
        raise UsageError(f"{spec}: unsupported URL scheme {scheme}://; use a folder, s3://, http:// or https://")
    if importlib.util.find_spec("obstore") is None:
        raise MissingExtraError(f"{spec} (a remote series)", "obstore", "remote")  # exit 1: the command is right
    return ObjectStoreSource(spec, cache)


def series_source(spec: "str | os.PathLike | Store", *, cache: Path | None = None) -> "Store":
    """open_store for a series to read: a path or URL that names the series' manifest.json (what a
    user copies from a listing) stands for its folder, as `vllm-sync` takes it."""
    if isinstance(spec, Store):
        return spec
    if is_remote(spec):
        parts = urlsplit(spec)
        if parts.path.endswith("/" + MANIFEST) and not parts.query and not parts.fragment:
            spec = spec[: -len("/" + MANIFEST)]
    elif Path(spec).name == MANIFEST and not Path(spec).is_dir():
        spec = Path(spec).parent
    return open_store(spec, cache=cache)


def default_cache(url: str) -> Path:
    """~/.cache/pulsediff/<host>-<hash of the URL>: one folder per source."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pulsediff"
    host = re.sub(r"[^A-Za-z0-9.-]", "_", urlsplit(url).netloc)[:64] or "source"
    return root / f"{host}-{hashlib.sha256(url.rstrip('/').encode()).hexdigest()[:16]}"


def _reason(exc: BaseException) -> str:
    """obstore's errors carry a multi-line debug dump: keep the first line, without the request id noise."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"<\?xml.*", "", text).rstrip(": ")
    return text[:300]


def _aws_profile() -> dict[str, str]:
    """Static credentials, region and endpoint of AWS_PROFILE (or [default]) from the shared AWS files.

    obstore reads the AWS_* environment variables itself, but not these files;
    a profile that needs more (SSO, assume-role) must be turned into
    environment variables, e.g. `eval "$(aws configure export-credentials --format env)"`.
    """
    profile = os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE") or "default"
    found: dict[str, str] = {}
    files = [(os.environ.get("AWS_CONFIG_FILE") or Path.home() / ".aws" / "config",
              profile if profile == "default" else f"profile {profile}"),
             (os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or Path.home() / ".aws" / "credentials", profile)]
    for path, section in files:
        parser = configparser.RawConfigParser()
        try:
            parser.read(path)
        except (configparser.Error, OSError, UnicodeDecodeError):
            continue
        if parser.has_section(section):
            found.update({k: v.strip() for k, v in parser.items(section)})
    keys = {"aws_access_key_id": "access_key_id", "aws_secret_access_key": "secret_access_key",
            "aws_session_token": "session_token", "region": "region", "endpoint_url": "endpoint"}
    return {ours: found[theirs] for theirs, ours in keys.items() if found.get(theirs)}


_ENV_FOR = {"region": ("AWS_REGION", "AWS_DEFAULT_REGION"),
            "endpoint": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")}


def _s3_config() -> tuple[dict, bool]:
    """(config for obstore beyond what it reads from the environment, whether the endpoint is plain http).

    As the AWS tools do, keys in the environment win over the profile's, and
    they come as a set: never one from each.
    """
    profile = _aws_profile()
    config = {}
    if not os.environ.get("AWS_ACCESS_KEY_ID"):
        config.update({k: profile[k] for k in ("access_key_id", "secret_access_key", "session_token") if k in profile})
    for key in ("region", "endpoint"):
        if key in profile and not any(os.environ.get(env) for env in _ENV_FOR[key]):
            config[key] = profile[key]
    endpoint = next((os.environ[e] for e in _ENV_FOR["endpoint"] if os.environ.get(e)), config.get("endpoint", ""))
    return config, endpoint.lower().startswith("http://")


@dataclass
class _Fetched:
    problem: str | None
    fresh: bool  # downloaded whole in this call (not resumed, not found in the cache)


def _too_large(where: str, limit: int) -> PulsediffError:
    return PulsediffError(f"{where} is larger than {limit} bytes")


class ObjectStoreSource(Store):
    """An S3 prefix or an HTTP(S) base URL, read (and for S3 written) with obstore."""

    remote = True

    def __init__(self, url: str, cache: Path | None = None):
        from obstore.store import HTTPStore, S3Store

        self.location = url
        self.url = url.rstrip("/")
        self.identity = url_identity(url)
        self.scheme = url.split("://", 1)[0].lower()
        self.cache = Path(cache) if cache is not None else default_cache(url)
        self._staging: Path | None = None
        self._manifest: tuple[str, bytes] | None = None  # (etag, bytes) of the manifest last read or written
        self._stop = threading.Event()
        self._use: dict[str, Path] = {}  # name -> this process's own hard link to the checked file
        client = {"connect_timeout": "10s", "read_timeout": "60s", "timeout": "24h"}  # a stall, not a slow link, fails
        retry = {"max_retries": 3, "retry_timeout": timedelta(seconds=30),
                 "backoff": {"init_backoff": timedelta(milliseconds=200), "max_backoff": timedelta(seconds=5), "base": 2}}
        if self.scheme == "s3":
            parts = urlsplit(url)
            if not parts.netloc:
                raise UsageError(f"{url}: an S3 URL names a bucket: s3://bucket/prefix")
            config, plain_http = _s3_config()
            self.store = S3Store(parts.netloc, prefix=parts.path.strip("/") or None, config=config,
                                 client_options={**client, "allow_http": plain_http}, retry_config=retry)
        else:
            self.store = HTTPStore.from_url(self.url, client_options={**client, "allow_http": self.scheme == "http"},
                                            retry_config=retry)

    def where(self, name: str) -> str:
        return f"{self.url}/{quote(name)}"

    # -- the manifest

    def read_manifest_bytes(self) -> bytes | None:
        import obstore as obs
        from obstore.exceptions import NotModifiedError

        where = self.where(MANIFEST)
        options = {"if_none_match": self._manifest[0]} if self._manifest and self._manifest[0] else {}
        try:
            result = obs.get(self.store, MANIFEST, options=options)
            if result.meta["size"] > MAX_MANIFEST_BYTES:  # said by the server: a shortcut, not the check below
                raise InvalidManifestError(where, f"larger than {MAX_MANIFEST_BYTES} bytes")
            data = bytearray()
            for chunk in result.stream(CHUNK):
                data += chunk
                if len(data) > MAX_MANIFEST_BYTES:
                    raise InvalidManifestError(where, f"larger than {MAX_MANIFEST_BYTES} bytes")
            self._manifest = (result.meta.get("e_tag") or "", bytes(data))
        except NotModifiedError:
            pass  # the copy we hold is current
        except Exception as exc:
            if _is_network_error(exc) and _is_missing(exc):
                self._manifest = None
                return None
            raise self._failure(f"cannot read {where}", exc) from None
        return self._manifest[1]

    def read_signature(self) -> bytes | None:
        from pulsediff.series.signing import MAX_SIGNATURE_BYTES, SIGNATURE_NAME

        return self.read_object(SIGNATURE_NAME, MAX_SIGNATURE_BYTES, missing_ok=True,
                                too_large=lambda where, limit: InvalidManifestError(where, f"larger than {limit} bytes"))

    def read_object(self, name: str, limit: int, *, missing_ok: bool = False, too_large=_too_large) -> bytes | None:
        """One object's bytes, read whole into memory (at most `limit`, checked as they arrive; past it,
        the error `too_large(where, limit)` makes). A missing object: None with `missing_ok`, else
        CheckpointNotFoundError."""
        import obstore as obs

        where = self.where(name)
        try:
            data = bytearray()
            for chunk in obs.get(self.store, name).stream(CHUNK):
                data += chunk
                if len(data) > limit:
                    raise too_large(where, limit)
        except Exception as exc:
            if _is_network_error(exc) and _is_missing(exc):
                if missing_ok:
                    return None
                raise CheckpointNotFoundError(where, "file") from None
            raise self._failure(f"cannot read {where}", exc) from None
        return bytes(data)

    def _failure(self, what: str, exc: Exception) -> PulsediffError:
        if isinstance(exc, PulsediffError):
            return exc
        if not _is_network_error(exc):
            raise exc
        return FetchError(f"{what}: {_reason(exc)}")

    # -- publishing (S3 only)

    def writable(self) -> None:
        if self.scheme != "s3":
            raise UsageError(f"{self.location}: an http(s) URL is read-only; publish to a folder or to s3:// "
                             f"and serve that over HTTP")

    def staging(self) -> Path:
        """One shared folder in the temp dir: staged names carry host and pid (atomic.temp_prefix), so the
        first publish after a killed one removes what the killed one left."""
        self.writable()
        if self._staging is None:
            folder = Path(tempfile.gettempdir()) / f"pulsediff-publish-{os.getuid()}"  # one per user: /tmp is shared
            try:
                folder.mkdir(exist_ok=True)
            except OSError as exc:
                raise output_error(folder, exc) from None
            remove_stale_temporaries(folder)
            self._staging = folder
        return self._staging

    def commit(self, staged: list[tuple[Path, str]]) -> None:
        """Upload each file unless the same bytes are there already; never replace other bytes.

        A create-only put (If-None-Match: *) where the store honours it, and a
        look before it for stores that ignore the condition (rclone serve s3):
        an object left by a killed run of this publish is the same file again
        (patches are deterministic) and is kept; anything else is a conflict.
        """
        import obstore as obs
        from obstore.exceptions import AlreadyExistsError, NotSupportedError, PreconditionError

        self.writable()
        for tmp, name in staged:
            where = self.where(name)
            try:
                if self._head(name) is not None:
                    self._same_or_conflict(name, tmp)
                    tmp.unlink(missing_ok=True)
                    continue
                size = tmp.stat().st_size
                try:
                    if size <= SINGLE_PUT_LIMIT:
                        obs.put(self.store, name, tmp, mode="create")
                    else:
                        obs.put(self.store, name, tmp)  # multipart: no condition; the look above must do
                except (AlreadyExistsError, PreconditionError):
                    self._same_or_conflict(name, tmp)
                except NotSupportedError:
                    obs.put(self.store, name, tmp, use_multipart=size > SINGLE_PUT_LIMIT)
            except PulsediffError:
                raise
            except Exception as exc:
                raise self._failure(f"cannot upload {where}; the manifest does not name it yet", exc) from None
            tmp.unlink(missing_ok=True)

    def _head(self, name: str) -> dict | None:
        import obstore as obs

        try:
            return obs.head(self.store, name)
        except Exception as exc:
            if _is_network_error(exc) and _is_missing(exc):
                return None
            raise

    def _same_or_conflict(self, name: str, local: Path) -> None:
        import obstore as obs

        conflict = PublishConflictError(f"{self.where(name)} exists with other content: is another publisher "
                                        f"writing to {self.location}? Nothing was overwritten")
        size = local.stat().st_size
        if self._head(name)["size"] != size:
            raise conflict
        with open(local, "rb") as f:
            for chunk in obs.get(self.store, name).stream(CHUNK):
                if f.read(len(chunk)) != bytes(chunk):
                    raise conflict

    def save_manifest(self, manifest: Manifest, signature: bytes | None = None) -> None:
        """Replace the manifest only if it is still the one this publish read (If-Match on its ETag); its
        signature, when given, is put just before (a reader between the two sees a pair that does not
        match and reads again)."""
        import obstore as obs
        from obstore.exceptions import AlreadyExistsError, NotSupportedError, PreconditionError

        from pulsediff.series.signing import SIGNATURE_NAME

        self.writable()
        where = self.where(MANIFEST)
        data = manifest.to_bytes()
        etag = self._manifest[0] if self._manifest else None
        conflict = PublishConflictError(f"{where} changed since this publish read it: is another publisher "
                                        f"writing to {self.location}? The manifest was not replaced")
        try:
            now = self._head(MANIFEST)  # for stores that ignore the condition below
            if (now.get("e_tag") if now else None) != etag and not (now is None and etag is None):
                raise conflict
            if signature is not None:
                obs.put(self.store, SIGNATURE_NAME, signature)
            mode = {"e_tag": etag} if etag else "create"
            try:
                put = obs.put(self.store, MANIFEST, data, mode=mode)
            except (AlreadyExistsError, PreconditionError):
                raise conflict from None
            except NotSupportedError:
                put = obs.put(self.store, MANIFEST, data)
        except PulsediffError:
            raise
        except Exception as exc:
            raise self._failure(f"cannot write {where}", exc) from None
        self._manifest = (put.get("e_tag") or "", data)

    def save_signature(self, signature: bytes) -> None:
        import obstore as obs

        from pulsediff.series.signing import SIGNATURE_NAME

        self.writable()
        try:
            obs.put(self.store, SIGNATURE_NAME, signature)
        except Exception as exc:
            raise self._failure(f"cannot write {self.where(SIGNATURE_NAME)}", exc) from None

    def delete(self, names: list[str]) -> None:
        import obstore as obs

        self.writable()
        for name in names:
            try:
                obs.delete(self.store, name)
            except Exception as exc:
                if _is_network_error(exc) and _is_missing(exc):
                    continue
                raise self._failure(f"cannot delete {self.where(name)}", exc) from None

    def close(self) -> None:
        self._staging = None  # publish removed its staged files; the shared folder stays
        for link in self._use.values():
            link.unlink(missing_ok=True)
        self._use.clear()

    # -- catching up

    def path(self, name: str) -> Path:
        return self._use.get(name, self.cache / name)

    def _own_link(self, src: Path, name: str) -> Path:
        """A hard link to `src` that only this process uses (and removes): another catch-up on the same cache
        may delete the shared name once it has applied it, and this one must still read what it checked.
        Its name carries host and pid, so a killed process's links are swept like its temporaries."""
        link = self.cache / f"{temp_prefix(self.cache / name)}use{TMP_SUFFIX}"
        link.unlink(missing_ok=True)
        os.link(src, link)
        return link

    def fetch(self, entries: list[Entry], check: Check, progress: Progress = SILENT) -> dict[str, str]:
        """Download and check `entries` in parallel; {name: problem} for those that cannot be used."""
        if not entries:
            return {}
        try:
            self.cache.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise FetchError(f"cannot create the cache folder {self.cache}: {exc.strerror or exc}") from None
        remove_stale_temporaries(self.cache)
        lock = threading.Lock()

        def advance(n: int, files: int = 0) -> None:
            with lock:
                progress.advance(n, files)

        total = sum(e.bytes for e in entries)
        progress.begin("fetching", total, len(entries), unit="files")
        self._stop.clear()
        try:
            with ThreadPoolExecutor(min(FETCH_THREADS, len(entries))) as pool:
                futures = [pool.submit(self._fetch_checked, e, check, advance) for e in entries]
                try:
                    results = [f.result() for f in futures]
                except BaseException:  # Ctrl-C or a failed fetch: the other downloads stop at their next chunk
                    self._stop.set()
                    raise
        finally:
            progress.end()
        return {e.file: why for e, why in zip(entries, results) if why is not None}

    def _fetch_checked(self, e: Entry, check: Check, advance) -> str | None:
        final = self.path(e.file)
        part = self.cache / f".{e.file}{PART_SUFFIX}"
        with _locked(part) as f:  # another catch-up on this cache waits here, then finds the file done
            try:
                mine = self._own_link(final, e.file)  # checked when it arrived; checked again before each use
            except FileNotFoundError:
                mine = None
            if mine is not None:
                advance(e.bytes, 0)
                problem = self._check(mine, e, check, fresh=False)
                if problem is None:
                    self._use[e.file] = mine
                    advance(0, 1)
                    _drop_if_empty(part, f)
                    return None
                mine.unlink(missing_ok=True)
                final.unlink(missing_ok=True)
                advance(-e.bytes, 0)
            for restart in (False, True):
                got = self._download(e, f, advance, restart=restart)
                problem = got.problem or self._check(part, e, check, fresh=got.fresh)
                if problem is None:
                    self._use[e.file] = self._own_link(part, e.file)
                    os.replace(part, final)
                    advance(0, 1)
                    return None
                if got.problem is not None:  # missing, incomplete (kept, to resume), or longer (already cut)
                    break
                _write(f, None, 0)
                advance(-e.bytes, 0)
                if got.fresh:
                    break  # fetched whole just now and damaged: the object is
            _drop_if_empty(part, f)
            return problem

    def _check(self, path: Path, e: Entry, check: Check, fresh: bool) -> str | None:
        """`check`, where a file we did not download whole just now is only suspect, never proof of a lie."""
        try:
            return check(path, e)
        except InvalidManifestError:
            if fresh:
                raise
            return "stale in the cache"

    def _download(self, e: Entry, f, advance, restart: bool) -> _Fetched:
        """Bring the locked `.part` file `f` to e.bytes bytes: resumed where it ends, or from the start."""
        import obstore as obs
        from obstore.exceptions import PermissionDeniedError, UnauthenticatedError

        where = self.where(e.file)
        have = os.fstat(f.fileno()).st_size
        if restart or have > e.bytes:
            _write(f, None, 0)
            have = 0
        fresh = have == 0
        advance(have, 0)
        resumes = 0
        while have < e.bytes:
            offset = have
            try:
                result = None
                if offset:
                    try:
                        result = obs.get(self.store, e.file, options={"range": {"offset": offset}})
                        if result.range[0] != offset:
                            result = None
                    except Exception as exc:  # no usable range support (rclone serve s3 answers 200), or no server
                        if not _is_network_error(exc) or _is_missing(exc):
                            raise
                    if result is None:  # then the whole object, once more; the part goes once it is coming
                        result = obs.get(self.store, e.file)
                        _write(f, None, 0)
                        advance(-have, 0)
                        have = offset = 0
                        fresh = True
                else:
                    result = obs.get(self.store, e.file)
                for chunk in result.stream(CHUNK):
                    if self._stop.is_set():
                        raise FetchError(f"stopped fetching {where}")
                    if len(chunk) > e.bytes - have:
                        _write(f, None, 0)
                        advance(-have, 0)
                        return _Fetched(f"the object at {where} is larger than the manifest's {e.bytes} bytes", fresh)
                    _write(f, chunk, have)
                    have += len(chunk)
                    advance(len(chunk), 0)
                if have < e.bytes:
                    return _Fetched(f"incomplete: {where} holds {have} of {e.bytes} bytes", fresh)
            except PulsediffError:
                raise
            except Exception as exc:
                if not _is_network_error(exc):
                    raise
                if _is_missing(exc):
                    return _Fetched("missing", fresh)
                if isinstance(exc, (PermissionDeniedError, UnauthenticatedError)):
                    raise FetchError(f"{where}: access denied ({_reason(exc)})") from None
                if have > offset and resumes < IN_RUN_RESUMES:  # it was moving: pick up where it broke
                    resumes += 1
                    continue
                # Past the retries: this object is unavailable, like a 404 (a 5xx, a body reset again and
                # again, an object a server's cache lost), so the planner tries another chain, an anchor's
                # say. Only when none is left does catch-up stop, naming this as the reason.
                kept = f"; {have} of {e.bytes} bytes are kept in {self.cache} for the next catch-up to resume" \
                    if have else ""
                return _Fetched(f"cannot fetch {where}: {_reason(exc)}{kept}", fresh)
        try:
            f.flush()  # buffered: the checks read the file by its name
            os.fsync(f.fileno())
        except OSError as exc:
            raise FetchError(f"cannot write {f.name}: {exc.strerror or exc}") from None
        return _Fetched(None, fresh)

    def forget(self, names: list[str], listed: set[str]) -> None:
        """The cache holds downloads, not a mirror (an anchor is nearly a checkpoint's size): drop what was
        applied, and what the manifest no longer lists (pruned by the publisher), unless another catch-up
        is downloading it (its .part is locked: that one may have read a newer manifest)."""
        self.close()
        try:
            present = os.listdir(self.cache)
        except OSError:
            return
        done = set(names)
        for name in present:
            if name.startswith(".") and name.endswith(PATCH_SUFFIX + PART_SUFFIX):
                if name[1:-len(PART_SUFFIX)] not in listed:
                    _remove_unlocked(self.cache / name)
            elif name.endswith(PATCH_SUFFIX) and not name.startswith(".") and (name in done or name not in listed):
                (self.cache / name).unlink(missing_ok=True)
        try:  # nothing left: no empty folder per source in the cache (only an empty one goes)
            self.cache.rmdir()
        except OSError:
            pass


@contextmanager
def _locked(part: Path):
    """The cache's `.part` file, opened and locked; the one at that name when the lock is ours (a catch-up
    that held it may have renamed it to the finished file meanwhile)."""
    while True:
        try:
            fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # the folder, emptied, was removed by another catch-up's forget: again
            try:
                part.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise FetchError(f"cannot create the cache folder {part.parent}: {exc.strerror or exc}") from None
            continue
        except OSError as exc:
            raise FetchError(f"cannot write {part}: {exc.strerror or exc}") from None
        f = os.fdopen(fd, "r+b")
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            same = os.stat(part).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        f.close()
    with f:
        yield f


def _remove_unlocked(part: Path) -> None:
    try:
        fd = os.open(part, os.O_RDWR)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        part.unlink(missing_ok=True)
    except OSError:
        pass  # locked: being downloaded
    finally:
        os.close(fd)


def _drop_if_empty(part: Path, f) -> None:
    if os.fstat(f.fileno()).st_size == 0:
        part.unlink(missing_ok=True)


def _write(f, chunk, at: int) -> None:
    """Write `chunk` at offset `at` of the cache file (None: cut the file to `at` bytes); a full disk is one line."""
    try:
        if chunk is None:
            f.flush()
            f.truncate(at)
        else:
            f.seek(at)
            f.write(chunk)
    except OSError as exc:
        raise FetchError(f"cannot write {f.name}: {exc.strerror or exc}") from None


def _is_network_error(exc: BaseException) -> bool:
    """An error from obstore (it raises its own classes, and built-in OSErrors such as FileNotFoundError)."""
    from obstore.exceptions import BaseError

    return isinstance(exc, (BaseError, OSError))


def _is_missing(exc: BaseException) -> bool:
    from obstore.exceptions import NotFoundError

    return isinstance(exc, (NotFoundError, FileNotFoundError))
