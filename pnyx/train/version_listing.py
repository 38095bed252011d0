"""The listed keys of one version's rollout prefix, and the two listings that read them (no object is read).

A `VersionListing` holds every key listed under `rollouts/v{V:08d}/` so far: the keys still waiting to be
trained on (per worker, oldest first), the highest upload stamp seen (the incremental listing resumes just
below it), and when the prefix was last listed. `list_keys` lists one prefix (one LIST request per 1,000
keys), starting after `high_ms - STAMP_SLACK_MS` for an incremental listing, or at the start of the prefix
for a full one; `list_range` lists several versions with one paged listing (stores that list in key order).

Why a slack: a key is stamped by its uploader before its upload lands, so a key can appear in a listing
after keys with higher stamps; re-listing the last few seconds catches it (the `seen` set deduplicates).
A clock that runs ahead cannot push the incremental bound past now (`now_ms` caps it), so it never hides
other workers' keys. Knows nothing about signatures, keys' standing or the window (`pnyx.train.listing`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from pnyx.protocol import layout
from pnyx.store import Store

GROUPS = "groups"
"""The kind of a listed rollout key that offers a group for training."""
SKIPS = "skip records"
"""The kind of a listed skip record (`layout.is_skip_key`): a group its worker announces and does not offer.
Counted, never a flood: a trainer short of a batch publishes no new version, so an honest worker whose
draws at that version keep coming out zero-variance announces them without bound; a per-version cap on
skip records stopped such a worker and the run with it (measured 2026-12-05: 8 skip records, 1 group,
the trainer waiting 224 s for its second)."""


def kind_of(key: str) -> str:
    """`SKIPS` for a skip record, else `GROUPS`."""
    return SKIPS if layout.is_skip_key(key) else GROUPS


STAMP_SLACK_MS = 2_000
"""An incremental listing re-reads keys stamped this long before the highest stamp seen (uploads in flight),
at least: the listing widens it when a full listing finds a key that landed further behind
(`pnyx.train.listing.WindowListings.slack_ms`)."""
MAX_SLACK_MS = 60_000
"""The widest the slack grows (a key later than this waits for the next full listing, `RESCAN_S`)."""
PAGE = 1000
"""Keys per LIST request on S3-compatible stores."""


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
    dups: dict[tuple[str, int], list[str]] = field(default_factory=dict)
    """(worker, seq) -> keys filed as its duplicates, in listing order (one takes the seq back if the key
    holding it proves to be no record of that worker: `listing.NOT_THE_NAMES`)."""
    counts: dict[tuple[str, str], int] = field(default_factory=dict)
    """(worker id, kind) -> distinct seqs listed under it at this version (used, rejected or waiting), of
    `kind` `GROUPS` or `SKIPS`; a key found to hold no record of the name (`listing.NOT_THE_NAMES`) is
    taken off again."""
    by_key: dict[tuple[str, str], int] = field(default_factory=dict)
    """(key fingerprint, kind) -> distinct seqs listed at this version under the names bound to it (the
    flood limit, `IngestSettings.flood_limit`, applies to each kind)."""
    verified: set[str] = field(default_factory=set)
    """Keys read by a flood audit and found to hold a record of their own name, signed by its key
    (`pnyx.train.flood_audit`)."""
    audited: set[str] = field(default_factory=set)
    """Keys read by a flood audit (whatever they held): never read by one again."""
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

    def start_after(self, now_ms: int, full: bool, slack_ms: int = STAMP_SLACK_MS) -> str | None:
        """The `start_after` bound of the next listing (None: from the start of the prefix): `slack_ms` below
        the highest stamp seen."""
        if full or self.listed_at is None or self.high_ms < 0:
            return None
        return layout.rollouts_start_after(self.version, min(self.high_ms, now_ms) - slack_ms)


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
