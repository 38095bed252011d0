"""The object-store API every pnyx role uses: get/put/list/head/delete over one run root.

`Store` wraps a raw backend (`ObstoreBackend`: thin calls into `obstore`) with three things:
typed errors from `pnyx.errors`, bounded retries of transient failures (`retry.py`), and key
checks. It knows nothing about the run layout (keys come from `pnyx.protocol.layout`), models or RL.

Guarantees kept here:
- a put is atomic: no reader ever observes a partial object (obstore's contract on every backend);
- `put(mode="create")` has exactly one winner among racing writers (AlreadyExistsError for the rest);
- not-found, already-exists, precondition and permission errors are never retried;
- transient errors are retried with full-jitter backoff until the policy's deadline, then
  `StoreUnavailableError`;
- `list()` returns keys sorted, strictly after `start_after`, never the prefix itself, on every backend.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, TypeVar

from pnyx.errors import (
    AlreadyExistsError,
    ConfigError,
    NotFoundError,
    PreconditionError,
    StoreError,
    StorePermissionError,
    UnsupportedError,
)
from pnyx.store.retry import RetryPolicy, call_with_retry

T = TypeVar("T")

_LIST_CHUNK = 1000


@dataclass(frozen=True)
class ObjectMeta:
    """What a store knows about one object. `key` is relative to the run root."""

    key: str
    size: int
    etag: str | None
    last_modified: datetime


@dataclass(frozen=True)
class PutResult:
    """The outcome of a successful put: the new object's ETag (None if the backend has none)."""

    etag: str | None


@dataclass(frozen=True)
class IfMatch:
    """Put mode for compare-and-swap: succeed only if the object's current ETag equals `etag`."""

    etag: str


PutMode = Literal["create", "overwrite"] | IfMatch


# --- the raw backend: one thin method per obstore call ----------------------------------------------


class ObstoreBackend:
    """Direct obstore calls on one store object. Raises obstore's (and builtin) exceptions untouched.

    `sorted_listing` says whether the backend lists in key order (S3, GCS and memory do; the local
    folder does not), which lets `Store.list(limit=...)` stop early instead of reading everything.
    """

    def __init__(self, raw: Any, *, sorted_listing: bool, supports_cas: bool, remote: bool):
        self.raw = raw
        self.sorted_listing = sorted_listing
        self.supports_cas = supports_cas
        self.remote = remote

    def get(self, key: str) -> bytes:
        import obstore

        return bytes(obstore.get(self.raw, key).bytes())

    def get_range(self, key: str, start: int, end: int) -> bytes:
        import obstore

        return bytes(obstore.get_range(self.raw, key, start=start, end=end))

    def head(self, key: str) -> ObjectMeta:
        import obstore

        return _meta(obstore.head(self.raw, key))

    def put(self, key: str, data: bytes, mode: PutMode) -> PutResult:
        import obstore

        if isinstance(mode, IfMatch):
            raw_mode: Any = {"e_tag": mode.etag}
        else:
            raw_mode = mode
        # Conditional puts must be single requests: multipart uploads cannot carry the condition.
        multipart = None if mode == "overwrite" else False
        result = obstore.put(self.raw, key, data, mode=raw_mode, use_multipart=multipart)
        return PutResult(etag=result.get("e_tag"))

    def list(self, prefix: str | None, offset: str | None) -> Iterator[list[ObjectMeta]]:
        import obstore

        stream = obstore.list(self.raw, prefix=prefix, offset=offset, chunk_size=_LIST_CHUNK)
        for chunk in stream:
            yield [_meta(m) for m in chunk]

    def delete(self, key: str) -> None:
        import obstore

        obstore.delete(self.raw, key)


def _meta(raw: Any) -> ObjectMeta:
    return ObjectMeta(
        key=raw["path"], size=raw["size"], etag=raw.get("e_tag"), last_modified=raw["last_modified"]
    )


# --- error classification -------------------------------------------------------------------------


def is_transient(exc: BaseException, remote: bool = True) -> bool:
    """True for failures worth retrying: generic/IO/connection/timeout/5xx/throttling errors.

    On a non-remote backend (local folder, memory) only I/O-level errors are retried, never
    obstore's GenericError, which there means a permanent fault.
    """
    import obstore.exceptions as oe

    if isinstance(exc, StoreError | ValueError | NotImplementedError):
        return False
    if isinstance(exc, FileNotFoundError | builtins.PermissionError | FileExistsError):
        return False
    if isinstance(
        exc,
        oe.AlreadyExistsError
        | oe.PreconditionError
        | oe.NotSupportedError
        | oe.PermissionDeniedError
        | oe.UnauthenticatedError
        | oe.InvalidPathError
        | oe.NotModifiedError
        | oe.UnknownConfigurationKeyError,
    ):
        return False
    if _missing_bucket(exc):
        return False
    status = http_status(exc)
    if status is not None and 400 <= status < 500 and status not in (408, 429):
        return False  # a client error (bad request, missing bucket) fails the same way again
    if isinstance(exc, oe.GenericError | oe.JoinError):
        return remote
    return isinstance(exc, OSError | ConnectionError | TimeoutError)


