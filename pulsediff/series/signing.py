"""Signed series: Ed25519 keys, the manifest's detached signature, and a worker's rollback record.

docs/FORMAT.md §8.1 is the specification; in short:

- `manifest.json.sig` beside `manifest.json` is one ASCII line,
  `ed25519:<public key, base64> <signature, base64>`, the signature Ed25519
  over SIGNATURE_CONTEXT followed by the manifest's exact bytes. Those bytes
  name every file with its size and SHA-256 (format/manifest.py), so a file that
  passes its entry's SHA-256 is the publisher's.
- The publisher writes the signature before it replaces the manifest. A
  reader may see the two at different moments (rsync, S3), so a signature
  that does not verify is read again READ_TRIES times before the manifest is
  refused; an unsigned manifest is never accepted where a key is trusted.
- A worker records, per source (whatever key signed), the highest `serial`
  it accepted (a state file, `default_state_file()`); a signed manifest with
  a lower serial, or the same serial and other bytes, is refused (replay,
  rollback), also across a key rotation: serials continue under a new key.
  The manifest's signed `series` id is pinned there too, at the first
  manifest that has one: another series signed by the same key, copied over
  this source, is refused.

The crypto is the `cryptography` package's (OpenSSL), imported only when a
key is used, so that `pulsediff --help` and unsigned series never load it.
"""

from __future__ import annotations

import base64
import binascii
import fcntl
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from pulsediff.io import strict_json
from pulsediff.errors import (MissingExtraError, OutputError, OutputExistsError, RollbackError, SigningKeyError,
                     UntrustedManifestError, refuse_folder_for_file)

KEY_PREFIX = "ed25519:"
SIGNATURE_NAME = "manifest.json.sig"
SIGNATURE_CONTEXT = b"pulsediff manifest signature v1\n"  # a key that signs manifests signs nothing else by mistake
MAX_SIGNATURE_BYTES = 1024  # the line is about 150 bytes
MAX_KEY_FILE_BYTES = 64 * 1024
MAX_STATE_BYTES = 16 * 1024 * 1024
READ_TRIES = 3  # reads of manifest + signature before a pair that does not match is refused
RETRY_DELAY = 0.5  # seconds before the second read; twice that before the third
STATE_VERSION = 1


def _crypto():
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise MissingExtraError("signing (keygen, --sign, --trust)", "cryptography", "sign") from None
    return ed25519, serialization, InvalidSignature


# -- keys -------------------------------------------------------------------------------------


def public_key_text(private_key) -> str:
    """`ed25519:` and the base64 of the 32-byte raw public key: the one line a worker is given."""
    _, serialization, _ = _crypto()
    raw = private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return KEY_PREFIX + base64.b64encode(raw).decode()


def keygen(path: Path, *, force: bool = False) -> str:
    """Write a new Ed25519 private key to `path` (PKCS#8 PEM, mode 0600); return its public key line.

    An existing `path` is refused unless `force` (a lost key cannot be re-made:
    every worker would have to trust a new one)."""
    ed25519, serialization, _ = _crypto()
    refuse_folder_for_file(path, "a key is a single file", "signing.key")  # -f would not help there
    path = Path(path)
    if not force and os.path.lexists(path):
        raise OutputExistsError(str(path), "give -f/--force")
    key = ed25519.Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    import tempfile

    from pulsediff.io.atomic import TMP_SUFFIX, output_error, remove_stale_temporaries, temp_prefix

    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(path.parent)  # a keygen killed mid-write left its temporary there
        # A name of its own (mkstemp: random, created O_EXCL, mode 0600): two keygens into one folder, or a
        # stale file of a dead process under a reused pid, never meet on the temporary's name.
        fd, name = tempfile.mkstemp(prefix=temp_prefix(path), suffix=TMP_SUFFIX, dir=path.parent)
        tmp = Path(name)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask: only the owner reads a private key
            os.write(fd, pem)
            os.fsync(fd)
        finally:
            os.close(fd)
        if force:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # refuses an existing name atomically, even one made since the look above
    except FileExistsError:
        raise OutputExistsError(str(path), "give -f/--force") from None
    except OSError as exc:
        raise output_error(path, exc) from None
    finally:
        if tmp is not None:
            try:
                tmp.unlink()  # gone already after os.replace
            except OSError:
                pass
    return public_key_text(key)


