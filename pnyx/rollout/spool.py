"""The worker's upload spool: a bounded FIFO of encoded rollout groups waiting for the store, kept on disk.

A worker never loses a group it generated because the store is down or because it was stopped: each
encoded group enters the spool, and `flush` uploads from the head with create-only puts until the spool
is empty, a put fails transiently (the store is down: try again later), a deadline passes or a stop is
requested. The worker stops generating while the spool is full, so nothing is dropped for space; only a
spool without a folder drops its *oldest* group past the bound (and counts it).

On disk (`folder=`, the worker's default): each pending group is also a file (temp file + rename, so a
crash never leaves a half file), removed once the store has it. A worker restarted with the same folder
loads the files and uploads them first, so neither a stop, a crash nor SIGKILL loses what was generated.
`spool_folder` gives the default folder: per run and per worker under the user's cache.

Knows nothing about models, envs or weights: entries are (key, bytes) plus a `rekey` callback the owner
supplies for the one case where a key has to change (a create-only collision with *different* bytes,
i.e. a duplicate worker id or a seq bug), and an optional `expired(key)` predicate for groups the trainer
can no longer use. Invariants: every group is uploaded at most once and stays in the spool (and on disk)
until the store has it or it is counted as expired; a put that was retried and landed (the store returns
our own bytes) counts as uploaded, never as a duplicate. Thread-safe for one flushing thread and any number
of adding threads.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pnyx.errors import AlreadyExistsError, ConfigError, StorePermissionError, StoreUnavailableError
from pnyx.protocol import layout
from pnyx.store import Store

log = logging.getLogger("pnyx.worker")

Rekey = Callable[[str, bytes], tuple[str, bytes]]
"""Given a key that collided and its bytes, return a fresh (key, bytes) to upload instead."""

SPOOL_ENV = "PNYX_SPOOL_DIR"
"""Environment variable naming the spool root (overridden by `pnyx worker --spool-dir`)."""


def default_spool_root() -> Path:
    """$PNYX_SPOOL_DIR, else $XDG_CACHE_HOME/pnyx/spool, else ~/.cache/pnyx/spool."""
    if os.environ.get(SPOOL_ENV):
        return Path(os.environ[SPOOL_ENV]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "pnyx" / "spool"


def spool_folder(root: str | Path | None, run_id: str, worker_id: str) -> Path:
    """`<root>/<run_id>/<worker_id>/`: one folder per run and worker, so a spool never leaks into another run."""
    base = Path(root).expanduser() if root is not None else default_spool_root()
    return base / layout.check_name(run_id, "run id") / layout.check_name(worker_id, "worker id")


@dataclass
class SpoolStats:
    """Counters of one spool's life (reported in the worker heartbeat)."""

    uploaded: int = 0
    """Groups uploaded (skip records not included)."""
    skips: int = 0
    """Skip records uploaded (`layout.is_skip_key`)."""
    dropped: int = 0
    collisions: int = 0
    failed_flushes: int = 0
    expired: int = 0
    """Groups uploaded after the trainer had moved past their version (never trained on; not in `uploaded`)."""
    loaded: int = 0
    """Groups found on disk at start (left by a previous life of this worker)."""


