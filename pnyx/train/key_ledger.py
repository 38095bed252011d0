"""Per-key security bookkeeping of ingestion: counters per key, names bound to keys, flood limit, quarantine.

`KeyLedger` is the `Ingestor`'s collaborator that keeps the cursor's books per signing key (docs/security.md):
each key's counters (`Cursor.by_key`: groups consumed, samples re-scored, reward disagreements, the drop
reasons of its groups), the binding of worker names to keys (`bind`), and quarantine. A key is quarantined
once its counters or plausibility evidence cross the settings' rates
(`pnyx.security.checks.quarantine_reason`), or once more records signed by it sit at one version than the
flood limit (`check_flood` notes a key whose listed seqs pass the limit; `pnyx.train.flood_audit` reads them
and quarantines only on records it signed: objects anyone else wrote under its names prove nothing); then
its fetched groups and the listed keys of the names bound to it are rejected as
`quarantined` through the listing (`WindowListings.reject`: counted, never downloaded). It is the listing's
`KeyGate` (`quarantined_name`, `check_flood`) and reports per key (`key_report`).

Bounded under Sybils: a key *has standing* once it is trusted, quarantined, or has had `STANDING` groups
trained on. Keys without standing (a Sybil's fresh key per group, a new worker's first groups) are kept at
most `MAX_NEW_KEYS` at a time: past that, the oldest of them are evicted in a batch (`_evict`): their
counters are added to the aggregate `EVICTED` entry of `Cursor.by_key`, and their evidence, their names'
bindings, per-name counters and seq books are forgotten. So the cursor holds O(keys with standing + MAX_NEW_KEYS)
whatever number of keys a Sybil invents (`benchmarks/bench_sybil_keys.py`). What eviction gives up: an
evicted key starts afresh if it comes back (its few faults forgotten; it never reached `quarantine_min`
with them unless it was quarantined, and a quarantined key is never evicted), and a name bound to an
evicted key can be bound again.

Reads no record and does no I/O. Methods run under the lock it is given (the ingestor's; the caller holds it,
or the method takes it where it says so). Knows nothing about torch, the store or how groups are ranked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container, Iterator
from contextlib import contextmanager
from typing import Any

from pnyx.errors import RecordRejected
from pnyx.protocol import layout
from pnyx.security.checks import FAULTS, quarantine_reason, summary
from pnyx.train.listing import Shared, WindowListings
from pnyx.train.rescore import ScoredGroup, disagreements
from pnyx.train.version_listing import GROUPS, SKIPS

log = logging.getLogger("pnyx.train.ingest")

STANDING = 4
"""Groups of a key trained on (`Cursor.by_key[fp]["groups"]`) from which it is never evicted."""
MAX_NEW_KEYS = 10_000
"""Keys without standing kept in the cursor at most; past it the oldest tenth is evicted."""
EVICTED = "(evicted)"
"""The `Cursor.by_key` entry that sums the counters of every evicted key."""


def id_theft(worker: str, bound: str, fp: str) -> RecordRejected:
    """The rejection of a group signed by `fp` under a worker name already bound to key `bound`."""
    e = RecordRejected(
        "id_theft", f"worker name {worker!r} is bound to key {bound}, this group is signed by {fp}"
    )
    e.signer = fp
    return e


class KeyLedger:
    """The books per signing key and quarantine (see the module docstring)."""

    def __init__(self, listing: WindowListings, shared: Shared, *, in_flight: Container[str]) -> None:
        self.listing = listing
        """Where quarantine files its rejections and whose per-version counts the flood limit reads."""
        self.shared = shared
        """The ingestor's state: the cursor holds the per-key counters, name bindings, evidence and
        quarantine; a quarantined key's fetched groups (`ready`) are rejected."""
        self._in_flight = in_flight  # keys being fetched now: judged when they land, not purged
        self._holding = False  # inside `holding_quarantine`: a fault quarantines no key until its end
        self.max_new_keys = MAX_NEW_KEYS
        """Keys without standing kept at most (see the module docstring)."""
        self._standing = 0  # keys with standing at the last eviction (they never count against the cap)
        self.evicted = 0
        """Keys evicted by this process."""
        self.suspects: set[tuple[str, int, str]] = set()
        """(key fingerprint, version, kind) whose listed seqs passed the flood limit: the flood audit's work
        (`pnyx.train.flood_audit.FloodAudits`)."""

    @contextmanager
    def holding_quarantine(self) -> Iterator[None]:
        """While inside, counting a fault quarantines no key: `BatchPlanner.commit` books a whole batch (its
        keys are used, not rejected), then checks the keys it touched (caller holds the lock)."""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False

    def count_scored(self, g: ScoredGroup) -> None:
        """Book `g`'s re-scored samples and reward disagreements against its worker name and its key
        (caller holds the lock)."""
        w = g.worker_id
        self.shared.cursor.scored[w] = self.shared.cursor.scored.get(w, 0) + len(g.rewards)
        bad = disagreements(g)
        if bad:
            self.shared.cursor.disagreements[w] = self.shared.cursor.disagreements.get(w, 0) + bad
        self.count_key(g.signer, "scored", len(g.rewards))
        if bad:
            self.count_key(g.signer, "disagreements", bad)
            self.count_key(g.signer, "reward_lie")  # a faulty group (pnyx.security.checks.FAULTS)

    def count_key(self, fingerprint: str, what: str, n: int = 1) -> None:
        """Add `n` to key `fingerprint`'s counter `what` ("": unsigned, not counted); a fault may quarantine
        the key (caller holds the lock)."""
        if fingerprint:
            by_key = self.shared.cursor.by_key
            counts = by_key.get(fingerprint)
            if counts is None:
                counts = by_key[fingerprint] = {}
                if len(by_key) > self.max_new_keys + self._standing:
                    self._evict()
            counts[what] = counts.get(what, 0) + n
            if what in FAULTS and not self._holding:
                self.check_quarantine(fingerprint)

    def _has_standing(self, fp: str, counts: dict[str, int]) -> bool:
        cursor, settings = self.shared.cursor, self.shared.settings
        return (
            fp == EVICTED
            or counts.get("groups", 0) >= STANDING
            or fp in cursor.quarantined
            or fp in settings.trusted_keys
        )

    def _evict(self) -> None:
        """Evict the oldest tenth of the keys without standing, when there are more than `max_new_keys`
        (see the module docstring; caller holds the lock). Amortised: O(keys + names) per eviction of
        `max_new_keys / 10` keys."""
        cursor = self.shared.cursor
        new = [fp for fp, c in cursor.by_key.items() if not self._has_standing(fp, c)]
        self._standing = len(cursor.by_key) - len(new)
        if len(new) <= self.max_new_keys:
            return
        gone = set(new[: max(1, self.max_new_keys // 10)])  # dicts keep insertion order: the oldest first
        total = cursor.by_key.setdefault(EVICTED, {})
        for fp in gone:
            for what, n in cursor.by_key.pop(fp).items():
                total[what] = total.get(what, 0) + n
            cursor.evidence.pop(fp, None)
        total["keys"] = total.get("keys", 0) + len(gone)
        for name in [n for n, fp in cursor.keys.items() if fp in gone]:
            del cursor.keys[name]
            cursor.scored.pop(name, None)
            cursor.disagreements.pop(name, None)
            cursor.seqs.pop(name, None)
        self.evicted += len(gone)
        log.info(
            "ingest: %d keys without standing evicted from the books (%d so far)", len(gone), self.evicted
        )

    def check_quarantine(self, fp: str) -> None:
        """Quarantine `fp` if its counters or evidence cross the settings' rates (caller holds the lock)."""
        q = self.shared.settings.quarantine
        if (
            q is None
            or not fp
            or fp in self.shared.cursor.quarantined
            or fp in self.shared.settings.trusted_keys
        ):
            return
        why = quarantine_reason(
            self.shared.cursor.by_key.get(fp, {}),
            self.shared.cursor.evidence.get(fp),
            q,
            self._center(),
            self._center(population=False),
        )
        if why is not None:
            self.quarantine(fp, why)

    def _center(self, population: bool = True) -> Callable[[str, int], float | None]:
        """The run's honest z per (engine, staleness) now (`calibration.Allowances.calibrated_center`):
        without `population`, the trusted keys' centres only (the upper side of a key's statistic,
        `checks.quarantine_reason`)."""
        from pnyx.security.calibration import Allowances, centers

        return Allowances(
            self.shared.settings.checks, z_center=centers(self.shared.cursor.calibration, population)
        ).calibrated_center

    def quarantine(self, fp: str, why: str) -> None:
        """Quarantine key `fp` now: its fetched groups and the listed keys of the names bound to it are
        rejected as `quarantined` (counted, never downloaded), and so is everything it uploads later."""
        with self.shared.lock:
            if fp in self.shared.cursor.quarantined:
                return
            self.shared.cursor.quarantined[fp] = why
            log.warning("ingest: quarantined worker key %s: %s", fp, why)
            for key in [k for k, g in self.shared.ready.items() if g.signer == fp]:
                self.listing.reject(key, "quarantined")
            for name in [n for n, bound in self.shared.cursor.keys.items() if bound == fp]:
                self.purge_name(name)

    def purge_name(self, worker: str) -> None:
        """Reject every listed, unfetched key of a name bound to a quarantined key, skip records not yet
        audited included (caller holds the lock)."""
        for lst in self.listing.versions.values():
            for key in list(lst.pending.get(worker, [])):
                if key not in self._in_flight:  # one being fetched is judged when it lands
                    self.listing.reject(key, "quarantined")
            for key in [k for k in lst.skips if (layout.parse_rollout_key(k) or (0, ""))[1] == worker]:
                if key not in self.shared.cursor.rejected:
                    self.listing.reject(key, "quarantined")

    def check_flood(self, fp: str, version: int, n: int, kind: str) -> None:
        """Note `fp` for a flood audit once it has more seqs of `kind` listed at `version` than the flood
        limit (caller holds the lock). Listed keys prove nothing about who wrote them: the audit reads
        them and quarantines `fp` only on records it signed (`pnyx.train.flood_audit`). Honest workers stop
        at half the limit (`pnyx.protocol.rules.worker_version_cap`)."""
        limit = self.shared.settings.flood_limit
        if (
            limit is None
            or kind != GROUPS  # skip records never flood (`version_listing.SKIPS`)
            or n <= limit
            or fp in self.shared.cursor.quarantined
            or self.shared.settings.quarantine is None
        ):
            return
        if fp in self.shared.settings.trusted_keys:
            return  # the user's own worker: its version cap keeps it under the limit anyway
        self.suspects.add((fp, version, kind))

    def flooded(self, fp: str, version: int, kind: str, listed: int, signed: int) -> None:
        """The flood audit proved `signed` of the `listed` seqs of `kind` at `version` to be records `fp`
        signed, more than the flood limit: quarantine it (caller holds the lock)."""
        limit = self.shared.settings.flood_limit
        self.count_key(fp, "flood")
        self.quarantine(
            fp,
            f"flooding: {listed} {kind} at version {version} ({signed} of them signed by this key), "
            f"over the limit of {limit} per key and version",
        )

    def count_gaps(self, worker: str, n: int) -> None:
        """`worker` left `n` seqs that the store never held signed by its key (`seq_books`): `n` `gap` faults
        of the key its name is bound to, which may quarantine it (caller holds the lock)."""
        fp = self.shared.cursor.keys.get(worker)
        if fp:
            self.count_key(fp, "gap", n)

    def count_lost(self, worker: str, n: int) -> None:
        """`worker` left `n` seqs excused from being gaps (`Ticker.excused`): counted `lost` on its key, no
        fault (caller holds the lock)."""
        fp = self.shared.cursor.keys.get(worker)
        if fp:
            self.count_key(fp, "lost", n)

    def bind(self, worker: str, fp: str) -> None:
        """`worker` was just bound to key `fp`: its groups listed so far count against the key's flood limit
        (caller holds the lock)."""
        for lst in list(self.listing.versions.values()):
            for kind in (GROUPS, SKIPS):
                c = lst.counts.get((worker, kind), 0)
                if c:
                    n = lst.by_key[fp, kind] = lst.by_key.get((fp, kind), 0) + c
                    self.check_flood(fp, lst.version, n, kind)

    def quarantined_name(self, worker: str) -> bool:
        """The name is bound to a quarantined key (caller holds the lock)."""
        bound = self.shared.cursor.keys.get(worker)
        return bound is not None and bound in self.shared.cursor.quarantined

    def key_report(self, limit: int | None = None) -> dict[str, dict[str, Any]]:
        """Per signing key: its counters, its plausibility evidence (`key_z`, `mean_z`, groups checked),
        the worker names bound to it and whether it is quarantined (and why): for `pnyx status` and the
        attack benchmark. `limit`: at most that many keys, quarantined ones first, then by faults."""
        with self.shared.lock:
            center = self._center()
            names: dict[str, list[str]] = {}
            for name, fp in self.shared.cursor.keys.items():
                names.setdefault(fp, []).append(name)
            out = {}
            for fp in sorted(
                set(self.shared.cursor.by_key)
                | set(self.shared.cursor.evidence)
                | set(self.shared.cursor.quarantined)
            ):
                counts = self.shared.cursor.by_key.get(fp, {})
                out[fp] = {
                    **summary(counts, self.shared.cursor.evidence.get(fp), center),
                    "counts": dict(counts),
                    "names": sorted(names.get(fp, [])),
                    "quarantined": self.shared.cursor.quarantined.get(fp),
                    "trusted": fp in self.shared.settings.trusted_keys,
                }
        if limit is not None and len(out) > limit:
            order = sorted(out, key=lambda fp: (out[fp]["quarantined"] is None, -out[fp]["faults"], fp))
            out = {fp: out[fp] for fp in order[:limit]}
        return out
