"""The caller's side of the vLLM backend: moving an engine to a step, offline or over HTTP.

The worker side (engines/vllm.py) verifies and loads; this side chooses the step, sets the weight
version, and keeps stale KV out of the answers. vLLM leaves resetting the prefix cache after an
update to the caller, and a cache that survives an update serves KV computed with the old
weights. So:

- `update_llm(llm, source, step=None, trust=None)`: an offline `vllm.LLM` made with
  `weight_transfer_config={"backend": "pulsediff"}`; start, update, finish with the step as the
  weight version, then `reset_prefix_cache()`.
- `sync_server(url, source, ...)`: a running `vllm serve` (started with VLLM_SERVER_DEV_MODE=1,
  which enables its weight-transfer routes, and `--weight-transfer-config '{"backend":
  "pulsediff"}'`): pause (in-flight requests finish on the old weights, caches cleared), start,
  update, finish, reset the prefix cache, resume. `pulsediff vllm-sync` is this, once or in a loop.

The weight version is the step as a decimal string ("12"), or, for a lone patch file, its target
digest ("xxh128:..."; a patch URL's file name). Nothing here imports vLLM: the offline helper
only calls methods of the `llm` it is given, and the HTTP client is the standard library's.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from pulsediff.errors import PulsediffError, UsageError

__all__ = ["Target", "resolve_target", "update_llm", "sync_server", "ServerClient"]


@dataclass(frozen=True)
class Target:
    step: int | None  # None for a lone patch file
    version: str  # the weight version the engine gets
    request: dict  # update_weights' update_info


def resolve_target(source: str, step: int | None = None, trust=None, trust_state=None) -> Target:
    """Where `source` leads: for a series, `step` or its newest step, with the manifest read (and its
    signature checked under `trust`) here, so that a missing step is refused before the engine is
    asked; for a patch file, its target digest."""
    from pulsediff.engines.state import parse_update_request

    request = {"source": source}
    if step is not None:
        request["step"] = step
    if trust:
        request["trust"] = [trust] if isinstance(trust, str) else list(trust)
    parse_update_request(request)  # the same checks the workers make
    kind, where = _source_kind(source)
    if kind == "patch":
        if step is not None or trust:
            raise UsageError(f"{source} is one patch file: --step and --trust need a published series")
        from pulsediff.format.patch_file import read_patch_header

        digest = read_patch_header(where).target_digest if isinstance(where, Path) else None
        version = digest or Path(urllib.parse.urlsplit(source).path).name
        return Target(None, version, request)
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
    return Target(entry.step, str(entry.step), request)


def _source_kind(source: str) -> tuple[str, "str | Path"]:
    """Like engines.state.classify_source, without fetching a patch URL."""
    from pulsediff.series.remote import is_remote

    if is_remote(source):
        return ("patch", source) if source.split("?", 1)[0].endswith(".pulsediff") else ("series", source.rstrip("/"))
    path = Path(source)
    if path.name == "manifest.json":
        return "series", str(path.parent)
    if path.is_dir():
        return "series", source
    if path.is_file():
        return "patch", path
    raise PulsediffError(f"{source}: no such patch file or series folder")


def update_llm(llm, source: str, *, step: int | None = None, trust=None, trust_state=None) -> Target:
    """Move an offline `vllm.LLM` (backend "pulsediff") to `step` of `source`; returns where it went.
    On an error nothing changed: the engine keeps its weights and its weight version."""
    target = resolve_target(source, step, trust, trust_state)
    llm.start_weight_update()
    llm.update_weights({"update_info": target.request})  # a worker that refuses leaves its session closed
    llm.finish_weight_update(weight_version=target.version)
    llm.reset_prefix_cache()
    return target


# -- a running `vllm serve` --------------------------------------------------------------------

# How engines/vllm.py ends its one line, so that it can be cut out of vLLM's wrapping of a worker error.
KEPT = "(the engine keeps its weights)"
UNDEFINED = "(the engine's weights are undefined: the next update loads every tensor)"
ROUTES_HINT = ("start it with VLLM_SERVER_DEV_MODE=1 (which enables vLLM's weight-transfer routes) and "
               "--weight-transfer-config '{\"backend\": \"pulsediff\"}'")


class ServerClient:
    """vLLM's weight-transfer routes (vllm/entrypoints/rl/online/api_router.py) over HTTP."""

    def __init__(self, url: str, timeout: float = 600.0):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise UsageError(f"{url}: the server is an http:// or https:// URL, e.g. http://127.0.0.1:8000")
        self.url = url.rstrip("/")
        self.timeout = timeout

    def call(self, method: str, route: str, body: dict | None = None, query: dict | None = None) -> dict:
        url = self.url + route + ("?" + urllib.parse.urlencode(query) if query else "")
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method,
                                         headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                raw = response.read(1 << 20)
        except urllib.error.HTTPError as exc:
            detail = _detail(exc.read(1 << 16))
            if exc.code == 404:
                raise PulsediffError(f"{self.url} has no {route} route: {ROUTES_HINT}") from None
            raise PulsediffError(f"{route} failed ({exc.code}){': ' + detail if detail else ''}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise PulsediffError(f"cannot reach the vLLM server at {self.url} ({reason})") from None
        try:
            return json.loads(raw) if raw else {}
        except ValueError:
            return {}

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
    text = " ".join(text.split())
    if "pulsediff: " in text:  # the worker's own line, inside vLLM's wrapping ("...'<line>', please check ...")
        text = text[text.index("pulsediff: ") + len("pulsediff: "):]
        for ending in (KEPT, UNDEFINED):
            if ending in text:
                text = text[:text.index(ending) + len(ending)]
    return text[:1000]


@dataclass(frozen=True)
class SyncResult:
    status: str  # "updated" or "up-to-date"
    version: str
    before: str
    seconds: float


def sync_server(url: str, source: str, *, step: int | None = None, trust=None, trust_state=None,
                init: dict | None = None, client: ServerClient | None = None) -> SyncResult:
    """Move a running `vllm serve` to `step` (default: the newest) of `source`. The server's
    generation is paused (in-flight requests finish first, caches cleared) for the update, and
    resumed whatever happens; a refused update leaves the engine serving its old weights."""
    client = client or ServerClient(url)
    target = resolve_target(source, step, trust, trust_state)
    before = client.weight_version()
    if before == target.version:
        return SyncResult("up-to-date", before, before, 0.0)
    start = time.perf_counter()
    client.call("POST", "/init_weight_transfer_engine", {"init_info": init or {}})
    client.call("POST", "/pause", query={"mode": "wait", "clear_cache": "true"})
    try:
        client.call("POST", "/start_weight_update")
        client.call("POST", "/update_weights", {"update_info": target.request})
        client.call("POST", "/finish_weight_update", {"weight_version": target.version})
        client.reset_prefix_cache()
    finally:
        client.call("POST", "/resume")
    return SyncResult("updated", target.version, before, time.perf_counter() - start)