def translate(exc: BaseException, what: str) -> BaseException:
    """The pnyx error to raise for a raw backend failure (or `exc` itself if it is already one)."""
    import obstore.exceptions as oe

    if isinstance(exc, StoreError):
        return exc
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if _missing_bucket(exc):
        return ConfigError(f"{what}: the bucket does not exist; create it or fix the store URL")
    if isinstance(exc, FileNotFoundError | oe.NotFoundError):
        return NotFoundError(f"{what}: no such object ({first})")
    if isinstance(exc, oe.AlreadyExistsError | FileExistsError):
        return AlreadyExistsError(f"{what}: the key already exists; another writer won ({first})")
    if isinstance(exc, oe.PreconditionError):
        return PreconditionError(f"{what}: the object changed since it was read; re-read and retry ({first})")
    if isinstance(exc, oe.NotSupportedError | NotImplementedError):
        return UnsupportedError(f"{what}: not supported by this backend ({first})")
    if isinstance(exc, oe.PermissionDeniedError | oe.UnauthenticatedError | builtins.PermissionError):
        return StorePermissionError(
            f"{what}: access denied ({first}). Check the credentials in the environment "
            "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS) and the bucket policy."
        )
    if isinstance(exc, oe.UnknownConfigurationKeyError):
        return ConfigError(f"{what}: {first}")
    if isinstance(exc, oe.InvalidPathError):
        return ValueError(f"{what}: invalid key ({first})")
    if isinstance(exc, oe.GenericError):
        return StoreError(f"{what}: {first}")
    return exc


_STATUS = re.compile(r"status code: (\d{3})")


def http_status(exc: BaseException) -> int | None:
    """The HTTP status a remote backend reported in `exc`'s message, if any."""
    m = _STATUS.search(str(exc))
    return int(m.group(1)) if m else None


def _missing_bucket(exc: BaseException) -> bool:
    return "<Code>NoSuchBucket</Code>" in str(exc)


def check_key(key: str) -> str:
    """Reject keys that are not plain relative object paths (empty, absolute, `..`, empty segments)."""
    if not isinstance(key, str) or not key or key.startswith("/") or key.endswith("/"):
        raise ValueError(f"invalid store key {key!r}: expected a relative path like 'weights/HEAD'")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"invalid store key {key!r}: no empty, '.' or '..' segments allowed")
    return key


# --- the Store --------------------------------------------------------------------------------------


