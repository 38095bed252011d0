"""The exact checks the trainer does off its step's path: while it waits for a batch, before it takes one,
and on a background thread while the step trains (rank 0).

`Prefetcher.next_batch` calls `WaitWork.idle` while the batch is short, in time the trainer would spend
waiting, and `WaitWork.ready` before a full batch is taken. Both do exact forwards under the published
weights of a group's own version (`Rejudge`):
- the check of skip records' draws (`audit_skip_draws`): each queued record's chosen samples must be the
  draws of its seeded uniforms, or its key is quarantined (`false_skip`). A few while waiting, and every
  record still queued before a full batch is taken, so a forger's key is out before its groups train.
- the stale rows of the batch so far, measured ahead (`precheck_rows`): the step's forward runs on newer
  weights and flags most of them, and each flagged row then needs an exact forward on the step's path. A
  row's distance under its own version's weights does not depend on when it is measured, so the step
  reads it instead (`Rejudge.precheck`).

A background thread (`start`) does both while the step trains: skip records' draws as soon as they are
re-scored, and, with none queued, the rows of the groups in the prefetcher's forecast of the next batch
(`Prefetcher.planned`) that will be at least `BACKGROUND_STALENESS` versions behind it (flagged by the
step's forward 53-82% of the time). The exact forwards run on the CPU in fp32 whatever device trains, so on
a GPU trainer they use cores the step leaves idle, and on a CPU trainer the core a worker paced by supply
control leaves idle when the trainer is the fleet's bottleneck (`security.background_checks`). A record
the thread has not reached when a batch is full is checked on the step's path as before (`ready`), and the
trainer's own calls go first (`Rejudge.draws`). While the trainer's thread waits for a batch it does this
work itself and the background thread pauses (`choosing`).

Their figures go into the step's metrics (`skip_audit`, `precheck`, and `checks_background`, a running total
of the thread's; docs/security.md, "Seeded draws").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from pnyx.train.microbatch import build_rows

if TYPE_CHECKING:
    from pnyx.config_sections import SecurityConfig
    from pnyx.train.ingest import Ingestor, ScoredGroup
    from pnyx.train.rejudge import Rejudge

T = TypeVar("T")
log = logging.getLogger("pnyx.trainer")

IDLE_AUDITS = 4
"""Skip records whose draws are checked per call while the trainer waits for a batch: each call delays
seeing a full batch by their forward, ~0.3 s on SmolLM2-135M on one thread."""
IDLE_PRECHECKS = 1
"""Stale groups of the batch so far whose rows are measured per call while the trainer waits and no skip
record is queued: one group's forward, about as long as `IDLE_AUDITS` skip records'."""
PRECHECKED_KEYS = 8192
"""Groups remembered as measured ahead at most (then forgotten at once; `Rejudge` keeps the measurements)."""
BACKGROUND_AUDITS = 2
"""Skip records checked per turn of the background thread: the step's own exact check waits at most for one
turn's forward (~0.2 s on SmolLM2-135M on one thread; the first records of an untrusted key are checked
whole, 8 rows each)."""
BACKGROUND_POLL_S = 0.2
"""With nothing to do, the background thread looks again this often."""
BACKGROUND_STALENESS = 2
"""The background thread measures ahead the forecast groups this many versions behind the next step or more:
at staleness 1 the step's forward flags about a third of the rows (SmolLM2 recipe), so measuring every row
ahead would spend three forwards for each one saved; at 2-3, 53-82%."""


class WaitWork:
    """The exact checks done while a step's batch is chosen (see the module docstring); `skip_audit` and
    `precheck` are the current step's metrics (None: nothing done)."""

    def __init__(self, ingestor: Ingestor, rejudge: Rejudge | None, security: SecurityConfig):
        self.ingestor, self.security = ingestor, security
        self.rejudge = rejudge if security.seeded_draws else None
        self.skip_audit: dict[str, Any] | None = None
        """The current step's check of skip records by the trainer's own thread (only it writes this):
        `groups`, `rows`, `false`, `s` on the step's path, `idle_groups` and `idle_s` in its wait."""
        self.precheck: dict[str, Any] | None = None
        self.error: BaseException | None = None
        """What ended the background thread (re-raised in the trainer's thread by `idle` and `ready`)."""
        self._background = {
            "groups": 0,
            "rows": 0,
            "false": 0,
            "s": 0.0,
            "pre_groups": 0,
            "pre_rows": 0,
            "pre_s": 0.0,
        }
        self._lock = threading.Lock()  # the metrics, written by both threads
        self._prechecked: set[str] = set()  # groups measured ahead, so a failed measurement is not retried
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._flight = threading.Condition()  # guards the two counts below
        self._in_flight = 0  # background turns under way: taken from the queue, verdict not yet filed
        self._paused = 0  # the trainer's thread chooses a batch (`choosing`, `ready`): no turn starts
        self._false_seen = 0  # the background thread's false records `ready` has reported

    @property
    def background(self) -> dict[str, Any]:
        """The background thread's work since the trainer started (a copy): skip records checked (`groups`,
        `rows`, `false`, `s`) and forecast stale rows measured ahead (`pre_groups`, `pre_rows`, `pre_s`)."""
        with self._lock:
            return dict(self._background)

    def new_step(self) -> None:
        """A new step's batch is about to be chosen: its metrics start empty."""
        with self._lock:
            self.skip_audit = self.precheck = None

    def start(
        self,
        version: Callable[[], int],
        planned: Callable[[], tuple[int, list[ScoredGroup]]] = lambda: (0, []),
    ) -> None:
        """Start the background checks (`version()`: the trainer's version now; `planned()`: the next step's
        version and forecast batch, `Prefetcher.planned`), when draws are checked and
        `security.background_checks` is on."""
        if self.rejudge is None or not self.security.background_checks or self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._run, args=(version, planned), name="pnyx-checks", daemon=True
        )
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the background thread (waits at most `timeout` for the forward under way)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self, version: Callable[[], int], planned: Callable[[], tuple[int, list[ScoredGroup]]]) -> None:
        while not self._stop.is_set():
            with self._flight:  # paused while the trainer's thread does this work in its own wait
                if not self._flight.wait_for(lambda: self._paused == 0, BACKGROUND_POLL_S):
                    continue
                self._in_flight += 1  # before the records leave the queue: `ready` waits for them
            try:
                done = self.audit_skip_draws(version(), BACKGROUND_AUDITS, background=True)
            except BaseException as e:  # noqa: BLE001 - re-raised in the trainer's thread by `check`
                self.error = e
                log.error("trainer background checks failed: %s: %s", type(e).__name__, e)
                return
            finally:
                with self._flight:
                    self._in_flight -= 1
                    self._flight.notify_all()
            if done is None and not self._measure_planned(*planned()):
                self._stop.wait(BACKGROUND_POLL_S)

    def check(self) -> None:
        """Re-raise, in the calling thread, the error that ended the background thread."""
        if self.error is not None:
            raise self.error

    def idle(self, version: int, chosen: list[ScoredGroup]) -> bool:
        """`Prefetcher.next_batch`'s `idle` for the step at `version`: a few skip records, else a stale
        group of the batch so far (`chosen`). Returns whether it did any."""
        self.check()
        return self.audit_skip_draws(version, IDLE_AUDITS) is not None or self.precheck_rows(version, chosen)

    def ready(self, version: int) -> bool:
        """`Prefetcher.next_batch`'s `ready`: every queued skip record checked; False if one was false (its
        key is quarantined, so the ranking must be read again). The background thread takes no record
        meanwhile, and its turn under way is waited for first (its records have left the queue; the wait
        counts as `s`, on the step's path); a false record it found since the last call also means False
        (the batch so far was chosen before its key was quarantined)."""
        t0 = time.perf_counter()
        with self._pause():
            with self._flight:
                self._flight.wait_for(lambda: self._in_flight == 0 or self.error is not None)
            self.check()
            with self._lock:
                if (waited := time.perf_counter() - t0) > 1e-3:
                    m = self.skip_audit = self.skip_audit or _empty_audit()
                    m["s"] = round(m["s"] + waited, 4)
                found, self._false_seen = (
                    self._background["false"] - self._false_seen,
                    self._background["false"],
                )
            return not self.audit_skip_draws(version) and not found

    def audit_skip_draws(
        self, version: int, limit: int | None = None, background: bool = False
    ) -> int | None:
        """The exact check of the tokens of the skip records re-scored and not yet checked
        (`Ingestor.take_draw_audits`: each record's chosen samples, at most `limit` records): each must be
        the draws of its seeded uniforms under the published weights of its version (`Rejudge.draws`), or
        its key is quarantined (`false_skip`). With `limit`, in time the trainer would spend waiting
        (`idle_s`, `idle_groups` in `skip_audit`); without, on the step's path (`s`); `background`: on the
        background thread (`background`). Returns how many records were false; None when nothing was
        checked."""
        audits = self.ingestor.take_draw_audits(version, limit)
        if not audits or self.rejudge is None:
            return None
        t0 = time.perf_counter()
        chosen = {a.group.key: a for a in audits}
        rows = [r for r in build_rows([a.group for a in audits]) if chosen[r.key].checks(r.index)]
        worst: dict[str, float] = {}
        for row, d in zip(rows, self.rejudge.draws(rows, background=background), strict=True):
            worst[row.key] = max(d, worst.get(row.key, 0.0))
        tol = self.security.draw_tolerance
        bad = self.ingestor.draws_audited(audits, [worst.get(a.group.key, 0.0) for a in audits], tol)
        took = time.perf_counter() - t0
        with self._lock:
            if background:
                m = self._background
            else:
                m = self.skip_audit = self.skip_audit or _empty_audit()
                if limit is not None:
                    m["idle_groups"] += len(audits)
            m["groups"] += len(audits)
            m["rows"] += len(rows)
            m["false"] += bad
            spent = "idle_s" if limit is not None and not background else "s"
            m[spent] = round(m[spent] + took, 4)
        return bad

    def precheck_rows(self, version: int, chosen: list[ScoredGroup]) -> bool:
        """Measure exactly, under the published weights of their version (`Rejudge.precheck`), the rows of
        `IDLE_PRECHECKS` of the stalest groups of the batch so far (`chosen`) older than `version`, the one
        the step trains from: its forward flags most such rows (at staleness 1-3 on the SmolLM2 recipe,
        33%, 53% and 82% of them), and the step then reads their distance instead of a forward (`known` in
        `precheck`, counted by `reading`). Returns whether it measured any."""
        return self._precheck(chosen, lambda g: g.version < version, IDLE_PRECHECKS, background=False)

    def _measure_planned(self, version: int, planned: list[ScoredGroup]) -> bool:
        """A turn of the background thread with no skip record queued: measure ahead the stalest group of
        the next step's forecast batch (`planned`, at `version`) at least `BACKGROUND_STALENESS` versions
        behind it (`pre_groups`, `pre_rows`, `pre_s` in `background`). Returns whether it measured any."""
        return self._precheck(
            planned, lambda g: version - g.version >= BACKGROUND_STALENESS, 1, background=True
        )

    def _precheck(
        self, groups: list[ScoredGroup], stale: Callable[[ScoredGroup], bool], n: int, background: bool
    ) -> bool:
        """Measure the rows of the `n` stalest of `groups` that are `stale` and not measured before."""
        if self.rejudge is None:
            return False
        with self._lock:
            todo = sorted(
                (g for g in groups if stale(g) and g.key not in self._prechecked), key=lambda g: g.version
            )[:n]
        if not todo:
            return False
        t0 = time.perf_counter()
        rows = self.rejudge.precheck(build_rows(todo), background=background)
        took = time.perf_counter() - t0
        with self._lock:
            if len(self._prechecked) > PRECHECKED_KEYS:
                self._prechecked.clear()
            self._prechecked.update(g.key for g in todo)
            if background:
                m, prefix = self._background, "pre_"
            else:
                m, prefix = self.precheck or {"groups": 0, "rows": 0, "s": 0.0}, ""
                self.precheck = m
            m[prefix + "groups"] += len(todo)
            m[prefix + "rows"] += rows
            m[prefix + "s"] = round(m[prefix + "s"] + took, 4)
        return True

    def choosing(self, choose: Callable[[], T]) -> T:
        """Run `choose` (the wait for a batch: `Prefetcher.next_batch`), during which the background thread
        starts no new turn: the trainer's thread checks in its wait (`idle`), where a second thread would
        only take the core a worker generates on."""
        with self._pause():
            return choose()

    @contextmanager
    def _pause(self) -> Iterator[None]:
        """No background turn starts inside (`_paused`; one under way finishes)."""
        with self._flight:
            self._paused += 1
        try:
            yield
        finally:
            with self._flight:
                self._paused -= 1
                self._flight.notify_all()

    def reading(self, train: Callable[[], T]) -> T:
        """Run `train` (the step) and count, as `known` in `precheck`, the rows its exact re-check read
        from measurements made ahead."""
        before = self.rejudge.known_rows if self.rejudge is not None else 0
        out = train()
        if self.rejudge is not None and (read := self.rejudge.known_rows - before):
            with self._lock:
                self.precheck = {"groups": 0, "rows": 0, "s": 0.0, **(self.precheck or {}), "known": read}
        return out


def _empty_audit() -> dict[str, Any]:
    """A step's `skip_audit` before anything is counted."""
    return {"groups": 0, "rows": 0, "false": 0, "s": 0.0, "idle_groups": 0, "idle_s": 0.0}
