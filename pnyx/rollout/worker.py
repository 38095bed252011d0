"""The worker loop: join a run from its store alone, follow the weights, generate, score, upload groups.

    worker = Worker(open_store(url), WorkerOptions(worker_id="gpu-box-1"))
    summary = worker.run()          # until max_groups, request_stop() (SIGINT/SIGTERM in the CLI), or a fatal error

Life of a worker: read `run.json` (model, env and sampling settings all come from the run, so the worker
needs only the store URL); pin the trainer's key (`--trust`, or trust on first use: docs/security.md), so
it follows only weights that key signed; load the local model folder and tokenizer; cold-join the newest verified
weights (anchor + deltas); then loop over cohorts. At each cohort boundary it swaps to the newest
prefetched version (never inside a cohort, so every group carries the one version that produced it),
asks supply control how many groups the trainer can still use (`throttle.py`: it paces itself by the
trainer's `weights/DEMAND`), samples tasks from its own seeded stream, generates G completions per task,
scores them, skips groups whose samples all got the same reward (the trainer would drop them; counted in
the heartbeat), and hands the rest to the on-disk spool. After the join, the generating thread never
touches the store: the courier thread (`courier.py`) uploads the spool create-only (each group signed with this machine's
worker key, `pnyx.security`) under
`rollouts/v{V}/{worker}-{seq}`, reads the demand and writes the heartbeat (`workers/{worker}.json`:
status, version, digest, throughput, uploaded / skipped / pending counts).

Seq numbers are resume-safe and contiguous: a group gets its seq only when it is spooled (skipped groups
take none), and at start the worker lists the rollout prefixes of the newest few versions for its own id
(and its spool folder) and continues after the highest seq it finds; a worker that restarts with the same
id cannot write into an older version than the newest at its restart, so that is enough. A create-only
collision with different bytes (two live workers sharing an id) is logged and the group re-keyed. Task
streams are seeded by (run seed, worker id, seq, groups skipped), so workers never duplicate each other and
a restarted worker does not replay its tasks.

Store outages: the courier retries with backoff; groups wait in the spool (on disk, per run and worker
under the user's cache: `spool.py`); while it is full the worker stops generating. Stop (`request_stop`):
the courier makes one final flush bounded by `final_flush_s` and writes a heartbeat with status
"stopped"; whatever is not uploaded stays on disk for the next start of this worker id. Puts are atomic in
every backend, so even SIGKILL never leaves a partial object.

The `Worker` builds on `WorkerLink` (`worker_link.py`: stopping, the courier's callbacks for supply
control, seq numbers and re-keying, the heartbeat record, the end and its summary); this module joins the
run and runs the generating loop. Knows nothing about training.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

from pnyx.errors import ConfigError, IntegrityError
from pnyx.protocol import layout
from pnyx.rollout.courier import Courier
from pnyx.rollout.joining import cold_join, default_worker_id, read_run_manifest, resume_seq
from pnyx.rollout.screen import Screen
from pnyx.rollout.spool import Spool, spool_folder
from pnyx.rollout.throttle import Throttle
from pnyx.rollout.worker_link import WorkerLink
from pnyx.rollout.worker_state import Status, Throughput, WorkerOptions, WorkerSummary
from pnyx.security.keys import load_or_create_key, worker_key_path
from pnyx.security.signing import Signer
from pnyx.store import Store
from pnyx.weights.syncer import Syncer
from pnyx.weights.trust import pin_trainer

log = logging.getLogger("pnyx.worker")

__all__ = ["Status", "Worker", "WorkerOptions", "WorkerSummary"]


class Worker(WorkerLink):
    """One rollout worker of one run. Call `run` (or `join` + `step`) from one thread; `request_stop` from any."""

    def __init__(self, store: Store, options: WorkerOptions | None = None):
        self.store = store
        self.opts = options or WorkerOptions()
        self.worker_id = layout.check_name(self.opts.worker_id or default_worker_id(), "worker id")
        self.stop_event = threading.Event()
        self.status: Status = "starting"
        self.detail = ""
        self.version: int | None = None
        self.digest = ""
        self.versions_used: list[int] = []
        self.rollouts = 0
        self.tokens = 0
        self.skipped_zero_variance = 0
        self.generate_s = 0.0  # seconds generating cohorts (the screening's cost is measured against it)
        self.screen: Screen | None = None  # made at join
        self.started_at = time.time()
        self._seq = 0
        self._seq_lock = threading.Lock()  # seqs are also taken by the courier (re-keying a collision)
        self._lock = threading.Lock()  # the throttle, shared with the courier
        self._wake = threading.Event()  # wakes the generating thread: spool space, a new demand, a stop
        self._joined = False
        self._throughput = Throughput()
        self._last_heartbeat = 0.0
        self._stop_reason = ""
        self.version_cap: int | None = None  # groups made per policy version before waiting for the next
        self._made: dict[int, int] = {}  # groups spooled per policy version (for version_cap)
        self._kept_frac = 1.0  # recent share of groups not skipped as zero-variance (sizes throttled cohorts)
        self.spool: Spool | None = None
        self.syncer: Syncer | None = None
        self.signer: Signer | None = None
        self.throttle: Throttle | None = None
        self.courier: Courier | None = None

    # -- joining --

    def join(self) -> None:
        """Read run.json, load model + tokenizer + env, cold-join the weights, find the resume seq, start the
        courier (the store thread)."""
        from pnyx.config import config_from_dict, resolve_env_kwargs, resolve_max_new_tokens
        from pnyx.envs import get_env
        from pnyx.models import load_tokenizer, resolve_run_model
        from pnyx.rollout.curriculum import Curriculum
        from pnyx.rollout.engines import check_engine, make_engine

        self._set_status("starting", "reading run.json")
        manifest = read_run_manifest(self.store, self.opts.join_timeout_s, self.stop_event)
        self.run_id = manifest.run_id
        self.trust = pin_trainer(manifest, self.opts.trust, self.opts.keys_dir)  # ConfigError: refuse to join
        key, created = load_or_create_key(worker_key_path(self.opts.keys_dir))
        self.signer = Signer(key)  # signs every group; the trainer binds this worker's name to it
        log.info(
            "worker %s: signing groups with key %s%s", self.worker_id, self.signer.fingerprint,
            " (created)" if created else "",
        )  # fmt: skip
        self.cfg = config_from_dict(manifest.config)
        from pnyx.protocol.rules import worker_version_cap

        self.version_cap = worker_version_cap(self.cfg)  # half the run's flood limit (docs/security.md)
        if self.opts.int8 and not self.cfg.worker.int8:
            raise ConfigError(
                "--int8: this run's trainer does not publish the int8 actor plane. Start the run with "
                "--worker.int8=true (the trainer then publishes it next to the bf16 weights), or drop --int8."
            )
        engine = self.opts.engine or self.cfg.worker.engine
        check_engine(engine, self.opts.device)  # fail before loading anything when the engine cannot run here
        self.env = get_env(self.cfg.env.name, **resolve_env_kwargs(self.cfg))
        self.max_new_tokens = resolve_max_new_tokens(self.cfg.worker.max_new_tokens, self.env)  # run.json's
        self.curriculum = Curriculum(self.env) if self.cfg.worker.curriculum else None
        path = resolve_run_model(
            manifest.model or {}, self.cfg.model.path, self.cfg.model.revision, self.opts.model_path
        )  # the run's exact model on this machine, or a ConfigError saying what differs
        self.tokenizer = load_tokenizer(path)
        w = self.cfg.worker
        self.plane = "int8" if (self.opts.int8 or w.int8) else "weights"
        self.engine = make_engine(
            engine, path, self.tokenizer, dtype=self.cfg.model.dtype, device=self.opts.device, plane=self.plane
        )  # fmt: skip
        self.screen = Screen(
            self.env, self.engine, self.tokenizer, w.screen, w.group_size, start_above=w.screen_start_above
        )
        capacity = max(w.spool_max_groups, w.prompts_per_cohort)  # 0 in config: hold one cohort at most
        folder = spool_folder(self.opts.spool_dir, self.run_id, self.worker_id)
        self.spool = Spool(capacity, folder=folder, rekey=self._rekey)
        self.throttle = Throttle(self.cfg.trainer.groups_per_step, w.supply_lead, w.prompts_per_cohort)

        self._set_status("syncing", "cold join")
        self._write_heartbeat()
        self.syncer = syncer = Syncer(
            self.store,
            plane=self.plane,
            max_backoff_s=self.opts.max_backoff_s,
            poll_interval_s=w.poll_interval_s,
            trust=self.trust,  # only weights the run's trainer key signed: fail-closed otherwise
        )
        version, tensors = cold_join(syncer, self.opts.join_timeout_s, w.poll_interval_s, self.stop_event)
        self._load(version, tensors)
        pending = [layout.parse_rollout_key(k) for k in self.spool.pending_keys()]
        spooled = max((p[2] for p in pending if p and p[1] == self.worker_id), default=-1)
        self._seq = max(resume_seq(self.store, self.worker_id, version), spooled + 1)
        log.info(
            "worker %s joined run %s: engine=%s env=%s v=%d digest=%s (%s proof) seq=%d spool=%s "
            "(%d left by a previous run)",
            self.worker_id, self.run_id, self.engine.name, self.env.name, version, self.digest[:12],
            self.engine.proof_kind, self._seq, folder, self.spool.stats.loaded,
        )  # fmt: skip
        syncer.start()  # background prefetch; swapped in only at cohort boundaries
        self.courier = Courier(
            self.store, self.spool, heartbeat=self._heartbeat_bytes,
            heartbeat_key=layout.worker_heartbeat(self.worker_id), heartbeat_s=w.heartbeat_interval_s,
            stop=self.stop_event, on_demand=self._take_demand, demand_poll_s=self._demand_poll_s,
            expired=self._expired, on_progress=self._wake.set, flush_deadline_s=self.opts.flush_deadline_s,
            final_flush_s=self.opts.final_flush_s, max_backoff_s=self.opts.max_backoff_s,
        )  # fmt: skip
        self.courier.start()
        self._throughput.restart(self.rollouts, self.tokens)
        self._joined = True

    def _load(self, version: int, tensors: dict[str, Any]) -> None:
        """Apply verified version `version` to the engine in place (only ever called between cohorts).

        The engine writes the tensors that changed into its resident model and proves the result against
        the version's manifest (`pnyx.rollout.engines.base`); `tensors` (the syncer's torch view) is not
        needed: engines read the syncer's verified bits, which they never write.
        """
        syncer = self.syncer
        if syncer is None:
            raise RuntimeError("the worker applies weights only after joining (no syncer yet)")
        proof = self.engine.update(version, syncer.state, syncer.manifest)
        if proof.chain_digest != syncer.digest:
            raise IntegrityError(
                f"v{version}: the engine proved {proof.chain_digest}, the syncer holds {syncer.digest}"
            )
        self.version, self.digest = version, proof.chain_digest
        self.versions_used.append(version)

    # -- the loop --

    def run(self) -> WorkerSummary:
        """Join (if not yet), then loop until stopped or `max_groups` uploaded; flush and say goodbye."""
        try:
            if not self._joined:
                self.join()
            while not self.stopping and not self._quota_reached():
                self.step()
        except InterruptedError:
            log.info("worker %s stopped before it joined", self.worker_id)
        except BaseException as e:
            self._set_status("error", f"{type(e).__name__}: {e}"[:500])
            self._end_courier(self.opts.final_flush_s)
            raise
        finally:
            if self.syncer is not None:
                self.syncer.stop(timeout_s=1.0)  # a fetch in flight is abandoned (daemon thread)
            if getattr(self, "engine", None) is not None:
                self.engine.close()
        return self._shutdown()

    def step(self) -> None:
        """One cohort boundary: maybe swap weights, then (if supply control and the spool allow) generate one
        cohort and spool its groups. Never calls the store: the courier uploads."""
        from pnyx.envs import stable_hash
        from pnyx.protocol.rules import is_zero_variance
        from pnyx.rollout.cohort import CohortSpec, generate_cohort, sampling_params

        if (
            self.spool is None
            or self.syncer is None
            or self.courier is None
            or self.throttle is None
            or self.screen is None
            or self.version is None
        ):
            raise RuntimeError("Worker.step() before join(): call run() or join() first")
        self.courier.check()  # re-raises a fatal error of the store thread
        fresh = self.syncer.swap()  # re-raises a fatal error of the prefetch thread
        if fresh is not None:
            self._load(*fresh)
            log.info("worker %s swapped to v=%d digest=%s", self.worker_id, self.version, self.digest[:12])
        w = self.cfg.worker
        cap = self.version_cap
        if cap is not None and self._groups_at_version() >= cap:
            self._set_status("waiting", f"v={self.version}: {cap} groups made, waiting for the next version")
            self._pause(w.poll_interval_s)
            return
        n = w.prompts_per_cohort
        if len(self.spool) + n > self.spool.max_groups:
            # never generate what could not be spooled; the courier is retrying the store
            self._set_status("waiting", f"store unreachable, {len(self.spool)} group(s) spooled")
            self._pause(1.0)
            return
        if w.supply_control:
            with self._lock:
                allowed, hint, why = (
                    self.throttle.allowance(),
                    self.throttle.wait_hint(),
                    self.throttle.describe(),
                )
            if allowed <= 0:
                self._set_status("waiting", why)
                self._pause(hint)
                return
            # prompts for `allowed` uploadable groups, given how many recently had zero variance
            n = min(n, math.ceil(allowed / max(0.25, self._kept_frac)))
        if self.opts.max_groups is not None:
            n = min(n, self.opts.max_groups - self.spool.accounted())
            if n <= 0:  # the quota is spooled: wait for the courier to upload it
                self._set_status("uploading", f"pending={len(self.spool)}")
                self._pause(0.5)
                return
        seed = stable_hash(self.cfg.run.seed, self.worker_id, self._seq, self.skipped_zero_variance) % (2**31)
        spec = CohortSpec(
            run_id=self.run_id, worker_id=self.worker_id, version=self.version, digest=self.digest,
            group_size=w.group_size, temperature=w.temperature, top_p=w.top_p, top_k=w.top_k,
            max_new_tokens=self.max_new_tokens, seed=seed,
        )  # fmt: skip
        pool_n = self.screen.pool_size(n)
        if self.curriculum is not None:
            pool = self.curriculum.sample(seed, pool_n)
        else:
            pool = self.env.sample("train", seed=seed, n=pool_n)
        tasks = self.screen.pick(pool, n, sampling_params(spec, self.env))
        self._set_status("generating", f"v={self.version} tasks={n}")
        result = generate_cohort(self.engine, self.tokenizer, self.env, tasks, spec, lambda: 0)
        self.generate_s += result.gen_seconds
        if self.curriculum is not None:
            self.curriculum.observe(tasks, result.groups)
        kept = self._spool_groups(result.groups)
        zero = sum(is_zero_variance([s.reward for s in g.samples]) for g in result.groups)
        self.screen.observe(zero, len(result.groups))
        self._kept_frac = 0.8 * self._kept_frac + 0.2 * kept / max(1, len(result.groups))
        self.rollouts += sum(len(g.samples) for g in result.groups)
        self.tokens += result.tokens
        self._throughput.update(self.rollouts, self.tokens)
        rewards = [s.reward for g in result.groups for s in g.samples]
        log.info(
            "worker=%s v=%d groups=%d pending=%d skipped=%d reward=%.3f rollouts/s=%.2f tok/s=%.1f",
            self.worker_id, self.version, self.spool.stats.uploaded, len(self.spool), self.skipped_zero_variance,
            sum(rewards) / max(1, len(rewards)), *self._throughput.rates,
        )  # fmt: skip
        if kept:
            self._set_status("uploading", f"v={self.version} pending={len(self.spool)}")

    def _spool_groups(self, groups: list[Any]) -> int:
        """Number and spool the groups worth uploading; skip (and count) zero-variance ones. Returns how many
        were spooled."""
        import msgspec

        from pnyx.protocol import encode_group
        from pnyx.protocol.rules import is_zero_variance  # the trainer's own test: same verifier, same drop

        # called by step() only, after join(): the parts below exist
        assert self.spool is not None and self.courier is not None and self.throttle is not None
        assert self.version is not None
        kept = 0
        for group in groups:
            if self.cfg.worker.skip_zero_variance and is_zero_variance([s.reward for s in group.samples]):
                self.skipped_zero_variance += 1
                continue
            group = msgspec.structs.replace(group, seq=self._next_seq())  # seqs stay contiguous
            self.spool.add(
                layout.rollout_key(group.policy_version, self.worker_id, group.seq),
                encode_group(group, signer=self.signer),
            )
            kept += 1
        if kept:
            self._made[self.version] = self._made.get(self.version, 0) + kept
            with self._lock:
                self.throttle.note_made(kept)
            self.courier.wake()
        return kept

    def _pause(self, seconds: float) -> None:
        """Wait up to `seconds`, returning early on a stop, spool progress or a new demand."""
        self._wake.wait(seconds)
        self._wake.clear()

    def _groups_at_version(self) -> int:
        return self._made.get(self.version, 0) if self.version is not None else 0

    def _quota_reached(self) -> bool:
        return (
            self.opts.max_groups is not None
            and self.spool is not None
            and (self.spool.stats.uploaded >= self.opts.max_groups)
        )
