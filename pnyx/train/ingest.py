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

Layout: the `Ingestor` owns three collaborators, one module each, none a subclass of another, each given what
it uses (the cursor, the settings, the one lock, the fetched groups) when it is built: `self.listing`
(`listing.py`, `WindowListings`: the window's listings, pending keys per version, the sweep, rejections),
`self.ledger` (`key_ledger.py`, `KeyLedger`: counters per key, names bound to keys, the flood limit,
quarantine, `key_report`; it rejects through the listing, and is the listing's `KeyGate`, connected once both
exist) and `self.planner` (`planner.py`, `BatchPlanner`: the ranking walk under the caps, `plan`, `commit`; it
reads the listing and books through the ledger); `ingest_state.py` holds `IngestSettings` and the `Cursor`.
This module adds admission (fetch, verify, re-score: `fetch`, `load`), `select`, `poll` (exhaustive, for
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
from concurrent.futures import wait as wait_futures
from typing import Any

from pnyx.envs.base import Environment, Prompt
from pnyx.errors import NotFoundError, RecordRejected, StoreUnavailableError
from pnyx.protocol import layout
from pnyx.protocol.codec import frame_signer
from pnyx.protocol.records import RolloutGroup
from pnyx.protocol.rules import is_zero_variance
from pnyx.security.calibration import Allowances, ProbeRow
from pnyx.security.keys import fingerprint
from pnyx.store import Store
from pnyx.train import seq_books
from pnyx.train.ingest_state import Cursor, IngestSettings
from pnyx.train.key_ledger import KeyLedger, id_theft
from pnyx.train.listing import SWEEP_GRACE_S, Shared, WindowListings
from pnyx.train.planner import BatchPlanner
from pnyx.train.pool import DaemonPool
from pnyx.train.ranking import Plan
from pnyx.train.rescore import ScoredGroup, check_sampling, decode_record, disagreements, rescore
from pnyx.train.skip_audit import SkipAudits

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
        self.env = env
        self.detokenize = detokenize
        self.run_id = run_id
        self.vocab_size = vocab_size
        self.render = render
        self.expected_digest = expected_digest
        self.decode = decode
        self.fetch_workers = fetch_workers
        self.require_signatures = require_signatures
        self.check_draws = check_draws
        """Whether a group may enter without seeded draws (`pnyx.train.drawcheck.unseeded_policy`): None, or
        a drop reason. Run on each admitted group that would otherwise be ready, outside the lock. The
        tokens themselves are checked by the step's forward (`pnyx.train.step`)."""
        self.shared = Shared(
            cursor if cursor is not None else Cursor(seqs_from_zero=True), settings or IngestSettings()
        )
        """The one lock, the cursor, the settings and the fetched groups, shared with the collaborators."""
        self._selecting = threading.RLock()  # held by `select`: listings merge before or after it
        # After close(), results of abandoned calls no longer touch the state.
        self._closed = threading.Event()
        self._futures: dict[str, Future] = {}  # key -> its fetch in flight
        self._outcomes: deque[str] = deque(maxlen=OUTCOMES)  # "ok", "zv_hard/easy/flat", or a reason
        self._pool: DaemonPool | None = None
        self._rendered: dict[str, list[int]] = {}
        self.fetched = 0
        """Records fetched so far by this process."""
        self.listing = WindowListings(
            store, self.shared, selecting=self._selecting, closed=self._closed, sweep_grace_s=sweep_grace_s
        )
        self.listing.read_signer = self._read_signer
        self.ledger = KeyLedger(self.listing, self.shared, in_flight=self._futures)
        self.listing.gate = self.ledger  # built second: it rejects through the listing
        self.skips = SkipAudits(
            self.shared, self.listing, self.ledger, self.load, self._pool_get, self._closed
        )
        """The audit of skip records (`skip_audit.py`)."""
        self.planner = BatchPlanner(self.listing, self.ledger, self.shared, outcomes=self._outcomes)
        self.commit = self.planner.commit
        """`BatchPlanner.commit`: record that one step consumed these groups (each once)."""

    @property
    def settings(self) -> IngestSettings:
        """The filters and caps of ingestion (read-only: the collaborators were built with them)."""
        return self.shared.settings

    @property
    def cursor(self) -> Cursor:
        """The ingestion state persisted with every checkpoint (shared by the three collaborators)."""
        return self.shared.cursor

    @cursor.setter
    def cursor(self, cursor: Cursor) -> None:
        """Replace the cursor (a resumed run's, `pnyx.train.resume`) in the ingestor and its collaborators."""
        with self.shared.lock:
            self.shared.cursor = cursor

    # --- admission: fetch, decode, validate, re-score -------------------------------------------------

    def _admit(self, key: str) -> None:
        """Fetch and score one listed key; file it as ready or rejected (runs in a pool thread)."""
        try:
            scored = self.load(key)
        except RecordRejected as e:
            with self.shared.lock:
                if (
                    not self._closed.is_set()
                    and key not in self.cursor.rejected
                    and key not in self.cursor.uses
                ):
                    self.listing.reject(key, e.reason, str(e))
                    self.ledger.count_key(getattr(e, "signer", ""), e.reason)
                    self._outcomes.append(e.reason)
            return
        except NotFoundError:  # listed, then deleted by someone else: nothing to train on or count
            with self.shared.lock:
                parsed = layout.parse_rollout_key(key)
                if parsed is not None and parsed[0] in self.listing.versions:
                    self.listing.versions[parsed[0]].remove_pending(key)
            return
        finally:
            with self.shared.lock:
                self.fetched += 1
        drop = self._dropped(scored)
        with self.shared.lock:
            if (
                self._closed.is_set()
                or key in self.cursor.rejected
                or self.cursor.uses.get(key, 0) >= self.settings.max_reuse
            ):
                return
            lst = self.listing.versions.get(scored.version)
            if lst is None or scored.version < self.cursor.swept_below:
                return  # its version was swept meanwhile
            if scored.signer in self.cursor.quarantined:  # quarantined while it was being fetched
                self.listing.reject(key, "quarantined")
                self.ledger.count_key(scored.signer, "quarantined")
                return
            if drop is not None:
                counter, reason, outcome = drop
                self.ledger.count_scored(scored)  # its samples, disagreements (a `reward_lie` fault)...
                self.ledger.count_key(scored.signer, counter)  # ...and its outcome (checks.JUDGED)
                self.listing.reject(key, reason)
                self._outcomes.append(outcome)
                return
            self._outcomes.append("ok")
            self.shared.ready[key] = scored

    def _dropped(self, scored: ScoredGroup) -> tuple[str, str, str] | None:
        """(the key's counter, the rejection reason, the outcome) of a group dropped before any step, in this
        order: a reward lie (`security.reject_reward_lies`), zero variance, then a missing seeded draw
        (`check_draws`); None: ready."""
        if self.settings.reject_reward_lies and disagreements(scored):
            return "lie_dropped", "reward_lie", "reward_lie"
        if is_zero_variance(scored.rewards):
            r = scored.rewards[0]
            return (
                "zero_variance",
                "zero_variance",
                "zv_hard" if r <= 0 else "zv_easy" if r >= 1 else "zv_flat",
            )
        if self.check_draws is not None and (reason := self.check_draws(scored)) is not None:
            return reason, reason, reason
        return None

    def cursor_json(self) -> bytes:
        """The cursor as JSON, taken under the lock (background fetches keep filing results meanwhile)."""
        with self.shared.lock:
            return self.cursor.to_json()

    def _pool_get(self) -> DaemonPool:
        with self.shared.lock:
            if self._pool is None:
                self._pool = DaemonPool(self.fetch_workers, "pnyx-ingest")
            return self._pool

    def fetch(
        self,
        keys: Iterable[str],
        wait_for: Iterable[str] | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> int:
        """Admit `keys` in parallel; wait for `wait_for` (default: all of them) unless `stop()` turns true.

        Returns how many of the awaited keys could not be fetched because the store was unavailable (they
        stay waiting). Any other failure of a fetch is a bug and re-raises here.
        """
        keys = list(dict.fromkeys(keys))
        pool = self._pool_get()
        futures: dict[str, Future] = {}
        with self.shared.lock:
            for key in keys:
                if key in self.shared.ready or key in self.cursor.rejected:
                    continue
                fut = self._futures.get(key)
                if fut is None:
                    fut = self._futures[key] = pool.submit(self._admit, key)
                    fut.add_done_callback(lambda _f, k=key: self._forget_future(k))
                futures[key] = fut
        awaited = [futures[k] for k in (keys if wait_for is None else wait_for) if k in futures]
        pending = set(awaited)
        while pending:
            if stop is not None and stop():
                return 0
            _, pending = wait_futures(pending, timeout=0.1)
        failed = 0
        for fut in awaited:
            if fut.cancelled():
                continue
            exc = fut.exception()
            if isinstance(exc, StoreUnavailableError):
                failed += 1
                log.warning("ingest: fetch failed, will retry: %s", exc)
            elif exc is not None:
                raise exc
        return failed

    def _forget_future(self, key: str) -> None:
        with self.shared.lock:
            self._futures.pop(key, None)

    def close(self) -> None:
        """Stop the fetch threads (queued fetches are cancelled; one in flight is abandoned and its result
        ignored, so the cursor no longer changes behind a final checkpoint)."""
        with self.shared.lock:
            self._closed.set()
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown()

    def load(self, key: str) -> ScoredGroup:
        """Fetch, validate and re-score one group (no filters, no counters). Raises RecordRejected(reason).

        Used by admission and, on resume, to rebuild exactly the batch a recorded step consumed.
        """
        parsed = layout.parse_rollout_key(key)
        if parsed is None:
            raise RecordRejected("bad_key", key)
        data = self.store.get(key)
        signer = self._signer_of(parsed[1], data) if self.require_signatures else ""
        try:
            group = self.decode(data, self.vocab_size)
            check_sampling(group, self.settings)
            scored = rescore(
                key,
                group,
                env=self.env,
                detokenize=self.detokenize,
                settings=self.settings,
                run_id=self.run_id,
                expected_digest=self.expected_digest,
                render=self.render,
                rendered=self._rendered,
            )
        except RecordRejected as e:
            e.signer = signer  # the drop counts against the key that signed the record
            raise
        scored.signer = signer
        if signer:
            with self.shared.lock:  # a valid group binds its name to its key, unless another key was first
                bound = self.cursor.keys.get(parsed[1])
                if bound is None:
                    bound = self.cursor.keys[parsed[1]] = signer
                    self.ledger.bind(parsed[1], signer)
                if bound == signer:  # its seq is accounted for (`seq_books`)
                    seq_books.verify(
                        self.cursor.seqs, parsed[1], parsed[2], bool(group.draws), self.cursor.seq_start
                    )
            if bound != signer:
                raise id_theft(parsed[1], bound, signer)
        return scored

    def _read_signer(self, key: str, worker: str, seq: int) -> tuple[str, bool] | None:
        """(fingerprint, seeded) of the record under `key` if it is a validly signed record of (`worker`,
        `seq`), else None (the listing's sweep settles seqs with it; a missing object is None)."""
        try:
            data = self.store.get(key)
        except NotFoundError:
            return None
        try:
            fp = fingerprint(frame_signer(data))
            group = self.decode(data, self.vocab_size)
        except RecordRejected:
            return None
        if group.worker_id != worker or group.seq != seq:
            return None
        return fp, bool(group.draws)

    def _signer_of(self, worker: str, data: bytes) -> str:
        """The fingerprint of the key that signed `data`, checked before anything is decoded: the frame's
        signature, then the name's binding. Raises RecordRejected("unsigned" | "bad_signature" | "id_theft")."""
        fp = fingerprint(frame_signer(data))
        with self.shared.lock:
            bound = self.cursor.keys.get(worker)
            if fp in self.cursor.quarantined and (bound is None or bound == fp):
                if bound is None:  # its later groups under this name: never fetched
                    self.cursor.keys[worker] = fp
                    self.ledger.purge_name(worker)
                e = RecordRejected("quarantined", f"key {fp} is quarantined: {self.cursor.quarantined[fp]}")
                e.signer = fp
                raise e
        if bound is not None and bound != fp:
            raise id_theft(worker, bound, fp)
        return fp

    def load_many(self, keys: list[str]) -> list[ScoredGroup]:
        """`load` of every key, in parallel, in order; the first failure (in key order) re-raises."""
        pool = self._pool_get()
        futures = [pool.submit(self.load, k) for k in keys]
        return [f.result() for f in futures]

    # --- skip records: `skip_audit.SkipAudits` ----------------------------------------------------------

    def audit_skips(self, wait: bool = False) -> None:
        """`SkipAudits.audit_skips`: re-score the skip records listed since the last call."""
        self.skips.audit_skips(wait)

    def take_draw_audits(self) -> list[ScoredGroup]:
        """`SkipAudits.take_draw_audits`."""
        return self.skips.take_draw_audits()

    def draws_audited(self, groups: list[ScoredGroup], worst: list[float], tolerance: float) -> int:
        """`SkipAudits.draws_audited`."""
        return self.skips.draws_audited(groups, worst, tolerance)

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
        return self.planner.available(version)

    # --- what the trainer reports ---------------------------------------------------------------------

    def backlog(self, version: int) -> dict[str, int]:
        """Keys in the window by state: `waiting` (listed, not fetched), `fetched` (valid, in memory)."""
        with self.shared.lock:
            low = self.listing.low(version)
            fetched = sum(1 for g in self.shared.ready.values() if g.version >= low)
            waiting = self.listing.waiting_from(version, low) - fetched
            return {
                "waiting": max(0, waiting),
                "fetched": fetched,
                "listed": self.listing.listed,
                "gets": self.fetched,
            }

    def zero_variance(self) -> dict[str, Any]:
        """Share of the recently scored groups whose samples all got the same reward (`frac`, None while
        fewer than 16 were scored) and whether those mostly failed (`kind` "hard") or succeeded ("easy")."""
        with self.shared.lock:
            scored = [o for o in self._outcomes if o == "ok" or o.startswith("zv_")]
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
