"""Ingestion: from rollout keys in the store to scored groups for one step, at a cost sized to the step.

The trainer at version V may train on groups of versions [V - max_staleness, V] (the window). It lists
each version's prefix incrementally (`listing.py`, the listing half of the `Ingestor`: keys are stamped, so
a listing starts just below the highest stamp seen), ranks the listed keys **from the listing alone** (fresh before replayed, newest
version first, then workers take turns, each worker's oldest group first), and fetches only the top of
that ranking, in parallel (`fetch`): decode, validate (limits, key vs record, run, weights digest, env,
task, prompt), **re-score every sample with the trainer's own verifier**, compute advantages, and drop
zero-variance groups. The per-prompt cap (`max_groups_per_prompt` per step) needs the task id, which is
inside the record, so it is applied after fetching; a selection on the critical path fetches a few places
below the top too, sized by the recent share of groups that survive (`_extra`). A group the window will never train on is
never downloaded: when its version leaves the window the prefix is listed one last time and every key
not consumed or rejected is counted `stale` (after `sweep_grace_s`, so uploads that land late are counted
too). Junk keys (`bad_key`) and a second key for the same (worker, seq) (`duplicate`) are counted from
the listing alone as well.

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
(`over_budget`) is dropped before it is scored. Counters per key (`Cursor.by_key`) follow keys, not names.

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
import math
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from pnyx.errors import NotFoundError, RecordRejected, StoreUnavailableError
from pnyx.protocol import layout
from pnyx.protocol.codec import frame_signer
from pnyx.security.checks import (
    FAULTS,
    CheckSettings,
    GroupEvidence,
    KeyEvidence,
    QuarantineSettings,
    add_evidence,
    quarantine_reason,
    summary,
)
from pnyx.security.keys import fingerprint
from pnyx.store import Store
from pnyx.train.advantages import AdvantageMode, is_zero_variance
from pnyx.train.listing import SWEEP_GRACE_S, VersionListing, WindowListings
from pnyx.train.pool import DaemonPool
from pnyx.train.ranking import Plan, ranked
from pnyx.train.rescore import REWARD_TOL, ScoredGroup, check_sampling, rescore

log = logging.getLogger("pnyx.train.ingest")

FETCH_WORKERS = 16
"""Parallel GETs (and re-scores) of one trainer."""
OUTCOMES = 256
"""How many recent admissions the survival rate and the zero-variance share are measured over."""


@dataclass(frozen=True)
class IngestSettings:
    """The filters of ingestion (from the config's `algorithm` section)."""

    max_staleness: int = 3
    max_reuse: int = 1
    max_groups_per_prompt: int = 2
    advantage: AdvantageMode = "grpo"
    adv_eps: float = 1e-6
    temperature: float | None = None
    """The run's sampling settings and per-turn generation budget (run.json's `worker` section): a group
    that claims other settings is `sampling_mismatch`, one with a model turn longer than the budget is
    `over_budget`. None: not checked (tests and tools)."""
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None
    checks: CheckSettings = field(default_factory=CheckSettings)
    """The step's sampling checks (their per-key evidence is folded into the cursor at `commit`)."""
    quarantine: QuarantineSettings | None = field(default_factory=QuarantineSettings)
    """When a signing key is quarantined (None: never)."""
    max_key_share: float | Literal["fair"] | None = None
    """At most ceil(share · n) places of a batch of n go to one key while other keys' groups can fill the
    rest; places the others cannot fill now go to it (one worker alone still fills a batch). "fair": the
    share is 1 / (keys with groups waiting in the window), so k keys each get ceil(n / k)."""
    flood_limit: int | None = None
    """A key with more than this many groups listed at one policy version is flooding: it is quarantined
    from the listing (its groups are counted, never downloaded). None: no limit."""
    max_groups_per_key_step: int | None = None
    """Hard cap: groups of one key in one batch (None: none)."""
    max_groups_per_key_version: int | None = None
    """Hard cap: groups of one key generated at one policy version that are ever trained on (None: none)."""
    reject_reward_lies: bool = False
    """Drop a group whose claimed rewards disagree with the re-score (`reward_lie`), instead of training on
    it with the trainer's own rewards."""


class Cursor(msgspec.Struct):
    """Ingestion state persisted with every checkpoint (JSON)."""

    uses: dict[str, int] = {}
    """Group key -> times consumed, for keys of versions not yet swept."""
    rejected: dict[str, str] = {}
    """Group key -> drop reason, for keys of versions not yet swept (never fetched again)."""
    drops: dict[str, int] = {}
    """Cumulative drop counts by reason."""
    disagreements: dict[str, int] = {}
    """Cumulative per-worker count of samples whose claimed reward differed from the re-score."""
    scored: dict[str, int] = {}
    """Cumulative per-worker count of re-scored samples (of groups consumed or rejected after scoring)."""
    keys: dict[str, str] = {}
    """Worker name -> fingerprint of the key it is bound to (the first key whose valid group used it)."""
    by_key: dict[str, dict[str, int]] = {}
    """Key fingerprint -> counters: `groups` consumed, `scored` samples, `disagreements`, and each drop
    reason of its groups (reputation and quotas attach to keys, not to claimed names)."""
    evidence: dict[str, KeyEvidence] = {}
    """Key fingerprint -> its running plausibility statistic over the groups the step checked."""
    quarantined: dict[str, str] = {}
    """Key fingerprint -> why it was quarantined: its later groups are counted from the listing (by the
    worker names bound to it) and never downloaded; a group it signs under a new name is refused after
    one GET, and that name is bound to it."""
    swept_below: int = 0
    """Versions below this have left the window and been swept for stale drops."""
    consumed: int = 0
    """Cumulative number of group uses committed by steps."""

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def from_json(cls, data: bytes) -> Cursor:
        return msgspec.json.decode(data, type=cls)


def _lies(g: ScoredGroup) -> bool:
    """Some sample's claimed reward differs from the trainer's re-score."""
    return any(abs(a - b) > REWARD_TOL for a, b in zip(g.worker_rewards, g.rewards, strict=True))


def _theft(worker: str, bound: str, fp: str) -> RecordRejected:
    e = RecordRejected(
        "id_theft", f"worker name {worker!r} is bound to key {bound}, this group is signed by {fp}"
    )
    e.signer = fp
    return e


def _default_decode(data: bytes, vocab_size: int | None) -> Any:
    from pnyx.protocol.codec import decode_group

    return decode_group(data, vocab_size=vocab_size)


@dataclass
class Ingestor(WindowListings):
    """Listing, ranking, fetching, validation and re-scoring of one run's rollout groups.

    `env` is the run's environment (`task`, `score`); `detokenize(ids) -> str` turns completion tokens into
    the text the verifier scores; `render(prompt) -> ids` (optional) re-renders a task's prompt so a group
    whose prompt tokens do not match its task id is rejected; `expected_digest(version)` (optional) gives
    the published chain digests a group of that version may carry (one per plane: bf16 weights, int8).
    """

    store: Store
    env: Any
    detokenize: Callable[[list[int]], str]
    settings: IngestSettings = field(default_factory=IngestSettings)
    cursor: Cursor = field(default_factory=Cursor)
    run_id: str | None = None
    vocab_size: int | None = None
    render: Callable[[Any], list[int]] | None = None
    expected_digest: Callable[[int], frozenset[str] | None] | None = None
    decode: Callable[[bytes, int | None], Any] = _default_decode
    fetch_workers: int = FETCH_WORKERS
    sweep_grace_s: float = SWEEP_GRACE_S
    require_signatures: bool = False
    """Refuse records that are not signed frames, and bind worker names to keys (the trainer sets it)."""

    def __post_init__(self) -> None:
        self._lock = threading.RLock()
        self._versions: dict[int, VersionListing] = {}
        self._ready: dict[str, ScoredGroup] = {}
        self._futures: dict[str, Future] = {}
        self._pool: DaemonPool | None = None
        self._rendered: dict[str, list[int]] = {}
        self._left_at: dict[int, float] = {}
        self._outcomes: deque[str] = deque(maxlen=OUTCOMES)  # "ok", "zv_hard/easy/flat", or a reason
        self._closed = False  # after close(), results of abandoned calls no longer touch the state
        self._selecting = threading.RLock()  # held by `select`: listings merge before or after it
        self._committing = False  # inside `commit` (under the lock): quarantine waits for its end
        self.listed = 0
        """Keys listed so far by this process (all versions)."""
        self.fetched = 0
        """Records fetched so far by this process."""

    def _count_scored(self, g: ScoredGroup) -> None:
        w = g.worker_id
        self.cursor.scored[w] = self.cursor.scored.get(w, 0) + len(g.rewards)
        bad = sum(abs(a - b) > REWARD_TOL for a, b in zip(g.worker_rewards, g.rewards, strict=True))
        if bad:
            self.cursor.disagreements[w] = self.cursor.disagreements.get(w, 0) + bad
        self._count_key(g.signer, "scored", len(g.rewards))
        if bad:
            self._count_key(g.signer, "disagreements", bad)
            self._count_key(g.signer, "reward_lie")  # a faulty group (pnyx.security.checks.FAULTS)

    def _count_key(self, fingerprint: str, what: str, n: int = 1) -> None:
        if fingerprint:
            counts = self.cursor.by_key.setdefault(fingerprint, {})
            counts[what] = counts.get(what, 0) + n
            if what in FAULTS and not self._committing:
                self._check_quarantine(fingerprint)

    def _check_quarantine(self, fp: str) -> None:
        """Quarantine `fp` if its counters or evidence cross the settings' rates (caller holds the lock)."""
        q = self.settings.quarantine
        if q is None or not fp or fp in self.cursor.quarantined:
            return
        why = quarantine_reason(self.cursor.by_key.get(fp, {}), self.cursor.evidence.get(fp), q)
        if why is not None:
            self.quarantine(fp, why)

    def quarantine(self, fp: str, why: str) -> None:
        """Quarantine key `fp` now: its fetched groups and the listed keys of the names bound to it are
        rejected as `quarantined` (counted, never downloaded), and so is everything it uploads later."""
        with self._lock:
            if fp in self.cursor.quarantined:
                return
            self.cursor.quarantined[fp] = why
            log.warning("ingest: quarantined worker key %s: %s", fp, why)
            for key in [k for k, g in self._ready.items() if g.signer == fp]:
                self._reject(key, "quarantined")
            for name in [n for n, bound in self.cursor.keys.items() if bound == fp]:
                self._purge_name(name)

    def _purge_name(self, worker: str) -> None:
        """Reject every listed, unfetched key of a name bound to a quarantined key (caller holds the lock)."""
        for lst in self._versions.values():
            for key in list(lst.pending.get(worker, [])):
                if key not in self._futures:  # one being fetched is judged when it lands
                    self._reject(key, "quarantined")

    def _check_flood(self, fp: str, version: int, n: int) -> None:
        """Quarantine `fp` once it has more groups listed at `version` than the flood limit (caller holds
        the lock). Honest workers stop at half the limit (`pnyx.train.settings.worker_version_cap`)."""
        limit = self.settings.flood_limit
        if limit is None or n <= limit or fp in self.cursor.quarantined or self.settings.quarantine is None:
            return
        self._count_key(fp, "flood")
        self.quarantine(
            fp, f"flooding: {n} groups at version {version}, over the limit of {limit} per key and version"
        )

    def _bind(self, worker: str, fp: str) -> None:
        """`worker` was just bound to key `fp`: its groups listed so far count against the key's flood limit
        (caller holds the lock)."""
        for lst in list(self._versions.values()):
            c = lst.counts.get(worker, 0)
            if c:
                n = lst.by_key[fp] = lst.by_key.get(fp, 0) + c
                self._check_flood(fp, lst.version, n)

    def _quarantined_name(self, worker: str) -> bool:
        """The name is bound to a quarantined key (caller holds the lock)."""
        bound = self.cursor.keys.get(worker)
        return bound is not None and bound in self.cursor.quarantined

    def _admit(self, key: str) -> None:
        """Fetch and score one listed key; file it as ready or rejected (runs in a pool thread)."""
        try:
            scored = self.load(key)
        except RecordRejected as e:
            with self._lock:
                if not self._closed and key not in self.cursor.rejected and key not in self.cursor.uses:
                    self._reject(key, e.reason, str(e))
                    self._count_key(getattr(e, "signer", ""), e.reason)
                    self._outcomes.append(e.reason)
            return
        except NotFoundError:  # listed, then deleted by someone else: nothing to train on or count
            with self._lock:
                parsed = layout.parse_rollout_key(key)
                if parsed is not None and parsed[0] in self._versions:
                    self._versions[parsed[0]].remove_pending(key)
            return
        finally:
            with self._lock:
                self.fetched += 1
        with self._lock:
            if (
                self._closed
                or key in self.cursor.rejected
                or self.cursor.uses.get(key, 0) >= self.settings.max_reuse
            ):
                return
            lst = self._versions.get(scored.version)
            if lst is None or scored.version < self.cursor.swept_below:
                return  # its version was swept meanwhile
            if scored.signer in self.cursor.quarantined:  # quarantined while it was being fetched
                self._reject(key, "quarantined")
                self._count_key(scored.signer, "quarantined")
                return
            if self.settings.reject_reward_lies and _lies(scored):
                self._count_scored(scored)  # its samples, disagreements and the key's `reward_lie` fault
                self._count_key(scored.signer, "lie_dropped")  # ...and its outcome (checks.JUDGED)
                self._reject(key, "reward_lie")
                self._outcomes.append("reward_lie")
                return
            if is_zero_variance(scored.rewards):
                self._count_scored(scored)
                self._count_key(scored.signer, "zero_variance")
                self._reject(key, "zero_variance")
                r = scored.rewards[0]
                self._outcomes.append("zv_hard" if r <= 0 else "zv_easy" if r >= 1 else "zv_flat")
                return
            self._outcomes.append("ok")
            self._ready[key] = scored

    def cursor_json(self) -> bytes:
        """The cursor as JSON, taken under the lock (background fetches keep filing results meanwhile)."""
        with self._lock:
            return self.cursor.to_json()

    def _pool_get(self) -> DaemonPool:
        with self._lock:
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
        with self._lock:
            for key in keys:
                if key in self._ready or key in self.cursor.rejected:
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
        with self._lock:
            self._futures.pop(key, None)

    def close(self) -> None:
        """Stop the fetch threads (queued fetches are cancelled; one in flight is abandoned and its result
        ignored, so the cursor no longer changes behind a final checkpoint)."""
        with self._lock:
            self._closed = True
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
            with self._lock:  # a valid group binds its name to its key, unless another key was first
                bound = self.cursor.keys.get(parsed[1])
                if bound is None:
                    bound = self.cursor.keys[parsed[1]] = signer
                    self._bind(parsed[1], signer)
            if bound != signer:
                raise _theft(parsed[1], bound, signer)
        return scored

    def _signer_of(self, worker: str, data: bytes) -> str:
        """The fingerprint of the key that signed `data`, checked before anything is decoded: the frame's
        signature, then the name's binding. Raises RecordRejected("unsigned" | "bad_signature" | "id_theft")."""
        fp = fingerprint(frame_signer(data))
        with self._lock:
            bound = self.cursor.keys.get(worker)
            if fp in self.cursor.quarantined and (bound is None or bound == fp):
                if bound is None:  # its later groups under this name: never fetched
                    self.cursor.keys[worker] = fp
                    self._purge_name(worker)
                e = RecordRejected("quarantined", f"key {fp} is quarantined: {self.cursor.quarantined[fp]}")
                e.signer = fp
                raise e
        if bound is not None and bound != fp:
            raise _theft(worker, bound, fp)
        return fp

    def load_many(self, keys: list[str]) -> list[ScoredGroup]:
        """`load` of every key, in parallel, in order; the first failure (in key order) re-raises."""
        pool = self._pool_get()
        futures = [pool.submit(self.load, k) for k in keys]
        return [f.result() for f in futures]

    # --- ranking and selection ------------------------------------------------------------------------

    def _extra(self, n: int) -> int:
        """Keys to fetch beyond the top `n`: what the recent survival rate says the top will lose."""
        if not self._outcomes:
            return 0
        ok = max(0.05, sum(o == "ok" for o in self._outcomes) / len(self._outcomes))
        return min(4 * n, math.ceil(n / ok) - n)

    def plan(self, version: int, n: int, exclude: Iterable[str] = (), extra: int | None = None) -> Plan:
        """Walk the ranking until `n` groups are chosen or pending a fetch (see `Plan`), honouring the
        per-prompt cap and the per-key caps (`max_groups_per_key_step`, `max_groups_per_key_version`,
        `max_key_share`). A group over the share cap is deferred, not skipped: once the ranking is
        exhausted, deferred groups fill the places no other key could (in ranking order)."""
        exclude = frozenset(exclude)
        s = self.settings
        cap = s.max_groups_per_prompt
        share = self._share(version, n)
        chosen: list[ScoredGroup] = []
        unknown: list[str] = []
        more: list[str] = []
        deferred: list[str] = []  # over the share cap, in ranking order (fetched or not)
        per_prompt: Counter[str] = Counter()
        per_key: Counter[str] = Counter()  # chosen, or pending a fetch under a name bound to the key

        def take(item: str, g: ScoredGroup | None, fill: bool) -> None:
            if g is None:
                unknown.append(item)
                parsed = layout.parse_rollout_key(item)
                fp = self.cursor.keys.get(parsed[1]) if parsed is not None else None
                if fp:
                    per_key[fp] += 1
                return
            if per_prompt[g.task_id] >= cap or not self._within_caps(g, per_key, used):
                return
            if not fill and share is not None and g.signer and per_key[g.signer] >= share:
                deferred.append(item)
                return
            per_prompt[g.task_id] += 1
            per_key[g.signer] += 1
            if used is not None:
                used[(g.signer, g.version)] += 1
            chosen.append(g)

        with self._lock:
            used = self._used_per_key_version() if s.max_groups_per_key_version is not None else None
            below = self._extra(n) if extra is None else extra  # places below the top worth fetching
            for item in ranked(
                self._versions,
                self.cursor.uses,
                version,
                self._low(version),
                s.max_reuse,
                exclude,
            ):
                if isinstance(item, int):
                    return Plan(chosen, unknown, more, item)
                g = self._ready.get(item)
                if len(chosen) + len(unknown) >= n:
                    if below <= 0:
                        break
                    below -= 1
                    if g is None:
                        more.append(item)
                    continue
                if g is None and share is not None:
                    parsed = layout.parse_rollout_key(item)
                    fp = self.cursor.keys.get(parsed[1]) if parsed is not None else None
                    if fp and per_key[fp] >= share:
                        deferred.append(item)  # its key is at the cap: not fetched unless needed
                        continue
                take(item, g, fill=False)
            else:
                for item in deferred:  # the ranking is exhausted: places no other key can fill now
                    if len(chosen) + len(unknown) >= n:
                        break
                    take(item, self._ready.get(item), fill=True)
        return Plan(chosen, unknown, more, None)

    def _share(self, version: int, n: int) -> int | None:
        """Places of a batch of `n` one key may take while others can fill the rest (None: no cap)."""
        s = self.settings
        if s.max_key_share is None or n >= 1 << 30:
            return None
        if s.max_key_share != "fair":
            return math.ceil(s.max_key_share * n)
        with self._lock:  # keys (or, before their first fetch, names) with groups waiting in the window
            keys = {
                self.cursor.keys.get(name) or f"name:{name}"
                for v in self.window(version)
                if v in self._versions
                for name, pending in self._versions[v].pending.items()
                if pending
            }
        return math.ceil(n / max(1, len(keys)))

    def _within_caps(
        self, g: ScoredGroup, per_key: Counter[str], used: Counter[tuple[str, int]] | None
    ) -> bool:
        """The hard per-key caps allow one more group of `g`'s key (caller holds the lock)."""
        s = self.settings
        if not g.signer:
            return True
        if s.max_groups_per_key_step is not None and per_key[g.signer] >= s.max_groups_per_key_step:
            return False
        cap = s.max_groups_per_key_version
        return used is None or cap is None or used[(g.signer, g.version)] < cap

    def _used_per_key_version(self) -> Counter[tuple[str, int]]:
        """(key fingerprint, version) -> groups of that key and version consumed so far (from the uses of
        the window's keys and the names' bindings; caller holds the lock)."""
        out: Counter[tuple[str, int]] = Counter()
        for k, n in self.cursor.uses.items():
            parsed = layout.parse_rollout_key(k)
            if n > 0 and parsed is not None:
                fp = self.cursor.keys.get(parsed[1])
                if fp is not None:
                    out[(fp, parsed[0])] += 1
        return out

    def select(
        self, version: int, n: int, stop: Callable[[], bool] | None = None
    ) -> list[ScoredGroup] | None:
        """Up to `n` distinct groups for the step at `version`: the top of the ranking over every listed key
        whose record is valid, honouring reuse and the per-prompt cap. Lists never-listed versions and
        fetches what the top needs (in parallel); None if `stop()` turned true. Changes no use count: the
        caller `commit`s the keys once the step is recorded."""
        with self._selecting:
            while True:
                if stop is not None and stop():
                    return None
                plan = self.plan(version, n)
                if plan.unlisted is not None:
                    self.list_version(plan.unlisted, full=True)
                    continue
                if not plan.unknown:
                    return plan.chosen
                failed = self.fetch(plan.unknown + plan.extra, wait_for=plan.unknown, stop=stop)
                if failed:
                    return plan.chosen  # the store is failing: the caller backs off and asks again

    def poll(self, version: int) -> int:
        """List the whole window and fetch every waiting key (exhaustive: for tests and tools, never the
        trainer loop, whose cost must not follow the backlog). Returns `available(version)`."""
        self.sweep(version)
        self.refresh(version, full=True)
        with self._lock:
            keys = [
                k
                for v in self.window(version)
                if v in self._versions
                for ks in self._versions[v].pending.values()
                for k in ks
                if k not in self._ready
            ]
        self.fetch(keys)
        return self.available(version)

    def available(self, version: int) -> int:
        """How many fetched, valid groups a selection at `version` could take now (without a size limit)."""
        return len(self.plan(version, 1 << 30, extra=0).chosen)

    def commit(
        self,
        keys: Iterable[str],
        groups: Iterable[ScoredGroup] = (),
        rejected: Mapping[str, str] | None = None,
        evidence: Mapping[str, GroupEvidence] | None = None,
    ) -> None:
        """Record that one step consumed these groups (each once). `groups` (the scored groups of those
        keys, when the caller has them) feed the per-worker re-score counters; `rejected` (key -> reason)
        are the groups the step's checks removed from its update (counted as drops against their key);
        `evidence` (key -> the step's `GroupEvidence`) feeds each key's running plausibility statistic.
        Quarantines the keys whose counters cross the settings' rates."""
        keys = list(keys)
        if len(set(keys)) != len(keys):
            raise ValueError("a step's batch must not contain the same group twice")
        by_key = {g.key: g for g in groups}
        rejected = rejected or {}
        evidence = evidence or {}
        touched: set[str] = set()
        with self._lock:
            self._committing = True  # quarantine once the batch is booked (its keys are used, not rejected)
            for k in keys:
                g = by_key.get(k) or self._ready.get(k)
                if g is not None:
                    self._count_scored(g)
                    ev = evidence.get(k)
                    if ev is not None and g.signer:
                        kev = self.cursor.evidence.setdefault(g.signer, KeyEvidence())
                        add_evidence(kev, ev, self.settings.checks)
                    reason = rejected.get(k)
                    if reason is not None:
                        self._drop(reason)
                    self._count_key(g.signer, reason or "groups")
                    if g.signer:
                        touched.add(g.signer)
                elif k in rejected:
                    self._drop(rejected[k])
                self.cursor.uses[k] = self.cursor.uses.get(k, 0) + 1
                self.cursor.consumed += 1
                if self.cursor.uses[k] >= self.settings.max_reuse:
                    self._ready.pop(k, None)
                    parsed = layout.parse_rollout_key(k)
                    if parsed is not None and parsed[0] in self._versions:
                        self._versions[parsed[0]].remove_pending(k)
            self._committing = False
            for fp in sorted(touched):
                self._check_quarantine(fp)

    # --- what the trainer reports ---------------------------------------------------------------------

    def backlog(self, version: int) -> dict[str, int]:
        """Keys in the window by state: `waiting` (listed, not fetched), `fetched` (valid, in memory)."""
        with self._lock:
            fetched = sum(1 for g in self._ready.values() if g.version >= self._low(version))
            waiting = self._waiting_from(version, self._low(version)) - fetched
            return {
                "waiting": max(0, waiting),
                "fetched": fetched,
                "listed": self.listed,
                "gets": self.fetched,
            }

    def zero_variance(self) -> dict[str, Any]:
        """Share of the recently scored groups whose samples all got the same reward (`frac`, None while
        fewer than 16 were scored) and whether those mostly failed (`kind` "hard") or succeeded ("easy")."""
        with self._lock:
            scored = [o for o in self._outcomes if o == "ok" or o.startswith("zv_")]
        if len(scored) < 16:
            return {"frac": None, "kind": None}
        flat = Counter(o for o in scored if o != "ok")
        kind = max(flat, key=lambda k: flat[k])[3:] if flat else None
        return {"frac": sum(flat.values()) / len(scored), "kind": kind if kind in ("hard", "easy") else None}

    def stats(self) -> dict[str, Any]:
        """Cumulative counters for the step log: drops by reason, reward disagreements per worker."""
        with self._lock:
            return {
                "drops": dict(self.cursor.drops),
                "disagreements": dict(self.cursor.disagreements),
                "scored": dict(self.cursor.scored),
                "consumed": self.cursor.consumed,
                "quarantined": dict(self.cursor.quarantined),
            }

    def key_report(self, limit: int | None = None) -> dict[str, dict[str, Any]]:
        """Per signing key: its counters, its plausibility evidence (`key_z`, `mean_z`, groups checked),
        the worker names bound to it and whether it is quarantined (and why): for `pnyx status` and the
        attack benchmark. `limit`: at most that many keys, quarantined ones first, then by faults."""
        with self._lock:
            names: dict[str, list[str]] = {}
            for name, fp in self.cursor.keys.items():
                names.setdefault(fp, []).append(name)
            out = {}
            for fp in sorted(
                set(self.cursor.by_key) | set(self.cursor.evidence) | set(self.cursor.quarantined)
            ):
                counts = self.cursor.by_key.get(fp, {})
                out[fp] = {
                    **summary(counts, self.cursor.evidence.get(fp)),
                    "counts": dict(counts),
                    "names": sorted(names.get(fp, [])),
                    "quarantined": self.cursor.quarantined.get(fp),
                }
        if limit is not None and len(out) > limit:
            order = sorted(out, key=lambda fp: (out[fp]["quarantined"] is None, -out[fp]["faults"], fp))
            out = {fp: out[fp] for fp in order[:limit]}
        return out
