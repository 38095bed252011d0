"""The order in which the trainer wants rollout groups, computed from the listing alone.

`ranked` walks the keys of the window best first: fresh (never used) before replayed; the newest policy
version first (least stale); within a version, workers take turns (each worker's oldest waiting group
first, ties by key), so one worker whose id sorts first, or that uploads faster, cannot crowd the others
out of a batch. One exception, `rescue`: up to that many fresh groups of the window's oldest version, whose
last chance this step is, come first. Under newest-first alone a group left behind once is never chosen
while fresher ones keep arriving, and supply control (which aims a step's worth of groups at the trainer's
next publish) replaces it: the default arith run dropped 114 such groups as stale of 1,741 uploaded
(BENCHMARKS.md, "Generated groups the trainer consumes"). It is lazy: taking the top `n` of a window
holding thousands of keys touches one key per worker of the newest versions, not the backlog.

Knows nothing about records, scoring or the store. Pure: the caller holds whatever lock guards the
listings and use counts while it iterates.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from pnyx.train.rescore import ScoredGroup
from pnyx.train.version_listing import VersionListing


@dataclass
class Plan:
    """One pass of the ranking: the groups chosen so far and what must be fetched before it is final."""

    chosen: list[ScoredGroup]
    unknown: list[str]
    """Keys inside the top `n` whose records have not been fetched yet (the choice waits for them)."""
    extra: list[str]
    """Keys just below the top, fetched along (sized by the recent survival rate), waited for by no one."""
    unlisted: int | None
    """A version in the window never listed yet: list it before trusting this plan."""


def ranked(
    versions: dict[int, VersionListing],
    uses: dict[str, int],
    version: int,
    low: int,
    max_reuse: int,
    exclude: frozenset[str],
    rescue: int = 0,
) -> Iterator[str | int]:
    """Candidate keys for the step at `version`, best first (caller holds the lock). Fresh before
    replayed; newest version first; within a version workers take turns, each worker's oldest first
    (ties by key); before all of them, up to `rescue` fresh keys of version `low` (their last step in the
    window, when `low < version`). Yields a version number instead when that version was never listed."""
    rescued: set[str] = set()
    if rescue > 0 and low < version:
        lst = versions.get(low)
        if lst is None or lst.listed_at is None:
            yield low
            return
        for k in _turns(lst, uses, 0, exclude):
            if len(rescued) >= rescue:
                break
            rescued.add(k)
            yield k
    for level in range(max_reuse):
        for v in range(version, low - 1, -1):
            lst = versions.get(v)
            if lst is None or lst.listed_at is None:
                yield v
                return
            for k in _turns(lst, uses, level, exclude):
                if k not in rescued:
                    yield k


def _turns(lst: VersionListing, uses: dict[str, int], level: int, exclude: frozenset[str]) -> Iterator[str]:
    """One version's keys used `level` times so far, workers taking turns, each worker's oldest first."""
    streams = [
        (k for k in keys if uses.get(k, 0) + (k in exclude) == level)
        for _, keys in sorted(lst.pending.items())
    ]
    while streams:
        heads, alive = [], []
        for s in streams:
            k = next(s, None)
            if k is not None:
                heads.append(k)
                alive.append(s)
        heads.sort()
        yield from heads
        streams = alive
