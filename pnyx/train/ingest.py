"""Ingestion: from rollout keys in the store to scored groups for one step, at a cost sized to the step.

The trainer at version V may train on groups of versions [V - max_staleness, V] (the window). It lists each
version's prefix incrementally (`listing.py`, the `Ingestor`'s listing collaborator: keys are stamped, so a
listing starts just below the highest stamp seen), ranks the listed keys **from the listing alone** (fresh
before replayed; a share of the batch to groups in their last step of the window; newest version first, then
workers take turns, each worker's oldest group first: `ranking.py`), and fetches
only the top of that ranking, in parallel (`fetch`): decode, validate (limits, key vs record, run, weights
digest, env, task, prompt), **re-score every sample with the trainer's own verifier**, compute advantages, and
drop zero-variance groups. The per-prompt cap (`max_groups_per_prompt` per step) needs the task id, which is
inside the record, so it is applied after fetching; a selection on the critical path fetches a few places
below the top too, sized by the recent share of groups that survive (`BatchPlanner._extra`). A group the
window will never train on is never downloaded: when its version leaves the window the prefix is listed one
last time and every key not consumed or rejected is counted `stale` (after `sweep_grace_s`, so uploads that
land late are counted too). Junk keys (`bad_key`) and a second key for the same (worker, seq) (`duplicate`)
are counted from the listing alone as well.

`select` is deterministic given the listing and the records: it repeats "rank, fetch what the top needs"
until the top `n` are all known, with listings held back while it runs, so which groups a step takes does
not depend on what happened to be prefetched (the kill tests compare a resumed run with an uninterrupted one). `prefetch.py` runs the same
ranking ahead, in a background thread, while the trainer steps.

Knows nothing about torch or models: text comes from an injected `detokenize` callable and prompts from an
optional `render` callable, so this module is testable with plain bytes. Thread-safe: one lock guards the
listings, the cursor and the fetched groups; store I/O and scoring run outside it.

Identity (docs/security.md): with `require_signatures` (the trainer's setting) every record must be a signed
frame; the signature is checked before anything is inflated or decoded (`unsigned`, `bad_signature`), and
a worker name is bound to the first key whose valid group used it, in the cursor: a later group under that
name signed by another key is an `id_theft`. With the run's sampling settings in `IngestSettings` (the
trainer's), a group that claims other settings (`sampling_mismatch`) or a model turn past the budget
(`over_budget`) is dropped before it is scored. Counters per key (`Cursor.by_key`) follow keys, not names
(`key_ledger.py`).

Layout: the `Ingestor` owns four collaborators, one module each, none a subclass of another, each given what
it uses (the cursor, the settings, the one lock, the fetched groups) when it is built: `self.listing`
(`listing.py`, `WindowListings`: the window's listings, pending keys per version, the sweep, rejections),
`self.ledger` (`key_ledger.py`, `KeyLedger`: counters per key, names bound to keys, the flood limit,
quarantine, `key_report`; it rejects through the listing, and is the listing's `KeyGate`, connected once both
exist) and `self.planner` (`planner.py`, `BatchPlanner`: the ranking walk under the caps, `plan`, `commit`; it
reads the listing and books through the ledger), and `self.admission` (`admission.py`, `Admission`: fetch,
verify, re-score and file one key, `fetch`, `load`; the trainer sets its hooks, `decode`, `run_id`,
`check_draws`); `ingest_state.py` holds `IngestSettings` and the `Cursor` (`skip_audit.py` audits skip records,
`flood_audit.py` reads a key's listed records before it is quarantined as a flooder).
This module adds `select`, `poll` (exhaustive, for
tools and tests; the trainer counts what waits with `waiting`, from what it already holds) and what the trainer
reports, and keeps the collaborators' methods the rest of the trainer calls on it.

Invariants:
- the `Cursor` (uses and rejections of keys in the window, counters, the sweep mark) is the only state that
  survives a restart; it holds only keys of versions not yet swept, so it is bounded by what the window
  consumes and rejects, never by the length of the run or by what workers upload;
- a group's use count changes only through `commit`, so a group is used at most once per step and at most
  `max_reuse` times overall; reward disagreements and re-scored samples are counted when a group is
  consumed or rejected, so a restart never counts a group twice.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from pnyx.envs.base import Environment, Prompt
from pnyx.protocol.records import RolloutGroup
from pnyx.security.calibration import Allowances, ProbeRow
from pnyx.store import Store
from pnyx.train.admission import Admission
from pnyx.train.flood_audit import FloodAudits
from pnyx.train.ingest_state import Cursor, IngestSettings
from pnyx.train.key_ledger import KeyLedger
from pnyx.train.listing import SWEEP_GRACE_S, Shared, WindowListings
from pnyx.train.planner import BatchPlanner
from pnyx.train.ranking import Plan
from pnyx.train.rescore import ScoredGroup, decode_record
from pnyx.train.skip_audit import DrawAudit, SkipAudits

log = logging.getLogger("pnyx.train.ingest")

FETCH_WORKERS = 16
"""Parallel GETs (and re-scores) of one trainer."""
OUTCOMES = 256
"""How many recent admissions the survival rate and the zero-variance share are measured over."""


class Ingestor:
    """Listing, ranking, fetching, validation and re-scoring of one run's rollout groups.

    `env` is the run's environment (`task`, `score`); `detokenize(ids) -> str` turns completion tokens into
    the text the verifier scores; `render(prompt) -> ids` (optional) re-renders a task's prompt so a group
    whose prompt tokens do not match its task id is rejected; `expected_digest(version)` (optional) gives
    the published chain digests a group of that version may carry (one per plane: bf16 weights, int8);
    `require_signatures`: refuse records that are not signed frames, and bind worker names to keys (the
    trainer sets it).
    """

    def __init__(
        self,
        store: Store,
        env: Environment,
        detokenize: Callable[[list[int]], str],
        settings: IngestSettings | None = None,
        cursor: Cursor | None = None,
        run_id: str | None = None,
        vocab_size: int | None = None,
        render: Callable[[Prompt], list[int]] | None = None,
        expected_digest: Callable[[int], frozenset[str] | None] | None = None,
        decode: Callable[[bytes, int | None], RolloutGroup] = decode_record,
        fetch_workers: int = FETCH_WORKERS,
        sweep_grace_s: float = SWEEP_GRACE_S,
        require_signatures: bool = False,
        check_draws: Callable[[ScoredGroup], str | None] | None = None,
    ) -> None:
        self.store = store
        self.shared = Shared(
            cursor if cursor is not None else Cursor(seqs_from_zero=True), settings or IngestSettings()
        )
        """The one lock, the cursor, the settings and the fetched groups, shared with the collaborators."""
        self._selecting = threading.RLock()  # held by `select`: listings merge before or after it
        # After close(), results of abandoned calls no longer touch the state.
        closed = threading.Event()
        futures: dict[str, Future] = {}  # key -> its fetch in flight
        outcomes: deque[str] = deque(maxlen=OUTCOMES)  # "ok", "zv_hard/easy/flat", or a reason
        self.listing = WindowListings(
            store, self.shared, selecting=self._selecting, closed=closed, sweep_grace_s=sweep_grace_s
        )
        self.ledger = KeyLedger(self.listing, self.shared, in_flight=futures)
        self.listing.gate = self.ledger  # built second: it rejects through the listing
        self.admission = Admission(
            store, env, detokenize, self.shared, self.listing, self.ledger,
            futures=futures, outcomes=outcomes, closed=closed, fetch_workers=fetch_workers,
            require_signatures=require_signatures, run_id=run_id, vocab_size=vocab_size, render=render,
            expected_digest=expected_digest, decode=decode, check_draws=check_draws,
        )  # fmt: skip
        """Fetching, verifying and re-scoring records (`admission.py`); the trainer sets its hooks."""
        self.listing.read_signer = self.admission.read_signer
        self.floods = FloodAudits(
            self.shared, self.listing, self.ledger, self.admission.flood_verdict, self.admission.pool,
            closed, futures,
        )  # fmt: skip
        """The reads that prove a flood before its key is quarantined (`flood_audit.py`)."""
        self.skips = SkipAudits(
            self.shared, self.listing, self.ledger, self.admission.load, self.admission.pool, closed
        )
        """The audit of skip records (`skip_audit.py`)."""
        self.planner = BatchPlanner(self.listing, self.ledger, self.shared, outcomes=outcomes)
        self.commit = self.planner.commit
        """`BatchPlanner.commit`: record that one step consumed these groups (each once)."""
        self.fetch = self.admission.fetch
        """`Admission.fetch`: admit keys in parallel; how many awaited keys the store could not give."""
        self.load = self.admission.load
        """`Admission.load`: fetch, validate and re-score one group (no filters, no counters)."""
        self.load_many = self.admission.load_many
        """`Admission.load_many`: `load` of every key, in parallel, in order."""
        self.close = self.admission.close
        """`Admission.close`: stop the fetch threads; results of abandoned fetches are ignored."""

    @property
    def settings(self) -> IngestSettings:
        """The filters and caps of ingestion (read-only: the collaborators were built with them)."""
        return self.shared.settings

    @property
    def cursor(self) -> Cursor:
        """The ingestion state persisted with every checkpoint (shared by the collaborators)."""
        return self.shared.cursor

    @cursor.setter
    def cursor(self, cursor: Cursor) -> None:
        """Replace the cursor (a resumed run's, `pnyx.train.resume`) in the ingestor and its collaborators."""
        with self.shared.lock:
            self.shared.cursor = cursor

    def cursor_json(self) -> bytes:
        """The cursor as JSON, taken under the lock (background fetches keep filing results meanwhile)."""
        with self.shared.lock:
            return self.cursor.to_json()

    # --- skip records: `skip_audit.SkipAudits` ----------------------------------------------------------

    def audit_skips(self, wait: bool = False) -> None:
        """Settle the flood suspects the listings named (`FloodAudits.audit`: a quarantined flooder's skip
        records are never read), then `SkipAudits.audit_skips`: re-score the skip records listed since the
        last call."""
        self.floods.audit()
        self.skips.audit_skips(wait)

    def take_draw_audits(self, version: int | None = None, limit: int | None = None) -> list[DrawAudit]:
        """`SkipAudits.take_draw_audits`."""
        return self.skips.take_draw_audits(version, limit)

    def draws_audited(self, audits: list[DrawAudit], worst: list[float], tolerance: float) -> int:
        """`SkipAudits.draws_audited`."""
        return self.skips.draws_audited(audits, worst, tolerance)

    # --- selection ------------------------------------------------------------------------------------

    def select(
        self, version: int, n: int, stop: Callable[[], bool] | None = None
    ) -> list[ScoredGroup] | None:
        """Up to `n` distinct groups for the step at `version`: the top of the ranking over every listed key
        whose record is valid, honouring reuse and the per-prompt cap. Lists never-listed versions and
        fetches what the top needs (in parallel); None if `stop()` turned true. Changes no use count: the
        caller `commit`s the keys once the step is recorded. Skip records listed so far are re-scored first
        (`audit_skips`): a false one quarantines its key before any of its groups is chosen."""
        with self._selecting:
            while True:
                if stop is not None and stop():
                    return None
                self.audit_skips(wait=True)
                for v in self.planner.take_relists():  # committed draws: a seq a held group waits for
                    self.listing.list_version(v, full=True)
                plan = self.planner.plan(version, n)
                if plan.unlisted is not None:
                    self.listing.list_version(plan.unlisted, full=True)
                    continue
                if not plan.unknown:
                    return plan.chosen
                failed = self.fetch(plan.unknown + plan.extra, wait_for=plan.unknown, stop=stop)
                if failed:
                    return plan.chosen  # the store is failing: the caller backs off and asks again

    def poll(self, version: int) -> int:
        """List the whole window and fetch every waiting key (exhaustive: its cost follows the backlog).
        Returns `available(version)`. For tests and tools; the trainer loop counts the demand's groups
        waiting with `waiting`, which reads nothing from the store."""
        self.listing.sweep(version)
        self.listing.refresh(version, full=True)
        self.audit_skips(wait=True)
        with self.shared.lock:
            keys = [
                k
                for v in self.listing.window(version)
                if v in self.listing.versions
                for ks in self.listing.versions[v].pending.values()
                for k in ks
                if k not in self.shared.ready
            ]
        self.fetch(keys)
        self.floods.audit()  # names bound by those fetches may have made their keys flood suspects
        return self.planner.available(version)

    # --- what the trainer reports ---------------------------------------------------------------------

    def backlog(self, version: int) -> dict[str, int]:
        """Keys in the window by state: `waiting` (listed, not fetched), `fetched` (valid, in memory) and,
        under committed draws, `held`: fetched groups the hold-back passes over now (`Ticker.held`: a seq
        their name committed below them is not read yet, or, counted again as `probation`, one of the first
        `security.standing_groups` seqs of an untrusted name, never trained)."""
        with self.shared.lock:
            low = self.listing.low(version)
            window = [g for g in self.shared.ready.values() if g.version >= low]
            waiting = self.listing.waiting_from(version, low) - len(window)
            out = {
                "waiting": max(0, waiting),
                "fetched": len(window),
                "listed": self.listing.listed,
                "gets": self.admission.fetched,
            }
            if (held := self.planner.held) is not None:
                why = [h for g in window if (h := held(g)) is not None]
                out["held"] = len(why)
                out["probation"] = sum(h[0] < 0 for h in why)
            return out

    def zero_variance(self) -> dict[str, Any]:
        """Share of the recently scored groups whose samples all got the same reward (`frac`, None while
        fewer than 16 were scored) and whether those mostly failed (`kind` "hard") or succeeded ("easy")."""
        with self.shared.lock:
            scored = [o for o in self.admission.outcomes if o == "ok" or o.startswith("zv_")]
        if len(scored) < 16:
            return {"frac": None, "kind": None}
        flat = Counter(o for o in scored if o != "ok")
        kind = max(flat, key=lambda k: flat[k])[3:] if flat else None
        return {"frac": sum(flat.values()) / len(scored), "kind": kind if kind in ("hard", "easy") else None}

    def stats(self) -> dict[str, Any]:
        """Cumulative counters for the step log: drops by reason, reward disagreements per worker."""
        with self.shared.lock:
            return {
                "drops": dict(self.cursor.drops),
                "disagreements": dict(self.cursor.disagreements),
                "scored": dict(self.cursor.scored),
                "consumed": self.cursor.consumed,
                "quarantined": dict(self.cursor.quarantined),
                "skips": dict(self.cursor.skips),
                "gaps": self.cursor.gaps,
            }

    # --- the collaborators' methods the trainer, the prefetcher and tools call on the ingestor ----------

    def window(self, version: int) -> range:
        """`WindowListings.window`: the rollout versions the trainer at `version` may train on."""
        return self.listing.window(version)

    def note_published(self, version: int) -> None:
        """`WindowListings.note_published`: `version`'s prefix counts as listed, empty, now."""
        self.listing.note_published(version)

    def list_version(self, version: int, full: bool = False) -> int:
        """`WindowListings.list_version`: list one version's prefix; how many new keys it found."""
        return self.listing.list_version(version, full)

    def list_span(self, first: int, last: int) -> int:
        """`WindowListings.list_span`: list versions first..last with one paged listing; new keys."""
        return self.listing.list_span(first, last)

    def refresh(
        self, version: int, full: bool = False, min_waiting: int | None = None, depth: int | None = None
    ) -> int:
        """`WindowListings.refresh`: list the window newest version first; new keys."""
        return self.listing.refresh(version, full, min_waiting, depth)

    def sweep(self, version: int) -> None:
        """`WindowListings.sweep`: count the unused keys of versions that left the window as `stale`."""
        self.listing.sweep(version)

    def quarantine(self, fp: str, why: str) -> None:
        """`KeyLedger.quarantine`: quarantine key `fp` now."""
        self.ledger.quarantine(fp, why)

    def key_report(self, limit: int | None = None) -> dict[str, dict[str, Any]]:
        """`KeyLedger.key_report`: counters, evidence, names and quarantine per signing key."""
        return self.ledger.key_report(limit)

    def plan(self, version: int, n: int, exclude: Iterable[str] = (), extra: int | None = None) -> Plan:
        """`BatchPlanner.plan`: walk the ranking until `n` groups are chosen or pending a fetch."""
        return self.planner.plan(version, n, exclude, extra)

    def available(self, version: int) -> int:
        """`BatchPlanner.available`: fetched, valid groups a selection at `version` could take now."""
        return self.planner.available(version)

    def waiting(self, version: int) -> int:
        """`BatchPlanner.waiting`: usable groups waiting at `version`, counted from the listings and fetches
        already held (no store I/O: the trainer's cost per step does not follow the backlog)."""
        return self.planner.waiting(version)

    def allowances(self, version: int) -> Allowances:
        """`BatchPlanner.allowances`: the sampling checks' allowances for a step from `version`."""
        return self.planner.allowances(version)

    def probe(self) -> list[ProbeRow]:
        """`BatchPlanner.probe`: the rows the next step's drift probe re-forwards."""
        return self.planner.probe()
