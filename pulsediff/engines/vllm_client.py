"""The caller's side of the vLLM backend: moving an engine to a step, offline or over HTTP.

The worker side (engines/vllm.py) verifies and loads; this side chooses the step, sets the weight
version, and keeps stale KV out of the answers. vLLM leaves resetting the prefix cache after an
update to the caller, and a cache that survives an update serves KV computed with the old
weights. So:

- `update_llm(llm, source, step=None, trust=None)`: an offline `vllm.LLM` made with
  `weight_transfer_config={"backend": "pulsediff"}`; start, update, finish with the step as the
  weight version, then `reset_prefix_cache()`.
- `prepare_llm(llm, source, step=None, trust=None)`: the same update, prepared ahead: every worker
  fetches, checks and decodes it on a thread of its own and the call returns at once; the engine
  goes on serving its current weights, and `update_llm` to that step then stops it for the load
  alone.
- `sync_server(url, source, ...)`: a running `vllm serve` (started with VLLM_SERVER_DEV_MODE=1,
  which enables its weight-transfer routes, and `--weight-transfer-config '{"backend":
  "pulsediff"}'`): pause (in-flight requests finish on the old weights, caches cleared), start,
  update, finish, reset the prefix cache, resume. `pulsediff vllm-sync` is this, once or in a loop.

The weight version is the step as a decimal string ("12"), or, for a lone patch file, its target
digest ("xxh3tree:..."; a patch URL's file name). Nothing here imports vLLM: the offline helper
only calls methods of the `llm` it is given, and the HTTP client is the standard library's.
"""

from __future__ import annotations

import http.client
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from pulsediff.errors import PulsediffError, UsageError

__all__ = ["Target", "resolve_target", "update_llm", "prepare_llm", "sync_server", "ServerClient"]


@dataclass(frozen=True)
class Target:
    step: int | None  # None for a lone patch file
    version: str  # the weight version the engine gets
    request: dict  # update_weights' update_info
    newest: int | None = None  # the series' newest step when it was read
    manifest: object = None  # the series' Manifest as read (None for a patch file): what a move will fetch

    def chain_bytes(self, version: str) -> int:
        """The bytes of the files a worker at weight version `version` fetches to reach this target
        (the cheapest chain, as the workers plan it; from an anchor when that version is no listed step)."""
        from pulsediff.format.manifest import cheapest_paths

        if self.manifest is None or self.step is None:
            return 0
        entries = self.manifest.entries
        have = next((e.target for e in entries if version.isdigit() and e.step == int(version)), None)
        goal = next(e.target for e in entries if e.step == self.step)
        paths = cheapest_paths(entries, have)
        return sum(e.bytes for e in paths.path_to(goal)) if paths.reaches(goal) else 0


def resolve_target(source: str, step: int | None = None, trust=None, trust_state=None, force: bool = False) -> Target:
    """Where `source` leads: for a series, `step` or its newest step, with the manifest read (and its
    signature checked under `trust`) here, so that a missing step is refused before the engine is
    asked; for a patch file, its target digest. The source must be readable here as well as by the
    engine's workers (the same path, or a URL): a relative path is sent as an absolute one, since a
    server's workers would read it from their own directory. `trust` (keys or files of them) is sent as
    the keys. `force`: weights the series does not list may be replaced with its step (HostState.advance)."""
    from pulsediff.engines.state import check_request_fits, classify_source, is_url, parse_update_request

    if not is_url(source):
        source = os.path.abspath(source)
    request: dict = {"source": source}
    if step is not None:
        request["step"] = step
    if force:
        request["force"] = True
    if trust:
        from pulsediff.series.signing import trusted_keys

        request["trust"] = list(trusted_keys(trust))  # files are read here: the workers take keys only
    parse_update_request(request)  # the same checks the workers make
    kind, where = classify_source(source)
    check_request_fits(kind, source, step, trust)
    if kind == "patch":
        if is_url(where):  # not fetched here: the workers fetch it
            return Target(None, Path(urllib.parse.urlsplit(where).path).name, request)
        from pulsediff.format.patch_file import read_patch_header

        return Target(None, read_patch_header(where).target_digest, request)
    from pulsediff.errors import CheckpointNotFoundError
    from pulsediff.series.catch_up import read_source_manifest, step_entry
    from pulsediff.series.remote import open_store
    from pulsediff.series.signing import as_trust

    store = open_store(where)
    try:
        manifest = read_source_manifest(store, as_trust(request.get("trust"), trust_state), record=False)
        if manifest is None or manifest.newest is None:
            raise CheckpointNotFoundError(store.shown("manifest.json"), "manifest")
        entry = step_entry(manifest, step, store.location)
    finally:
        store.close()
    request["step"] = entry.step  # the workers move to this step even if a newer one appears meanwhile
    return Target(entry.step, str(entry.step), request, manifest.newest.step, manifest)


