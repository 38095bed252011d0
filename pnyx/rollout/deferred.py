"""A call run once, later: on a timer thread after a delay, or at once in the thread that needs its result.

    later = Deferred(commit_next_cohort, delay_s=3.5)   # fires on its own thread after 3.5 s ...
    ahead = later.take()                                 # ... or now, here, if it has not fired yet

A worker under committed draws commits its next cohort while it draws the current one
(`security.commit_ahead`, `pnyx.rollout.worker`), as late as the trainer's tick allows: the commitment names
the version the cohort is drawn at, and the later it is written, the newer that version. `take` returns the
call's result or re-raises its error in the caller's thread; `cancel` makes sure it never runs (if it has not
started). Knows nothing about workers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Deferred(Generic[T]):
    """`fn` run exactly once (see the module docstring); `delay_s` <= 0 runs it now, in this thread."""

    def __init__(self, fn: Callable[[], T], delay_s: float):
        self._fn = fn
        self._lock = threading.Lock()
        self._claimed = False
        self._done = threading.Event()
        self._result: T | None = None
        self._error: BaseException | None = None
        self._timer: threading.Timer | None = None
        if delay_s <= 0:
            self._claim()
            self._run()
        else:
            self._timer = threading.Timer(delay_s, self._fire)
            self._timer.daemon = True
            self._timer.start()

    @classmethod
    def of(cls, value: T) -> Deferred[T]:
        """One already settled with `value`."""
        return cls(lambda: value, 0.0)

    def take(self) -> T:
        """The call's result: run here if the timer has not fired yet, else waited for. Re-raises its error."""
        if self._timer is not None:
            self._timer.cancel()
        if self._claim():
            self._run()
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]  # set by _run (T may itself be None)

    def cancel(self) -> None:
        """Make sure the call never runs, if it has not started (a running one finishes)."""
        if self._timer is not None:
            self._timer.cancel()
        if self._claim():
            self._done.set()

    def _claim(self) -> bool:
        with self._lock:
            if self._claimed:
                return False
            self._claimed = True
            return True

    def _fire(self) -> None:
        if self._claim():
            self._run()

    def _run(self) -> None:
        try:
            self._result = self._fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller of take()
            self._error = e
        finally:
            self._done.set()
