"""The trainer loop: bootstrap or resume a run, then ingest → step → publish → checkpoint, until a budget.

Per step at version V (DESIGN.md §5, docs/trainer.md):
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

Test hooks: `PNYX_TEST_CRASH_AT=<point>:N[@R]` SIGKILLs this process (only rank R when given) at a named
point of the step that produces version N: `after_step` (optimizer step done), `before_manifest` (payload
uploaded, manifest not written), `after_publish` (published, before metrics and checkpoint) or
`during_checkpoint` (this rank's checkpoint shards uploaded, not committed). `PNYX_TEST_INGEST_DELAY_S=x`
makes every group fetch sleep x seconds first (the liveness tests use it to hold the trainer in
ingestion). Used by tests only. Knows nothing about generation internals.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from pnyx.config import PnyxConfig, overlay_changed, resolve_model_source
from pnyx.errors import ConfigError, FencedError, IntegrityError, NotFoundError, PnyxError, RecordRejected
from pnyx.security.trust import check_trainer_key, run_verifier, trainer_key_record, trainer_signer
from pnyx.store import Store
from pnyx.train import bootstrap, checkpoint, checkpointer
from pnyx.train.ingest import Ingestor, ScoredGroup
from pnyx.train.prefetch import Prefetcher
from pnyx.train.progress import Progress, format_line, reward_parts
from pnyx.train.settings import check_settings, ingest_settings, loss_settings
from pnyx.train.step import StepStats, make_optimizer, train_step
from pnyx.train.supply import DemandPublisher

log = logging.getLogger("pnyx.train")

CRASH_ENV = "PNYX_TEST_CRASH_AT"
INGEST_DELAY_ENV = "PNYX_TEST_INGEST_DELAY_S"
STATUS_KEYS = 32
"""`trainer/status.json` reports at most this many worker keys (quarantined first, then by faults)."""


def _crash_point(name: str, version: int) -> None:
    """The kill-test hook (see module docstring): SIGKILL ourselves at a named point."""
    want = os.environ.get(CRASH_ENV)
    if want is None:
        return
    point, _, rank = want.partition("@")
    if point == f"{name}:{version}" and (not rank or rank == os.environ.get("RANK", "0")):
        log.warning("test hook %s=%s: SIGKILL", CRASH_ENV, want)
        os.kill(os.getpid(), signal.SIGKILL)


def published_digests(store: Store, version: int, trust: Any = None) -> frozenset[str] | None:
    """Chain digests a group of `version` may carry, one per plane (a worker on the int8 actor plane stamps
    its groups with that plane's digest); None if the version is not published (with `trust`: by the
    run's key)."""
    from pnyx.weights.manifest import read_manifest

    try:
        m = read_manifest(store, version, trust)
    except NotFoundError:
        return None
    return manifest_digests(m)


def manifest_digests(m: Any) -> frozenset[str]:
    """The chain digests of a weight manifest's planes."""
    planes = [m.weights] + ([m.int8] if m.int8 is not None else [])
    return frozenset(p.chain_digest for p in planes)


def _slow_decode(delay_s: float) -> Any:
    """The decoder behind `PNYX_TEST_INGEST_DELAY_S`: sleep, then decode as usual."""
    from pnyx.protocol.codec import decode_group

    def decode(data: bytes, vocab_size: int | None) -> Any:
        time.sleep(delay_s)
        return decode_group(data, vocab_size=vocab_size)

    return decode


def merge_resume_config(run_config: dict[str, Any], given: PnyxConfig) -> PnyxConfig:
    """On resume the run's config is the base; every field the caller gave wins (even one set back to its
    default)."""
    return overlay_changed(run_config, given)


@dataclass
class StepResult:
    version: int
    stats: StepStats
    groups: list[ScoredGroup]
    publish_s: float
    publish_kind: str
    lr: float = 0.0


@dataclass
class Batch:
    """What rank 0 sends every rank for one step: the groups, their reference logprobs, the rate."""

    keys: list[str]
    groups: list[ScoredGroup]
    lr: float
    ref: dict[tuple[str, int], list[float]] | None = None


class Trainer:
    """One run's trainer process. `start()` bootstraps or resumes; `run()` steps until a stop condition."""

    def __init__(self, cfg: PnyxConfig, store: Store, *, resume: bool = False, steps: int | None = None):
        self.cfg = cfg
        self.store = store
        self.resume = resume
        self._steps_override = steps
        self.steps = steps if steps is not None else cfg.run.steps
        self.version = 0
        self.last_checkpoint: int | None = None
        self._stop = False  # set by the signal handler: a plain flag, no locks inside a handler
        self.trainer_id = f"trainer-{os.getpid()}"
        self.ingestor: Ingestor | None = None
        self._check_pending = True  # read a pending batch record before the first step of this process
        self._ingest_wait_s = 0.0
        self.progress = Progress(store, self._describe)
        self.reference: Any = None
        self.trust: Any = None
        """The verifier of the run's trainer key (from run.json), once the run is created or joined."""

    # --- setup ---------------------------------------------------------------------------------------

    def _load(self, run: Any = None) -> None:
        """Load model, tokenizer, env, optimizer; resuming `run` (its RunManifest), its recorded model."""
        from pnyx.config import resolve_device, resolve_env_kwargs, resolve_max_new_tokens
        from pnyx.envs import get_env
        from pnyx.models import load_model, load_tokenizer, render_prompt, resolve_run_model, tokenizer_digest
        from pnyx.train.distributed import init_distributed, prepare_model, resolve_compute_dtype
        from pnyx.train.reference import Reference
        from pnyx.train.schedule import Schedule
        from pnyx.weights.publisher import Publisher

        cfg, t = self.cfg, self.cfg.trainer
        torch.manual_seed(cfg.run.seed)  # nothing in a step samples today; keeps any future use seeded
        if run is not None:  # resuming: exactly the run's recorded model (a hub id pinned to its commit)
            source = resolve_run_model(run.model, cfg.model.path, cfg.model.revision)
        else:
            source = resolve_model_source(cfg)
        model_dir = source.folder
        self.dist = init_distributed(resolve_device(t.device), wait_s=t.max_wait_s)
        self.device = self.dist.device
        self.compute_dtype = resolve_compute_dtype(t.compute_dtype, self.device)
        model = load_model(model_dir, dtype="float32", device=self.device)
        self.model = prepare_model(model, self.dist, self.compute_dtype, t.activation_checkpointing)
        self.tokenizer = load_tokenizer(model_dir)
        self.env = get_env(cfg.env.name, **resolve_env_kwargs(cfg))
        # The generation budget is run-defining: run.json records the resolved number (None = the env's),
        # and workers and the Dr.GRPO normaliser read that one number.
        cfg.worker.max_new_tokens = resolve_max_new_tokens(cfg.worker.max_new_tokens, self.env)
        if cfg.algorithm.kl_coef > 0 and self.dist.is_main:
            self.reference = Reference(model_dir, t.reference_device or self.device, self.compute_dtype)
        self.optimizer = make_optimizer(self.model, t.lr, t.betas, t.weight_decay)
        self.schedule = Schedule(t.lr, t.lr_schedule, t.warmup_steps, self.steps, t.min_lr_ratio)
        self.publisher = Publisher(
            self.store, anchor_every=t.anchor_every, int8_plane=cfg.worker.int8,
            chunk_bytes=t.publish_chunk_bytes, comm=self.dist, hook=_crash_point,
        )  # fmt: skip
        self.checkpointer = checkpointer.Checkpointer(
            self.store, self.dist, checkpointer.local_folder(t.checkpoint_dir, self.store.url), t.keep_checkpoints,
            t.async_checkpoint, hook=_crash_point,
        )  # fmt: skip
        self.supply = DemandPublisher(self.store, t.groups_per_step, cfg.algorithm.max_staleness)
        vocab = int(self.model.config.vocab_size)
        self.model_info = {
            "name": source.name,
            "path": str(model_dir),
            "source": source.identity(),
            "model_type": getattr(self.model.config, "model_type", None),
            "vocab_size": vocab,
            "tokenizer_digest": tokenizer_digest(model_dir),
            "num_parameters": sum(p.numel() for p in self.model.parameters()),
            "publish_dtype": cfg.trainer.publish_dtype,
            "hf_config": self.model.config.to_dict(),
        }
        tok = self.tokenizer
        self._digests: dict[int, frozenset[str]] = {}
        self.ingestor = Ingestor(
            store=self.store,
            env=self.env,
            detokenize=lambda ids: tok.decode(ids, skip_special_tokens=True),
            settings=ingest_settings(cfg),
            vocab_size=vocab,
            render=lambda prompt: render_prompt(tok, prompt),
            expected_digest=self._published_digest,
            require_signatures=True,  # every group signed by its worker's key (docs/security.md)
        )
        if os.environ.get(INGEST_DELAY_ENV):
            self.ingestor.decode = _slow_decode(float(os.environ[INGEST_DELAY_ENV]))
        self.prefetcher = Prefetcher(self.ingestor, cfg.trainer.groups_per_step)

    def _published_digest(self, version: int) -> frozenset[str] | None:
        """`published_digests` of `version`, cached once known."""
        if version not in self._digests:
            digests = published_digests(self.store, version, self.trust)
            if digests is None:
                return None
            self._digests[version] = digests
        return self._digests[version]

    def publish_layout(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        from pnyx.train.distributed import state_layout

        return state_layout(self.model, getattr(torch, self.cfg.trainer.publish_dtype))

    def publish_tensors(self) -> dict[str, torch.Tensor]:
        """The published cast of the tensors this rank publishes (all of them in one process); on CPU."""
        from pnyx.train.distributed import gather_published

        keep = self.publisher.needs(self.publish_layout())
        return gather_published(self.model, getattr(torch, self.cfg.trainer.publish_dtype), keep)

    def _publish(self, version: int, force_anchor: bool = False) -> Any:
        """Publish the current weights as `version` (every rank takes part; rank 0 commits)."""
        return self.publisher.publish(version, self.publish_tensors(), force_anchor, self.publish_layout())

    def _on_main(self, fn: Any) -> Any:
        """Run `fn()` on rank 0 only and hand its result (or its error) to every rank."""
        out: tuple[str, Any] = ("ok", None)
        if self.dist.is_main:
            try:
                out = ("ok", fn())
            except PnyxError as e:  # the same error on every rank, so every rank exits the same way
                out = ("error", e)
        out = self.dist.broadcast(out)
        if out[0] == "error":
            raise out[1]
        return out[1]

    def start(self) -> None:
        """Load the model and either create the run (publish v0) or resume it from the store."""
        self.progress.phase("loading")
        with self.progress.running(status=False):
            self._start()

    def _start(self) -> None:
        from pnyx.weights.manifest import latest_version

        existing = bootstrap.read_run(self.store)
        if self.resume:
            if existing is None:
                raise ConfigError(
                    f"nothing to resume at {self.store.url}: it has no run.json. Start without --resume."
                )
            self.cfg = merge_resume_config(existing.config, self.cfg)
            self.steps = self._steps_override if self._steps_override is not None else self.cfg.run.steps
        self._load(existing if self.resume else None)
        config_json = self.cfg.model_dump(mode="json")
        config_json["store"]["url"] = None  # where the run lives is not part of what it is
        signer = trainer_signer() if self.dist.is_main else None  # rank 0 alone signs (and holds the key)
        if existing is not None:
            bootstrap.check_compatible(existing, config_json, self.model_info, self.store.url)
            self.manifest = existing
        else:
            self.manifest = self._on_main(
                lambda: bootstrap.init_run(
                    self.store,
                    config_json,
                    self.model_info,
                    trainer_key_record(signer) if signer is not None else None,
                )
            )
        if signer is not None:
            check_trainer_key(self.manifest, signer, self.store.url)
            self.publisher.signer = signer.for_run(self.manifest.run_id)
            log.info("trainer: weights signed by key %s", signer.fingerprint)
        self.trust = run_verifier(self.manifest)
        self._ingest.run_id = self.manifest.run_id
        if not self.resume:
            try:
                self._publish(0, force_anchor=True)
            except FencedError:
                raise FencedError(
                    f"the run at {self.store.url} already has published weights: another trainer owns it. "
                    "Resume it with --resume (if its trainer is dead) or use another --store."
                ) from None
            self.version = 0
            log.info(
                "trainer run=%s created: v0 published (%s)", self.manifest.run_id, self.model_info["name"]
            )
            return
        self._restore(
            self.dist.broadcast(latest_version(self.store, self.trust) if self.dist.is_main else None)
        )

    def _restore(self, published: int | None) -> None:
        """Load the newest checkpoint and roll forward through every version published after it."""
        from pnyx.train.resume import restore

        restore(self, published)

    def _batch(self, rec: checkpoint.BatchRecord, groups: list[ScoredGroup]) -> Batch:
        """Rank 0: what every rank needs for the step of `rec` (its rate, the reference logprobs)."""
        lr = rec.lr if rec.lr is not None else self.cfg.trainer.lr
        ref = self.reference.logprobs(groups) if self.reference is not None else None
        return Batch(list(rec.keys), groups, lr, ref)

    # --- one step ------------------------------------------------------------------------------------

    def _train(self, batch: Batch) -> StepStats:
        return train_step(
            self.model,
            self.optimizer,
            batch.groups,
            loss_settings(self.cfg),
            micro_batch_tokens=self.cfg.trainer.micro_batch_tokens,
            grad_clip=self.cfg.trainer.grad_clip,
            max_len=self.cfg.worker.max_new_tokens,
            ref_logprobs=batch.ref,
            policy_version=self.version,
            lr=batch.lr,
            dist=self.dist,
            compute_dtype=self.compute_dtype,
            checks=check_settings(self.cfg),
        )

    def _wait_for_batch(self) -> list[ScoredGroup] | None:
        """The top `groups_per_step` groups of the ranking (None: stop requested, or no full batch for
        `trainer.max_wait_s`); see `Prefetcher.next_batch`."""
        self.progress.phase("ingesting", have=0)
        chosen = self.prefetcher.next_batch(
            self.version,
            self.cfg.trainer.groups_per_step,
            stop=lambda: self._stop,
            deadline_s=self.cfg.trainer.max_wait_s,
            on_short=lambda have: self.progress.phase("waiting", have=have),
        )
        if chosen is None and not self._stop:
            log.warning(
                "trainer v=%d no full batch for %.0fs: stopping", self.version, self.cfg.trainer.max_wait_s
            )
        return chosen

    def _load_recorded(self, rec: checkpoint.BatchRecord) -> list[ScoredGroup]:
        """The groups a batch record names, validated and re-scored again (they are immutable)."""
        try:
            return self._ingest.load_many(rec.keys)
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
        batch = self._on_main(lambda: self._choose_batch(target))
        if batch is None:
            return None
        self.progress.phase("training", have=len(batch.groups))
        stats = self._train(batch)
        _crash_point("after_step", target)
        self.progress.phase("publishing")
        t0 = time.perf_counter()
        m = self._publish(target)
        publish_s = time.perf_counter() - t0
        if self.dist.is_main:
            self._digests[target] = manifest_digests(m)
            self._ingest.note_published(target)
            self._ingest.commit(batch.keys, batch.groups, stats.rejected, stats.evidence)
            self.prefetcher.ahead(target)
        self.version = target
        _crash_point("after_publish", target)
        return StepResult(target, stats, batch.groups, publish_s, m.kind, batch.lr)

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
                self.store, target, [g.key for g in chosen], self.trainer_id, self.schedule.at(target)
            )
            by_key = {g.key: g for g in chosen}
            groups = (
                [by_key[k] for k in rec.keys] if set(rec.keys) == set(by_key) else self._load_recorded(rec)
            )
        else:
            log.info(
                "trainer v=%d: reusing the recorded batch of v%d (%d groups)",
                self.version,
                target,
                len(rec.keys),
            )
            self.progress.phase("ingesting", have=0)
            groups = self._load_recorded(rec)
            self._ingest_wait_s = 0.0
        self.prefetcher.ahead(target, rec.keys)  # the next step's groups, fetched while this one runs
        return self._batch(rec, groups)

    def checkpoint(self) -> None:
        """Start a sharded checkpoint of the current version (every rank together); it uploads and commits
        in the background. Then weights retention (rank 0)."""
        if self.last_checkpoint == self.version:
            return  # (v0 too is checkpointed once stopped: its cursor holds what ingestion already judged)
        cursor = self._ingest.cursor_json().decode()
        blocked = self.checkpointer.save(
            self.version, self.model, self.optimizer, cursor, self.manifest.run_id
        )
        self.last_checkpoint = self.version
        if not self.dist.is_main:
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
        s = r.stats
        stale = Counter(r.version - 1 - g.version for g in r.groups)
        rewards = [x for g in r.groups for x in g.rewards]
        claimed = [x for g in r.groups for x in g.worker_rewards]
        n_stale = sum(stale.values())
        return {
            "version": r.version,
            "time": time.time(),
            "groups": len(r.groups),
            "samples": len(rewards),
            "reward": sum(rewards) / len(rewards),
            "worker_reward": sum(claimed) / len(claimed),
            "staleness": {str(k): v for k, v in sorted(stale.items())},
            "stale_mean": sum(k * v for k, v in stale.items()) / n_stale,
            "loss": s.loss,
            "masked_frac": s.masked_frac,
            "clip_frac": s.clip_frac,
            "iw_mean": s.iw_mean,
            "iw_min": s.iw_min,
            "iw_max": s.iw_max,
            "ess": s.ess,
            "entropy": s.entropy,
            "kl": s.kl,
            "grad_norm": s.grad_norm,
            "tokens": s.tokens,
            "tok_s": s.tokens_per_s,
            "step_s": s.seconds,
            "publish_s": r.publish_s,
            "publish_kind": r.publish_kind,
            "lr": r.lr,
            "ranks": self.dist.world,
            "micro_batches": s.micro_batches,
            "lp_gap": s.lp_gap,
            "reward_parts": reward_parts(r.groups),
            "backlog": self._ingest.backlog(self.version),
            "zero_variance": self._ingest.zero_variance(),
            "ingest_wait_s": self._ingest_wait_s,
            "prefetch_busy_s": round(self.prefetcher.busy_s, 3),
            "lp_gap_engine": s.lp_gap_engine,
            "rejected": dict(Counter(s.rejected.values())),
            "undo_s": round(s.undo_s, 4),
            **self._ingest.stats(),
        }

    @property
    def _ingest(self) -> Ingestor:
        """The ingestor, which exists from `start()` on."""
        if self.ingestor is None:
            raise RuntimeError("the trainer has no ingestor before start()")
        return self.ingestor

    def _describe(self) -> dict[str, Any]:
        """What the progress line and `trainer/status.json` report (callable from the progress thread)."""
        d: dict[str, Any] = {"version": self.version, "need": self.cfg.trainer.groups_per_step, "have": 0}
        ingestor = self.ingestor
        if ingestor is not None:
            d["backlog"] = ingestor.backlog(self.version)
            d["zero_variance"] = ingestor.zero_variance()
            d.update(ingestor.stats())
            d.pop("scored", None)
            d["keys"] = ingestor.key_report(limit=STATUS_KEYS)
        return d

    # --- the loop ------------------------------------------------------------------------------------

    def request_stop(self, *_: Any) -> None:
        """Stop soon (installed for SIGINT/SIGTERM): a wait or a fetch ends within 0.1 s; a step under way
        finishes and publishes; then the trainer checkpoints and returns. Only sets a flag."""
        self._stop = True

    def run(self, sinks: list[Any] | None = None) -> int:
        """Step until `steps` versions exist, a stop is requested, or data stops arriving. Returns V."""
        sinks = sinks or []
        if self.dist.is_main:  # ingestion runs on rank 0 only; the others receive each batch
            self.prefetcher.ahead(self.version)
            self.prefetcher.start()
        with self.progress.running(status=self.dist.is_main):
            self._loop(sinks)
        return self.version

    def _loop(self, sinks: list[Any]) -> None:
        try:
            # Rank 0 decides whether to go on (its stop flag, its budget); the others follow its word.
            while self.dist.broadcast(self.version < self.steps and not self._stop):
                r = self.step()
                if r is None:
                    break
                if self.dist.is_main:
                    # supply control, first thing after a publish: tell workers what the next step can use
                    self.supply.after_publish(r.version, waiting=self._ingest.poll(r.version))
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
            self.prefetcher.close()
            self._ingest.close()
        if self._stop:
            log.info("trainer v=%d: stop requested; checkpointing", self.version)
        self.progress.phase("checkpointing")
        self.checkpoint()
        self.checkpointer.wait()
        if self.reference is not None:
            self.reference.close()
        self.progress.phase("stopped")