def update_llm(llm, source: str, *, step: int | None = None, trust=None, trust_state=None,
               force: bool = False) -> Target:
    """Move an offline `vllm.LLM` (backend "pulsediff") to `step` of `source`; returns where it went.
    A refused update leaves the engine's weights and weight version as they were; an engine that failed
    while loading verified weights gets the weight version "undefined" (the next update loads every
    tensor). After `prepare_llm` of the same source the workers go on from what they prepared. Weights the
    series does not list (another run's, or a step it no longer keeps) are refused unless `force`."""
    target = resolve_target(source, step, trust, trust_state, force)
    llm.start_weight_update()
    try:
        llm.update_weights({"update_info": target.request})  # a worker that refuses leaves its session closed
    except Exception as exc:
        if UNDEFINED in str(exc):
            llm.update_weight_version(UNDEFINED_VERSION)
        text = " ".join(str(exc).split())
        if "pulsediff: " in text:  # a worker's refusal: its one line, not vLLM's wrapping of it
            raise PulsediffError(worker_line(text)) from exc
        raise
    llm.finish_weight_update(weight_version=target.version)
    llm.reset_prefix_cache()
    return target


def prepare_llm(llm, source: str, *, step: int | None = None, trust=None, trust_state=None,
                wait: bool = False, force: bool = False) -> Target:
    """Prepare the update `update_llm` would make, without changing what the engine serves: every worker
    verifies and decodes it in the background (engines/vllm.py, "prepare"). Call `update_llm` with the same
    source to take it. `wait`: return only when every worker's preparation has ended (vLLM runs no model
    step meanwhile). A preparation that fails is not reported here: the update does the whole work again,
    and refuses it with one line if it fails again."""
    target = resolve_target(source, step, trust, trust_state, force)
    llm.start_weight_update()
    llm.update_weights({"update_info": dict(target.request, prepare=True)})
    llm.finish_weight_update()  # no weight version: the engine's weights have not changed
    if wait:
        llm.collective_rpc(settle_prepared)
    return target


def settle_prepared(worker) -> str:
    """For `collective_rpc` (it runs in each worker): wait until the worker's preparation, if any, has
    ended; returns why it failed ("" when it did not, or none ran)."""
    engine = getattr(worker, "weight_transfer_engine", None)
    state = getattr(engine, "state", None)
    if state is None:
        return ""
    state.settle()
    return state.prepare_error


# -- a running `vllm serve` --------------------------------------------------------------------

# How engines/vllm.py ends its one line, so that it can be cut out of vLLM's wrapping of a worker error.
KEPT = "(the engine keeps its weights)"
UNDEFINED = "(the engine's weights are undefined: the next update loads every tensor)"
UNDEFINED_VERSION = "undefined"  # the weight version of an engine whose load failed part-way
ROUTES_HINT = ("start it with VLLM_SERVER_DEV_MODE=1 (which enables vLLM's weight-transfer routes) and "
               "--weight-transfer-config '{\"backend\": \"pulsediff\"}'")


class ServerTimeout(PulsediffError):
    """A route that did not answer in time: the server may still be at work."""


