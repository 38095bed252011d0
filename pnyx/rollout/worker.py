"""The worker loop: join a run from its store alone, follow the weights, generate, score, upload groups.

    worker = Worker(open_store(url), WorkerOptions(worker_id="gpu-box-1"))
    summary = worker.run()          # until max_groups, request_stop() (SIGINT/SIGTERM in the CLI), or a fatal error

Life of a worker: read `run.json` (model, env and sampling settings all come from the run, so the worker
needs only the store URL); pin the trainer's key (`--trust`, or trust on first use: docs/security.md), so
it follows only weights that key signed; load the local model folder and tokenizer; cold-join the newest verified
weights (anchor + deltas); then loop over cohorts. At each cohort boundary it swaps to the newest
prefetched version (never inside a cohort, so every group carries the one version that produced it),
asks supply control how many groups the trainer can still use (`throttle.py`: it paces itself by the
trainer's `weights/DEMAND`), picks tasks from its own seeded stream (by default through the curriculum,
`curriculum.py`, which passes over problems and classes it measured making zero-variance groups, and the
screen, `screen.py`), generates G completions per task,
scores them, skips groups whose samples all got the same reward (the trainer would drop them; counted in
the heartbeat; a seeded one is spooled as its skip record, so every seq it reserved is accounted for in
the store), and hands the rest to the on-disk spool. After the join, the generating thread never
touches the store: the courier thread (`courier.py`) uploads the spool create-only (each group signed with this machine's
worker key, `pnyx.security`) under
`rollouts/v{V}/{worker}-{seq}`, reads the demand and writes the heartbeat (`workers/{worker}.json`:
status, version, digest, throughput, uploaded / skipped / pending counts).

Under committed draws (`security.committed_draws`, `committer.py`) a cohort's tasks and seqs are committed
and drawn only once the trainer's tick includes them; the next cohort is committed while the current one
is drawn (`security.commit_ahead`: on a timer shortly before the current cohort should end, at the version
the next swap will install, `Syncer.pin`), and a stop draws that cohort before the worker leaves.

Seq numbers are resume-safe: with seeded draws (torch and MLX engines, `pnyx.protocol.draws`) a group
reserves its seq before it is generated (its draws name it; a skipped group is uploaded as its skip
record), else a group gets its seq only when it is spooled; at start the worker lists the rollout prefixes of the newest
few versions for its own id (and its spool folder) and continues after the highest seq it finds; a worker
that restarts with the same id cannot write into an older version than the newest at its restart, so that
is enough. A create-only collision with different bytes (two live workers sharing an id) re-keys an
unseeded group and stops the worker with the reason for a seeded one (`sealer.py`). Task
streams are seeded by (run seed, worker id, seq, groups skipped), so workers never duplicate each other and
a restarted worker does not replay its tasks.

Store outages: the courier retries with backoff; groups wait in the spool (on disk, per run and worker
under the user's cache: `spool.py`); while it is full the worker stops generating. Stop (`request_stop`):
the courier makes one final flush bounded by `final_flush_s` and writes a heartbeat with status
"stopped", and what the generating thread spools after it (the cohort it was generating, one committed
ahead) is flushed once more at the end, within the same bound (`Courier.last_flush`); whatever is not
uploaded stays on disk for the next start of this worker id. Puts are atomic in
every backend, so even SIGKILL never leaves a partial object.

The `Worker` runs the generating loop and owns named collaborators: `link` (a `RunLink`, `run_link.py`:
everything it does with the store: joining, the weights syncer, the spool, the courier thread, the
heartbeat, stopping and the end), `progress` (`worker_state.Progress`: what the heartbeat reports),
`gen` (a `Generation`: env, tokenizer, engine, screen, curriculum, made at join) and `supply` (`Supply`,
`throttle.py`: the trainer's demand, shared with the courier). Knows nothing about training.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from pnyx.envs import stable_hash
from pnyx.errors import IntegrityError
from pnyx.protocol import layout
from pnyx.protocol.records import RolloutGroup
from pnyx.rollout.deferred import Deferred
from pnyx.rollout.joining import default_worker_id
from pnyx.rollout.run_link import RunLink
from pnyx.rollout.screen import Screen
from pnyx.rollout.throttle import Supply, Throttle
from pnyx.rollout.worker_state import CohortAhead, Generation, Progress, Status, WorkerOptions, WorkerSummary
from pnyx.store import Store

if TYPE_CHECKING:
    from pnyx.config import PnyxConfig
    from pnyx.envs import Task
    from pnyx.rollout.cohort import CohortSpec

log = logging.getLogger("pnyx.worker")

CURRICULUM_LOG_EVERY = 100
"""Cohorts between two log lines of the curriculum's per-class shares."""
AHEAD_MARGIN_S = 0.3
"""Under committed draws, a cohort committed ahead is committed this long (or two tick intervals, if longer)
before the cohort being drawn should end: its tick (written within a tick interval, then read by a poll) is
there when it is needed, and the version it names is the newest staged at that point."""
DRAIN_TICK_S = 5.0
"""At a stop, seconds a worker waits for the tick of a cohort it committed ahead before leaving it undrawn."""

