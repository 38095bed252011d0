"""What the trainer knows about the rollout keys of one version, from listings alone (no object is read).

A `VersionListing` holds every key listed under `rollouts/v{V:08d}/` so far: the keys still waiting to be
trained on (per worker, oldest first), the highest upload stamp seen (the incremental listing resumes just
below it), and when the prefix was last listed. `list_keys` is the only I/O: one LIST request per 1,000
keys, starting after `high_ms - STAMP_SLACK_MS` for an incremental listing, or at the start of the prefix
for a full one.

Why a slack: a key is stamped by its uploader before its upload lands, so a key can appear in a listing
after keys with higher stamps; re-listing the last few seconds catches it (the `seen` set deduplicates).
A key that lands later than that (a slow upload, a clock that runs behind) is found by the periodic full
listing (`RESCAN_S`) or, at the latest, by the sweep when its version leaves the window. A clock that runs
ahead cannot push the incremental bound past now (`now_ms` caps it), so it never hides other workers' keys.

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

import bisect
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pnyx.errors import StoreError
from pnyx.protocol import layout
from pnyx.store import Store
from pnyx.train import seq_books
from pnyx.train.ingest_state import Cursor, IngestSettings
from pnyx.train.rescore import ScoredGroup

log = logging.getLogger("pnyx.train.ingest")

STAMP_SLACK_MS = 2_000
"""An incremental listing re-reads keys stamped this long before the highest stamp seen (uploads in flight)."""
PAGE = 1000
"""Keys per LIST request on S3-compatible stores."""
RESCAN_S = 60.0
"""Each version in the window is listed from the start of its prefix this often (late keys, old layout)."""
SWEEP_GRACE_S = 30.0
"""A version is swept (its unused keys counted `stale`) this long after it left the window..."""
SWEEP_MAX_LAG = 16
"""...or once it is this many versions below the window, whichever comes first."""
SWEEP_BATCH = 8
"""On a store that lists in key order, versions are swept this many at a time (one paged listing)."""


@dataclass
class SettlePlan:
    """What settling one worker name at a swept version needs read first (`WindowListings._settle_plan`)."""

    fp: str
    """The key the name is bound to: only records it signed account for a seq."""
    low: int
    """The name's lowest seq not settled."""
    listed: dict[int, list[str]]
    """Seqs listed but not read yet -> every key listed for that seq (one signed by `fp` is enough)."""
    verified: set[int]
    """The name's seqs at the version already read and found signed by `fp`."""
    since: int
    """The version of the name's last settlement (a missing seq is looked for from there: a late upload)."""


@dataclass
class VersionListing:
    """The listed keys of one version's rollout prefix."""

    version: int
    seen: set[str] = field(default_factory=set)
    """Every key listed under this prefix (rollout keys and junk), so a re-listing adds nothing twice."""
    pending: dict[str, list[str]] = field(default_factory=dict)
    """Worker id -> keys that may still be trained on (not rejected, not used up), sorted (oldest first)."""
    ids: dict[tuple[str, int], str] = field(default_factory=dict)
    """(worker, seq) -> the key that holds that group: a second key for the same group is a duplicate."""
    counts: dict[str, int] = field(default_factory=dict)
    """Worker id -> distinct groups listed under it at this version (used, rejected or waiting)."""
    by_key: dict[str, int] = field(default_factory=dict)
    """Key fingerprint -> distinct groups listed at this version under the names bound to it (the flood
    limit, `IngestSettings.flood_limit`)."""
    skips: list[str] = field(default_factory=list)
    """Skip records (`layout.is_skip_key`) listed and not yet handed to the audit (`take_skips`)."""
    high_ms: int = -1
    """The highest upload stamp listed so far (-1: none)."""
    listed_at: float | None = None
    """Monotonic time of the last listing (None: never listed)."""
    full_at: float | None = None
    """Monotonic time of the last listing from the start of the prefix."""

    @property
    def waiting(self) -> int:
        return sum(len(keys) for keys in self.pending.values())

    def add_pending(self, key: str, worker: str) -> None:
        keys = self.pending.setdefault(worker, [])
        if not keys or key > keys[-1]:
            keys.append(key)  # the common case: listings come in key order
        else:
            bisect.insort(keys, key)

    def remove_pending(self, key: str) -> bool:
        parsed = layout.parse_rollout_key(key)
        if parsed is None:
            return False
        keys = self.pending.get(parsed[1])
        if not keys:
            return False
        i = bisect.bisect_left(keys, key)
        if i < len(keys) and keys[i] == key:
            del keys[i]
            if not keys:
                del self.pending[parsed[1]]
            return True
        return False

    def start_after(self, now_ms: int, full: bool) -> str | None:
        """The `start_after` bound of the next listing (None: from the start of the prefix)."""
        if full or self.listed_at is None or self.high_ms < 0:
            return None
        return layout.rollouts_start_after(self.version, min(self.high_ms, now_ms) - STAMP_SLACK_MS)


