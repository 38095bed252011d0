"""Choosing the J external groups of a step from the pool of recent, validated, re-scored foreign groups.

`Pool` holds candidates (see `foreign.Candidate`) and forgets them once used (each foreign group trains a
node at most once), once they leave the time window, when a peer has more than `recent_per_peer`
waiting (the oldest go), or when it holds more than `max_items` across peers (the oldest uploads go). A candidate whose content (task and texts) is already in the pool or was used is
not added: copies under other keys or names cannot fill a step. `sample_external` draws J of them:

- ``uniform``: uniformly at random;
- ``variance``: first among groups whose rewards *under this node's own verifier* differ (the only ones
  that carry a GRPO signal), then uniformly among the rest; claimed rewards never influence the draw.

In both modes no peer contributes more than `max_per_peer` groups to one step, so one prolific or
hostile peer cannot dominate a batch. Pure Python; knows nothing about torch or the store.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Literal

from pnyx.errors import ConfigError
from pnyx.swarm.foreign import Candidate

Prefer = Literal["uniform", "variance"]


def sample_external(
    candidates: list[Candidate], j: int, prefer: Prefer, max_per_peer: int, rng: random.Random
) -> list[Candidate]:
    """Draw up to `j` candidates (fewer if the pool or the per-peer cap allows fewer)."""
    if prefer not in ("uniform", "variance"):
        raise ConfigError(f"prefer must be 'uniform' or 'variance', got {prefer!r}")
    order = list(candidates)
    rng.shuffle(order)
    if prefer == "variance":
        order.sort(key=lambda c: not c.has_variance)  # stable: shuffled within each class
    picked: list[Candidate] = []
    per_peer: Counter[str] = Counter()
    for c in order:
        if len(picked) >= j:
            break
        if per_peer[c.peer] >= max_per_peer:
            continue
        per_peer[c.peer] += 1
        picked.append(c)
    return picked


MAX_POOL = 1024
"""Candidates a pool holds at most, whatever number of peers (names are free): past it the oldest uploads go."""


class Pool:
    """Recent foreign candidates, keyed by store key (at most `max_items`, the newest uploads)."""

    def __init__(self, window_s: float, recent_per_peer: int, max_items: int = MAX_POOL):
        self.window_s = window_s
        self.recent_per_peer = recent_per_peer
        self.max_items = max_items
        self._items: dict[str, Candidate] = {}
        self._used: set[str] = set()
        self._used_content: set[bytes] = set()

    def __len__(self) -> int:
        return len(self._items)

    def add(self, cands: list[Candidate]) -> int:
        """Add new candidates; returns how many were copies of content held or used already (not added)."""
        held = {c.content for c in self._items.values()} | self._used_content
        copies = 0
        for c in cands:
            if c.key in self._used or c.key in self._items:
                continue
            content = c.content
            if content in held:
                copies += 1
                continue
            held.add(content)
            self._items[c.key] = c
        if len(self._items) > self.max_items:
            newest = sorted(self._items.values(), key=lambda c: c.uploaded)[-self.max_items :]
            self._items = {c.key: c for c in newest}
        return copies

    def prune(self, now: float) -> int:
        """Forget candidates outside the window and all but each peer's newest `recent_per_peer`."""
        before = len(self._items)
        keep = {k: c for k, c in self._items.items() if now - c.uploaded <= self.window_s}
        by_peer: dict[str, list[Candidate]] = {}
        for c in keep.values():
            by_peer.setdefault(c.peer, []).append(c)
        self._items = {}
        for cs in by_peer.values():
            cs.sort(key=lambda c: c.group.seq)
            for c in cs[-self.recent_per_peer :]:
                self._items[c.key] = c
        return before - len(self._items)

    def candidates(self) -> list[Candidate]:
        return sorted(self._items.values(), key=lambda c: c.key)

    def take(self, cands: list[Candidate]) -> None:
        """Mark candidates used: they never come back."""
        for c in cands:
            self._used.add(c.key)
            self._used_content.add(c.content)
            self._items.pop(c.key, None)
