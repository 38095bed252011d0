"""The prefetcher: while the trainer steps and publishes, a background thread prepares the next batch.

`ahead(version, in_flight)` tells it which step comes next (the version it will train from, and the keys
of the batch being trained now, which will be used by then). Once per step, late in it (`LATE` of the
recent step time, and at most every `list_interval_s`), it lists the two newest versions (where uploads
land; the whole window when the main loop is short of groups, `poke()`), then fetches, decodes, validates
and re-scores the top of the next step's ranking (`Ingestor.plan`) in the ingestor's bounded fetch pool,
round after round until the top is known (no over-fetch: the latency is hidden behind the step), then
sweeps versions that left the window. Listing late matters: what is fetched then stays at the top of the
next step's ranking (a later upload of the same version ranks after it), so prefetched groups are rarely
downloaded for nothing. `Ingestor.select` then finds those records ready; what it takes is decided by the
ranking alone, never by what the prefetcher happened to fetch, so resume stays exact.

`next_batch` is the main loop's wait for a batch: select, and short of groups, poke and wait for the
listing with backoff. Memory is bounded by the ingestor (about two steps of fetched records).

Every error of the thread is kept and re-raised in the main loop by `check()`, except an unavailable
store, which is logged and retried with backoff (the store's own retries already ran). Knows nothing
about torch or the optimizer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pnyx.errors import StoreUnavailableError
from pnyx.store.retry import Backoff
from pnyx.train.ingest import Ingestor, ScoredGroup

log = logging.getLogger("pnyx.train.prefetch")

LIST_INTERVAL_S = 0.5
"""The prefetcher lists at most this often unless the main loop is short of groups (`poke`)."""
LATE = 0.7
"""A running step's listing happens this far into it (as a share of the recent step time)."""
REFRESH_DEPTH = 2
"""A refresh between steps lists at most this many of the newest versions (the full window when short)."""
ROUNDS = 32
"""At most this many fetch rounds per wake (a round waits for one parallel fetch of the top's unknowns)."""
IDLE_S = 5.0
"""With nothing asked of it, the thread still wakes this often (sweeps are due on a timer)."""
POKE_MAX_S = 1.0
"""A trainer short of groups asks for a listing at most this often, once its backoff has grown."""
POKE_BASE_S = 0.05
"""...and at first this often: the groups it lacks are usually landing (at the default supply lead a
worker makes the next batch while the trainer steps), and a 0.2 s first pause was on the critical path of
a third of the steps of `bench_async.py --arm equal` (1 LIST per pause: ~10 in the first second, then 1/s)."""