class ServerClient:
    """vLLM's weight-transfer routes (vllm/entrypoints/rl/online/api_router.py) over HTTP."""

    def __init__(self, url: str):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise UsageError(f"{url}: the server is an http:// or https:// URL, e.g. http://127.0.0.1:8000")
        self.url = url.rstrip("/")

    def call(self, method: str, route: str, body: dict | None = None, query: dict | None = None,
             timeout: float | None = 60.0) -> dict:
        """One route; its JSON answer (an object, else {}). `timeout` None: wait as long as it takes."""
        url = self.url + route + ("?" + urllib.parse.urlencode(query) if query else "")
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method,
                                         headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                raw = response.read(1 << 20)
        except urllib.error.HTTPError as exc:
            detail = _detail(exc.read(1 << 16))
            if exc.code == 404:
                raise PulsediffError(f"{self.url} has no {route} route: {ROUTES_HINT}") from None
            raise PulsediffError(f"{route} failed ({exc.code}){': ' + detail if detail else ''}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:  # TimeoutError is an OSError
            reason = getattr(exc, "reason", None) or exc
            if isinstance(reason, TimeoutError):
                raise ServerTimeout(f"the vLLM server at {self.url} did not answer {route} in {timeout:.0f} s") from None
            raise PulsediffError(f"cannot reach the vLLM server at {self.url} ({reason})") from None
        try:
            answer = json.loads(raw) if raw else {}
        except ValueError:
            return {}
        return answer if isinstance(answer, dict) else {}

    def weight_version(self) -> str:
        version = self.call("GET", "/weight_info").get("weight_version")
        return version if isinstance(version, str) else ""

    def reset_prefix_cache(self) -> None:
        try:
            self.call("POST", "/reset_prefix_cache")
        except PulsediffError as exc:  # pause cleared the caches already; this second clear is a safeguard
            if "no /reset_prefix_cache route" not in str(exc):
                raise


def _detail(body: bytes) -> str:
    """The error a FastAPI route answered with, as one line."""
    text = body.decode("utf-8", "replace").strip()
    try:
        got = json.loads(text)
        if isinstance(got, dict):
            text = str(got.get("detail") or got.get("error") or got.get("message") or text)
    except ValueError:
        pass
    return worker_line(" ".join(text.split()))[:1000]


def worker_line(text: str) -> str:
    """A worker's own line (engines/vllm.py's "pulsediff: ... (the engine keeps its weights)") cut out of
    vLLM's wrapping of it ("...'<line>', please check the stack trace ..."); other text as it is."""
    if "pulsediff: " in text:
        text = text[text.index("pulsediff: ") + len("pulsediff: "):]
        for ending in (KEPT, UNDEFINED):
            if ending in text:
                text = text[:text.index(ending) + len(ending)]
    return text


@dataclass(frozen=True)
class SyncResult:
    status: str  # "updated" or "up-to-date"
    version: str
    before: str
    seconds: float  # how long generation was paused
    prepared_ahead: float = 0.0  # seconds between the preparation's start and the pause (0: not prepared)
    bytes: int = 0  # what each worker fetched (the chain's files; 0 for a lone patch file or no move)
    lag: int = 0  # steps between the one reached and the series' newest when it was read


def sync_server(url: str, source: str, *, step: int | None = None, trust=None, trust_state=None,
                client: ServerClient | None = None, prepare_ahead: float = 0.0, force: bool = False) -> SyncResult:
    """Move a running `vllm serve` to `step` (default: the newest) of `source`. The server's
    generation is paused (in-flight requests finish first, caches cleared) for the update, and
    resumed whatever happens; a refused update leaves the engine serving its old weights.

    `prepare_ahead` (seconds): first have the workers prepare the update in the background (fetch,
    checks and decode, while the server goes on generating), and pause that long after: the pause
    then lasts for the load alone if the preparation has ended by then, and for what is left of it if
    not. `force`: as update_llm's."""
    client = client or ServerClient(url)
    target = resolve_target(source, step, trust, trust_state, force)
    before = client.weight_version()
    if before == target.version:
        return SyncResult("up-to-date", before, before, 0.0)
    prepared_at = None
    if prepare_ahead > 0:
        prepared_at = time.perf_counter()
        client.call("POST", "/start_weight_update")
        client.call("POST", "/update_weights", {"update_info": dict(target.request, prepare=True)}, timeout=None)
        client.call("POST", "/finish_weight_update", {})
        time.sleep(prepare_ahead)
    start = time.perf_counter()
    # No time limit on pausing (in-flight requests finish first) nor on the update (it may fetch an anchor):
    # resuming while the workers still write would serve half-written weights.
    try:
        client.call("POST", "/pause", query={"mode": "wait", "clear_cache": "true"}, timeout=None)
        client.call("POST", "/start_weight_update")
        try:
            client.call("POST", "/update_weights", {"update_info": target.request}, timeout=None)
        except PulsediffError as exc:
            if UNDEFINED in str(exc):
                client.call("POST", "/update_weight_version", {"new_version": UNDEFINED_VERSION})
            raise
        client.call("POST", "/finish_weight_update", {"weight_version": target.version})
        client.reset_prefix_cache()
    except BaseException as exc:
        try:
            client.call("POST", "/resume")
        except PulsediffError as also:  # say both: the update's error first
            raise PulsediffError(f"{exc}; and the server could not be resumed: {also}") from None
        raise
    client.call("POST", "/resume")
    lag = target.newest - target.step if target.newest is not None and target.step is not None else 0
    return SyncResult("updated", target.version, before, time.perf_counter() - start,
                      0.0 if prepared_at is None else start - prepared_at, target.chain_bytes(before), lag)
