"""What the trainer does while it waits for a batch, and before it takes one (rank 0).

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

Their figures go into the step's metrics (`skip_audit`, `precheck`; docs/security.md, "Seeded draws").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from pnyx.train.microbatch import build_rows

if TYPE_CHECKING:
    from pnyx.config_sections import SecurityConfig
    from pnyx.train.ingest import Ingestor, ScoredGroup
    from pnyx.train.rejudge import Rejudge

T = TypeVar("T")

IDLE_AUDITS = 4
"""Skip records whose draws are checked per call while the trainer waits for a batch: each call delays
seeing a full batch by their forward, ~0.3 s on SmolLM2-135M on one thread."""
IDLE_PRECHECKS = 1
"""Stale groups of the batch so far whose rows are measured per call while the trainer waits and no skip
record is queued: one group's forward, about as long as `IDLE_AUDITS` skip records'."""
PRECHECKED_KEYS = 8192
"""Groups remembered as measured ahead at most (then forgotten at once; `Rejudge` keeps the measurements)."""


class WaitWork:
    """The exact checks done while a step's batch is chosen (see the module docstring); `skip_audit` and
    `precheck` are the current step's metrics (None: nothing done)."""

    def __init__(self, ingestor: Ingestor, rejudge: Rejudge | None, security: SecurityConfig):
        self.ingestor, self.security = ingestor, security
        self.rejudge = rejudge if security.seeded_draws else None
        self.skip_audit: dict[str, Any] | None = None
        self.precheck: dict[str, Any] | None = None
        self._prechecked: set[str] = set()  # groups measured ahead, so a failed measurement is not retried

    def new_step(self) -> None:
        """A new step's batch is about to be chosen: its metrics start empty."""
        self.skip_audit = self.precheck = None

    def idle(self, version: int, chosen: list[ScoredGroup]) -> bool:
        """`Prefetcher.next_batch`'s `idle` for the step at `version`: a few skip records, else a stale
        group of the batch so far (`chosen`). Returns whether it did any."""
        return self.audit_skip_draws(version, IDLE_AUDITS) is not None or self.precheck_rows(version, chosen)

    def ready(self, version: int) -> bool:
        """`Prefetcher.next_batch`'s `ready`: every queued skip record checked; False if one was false (its
        key is quarantined, so the ranking must be read again)."""
        return not self.audit_skip_draws(version)

    def audit_skip_draws(self, version: int, limit: int | None = None) -> int | None:
        """The exact check of the tokens of the skip records re-scored and not yet checked
        (`Ingestor.take_draw_audits`: each record's chosen samples, at most `limit` records): each must be
        the draws of its seeded uniforms under the published weights of its version (`Rejudge.draws`), or
        its key is quarantined (`false_skip`). With `limit`, in time the trainer would spend waiting
        (`idle_s`, `idle_groups` in `skip_audit`); without, on the step's path (`s`). Returns how many
        records were false; None when nothing was checked."""
        audits = self.ingestor.take_draw_audits(version, limit)
        if not audits or self.rejudge is None:
            return None
        t0 = time.perf_counter()
        chosen = {a.group.key: a for a in audits}
        rows = [r for r in build_rows([a.group for a in audits]) if chosen[r.key].checks(r.index)]
        worst: dict[str, float] = {}
        for row, d in zip(rows, self.rejudge.draws(rows), strict=True):
            worst[row.key] = max(d, worst.get(row.key, 0.0))
        tol = self.security.draw_tolerance
        bad = self.ingestor.draws_audited(audits, [worst.get(a.group.key, 0.0) for a in audits], tol)
        m = self.skip_audit or {"groups": 0, "rows": 0, "false": 0, "s": 0.0, "idle_groups": 0, "idle_s": 0.0}
        m["groups"] += len(audits)
        m["rows"] += len(rows)
        m["false"] += bad
        spent = "s" if limit is None else "idle_s"
        m[spent] = round(m[spent] + time.perf_counter() - t0, 4)
        if limit is not None:
            m["idle_groups"] += len(audits)
        self.skip_audit = m
        return bad

    def precheck_rows(self, version: int, chosen: list[ScoredGroup]) -> bool:
        """Measure exactly, under the published weights of their version (`Rejudge.precheck`), the rows of
        `IDLE_PRECHECKS` of the stalest groups of the batch so far (`chosen`) older than `version`, the one
        the step trains from: its forward flags most such rows (at staleness 1-3 on the SmolLM2 recipe,
        33%, 53% and 82% of them), and the step then reads their distance instead of a forward (`known` in
        `precheck`, counted by `reading`). Returns whether it measured any."""
        if self.rejudge is None:
            return False
        todo = sorted(
            (g for g in chosen if g.version < version and g.key not in self._prechecked),
            key=lambda g: g.version,
        )[:IDLE_PRECHECKS]
        if not todo:
            return False
        t0 = time.perf_counter()
        rows = self.rejudge.precheck(build_rows(todo))
        if len(self._prechecked) > PRECHECKED_KEYS:
            self._prechecked.clear()
        self._prechecked.update(g.key for g in todo)
        m = self.precheck or {"groups": 0, "rows": 0, "s": 0.0}
        m["groups"] += len(todo)
        m["rows"] += rows
        m["s"] = round(m["s"] + time.perf_counter() - t0, 4)
        self.precheck = m
        return True

    def reading(self, train: Callable[[], T]) -> T:
        """Run `train` (the step) and count, as `known` in `precheck`, the rows its exact re-check read
        from measurements made ahead."""
        before = self.rejudge.known_rows if self.rejudge is not None else 0
        out = train()
        if self.rejudge is not None and (read := self.rejudge.known_rows - before):
            self.precheck = {"groups": 0, "rows": 0, "s": 0.0, **(self.precheck or {}), "known": read}
        return out
