"""`open_store(url)`: turn a store URL into a `Store`; every backend quirk lives in one function here.

Accepted URLs (the URL always points at one run root):
    runs/x, ./runs/x, /abs/path, file:///abs/path      local folder (created if missing)
    memory://                                          a fresh in-memory store (one per call, not picklable)
    memory://name                                      an in-memory store shared by name within one process
    s3://bucket/prefix?endpoint=URL&region=R           S3 or any S3 API (MinIO, moto, R2: region=auto)
    gs://bucket/prefix                                 Google Cloud Storage

Credentials never come from the URL: S3 reads AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
AWS_SESSION_TOKEN (and AWS_ENDPOINT_URL, AWS_REGION) from the environment; GCS reads
GOOGLE_APPLICATION_CREDENTIALS. A URL carrying credentials is refused with a message that does not
echo them, so `Store.url` is always safe to log. Knows nothing about keys or the run layout.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

from pnyx.errors import ConfigError
from pnyx.store.base import ObstoreBackend, Store
from pnyx.store.retry import RetryPolicy

if TYPE_CHECKING:
    from obstore.store import ClientConfig, RetryConfig, S3Config

SUPPORTED_SCHEMES = ("file", "memory", "s3", "gs")
_S3_QUERY = ("endpoint", "region")
_SECRET_WORDS = ("secret", "password", "token", "key", "credential", "signature", "sig")

_named_memory: dict[str, Any] = {}
_named_lock = threading.Lock()

# Our own retry policy is the only one: obstore's internal retries would stack under it and break
# the deadline. Single requests are bounded by the client timeouts instead.
_NO_OBSTORE_RETRY: RetryConfig = {"max_retries": 0}
_CLIENT_OPTIONS: ClientConfig = {"connect_timeout": "10s", "timeout": "300s"}


def open_store(url: str | os.PathLike[str], retry: RetryPolicy | None = None) -> Store:
    """Open the run root at `url`. See the module docstring for the accepted forms.

    Raises ConfigError for an unknown scheme, a malformed URL, or credentials inside the URL.
    """
    text = os.fspath(url)
    if not isinstance(text, str) or not text:
        raise ConfigError(f"store URL must be a non-empty string, got {url!r}")
    if "://" not in text:
        return _open_local(Path(text), retry)
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if parts.username is not None or parts.password is not None:
        raise ConfigError(
            f"store URL {redact_url(text)} carries credentials: remove them and set them in the "
            "environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS)"
        )
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ConfigError(f"file URL {text!r} must be file:///absolute/path (got host {parts.netloc!r})")
        return _open_local(Path(unquote(parts.path)), retry)
    if scheme == "memory":
        return _open_memory(unquote(parts.netloc + parts.path).strip("/"), retry)
    if scheme == "s3":
        return _open_s3(parts.netloc, parts.path.strip("/"), dict(parse_qsl(parts.query)), text, retry)
    if scheme in ("gs", "gcs"):
        _refuse_query(parts.query, text, allowed=())
        return _open_gcs(parts.netloc, parts.path.strip("/"), retry)
    raise ConfigError(
        f"unsupported store URL scheme {scheme!r} in {redact_url(text)}: use a folder path, "
        f"{', '.join(s + '://' for s in SUPPORTED_SCHEMES)}"
    )


def redact_url(url: str) -> str:
    """`url` with any user info and secret-looking query values replaced by `***` (for messages)."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = [
        (k, "***" if any(w in k.lower() for w in _SECRET_WORDS) else v)
        for k, v in parse_qsl(parts.query, keep_blank_values=True)
    ]
    out = f"{parts.scheme}://{netloc}{parts.path}"
    return out + (f"?{urlencode(query, safe=':/*')}" if query else "")


# --- one function per backend ------------------------------------------------------------------------


def _open_local(path: Path, retry: RetryPolicy | None) -> Store:
    from obstore.store import LocalStore

    root = path.expanduser().resolve()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create the store folder {root}: {exc}") from exc
    # automatic_cleanup stays off: removing an emptied folder can race a writer creating a file in it.
    raw = LocalStore(root, mkdir=True)
    # LocalStore lists in directory order, and has no compare-and-swap (PutMode::Update).
    backend = ObstoreBackend(raw, sorted_listing=False, supports_cas=False, remote=False)
    return Store(backend, "file://" + quote(str(root)), retry, local_path=root, reopen=open_store)


def _open_memory(name: str, retry: RetryPolicy | None) -> Store:
    from obstore.store import MemoryStore

    if not name:
        backend = ObstoreBackend(MemoryStore(), sorted_listing=True, supports_cas=True, remote=False)
        return Store(backend, "memory://", retry)
    with _named_lock:
        raw = _named_memory.get(name)
        if raw is None:
            raw = _named_memory[name] = MemoryStore()
    backend = ObstoreBackend(raw, sorted_listing=True, supports_cas=True, remote=False)
    return Store(backend, f"memory://{name}", retry, reopen=open_store)


def _open_s3(bucket: str, prefix: str, query: dict[str, str], text: str, retry: RetryPolicy | None) -> Store:
    from obstore.store import S3Store

    if not bucket:
        raise ConfigError(f"S3 URL {redact_url(text)} has no bucket: use s3://bucket/prefix")
    _refuse_query(urlsplit(text).query, text, allowed=_S3_QUERY)
    endpoint = (
        query.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    )
    region = query.get("region")
    config: S3Config = {}
    client = _CLIENT_OPTIONS.copy()
    if endpoint:
        if urlsplit(endpoint).username is not None:
            raise ConfigError("the S3 endpoint URL must not carry credentials: set them in the environment")
        config["endpoint"] = endpoint.rstrip("/")
        # Path style with a custom endpoint: MinIO, moto and R2 all accept it; virtual-hosted needs DNS.
        config["virtual_hosted_style_request"] = False
        if endpoint.startswith("http://"):
            client["allow_http"] = True
    if region:
        config["region"] = region
    raw = S3Store(
        bucket, prefix=prefix or None, config=config, client_options=client, retry_config=_NO_OBSTORE_RETRY
    )
    backend = ObstoreBackend(raw, sorted_listing=True, supports_cas=True, remote=True)
    canonical = f"s3://{bucket}/{prefix}".rstrip("/")
    shown = {k: query[k].rstrip("/") for k in _S3_QUERY if k in query}
    if shown:
        canonical += "?" + urlencode(shown, safe=":/")
    return Store(backend, canonical, retry, reopen=open_store)


def _open_gcs(bucket: str, prefix: str, retry: RetryPolicy | None) -> Store:
    from obstore.store import GCSStore

    if not bucket:
        raise ConfigError("GCS URL has no bucket: use gs://bucket/prefix")
    raw = GCSStore(
        bucket, prefix=prefix or None, client_options=_CLIENT_OPTIONS.copy(), retry_config=_NO_OBSTORE_RETRY
    )
    backend = ObstoreBackend(raw, sorted_listing=True, supports_cas=True, remote=True)
    return Store(backend, f"gs://{bucket}/{prefix}".rstrip("/"), retry, reopen=open_store)


def _refuse_query(query: str, text: str, allowed: tuple[str, ...]) -> None:
    for key, _ in parse_qsl(query, keep_blank_values=True):
        if any(w in key.lower() for w in _SECRET_WORDS):
            raise ConfigError(
                f"store URL {redact_url(text)} carries a credential ({key}): remove it and set it in the "
                "environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/AWS_SESSION_TOKEN)"
            )
        if key not in allowed:
            raise ConfigError(
                f"unknown store URL option {key!r} in {redact_url(text)}; allowed: {', '.join(allowed) or 'none'}"
            )
