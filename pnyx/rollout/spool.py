"""The worker's upload spool: a bounded FIFO of encoded rollout groups waiting for the store.

A worker never loses a group it generated just because the store is briefly down: each encoded group
enters the spool, and `flush` uploads from the head with create-only puts until the spool is empty, a
put fails transiently (the store is down: try again later), or a deadline passes. The spool is bounded
(`max_groups`); past the bound the *oldest* group is dropped and counted, since the trainer's staleness
window would discard it first anyway.

Optional on-disk copy (`folder=`): each pending group is also written to a file (temp file + rename, so
a crash never leaves a half file), removed once uploaded. A restarted worker with the same folder loads
the files and uploads them, so even a restart loses nothing generated. Off by default.

Knows nothing about models, envs or weights: entries are (key, bytes) plus a `rekey` callback the owner
supplies for the one case where a key has to change (a create-only collision with *different* bytes,
i.e. a duplicate worker id or a seq bug). Invariants: every group is uploaded at most once and stays in
the spool until the store has it; a put that was retried and landed (the store returns our own bytes)
counts as uploaded, never as a duplicate.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pnyx.errors import AlreadyExistsError, StorePermissionError, StoreUnavailableError
from pnyx.protocol import layout
from pnyx.store import Store

log = logging.getLogger("pnyx.worker")

Rekey = Callable[[str, bytes], tuple[str, bytes]]
"""Given a key that collided and its bytes, return a fresh (key, bytes) to upload instead."""


@dataclass
class SpoolStats:
    """Counters of one spool's life (reported in the worker heartbeat)."""

    uploaded: int = 0
    dropped: int = 0
    collisions: int = 0
    failed_flushes: int = 0


class Spool:
    """A bounded FIFO of (key, encoded group) pairs, uploaded create-only in order by `flush`."""

    def __init__(self, max_groups: int, folder: str | Path | None = None, rekey: Rekey | None = None):
        if max_groups < 1:
            raise ValueError(f"spool max_groups must be >= 1, got {max_groups}")
        self.max_groups = max_groups
        self.folder = Path(folder) if folder is not None else None
        self.rekey = rekey
        self.stats = SpoolStats()
        self._items: deque[tuple[str, bytes]] = deque()
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._load()

    def __len__(self) -> int:
        return len(self._items)

    def pending_keys(self) -> list[str]:
        """The pending keys, oldest first."""
        return [k for k, _ in self._items]

    def add(self, key: str, data: bytes) -> None:
        """Queue one encoded group; drops (and counts) the oldest pending group past the bound."""
        if layout.parse_rollout_key(key) is None:
            raise ValueError(f"spool key {key!r} is not a rollout key (build it with pnyx.protocol.layout)")
        self._items.append((key, data))
        self._save(key, data)
        while len(self._items) > self.max_groups:
            old, _ = self._items.popleft()
            self._unlink(old)
            self.stats.dropped += 1
            log.warning("spool full (%d groups): dropped the oldest pending group %s", self.max_groups, old)

    def flush(self, store: Store, deadline_s: float | None = None) -> int:
        """Upload pending groups oldest first; return how many were uploaded by this call.

        Stops early, leaving the rest queued, when the store is unavailable (after its own retries) or
        the deadline passes. A permission error is not transient: it propagates (fix the policy).
        """
        end = None if deadline_s is None else time.monotonic() + deadline_s
        done = 0
        while self._items:
            if end is not None and time.monotonic() > end:
                break
            key, data = self._items[0]
            try:
                try:
                    store.put(key, data, mode="create")
                except AlreadyExistsError:
                    # resolving reads the key: an outage there must leave the group spooled, like one here
                    if not self._resolve_collision(store, key, data):
                        continue  # re-keyed in place; try the new key
            except StoreUnavailableError as e:
                self.stats.failed_flushes += 1
                log.warning("store unavailable, %d group(s) stay spooled: %s", len(self._items), e)
                break
            except StorePermissionError:
                raise
            self._items.popleft()
            self._unlink(key)
            self.stats.uploaded += 1
            done += 1
        return done

    # -- internals --

    def _resolve_collision(self, store: Store, key: str, data: bytes) -> bool:
        """True if the key already holds our bytes (done); else re-key the head item and return False."""
        try:
            if store.get(key) == data:
                return True  # an earlier ambiguous put of ours landed: uploaded exactly once
        except FileNotFoundError:
            pass  # deleted since (retention): still not ours; re-key to be safe
        self.stats.collisions += 1
        if self.rekey is None:
            raise AlreadyExistsError(
                f"{key} already exists with different content: two workers share this worker id. "
                "Give each worker a unique --id."
            )
        new_key, new_data = self.rekey(key, data)
        log.error("key collision on %s (duplicate worker id or seq bug): re-keyed to %s", key, new_key)
        self._items[0] = (new_key, new_data)
        self._unlink(key)
        self._save(new_key, new_data)
        return False

    def _file(self, key: str) -> Path | None:
        if self.folder is None:
            return None
        return self.folder / (key.replace("/", "__") + ".grp")

    def _save(self, key: str, data: bytes) -> None:
        path = self._file(key)
        if path is None:
            return
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # rename is atomic: a crash leaves the old state or the whole file

    def _unlink(self, key: str) -> None:
        path = self._file(key)
        if path is not None:
            path.unlink(missing_ok=True)

    def _load(self) -> None:
        if self.folder is None:
            return
        for path in sorted(self.folder.glob("*.grp")):
            key = path.name[: -len(".grp")].replace("__", "/")
            if layout.parse_rollout_key(key) is None:
                log.warning("ignoring foreign file %s in the spool folder", path)
                continue
            self._items.append((key, path.read_bytes()))
        if self._items:
            log.info("spool: %d group(s) from a previous run will be uploaded", len(self._items))