def list_keys(store: Store, version: int, start_after: str | None) -> list[str]:
    """Keys under `rollouts/v{version:08d}/` after `start_after`, sorted (the only I/O of this module)."""
    return [m.key for m in store.list(layout.rollouts_dir(version), start_after=start_after)]


def list_range(store: Store, first: int, end: int, start_after: str | None = None) -> dict[int, list[str]]:
    """The keys of versions [first, end) after `start_after` (default: all), by version, from one paged
    listing of `rollouts/` (for stores that list in key order and start after a key server-side: one
    request per 1,000 keys)."""
    out: dict[int, list[str]] = {v: [] for v in range(first, end)}
    stop = layout.rollouts_dir(end)
    after = start_after or layout.rollouts_dir(first)  # the bare prefix sorts before every key under it
    while True:
        page = store.list(layout.ROLLOUTS_PREFIX, start_after=after, limit=PAGE)
        for m in page:
            if m.key >= stop:
                return out
            parsed = layout.parse_rollout_key(m.key)
            version = parsed[0] if parsed is not None else _version_of_dir(m.key)
            if version is not None and first <= version < end:
                out[version].append(m.key)
        if len(page) < PAGE:
            return out
        after = page[-1].key


def _version_of_dir(key: str) -> int | None:
    """The version of a junk key under `rollouts/v{V:08d}/` (so the sweep counts it), else None."""
    head = key[len(layout.ROLLOUTS_PREFIX) :].split("/", 1)[0]
    return int(head[1:]) if len(head) == 9 and head[0] == "v" and head[1:].isdigit() else None


class KeyGate(Protocol):
    """What the listing asks about the signing key a worker name is bound to (the `KeyLedger` answers;
    the caller holds the lock)."""

    def quarantined_name(self, worker: str) -> bool:
        """`worker` is bound to a quarantined key (its listed keys are rejected, never downloaded)."""
        ...

    def check_flood(self, fp: str, version: int, n: int) -> None:
        """Key `fp` now has `n` groups listed at `version` (quarantined past the flood limit)."""
        ...

    def count_gaps(self, worker: str, n: int) -> None:
        """`worker` left `n` seqs that the store never held (`seq_books.settle`)."""
        ...


class OpenGate:
    """A `KeyGate` that quarantines nothing: the gate of a listing whose ledger is not connected yet."""

    def quarantined_name(self, worker: str) -> bool:
        return False

    def check_flood(self, fp: str, version: int, n: int) -> None:
        return None

    def count_gaps(self, worker: str, n: int) -> None:
        return None


