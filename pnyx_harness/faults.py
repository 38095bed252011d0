"""Fault injection for tests: a `Store` whose raw backend fails, stalls or counts on demand.

`FaultyStore(inner, ...)` is a real `Store` (same URL, same data, same retry machinery) whose
backend wraps `inner`'s backend. Faults are raised *below* the retry logic, as the raw exceptions
a real backend would raise (obstore's GenericError for a remote 503, an EIO OSError locally), so what a test observes is exactly what production code
observes: transient faults are retried under the policy and surface as `StoreUnavailableError`
only when the deadline passes; permission faults surface at once as `StorePermissionError`.

    store = FaultyStore(open_store(url), retry=RetryPolicy(deadline_s=0.5, base_s=0.01))
    store.fail_next(3)                                    # the next 3 backend calls fail transiently
    store.fail_when(lambda op, key: key.endswith("HEAD") and op == "put")   # until clear()
    store.set_latency(0.05)                               # every backend call sleeps first
    store.calls["put"]                                    # backend attempts per operation so far
    store.clear()

Operations are named "get", "get_range", "head", "put", "list", "delete"; the key given to a
predicate is the object key (for "list", the folder being listed, "" for the root). Knows nothing
about the run layout. Not picklable: faults are per-process test state.
"""

from __future__ import annotations

import errno
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, Literal

from pnyx.store.base import ObjectMeta, ObstoreBackend, PutMode, PutResult, Store
from pnyx.store.retry import RetryPolicy

FaultKind = Literal["transient", "permission"]
Predicate = Callable[[str, str], bool]


class FaultyBackend(ObstoreBackend):
    """An `ObstoreBackend` that consults a fault plan before delegating each raw call."""

    def __init__(self, inner: ObstoreBackend, sleep: Callable[[float], None] = time.sleep):
        super().__init__(
            inner.raw,
            sorted_listing=inner.sorted_listing,
            supports_cas=inner.supports_cas,
            remote=inner.remote,
        )
        self.inner = inner
        self.calls: Counter[str] = Counter()
        self.injected = 0
        self.remaining = 0
        self.predicate: Predicate | None = None
        self.kind: FaultKind = "transient"
        self.latency_s = 0.0
        self._sleep = sleep
        self._lock = threading.Lock()

    def _gate(self, op: str, key: str) -> None:
        with self._lock:
            self.calls[op] += 1
            fire = False
            if self.remaining > 0:
                self.remaining -= 1
                fire = True
            elif self.predicate is not None and self.predicate(op, key):
                fire = True
            if fire:
                self.injected += 1
            latency = self.latency_s
        if latency > 0:
            self._sleep(latency)
        if fire:
            raise _raw_error(self.kind, op, key, remote=self.remote)

    def get(self, key: str) -> bytes:
        self._gate("get", key)
        return self.inner.get(key)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        self._gate("get_range", key)
        return self.inner.get_range(key, start, end)

    def head(self, key: str) -> ObjectMeta:
        self._gate("head", key)
        return self.inner.head(key)

    def put(self, key: str, data: bytes, mode: PutMode) -> PutResult:
        self._gate("put", key)
        return self.inner.put(key, data, mode)

    def list(self, prefix: str | None, offset: str | None) -> Iterator[list[ObjectMeta]]:
        self._gate("list", prefix or "")
        return self.inner.list(prefix, offset)

    def delete(self, key: str) -> None:
        self._gate("delete", key)
        self.inner.delete(key)


def _raw_error(kind: FaultKind, op: str, key: str, remote: bool) -> Exception:
    """What the real backend raises for such a fault: obstore's GenericError for a 503 from a remote
    store, an I/O OSError from a local one."""
    import obstore.exceptions as oe

    if kind == "permission":
        return oe.PermissionDeniedError(f"injected permission fault on {op} {key!r}")
    if remote:
        return oe.GenericError(f"injected transient fault on {op} {key!r} (HTTP 503 Slow Down)")
    return OSError(errno.EIO, f"injected transient I/O fault on {op} {key!r}")


class FaultyStore(Store):
    """A `Store` over the same data as `inner`, whose backend calls fail or stall as armed."""

    def __init__(
        self,
        inner: Store,
        retry: RetryPolicy | None = None,
        *,
        fail_next: int = 0,
        fail_when: Predicate | None = None,
        kind: FaultKind = "transient",
        latency_s: float = 0.0,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self._faults = FaultyBackend(inner._backend, sleep=sleep)
        super().__init__(self._faults, inner.url, retry or inner.retry, local_path=inner.local_path)
        self._faults.remaining = fail_next
        self._faults.predicate = fail_when
        self._faults.kind = kind
        self._faults.latency_s = latency_s

    def __reduce__(self) -> Any:
        raise TypeError("FaultyStore is per-process test state and cannot be pickled; pickle the inner Store")

    @property
    def calls(self) -> Counter[str]:
        """Backend attempts so far, per operation name (retries count once each)."""
        return self._faults.calls

    @property
    def injected(self) -> int:
        """How many faults have been raised so far."""
        return self._faults.injected

    def fail_next(self, n: int, kind: FaultKind = "transient") -> None:
        """Make the next `n` backend calls (of any operation) fail with a `kind` fault."""
        with self._faults._lock:
            self._faults.remaining = n
            self._faults.kind = kind

    def fail_when(self, predicate: Predicate | None, kind: FaultKind = "transient") -> None:
        """Fail every backend call for which `predicate(op, key)` is true, until cleared."""
        with self._faults._lock:
            self._faults.predicate = predicate
            self._faults.kind = kind

    def set_latency(self, seconds: float) -> None:
        """Sleep this long before every backend call (0 turns it off)."""
        with self._faults._lock:
            self._faults.latency_s = seconds

    def clear(self) -> None:
        """Disarm all faults and latency (counters are kept)."""
        with self._faults._lock:
            self._faults.remaining = 0
            self._faults.predicate = None
            self._faults.latency_s = 0.0
