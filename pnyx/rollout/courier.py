"""The worker's store thread: uploads the spool, reads the trainer's demand, writes the heartbeat.

Once a worker has joined, its generating thread never calls the store: every upload, demand read and
heartbeat goes through this one thread. A store that is slow, down or hanging therefore never holds up
generation, and never holds up a stop: the worker's stop event ends this thread after one final flush
bounded by `final_flush_s`, then the final heartbeat. A put already in flight may overrun that bound by
its own retry deadline; `pnyx worker` bounds the whole process with a hard deadline on top, abandoning
what is left (it is still on disk, see `spool.py`).

    courier = Courier(store, spool, heartbeat=build, on_demand=take, ...); courier.start()
    courier.wake()              # new groups in the spool
    courier.finish(30.0)        # clean end (a quota reached): upload everything, then the final heartbeat
    courier.join(5.0)

Knows nothing about models, envs or supply control: the owner passes callbacks for the heartbeat bytes,
for each demand record read, for expiry and for the demand poll interval. An unexpected error here stops
the thread and is re-raised in the owner's thread by `check()`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from pnyx.errors import NotFoundError, RecordRejected, StoreUnavailableError
from pnyx.protocol import layout
from pnyx.rollout.spool import Spool
from pnyx.store import Store
from pnyx.store.retry import Backoff

log = logging.getLogger("pnyx.worker")

WARN_EVERY_S = 30.0
"""Repeated warnings (heartbeat not written, demand unreadable) are logged at most this often."""


class Courier:
    """One background thread doing a worker's store I/O; see the module docstring."""

    def __init__(
        self,
        store: Store,
        spool: Spool,
        *,
        heartbeat: Callable[[bool], bytes],
        heartbeat_key: str,
        heartbeat_s: float,
        stop: threading.Event,
        on_demand: Callable[[Any], None] | None = None,
        demand_poll_s: Callable[[], float] = lambda: 1.0,
        expired: Callable[[str], bool] | None = None,
        on_progress: Callable[[], None] = lambda: None,
        flush_deadline_s: float = 30.0,
        final_flush_s: float = 3.0,
        max_backoff_s: float = 30.0,
    ):
        self.store = store
        self.spool = spool
        self.heartbeat = heartbeat
        self.heartbeat_key = heartbeat_key
        self.heartbeat_s = heartbeat_s
        self.stop = stop
        self.on_demand = on_demand
        self.demand_poll_s = demand_poll_s
        self.expired = expired
        self.on_progress = on_progress
        self.flush_deadline_s = flush_deadline_s
        self.final_flush_s = final_flush_s
        self.max_backoff_s = max_backoff_s
        self.fatal: BaseException | None = None
        self.final_heartbeat_written = False
        self.done = threading.Event()
        self._wake = threading.Event()
        self._finish = threading.Event()
        self._finish_deadline_s = flush_deadline_s
        self._pause = Backoff(0.5, max_backoff_s, jitter=True)
        self._retry_at = 0.0
        self._warned: dict[str, float] = {}
        self._thread: threading.Thread | None = None

    # -- control (any thread) --

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pnyx-worker-courier", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Something changed (new groups, a stop): look at the spool now."""
        self._wake.set()

    def finish(self, deadline_s: float) -> None:
        """End cleanly: upload everything (for at most `deadline_s`), write the final heartbeat, stop."""
        self._finish_deadline_s = deadline_s
        self._finish.set()
        self._wake.set()

    def join(self, timeout_s: float) -> bool:
        """Wait for the thread to end; False if it is still running (stuck in a store call) after the timeout."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self.done.is_set()

    def check(self) -> None:
        """Re-raise, in the caller's thread, an unexpected error that ended this thread."""
        if self.fatal is not None:
            raise self.fatal

    def last_flush(self, deadline_s: float) -> None:
        """After the thread ended on a stop (its final flush ran when the stop came): upload, in the caller's
        thread and within `deadline_s`, what the generating thread spooled since (the cohort it finished, and
        one it had committed ahead: `pnyx.rollout.worker`), then write the final heartbeat again. Nothing when
        the thread is still running or ended on an error, or when its last flush failed (the store is down:
        the spool keeps the groups for the next start)."""
        if not self.done.is_set() or self.fatal is not None or not len(self.spool):
            return
        if self._retry_at > time.monotonic():
            return
        self._flush(deadline_s, stop=None)
        self._beat(final=True)

    def drained(self) -> bool:
        return len(self.spool) == 0

    # -- the thread --

    def _run(self) -> None:
        try:
            demand_at = 0.0 if self.on_demand is not None else float("inf")
            beat_at = 0.0
            while not self.stop.is_set() and not self._finish.is_set():
                if time.monotonic() >= demand_at:  # first: what the trainer can use decides what to upload
                    self._read_demand()
                    demand_at = time.monotonic() + self.demand_poll_s()
                if len(self.spool) and time.monotonic() >= self._retry_at:
                    self._flush(self.flush_deadline_s, stop=self.stop)
                if time.monotonic() >= beat_at:
                    self._beat(final=False)
                    beat_at = time.monotonic() + self.heartbeat_s
                due = min(demand_at, beat_at, self._retry_at if len(self.spool) else float("inf"))
                self._wake.wait(max(0.0, min(due - time.monotonic(), 5.0)))
                self._wake.clear()
            # one final flush: bounded when stopping, thorough when finishing a quota
            self._flush(self._finish_deadline_s if not self.stop.is_set() else self.final_flush_s, stop=None)
            self._beat(final=True)
        except BaseException as e:  # noqa: BLE001 - handed to the owner's thread by check()
            self.fatal = e
            log.error("worker store thread stopped on an error: %s: %s", type(e).__name__, e)
        finally:
            self.done.set()

    def _flush(self, deadline_s: float, stop: threading.Event | None) -> None:
        before = self.spool.stats.failed_flushes
        uploaded = self.spool.flush(self.store, deadline_s, expired=self.expired, stop=stop)
        if self.spool.stats.failed_flushes > before:
            self._retry_at = time.monotonic() + self._pause.next()
        else:
            self._pause.reset()
            self._retry_at = 0.0
        if uploaded:
            self.on_progress()

    def _read_demand(self) -> None:
        from pnyx.protocol import Demand, decode_json

        try:
            demand = decode_json(self.store.get(layout.WEIGHTS_DEMAND), Demand)
        except NotFoundError:
            return  # the trainer has not published its first demand yet
        except (StoreUnavailableError, RecordRejected) as e:
            self._warn("demand", f"trainer demand not read ({e}); pacing by the last one")
            return
        if self.on_demand is not None:
            self.on_demand(demand)

    def _beat(self, final: bool) -> None:
        try:
            self.store.put(self.heartbeat_key, self.heartbeat(final), mode="overwrite")
            if final:
                self.final_heartbeat_written = True
        except StoreUnavailableError as e:
            self._warn("heartbeat", f"heartbeat not written (store unavailable): {e}")

    def _warn(self, what: str, message: str) -> None:
        now = time.monotonic()
        if now - self._warned.get(what, -WARN_EVERY_S) >= WARN_EVERY_S:
            self._warned[what] = now
            log.warning(message)
