"""Admission: one listed key to a scored group or a rejection (fetch, signature, decode, validate, re-score).

`Admission` is the `Ingestor`'s collaborator that reads records: `load` fetches one record, checks its
signature and the name's binding before anything is decoded (`unsigned`, `bad_signature`, `id_theft`,
`quarantined`), decodes and validates it (`rescore.decode_record`, `check_sampling`, `rescore` with the
episode check) and books its seq (`seq_books.verify`); `admit` files the result (ready, or rejected with its
reason, counted per key) and `fetch` admits keys in parallel on the fetch pool. `read_signer` is the
listing's sweep's view of one record (who signed it, whether it is seeded), `flood_verdict` the flood
audit's (did the name's key sign it). Its hooks (`decode`, `render`,
`expected_digest`, `check_draws`, `episodes`, `run_id`) are set by the trainer after the run is known, and
by tests. Thread-safe through the shared lock; store I/O and scoring run outside it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures

from pnyx.envs.base import Environment, Prompt
from pnyx.errors import NotFoundError, RecordRejected, StoreUnavailableError
from pnyx.protocol import layout
from pnyx.protocol.codec import frame_signer
from pnyx.protocol.records import RolloutGroup
from pnyx.protocol.rules import is_zero_variance
from pnyx.security.keys import fingerprint
from pnyx.store import Store
from pnyx.train import seq_books
from pnyx.train.episode_check import EpisodeRules
from pnyx.train.key_ledger import KeyLedger, id_theft
from pnyx.train.listing import Shared, WindowListings
from pnyx.train.pool import DaemonPool
from pnyx.train.rescore import ScoredGroup, check_sampling, decode_record, disagreements, rescore

log = logging.getLogger("pnyx.train.ingest")


class Admission:
    """Fetching, verifying and re-scoring listed keys (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        env: Environment,
        detokenize: Callable[[list[int]], str],
        shared: Shared,
        listing: WindowListings,
        ledger: KeyLedger,
        *,
        futures: dict[str, Future],
        outcomes: deque[str],
        closed: threading.Event,
        fetch_workers: int,
        require_signatures: bool,
        run_id: str | None = None,
        vocab_size: int | None = None,
        render: Callable[[Prompt], list[int]] | None = None,
        expected_digest: Callable[[int], frozenset[str] | None] | None = None,
        decode: Callable[[bytes, int | None], RolloutGroup] = decode_record,
        check_draws: Callable[[ScoredGroup], str | None] | None = None,
    ) -> None:
        self.store, self.env, self.detokenize = store, env, detokenize
        self.shared, self.listing, self.ledger = shared, listing, ledger
        self.futures = futures
        """Key -> its fetch in flight (the ledger reads it: a name is bound by one GET)."""
        self.outcomes = outcomes
        """Recent admission outcomes ("ok", "zv_hard/easy/flat", or a reason), shared with the planner."""
        self.closed = closed
        self.fetch_workers = fetch_workers
        self.require_signatures = require_signatures
        self.run_id = run_id
        self.vocab_size = vocab_size
        self.render = render
        self.expected_digest = expected_digest
        self.decode = decode
        self.check_draws = check_draws
        """Whether a group may enter without seeded draws (`pnyx.train.drawcheck.unseeded_policy`): None, or
        a drop reason. Run on each admitted group that would otherwise be ready, outside the lock. The
        tokens themselves are checked by the step's forward (`pnyx.train.step`)."""
        self.episodes: EpisodeRules | None = None
        """Tool replies and turn endings (`pnyx.train.episode_check`; set by the trainer's setup)."""
        self._pool: DaemonPool | None = None
        self._rendered: dict[str, list[int]] = {}
        self.fetched = 0
        """Records fetched so far by this process."""

    def admit(self, key: str) -> None:
        """Fetch and score one listed key; file it as ready or rejected (runs in a pool thread)."""
        try:
            scored = self.load(key)
        except RecordRejected as e:
            with self.shared.lock:
                if (
                    not self.closed.is_set()
                    and key not in self.shared.cursor.rejected
                    and key not in self.shared.cursor.uses
                ):
                    self.listing.reject(key, e.reason, str(e))
                    self.ledger.count_key(getattr(e, "signer", ""), e.reason)
                    self.outcomes.append(e.reason)
            return
        except NotFoundError:  # listed, then deleted by someone else: nothing to train on or count
            with self.shared.lock:
                parsed = layout.parse_rollout_key(key)
                if parsed is not None and parsed[0] in self.listing.versions:
                    self.listing.versions[parsed[0]].remove_pending(key)
            return
        finally:
            with self.shared.lock:
                self.fetched += 1
        drop = self._dropped(scored)
        with self.shared.lock:
            if (
                self.closed.is_set()
                or key in self.shared.cursor.rejected
                or self.shared.cursor.uses.get(key, 0) >= self.shared.settings.max_reuse
            ):
                return
            lst = self.listing.versions.get(scored.version)
            if lst is None or scored.version < self.shared.cursor.swept_below:
                return  # its version was swept meanwhile
            if scored.signer in self.shared.cursor.quarantined:  # quarantined while it was being fetched
                self.listing.reject(key, "quarantined")
                self.ledger.count_key(scored.signer, "quarantined")
                return
            if drop is not None:
                counter, reason, outcome = drop
                self.ledger.count_scored(scored)  # its samples, disagreements (a `reward_lie` fault)...
                self.ledger.count_key(scored.signer, counter)  # ...and its outcome (checks.JUDGED)
                self.listing.reject(key, reason)
                self.outcomes.append(outcome)
                return
            self.outcomes.append("ok")
            self.shared.ready[key] = scored

    def _dropped(self, scored: ScoredGroup) -> tuple[str, str, str] | None:
        """(the key's counter, the rejection reason, the outcome) of a group dropped before any step, in this
        order: a reward lie (`security.reject_reward_lies`), zero variance, then a missing seeded draw
        (`check_draws`); None: ready."""
        if self.shared.settings.reject_reward_lies and disagreements(scored):
            return "lie_dropped", "reward_lie", "reward_lie"
        if is_zero_variance(scored.rewards):
            r = scored.rewards[0]
            return (
                "zero_variance",
                "zero_variance",
                "zv_hard" if r <= 0 else "zv_easy" if r >= 1 else "zv_flat",
            )
        if self.check_draws is not None and (reason := self.check_draws(scored)) is not None:
            return reason, reason, reason
        return None

    def pool(self) -> DaemonPool:
        with self.shared.lock:
            if self._pool is None:
                self._pool = DaemonPool(self.fetch_workers, "pnyx-ingest")
            return self._pool

    def fetch(
        self,
        keys: Iterable[str],
        wait_for: Iterable[str] | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> int:
        """Admit `keys` in parallel; wait for `wait_for` (default: all of them) unless `stop()` turns true.

        Returns how many of the awaited keys could not be fetched because the store was unavailable (they
        stay waiting). Any other failure of a fetch is a bug and re-raises here.
        """
        keys = list(dict.fromkeys(keys))
        pool = self.pool()
        futures: dict[str, Future] = {}
        with self.shared.lock:
            for key in keys:
                if key in self.shared.ready or key in self.shared.cursor.rejected:
                    continue
                fut = self.futures.get(key)
                if fut is None:
                    fut = self.futures[key] = pool.submit(self.admit, key)
                    fut.add_done_callback(lambda _f, k=key: self._forget(k))
                futures[key] = fut
        awaited = [futures[k] for k in (keys if wait_for is None else wait_for) if k in futures]
        pending = set(awaited)
        while pending:
            if stop is not None and stop():
                return 0
            _, pending = wait_futures(pending, timeout=0.1)
        failed = 0
        for fut in awaited:
            if fut.cancelled():
                continue
            exc = fut.exception()
            if isinstance(exc, StoreUnavailableError):
                failed += 1
                log.warning("ingest: fetch failed, will retry: %s", exc)
            elif exc is not None:
                raise exc
        return failed

    def _forget(self, key: str) -> None:
        with self.shared.lock:
            self.futures.pop(key, None)

    def close(self) -> None:
        """Stop the fetch threads (queued fetches are cancelled; one in flight is abandoned and its result
        ignored, so the cursor no longer changes behind a final checkpoint)."""
        with self.shared.lock:
            self.closed.set()
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown()

    def load(self, key: str) -> ScoredGroup:
        """Fetch, validate and re-score one group (no filters, no counters). Raises RecordRejected(reason).

        Used by admission and, on resume, to rebuild exactly the batch a recorded step consumed.
        """
        parsed = layout.parse_rollout_key(key)
        if parsed is None:
            raise RecordRejected("bad_key", key)
        data = self.store.get(key)
        signer = self._signer_of(parsed[1], data) if self.require_signatures else ""
        try:
            group = self.decode(data, self.vocab_size)
            check_sampling(group, self.shared.settings)
            scored = rescore(
                key,
                group,
                env=self.env,
                detokenize=self.detokenize,
                settings=self.shared.settings,
                run_id=self.run_id,
                expected_digest=self.expected_digest,
                render=self.render,
                rendered=self._rendered,
                episodes=self.episodes,
            )
        except RecordRejected as e:
            e.signer = signer  # the drop counts against the key that signed the record
            raise
        scored.signer = signer
        if signer:
            with self.shared.lock:  # a valid group binds its name to its key, unless another key was first
                bound = self.shared.cursor.keys.get(parsed[1])
                if bound is None:
                    bound = self.shared.cursor.keys[parsed[1]] = signer
                    self.ledger.bind(parsed[1], signer)
                if bound == signer:  # its seq is accounted for (`seq_books`)
                    seq_books.verify(
                        self.shared.cursor.seqs,
                        parsed[1],
                        parsed[2],
                        bool(group.draws),
                        self.shared.cursor.seq_start,
                    )
            if bound != signer:
                raise id_theft(parsed[1], bound, signer)
        return scored

    def read_signer(self, key: str, worker: str, seq: int) -> tuple[str, bool] | None:
        """(fingerprint, seeded) of the record under `key` if it is a validly signed record of (`worker`,
        `seq`), else None (the listing's sweep settles seqs with it; a missing object is None)."""
        try:
            data = self.store.get(key)
        except NotFoundError:
            return None
        try:
            fp = fingerprint(frame_signer(data))
            group = self.decode(data, self.vocab_size)
        except RecordRejected:
            return None
        if group.worker_id != worker or group.seq != seq:
            return None
        return fp, bool(group.draws)

    def flood_verdict(self, key: str, fp: str) -> str | None:
        """For the flood audit (`pnyx.train.flood_audit`): None if the object under `key` is a record that key
        `fp` signed for the key's own version, name and seq (or one signed by `fp` that does not decode:
        `fp` made it either way); else why it proves nothing about `fp`: "missing", a signature failure
        (`unsigned`, `bad_signature`, `bad_magic`), `id_theft` (another key signed it) or `key_mismatch` (a
        copy of a record of another version, name or seq: anyone who read one can make it)."""
        parsed = layout.parse_rollout_key(key)
        if parsed is None:
            return "bad_key"
        try:
            data = self.store.get(key)
        except NotFoundError:
            return "missing"
        finally:
            with self.shared.lock:
                self.fetched += 1
        try:
            signer = fingerprint(frame_signer(data))
        except RecordRejected as e:
            return e.reason
        if signer != fp:
            return "id_theft"
        try:
            group = self.decode(data, self.vocab_size)
        except RecordRejected:
            return None
        if (group.policy_version, group.worker_id, group.seq) != parsed:
            return "key_mismatch"
        return None

    def _signer_of(self, worker: str, data: bytes) -> str:
        """The fingerprint of the key that signed `data`, checked before anything is decoded: the frame's
        signature, then the name's binding. Raises RecordRejected("unsigned" | "bad_signature" | "id_theft")."""
        fp = fingerprint(frame_signer(data))
        with self.shared.lock:
            bound = self.shared.cursor.keys.get(worker)
            if fp in self.shared.cursor.quarantined and (bound is None or bound == fp):
                if bound is None:  # its later groups under this name: never fetched
                    self.shared.cursor.keys[worker] = fp
                    self.ledger.purge_name(worker)
                e = RecordRejected(
                    "quarantined", f"key {fp} is quarantined: {self.shared.cursor.quarantined[fp]}"
                )
                e.signer = fp
                raise e
        if bound is not None and bound != fp:
            raise id_theft(worker, bound, fp)
        return fp

    def load_many(self, keys: list[str]) -> list[ScoredGroup]:
        """`load` of every key, in parallel, in order; the first failure (in key order) re-raises."""
        pool = self.pool()
        futures = [pool.submit(self.load, k) for k in keys]
        return [f.result() for f in futures]
