"""The trainer's listings of the rollout versions in its window, and the sweep of those that left it.

Each version's listed keys are a `VersionListing` (`pnyx.train.version_listing`, with the two LIST calls).
A key stamped before an upload that lands late is found by the incremental listing's slack, by the periodic
full listing (`RESCAN_S`) or, at the latest, by the sweep when its version leaves the window, which also
settles the worker names' seqs there (`pnyx.train.settlement`: the `gap` faults). A worker stamps a key when
it seals the group, and its courier may upload it seconds later (a backlog, a retry): when a full listing
finds a key the incremental ones missed, stamped further below the newest stamp listed than the slack, the
slack widens to cover it (`slack_ms`, up to `MAX_SLACK_MS`), so the next such key is found within a listing
instead of at the next full one.

`WindowListings` is the `Ingestor`'s listing collaborator: the listings of the versions in the window, merged
as they come (`list_version`, `list_span`, `refresh`), and the sweep of versions that left it, which counts
their unused keys as `stale` from one last listing. It files rejections into the cursor (`reject`: junk and
duplicate keys here; the ledger's and the admission's through it), which takes a key out of the pending set
and out of the fetched groups. It asks a `KeyGate` (the `KeyLedger`) two questions about the worker name a key
is listed under: is it bound to a quarantined key, and does its key now flood a version. It never reads a
record and knows nothing about signatures, counters per key or how groups are ranked. Thread-safe through the
lock it is given (the ingestor's); the I/O runs without it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pnyx.protocol import layout
from pnyx.store import Store
from pnyx.train import seq_books, settlement
from pnyx.train.ingest_state import Cursor, IngestSettings
from pnyx.train.rescore import ScoredGroup
from pnyx.train.settlement import ReadSigner
from pnyx.train.version_listing import (
    GROUPS,
    MAX_SLACK_MS,
    STAMP_SLACK_MS,
    VersionListing,
    kind_of,
    list_keys,
    list_range,
)

log = logging.getLogger("pnyx.train.ingest")

RESCAN_S = 60.0
"""Each version in the window is listed from the start of its prefix this often (late keys, old layout)."""
SWEEP_GRACE_S = 30.0
"""A version is swept (its unused keys counted `stale`) this long after it left the window..."""
SWEEP_MAX_LAG = 16
"""...or once it is this many versions below the window, whichever comes first."""
SWEEP_BATCH = 8
"""On a store that lists in key order, versions are swept this many at a time (one paged listing)."""


class KeyGate(Protocol):
    """What the listing asks about the signing key a worker name is bound to (the `KeyLedger` answers;
    the caller holds the lock)."""

    def quarantined_name(self, worker: str) -> bool:
        """`worker` is bound to a quarantined key (its listed keys are rejected, never downloaded)."""
        ...

    def check_flood(self, fp: str, version: int, n: int, kind: str) -> None:
        """Key `fp` now has `n` seqs of `kind` listed at `version` (past the flood limit, a flood audit
        reads them: `pnyx.train.flood_audit`)."""
        ...

    def count_gaps(self, worker: str, n: int) -> None:
        """`worker` left `n` seqs that the store never held (`seq_books.settle`)."""
        ...

    def count_lost(self, worker: str, n: int) -> None:
        """`worker` left `n` seqs excused from being gaps (a restarted worker's undrawn cohort)."""
        ...


class OpenGate:
    """A `KeyGate` that quarantines nothing: the gate of a listing whose ledger is not connected yet."""

    def quarantined_name(self, worker: str) -> bool:
        return False

    def check_flood(self, fp: str, version: int, n: int, kind: str) -> None:
        return None

    def count_gaps(self, worker: str, n: int) -> None:
        return None

    def count_lost(self, worker: str, n: int) -> None:
        return None


@dataclass
class Shared:
    """What the ingestor and its collaborators share (the listing, the key ledger, the planner, admission): one
    lock over all of it, the cursor (replaced whole on resume), the settings, and the fetched groups."""

    cursor: Cursor
    settings: IngestSettings
    lock: threading.RLock = field(default_factory=threading.RLock)
    ready: dict[str, ScoredGroup] = field(default_factory=dict)
    """Fetched, valid groups by key, until consumed or dropped."""


NOT_THE_NAMES = frozenset({"unsigned", "bad_signature", "bad_magic", "id_theft", "key_mismatch"})
"""Rejections that say a key holds no record of the name it is listed under (not signed, not decodable,
signed by another key, a record of another name, seq or version: a copy): such a key does not keep a
(name, seq) from the name's own record, and does not count against the name's key (the flood limit)."""


class WindowListings:
    """The window's listings and the sweep of versions that left it (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        shared: Shared,
        *,
        selecting: threading.RLock,
        closed: threading.Event,
        sweep_grace_s: float = SWEEP_GRACE_S,
    ) -> None:
        self.store = store
        self.shared = shared
        """The ingestor's state; its cursor is read for uses and rejections, written by `reject`, `drop` and
        the sweep."""
        self.sweep_grace_s = sweep_grace_s
        """A version that left the window is swept this long after (uploads that land late still count)."""
        self.gate: KeyGate = OpenGate()
        """The key ledger, which answers the two questions about names; the `Ingestor` connects it once
        built (the ledger needs this listing, so it is built second)."""
        self.slack_ms = STAMP_SLACK_MS
        """How far below the newest stamp listed an incremental listing starts (widened by late keys)."""
        self.excused: Callable[[str, str], list[tuple[int, int]]] | None = None
        """(worker name, key) -> seq ranges whose absence is no gap (committed draws: a restarted worker's
        undrawn cohort, `Ticker.excused`); None: none are."""
        self.probation: Callable[[str, int], bool] | None = None
        """(worker name, seq) -> whether standing holds that seq for good (`Ticker.on_probation` for the
        name's key): left unconsumed, it is counted `probation` at the sweep, not `stale`. None: never."""
        self.read_signer: ReadSigner = lambda key, worker, seq: None
        """(fingerprint, seeded) of the record under `key` if it is a valid signed record of (worker, seq),
        else None: how the sweep settles seqs it listed but never read (`seq_books`); the `Ingestor`
        connects its own (the listing reads no record itself)."""
        self.versions: dict[int, VersionListing] = {}
        """Version -> its listing, for the versions in the window and those not swept yet."""
        self.listed = 0
        """Keys listed so far by this process (all versions)."""
        self._selecting = selecting  # held by `Ingestor.select`: listings merge before or after it
        self._closed = closed  # set by `Ingestor.close`: listings that land afterwards are not merged
        self._left_at: dict[int, float] = {}  # version -> monotonic time it was first seen below the window

    def window(self, version: int) -> range:
        """Rollout versions the trainer at `version` may train on: [version - max_staleness, version]."""
        return range(self.low(version), version + 1)

    def low(self, version: int) -> int:
        """The oldest version in the window of the trainer at `version`."""
        return max(0, version - self.shared.settings.max_staleness)

    def _listing(self, version: int) -> VersionListing:
        lst = self.versions.get(version)
        if lst is None:
            lst = self.versions[version] = VersionListing(version)
        return lst

    def note_published(self, version: int) -> None:
        """`version` is being or was just published: no group of it can exist yet (a worker generates from
        verified weights only), so its prefix counts as listed, empty, now."""
        with self.shared.lock:
            lst = self._listing(version)
            if lst.listed_at is None:
                lst.listed_at = lst.full_at = time.monotonic()

    def list_version(self, version: int, full: bool = False) -> int:
        """List one version's prefix (incrementally unless `full`); returns how many new keys it found."""
        with self.shared.lock:
            start_after = self._listing(version).start_after(layout.now_ms(), full, self.slack_ms)
        return self._file(
            {version: list_keys(self.store, version, start_after)}, {version: start_after is None}
        )

    def list_span(self, first: int, last: int) -> int:
        """List versions first..last with one paged listing (stores that list in key order): `first`
        incrementally, the newer ones from their start (they are young: few keys). Returns new keys."""
        with self.shared.lock:
            start_after = self._listing(first).start_after(layout.now_ms(), False, self.slack_ms)
        listings = list_range(self.store, first, last + 1, start_after=start_after)
        return self._file(listings, {v: v > first or start_after is None for v in listings})

    def _file(self, listings: dict[int, list[str]], complete: dict[int, bool]) -> int:
        """Merge listed keys into the versions' listings; `complete[v]`: v was listed from its start.
        Waits while a selection runs, so a selection ranks one listing, not one that changes under it."""
        now = time.monotonic()
        new = 0
        with self._selecting, self.shared.lock:
            for version, keys in listings.items():
                if self._closed.is_set() or version < self.shared.cursor.swept_below:
                    continue  # closed, or swept while we listed (counted there)
                lst = self._listing(version)
                high, listed = lst.high_ms, lst.listed_at is not None
                for key in keys:
                    if key not in lst.seen:
                        new += 1
                        self._merge(lst, key)
                        if complete.get(version) and listed:
                            self._widen(high, layout.rollout_stamp(key), key)
                lst.listed_at = now
                if complete.get(version):
                    lst.full_at = now
            self.listed += new
        return new

    def _widen(self, high: int, stamp: int | None, key: str) -> None:
        """A full listing found `key` (stamped `stamp`) that the incremental listings since the newest stamp
        `high` missed: widen the slack to cover it (caller holds the lock)."""
        if stamp is None or high < 0 or high - stamp <= self.slack_ms:
            return
        widened = min(MAX_SLACK_MS, high - stamp + STAMP_SLACK_MS)
        if widened > self.slack_ms:
            log.info(
                "ingest: %s landed %.1fs behind the newest key listed; incremental listings now re-read %.1fs",
                key, (high - stamp) / 1000, widened / 1000,
            )  # fmt: skip
            self.slack_ms = widened

    def _merge(self, lst: VersionListing, key: str) -> None:
        lst.seen.add(key)
        parsed = layout.parse_rollout_key(key)
        if parsed is None or parsed[0] != lst.version:
            if key not in self.shared.cursor.rejected:
                self.reject(key, "bad_key")
            return
        stamp = layout.rollout_stamp(key)
        if stamp is not None:
            lst.high_ms = max(lst.high_ms, stamp)
        seq_books.note(self.shared.cursor.seqs, parsed[1], parsed[2], self.shared.cursor.seq_start)
        ident = (parsed[1], parsed[2])
        other = lst.ids.get(ident)
        if other is not None:
            # Two keys for one group: the first listed stays unless the other was consumed already, or the
            # first was found to be no record of that name (junk squatting the seq: `NOT_THE_NAMES`).
            rejected = self.shared.cursor.rejected
            first_forged = rejected.get(other) in NOT_THE_NAMES
            keep_new = self.shared.cursor.uses.get(key, 0) > 0 or first_forged
            keep, dup = (key, other) if keep_new else (other, key)
            lst.ids[ident] = keep
            if dup not in rejected:
                lst.remove_pending(dup)
                self.shared.ready.pop(dup, None)
                self.reject(dup, "duplicate")
            if dup == key:
                lst.dups.setdefault(ident, []).append(key)
            if keep is other:
                return
            self._recount(lst, parsed[1], other, key)
        else:
            self._count_listed(lst, parsed[1], kind_of(key))
        lst.ids[ident] = key
        if (
            key in self.shared.cursor.rejected
            or self.shared.cursor.uses.get(key, 0) >= self.shared.settings.max_reuse
        ):
            return
        if self.gate.quarantined_name(parsed[1]):
            self.reject(key, "quarantined")  # counted from the listing, never downloaded
            return
        if layout.is_skip_key(key):
            lst.skips.append(key)  # audited, never trained on
            return
        lst.add_pending(key, parsed[1])

    def _count_listed(self, lst: VersionListing, worker: str, kind: str, d: int = 1) -> None:
        """`d` more distinct seqs of `kind` of `worker` listed at `lst.version`, and of the key its name is
        bound to (one more group may start a flood audit: `KeyGate.check_flood`; skip records are counted
        but never a flood: see `version_listing.SKIPS`)."""
        lst.counts[worker, kind] = lst.counts.get((worker, kind), 0) + d
        fp = self.shared.cursor.keys.get(worker)
        if fp:
            n = lst.by_key[fp, kind] = lst.by_key.get((fp, kind), 0) + d
            if d > 0 and kind == GROUPS:
                self.gate.check_flood(fp, lst.version, n, kind)

    def _recount(self, lst: VersionListing, worker: str, old: str, new: str) -> None:
        """Key `new` holds the seq `old` held: if one is a skip record and the other not, the seq moves kind."""
        if kind_of(old) != kind_of(new):
            self._count_listed(lst, worker, kind_of(old), -1)
            self._count_listed(lst, worker, kind_of(new))

    def refresh(
        self, version: int, full: bool = False, min_waiting: int | None = None, depth: int | None = None
    ) -> int:
        """List the window newest version first (each fully every `RESCAN_S`); with `min_waiting`, stop
        once the versions listed hold that many waiting keys; with `depth`, list at most that many
        versions. On a store that lists in key order the two newest versions (where uploads land) share
        one listing. Returns how many new keys were found. (The sweep is separate: `sweep`.)"""
        new = 0
        now = time.monotonic()
        versions = list(range(version, self.low(version) - 1, -1))[:depth]
        with self.shared.lock:
            rescan = {v: full or self._rescan_due(v, now) for v in versions}
        if (
            len(versions) >= 2
            and getattr(self.store, "sorted_listing", False)
            and not any(rescan[v] for v in versions[:2])
        ):
            new += self.list_span(versions[1], versions[0])
            if min_waiting is not None and self.waiting_from(version, versions[1]) >= min_waiting:
                return new
            versions = versions[2:]
        for v in versions:
            new += self.list_version(v, full=rescan[v])
            if min_waiting is not None and self.waiting_from(version, v) >= min_waiting:
                break
        return new

    def _rescan_due(self, version: int, now: float) -> bool:
        lst = self.versions.get(version)
        return lst is None or lst.full_at is None or now - lst.full_at >= RESCAN_S

    def take_skips(self) -> list[str]:
        """The skip records listed since the last call and not rejected meanwhile (a flood audit's
        quarantine), of versions not swept (their audit is the caller's)."""
        with self.shared.lock:
            out = []
            for lst in self.versions.values():
                out += [k for k in lst.skips if k not in self.shared.cursor.rejected]
                lst.skips = []
            return out

    def waiting_from(self, version: int, low: int) -> int:
        """Listed keys still waiting to be trained on, of versions `low`..`version`."""
        with self.shared.lock:
            return sum(self.versions[v].waiting for v in range(low, version + 1) if v in self.versions)

    # --- sweep: versions that left the window ---------------------------------------------------------

    def sweep(self, version: int) -> None:
        """Count the unused keys of versions that left the window as `stale`, from one last listing of them,
        then forget those versions. A version is due `sweep_grace_s` after it left the window (uploads that
        land late are still counted) or once `SWEEP_MAX_LAG` versions below it. On a store that lists in key
        order (S3, GCS, memory) due versions are swept `SWEEP_BATCH` at a time with one paged listing across
        their prefixes (1 request per 1,000 keys, not one per version)."""
        low = self.low(version)
        now = time.monotonic()
        with self.shared.lock:
            for key in [k for k, g in self.shared.ready.items() if g.version < low]:
                del self.shared.ready[key]  # never trained on again; the sweep counts it
            due = []
            for v in range(self.shared.cursor.swept_below, low):
                left = self._left_at.setdefault(v, now)
                if now - left < self.sweep_grace_s and v >= low - SWEEP_MAX_LAG:
                    break
                due.append(v)
            oldest = self._left_at.get(due[0], now) if due else now
        if not due:
            return
        if not getattr(self.store, "sorted_listing", False):
            listings = {v: list_keys(self.store, v, None) for v in due}
        elif (
            len(due) >= SWEEP_BATCH or now - oldest >= 4 * self.sweep_grace_s or due[0] < low - SWEEP_MAX_LAG
        ):
            listings = list_range(self.store, due[0], due[-1] + 1)
        else:
            return  # wait for a fuller batch
        for v in due:
            with self.shared.lock:
                if self._closed.is_set() or v < self.shared.cursor.swept_below:
                    continue
                plan = settlement.plan(self.shared.cursor, self.versions.get(v), v, listings.get(v, []))
            read = settlement.read_seqs(  # store I/O, outside the lock
                self.store, self.shared.cursor, self.shared.lock, self.read_signer, v, plan
            )
            with self.shared.lock:
                if not self._closed.is_set() and v >= self.shared.cursor.swept_below:
                    self._account(v, listings.get(v, []), read)

    def _account(self, version: int, keys: list[str], read: dict[str, set[int]] | None = None) -> None:
        lst = self.versions.pop(version, None) or VersionListing(version)
        for key in keys:
            if key not in lst.seen:
                self._merge(lst, key)  # counts junk and duplicates first seen now
        cursor = self.shared.cursor
        for key in lst.seen:
            if cursor.uses.get(key, 0) == 0 and key not in cursor.rejected:
                if layout.is_skip_key(key):  # swept before its audit: never trained on either way
                    cursor.skips["unaudited"] = cursor.skips.get("unaudited", 0) + 1
                elif self._on_probation(key):
                    self.drop("probation")  # a new name's first seqs under standing: never trainable
                else:
                    self.drop("stale")
        settlement.settle(
            self.shared.cursor,
            version,
            lst,
            read or {},
            self.gate.count_gaps,
            self.excused,
            self.gate.count_lost,
        )
        prefix = layout.rollouts_dir(version)
        for d in (self.shared.cursor.uses, self.shared.cursor.rejected, self.shared.ready):
            for k in [k for k in d if k.startswith(prefix)]:
                del d[k]
        self._left_at.pop(version, None)
        self.shared.cursor.swept_below = version + 1

    # --- rejections: the cursor's record of keys never to be trained on -----------------------------

    def _on_probation(self, key: str) -> bool:
        if self.probation is None:
            return False
        parsed = layout.parse_rollout_key(key)
        return parsed is not None and self.probation(parsed[1], parsed[2])

    def drop(self, reason: str) -> None:
        """Count one drop for `reason` (caller holds the lock)."""
        self.shared.cursor.drops[reason] = self.shared.cursor.drops.get(reason, 0) + 1

    def reject(self, key: str, reason: str, detail: str = "") -> None:
        """File `key` as rejected for `reason`: counted, out of the pending set and the fetched groups, never
        fetched again (caller holds the lock). A key that held its (name, seq) and proves to be no record of
        that name (`NOT_THE_NAMES`: junk squatting the seq) hands the seq to the first key filed as its
        duplicate, which is waiting again."""
        self.shared.cursor.rejected[key] = reason
        self.drop(reason)
        parsed = layout.parse_rollout_key(key)
        if parsed is not None and parsed[0] in self.versions:
            self.versions[parsed[0]].remove_pending(key)
            self._release(key, reason)
        self.shared.ready.pop(key, None)
        log.debug("rejected %s: %s %s", key, reason, detail)

    def disown(self, key: str, reason: str) -> None:
        """`key` was found to hold no record of its name (`reason` in `NOT_THE_NAMES`, by the flood audit):
        rejected with that reason even if it was rejected for another before, and off its name's count
        (caller holds the lock)."""
        before = self.shared.cursor.rejected.get(key)
        if before is None:
            self.reject(key, reason)
        elif before not in NOT_THE_NAMES:
            self.shared.cursor.rejected[key] = reason
            self._release(key, reason)

    def _release(self, key: str, reason: str) -> None:
        """A key rejected for `reason`: one in `NOT_THE_NAMES` that held its (name, seq) hands it to its first
        duplicate, or frees it and takes it off the name's count (caller holds the lock)."""
        parsed = layout.parse_rollout_key(key)
        if reason not in NOT_THE_NAMES or parsed is None or parsed[0] not in self.versions:
            return
        lst = self.versions[parsed[0]]
        ident = (parsed[1], parsed[2])
        if lst.ids.get(ident) == key and not self._restore_duplicate(lst, ident, key):
            del lst.ids[ident]  # the seq is free again: the next key listed for it counts
            self._count_listed(lst, parsed[1], kind_of(key), -1)

    def _restore_duplicate(self, lst: VersionListing, ident: tuple[str, int], junk: str) -> bool:
        """Hand the seq `junk` held to its first duplicate still filed as one; False if there is none."""
        for dup in lst.dups.pop(ident, []):
            if self.shared.cursor.rejected.get(dup) != "duplicate":
                continue
            del self.shared.cursor.rejected[dup]
            lst.ids[ident] = dup
            self._recount(lst, ident[0], junk, dup)
            if layout.is_skip_key(dup):
                lst.skips.append(dup)
            else:
                lst.add_pending(dup, ident[0])
            log.info("ingest: %s holds seq %d of %s again (the key listed first was no record of it)",
                     dup, ident[1], ident[0])  # fmt: skip
            return True
        return False
