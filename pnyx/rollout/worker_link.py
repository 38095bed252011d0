"""The worker's side of its courier: stopping, supply control, seq numbers, the heartbeat, the end.

`WorkerLink` is the layer of the `Worker` (`worker.py`, a base class it builds on) that the courier thread
(`courier.py`) calls and that ends a worker: `request_stop` (signal-safe: it sets events only); the
callbacks of supply control (`_take_demand` reads the trainer's `weights/DEMAND` into the throttle and
fetches an announced version early; `_demand_poll_s`, `_expired`); the seq numbers (`_next_seq`, and
`_rekey` for a create-only collision with foreign bytes); the heartbeat record (`workers/{worker}.json`);
and the end: the courier's final flush and heartbeat, the `WorkerSummary`. Runs on the courier thread or
the generating thread, sharing the throttle under the worker's lock and the seq under its own.

Knows nothing about generation or training.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from pnyx.errors import PnyxError, StoreError
from pnyx.protocol import layout
from pnyx.protocol.records import Demand
from pnyx.rollout.courier import Courier
from pnyx.rollout.screen import Screen
from pnyx.rollout.spool import Spool
from pnyx.rollout.throttle import Throttle
from pnyx.rollout.worker_state import Status, Throughput, WorkerOptions, WorkerSummary
from pnyx.security.signing import Signer
from pnyx.store import Store
from pnyx.weights.syncer import Syncer

if TYPE_CHECKING:
    from pnyx.config import PnyxConfig

log = logging.getLogger("pnyx.worker")


class WorkerLink:
    """The store-facing layer of the `Worker` (see the module docstring); the attributes below are its."""

    store: Store
    opts: WorkerOptions
    worker_id: str
    cfg: PnyxConfig
    stop_event: threading.Event
    status: Status
    detail: str
    version: int | None
    digest: str
    versions_used: list[int]
    rollouts: int
    tokens: int
    skipped_zero_variance: int
    generate_s: float
    screen: Screen | None
    started_at: float
    spool: Spool | None
    syncer: Syncer | None
    signer: Signer | None
    throttle: Throttle | None
    courier: Courier | None
    _seq: int
    _seq_lock: threading.Lock
    _lock: threading.Lock
    _wake: threading.Event
    _throughput: Throughput
    _stop_reason: str

    # -- control --

    def request_stop(self, reason: str = "stop requested") -> None:
        """Ask the worker to stop: the courier makes its final flush now; generation ends at the next boundary.
        Signal-safe from the main thread (sets events only)."""
        self._stop_reason = reason
        self.stop_event.set()
        self._wake.set()
        if self.courier is not None:
            self.courier.wake()

    @property
    def stopping(self) -> bool:
        return self.stop_event.is_set()

    # -- supply control (called by the courier thread) --

    def _take_demand(self, demand: Demand) -> None:
        assert self.throttle is not None  # the courier runs only after join()
        with self._lock:
            news = self.throttle.observe(demand)
        if not news:
            return
        if self.version is not None and demand.version > self.version and self.syncer is not None:
            # Fetch the announced version now rather than at the prefetcher's next poll, so the groups this
            # demand asks for come from the newest weights (fresher groups go stale later). Fail-closed: a
            # version that does not verify is not staged, and the prefetch thread retries it.
            try:
                self.syncer.prefetch_once()
            except PnyxError as e:
                log.info(
                    "worker %s: early fetch of v%d failed (%s); the prefetcher retries",
                    self.worker_id,
                    demand.version,
                    e,
                )
        self._wake.set()

    def _demand_poll_s(self) -> float:
        assert self.throttle is not None  # the courier runs only after join()
        with self._lock:
            return self.throttle.poll_interval(self.cfg.worker.poll_interval_s)

    def _expired(self, key: str) -> bool:
        parsed = layout.parse_rollout_key(key)
        assert self.throttle is not None  # the courier runs only after join()
        with self._lock:
            return parsed is not None and self.throttle.expired(parsed[0])

    # -- the end --

    def _end_courier(self, wait_s: float) -> None:
        """Stop the courier (its final flush and heartbeat) and wait up to `wait_s` + 2 s for it."""
        if self.courier is None:
            self._write_heartbeat()
            return
        self.stop_event.set()
        self.courier.wake()
        if not self.courier.join(wait_s + 2.0):
            log.warning(
                "worker %s: the store thread is still busy after %.0fs; leaving it",
                self.worker_id,
                wait_s + 2,
            )
        elif not self.courier.final_heartbeat_written:
            self._write_heartbeat()

    def _shutdown(self) -> WorkerSummary:
        if self.courier is not None and not self.stopping:  # max_groups reached: upload everything first
            self.courier.finish(self.opts.flush_deadline_s)
            self.courier.join(self.opts.flush_deadline_s + 2.0)
        if self.status != "error":
            self._set_status("stopped", self._stop_reason or "done")
        self._end_courier(self.opts.final_flush_s)
        spool = self.spool
        if spool is not None and len(spool):
            log.warning(
                "worker %s: %d group(s) not uploaded at stop, kept in %s: the next start of this worker id "
                "uploads them", self.worker_id, len(spool), spool.folder,
            )  # fmt: skip
        stats = spool.stats if spool is not None else None
        return WorkerSummary(
            worker_id=self.worker_id,
            groups_uploaded=stats.uploaded if stats else 0,
            groups_pending=len(spool) if spool is not None else 0,
            groups_dropped=stats.dropped if stats else 0,
            groups_skipped_zero_variance=self.skipped_zero_variance,
            groups_expired=stats.expired if stats else 0,
            rollouts=self.rollouts,
            tokens=self.tokens,
            versions=list(self.versions_used),
            status=self.status,
            spool_folder=str(spool.folder) if spool is not None and spool.folder is not None else None,
        )

    def close(self) -> None:
        """Stop the background threads without a goodbye (for callers that used `join` + `step` only)."""
        self.stop_event.set()
        if self.courier is not None:
            self.courier.wake()
            self.courier.join(self.opts.final_flush_s + 2.0)
        if self.syncer is not None:
            self.syncer.stop(timeout_s=1.0)

    # -- seq numbers --

    def _next_seq(self) -> int:
        with self._seq_lock:
            seq = self._seq
            self._seq += 1
            return seq

    def _rekey(self, key: str, data: bytes) -> tuple[str, bytes]:
        import msgspec

        from pnyx.protocol import decode_group, encode_group

        group = msgspec.structs.replace(decode_group(data), seq=self._next_seq())
        key = layout.rollout_key(group.policy_version, self.worker_id, group.seq)
        return key, encode_group(group, signer=self.signer)

    # -- heartbeat --

    def _set_status(self, status: Status, detail: str = "") -> None:
        self.status = status
        self.detail = detail

    def _uploaded(self) -> int:
        return self.spool.stats.uploaded if self.spool is not None else 0

    def _heartbeat_bytes(self, final: bool = False) -> bytes:
        """This worker's heartbeat record; `final` reports the end (stopped, or error) whatever the
        generating thread is doing."""
        from pnyx.protocol import HEARTBEAT_SCHEMA, Heartbeat, encode_json

        status, detail = self.status, self.detail
        if final and status != "error":
            status, detail = "stopped", self._stop_reason or "done"
        if final and self.spool is not None and len(self.spool):
            detail = f"{detail}; {len(self.spool)} group(s) kept in {self.spool.folder}"
        group_size = self.cfg.worker.group_size if hasattr(self, "cfg") else 0
        spool = self.spool
        hb = Heartbeat(
            schema=HEARTBEAT_SCHEMA,
            worker_id=self.worker_id,
            role="worker",
            version=self.version if self.version is not None else -1,
            updated_at=time.time(),
            rollouts=self._uploaded() * group_size,
            groups=self._uploaded(),
            groups_skipped_zero_variance=self.skipped_zero_variance,
            groups_pending=len(spool) if spool is not None else 0,
            groups_expired=spool.stats.expired if spool is not None else 0,
            started_at=self.started_at,
            tokens_per_s=round(self._throughput.rates[1], 3),
            rollouts_per_s=round(self._throughput.rates[0], 3),
            status=status,
            detail=detail[:500],
            digest=self.digest,
            key=self.signer.fingerprint if self.signer is not None else "",
            generate_seconds=round(self.generate_s, 3),
            screen_seconds=round(self.screen.seconds, 3) if self.screen is not None else 0.0,
            tasks_screened=self.screen.scored if self.screen is not None else 0,
        )
        return encode_json(hb)

    def _write_heartbeat(self) -> None:
        """Write the heartbeat from this thread (before the courier runs, or after it ended); never fatal."""
        try:
            self.store.put(
                layout.worker_heartbeat(self.worker_id), self._heartbeat_bytes(final=self.status == "stopped")
            )
        except StoreError as e:
            log.warning("heartbeat not written (%s): %s", type(e).__name__, e)
