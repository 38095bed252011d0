"""A worker's link to its run: everything the `Worker` (`worker.py`) does with the store, in one object it owns.

The link joins the run, in the order the worker calls it: `read_run` reads run.json (waiting for it), pins
the trainer's key (`--trust`, or trust on first use: docs/security.md) and loads this machine's worker key;
`cold_join` opens the on-disk spool (`spool.py`) and fetches the newest weights that key signed (the
`Syncer`, fail-closed); `resume` finds the first unused seq; `start` starts the weights prefetch and the
courier (`courier.py`), the one thread that from then on does all store I/O: it uploads the spool, reads
the trainer's demand into supply control (fetching an announced version early) and writes the heartbeat
(`workers/{worker}.json`, built from the worker's `Progress`). At each cohort boundary the generating
thread asks the link for newer weights (`swap`), hands it groups (`send`: numbered and signed by the
`Sealer`, spooled; local disk only) and waits on it when it may not generate (`pause`).

It owns stopping (`request_stop`, signal-safe: it sets events only) and the end: the courier's final flush
and heartbeat, and the `WorkerSummary`.

Knows nothing about models, envs or generation: what it reports comes from the worker's `Progress`, and the
demands it reads go to the worker's `Supply`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pnyx.errors import ConfigError, PnyxError, StoreError
from pnyx.protocol import layout
from pnyx.protocol.records import Demand, RolloutGroup, RunManifest
from pnyx.rollout.committer import Ahead, Committer, Drawn
from pnyx.rollout.courier import Courier
from pnyx.rollout.joining import cold_join, read_run_manifest, resume_seq
from pnyx.rollout.sealer import Sealer
from pnyx.rollout.spool import Spool, spool_folder
from pnyx.rollout.throttle import Supply
from pnyx.rollout.worker_state import Progress, WorkerOptions, WorkerSummary
from pnyx.security.keys import load_or_create_key, worker_key_path
from pnyx.security.signing import Signer
from pnyx.store import Store
from pnyx.weights.syncer import Plane, Syncer
from pnyx.weights.trust import pin_trainer

if TYPE_CHECKING:
    from pnyx.config import PnyxConfig

log = logging.getLogger("pnyx.worker")


class RunLink:
    """Worker `worker_id`'s link to the run in `store` (see the module docstring). `progress` is the
    worker's, read here for the heartbeat and the summary."""

    def __init__(self, store: Store, worker_id: str, opts: WorkerOptions, progress: Progress):
        self.store = store
        self.worker_id = worker_id
        self.opts = opts
        self.progress = progress
        self.stop_event = threading.Event()
        self._wake = threading.Event()  # ends the generating thread's `pause`: spool space, demand, a stop
        self.manifest: RunManifest | None = None
        """The run's run.json (None before `read_run`)."""
        self.cfg: PnyxConfig | None = None
        """The run's config, from run.json (None before `read_run`)."""
        self.sealer: Sealer | None = None
        self.syncer: Syncer | None = None
        self.committer: Committer | None = None  # committed draws (security.committed_draws), at read_run
        self.spool: Spool | None = None
        self.courier: Courier | None = None
        self._supply: Supply | None = None  # fed by the courier's demand reads, after `start`
        self._stop_reason = ""

    # -- joining (the generating thread, in this order) --

    def read_run(self) -> PnyxConfig:
        """Read run.json (waiting up to `join_timeout_s`), pin the trainer's key and load this machine's worker
        key; set up (not start) the syncer on the pinned key. Returns the run's config. ConfigError: refuse to
        join (a key that does not match `--trust`, or `--int8` on a run without the int8 plane)."""
        from pnyx.config import config_from_dict

        manifest = read_run_manifest(self.store, self.opts.join_timeout_s, self.stop_event)
        self.manifest = manifest
        trust = pin_trainer(manifest, self.opts.trust, self.opts.keys_dir)  # ConfigError: refuse to join
        key, created = load_or_create_key(worker_key_path(self.opts.keys_dir))
        signer = Signer(key)  # signs every group; the trainer binds this worker's name to it
        self.sealer = Sealer(self.worker_id, signer)
        log.info(
            "worker %s: signing groups with key %s%s", self.worker_id, signer.fingerprint,
            " (created)" if created else "",
        )  # fmt: skip
        self.cfg = cfg = config_from_dict(manifest.config)
        if self.opts.int8 and not cfg.worker.int8:
            raise ConfigError(
                "--int8: this run's trainer does not publish the int8 actor plane. Start the run with "
                "--worker.int8=true (the trainer then publishes it next to the bf16 weights), or drop --int8."
            )
        if cfg.security.committed_draws:
            self.committer = Committer(self.store, signer, manifest.run_id, self.worker_id, trust.fingerprint)
        self.syncer = Syncer(
            self.store,
            plane="int8" if (self.opts.int8 or cfg.worker.int8) else "weights",
            max_backoff_s=self.opts.max_backoff_s,
            poll_interval_s=cfg.worker.poll_interval_s,
            trust=trust,  # only weights the run's trainer key signed: fail-closed otherwise
        )
        return cfg

    @property
    def run_id(self) -> str:
        return self.manifest.run_id if self.manifest is not None else ""

    @property
    def next_seq(self) -> int:
        """The seq the next group sent gets (seeds the worker's task stream)."""
        return self.sealer.next_seq if self.sealer is not None else 0

    @property
    def key(self) -> str:
        """Fingerprint of the key this worker signs with (part of its groups' seeded draws)."""
        return self._sealer().signer.fingerprint

    def commit_ahead(self, version: int, task_ids: list[str]) -> Ahead:
        """Committed draws: reserve one seq per task and commit to them, drawn at `version`, without waiting
        for the tick (`Committer.ahead`; `draw` waits)."""
        return self._committer().ahead(version, task_ids, self._sealer().reserve)

    def draw(self, ahead: Ahead, stop: threading.Event | None = None) -> tuple[Drawn | None, list[int]]:
        """Wait for the trainer's tick of `ahead` (`Committer.draw`; a refused reuse of seqs moves the
        numbering on). Returns (how to draw, the seqs); (None, []) when the stop (`stop`, default this link's
        stop) came first."""
        sealer = self._sealer()

        def skip_to(seq: int) -> None:
            sealer.resume(max(seq, sealer.next_seq))

        committer = self._committer()
        try:
            return committer.draw(ahead, sealer.reserve, skip_to, stop or self.stop_event)
        finally:
            self.progress.commit_wait_s = committer.wait_s

    def pin_next(self) -> int | None:
        """The version the next `swap` installs, fixed now (`Syncer.pin`): None when it installs nothing."""
        return self._weights().pin()

    def _committer(self) -> Committer:
        if self.committer is None:
            raise RuntimeError(
                "committed draws: the run link has no committer (read_run, on such a run, makes it)"
            )
        return self.committer

    def reserve_seq(self) -> int:
        """The seq of a group about to be generated with seeded draws (`Sealer.reserve`)."""
        return self._sealer().reserve()

    @property
    def plane(self) -> Plane:
        """The weights plane this worker follows: "int8" (run.json's worker.int8, or `--int8`) or "weights"."""
        return self._weights().plane

    def cold_join(self) -> int:
        """Open the spool (loading what a previous run of this worker id left), report "syncing", and fetch
        the newest verified weights (waiting up to `join_timeout_s` for the first publish). Returns their
        version; the syncer holds them (`syncer.state`) for the engine to load."""
        cfg, syncer, sealer = self._config(), self._weights(), self._sealer()
        w = cfg.worker
        capacity = max(w.spool_max_groups, w.prompts_per_cohort)  # 0 in config: hold one cohort at most
        folder = spool_folder(self.opts.spool_dir, self.run_id, self.worker_id)
        self.spool = Spool(capacity, folder=folder, rekey=sealer.rekey)
        self.progress.set("syncing", "cold join")
        self._write_heartbeat()
        version, _tensors = cold_join(syncer, self.opts.join_timeout_s, w.poll_interval_s, self.stop_event)
        return version

    def resume(self, version: int) -> int:
        """Continue the seq numbers after the highest this worker id left in the store (the newest few versions
        up to `version`) or in its spool. Returns the next seq."""
        sealer, spool = self._sealer(), self._spool()
        pending = [layout.parse_rollout_key(k) for k in spool.pending_keys()]
        spooled = max((p[2] for p in pending if p and p[1] == self.worker_id), default=-1)
        sealer.resume(max(resume_seq(self.store, self.worker_id, version), spooled + 1))
        return sealer.next_seq

    def start(self, supply: Supply) -> None:
        """Start the weights prefetch (swapped in by the worker at cohort boundaries only) and the courier,
        which feeds the trainer's demands to `supply`."""
        w, spool = self._config().worker, self._spool()
        self._supply = supply
        self._weights().start()
        self.courier = Courier(
            self.store, spool, heartbeat=self._heartbeat_bytes,
            heartbeat_key=layout.worker_heartbeat(self.worker_id), heartbeat_s=w.heartbeat_interval_s,
            stop=self.stop_event, on_demand=self._take_demand, demand_poll_s=self._demand_poll_s,
            expired=self._expired, on_progress=self._wake.set, flush_deadline_s=self.opts.flush_deadline_s,
            final_flush_s=self.opts.final_flush_s, max_backoff_s=self.opts.max_backoff_s,
        )  # fmt: skip
        self.courier.start()

    # -- the generating thread, after the join --

    def swap(self, at: int | None = None) -> int | None:
        """At a cohort boundary: re-raise a fatal error of the courier or the prefetch thread, then install the
        prefetched weights in the syncer if they are newer (`at`: only version `at`, `Syncer.swap`). Returns
        their version (for the engine to load), or None."""
        if self.courier is None:
            raise RuntimeError("RunLink: start() first (no courier yet)")
        self.courier.check()
        fresh = self._weights().swap(at)
        return fresh[0] if fresh is not None else None

    def send(self, groups: Sequence[RolloutGroup], skips: Sequence[RolloutGroup] = ()) -> None:
        """Number, sign and spool `groups` and the skip records of `skips` (seeded groups not offered for
        training), all in seq order, and wake the courier to upload them (local disk only)."""
        sealer, spool = self._sealer(), self._spool()
        entries = [(g, False) for g in groups] + [(g, True) for g in skips]
        for group, skip in sorted(entries, key=lambda e: (not e[0].draws, e[0].seq)):
            spool.add(*sealer.seal(group, skip=skip))
        if self.courier is not None:
            self.courier.wake()

    def pause(self, seconds: float) -> None:
        """Wait up to `seconds`, returning early on a stop, spool progress or a new demand."""
        self._wake.wait(seconds)
        self._wake.clear()

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
        if self._supply is None or not self._supply.observe(demand):
            return
        version = self.progress.version
        if version is not None and demand.version > version and self.syncer is not None:
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
        default_s = self._config().worker.poll_interval_s
        return self._supply.poll_interval(default_s) if self._supply is not None else default_s

    def _expired(self, key: str) -> bool:
        parsed = layout.parse_rollout_key(key)
        return parsed is not None and self._supply is not None and self._supply.expired(parsed[0])

    # -- the end --

    def end_courier(self, wait_s: float) -> None:
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

    def stop_prefetch(self) -> None:
        """Stop the weights prefetch thread; a fetch in flight is abandoned (daemon thread)."""
        if self.syncer is not None:
            self.syncer.stop(timeout_s=1.0)

    def shutdown(self) -> WorkerSummary:
        """The end of `Worker.run`: upload everything first when the quota was reached (no stop requested),
        report "stopped" (unless "error"), end the courier, and say what was done."""
        if self.courier is not None and not self.stopping:  # max_groups reached: upload everything first
            self.courier.finish(self.opts.flush_deadline_s)
            self.courier.join(self.opts.flush_deadline_s + 2.0)
        progress = self.progress
        if progress.status != "error":
            progress.set("stopped", self._stop_reason or "done")
        self.end_courier(self.opts.final_flush_s)
        spool = self.spool
        if self.courier is not None and spool is not None and len(spool):
            self.courier.last_flush(self.opts.final_flush_s)  # spooled after the courier's final flush
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
            groups_skipped_zero_variance=progress.skipped_zero_variance,
            groups_expired=stats.expired if stats else 0,
            rollouts=progress.rollouts,
            tokens=progress.tokens,
            versions=list(progress.versions_used),
            status=progress.status,
            spool_folder=str(spool.folder) if spool is not None and spool.folder is not None else None,
        )

    def close(self) -> None:
        """Stop the background threads without a goodbye (for callers that used `join` + `step` only)."""
        self.stop_event.set()
        if self.courier is not None:
            self.courier.wake()
            self.courier.join(self.opts.final_flush_s + 2.0)
        self.stop_prefetch()

    # -- heartbeat --

    def _uploaded(self) -> int:
        return self.spool.stats.uploaded if self.spool is not None else 0

    def _heartbeat_bytes(self, final: bool = False) -> bytes:
        """This worker's heartbeat record; `final` reports the end (stopped, or error) whatever the
        generating thread is doing."""
        from pnyx.protocol import HEARTBEAT_SCHEMA, Heartbeat, encode_json

        p = self.progress
        status, detail = p.status, p.detail
        if final and status != "error":
            status, detail = "stopped", self._stop_reason or "done"
        if final and self.spool is not None and len(self.spool):
            detail = f"{detail}; {len(self.spool)} group(s) kept in {self.spool.folder}"
        group_size = self.cfg.worker.group_size if self.cfg is not None else 0
        spool = self.spool
        staged = self.syncer.staged if self.syncer is not None else None
        hb = Heartbeat(
            schema=HEARTBEAT_SCHEMA,
            worker_id=self.worker_id,
            role="worker",
            version=p.version if p.version is not None else -1,
            updated_at=time.time(),
            rollouts=self._uploaded() * group_size,
            groups=self._uploaded(),
            groups_skipped_zero_variance=p.skipped_zero_variance,
            groups_pending=len(spool) if spool is not None else 0,
            groups_expired=spool.stats.expired if spool is not None else 0,
            started_at=p.started_at,
            tokens_per_s=round(p.throughput.rates[1], 3),
            rollouts_per_s=round(p.throughput.rates[0], 3),
            status=status,
            detail=detail[:500],
            digest=p.digest,
            staged=staged[0] if staged is not None else -1,
            staged_digest=staged[1] if staged is not None else "",
            key=self.sealer.signer.fingerprint if self.sealer is not None else "",
            generate_seconds=round(p.generate_s, 3),
            screen_seconds=round(p.screen_s, 3),
            commit_wait_seconds=round(p.commit_wait_s, 3),
            tasks_screened=p.tasks_screened,
            engine=self.cfg.worker.engine if self.cfg is not None else "",
        )
        return encode_json(hb)

    def _write_heartbeat(self) -> None:
        """Write the heartbeat from this thread (before the courier runs, or after it ended); never fatal."""
        try:
            self.store.put(
                layout.worker_heartbeat(self.worker_id),
                self._heartbeat_bytes(final=self.progress.status == "stopped"),
            )
        except StoreError as e:
            log.warning("heartbeat not written (%s): %s", type(e).__name__, e)

    # -- what the join made (a RuntimeError names the call that was skipped) --

    def _config(self) -> PnyxConfig:
        if self.cfg is None:
            raise RuntimeError("RunLink: read_run() first (no run config yet)")
        return self.cfg

    def _weights(self) -> Syncer:
        if self.syncer is None:
            raise RuntimeError("RunLink: read_run() first (no syncer yet)")
        return self.syncer

    def _sealer(self) -> Sealer:
        if self.sealer is None:
            raise RuntimeError("RunLink: read_run() first (no worker key yet)")
        return self.sealer

    def _spool(self) -> Spool:
        if self.spool is None:
            raise RuntimeError("RunLink: cold_join() first (no spool yet)")
        return self.spool
