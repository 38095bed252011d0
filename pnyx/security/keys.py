"""Ed25519 key files and fingerprints: where a trainer's and a worker's private keys live on disk.

- The trainer's key signs every weight manifest, its name and HEAD. It lives outside the store, at
  `$PNYX_TRAINER_KEY` if set, else `$XDG_CONFIG_HOME/pnyx/trainer.key` (default `~/.config/pnyx/trainer.key`).
  A trainer creates it on first use; a resumed trainer finds it at the same path (on another machine:
  copy the file, or point `PNYX_TRAINER_KEY` at it). run.json records its public key.
- A worker's key signs every rollout group. It lives in the worker's cache, next to the spool:
  `$PNYX_KEYS_DIR/worker.key` if set, else `$XDG_CACHE_HOME/pnyx/keys/worker.key` (default
  `~/.cache/pnyx/keys/worker.key`). Every worker process of one user on one machine shares it, so the
  trainer's per-key accounting sees one machine as one contributor, whatever names its workers claim.

A key file is PKCS#8 PEM, unencrypted, mode 0600, created create-only (two processes racing to create
it end up with the same key). A fingerprint is the first 128 bits of SHA-256 of the raw 32-byte public
key, as 32 hex digits: short enough to compare by eye, too long to brute-force a key that matches it.
Knows nothing about the store, runs or what is signed.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from pnyx.errors import ConfigError

TRAINER_KEY_ENV = "PNYX_TRAINER_KEY"
"""Path of the trainer's private key file (overrides the default under the user's config folder)."""
KEYS_DIR_ENV = "PNYX_KEYS_DIR"
"""Folder of the worker's key and of its pinned trainer keys (overrides the default under the cache)."""
FINGERPRINT_HEX = 32
_FP = re.compile(r"^[0-9a-f]{32}$")


def default_trainer_key_path() -> Path:
    """$PNYX_TRAINER_KEY, else $XDG_CONFIG_HOME/pnyx/trainer.key, else ~/.config/pnyx/trainer.key."""
    if os.environ.get(TRAINER_KEY_ENV):
        return Path(os.environ[TRAINER_KEY_ENV]).expanduser()
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config).expanduser() / "pnyx" / "trainer.key"


def default_keys_dir() -> Path:
    """$PNYX_KEYS_DIR, else $XDG_CACHE_HOME/pnyx/keys, else ~/.cache/pnyx/keys (beside the spool)."""
    if os.environ.get(KEYS_DIR_ENV):
        return Path(os.environ[KEYS_DIR_ENV]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "pnyx" / "keys"


def worker_key_path(keys_dir: str | Path | None = None) -> Path:
    """The worker's private key file inside `keys_dir` (default: `default_keys_dir()`)."""
    return (Path(keys_dir).expanduser() if keys_dir is not None else default_keys_dir()) / "worker.key"


def load_key(path: str | Path) -> Ed25519PrivateKey:
    """The Ed25519 private key in `path` (ConfigError if missing or not one)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"no key file at {path}") from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        raise ConfigError(
            f"{path} is not an unencrypted PEM private key ({e}): move it away or fix it"
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"{path} holds a {type(key).__name__}, pnyx needs an Ed25519 key")
    return key


def load_or_create_key(path: str | Path) -> tuple[Ed25519PrivateKey, bool]:
    """(the key in `path`, whether it was created now). Creates the folder (0700) and the file (0600)."""
    path = Path(path).expanduser()
    if path.exists():
        return load_key(path), False
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd, tmp = tempfile.mkstemp(prefix=".key-", dir=path.parent)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        try:
            os.link(tmp, path)  # create-only: a process that raced us keeps its key, and we read it
        except FileExistsError:
            return load_key(path), False
    finally:
        os.unlink(tmp)
    return key, True


def public_raw(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    """The raw 32-byte public key."""
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def fingerprint(public: bytes | Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """32 hex digits: the first 128 bits of SHA-256 of the raw public key."""
    raw = public if isinstance(public, bytes) else public_raw(public)
    return hashlib.sha256(raw).hexdigest()[:FINGERPRINT_HEX]


def normalize_fingerprint(text: str) -> str:
    """A fingerprint as typed by a person (any case, `:`/space/`-` separators) in canonical form."""
    fp = re.sub(r"[\s:\-]", "", text.strip().lower())
    if not _FP.match(fp):
        raise ConfigError(
            f"{text!r} is not a pnyx key fingerprint: expected {FINGERPRINT_HEX} hex digits, as printed "
            "by the trainer at start and shown in run.json (trainer_key.fingerprint)"
        )
    return fp


def public_from_hex(text: str) -> Ed25519PublicKey:
    """An Ed25519 public key from its 64-hex raw form (ValueError if it is not one)."""
    raw = bytes.fromhex(text)
    if len(raw) != 32:
        raise ValueError(f"an Ed25519 public key is 32 bytes, got {len(raw)}")
    return Ed25519PublicKey.from_public_bytes(raw)
