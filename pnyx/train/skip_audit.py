"""Skip records (`layout.is_skip_key`): audited, never trained on (docs/security.md, "Seeded draws").

`SkipAudits` is the `Ingestor`'s collaborator for the seeded groups a worker does not offer for training: it
re-scores every listed skip record in the fetch threads (a false one quarantines its key at once), and queues
those that pass for the exact check of their draws (`DrawAudit`: a few random samples of each, every sample
of a random share and of an untrusted key's first skip records), which the trainer loop runs
(`WaitWork.audit_skip_draws`) and reports back (`draws_audited`). Outcomes are counted in
`Cursor.skips`. Thread-safe through the shared lock; store I/O runs outside it.
"""

from __future__ import annotations

import logging
import random
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

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


@dataclass(frozen=True)
class DrawAudit:
    """A skip record queued for the exact check of its draws: `samples`, the indices of the samples to
    check, or None for every one."""

    group: ScoredGroup
    samples: frozenset[int] | None

    def checks(self, index: int) -> bool:
        """Whether sample `index` is checked."""
        return self.samples is None or index in self.samples


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
        """Share of skip records with seeded draws whose every sample is checked exactly, chosen at random
        (`take_draw_audits`; the trainer sets it from `security.skip_draw_audit`)."""
        self.skip_draw_samples = 0
        """Samples of each other such skip record checked exactly, chosen at random
        (`security.skip_draw_samples`)."""
        self.skip_audit_first = 0
        """An untrusted key's first skip records are checked whole: until this many of its records have
        been queued whole (counted as `skips_whole` in its books, at queue time, so a fresh key uploading
        many at once buys no more whole forwards than this), each is (`security.skip_audit_first`)."""
        self.skip_audit_trusted = 1.0
        """Share of a trusted key's skip records queued for the check of their draws at all, chosen at random
        (a trusted key is never quarantined: the check measures; `security.skip_audit_trusted`)."""
        self.check_draws: Callable[[ScoredGroup], str | None] | None = None
        """The admission's policy for unseeded groups (`drawcheck.unseeded_policy`), applied to skip records
        too: a skip record without the run's seeded draws would fill its seq with a group no check can
        see, so under seeded draws it is a `false_skip` (the trainer sets it with `security.seeded_draws`)."""
        self._audit_rng = random.SystemRandom()  # no worker can predict which skip records are checked
        self._draw_audits: deque[DrawAudit] = deque(maxlen=MAX_DRAW_AUDITS)

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
        re-score repeats exactly); one that passes is filed as `skipped` and, with seeded draws, queued for the
        exact check of its tokens (`take_draw_audits`, which samples: `_samples_to_check`)."""
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
            if scored.group.draws == SCHEME and scored.signer:
                samples = self._samples_to_check(scored)
                if samples is None or samples:
                    self._draw_audits.append(DrawAudit(scored, samples))

    def _samples_to_check(self, scored: ScoredGroup) -> frozenset[int] | None:
        """Which samples of skip record `scored` get the exact check (None: every one; empty: none): none of
        a trusted key's records but a random share `skip_audit_trusted`; all of them for an untrusted key
        with fewer than `skip_audit_first` skip records queued whole (`skips_whole`), or at the rate
        `skip_draw_audit`; else `skip_draw_samples` of them at random (caller holds the lock)."""
        fp = scored.signer
        books = self.cursor.by_key.get(fp, {})
        trusted = fp in self.settings.trusted_keys
        if trusted and not self._audit_rng.random() < self.skip_audit_trusted:
            return frozenset()
        if not trusted and books.get("skips_whole", 0) < self.skip_audit_first:
            self.ledger.count_key(fp, "skips_whole")
            return None
        if self._audit_rng.random() < self.skip_draw_audit:
            return None
        n = len(scored.group.samples)
        return frozenset(self._audit_rng.sample(range(n), min(self.skip_draw_samples, n)))

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

    def take_draw_audits(self, version: int | None = None, limit: int | None = None) -> list[DrawAudit]:
        """The skip records whose tokens await the exact check of their seeded draws (oldest first), of
        versions not swept, at most `limit` of them (the rest stay queued, in order). With the trainer's
        `version`, a trusted key's records wait until their version's last step in the window: a trusted
        key is never quarantined, so its audit is a measurement, made with one forward per version instead
        of one per step (the others are checked before the next batch trains: a forger's key must be out
        before its chosen groups train)."""
        with self.shared.lock:
            last = None if version is None else version - self.settings.max_staleness
            trusted = self.settings.trusted_keys
            out: list[DrawAudit] = []
            keep: list[DrawAudit] = []
            for a in self._draw_audits:
                if a.group.version < self.cursor.swept_below:
                    continue
                later = last is not None and a.group.signer in trusted and a.group.version > last
                full = limit is not None and len(out) >= limit
                (keep if later or full else out).append(a)
            self._draw_audits.clear()
            self._draw_audits.extend(keep)
            return out

    def draws_audited(self, audits: list[DrawAudit], worst: list[float], tolerance: float) -> int:
        """Record the exact check of `audits` (skip records): `worst[i]` is the largest distance of a
        checked model token of audit i from its draw (inf: its version's weights could not be verified, not
        blamed). A record over `tolerance` is a `false_skip`. Returns how many were false."""
        bad = 0
        with self.shared.lock:
            for a, w in zip(audits, worst, strict=True):
                g = a.group
                if w == float("inf"):
                    self._count_skip("unverifiable")
                elif not w <= tolerance:
                    bad += 1
                    self._false_skip(g.key, g.signer, f"a token is {w:.3g} from its seeded draw")
                else:
                    self._count_skip("draws_checked" if a.samples is None else "samples_checked")
        return bad

    def _count_skip(self, outcome: str) -> None:
        self.cursor.skips[outcome] = self.cursor.skips.get(outcome, 0) + 1