def load_private_key(path: Path):
    """The Ed25519 private key in `path` (as keygen writes it)."""
    ed25519, serialization, _ = _crypto()
    data = _read_bounded(Path(path), MAX_KEY_FILE_BYTES, "key file")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        hint = " (an ed25519:... line is a public key: give it to --trust)" if data.strip().startswith(
            KEY_PREFIX.encode()) else ""
        raise SigningKeyError(f"{path} is not an unencrypted PEM private key{hint}: {str(exc).splitlines()[0][:200]}") \
            from None
    except Exception as exc:  # cryptography raises UnsupportedAlgorithm for keys it cannot load
        raise SigningKeyError(f"{path} is not a usable private key: {str(exc).splitlines()[0][:200]}") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise SigningKeyError(f"{path} holds a {type(key).__name__.removeprefix('_')}, not an Ed25519 key "
                              f"(make one with pulsediff keygen)")
    _check_private(Path(path))  # after the parse: a file that is no key is named as such first
    return key


def _check_private(path: Path) -> None:
    """Refuse a private key file of ours that others may read or write, as ssh does (sshkey_perm_ok):
    a key every user of the machine (or of its group) could have copied signs nothing the workers
    should take as the publisher's. A file someone else owns (a secret mounted by root, say) is
    that owner's to protect, and cannot be chmod-ed by us: taken as it is."""
    if os.name != "posix":
        return
    try:
        st = os.stat(path)
    except OSError as exc:
        raise SigningKeyError(f"cannot read the key file {path}: {exc.strerror or exc}") from None
    if st.st_uid == os.getuid() and st.st_mode & 0o077:
        raise SigningKeyError(f"{path} is accessible to other users (mode {st.st_mode & 0o777:04o}); a "
                              f"private key must be its owner's alone: chmod 600 {path} (pulsediff keygen writes it so)")


