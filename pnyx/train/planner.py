"""Choosing a step's batch from what ingestion has listed and fetched, and booking what a step consumed.

`BatchPlanner` is the `Ingestor`'s collaborator that walks the ranking (`ranking.py`: fresh before replayed,
newest version first, then workers take turns) over the listing's pending keys until `n` groups are chosen or
pending a fetch (`plan`), honouring the per-prompt cap and the per-key caps: at most `max_groups_per_key_step`
groups of one key per batch, at most `max_groups_per_key_version` of one key and version ever, and the share
cap (`max_key_share`; "fair": ceil(n / keys with groups waiting)), under which a group is deferred, not
skipped, so a key alone still fills a batch. `_extra` sizes how far below the top a selection fetches from the
recent survival rate (the admission outcomes it is given); `commit` books the groups a step consumed (use
counts, re-score counters, the step's drops and evidence per key, through the `KeyLedger`) and then
quarantines the keys that crossed the settings' rates.

Fetches nothing: the `Ingestor`'s `select` repeats "plan, fetch what the plan needs" until the top is known.
Thread-safe through the lock it is given (the ingestor's). Knows nothing about torch or the store.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping

from pnyx.protocol import layout
from pnyx.security.calibration import PROBE_STEPS, Allowances, Drift, ProbeRow, choose_probe, derive
from pnyx.security.checks import GroupEvidence, KeyEvidence, add_evidence
from pnyx.train.key_ledger import KeyLedger
from pnyx.train.listing import Shared, WindowListings
from pnyx.train.ranking import Plan, ranked
from pnyx.train.rescore import ScoredGroup

RELIST_S = 1.0
"""Seconds between two full listings of one version asked for by held groups (`BatchPlanner.take_relists`)."""


class BatchPlanner:
    """A step's batch from the listed and fetched groups, and the booking of what it consumed (see the
    module docstring)."""

    def __init__(
        self, listing: WindowListings, ledger: KeyLedger, shared: Shared, *, outcomes: deque[str]
    ) -> None:
        self.listing = listing
        """The window's pending keys, ranked by `plan`; a consumed key leaves them."""
        self.ledger = ledger
        """Where `commit` books counters per key and which keys it quarantines."""
        self.shared = shared
        """The ingestor's state: `plan` chooses from its fetched groups (`ready`); `commit` writes the
        cursor's use counts, evidence and calibration."""
        self._outcomes = outcomes  # the ingestor's recent admission outcomes ("ok" or why not)
        self.held: Callable[[ScoredGroup], tuple[int, int] | None] | None = None
        """Whether `plan` must pass over a fetched group for now (committed draws, `Ticker.held`): the
        (version, seq) of a seq its name committed below it and the trainer has not read yet, whose record
        `plan` then fetches if it is listed, or whose version `take_relists` lists again if it is not (an
        incremental listing can miss a key until the full one a minute later); called under the shared
        lock."""
        self._relist: dict[int, float] = {}  # version -> when `take_relists` last handed it out

    def take_relists(self) -> list[int]:
        """Versions holding a seq a held group waits for that no listing has shown, each handed out at most
        once per `RELIST_S` (a seq a worker really left empty is never listed)."""
        now = time.monotonic()
        with self.shared.lock:
            due = [v for v, at in self._relist.items() if now - at >= RELIST_S]
            for v in due:
                self._relist[v] = now
            for v in [v for v in self._relist if v < self.shared.cursor.swept_below]:
                del self._relist[v]
            return due

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
        s = self.shared.settings
        cap = s.max_groups_per_prompt
        share = self._share(version, n)
        chosen: list[ScoredGroup] = []
        unknown: list[str] = []
        more: list[str] = []
        deferred: list[str] = []  # over the share cap, in ranking order (fetched or not)
        per_prompt: Counter[str] = Counter()
        per_key: Counter[str] = Counter()  # chosen, or pending a fetch under a name bound to the key
        fetching: set[str] = set()  # records below held groups, added to `unknown`

        def take(item: str, g: ScoredGroup | None, fill: bool) -> None:
            if g is None:
                unknown.append(item)
                parsed = layout.parse_rollout_key(item)
                fp = self.shared.cursor.keys.get(parsed[1]) if parsed is not None else None
                if fp:
                    per_key[fp] += 1
                return
            if per_prompt[g.task_id] >= cap or not self._within_caps(g, per_key, used):
                return
            if self.held is not None and (block := self.held(g)) is not None:
                lst = self.listing.versions.get(block[0])
                below = lst.ids.get((g.group.worker_id, block[1])) if lst is not None else None
                if below is None and lst is not None:  # not listed (yet, or missed): list its version again
                    self._relist.setdefault(block[0], 0.0)
                elif (  # a skip record releases `g` once its audit has read it (`SkipAudits`), not here
                    below is not None
                    and not layout.is_skip_key(below)
                    and below not in fetching
                    and below not in self.shared.ready
                    and below not in self.shared.cursor.rejected
                ):
                    fetching.add(below)  # read it: a record signed by the name's key releases `g`
                    unknown.append(below)
                return
            if not fill and share is not None and g.signer and per_key[g.signer] >= share:
                deferred.append(item)
                return
            per_prompt[g.task_id] += 1
            per_key[g.signer] += 1
            if used is not None:
                used[(g.signer, g.version)] += 1
            chosen.append(g)

        with self.shared.lock:
            used = self._used_per_key_version() if s.max_groups_per_key_version is not None else None
            below = self._extra(n) if extra is None else extra  # places below the top worth fetching
            for item in ranked(
                self.listing.versions,
                self.shared.cursor.uses,
                version,
                self.listing.low(version),
                s.max_reuse,
                exclude,
                rescue=self._rescue(version, n),
            ):
                if isinstance(item, int):
                    return Plan(chosen, unknown, more, item)
                g = self.shared.ready.get(item)
                if len(chosen) + len(unknown) >= n:
                    if below <= 0:
                        break
                    below -= 1
                    if g is None:
                        more.append(item)
                    continue
                if g is None and share is not None:
                    parsed = layout.parse_rollout_key(item)
                    fp = self.shared.cursor.keys.get(parsed[1]) if parsed is not None else None
                    if fp and per_key[fp] >= share:
                        deferred.append(item)  # its key is at the cap: not fetched unless needed
                        continue
                take(item, g, fill=False)
            else:
                for item in deferred:  # the ranking is exhausted: places no other key can fill now
                    if len(chosen) + len(unknown) >= n:
                        break
                    take(item, self.shared.ready.get(item), fill=True)
        return Plan(chosen, unknown, more, None)

    def _rescue(self, version: int, n: int) -> int:
        """Places of a batch of `n` offered first to the groups in their last step of the window (none while
        the window still reaches back to version 0, or when counting what waits)."""
        s = self.shared.settings
        if n >= 1 << 30 or version - s.max_staleness < 0:
            return 0
        return math.ceil(s.last_chance_share * n)

    def _share(self, version: int, n: int) -> int | None:
        """Places of a batch of `n` one key may take while others can fill the rest (None: no cap)."""
        s = self.shared.settings
        if s.max_key_share is None or n >= 1 << 30:
            return None
        if s.max_key_share != "fair":
            return math.ceil(s.max_key_share * n)
        with self.shared.lock:  # keys (or, before their first fetch, names) with groups waiting in the window
            keys = {
                self.shared.cursor.keys.get(name) or f"name:{name}"
                for v in self.listing.window(version)
                if v in self.listing.versions
                for name, pending in self.listing.versions[v].pending.items()
                if pending
            }
        return math.ceil(n / max(1, len(keys)))

    def _within_caps(
        self, g: ScoredGroup, per_key: Counter[str], used: Counter[tuple[str, int]] | None
    ) -> bool:
        """The hard per-key caps allow one more group of `g`'s key (caller holds the lock)."""
        s = self.shared.settings
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
        for k, n in self.shared.cursor.uses.items():
            parsed = layout.parse_rollout_key(k)
            if n > 0 and parsed is not None:
                fp = self.shared.cursor.keys.get(parsed[1])
                if fp is not None:
                    out[(fp, parsed[0])] += 1
        return out

    def available(self, version: int) -> int:
        """How many fetched, valid groups a selection at `version` could take now (without a size limit)."""
        return len(self.plan(version, 1 << 30, extra=0).chosen)

    def waiting(self, version: int) -> int:
        """Usable groups waiting for a selection at `version`, from what is already listed and fetched (no
        store I/O, so its cost follows nothing the workers upload since): the fetched, valid groups a
        selection could take now, plus the listed keys not fetched yet times the recent survival rate (the
        share of admitted groups that were valid and not zero-variance; 1 before any admission). A version
        in the window never listed counts as empty until the next listing finds it."""
        plan = self.plan(version, 1 << 30, extra=0)
        with self.shared.lock:
            outcomes = list(self._outcomes)
        survival = sum(o == "ok" for o in outcomes) / len(outcomes) if outcomes else 1.0
        return len(plan.chosen) + round(len(plan.unknown) * survival)

    def allowances(self, version: int) -> Allowances:
        """The sampling checks' allowances for a step from `version`: the settings' floors widened by what
        the run measured (`pnyx.security.calibration.derive`)."""
        with self.shared.lock:
            return derive(
                self.shared.settings.checks,
                self.shared.cursor.calibration,
                version,
                self.shared.settings.max_staleness,
            )

    def probe(self) -> list[ProbeRow]:
        """The rows the next step's drift probe re-forwards."""
        with self.shared.lock:
            return list(self.shared.cursor.calibration.probe)

    def commit(
        self,
        keys: Iterable[str],
        groups: Iterable[ScoredGroup] = (),
        rejected: Mapping[str, str] | None = None,
        evidence: Mapping[str, GroupEvidence] | None = None,
        allowances: Allowances | None = None,
        drift: Drift | None = None,
        version: int | None = None,
    ) -> None:
        """Record that one step consumed these groups (each once). `groups` (the scored groups of those
        keys, when the caller has them) feed the per-worker re-score counters; `rejected` (key -> reason)
        are the groups the step's checks removed from its update (counted as drops against their key);
        `evidence` (key -> the step's `GroupEvidence`) feeds each key's running plausibility statistic,
        judged under `allowances` (the ones the step used; default: `allowances(version)`); groups of
        trusted keys and the step's drift probe (`drift`, of the step from `version`) feed the run's
        calibration.
        Quarantines the keys whose counters cross the settings' rates."""
        keys = list(keys)
        if len(set(keys)) != len(keys):
            raise ValueError("a step's batch must not contain the same group twice")
        by_key = {g.key: g for g in groups}
        rejected = rejected or {}
        evidence = evidence or {}
        touched: set[str] = set()
        calib = self.shared.cursor.calibration
        if allowances is None:
            allowances = self.allowances(version if version is not None else 0)
        with self.shared.lock:
            with (
                self.ledger.holding_quarantine()
            ):  # until the batch is booked (its keys are used, not rejected)
                for k in keys:
                    g = by_key.get(k) or self.shared.ready.get(k)
                    if g is not None:
                        self.ledger.count_scored(g)
                        ev = evidence.get(k)
                        if ev is not None and g.signer:
                            kev = self.shared.cursor.evidence.setdefault(g.signer, KeyEvidence())
                            add_evidence(kev, ev, allowances)
                            if ev.tokens:
                                trusted = g.signer in self.shared.settings.trusted_keys
                                calib.note_group(ev.engine, ev.staleness, ev.gap, ev.z, trusted)
                        reason = rejected.get(k)
                        if reason is not None:
                            self.listing.drop(reason)
                        self.ledger.count_key(g.signer, reason or "groups")
                        if g.signer:
                            touched.add(g.signer)
                    elif k in rejected:
                        self.listing.drop(rejected[k])
                    self.shared.cursor.uses[k] = self.shared.cursor.uses.get(k, 0) + 1
                    self.shared.cursor.consumed += 1
                    if self.shared.cursor.uses[k] >= self.shared.settings.max_reuse:
                        self.shared.ready.pop(k, None)
                        parsed = layout.parse_rollout_key(k)
                        if parsed is not None and parsed[0] in self.listing.versions:
                            self.listing.versions[parsed[0]].remove_pending(k)
                if version is not None:
                    calib.note_drift(version, drift)
                    keep = drift is not None and bool(calib.probe) and self.shared.settings.max_reuse == 1
                    if keep and calib.probe_steps + 1 < PROBE_STEPS:  # the same rows again (PROBE_STEPS)
                        calib.probe_steps += 1
                    else:
                        chosen = [
                            g for k in keys if (g := by_key.get(k) or self.shared.ready.get(k)) is not None
                        ]
                        calib.probe = choose_probe(chosen, rejected, self.shared.settings.trusted_keys)
                        calib.probe_steps = 0
            for fp in sorted(touched):
                self.ledger.check_quarantine(fp)
