"""Which seqs of each worker name the store holds: a seq a worker kept back is a gap, a fault of its key.

A worker with seeded draws (`pnyx.protocol.draws`) reserves a group's seq before it generates the group,
and uploads every group it reserved: the ones it offers for training under their rollout keys, the ones it
does not (zero variance) as skip records (`layout.is_skip_key`), and the ones whose version the trainer
left behind while they waited in its spool (late, under their own keys). So a worker name's seqs are
contiguous, and a seq the store never holds, signed by the name's key, is a group its worker generated and
kept back: what a worker that drops groups by their outcome leaves (docs/security.md, "Seeded draws").

`SeqBook` is one name's record in the cursor: `low`, below which every seq was settled, the seqs listed at
or above it, and those of them whose record the trainer read and found signed by the name's key
(`verified`: every group it fetched, every skip record it audited).

**Settling** (`WindowListings.sweep`, when a version leaves the window for good): every seq of a name
below the highest it holds at that version was uploaded by then if it ever will be (seqs grow with
versions). Seqs listed but not read are read then (`unverified`); the ones still missing are looked for in
the versions swept since the name's last settlement (a late upload: `missing`); what remains, and what was
listed under the name but not signed by its key (anyone who may write under `rollouts/` can list a key
under any name), is counted as **gaps**: `gap` faults of the name's key, except the seqs `excuse` marks
(under committed draws, a restarted worker's undrawn cohort, which the trainer's tick excused: counted
`lost`, no fault; `pnyx.train.ticker`). Only names with seeded records
bound to a key are judged; the others' seqs are forgotten (`forget`). A book holds the seqs of versions
not swept yet; books of names with nothing listed and bound to no key are dropped at the sweep (`prune`).

What gaps do not show: a worker that reuses a seq. The seq is reserved only in the worker's memory and
the worker chooses its tasks, so it can draw its next group under the seq of one it did not want (with
another task) and leave no gap (the attack suite's `CherryPicker(form="whole_reuse")`; a commitment to
the task before the draw's randomness is known would bind it: docs/verifiable-sampling.md).

Not built: holding a group back while a seq below it is missing (so a worker's groups after one it kept
back are never trained on). Tried: a late upload lands in a version the trainer has already swept and
never lists again, so the groups after it waited for good (a tiny `pnyx run` starved at v80).

A name's seqs start at 0 (a worker numbers from 0, and the same key under a new name starts again at
0: a name cannot begin after the groups it kept back); with a cursor older than the books, at the lowest
seq listed. Pure: no store, no lock (the listing holds the lock and does the I/O).
"""

from __future__ import annotations

import bisect

import msgspec


class SeqBook(msgspec.Struct):
    """One worker name's seqs (see the module docstring)."""

    low: int | None = None
    """Every seq below it was settled (None: nothing settled yet)."""
    seen: list[int] = []
    """Seqs listed at or above `low`, sorted, each once."""
    verified: list[int] = []
    """Seqs at or above `low` whose record was read and found signed by the name's key, sorted."""
    seeded: bool = False
    """A record of this name had seeded draws: its seqs were reserved before generating (judged)."""
    settled_version: int = 0
    """The version swept at the last settlement (a late upload is looked for from there)."""


def _insert(xs: list[int], x: int) -> None:
    i = bisect.bisect_left(xs, x)
    if i == len(xs) or xs[i] != x:
        xs.insert(i, x)


def _book(books: dict[str, SeqBook], worker: str, start: int | None) -> SeqBook:
    book = books.get(worker)
    if book is None:
        book = books[worker] = SeqBook(low=start)
    return book


def note(books: dict[str, SeqBook], worker: str, seq: int, start: int | None = 0) -> None:
    """`worker`'s group (or skip record) `seq` was listed. `start`: where a new name's seqs begin (0: a
    worker numbers from 0; None: at the lowest listed, for a cursor older than the books)."""
    book = _book(books, worker, start)
    if book.low is None or seq >= book.low:
        _insert(book.seen, seq)


def verify(books: dict[str, SeqBook], worker: str, seq: int, seeded: bool, start: int | None = 0) -> None:
    """`worker`'s record `seq` was read and is signed by the key `worker` is bound to (`start`: as `note`)."""
    book = _book(books, worker, start)
    book.seeded = book.seeded or seeded
    if book.low is None or seq >= book.low:
        _insert(book.seen, seq)
        _insert(book.verified, seq)


def unverified(books: dict[str, SeqBook], worker: str, high: int) -> tuple[list[int], list[int], int]:
    """What settling `worker` up to `high` must read first: (seqs in [low, high] listed but not verified,
    the verified ones, low)."""
    book = books.get(worker)
    if book is None or not book.seen:
        return [], [], high + 1
    low = book.seen[0] if book.low is None else book.low
    listed = book.seen[: bisect.bisect_right(book.seen, high)]
    checked = set(book.verified[: bisect.bisect_right(book.verified, high)])
    return [s for s in listed if s not in checked], sorted(checked), low


def unseen(books: dict[str, SeqBook], worker: str, low: int, high: int) -> int:
    """How many seqs of `worker` in [low, high] were not listed at all: counted from the listed ones, never
    enumerated (a name may hold a seq far above its others: one signed record at seq 10^12 must not make
    the trainer walk 10^12 numbers)."""
    book = books.get(worker)
    seen = book.seen if book is not None else []
    return max(0, high + 1 - low - (bisect.bisect_right(seen, high) - bisect.bisect_left(seen, low)))


def forget(books: dict[str, SeqBook], worker: str, high: int) -> None:
    """Drop `worker`'s listed seqs up to `high` without settling them (a name whose seqs are not judged:
    no seeded record, or bound to no key; its book still starts at the lowest seq listed later)."""
    book = books.get(worker)
    if book is not None:
        del book.seen[: bisect.bisect_right(book.seen, high)]
        del book.verified[: bisect.bisect_right(book.verified, high)]


def excuse(books: dict[str, SeqBook], worker: str, high: int, ranges: list[tuple[int, int]]) -> int:
    """Mark the seqs of `worker` up to `high` that lie in `ranges` ((first, last) pairs) and are not
    verified as accounted for, so `settle` counts them as no gap. Returns how many it marked."""
    book = books.get(worker)
    if book is None or not book.seen or not ranges:
        return 0
    low = book.seen[0] if book.low is None else book.low
    before = len(book.verified)
    for first, last in ranges:
        for seq in range(max(first, low), min(last, high) + 1):
            _insert(book.verified, seq)
    return len(book.verified) - before


def settle(books: dict[str, SeqBook], worker: str, high: int, version: int) -> int:
    """Close `worker`'s seqs up to `high` (a seq it holds at `version`, now swept): count every seq in
    [low, high] not verified, forget them all. Returns the gaps."""
    book = books.get(worker)
    if book is None or not book.seen:
        return 0
    low = book.seen[0] if book.low is None else book.low
    if high < low:
        return 0
    end = bisect.bisect_right(book.verified, high)
    gaps = high + 1 - low - len(book.verified[:end])
    del book.verified[:end]
    del book.seen[: bisect.bisect_right(book.seen, high)]
    book.low, book.settled_version = high + 1, version
    return gaps


def prune(books: dict[str, SeqBook], bound: dict[str, str]) -> None:
    """Drop the books of names bound to no key that hold no listed seq (junk and rejected names)."""
    for name in [n for n, b in books.items() if not b.seen and n not in bound]:
        del books[name]
