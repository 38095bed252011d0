"""Settling a swept version's seqs: which seqs each worker name left empty (`gap` faults of its key).

When the sweep (`pnyx.train.listing.WindowListings.sweep`) forgets a version, every worker name listed there
with seeded records, bound to a signing key, is settled up to its highest seq at that version signed by
that key (`pnyx.train.seq_books`). Three steps, the middle one store I/O without the ingestor's lock:
- `plan`: per name, what must be read first: the seqs listed but never read (stale groups, skip records
  swept before their audit) and the seqs already verified;
- `read_seqs`: read those records' signers (`ReadSigner`, the ingestor's) and look for the seqs still
  missing in the versions swept since the name's last settlement (an upload that landed late, in a version
  the trainer no longer lists);
- `settle`: count the seqs that no record signed by the name's key holds as gaps (`KeyGate.count_gaps`).
Junk listed under a name (a record not signed by its key) accounts for nothing, and junk squatting a seq
the worker did upload makes no gap. A store error while reading leaves a seq unknown, never a gap.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from pnyx.errors import StoreError
from pnyx.protocol import layout
from pnyx.store import Store
from pnyx.train import seq_books
from pnyx.train.ingest_state import Cursor
from pnyx.train.version_listing import VersionListing, list_range

log = logging.getLogger("pnyx.train.ingest")

ReadSigner = Callable[[str, str, int], "tuple[str, bool] | None"]
"""(key, worker, seq) -> (fingerprint, seeded) of the record under key if it is a valid signed record of
(worker, seq), else None (`Admission.read_signer`)."""


@dataclass
class SettlePlan:
    """What settling one worker name at a swept version needs read first (`plan`)."""

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


def plan(cursor: Cursor, lst: VersionListing | None, version: int, keys: list[str]) -> dict[str, SettlePlan]:
    """Per name with seeded records bound to a key and listed at `version` (in `lst` or the sweep's last
    listing `keys`): what settling it needs read first (`seq_books.unverified`; caller holds the lock)."""
    seen = lst.seen if lst is not None else set()
    by_ident: dict[tuple[str, int], list[str]] = {}
    for key in set(keys) | seen:
        parsed = layout.parse_rollout_key(key)
        if parsed is not None and parsed[0] == version:
            by_ident.setdefault((parsed[1], parsed[2]), []).append(key)
            seq_books.note(cursor.seqs, parsed[1], parsed[2], cursor.seq_start)
    books, bound = cursor.seqs, cursor.keys
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


def read_seqs(
    store: Store,
    cursor: Cursor,
    lock: threading.RLock,
    read_signer: ReadSigner,
    version: int,
    plans: dict[str, SettlePlan],
) -> dict[str, set[int]]:
    """Per name, the seqs of `plans` found signed by its key: the listed ones read, the missing ones looked
    for in the versions swept since its last settlement (a late upload). Takes `lock` only to read the
    books; the I/O runs without it."""
    found = {w: read_listed(read_signer, w, p) for w, p in plans.items()}
    want: dict[str, tuple[int, int, list[int]]] = {}  # name -> [low, high] holding unlisted seqs, listed ones
    with lock:
        for worker, p in plans.items():
            signed = p.verified | found[worker]  # the name's genuine seqs at this version
            if signed and seq_books.unseen(cursor.seqs, worker, p.low, max(signed)):
                book = cursor.seqs.get(worker)
                want[worker] = (p.low, max(signed), list(book.seen) if book is not None else [])
    if want:  # a late upload lands in a version swept already: one paged listing since the oldest
        since = min(plans[w].since for w in want)
        late: dict[str, SettlePlan] = {}
        try:
            for v, keys in list_range(store, since, version + 1).items():
                for key in keys:
                    parsed = layout.parse_rollout_key(key)
                    if parsed is None or parsed[0] != v or parsed[1] not in want:
                        continue
                    worker, seq = parsed[1], parsed[2]
                    low, high, seen = want[worker]
                    i = bisect.bisect_left(seen, seq)
                    if low <= seq <= high and (i == len(seen) or seen[i] != seq):  # a seq never listed
                        p = late.setdefault(worker, SettlePlan(plans[worker].fp, 0, {}, set(), 0))
                        p.listed.setdefault(seq, []).append(key)
        except StoreError as e:
            log.warning("ingest: the sweep of v%d could not look for late uploads (%s)", version, e)
        for worker, p in late.items():
            found[worker] |= read_listed(read_signer, worker, p)
    return found


def read_listed(read_signer: ReadSigner, worker: str, p: SettlePlan) -> set[int]:
    """The seqs of `p.listed` with at least one key holding a record of them signed by `p.fp`."""
    out = set()
    for seq, keys in p.listed.items():
        for key in keys:
            try:
                got = read_signer(key, worker, seq)
            except StoreError as e:  # unknown: not counted against the key
                log.warning("ingest: could not read %s at the sweep (%s)", key, e)
                got = (p.fp, False)
            if got is not None and got[0] == p.fp:
                out.add(seq)
                break
    return out


def settle(
    cursor: Cursor,
    version: int,
    lst: VersionListing,
    read: dict[str, set[int]],
    count_gaps: Callable[[str, int], None],
    excused: Callable[[str, str], list[tuple[int, int]]] | None = None,
    count_lost: Callable[[str, int], None] | None = None,
) -> None:
    """Settle the seqs of every name listed at `version` (`seq_books.settle`): a name with seeded records
    bound to a key up to the highest seq at `version` signed by that key, counting its gaps in the cursor
    and through `count_gaps`; any other name up to its highest seq there, counting nothing (caller holds
    the lock). A missing seq in one of `excused(name, key)`'s ranges is no gap: it is counted through
    `count_lost` (a restarted worker's undrawn cohort under committed draws: `pnyx.train.ticker`)."""
    books = cursor.seqs
    high: dict[str, int] = {}
    for worker, seq in lst.ids:
        high[worker] = max(seq, high.get(worker, -1))
    for worker, top in high.items():
        book = books.get(worker)
        if worker not in read or book is None:
            seq_books.forget(books, worker, top)  # not judged: no seeded record, or no key bound
            continue
        for seq in read[worker]:
            seq_books.verify(books, worker, seq, True, cursor.seq_start)
        here = {seq for w, seq in lst.ids if w == worker}
        junk = here.difference(book.verified)  # listed under the name, not signed by its key
        book.seen = [seq for seq in book.seen if seq not in junk]
        signed = here - junk
        if not signed:
            continue
        fp = cursor.keys.get(worker)
        if excused is not None and fp:
            lost = seq_books.excuse(books, worker, max(signed), excused(worker, fp))
            if lost and count_lost is not None:
                count_lost(worker, lost)
        gaps = seq_books.settle(books, worker, max(signed), version)
        if gaps:
            cursor.gaps += gaps
            count_gaps(worker, gaps)
    seq_books.prune(books, cursor.keys)