class Prefetcher:
    """One background thread working one step ahead of the trainer (see the module docstring)."""

    def __init__(self, ingestor: Ingestor, need: int, list_interval_s: float = LIST_INTERVAL_S):
        if need < 1:
            raise ValueError(f"a step needs at least one group, got {need}")
        self.ingestor = ingestor
        self.need = need
        self.list_interval_s = list_interval_s
        self.error: BaseException | None = None
        self.busy_s = 0.0
        """Seconds the thread spent working (listing, sweeping, fetching): ingestion hidden behind steps."""
        self.planned: tuple[int, list[ScoredGroup]] = (0, [])
        """The next step's version and the top of its ranking as the thread last fetched it (a forecast of
        its batch: fresher uploads may still outrank some of it; `WaitWork` measures its stale rows ahead)."""
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._listed = threading.Condition()
        self._generation = 0  # listings completed
        self._target: tuple[int, frozenset[str]] | None = None
        self._step_started: float | None = None  # when the step now running started (monotonic)
        self._step_s: float | None = None  # smoothed time from one step's start to the next
        self._refreshed = True  # the step now running has had its listing
        self._poked = False
        self._last_list = float("-inf")  # monotonic time of the last listing
        self._thread: threading.Thread | None = None

    # --- control (main thread) -----------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pnyx-prefetch", daemon=True)
            self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        """Stop the thread; waits at most `timeout` (a store call in flight is abandoned with the process)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def check(self) -> None:
        """Re-raise, in the calling thread, the error that ended the background thread."""
        if self.error is not None:
            raise self.error

    def ahead(self, version: int, in_flight: frozenset[str] | set[str] | list[str] = frozenset()) -> None:
        """The next step trains from `version`; `in_flight` keys (the batch of the step that starts now,
        if any) will have been used by then."""
        now = time.monotonic()
        if in_flight:
            if self._step_started is not None:
                took = now - self._step_started
                self._step_s = took if self._step_s is None else 0.5 * self._step_s + 0.5 * took
            self._step_started = now
            self._refreshed = False
        self._target = (version, frozenset(in_flight))
        self._wake.set()

    def poke(self) -> None:
        """List now (the main loop is waiting for groups)."""
        self._poked = True
        self._wake.set()

    def wait_listing(self, timeout: float) -> bool:
        """Wait until a listing that started after this call has finished (False on timeout)."""
        with self._listed:
            start = self._generation
            done = start + (2 if start % 2 == 0 else 3)  # odd: one is running, and it may have missed news
            return self._listed.wait_for(lambda: self._generation >= done or self._stop.is_set(), timeout)

    def next_batch(
        self,
        version: int,
        need: int,
        stop: Callable[[], bool],
        deadline_s: float,
        on_short: Callable[[int], None] | None = None,
        idle: Callable[[list[ScoredGroup]], bool] | None = None,
        ready: Callable[[], bool] | None = None,
    ) -> list[ScoredGroup] | None:
        """The top `need` groups of the ranking for the step at `version` (`Ingestor.select`); short of
        them, ask for a listing and wait for it or for a listing that brings news; asks at most once per
        `POKE_BASE_S` (0.05 s), backing off to `POKE_MAX_S` (a listing that just finished is never re-asked
        for at once: with no groups arriving the trainer would otherwise list the store back to back). None once `stop()` turns true or
        after `deadline_s` without a full batch; `on_short(have)` is told each time it has to wait. A store
        that stays unavailable is retried until the deadline; errors of the thread re-raise here.

        `idle(chosen)` is work the caller does while the batch is short (`chosen`: its groups so far), in
        place of the wait (True: it did some, so the ranking is read again at once; keep each call short, it
        delays seeing a full batch);
        `ready()` is what must be done before a full batch is taken (False: it changed what may be chosen,
        so the ranking is read again)."""
        deadline = time.monotonic() + deadline_s
        pokes = Backoff.polling(cap_s=POKE_MAX_S, base_s=POKE_BASE_S)
        next_poke = 0.0
        while not stop():
            self.check()
            try:
                chosen = self.ingestor.select(version, need, stop=stop)
            except StoreUnavailableError as e:
                log.warning("trainer v=%d store unavailable while ingesting (%s); retrying", version, e)
                chosen = []
            if chosen is None:
                return None
            if len(chosen) >= need:
                if ready is None or ready():
                    return chosen
                continue
            if on_short is not None:
                on_short(len(chosen))
            now = time.monotonic()
            if now > deadline:
                return None
            if now >= next_poke:  # ask for a listing at most once per pause (0.05 s, backing off to 1 s)
                if self._thread is None:  # no background thread (a caller stepping by hand): list here
                    self.ingestor.refresh(version)
                self.poke()
                next_poke = now + pokes.next()
            if idle is not None and idle(chosen):
                continue
            end = min(next_poke, deadline)
            while not stop() and time.monotonic() < end:  # wakes at once on stop, on a listing soon after
                if self.wait_listing(min(0.1, max(0.0, end - time.monotonic()))):
                    break
        return None

    # --- the thread -------------------------------------------------------------------------------------

    def _listing_due(self) -> float:
        """Seconds until the running step's listing is due (0: now); `IDLE_S` when none is pending."""
        if self._poked:
            return 0.0
        if self._refreshed or self._step_started is None:
            return IDLE_S
        due = self._step_started + LATE * (self._step_s or 0.0)
        due = max(due, self._last_list + self.list_interval_s)
        return max(0.0, due - time.monotonic())

    def _run(self) -> None:
        backoff = Backoff(0.2, 5.0)
        while not self._stop.is_set():
            self._wake.wait(self._listing_due())
            self._wake.clear()
            target = self._target
            if self._stop.is_set() or target is None:
                continue
            t0 = time.perf_counter()
            try:
                self._work(*target)
                backoff.reset()
            except StoreUnavailableError as e:
                pause = backoff.next()
                log.warning("trainer prefetch: store unavailable (%s); retrying in %.1fs", e, pause)
                self._stop.wait(pause)
                self._wake.set()
            except BaseException as e:  # noqa: BLE001 - re-raised in the main loop by check()
                self.error = e
                log.error("trainer prefetch failed: %s: %s", type(e).__name__, e)
                return
            finally:
                self.busy_s += time.perf_counter() - t0

    def _work(self, version: int, in_flight: frozenset[str]) -> None:
        """List if due, fetch what the next step needs, then sweep (accounting last: it may be slow).

        A running step gets one listing, late in it (`LATE` of the usual step time): the groups uploaded
        meanwhile are the freshest the next step can have, and what is fetched then stays at the top of
        the next step's ranking (a later upload of the same version ranks after it). Short of groups
        (`poke`), the whole window is listed at once.
        """
        ing = self.ingestor
        if in_flight:
            ing.note_published(version)  # being trained: no group of it can exist before its publish
        if self._listing_due() == 0.0:
            depth = None if self._poked else REFRESH_DEPTH
            self._poked = False
            self._refreshed = True
            self._last_list = time.monotonic()
            with self._listed:
                self._generation += 1  # odd: a listing is running
            try:  # while a step runs, its target version is not published yet: start below it
                newest = version - 1 if in_flight else version
                ing.refresh(newest, min_waiting=self.need + len(in_flight), depth=depth)
            finally:
                with self._listed:
                    self._generation += 1
                    self._listed.notify_all()
        elif in_flight and not self._refreshed:
            return  # fetch after the listing, or the fetch would serve groups the listing will outrank
        ing.audit_skips(wait=True)  # re-scored before the groups: a false skip quarantines its key first
        # Rounds without over-fetch: each fetches only the unknown keys inside the top, and rejections free
        # places for the next round. Latency is hidden behind the step here; over-fetch (which `select`
        # uses, on the critical path) would download groups a fresher listing may outrank.
        for _ in range(ROUNDS):
            if self._stop.is_set():
                return
            plan = ing.plan(version, self.need, in_flight, extra=0)
            self.planned = (version, plan.chosen)
            if plan.unlisted is not None:
                ing.list_version(plan.unlisted, full=True)
                continue
            if not plan.unknown and not plan.extra:
                break
            ing.fetch(plan.unknown + plan.extra, stop=self._stop.is_set)
        ing.sweep(version)