class Store:
    """One run root in an object store. Create with `pnyx.store.open_store(url)`.

    Picklable: a pickled Store re-opens itself from `url` in the receiving process (credentials come
    from that process's environment), except anonymous `memory://` stores, which cannot be shared.
    """

    def __init__(
        self,
        backend: ObstoreBackend,
        url: str,
        retry: RetryPolicy | None = None,
        *,
        local_path: Path | None = None,
        reopen: Callable[[str, RetryPolicy], Store] | None = None,
    ):
        self._backend = backend
        self.url = url
        """Canonical URL of this run root; never contains credentials (safe to log)."""
        self.retry = retry or RetryPolicy()
        self.local_path = local_path
        """The run folder for the local backend (None otherwise), for files that live beside the run."""
        self._reopen = reopen
        """How another process opens this run root again (`pnyx.store.open_store`); None: it cannot."""

    # -- properties --
    @property
    def supports_cas(self) -> bool:
        """Whether `put(mode=IfMatch(...))` works here (False on the local folder backend)."""
        return self._backend.supports_cas

    @property
    def sorted_listing(self) -> bool:
        """Whether the backend lists in key order from `start_after` itself (S3, GCS, memory), so a `list`
        with `limit` costs one request per `limit` keys; the local folder walks its whole folder each time."""
        return self._backend.sorted_listing

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def __reduce__(self) -> tuple[Callable[..., Store], tuple[Any, ...]]:
        if self._reopen is None:
            raise UnsupportedError(
                f"{self.url} cannot be pickled: an anonymous memory store lives in one process only. "
                "Use a named one (memory://name, shared per process) or a folder/S3 URL."
            )
        return (self._reopen, (self.url, _picklable_policy(self.retry)))

    # -- operations --
    def get(self, key: str) -> bytes:
        """The whole object. Raises NotFoundError (a FileNotFoundError) if it does not exist."""
        check_key(key)
        return self._call(f"get {key}", lambda: self._backend.get(key))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the object; shorter if the object ends before `end`."""
        check_key(key)
        if start < 0 or end < start:
            raise ValueError(f"get_range({key!r}, {start}, {end}): need 0 <= start <= end")
        if start == end:  # obstore rejects empty ranges; still report a missing key as missing
            self.head(key)
            return b""
        return self._call(
            f"get_range {key} [{start}:{end})", lambda: self._backend.get_range(key, start, end)
        )

    def head(self, key: str) -> ObjectMeta:
        """Size, ETag and modification time of the object. Raises NotFoundError if missing."""
        check_key(key)
        return self._call(f"head {key}", lambda: self._backend.head(key))

    def exists(self, key: str) -> bool:
        """Whether the object exists (a head that maps not-found to False)."""
        try:
            self.head(key)
        except NotFoundError:
            return False
        return True

    def put(self, key: str, data: bytes, mode: PutMode = "overwrite") -> PutResult:
        """Write the whole object atomically.

        `"create"` raises AlreadyExistsError if the key exists (exactly one of many racing writers
        wins); `IfMatch(etag)` raises PreconditionError if the object's ETag differs, and
        UnsupportedError on the local folder backend. If a conditional put is retried after an
        ambiguous failure (the first attempt may have landed) and then meets its own bytes, it
        succeeds: the object holds exactly what this caller wrote.
        """
        check_key(key)
        if not isinstance(mode, IfMatch) and mode not in ("create", "overwrite"):
            raise ValueError(f"put mode must be 'create', 'overwrite' or IfMatch(etag), got {mode!r}")
        if isinstance(mode, IfMatch) and not self.supports_cas:
            raise UnsupportedError(
                f"put {key} with IfMatch: the local folder backend has no compare-and-swap. pnyx's "
                "protocol never needs it (HEAD is a hint verified against manifests); use mode='overwrite'."
            )
        data = bytes(data)
        retried = [False]

        def note_retry(attempt: int, exc: BaseException) -> None:
            retried[0] = True

        def attempt() -> PutResult:
            try:
                return self._backend.put(key, data, mode)
            except FileNotFoundError as exc:
                if not self._backend.remote or _missing_bucket(exc):
                    raise
                # A put never legitimately answers "not found": this is a multipart upload whose completion
                # landed but whose reply was lost, so the client's abort met NoSuchUpload. Try it again.
                # (the message leaves out the inner 404, which the classifier would read as final)
                raise OSError(errno.EIO, f"put of {key} ended ambiguously (its upload was gone)") from exc

        try:
            return self._call(f"put {key}", attempt, on_retry=note_retry)
        except (AlreadyExistsError, PreconditionError):
            if retried[0] and self._holds(key, data):
                return PutResult(etag=self.head(key).etag)
            raise

    def list(
        self, prefix: str = "", start_after: str | None = None, limit: int | None = None
    ) -> list[ObjectMeta]:
        """Objects whose key starts with `prefix` (plain string prefix), sorted by key.

        Only keys strictly greater than `start_after` are returned, at most `limit` of them. An object
        whose key equals `prefix` (a "folder marker") is never returned.
        """
        if limit is not None and limit < 0:
            raise ValueError(f"list limit must be >= 0, got {limit}")
        if limit == 0:
            return []
        # obstore prefixes are whole path segments; list the enclosing folder and filter by string.
        folder = prefix[: prefix.rfind("/") + 1] if "/" in prefix else ""
        offset = start_after
        if offset is not None and offset < prefix:
            offset = None  # everything under the prefix sorts after start_after anyway

        def run() -> list[ObjectMeta]:
            out: list[ObjectMeta] = []
            for chunk in self._backend.list(folder.rstrip("/") or None, offset):
                for m in chunk:
                    if (
                        m.key.startswith(prefix)
                        and m.key != prefix
                        and (start_after is None or m.key > start_after)
                    ):
                        out.append(m)
                if self._backend.sorted_listing and limit is not None and len(out) >= limit:
                    break
            out.sort(key=lambda m: m.key)
            return out if limit is None else out[:limit]

        return self._call(f"list {prefix!r}", run)

    def delete(self, key: str) -> None:
        """Remove the object. Deleting a missing key is not an error."""
        check_key(key)
        with contextlib.suppress(NotFoundError):
            self._call(f"delete {key}", lambda: self._backend.delete(key))

    # -- internals --
    def _is_transient(self, exc: BaseException) -> bool:
        return is_transient(exc, remote=self._backend.remote)

    def _holds(self, key: str, data: bytes) -> bool:
        try:
            return self.get(key) == data
        except NotFoundError:
            return False

    def _call(
        self,
        what: str,
        fn: Callable[[], T],
        on_retry: Callable[[int, BaseException], None] | None = None,
    ) -> T:
        full = f"{what} in {self.url}"
        try:
            return call_with_retry(fn, self.retry, self._is_transient, full, on_retry=on_retry)
        except Exception as exc:  # translated to the pnyx hierarchy; unknown errors re-raise as is
            mapped = translate(exc, full)
            if mapped is exc:
                raise
            raise mapped from exc


def _picklable_policy(policy: RetryPolicy) -> RetryPolicy:
    """The policy without injected clocks (fakes are per-process test doubles)."""
    return RetryPolicy(deadline_s=policy.deadline_s, base_s=policy.base_s, cap_s=policy.cap_s)