__all__ = ["Generation", "Status", "Worker", "WorkerOptions", "WorkerSummary"]


class Worker:
    """One rollout worker of one run. Call `run` (or `join` + `step`) from one thread; `request_stop` from any."""

    def __init__(self, store: Store, options: WorkerOptions | None = None):
        self.opts = options or WorkerOptions()
        worker_id = layout.check_name(self.opts.worker_id or default_worker_id(), "worker id")
        self.progress = Progress()
        self.link = RunLink(store, worker_id, self.opts, self.progress)
        self.cfg: PnyxConfig | None = None  # the run's, from run.json at join
        self.gen: Generation | None = None  # made at join
        self.supply: Supply | None = None  # made at join
        self.version_cap: int | None = None  # groups made per policy version before waiting for the next
        self._made: dict[int, int] = {}  # groups spooled per policy version (for version_cap)
        self._cohorts = 0  # cohorts generated (for the curriculum's periodic log line)
        self._kept_frac = 1.0  # recent share of groups not skipped as zero-variance (sizes throttled cohorts)
        # committed draws: the next cohort (its commitment written on a timer shortly before this one ends,
        # `_plan_ahead`), not drawn yet
        self._ahead: Deferred[CohortAhead | None] | None = None
        self._cohort_s = 0.0  # recent wall seconds per cohort (when to commit the next one ahead)
        self._tick_stop: threading.Event | None = None  # set while `_drain` waits for a tick (bounded)
        self._joined = False

    @property
    def worker_id(self) -> str:
        return self.link.worker_id

    # -- control (any thread) --

    def request_stop(self, reason: str = "stop requested") -> None:
        """Ask the worker to stop (`RunLink.request_stop`); signal-safe."""
        self.link.request_stop(reason)

    @property
    def stopping(self) -> bool:
        return self.link.stopping

    def close(self) -> None:
        """Stop the background threads without a goodbye (for callers that used `join` + `step` only)."""
        self.link.close()

    # -- joining --

    def join(self) -> None:
        """Read run.json, load model + tokenizer + env, cold-join the weights, find the resume seq, start the
        courier (the store thread)."""
        from pnyx.config import check_worker_dtype, resolve_env_kwargs, resolve_max_new_tokens
        from pnyx.envs import get_env
        from pnyx.models import load_tokenizer, resolve_run_model
        from pnyx.protocol.rules import worker_version_cap
        from pnyx.rollout.curriculum import Curriculum
        from pnyx.rollout.engines import check_engine, make_engine

        self.progress.set("starting", "reading run.json")
        self.cfg = cfg = self.link.read_run()  # ConfigError: refuse to join
        check_worker_dtype(cfg)  # a run.json written before the trainer refused half precision
        self.version_cap = worker_version_cap(cfg)  # half the run's flood limit (docs/security.md)
        engine_name = self.opts.engine or cfg.worker.engine
        check_engine(
            engine_name, self.opts.device
        )  # fail before loading anything when the engine cannot run here
        env = get_env(cfg.env.name, **resolve_env_kwargs(cfg))
        max_new_tokens = resolve_max_new_tokens(cfg.worker.max_new_tokens, env)  # run.json's
        use_curriculum = (
            cfg.worker.skip_zero_variance if cfg.worker.curriculum is None else cfg.worker.curriculum
        )
        curriculum = Curriculum(env) if use_curriculum else None
        manifest = self.link.manifest
        model = manifest.model if manifest is not None else None
        path = resolve_run_model(
            model or {}, cfg.model.path, cfg.model.revision, self.opts.model_path
        )  # the run's exact model on this machine, or a ConfigError saying what differs
        tokenizer = load_tokenizer(path)
        w = cfg.worker
        engine = make_engine(
            engine_name, path, tokenizer, dtype=cfg.model.dtype, device=self.opts.device, plane=self.link.plane,
            lora=cfg.trainer.lora,
        )  # fmt: skip
        screen = Screen(env, engine, tokenizer, w.screen, w.group_size, start_above=w.screen_start_above)
        self.gen = gen = Generation(env, tokenizer, engine, screen, curriculum, max_new_tokens)
        self.supply = supply = Supply(
            Throttle(cfg.trainer.groups_per_step, w.supply_lead, w.prompts_per_cohort)
        )

        version = self.link.cold_join()
        self._load(version)
        seq = self.link.resume(version)
        spool = self.link.spool
        log.info(
            "worker %s joined run %s: engine=%s env=%s v=%d digest=%s (%s proof) seq=%d spool=%s "
            "(%d left by a previous run)",
            self.worker_id, self.link.run_id, gen.engine.name, gen.env.name, version, self.progress.digest[:12],
            gen.engine.proof_kind, seq, spool.folder if spool else None, spool.stats.loaded if spool else 0,
        )  # fmt: skip
        self.link.start(supply)  # background prefetch; swapped in only at cohort boundaries
        self.progress.throughput.restart(self.progress.rollouts, self.progress.tokens)
        self._joined = True

    def _load(self, version: int) -> None:
        """Apply verified version `version` to the engine in place (only ever called between cohorts).

        The engine writes the tensors that changed into its resident model and proves the result against
        the version's manifest (`pnyx.rollout.engines.base`), reading the syncer's verified bits, which it
        never writes.
        """
        syncer = self.link.syncer
        if syncer is None or self.gen is None:
            raise RuntimeError("the worker applies weights only after joining (no syncer or engine yet)")
        proof = self.gen.engine.update(version, syncer.state, syncer.manifest)
        if proof.chain_digest != syncer.digest:
            raise IntegrityError(
                f"v{version}: the engine proved {proof.chain_digest}, the syncer holds {syncer.digest}"
            )
        self.progress.version, self.progress.digest = version, proof.chain_digest
        self.progress.versions_used.append(version)

    # -- the loop --

    def run(self) -> WorkerSummary:
        """Join (if not yet), then loop until stopped or `max_groups` uploaded (then draw a cohort committed
        ahead, `_drain`); flush and say goodbye."""
        try:
            if not self._joined:
                self.join()
            while not self.stopping and not self._quota_reached():
                self.step()
            self._drain()
        except InterruptedError:
            log.info("worker %s stopped before it joined", self.worker_id)
        except BaseException as e:
            self.progress.set("error", f"{type(e).__name__}: {e}"[:500])
            self.link.end_courier(self.opts.final_flush_s)
            raise
        finally:
            if self._ahead is not None:
                self._ahead.cancel()  # an error: no commitment written after it
            self.link.stop_prefetch()
            if self.gen is not None:
                self.gen.engine.close()
        return self.link.shutdown()

    def step(self) -> None:
        """One cohort boundary: maybe swap weights, then (if supply control and the spool allow) generate one
        cohort and spool its groups. Never calls the store but for committed draws' commitment and tick (the
        courier uploads). Under committed draws with `security.commit_ahead` the cohort after this one is
        committed while this one is drawn (`_plan_ahead`), and the next boundary draws that one."""
        from pnyx.rollout.cohort import CohortSpec

        link, gen, supply, cfg = self.link, self.gen, self.supply, self.cfg
        if not self._joined or gen is None or supply is None or cfg is None or link.spool is None:
            raise RuntimeError("Worker.step() before join(): call run() or join() first")
        plan, self._ahead = self._ahead, None
        ahead = plan.take() if plan is not None else None  # written now if its timer has not fired yet
        # re-raises a fatal error; a cohort committed ahead is drawn at exactly its version (`pin_next`), and one
        # drawn again after a stop interrupted its wait for the tick (`_drain`) keeps the version it swapped to
        fresh = link.swap(ahead.commit.version if ahead is not None else None)
        if fresh is not None:
            self._load(fresh)
            log.info("worker %s swapped to v=%d digest=%s", self.worker_id, fresh, self.progress.digest[:12])
        progress = self.progress
        version = progress.version
        if version is None:
            raise RuntimeError("Worker.step() before join(): call run() or join() first")
        if ahead is not None and ahead.commit.version != version:
            raise RuntimeError(
                f"a cohort committed ahead at v{ahead.commit.version}, the engine holds v{version}"
            )
        seed = stable_hash(cfg.run.seed, self.worker_id, link.next_seq, progress.skipped_zero_variance) % (
            2**31
        )
        # every token drawn from seeded uniforms the trainer checks (engines that can)
        seeded = getattr(gen.engine, "seeded_draws", False)
        w = cfg.worker
        spec = CohortSpec(
            run_id=link.run_id, worker_id=self.worker_id, version=version, digest=progress.digest,
            group_size=w.group_size, temperature=w.temperature, top_p=w.top_p, top_k=w.top_k,
            max_new_tokens=gen.max_new_tokens, seed=seed, key=link.key if seeded else "",
        )  # fmt: skip
        if ahead is not None:
            tasks = ahead.tasks
        else:
            n = self._cohort_size(version)
            if n <= 0:
                return  # paused (the reason is in the heartbeat)
            tasks = self._pick(spec, n, version)
        next_seq = link.reserve_seq if seeded else lambda: 0
        if seeded and link.committer is not None:  # committed draws: the seqs and tasks first, then the tick
            if ahead is None:
                ahead = CohortAhead(link.commit_ahead(version, [t.id for t in tasks]), tasks)
            progress.set(
                "waiting", f"v={version}: committed {len(tasks)} task(s), waiting for the trainer's tick"
            )
            drawn, seqs = link.draw(ahead.commit, self._tick_stop)
            if drawn is None:
                self._ahead = Deferred.of(ahead)  # stopping: `run` draws it if its tick comes (`_drain`)
                return
            spec = replace(spec, tick=drawn.n, beacon=drawn.beacon, commit=drawn.key)
            next_seq = iter(seqs).__next__
            if cfg.security.commit_ahead and self._tick_stop is None:
                self._ahead = self._plan_ahead(spec, len(tasks), version)
        t0 = time.monotonic()
        self._generate(spec, tasks, next_seq, version)
        took = time.monotonic() - t0
        self._cohort_s = took if not self._cohort_s else 0.7 * self._cohort_s + 0.3 * took

    def _cohort_size(self, version: int) -> int:
        """Prompts for the next cohort at `version` by the version cap, the spool, supply control and the
        quota; 0 after pausing for the reason (set in the heartbeat)."""
        cfg, supply, spool, progress, link = self.cfg, self.supply, self.link.spool, self.progress, self.link
        assert cfg is not None and supply is not None and spool is not None
        w = cfg.worker
        cap = self.version_cap
        n = w.prompts_per_cohort
        if cap is not None:  # groups stay under it (the trainer's flood limit is twice it)
            # Skip records do not count: a trainer short of a batch publishes no new version, so they go on
            # until it has one (`pnyx.train.version_listing.SKIPS`).
            n = min(n, cap - self._made.get(version, 0))
            if n <= 0:
                progress.set("waiting", f"v={version}: {cap} groups made, waiting for the next version")
                link.pause(w.poll_interval_s)
                return 0
        if len(spool) + n > spool.max_groups:
            # never generate what could not be spooled; the courier is retrying the store
            progress.set("waiting", f"store unreachable, {len(spool)} group(s) spooled")
            link.pause(1.0)
            return 0
        if w.supply_control:
            allowed, hint, why = supply.allowance()
            if allowed <= 0:
                progress.set("waiting", why)
                link.pause(hint)
                return 0
            # prompts for `allowed` uploadable groups, given how many recently had zero variance
            n = min(n, math.ceil(allowed / max(0.25, self._kept_frac)))
        if self.opts.max_groups is not None:
            n = min(n, self.opts.max_groups - spool.accounted())
            if n <= 0:  # the quota is spooled: wait for the courier to upload it
                progress.set("uploading", f"pending={len(spool)}")
                link.pause(0.5)
                return 0
        return n

    def _plan_ahead(
        self, spec: CohortSpec, drawing: int, version: int
    ) -> Deferred[CohortAhead | None] | None:
        """The cohort after the one of `drawing` tasks about to be drawn at `version`: its tasks picked now, a
        whole cohort where supply control leaves room beyond the cohort drawn now (its groups not made yet:
        counted at the recent share kept), within the version cap, the spool and the quota; its commitment
        written on a timer `AHEAD_MARGIN_S` (or two ticks) before this cohort should end by the recent
        cohorts' length (`_commit_at`), so it names the newest version staged by then and its tick is there
        when it is needed. None: no room (the next boundary commits and waits, as without `commit_ahead`),
        or stopping."""
        cfg, supply, spool = self.cfg, self.supply, self.link.spool
        assert cfg is not None and supply is not None and spool is not None
        if self.stopping:
            return None
        n = cfg.worker.prompts_per_cohort
        if self.version_cap is not None:  # as if drawn at `version`: a newer one has no groups made yet
            n = min(n, self.version_cap - self._made.get(version, 0) - drawing)
        if len(spool) + drawing + n > spool.max_groups:
            n = 0
        if cfg.worker.supply_control and supply.room() - drawing * self._kept_frac <= 0:
            # The room is read before the demand this cohort's groups will answer: a cohort committed ahead
            # is made whole where any room is left (sized to the room, it came out ~15% smaller than the
            # cohorts of a worker that commits as it goes, each batch less efficient: bench_commit_ahead.py)
            n = 0
        if self.opts.max_groups is not None:
            n = min(n, self.opts.max_groups - spool.accounted() - drawing)
        if n <= 0:
            return None
        tasks = self._pick(spec, n, version)
        margin = max(AHEAD_MARGIN_S, 2 * cfg.security.tick_interval_s)
        return Deferred(lambda: self._commit_at(tasks, version), self._cohort_s - margin)

    def _commit_at(self, tasks: list[Task], version: int) -> CohortAhead | None:
        """Commit `tasks` at the version the next swap installs (`RunLink.pin_next`: the newest staged, else
        `version`, the one drawn now). On the timer's thread or the generating one (`Deferred`); None when
        stopping (nothing committed, nothing left undrawn)."""
        if self.stopping:
            return None
        link = self.link
        target = link.pin_next()
        at = version if target is None else target
        return CohortAhead(link.commit_ahead(at, [t.id for t in tasks]), tasks)

    def _pick(self, spec: CohortSpec, n: int, version: int) -> list[Task]:
        """`n` tasks for a cohort at `version`: a pool from the curriculum (or the env's train stream), then
        the screen's pick."""
        from pnyx.rollout.cohort import sampling_params

        gen, progress = self.gen, self.progress
        assert gen is not None
        pool_n = gen.screen.pool_size(n)
        if gen.curriculum is not None:
            pool = gen.curriculum.sample(spec.seed, pool_n, version)
        else:
            pool = gen.env.sample("train", seed=spec.seed, n=pool_n)
        tasks = gen.screen.pick(pool, n, sampling_params(spec, gen.env))
        progress.screen_s, progress.tasks_screened = gen.screen.seconds, gen.screen.scored
        return tasks

    def _generate(
        self, spec: CohortSpec, tasks: list[Task], next_seq: Callable[[], int], version: int
    ) -> None:
        """Generate the cohort of `tasks` at `version`, observe it (curriculum, screen) and spool its groups."""
        from pnyx.protocol.rules import is_zero_variance
        from pnyx.rollout.cohort import generate_cohort

        gen, supply, progress, spool, cfg = self.gen, self.supply, self.progress, self.link.spool, self.cfg
        assert gen is not None and supply is not None and spool is not None and cfg is not None
        w = cfg.worker
        progress.set("generating", f"v={version} tasks={len(tasks)}")
        # a seeded group's seq is reserved now (its draws name it); an unseeded one is numbered when sealed
        result = generate_cohort(gen.engine, gen.tokenizer, gen.env, tasks, spec, next_seq)
        progress.generate_s += result.gen_seconds
        if gen.curriculum is not None:
            gen.curriculum.observe(tasks, result.groups, version)
            self._cohorts += 1
            if self._cohorts % CURRICULUM_LOG_EVERY == 0:
                shares = " ".join(f"{k}={v:.2f}" for k, v in sorted(gen.curriculum.summary().items()))
                log.info(
                    "worker=%s v=%d curriculum shares of mixed groups: %s", self.worker_id, version, shares
                )
        kept = self._spool_groups(result.groups, version, supply, skip_zero_variance=w.skip_zero_variance)
        zero = sum(is_zero_variance([s.reward for s in g.samples]) for g in result.groups)
        gen.screen.observe(zero, len(result.groups))
        self._kept_frac = 0.8 * self._kept_frac + 0.2 * kept / max(1, len(result.groups))
        progress.rollouts += sum(len(g.samples) for g in result.groups)
        progress.tokens += result.tokens
        progress.throughput.update(progress.rollouts, progress.tokens)
        rewards = [s.reward for g in result.groups for s in g.samples]
        log.info(
            "worker=%s v=%d groups=%d pending=%d skipped=%d reward=%.3f rollouts/s=%.2f tok/s=%.1f",
            self.worker_id, version, spool.stats.uploaded, len(spool), progress.skipped_zero_variance,
            sum(rewards) / max(1, len(rewards)), *progress.throughput.rates,
        )  # fmt: skip
        if kept:
            progress.set("uploading", f"v={version} pending={len(spool)}")

    def _drain(self) -> None:
        """At a stop, draw the cohort committed ahead (its seqs would be gaps, faults of this key, if it were
        never drawn), waiting for its tick at most `DRAIN_TICK_S` (the trainer may be gone: then it is left,
        and a restart of this worker has it excused, `pnyx.train.ticker`)."""
        plan = self._ahead
        ahead = plan.take() if plan is not None else None
        self._ahead = Deferred.of(ahead) if ahead is not None else None
        if ahead is None:
            return
        stop = threading.Event()
        timer = threading.Timer(DRAIN_TICK_S, stop.set)
        timer.daemon = True
        self._tick_stop = stop
        timer.start()
        try:
            log.info("worker %s: stopping: drawing the %d task(s) committed ahead first", self.worker_id,
                     len(ahead.tasks))  # fmt: skip
            self.step()
            if self._ahead is not None:
                log.warning(
                    "worker %s: no tick for the cohort committed ahead within %.0fs: its %d seq(s) stay undrawn",
                    self.worker_id, DRAIN_TICK_S, len(ahead.tasks),
                )  # fmt: skip
        finally:
            timer.cancel()
            self._tick_stop = None
            self._ahead = None

    def _spool_groups(
        self, groups: list[RolloutGroup], version: int, supply: Supply, *, skip_zero_variance: bool
    ) -> int:
        """Hand the groups worth uploading to the link (which numbers, signs and spools them); skip (and count)
        zero-variance ones, a seeded one as its skip record (`layout.is_skip_key`: the trainer audits it and
        never trains on it). Returns how many groups were spooled for training."""
        from pnyx.protocol.rules import is_zero_variance  # the trainer's own test: same verifier, same drop

        kept: list[RolloutGroup] = []
        skips: list[RolloutGroup] = []
        for group in groups:
            if skip_zero_variance and is_zero_variance([s.reward for s in group.samples]):
                self.progress.skipped_zero_variance += 1
                if group.draws:  # its seq was reserved before it was generated: account for it
                    skips.append(group)
                continue
            kept.append(group)  # in order
        if kept:
            self._made[version] = self._made.get(version, 0) + len(kept)
            supply.note_made(len(kept))
        if kept or skips:
            self.link.send(kept, skips)
        return len(kept)

    def _quota_reached(self) -> bool:
        spool = self.link.spool
        return (
            self.opts.max_groups is not None
            and spool is not None
            and spool.stats.uploaded >= self.opts.max_groups
        )