class Spool:
    """A bounded FIFO of (key, encoded group) pairs, uploaded create-only in order by `flush`."""

    def __init__(self, max_groups: int, folder: str | Path | None = None, rekey: Rekey | None = None):
        if max_groups < 1:
            raise ConfigError(f"spool max_groups must be >= 1 (worker.spool_max_groups), got {max_groups}")
        self.max_groups = max_groups
        self.folder = Path(folder) if folder is not None else None
        self.rekey = rekey
        self.stats = SpoolStats()
        self._items: deque[tuple[str, bytes]] = deque()
        self._lock = threading.Lock()
        self._flushing = threading.Lock()  # one flush at a time: it owns the head while uploading it
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._load()

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def accounted(self) -> int:
        """Groups uploaded plus groups pending (skip records not counted), read together: a flush moves a
        group from one to the other under the lock, so the sum never misses it (two separate reads could)."""
        with self._lock:
            return self.stats.uploaded + sum(not layout.is_skip_key(k) for k, _ in self._items)

    def pending_keys(self) -> list[str]:
        """The pending keys, oldest first."""
        with self._lock:
            return [k for k, _ in self._items]

    def add(self, key: str, data: bytes) -> None:
        """Queue one encoded group (on disk first, if the spool has a folder).

        A spool without a folder drops (and counts) its oldest group past the bound; one with a folder
        never drops: the owner is expected to stop generating while `len(spool)` is at the bound.
        """
        if layout.parse_rollout_key(key) is None:
            raise ValueError(f"spool key {key!r} is not a rollout key (build it with pnyx.protocol.layout)")
        self._save(key, data)
        with self._lock:
            self._items.append((key, data))
            while self.folder is None and len(self._items) > self.max_groups:
                old, _ = self._items.popleft()
                self.stats.dropped += 1
                log.warning(
                    "spool full (%d groups): dropped the oldest pending group %s", self.max_groups, old
                )

    def flush(
        self,
        store: Store,
        deadline_s: float | None = None,
        *,
        expired: Callable[[str], bool] | None = None,
        stop: threading.Event | None = None,
    ) -> int:
        """Upload pending groups oldest first; return how many were uploaded by this call.

        Stops early, leaving the rest queued, when the store is unavailable (after its own retries), the
        deadline passes or `stop` is set. Groups for which `expired(key)` is true (the trainer has moved
        past their version) are uploaded all the same and counted `expired`: the trainer never trains on
        them, but their seqs must be accounted for (a seq never uploaded is a `gap` fault of the key). A permission error is not transient: it propagates (fix the policy).
        """
        end = None if deadline_s is None else time.monotonic() + deadline_s
        done = 0
        with self._flushing:
            while True:
                if (end is not None and time.monotonic() > end) or (stop is not None and stop.is_set()):
                    break
                with self._lock:
                    if not self._items:
                        break
                    key, data = self._items[0]
                late = expired is not None and expired(key)
                try:
                    try:
                        store.put(key, data, mode="create")
                    except AlreadyExistsError:
                        # resolving reads the key: an outage there must leave the group spooled, like one here
                        if not self._resolve_collision(store, key, data):
                            continue  # re-keyed in place; try the new key
                except StoreUnavailableError as e:
                    self.stats.failed_flushes += 1
                    log.warning("store unavailable, %d group(s) stay spooled: %s", len(self), e)
                    break
                except StorePermissionError:
                    raise
                if late:  # uploaded all the same, so its seq is accounted for (`pnyx.train.seq_books`)
                    self._remove(key)
                    self.stats.expired += 1
                    log.info(
                        "expired %s, uploaded late: the trainer has moved past its version's window", key
                    )
                    continue
                self._remove(key, uploaded=True)
                done += 1
        return done

    # -- internals --

    def _remove(self, key: str, uploaded: bool = False) -> None:
        with self._lock:
            if self._items and self._items[0][0] == key:
                self._items.popleft()
            else:  # dropped for space meanwhile (folder-less spool only)
                self._items = deque(item for item in self._items if item[0] != key)
            if uploaded and layout.is_skip_key(key):
                self.stats.skips += 1
            elif uploaded:  # in the same critical section: `accounted` never sees it in neither place
                self.stats.uploaded += 1
        self._unlink(key)

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
        self._save(new_key, new_data)
        with self._lock:
            self._items = deque((new_key, new_data) if k == key else (k, d) for k, d in self._items)
        self._unlink(key)
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
        self.stats.loaded = len(self._items)
        if self._items:
            log.info(
                "spool %s: %d group(s) left by a previous run will be uploaded first",
                self.folder,
                len(self._items),
            )
