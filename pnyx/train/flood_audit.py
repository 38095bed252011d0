"""The flood audit: a key is quarantined for flooding only on records it signed (docs/security.md, "Flooding").

The listing counts the seqs listed at each version under the names bound to a key, per kind (groups and
skip records, `version_listing.GROUPS` and `SKIPS`), without reading a record; past
`IngestSettings.flood_limit` the key becomes a suspect (`KeyLedger.check_flood`). A listed key proves
nothing about who wrote it: where workers share write access anyone can put objects under an honest
worker's name (junk, or copies of its signed records under other seqs). `FloodAudits.audit` reads the
suspect's listed keys at that version (`Admission.flood_verdict`) until one of two things holds:
- more than the limit are records the key signed, each for its own name, seq and version: the key is
  quarantined (`KeyLedger.flooded`), and the rest of its listed keys are rejected without a read;
- what is left that could be such a record no longer passes the limit: each key read that holds no record
  of its name is rejected with its reason (`listing.NOT_THE_NAMES`: not counted against the name's key,
  never blamed on it), which takes it off the count.
Groups already fetched and valid, or consumed, are proven without a read. Cost: a flooder costs limit + 1
reads (65 at the defaults) once per version it floods, then nothing (quarantined from the listing); junk
costs one read per object, as junk under fresh names always did.

Thread-safe through the shared lock; store reads run on the fetch pool, outside it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Container
from concurrent.futures import wait as wait_futures

from pnyx.errors import StoreUnavailableError
from pnyx.train.key_ledger import KeyLedger
from pnyx.train.listing import NOT_THE_NAMES, Shared, WindowListings
from pnyx.train.pool import DaemonPool
from pnyx.train.version_listing import VersionListing, kind_of

log = logging.getLogger("pnyx.train.ingest")

Read = tuple[str, str, int, str]
"""(key, suspect fingerprint, version, kind): one read of a flood audit."""


class FloodAudits:
    """The reads that settle the ledger's flood suspects (see the module docstring)."""

    def __init__(
        self,
        shared: Shared,
        listing: WindowListings,
        ledger: KeyLedger,
        verdict: Callable[[str, str], str | None],
        pool: Callable[[], DaemonPool],
        closed: threading.Event,
        in_flight: Container[str],
    ) -> None:
        self.shared, self.listing, self.ledger = shared, listing, ledger
        self._verdict, self._pool, self._closed, self._in_flight = verdict, pool, closed, in_flight
        self.reads = 0
        """Records read by flood audits in this process."""
        self._one_at_a_time = threading.Lock()  # the prefetch thread and `select` both audit: no read twice

    def audit(self) -> None:
        """Settle every suspect the listings have named (see the module docstring). A read the store cannot
        serve now leaves its key for the next call (StoreUnavailableError is logged, not raised). A call
        while another runs waits for it, then finds what is left."""
        with self._one_at_a_time:
            self._audit()

    def _audit(self) -> None:
        while True:
            with self.shared.lock:
                reads = [r for suspect in sorted(self.ledger.suspects) for r in self._plan(*suspect)]
            if not reads or self._closed.is_set():
                return
            pool = self._pool()
            futures = [
                (pool.submit(self._verdict, key, fp), (key, fp, v, kind)) for key, fp, v, kind in reads
            ]
            wait_futures([f for f, _ in futures])
            unavailable = False
            with self.shared.lock:
                self.reads += len(futures)
                for fut, (key, fp, version, _kind) in futures:
                    exc = fut.exception()
                    if isinstance(exc, StoreUnavailableError):
                        unavailable = True
                        log.warning("ingest: flood audit could not read %s, will retry: %s", key, exc)
                    elif exc is not None:
                        raise exc
                    elif not self._closed.is_set():
                        self._file(key, fp, version, fut.result())
            if unavailable:
                return

    def _plan(self, fp: str, version: int, kind: str) -> list[Read]:
        """The reads one suspect needs next; settles it (quarantine, or off the suspects) when none is
        needed (caller holds the lock)."""
        cursor, limit = self.shared.cursor, self.shared.settings.flood_limit
        lst = self.listing.versions.get(version)
        if (
            lst is None
            or limit is None
            or fp in cursor.quarantined
            or fp in self.shared.settings.trusted_keys
            or self.shared.settings.quarantine is None
        ):
            self.ledger.suspects.discard((fp, version, kind))
            return []
        held = self._held(lst, fp, kind)
        proven = [k for k in held if k in lst.verified or self._admitted(k, fp)]
        if len(proven) > limit:
            self.ledger.suspects.discard((fp, version, kind))
            self.ledger.flooded(fp, version, kind, len(held), len(proven))
            return []
        unread = [k for k in held if k not in lst.audited and k not in proven and k not in self._in_flight]
        if len(held) <= limit:  # not a flood on what is left
            self.ledger.suspects.discard((fp, version, kind))
            return []
        if not unread:  # what was read and is gone proves nothing; one being fetched is judged when it lands
            if not any(k in self._in_flight for k in held):
                self.ledger.suspects.discard((fp, version, kind))  # the next seq listed names it again
            return []
        return [(k, fp, version, kind) for k in unread[: limit + 1 - len(proven)]]

    def _held(self, lst: VersionListing, fp: str, kind: str) -> list[str]:
        """The keys that hold a seq of `kind` at `lst.version` under a name bound to `fp` and could be
        records of that name (not yet found to be no record of it), in key order."""
        names = {n for n, bound in self.shared.cursor.keys.items() if bound == fp}
        rejected = self.shared.cursor.rejected
        return sorted(
            k
            for (worker, _seq), k in lst.ids.items()
            if worker in names and kind_of(k) == kind and rejected.get(k) not in NOT_THE_NAMES
        )

    def _admitted(self, key: str, fp: str) -> bool:
        """Admission verified `key` as `fp`'s record: fetched and valid, or consumed by a step."""
        g = self.shared.ready.get(key)
        return (g is not None and g.signer == fp) or self.shared.cursor.uses.get(key, 0) > 0

    def _file(self, key: str, fp: str, version: int, verdict: str | None) -> None:
        """Record one read (caller holds the lock): a record `fp` signed, or a key that holds no record of
        its name (rejected with `verdict`, off the count); a missing object is only marked read."""
        lst = self.listing.versions.get(version)
        if lst is None:
            return  # swept meanwhile
        lst.audited.add(key)
        if verdict is None:
            lst.verified.add(key)
        elif verdict != "missing":
            log.info("ingest: flood audit of %s: %s holds no record of its name (%s)", fp, key, verdict)
            self.listing.disown(key, verdict)