def parse_public_key(text: str, where: str = "public key") -> str:
    """`text` as a canonical `ed25519:<base64>` key line (or SigningKeyError)."""
    text = text.strip()
    if not text.startswith(KEY_PREFIX):
        raise SigningKeyError(f"{where}: {text[:60]!r} is not an {KEY_PREFIX}<base64> public key")
    try:
        raw = base64.b64decode(text[len(KEY_PREFIX):], validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 32:
        raise SigningKeyError(f"{where}: {text[:60]!r} is not an Ed25519 public key (32 bytes in base64)")
    return KEY_PREFIX + base64.b64encode(raw).decode()


def trusted_keys(specs: "str | os.PathLike | Iterable[str | os.PathLike]") -> tuple[str, ...]:
    """The public keys that `--trust` values name: each an `ed25519:...` line, or a file of such lines
    (blank lines and `#` comments allowed; several keys during a rotation)."""
    if isinstance(specs, (str, os.PathLike)):
        specs = [specs]
    keys: list[str] = []
    for spec in specs:
        text = os.fspath(spec)
        if text.strip().startswith(KEY_PREFIX):
            keys.append(parse_public_key(text, "--trust"))
            continue
        path = Path(text)
        if not path.exists():
            raise SigningKeyError(f"--trust {text}: neither an {KEY_PREFIX}... public key nor an existing file")
        data = _read_bounded(path, MAX_KEY_FILE_BYTES, "trusted key file")
        if b"PRIVATE KEY" in data:
            raise SigningKeyError(f"{path} is a private key; trust its public key instead "
                                  f"(pulsediff keygen --public {path}), and keep the private key on the publisher")
        try:
            lines = data.decode("ascii").splitlines()
        except UnicodeDecodeError:
            raise SigningKeyError(f"{path}: not a file of {KEY_PREFIX}... public keys") from None
        found = [parse_public_key(ln, str(path)) for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
        if not found:
            raise SigningKeyError(f"{path} holds no {KEY_PREFIX}... public key")
        keys += found
    if not keys:
        raise SigningKeyError("--trust names no key")
    return tuple(dict.fromkeys(keys))


def _read_bounded(path: Path, limit: int, what: str) -> bytes:
    from pulsediff.format.manifest import read_small_file

    data = read_small_file(path, limit, lambda where, why: SigningKeyError(f"cannot read the {what} {where}: {why}"))
    if data is None:
        raise SigningKeyError(f"{what} not found: {path}")
    return data


# -- signatures ----------------------------------------------------------------------------------


def sign_manifest(private_key, data: bytes) -> bytes:
    """The signature file for manifest bytes `data`."""
    signature = private_key.sign(SIGNATURE_CONTEXT + data)
    return f"{public_key_text(private_key)} {base64.b64encode(signature).decode()}\n".encode()


def verify_manifest(keys: tuple[str, ...], data: bytes, signature: bytes | None, where: str) -> str:
    """The trusted key (of `keys`) whose signature `signature` holds over `data`; else UntrustedManifestError."""
    ed25519, _, InvalidSignature = _crypto()
    sig_where = f"{where}.sig" if where.endswith("manifest.json") else SIGNATURE_NAME
    if signature is None:
        raise UntrustedManifestError(where, f"it is not signed (no {sig_where}), and a key is trusted")
    try:
        key_text, sig_text = signature.decode("ascii").split()
        raw_sig = base64.b64decode(sig_text, validate=True)
        key_text = parse_public_key(key_text)
    except (UnicodeDecodeError, ValueError, binascii.Error, SigningKeyError):
        raise UntrustedManifestError(where, f"{sig_where} is not a signature line") from None
    if key_text not in keys:
        raise UntrustedManifestError(where, f"it is signed by {key_text}, which is not a trusted key")
    public = ed25519.Ed25519PublicKey.from_public_bytes(base64.b64decode(key_text[len(KEY_PREFIX):]))
    try:
        public.verify(raw_sig, SIGNATURE_CONTEXT + data)
    except InvalidSignature:
        raise UntrustedManifestError(where, f"its signature ({sig_where}) does not match it: altered after "
                                            f"signing, or caught while being replaced (then run again)") from None
    return key_text


def read_verified(read_pair, keys: tuple[str, ...], where: str, *, tries: int = READ_TRIES):
    """(data, signing key) from `read_pair()` -> (manifest bytes or None, signature bytes or None), read
    again while the pair does not verify (the publisher replaces the signature, then the manifest: a
    reader between the two sees a pair that does not match). (None, None) when there is no manifest."""
    for attempt in range(tries):
        data, signature = read_pair()
        if data is None:
            return None, None
        try:
            return data, verify_manifest(keys, data, signature, where)
        except UntrustedManifestError:
            if attempt == tries - 1:
                raise
            time.sleep(RETRY_DELAY * (attempt + 1))
    raise AssertionError("unreachable")


# -- the rollback record ---------------------------------------------------------------------------


def default_state_file() -> Path:
    """$XDG_STATE_HOME/pulsediff/trusted-series.json (default ~/.local/state/pulsediff/...)."""
    root = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return root / "pulsediff" / "trusted-series.json"


def check_rollback(state_file: Path | None, source: str, key: str, serial: int, step: int | None, data: bytes,
                   where: str, *, record: bool = True, series: str | None = None) -> None:
    """Refuse a manifest older than the newest one accepted from `source`, under any key; record this one.

    The state file maps the source to the serial, newest step, SHA-256 and
    signing key of the manifest last accepted. The record is per source, not
    per key: serials continue across a key rotation (publish --sign with the
    old key trusted), so the old key's last manifest, still trusted during
    the rotation, is older than one accepted under the new key and refused.
    Entries of the first record format ("KEY SOURCE") count for their source.
    `series` (the manifest's signed series id) is pinned at the first manifest
    that has one: a manifest of another series (another series signed by the
    same key, copied over this source), or without one, is refused after.
    It is locked while read and rewritten (workers on one machine share it)
    and replaced atomically. A damaged state file is an error, never a fresh
    start: forgetting it would re-open the replay."""
    state_file = Path(state_file) if state_file is not None else default_state_file()
    digest = hashlib.sha256(data).hexdigest()
    try:
        state_file.parent.mkdir(parents=True, exist_ok=True)
        lock_fd = os.open(f"{state_file}.lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as exc:
        raise OutputError(f"cannot write the rollback record {state_file}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        state = _load_state(state_file)
        legacy = [name for name in state["series"] if name.startswith(KEY_PREFIX) and name.split(" ", 1)[-1] == source]
        candidates = [state["series"][name] for name in legacy]
        if source in state["series"]:
            candidates.append(state["series"][source])
        seen = max(candidates, key=lambda s: s["serial"], default=None)
        if seen is not None and seen.get("series") is not None and series != seen["series"]:
            raise RollbackError(where, f"it is of series {series or '(none)'}, not series {seen['series']} that this "
                                       f"worker follows from this source (another series signed by the same key? "
                                       f"record: {state_file})")
        if seen is not None:
            by = f" (signed by {seen['key']})" if seen.get("key") and seen["key"] != key else ""
            if serial < seen["serial"]:
                raise RollbackError(where, f"its serial {serial} is older than serial {seen['serial']} (step "
                                           f"{seen['step']}) already accepted from this source{by} "
                                           f"(replayed or rolled back; record: {state_file})")
            if serial == seen["serial"] and digest != seen["sha256"]:
                raise RollbackError(where, f"its serial {serial} was already accepted from this source with other "
                                           f"bytes{by} (two publishers? record: {state_file})")
            if serial == seen["serial"] and not legacy and seen.get("series") == series:
                return
        if not record:
            return
        for name in legacy:
            del state["series"][name]
        state["series"][source] = {"serial": serial, "step": step, "sha256": digest, "key": key}
        if series is not None:
            state["series"][source]["series"] = series
        _save_state(state_file, state)
    finally:
        os.close(lock_fd)


def recorded(state_file: Path | None, source: str, data: bytes, keys: tuple[str, ...]) -> bool:
    """Whether `data` are the exact bytes of the manifest last accepted from `source` in the record, under
    one of `keys` (a publisher's record holds the manifest it last read or wrote, verified and signed)."""
    state_file = Path(state_file) if state_file is not None else default_state_file()
    if not state_file.exists():
        return False
    digest = hashlib.sha256(data).hexdigest()
    seen = []
    for name, entry in _load_state(state_file)["series"].items():
        if name == source:
            seen.append((entry, entry.get("key")))
        elif name.startswith(KEY_PREFIX) and name.split(" ", 1)[-1] == source:
            seen.append((entry, name.split(" ", 1)[0]))
    if not seen:
        return False
    newest, key = max(seen, key=lambda s: s[0]["serial"])
    return newest["sha256"] == digest and key in keys


def _load_state(path: Path) -> dict:
    def damaged(why: str) -> UntrustedManifestError:
        return UntrustedManifestError(str(path), f"the rollback record is damaged ({why}); delete it to start "
                                                 f"afresh, which forgets which manifests were seen")

    try:
        with open(path, "rb") as f:
            data = f.read(MAX_STATE_BYTES + 1)
    except FileNotFoundError:
        return {"version": STATE_VERSION, "series": {}}
    except OSError as exc:
        raise damaged(exc.strerror or str(exc)) from None
    if len(data) > MAX_STATE_BYTES:
        raise damaged(f"larger than {MAX_STATE_BYTES} bytes")
    try:
        obj = strict_json.loads(data, max_depth=3)
    except strict_json.JsonError as exc:
        raise damaged(f"not JSON: {exc}") from None
    if not (isinstance(obj, dict) and obj.get("version") == STATE_VERSION and isinstance(obj.get("series"), dict)):
        raise damaged("not a pulsediff rollback record")
    for name, seen in obj["series"].items():
        if not (isinstance(seen, dict) and isinstance(seen.get("serial"), int) and not isinstance(seen["serial"], bool)
                and isinstance(seen.get("sha256"), str)):
            raise damaged(f"bad entry for {name[:80]!r}")
    return obj


def _save_state(path: Path, state: dict) -> None:
    from pulsediff.io.atomic import StagedFiles

    with StagedFiles(inputs=()) as staged:  # made of no mapped checkpoint
        with staged.open(path) as f:
            f.write((json.dumps(state, indent=1, sort_keys=True) + "\n").encode())
        staged.commit()


# -- a signed series, as publish and catch-up use it ------------------------------------------------


@dataclass(frozen=True)
class Trust:
    """What a worker trusts: these keys, and its rollback record in `state` (None: default_state_file())."""

    keys: tuple[str, ...]
    state: Path | None = None


def as_trust(trust, state: "Path | str | None" = None) -> Trust | None:
    """`trust` (None, a Trust, an `ed25519:...` key, a file of keys, or several) as a Trust."""
    if trust is None:
        return None
    _crypto()  # a missing package is said before anything is read
    if isinstance(trust, Trust):
        return trust
    return Trust(trusted_keys(trust), Path(state) if state is not None else None)


def read_signed_manifest(store, trust: Trust, *, record: bool = True):
    """The store's manifest, accepted only when signed by a trusted key, naming every file's SHA-256, and
    not older than one accepted before from this store (under any key); None when there is none.

    Nothing unauthenticated reaches the manifest parser: the bytes are verified first."""
    from pulsediff.format.manifest import MANIFEST, parse_manifest

    where = store.shown(MANIFEST)
    data, key = read_verified(lambda: (store.read_manifest_bytes(), store.read_signature()), trust.keys, where)
    if data is None:
        return None
    manifest = parse_manifest(data, where)
    bare = next((e.file for e in manifest.entries if e.sha256 is None), None)
    if bare is not None:
        raise UntrustedManifestError(where, f"it lists {bare} without a sha256, so that file cannot be "
                                            f"authenticated")
    newest = manifest.newest
    check_rollback(trust.state, store.identity, key, manifest.serial, newest.step if newest else None, data, where,
                   record=record, series=manifest.series)
    return manifest
