"""Which seqs of each worker name the store holds: the gaps a worker leaves are counted against its key.

A worker with seeded draws (`pnyx.protocol.draws`) reserves a group's seq before it generates the group,
and uploads every group it reserved: the ones it offers for training under their rollout keys, the ones it
does not (zero variance) as skip records (`layout.is_skip_key`). So a worker name's seqs are contiguous,
and a seq the store never holds is a group its worker generated and kept back: what a worker that drops
groups by their outcome leaves (docs/security.md, "Seeded draws").

`SeqBook` is one name's record in the cursor: `low`, below which every seq was listed or counted, and the
seqs listed at or above it. The listing notes every rollout key and skip record it lists (`note`); when a
version is swept (its last listing, `WindowListings.sweep`), every seq of a name below the highest it holds
at that version has been listed if it exists (seqs grow with versions: a worker generates with the newest
weights it holds), so the missing ones are counted (`settle`). A name's first book starts at the lowest seq
listed (a trainer that meets a worker mid-run does not count the seqs it never saw).

Bounded: a book holds the seqs of versions not swept yet, and books of names bound to no key with nothing
listed are dropped at the sweep. Pure: no store, no lock (the listing's caller holds it).
"""

from __future__ import annotations

import bisect

import msgspec


class SeqBook(msgspec.Struct):
    """One worker name's listed seqs (see the module docstring)."""

    low: int | None = None
    """Every seq below it was listed or counted as a gap (None: nothing settled yet)."""
    seen: list[int] = []
    """Seqs listed at or above `low`, sorted, each once."""


def note(books: dict[str, SeqBook], worker: str, seq: int) -> None:
    """`worker`'s group (or skip record) `seq` was listed."""
    book = books.get(worker)
    if book is None:
        book = books[worker] = SeqBook()
    if book.low is not None and seq < book.low:
        return  # settled already (counted as a gap then: it landed after its version was swept)
    i = bisect.bisect_left(book.seen, seq)
    if i == len(book.seen) or book.seen[i] != seq:
        book.seen.insert(i, seq)


def settle(books: dict[str, SeqBook], worker: str, high: int) -> int:
    """Every seq of `worker` below `high` (a seq it holds at a version now swept) exists in the store if it
    was ever uploaded: count the ones never listed, forget the listed ones up to `high`. Returns the gaps."""
    book = books.get(worker)
    if book is None:
        return 0
    end = bisect.bisect_right(book.seen, high)
    listed = book.seen[:end]
    if not listed:
        return 0
    low = listed[0] if book.low is None else book.low
    gaps = max(0, high + 1 - low - len(listed))
    book.low = max(low, high + 1)
    del book.seen[:end]
    return gaps


def prune(books: dict[str, SeqBook], bound: dict[str, str]) -> None:
    """Drop the books of names bound to no key that hold no listed seq (junk and rejected names)."""
    for name in [n for n, b in books.items() if not b.seen and n not in bound]:
        del books[name]
