"""The trainer loop: bootstrap or resume a run, then ingest → step → publish → checkpoint, until a budget.

Per step at version V (docs/trainer.md):
1. the batch of step V→V+1 is `trainer/batch-{V+1}` if that record exists (a step that was started
   before a crash, or by another trainer), else the ingestor selects one and records it create-only;
2. `train_step` (fp32 master, micro-batched, AdamW, clip);
3. publish V+1 (bf16 by default) through the PULSE publisher — the fence: FencedError if another trainer
   owns the run;
4. commit the batch to the ingestion cursor; write metrics; checkpoint (sharded, asynchronous) every
   `checkpoint_every` steps.

On resume, the newest committed checkpoint C is loaded and every published version in (C, P] is replayed
from its batch record, so the in-memory state (weights, optimizer, cursor) is exactly the state that
produced P; a replay whose bits differ from the published P (non-deterministic kernels, another number of
ranks) adopts the published bits.

Ingestion overlaps the step: once a batch is recorded, the prefetcher (`prefetch.py`) lists, fetches and
re-scores the next step's groups in the background while this step trains and publishes. Never silent:
`progress.py` logs what the trainer is doing at least every 8 s and writes `trainer/status.json`. A stop
request (SIGINT/SIGTERM) is a flag every wait checks at least every 0.1 s: a trainer waiting for or
fetching groups stops at once; one that is stepping finishes the step (publish, commit), then checkpoints.

Under torchrun every rank runs this loop together (`distributed.py`): rank 0 alone chooses and records the
batch (ingestion runs on rank 0 only), commits the manifest, writes metrics and checkpoint commits; every
rank receives the batch, trains on its share, publishes its share of the payload and writes its
checkpoint shards.

Layout: the `Trainer` is composed of the `TrainerParts` that `trainer_setup.py` loads (model, optimizer,
publishing, checkpointer, ingestor and prefetcher, ...) when it creates or joins the run (`open_run`);
`resume.py` replays the steps published after a checkpoint;
`hooks.py` names the points of a step where a harness may act (`pnyx_harness.trainer` kills the process
there, or slows every group fetch). This module is the step loop: choose and record the
batch, train, publish, commit, metrics, checkpoint. Knows nothing about generation internals.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from pnyx.config import PnyxConfig
from pnyx.errors import IntegrityError, NotFoundError, RecordRejected
from pnyx.protocol.records import RunManifest
from pnyx.security.signing import Verifier
from pnyx.store import Store
from pnyx.train import checkpoint, hooks
from pnyx.train.batch import Batch, StepResult
from pnyx.train.forward import MicroBatch
from pnyx.train.ingest import ScoredGroup
from pnyx.train.progress import Progress, format_line
from pnyx.train.resume import restore
from pnyx.train.settings import check_settings, loss_settings
from pnyx.train.step import StepStats, train_step
from pnyx.train.step_metrics import step_metrics
from pnyx.train.ticker import Ticker
from pnyx.train.trainer_setup import TrainerParts, attach_run, load_parts, open_run
from pnyx.train.wait_work import WaitWork
from pnyx.weights.manifest import WeightManifest

T = TypeVar("T")

log = logging.getLogger("pnyx.train")

STATUS_KEYS = 32
"""`trainer/status.json` reports at most this many worker keys (quarantined first, then by faults)."""


class Trainer:
    """One run's trainer process. `start()` bootstraps or resumes; `run()` steps until a stop condition.

    Composed of the run's `TrainerParts` (`self.parts`, from `start()` on): a step reads its batch through
    `parts.prefetcher` and `parts.ingestor`, trains `parts.model` with `parts.optimizer`, publishes through
    `parts.publishing` and checkpoints through `parts.checkpointer`."""

    def __init__(self, cfg: PnyxConfig, store: Store, *, resume: bool = False, steps: int | None = None):
        self.cfg = cfg
        """The config as given; from `start()` on, the run's resolved config (`parts.cfg`)."""
        self.store = store
        self.resume = resume
        self._steps_override = steps
        self.steps = steps if steps is not None else cfg.run.steps
        self.version = 0
        self.last_checkpoint: int | None = None
        self._stop = False  # set by the signal handler: a plain flag, no locks inside a handler
        self.trainer_id = f"trainer-{os.getpid()}"
        self._parts: TrainerParts | None = None
        self._check_pending = True  # read a pending batch record before the first step of this process
        self._ingest_wait_s = 0.0
        self._probe_after: tuple[int, tuple[object, ...], MicroBatch] | None = None
        """(the version after the step, its probe rows, their forward after it): the next step's forward
        before the same rows (`train_batch`)."""
        self._waiting: WaitWork | None = None
        self.progress = Progress(store, self._describe)
        self.manifest: RunManifest | None = None
        self.trust: Verifier | None = None
        """The verifier of the run's trainer key (from run.json), once the run is created or joined."""

    @property
    def parts(self) -> TrainerParts:
        """What a step needs, loaded by `start()`."""
        if self._parts is None:
            raise RuntimeError("the trainer has no model or ingestor before start()")
        return self._parts

    @property
    def waiting(self) -> WaitWork:
        """The exact checks done while a batch is chosen, and their metrics (from the parts `start()` loads)."""
        if self._waiting is None:
            self._waiting = WaitWork(self.parts.ingestor, self.parts.rejudge, self.cfg.security)
        return self._waiting

    @property
    def run_id(self) -> str:
        if self.manifest is None:
            raise RuntimeError("the trainer has no run before start()")
        return self.manifest.run_id

    # --- one step ------------------------------------------------------------------------------------

    def start(self) -> None:
        """Load the model and either create the run (publish v0) or resume it from the store: the newest
        checkpoint, then every version published after it replayed (`resume.restore`)."""
        self.progress.phase("loading")
        with self.progress.running(status=False):
            opened = open_run(self.cfg, self.store, self.resume, self._steps_override)
            self._parts, self.cfg, self.steps = opened.parts, opened.parts.cfg, opened.steps
            self.manifest, self.trust = opened.manifest, opened.trust
            if self.resume:
                restore(self, opened.published)
            self._attach_ticker()
            rejudge = self.parts.rejudge
            if self.parts.dist.is_main and rejudge is not None:
                log.info("trainer: exact checks prepared in %.2fs", rejudge.prepare())

    def _attach_ticker(self) -> None:
        """Under `security.committed_draws`, rank 0's beacon (`pnyx.train.ticker`): ticks read back from the
        store (a resumed run), and admission's check of every group and skip record against its tick."""
        parts, sec = self.parts, self.cfg.security
        signer = parts.publishing.publisher.signer
        if not sec.committed_draws or not parts.dist.is_main or signer is None:
            return
        ticker = Ticker(
            self.store, signer, self.run_id, sec.tick_interval_s, lambda: self.version,
            self.cfg.algorithm.max_staleness,
        )  # fmt: skip
        ticker.standing = sec.standing_groups
        ticker.trusted = frozenset(parts.ingestor.settings.trusted_keys)
        ticker.restore(unswept=parts.ingestor.shared.cursor.swept_below if self.resume else None)
        admission = parts.ingestor.admission
        admission.check_draws = ticker.policy(admission.check_draws)
        parts.ingestor.skips.check_draws = admission.check_draws
        shared = parts.ingestor.shared  # its cursor is replaced whole on resume: read it at each call
        parts.ingestor.planner.held = lambda g: ticker.held(g, shared.cursor.seqs.get(g.group.worker_id))
        parts.ingestor.listing.excused = ticker.excused  # a restarted worker's undrawn cohort: no gap
        parts.ingestor.listing.probation = lambda worker, seq: (
            (fp := shared.cursor.keys.get(worker)) is not None and ticker.on_probation(worker, fp, seq)
        )  # standing's groups expire as `probation`, not `stale`
        parts.ticker = ticker

    def load(self, run: RunManifest) -> None:
        """Load the parts for the existing `run` without joining it or restoring a checkpoint: the weights
        are the base model's. For replaying recorded steps by hand (the distributed replay tests)."""
        self._parts = load_parts(self.cfg, self.store, self.steps, run)
        self.cfg, self.manifest, self.trust = self._parts.cfg, run, attach_run(self._parts, run)

    def publish(self, version: int, force_anchor: bool = False) -> WeightManifest:
        """Publish the current weights as `version` (every rank takes part; rank 0 commits)."""
        return self.parts.publishing.publish(version, force_anchor)

    def on_main(self, fn: Callable[[], T]) -> T:
        """`fn()` on rank 0 alone, its result (or error) on every rank."""
        return self.parts.dist.on_main(fn)

    def make_batch(self, rec: checkpoint.BatchRecord, groups: list[ScoredGroup]) -> Batch:
        """Rank 0: what every rank needs for the step of `rec` (its rate, the reference logprobs)."""
        lr = rec.lr if rec.lr is not None else self.cfg.trainer.lr
        ref = self.parts.reference.logprobs(groups) if self.parts.reference is not None else None
        from pnyx.train.microbatch import Row

        checks = self.parts.ingestor.allowances(rec.version - 1)
        probe = [
            Row(p.prompt, p.completion, [0.0] * len(p.completion), p.mask, 0.0, p.sampling)
            for p in self.parts.ingestor.probe()
        ]
        return Batch(list(rec.keys), groups, lr, ref, checks, probe, rec.rounded)

    def _rounded(self) -> str | None:
        """The dtype this trainer's steps round their forward weights to, for the batch record."""
        r = self.parts.rounding
        return None if r is None else str(r).removeprefix("torch.")

    def train_batch(self, batch: Batch) -> StepStats:
        """One `train_step` on `batch`; the drift probe's forward after it is kept for the next step, which
        then does not forward the same rows at the same weights again (the planner keeps a probe's rows for
        `calibration.PROBE_STEPS` steps)."""
        rows = tuple(
            (tuple(r.prompt), tuple(r.completion), tuple(r.loss_mask), r.sampling) for r in batch.probe or ()
        )
        kept = self._probe_after
        before = kept[2] if kept is not None and rows and kept[:2] == (self.version, rows) else None
        stats = self._train_step(batch, before)
        after = stats.probe_after
        self._probe_after = (self.version + 1, rows, after) if after is not None else None
        stats.probe_after = None  # held here, not carried with the step's results
        return stats

    def _train_step(self, batch: Batch, probe_before: MicroBatch | None) -> StepStats:
        return train_step(
            self.parts.model,
            self.parts.optimizer,
            batch.groups,
            loss_settings(self.cfg),
            micro_batch_tokens=self.cfg.trainer.micro_batch_tokens,
            grad_clip=self.cfg.trainer.grad_clip,
            max_len=self.cfg.worker.max_new_tokens,
            ref_logprobs=batch.ref,
            policy_version=self.version,
            lr=batch.lr,
            dist=self.parts.dist,
            compute_dtype=self.parts.compute_dtype,
            checks=batch.checks if batch.checks is not None else check_settings(self.cfg),
            probe=batch.probe,
            probe_before=probe_before,
            rejudge=self.parts.rejudge if self.cfg.security.rejudge else None,
            exact_draws=self.parts.rejudge.draws
            if self.parts.rejudge and self.cfg.security.seeded_draws
            else None,
            forward_dtype=getattr(torch, batch.rounded) if batch.rounded else None,
        )

    def _wait_for_batch(self) -> list[ScoredGroup] | None:
        """The top `groups_per_step` groups of the ranking (None: stop requested, or no full batch for
        `trainer.max_wait_s`); see `Prefetcher.next_batch`. Skip records are checked while it waits and
        before the batch is taken, and stale rows measured while it waits (`wait_work.WaitWork`)."""
        self.progress.phase("ingesting", have=0)
        chosen = self.waiting.choosing(
            lambda: self.parts.prefetcher.next_batch(
                self.version,
                self.cfg.trainer.groups_per_step,
                stop=lambda: self._stop,
                deadline_s=self.cfg.trainer.max_wait_s,
                on_short=lambda have: self.progress.phase("waiting", have=have),
                idle=lambda chosen: self.waiting.idle(self.version, chosen),
                ready=lambda: self.waiting.ready(self.version),
            )
        )
        if chosen is None and not self._stop:
            log.warning(
                "trainer v=%d no full batch for %.0fs: stopping", self.version, self.cfg.trainer.max_wait_s
            )
        return chosen

    def load_recorded(self, rec: checkpoint.BatchRecord) -> list[ScoredGroup]:
        """The groups a batch record names, validated and re-scored again (they are immutable)."""
        try:
            return self.parts.ingestor.load_many(rec.keys)
        except (RecordRejected, NotFoundError) as e:
            raise IntegrityError(
                f"{checkpoint.batch_key(rec.version)} names a group that is missing or no longer validates ({e}); "
                "the run's rollouts were modified"
            ) from e

    def _sleep(self, seconds: float) -> None:
        """Sleep in short slices so a stop request is noticed within 0.1 s."""
        end = time.monotonic() + seconds
        while not self._stop and (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 0.1))

    def step(self) -> StepResult | None:
        """One step V → V+1 (None if stopped while waiting for data). Every rank calls it together."""
        target = self.version + 1
        self.waiting.new_step()
        batch = self.on_main(lambda: self._choose_batch(target))
        if batch is None:
            return None
        self.progress.phase("training", have=len(batch.groups))
        stats = self.waiting.reading(lambda: self.train_batch(batch))
        hooks.point("after_step", target)
        self.progress.phase("publishing")
        t0 = time.perf_counter()
        m = self.publish(target)
        publish_s = time.perf_counter() - t0
        if self.parts.dist.is_main:
            self.parts.digests.note(target, m)
            self.parts.ingestor.note_published(target)
            self.parts.ingestor.commit(
                batch.keys, batch.groups, stats.rejected, stats.verdict_evidence, batch.checks, stats.drift,
                self.version,
            )  # fmt: skip
            self.parts.prefetcher.ahead(target)
        self.version = target
        hooks.point("after_publish", target)
        return StepResult(target, stats, batch.groups, publish_s, m.kind, batch.lr, batch.checks)

    def _choose_batch(self, target: int) -> Batch | None:
        """Rank 0: the batch of the step producing `target`: its record if one exists, else a new one."""
        rec = checkpoint.read_batch_record(self.store, target) if self._check_pending else None
        # Later records can only come from a rival trainer, which the create-only write below detects.
        self._check_pending = False
        if rec is None:
            t0 = time.perf_counter()
            chosen = self._wait_for_batch()
            if chosen is None:
                return None
            self._ingest_wait_s = time.perf_counter() - t0
            rec = checkpoint.write_batch_record(
                self.store, target, [g.key for g in chosen], self.trainer_id, self.parts.schedule.at(target),
                self._rounded(),
            )  # fmt: skip
            by_key = {g.key: g for g in chosen}
            groups = (
                [by_key[k] for k in rec.keys] if set(rec.keys) == set(by_key) else self.load_recorded(rec)
            )
        else:
            log.info(
                "trainer v=%d: reusing the recorded batch of v%d (%d groups)",
                self.version,
                target,
                len(rec.keys),
            )
            self.progress.phase("ingesting", have=0)
            groups = self.load_recorded(rec)
            self.waiting.audit_skip_draws(self.version)  # the recorded batch stands whatever it finds
            self._ingest_wait_s = 0.0
        self.parts.prefetcher.ahead(target, rec.keys)  # the next step's groups, fetched while this one runs
        return self.make_batch(rec, groups)

    def checkpoint(self) -> None:
        """Start a sharded checkpoint of the current version (every rank together); it uploads and commits
        in the background. Then weights retention (rank 0)."""
        if self.last_checkpoint == self.version:
            return  # (v0 too is checkpointed once stopped: its cursor holds what ingestion already judged)
        cursor = self.parts.ingestor.cursor_json().decode()
        blocked = self.parts.checkpointer.save(
            self.version, self.parts.model, self.parts.optimizer, cursor, self.run_id
        )
        self.last_checkpoint = self.version
        if not self.parts.dist.is_main:
            return
        mode = "async: shards upload in the background" if self.cfg.trainer.async_checkpoint else "sync"
        log.info("trainer checkpoint v=%d started: the loop waited %.2fs (%s)", self.version, blocked, mode)
        # Weights retention: keep the newest anchors, and every version a group in the staleness window
        # may name (its manifest holds the digest ingestion checks).
        from pnyx.weights import apply_retention

        apply_retention(
            self.store,
            self.cfg.trainer.keep_anchors,
            window=self.cfg.algorithm.max_staleness + 1,
            trust=self.trust,
        )

    def metrics(self, r: StepResult) -> dict[str, Any]:
        """The step's metrics record (`step_metrics`), with what this trainer knows beside the step."""
        return step_metrics(
            r, self.parts.ingestor, version=self.version, world=self.parts.dist.world,
            max_staleness=self.cfg.algorithm.max_staleness, ingest_wait_s=self._ingest_wait_s,
            prefetch_busy_s=self.parts.prefetcher.busy_s, skip_audit=self.waiting.skip_audit,
            precheck=self.waiting.precheck, checks_background=self.waiting.background,
        )  # fmt: skip

    def _describe(self) -> dict[str, Any]:
        """What the progress line and `trainer/status.json` report (callable from the progress thread)."""
        d: dict[str, Any] = {"version": self.version, "need": self.cfg.trainer.groups_per_step, "have": 0}
        if self._parts is not None:
            ingestor = self._parts.ingestor
            d["backlog"] = ingestor.backlog(self.version)
            d["zero_variance"] = ingestor.zero_variance()
            d.update(ingestor.stats())
            d.pop("scored", None)
            d["keys"] = ingestor.key_report(limit=STATUS_KEYS)
            if self._parts.ticker is not None:  # committed draws: ticks written, commitments judged
                d["ticks"] = dict(self._parts.ticker.counts)
        return d

    # --- the loop ------------------------------------------------------------------------------------

    def request_stop(self, *_: object) -> None:
        """Stop soon (installed for SIGINT/SIGTERM): a wait or a fetch ends within 0.1 s; a step under way
        finishes and publishes; then the trainer checkpoints and returns. Only sets a flag."""
        self._stop = True

    def run(self, sinks: list[Any] | None = None) -> int:
        """Step until `steps` versions exist, a stop is requested, or data stops arriving. Returns V."""
        sinks = sinks or []
        if self.parts.dist.is_main:  # ingestion runs on rank 0 only; the others receive each batch
            self.parts.prefetcher.ahead(self.version)
            self.parts.prefetcher.start()
            if self.parts.ticker is not None:
                self.parts.ticker.start()
            self.waiting.start(lambda: self.version, lambda: self.parts.prefetcher.planned)
        with self.progress.running(status=self.parts.dist.is_main):
            self._loop(sinks)
        return self.version

    def _loop(self, sinks: list[Any]) -> None:
        try:
            # Rank 0 decides whether to go on (its stop flag, its budget); the others follow its word.
            while self.parts.dist.broadcast(self.version < self.steps and not self._stop):
                r = self.step()
                if r is None:
                    break
                if self.parts.dist.is_main:
                    # supply control, first thing after a publish: tell workers what the next step can use,
                    # counted from what the prefetcher already listed and fetched (no store I/O: a LIST and
                    # GET of the whole backlog here made every step's cost follow the backlog)
                    self.parts.supply.after_publish(
                        r.version,
                        waiting=self.parts.ingestor.waiting(r.version),
                        steps_left=self.steps - r.version,
                    )
                    if self.parts.ticker is not None:
                        self.parts.ticker.poke()
                    m = self.metrics(r)
                    checkpoint.write_metrics(self.store, r.version, m)
                    for sink in sinks:
                        sink.write(m)
                    log.info(format_line(m))
                    self.progress.noted()
                    zv = m["zero_variance"]
                    self.progress.warn_zero_variance(zv["frac"], zv["kind"])
                if r.version % self.cfg.trainer.checkpoint_every == 0:
                    self.progress.phase("checkpointing")
                    self.checkpoint()
        finally:
            for sink in sinks:
                sink.close()
            if self.parts.ticker is not None:
                self.parts.ticker.close()
            self.waiting.close()
            self.parts.prefetcher.close()
            self.parts.ingestor.close()
        if self._stop:
            log.info("trainer v=%d: stop requested; checkpointing", self.version)
        self.progress.phase("checkpointing")
        self.checkpoint()
        self.parts.checkpointer.wait()
        if self.parts.reference is not None:
            self.parts.reference.close()
        self.progress.phase("stopped")
