"""Skip records (`layout.is_skip_key`): audited, never trained on (docs/security.md, "Seeded draws").

`SkipAudits` is the `Ingestor`'s collaborator for the seeded groups a worker does not offer for training: it
re-scores every listed skip record in the fetch threads (a false one quarantines its key at once), and queues
a random share of those that pass for the exact check of their draws, which the trainer loop runs
(`TrainerLoop._audit_skip_draws`) and reports back (`draws_audited`). Outcomes are counted in
`Cursor.skips`. Thread-safe through the shared lock; store I/O runs outside it.
"""

from __future__ import annotations

import logging
import random
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import wait as wait_futures

from pnyx.errors import NotFoundError, RecordRejected, StoreUnavailableError
from pnyx.protocol import layout
from pnyx.protocol.draws import SCHEME
from pnyx.protocol.rules import is_zero_variance
from pnyx.train.ingest_state import Cursor, IngestSettings
from pnyx.train.key_ledger import KeyLedger
from pnyx.train.listing import Shared, WindowListings
from pnyx.train.pool import DaemonPool
from pnyx.train.rescore import ScoredGroup

log = logging.getLogger("pnyx.train.ingest")

MAX_DRAW_AUDITS = 4096
"""Skip records waiting for the exact check of their tokens at most (the oldest beyond it go unchecked)."""


class SkipAudits:
    """The audit of skip records (see the module docstring)."""

    def __init__(
        self,
        shared: Shared,
        listing: WindowListings,
        ledger: KeyLedger,
        load: Callable[[str], ScoredGroup],
        pool: Callable[[], DaemonPool],
        closed: threading.Event,
    ) -> None:
        self.shared, self.listing, self.ledger = shared, listing, ledger
        self._load, self._pool, self._closed = load, pool, closed
        self.skip_draw_audit = 1.0
        """Share of skip records with seeded draws queued for the exact check of their tokens, chosen at
        random (`take_draw_audits`; the trainer sets it from `security.skip_draw_audit`)."""
        self.check_draws: Callable[[ScoredGroup], str | None] | None = None
        """The admission's policy for unseeded groups (`drawcheck.unseeded_policy`), applied to skip records
        too: a skip record without the run's seeded draws would fill its seq with a group no check can
        see, so under seeded draws it is a `false_skip` (the trainer sets it with `security.seeded_draws`)."""
        self._audit_rng = random.SystemRandom()  # no worker can predict which skip records are checked
        self._draw_audits: deque[ScoredGroup] = deque(maxlen=MAX_DRAW_AUDITS)

    @property
    def cursor(self) -> Cursor:
        """The shared cursor (replaced whole on resume)."""
        return self.shared.cursor

    @property
    def settings(self) -> IngestSettings:
        return self.shared.settings

    def audit_skips(self, wait: bool = False) -> None:
        """Fetch and re-score the skip records listed since the last call, in the fetch threads (`wait`:
        until all are done). A skip record whose samples' rewards differ is a `false_skip`: its key is
        quarantined at once (an honest worker's skip is its verifier's own verdict, which the trainer's
        re-score repeats exactly); one that passes is filed as `skipped` and, with seeded draws, queued at the
        rate `skip_draw_audit` for the exact check of its tokens (`take_draw_audits`)."""
        keys = self.listing.take_skips()
        if not keys:
            return
        pool = self._pool()
        futures = [pool.submit(self._audit, k) for k in keys]
        if wait:
            wait_futures(futures)
            for f in futures:
                if (exc := f.exception()) is not None:
                    raise exc

    def _audit(self, key: str) -> None:
        try:
            scored = self._load(key)
        except RecordRejected as e:
            with self.shared.lock:
                if not self._closed.is_set() and key not in self.cursor.rejected:
                    self.listing.reject(key, e.reason, str(e))
                    self.ledger.count_key(getattr(e, "signer", ""), e.reason)
            return
        except NotFoundError:
            return
        except StoreUnavailableError as e:  # audited at the next call
            log.warning("ingest: skip record %s not fetched, will retry: %s", key, e)
            with self.shared.lock:
                parsed = layout.parse_rollout_key(key)
                if parsed is not None and parsed[0] in self.listing.versions:
                    self.listing.versions[parsed[0]].skips.append(key)
            return
        with self.shared.lock:
            if (
                self._closed.is_set()
                or key in self.cursor.rejected
                or scored.version < self.cursor.swept_below
            ):
                return
            if not is_zero_variance(scored.rewards):
                self._false_skip(
                    key, scored.signer, f"its re-scored rewards differ ({sorted(set(scored.rewards))})"
                )
                return
            if self.check_draws is not None and (why := self.check_draws(scored)) is not None:
                self._false_skip(key, scored.signer, f"{why} (draws {scored.group.draws!r})")
                return
            self.cursor.rejected[key] = "skipped"  # audited: never trained on, never fetched again
            self._count_skip("audited")
            self.ledger.count_key(scored.signer, "skips")
            if (
                scored.group.draws == SCHEME
                and scored.signer
                and self._audit_rng.random() < self.skip_draw_audit
            ):
                self._draw_audits.append(scored)

    def _false_skip(self, key: str, fp: str, why: str) -> None:
        """File skip record `key` as `false_skip` and quarantine its key `fp` (caller holds the lock)."""
        if self.cursor.rejected.get(key) == "false_skip":
            return
        self.cursor.rejected[key] = "false_skip"
        self.listing.drop("false_skip")
        self._count_skip("false")
        self.ledger.count_key(fp, "false_skip")
        if fp and fp not in self.settings.trusted_keys and self.settings.quarantine is not None:
            self.ledger.quarantine(fp, f"false skip record {key}: {why}")
        log.warning("ingest: false skip record %s: %s", key, why)

    def take_draw_audits(self) -> list[ScoredGroup]:
        """The skip records whose tokens await the exact check of their seeded draws (oldest first), of
        versions not swept."""
        with self.shared.lock:
            out = [g for g in self._draw_audits if g.version >= self.cursor.swept_below]
            self._draw_audits.clear()
            return out

    def draws_audited(self, groups: list[ScoredGroup], worst: list[float], tolerance: float) -> int:
        """Record the exact check of `groups` (skip records): `worst[i]` is group i's largest distance of a
        model token from its draw (inf: its version's weights could not be verified, not blamed). A group
        over `tolerance` is a `false_skip`. Returns how many were."""
        bad = 0
        with self.shared.lock:
            for g, w in zip(groups, worst, strict=True):
                if w == float("inf"):
                    self._count_skip("unverifiable")
                elif not w <= tolerance:
                    bad += 1
                    self._false_skip(g.key, g.signer, f"a token is {w:.3g} from its seeded draw")
                else:
                    self._count_skip("draws_checked")
        return bad

    def _count_skip(self, outcome: str) -> None:
        self.cursor.skips[outcome] = self.cursor.skips.get(outcome, 0) + 1