@dataclass
class Shared:
    """What the ingestor and its three collaborators share (the listing, the key ledger, the planner): one
    lock over all of it, the cursor (replaced whole on resume), the settings, and the fetched groups."""

    cursor: Cursor
    settings: IngestSettings
    lock: threading.RLock = field(default_factory=threading.RLock)
    ready: dict[str, ScoredGroup] = field(default_factory=dict)
    """Fetched, valid groups by key, until consumed or dropped."""


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
        self.read_signer: Callable[[str, str, int], tuple[str, bool] | None] = lambda key, worker, seq: None
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
            start_after = self._listing(version).start_after(layout.now_ms(), full)
        return self._file(
            {version: list_keys(self.store, version, start_after)}, {version: start_after is None}
        )

    def list_span(self, first: int, last: int) -> int:
        """List versions first..last with one paged listing (stores that list in key order): `first`
        incrementally, the newer ones from their start (they are young: few keys). Returns new keys."""
        with self.shared.lock:
            start_after = self._listing(first).start_after(layout.now_ms(), False)
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
                for key in keys:
                    if key not in lst.seen:
                        new += 1
                        self._merge(lst, key)
                lst.listed_at = now
                if complete.get(version):
                    lst.full_at = now
            self.listed += new
        return new

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
            # Two keys for one group: the first listed stays unless the other was consumed already.
            keep, dup = (key, other) if self.shared.cursor.uses.get(key, 0) > 0 else (other, key)
            lst.ids[ident] = keep
            if dup not in self.shared.cursor.rejected:
                lst.remove_pending(dup)
                self.shared.ready.pop(dup, None)
                self.reject(dup, "duplicate")
            if keep is other:
                return
        elif not layout.is_skip_key(key):  # a skip record is no group: the flood limit counts groups
            self._count_listed(lst, parsed[1])
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

    def _count_listed(self, lst: VersionListing, worker: str) -> None:
        """One more distinct group of `worker` listed at `lst.version`, and of the key its name is bound to."""
        lst.counts[worker] = lst.counts.get(worker, 0) + 1
        fp = self.shared.cursor.keys.get(worker)
        if fp:
            n = lst.by_key[fp] = lst.by_key.get(fp, 0) + 1
            self.gate.check_flood(fp, lst.version, n)

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
        """The skip records listed since the last call, of versions not swept (their audit is the caller's)."""
        with self.shared.lock:
            out = []
            for lst in self.versions.values():
                out += lst.skips
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
                plan = self._settle_plan(v, listings.get(v, []))
            read = self._read_seqs(v, plan)  # store I/O, outside the lock
            with self.shared.lock:
                if not self._closed.is_set() and v >= self.shared.cursor.swept_below:
                    self._account(v, listings.get(v, []), read)

    def _settle_plan(self, version: int, keys: list[str]) -> dict[str, SettlePlan]:
        """Per name with seeded records bound to a key and listed at `version`: what settling it needs read
        first (`seq_books.unverified`; caller holds the lock)."""
        lst = self.versions.get(version) or VersionListing(version)
        by_ident: dict[tuple[str, int], list[str]] = {}
        for key in set(keys) | lst.seen:
            parsed = layout.parse_rollout_key(key)
            if parsed is not None and parsed[0] == version:
                by_ident.setdefault((parsed[1], parsed[2]), []).append(key)
                seq_books.note(self.shared.cursor.seqs, parsed[1], parsed[2], self.shared.cursor.seq_start)
        books, bound = self.shared.cursor.seqs, self.shared.cursor.keys
        high: dict[str, int] = {}
        for worker, seq in by_ident:
            high[worker] = max(seq, high.get(worker, -1))
        plans = {}
        for worker, top in high.items():
            book = books.get(worker)
            if book is None or not book.seeded or worker not in bound:
                continue
            listed, verified, low = seq_books.unverified(books, worker, top)
            plans[worker] = SettlePlan(
                bound[worker], low, {s: sorted(by_ident.get((worker, s), [])) for s in listed},
                {s for s in verified if (worker, s) in by_ident}, book.settled_version,
            )  # fmt: skip
        return plans

    def _read_seqs(self, version: int, plans: dict[str, SettlePlan]) -> dict[str, set[int]]:
        """Per name, the seqs of `plans` found signed by its key: the listed ones read, the missing ones
        looked for in the versions swept since its last settlement (a late upload). No lock held."""
        found = {w: self._read_listed(w, p) for w, p in plans.items()}
        want: set[tuple[str, int]] = set()
        with self.shared.lock:
            for worker, plan in plans.items():
                signed = plan.verified | found[worker]  # the name's genuine seqs at this version
                if signed:
                    lost = seq_books.missing(self.shared.cursor.seqs, worker, plan.low, max(signed))
                    want.update((worker, s) for s in lost)
        if want:  # a late upload lands in a version swept already: one paged listing since the oldest
            since = min(plans[w].since for w, _ in want)
            late: dict[str, SettlePlan] = {}
            try:
                for v, keys in list_range(self.store, since, version + 1).items():
                    for key in keys:
                        parsed = layout.parse_rollout_key(key)
                        if parsed is not None and parsed[0] == v and (parsed[1], parsed[2]) in want:
                            plan = late.setdefault(
                                parsed[1], SettlePlan(plans[parsed[1]].fp, 0, {}, set(), 0)
                            )
                            plan.listed.setdefault(parsed[2], []).append(key)
            except StoreError as e:
                log.warning("ingest: the sweep of v%d could not look for late uploads (%s)", version, e)
            for worker, plan in late.items():
                found[worker] |= self._read_listed(worker, plan)
        return found

    def _read_listed(self, worker: str, plan: SettlePlan) -> set[int]:
        """The seqs of `plan.listed` with at least one key holding a record of them signed by `plan.fp`."""
        out = set()
        for seq, keys in plan.listed.items():
            for key in keys:
                try:
                    got = self.read_signer(key, worker, seq)
                except StoreError as e:  # unknown: not counted against the key
                    log.warning("ingest: could not read %s at the sweep (%s)", key, e)
                    got = (plan.fp, False)
                if got is not None and got[0] == plan.fp:
                    out.add(seq)
                    break
        return out

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
                else:
                    self.drop("stale")
        self._settle(version, lst, read or {})
        prefix = layout.rollouts_dir(version)
        for d in (self.shared.cursor.uses, self.shared.cursor.rejected, self.shared.ready):
            for k in [k for k in d if k.startswith(prefix)]:
                del d[k]
        self._left_at.pop(version, None)
        self.shared.cursor.swept_below = version + 1

    def _settle(self, version: int, lst: VersionListing, read: dict[str, set[int]]) -> None:
        """Settle the seqs of every name listed at `version` (`seq_books.settle`): a name with seeded records
        bound to a key up to the highest seq at `version` signed by that key, counting the gaps against it;
        any other name up to its highest seq there, counting nothing (caller holds the lock)."""
        books = self.shared.cursor.seqs
        high: dict[str, int] = {}
        for worker, seq in lst.ids:
            high[worker] = max(seq, high.get(worker, -1))
        for worker, top in high.items():
            book = books.get(worker)
            if worker not in read or book is None:
                seq_books.forget(books, worker, top)  # not judged: no seeded record, or no key bound
                continue
            for seq in read[worker]:
                seq_books.verify(books, worker, seq, True, self.shared.cursor.seq_start)
            here = {seq for w, seq in lst.ids if w == worker}
            junk = here.difference(book.verified)  # listed under the name, not signed by its key
            book.seen = [seq for seq in book.seen if seq not in junk]
            signed = here - junk
            if not signed:
                continue
            gaps = seq_books.settle(books, worker, max(signed), version)
            if gaps:
                self.shared.cursor.gaps += gaps
                self.gate.count_gaps(worker, gaps)
        seq_books.prune(books, self.shared.cursor.keys)

    # --- rejections: the cursor's record of keys never to be trained on -----------------------------

    def drop(self, reason: str) -> None:
        """Count one drop for `reason` (caller holds the lock)."""
        self.shared.cursor.drops[reason] = self.shared.cursor.drops.get(reason, 0) + 1

    def reject(self, key: str, reason: str, detail: str = "") -> None:
        """File `key` as rejected for `reason`: counted, out of the pending set and the fetched groups, never
        fetched again (caller holds the lock)."""
        self.shared.cursor.rejected[key] = reason
        self.drop(reason)
        parsed = layout.parse_rollout_key(key)
        if parsed is not None and parsed[0] in self.versions:
            self.versions[parsed[0]].remove_pending(key)
        self.shared.ready.pop(key, None)
        log.debug("rejected %s: %s %s", key, reason, detail)
