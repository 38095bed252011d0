"""Bounded retries for transient store errors: full-jitter exponential backoff under a deadline.

Knows nothing about obstore or keys: it runs a callable, asks a classifier whether a failure is
transient, and either sleeps and tries again or gives up with `StoreUnavailableError`. The clock,
the sleep and the random source are injectable so tests drive it without waiting for real.

Invariant: a call never runs past `deadline_s` (measured from its first attempt) because of
retrying, and anything the classifier does not call transient propagates after exactly one attempt.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from pnyx.errors import ConfigError, StoreUnavailableError

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How long and how often a store call retries transient errors.

    Backoff before retry n (0-based) is uniform in [0, min(cap_s, base_s * 2**n)] ("full jitter"),
    so a fleet of workers hitting a throttled bucket spreads out instead of retrying in lockstep.
    `sleep`, `clock` and `rand` default to the real ones; tests inject fakes.
    """

    deadline_s: float = 30.0
    """Give up (StoreUnavailableError) once the next retry would start past this many seconds."""
    base_s: float = 0.1
    """First backoff bound in seconds."""
    cap_s: float = 5.0
    """Largest backoff bound in seconds."""
    sleep: Callable[[float], None] | None = None
    clock: Callable[[], float] | None = None
    rand: Callable[[], float] | None = None

    def __post_init__(self) -> None:
        if self.deadline_s < 0 or self.base_s < 0 or self.cap_s < 0:
            raise ConfigError(f"RetryPolicy times must be >= 0, got {self}")

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before retry number `attempt` (0-based)."""
        rand = self.rand or random.random
        bound = min(self.cap_s, self.base_s * (2.0 ** min(attempt, 62)))
        return rand() * bound


def call_with_retry(
    fn: Callable[[], T],
    policy: RetryPolicy,
    is_transient: Callable[[BaseException], bool],
    what: str,
    on_retry: Callable[[int, BaseException], None] | None = None,
) -> T:
    """Run `fn`, retrying failures that `is_transient` accepts until `policy.deadline_s` passes.

    Non-transient exceptions propagate unchanged on the attempt that raised them. When the deadline
    would be crossed, raises `StoreUnavailableError` naming `what`, the attempt count and the last
    error (chained as `__cause__`).
    """
    sleep = policy.sleep or time.sleep
    clock = policy.clock or time.monotonic
    start = clock()
    attempt = 0
    while True:
        try:
            return fn()
        except Exception as exc:  # filtered just below: only transient errors are retried
            if not is_transient(exc):
                raise
            delay = policy.backoff(attempt)
            elapsed = clock() - start
            if elapsed + delay > policy.deadline_s:
                raise StoreUnavailableError(
                    f"{what} failed after {attempt + 1} attempts over {elapsed:.1f}s "
                    f"(retry deadline {policy.deadline_s:g}s): {type(exc).__name__}: {_first_line(exc)}. "
                    "The store is unreachable or throttling; check the endpoint/network and try later."
                ) from exc
            if on_retry is not None:
                on_retry(attempt, exc)
            sleep(delay)
            attempt += 1


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
