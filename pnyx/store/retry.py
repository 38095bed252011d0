"""Every retry and wait loop's pauses, in one place.

- `RetryPolicy` + `call_with_retry`: one store call retried on transient errors with full-jitter
  exponential backoff under a deadline, then `StoreUnavailableError`. Invariant: a call never runs past
  `deadline_s` (measured from its first attempt) because of retrying, and anything the classifier does not
  call transient propagates after exactly one attempt.
- `Backoff`: the growing pause of a loop that outlives single calls (a courier re-flushing its spool, a
  syncer re-polling, a prefetcher behind an outage); `Backoff.polling` for loops that wait on someone else
  (a trainer's first run.json, peers, ranks' checkpoint records).
- `wait_for`: try until something is there or a deadline passes, pausing by a `Backoff`, stoppable.

Knows nothing about obstore or keys. The clock, the sleep and the random source are injectable so tests
drive them without waiting for real.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
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


RETRY_FACTOR = 2.0
"""A pause after a failure doubles: the thing that failed (the store, a payload) may need a while."""
POLL_BASE_S = 0.2
POLL_FACTOR = 1.5
"""A wait on someone else (a trainer, peers, ranks) starts at 0.2 s and grows by half each look."""


@dataclass
class Backoff:
    """The pauses of one loop: `base_s`, then times `factor` after each `next()`, at most `cap_s`; with
    `jitter`, each pause is drawn uniformly from its upper half (a fleet retrying a throttled store spreads
    out). `reset()` after a success starts over."""

    base_s: float
    cap_s: float
    factor: float = RETRY_FACTOR
    jitter: bool = False
    rand: Callable[[], float] = random.random
    _pause: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.base_s < 0 or self.cap_s < 0 or self.factor < 1:
            raise ConfigError(f"Backoff needs times >= 0 and a factor >= 1, got {self}")
        self._pause = min(self.base_s, self.cap_s)

    @classmethod
    def polling(cls, cap_s: float, base_s: float = POLL_BASE_S, jitter: bool = False) -> Backoff:
        """The pauses of a wait on someone else: from `base_s`, growing by `POLL_FACTOR`, up to `cap_s`."""
        return cls(base_s, cap_s, POLL_FACTOR, jitter)

    def next(self) -> float:
        """The pause to take now; the one after it grows."""
        pause = self._pause
        self._pause = min(self.cap_s, self._pause * self.factor)
        return pause * (0.5 + self.rand() / 2) if self.jitter else pause

    def peek(self) -> float:
        """The next pause without jitter, not taken."""
        return self._pause

    def reset(self) -> None:
        self._pause = min(self.base_s, self.cap_s)


def wait_for(
    attempt: Callable[[], T | None],
    deadline_s: float,
    pause: Backoff,
    stop: threading.Event | None = None,
    what: str = "",
) -> T | None:
    """Call `attempt` until it returns something other than None, pausing by `pause` between tries (the
    last pause shortened so that the last try falls at `deadline_s`, measured from the first); None when
    that try found nothing either. A set `stop` ends the wait with InterruptedError naming `what`."""
    end = time.monotonic() + deadline_s
    while True:
        got = attempt()
        if got is not None:
            return got
        left = end - time.monotonic()
        if left <= 0:
            return None
        delay = min(pause.next(), left)
        if stop is None:
            time.sleep(delay)
        elif stop.wait(delay):
            raise InterruptedError(f"stopped while waiting for {what or 'the store'}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
