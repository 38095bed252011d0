"""The trainer loop: bootstrap or resume a run, then ingest → step → publish → checkpoint, until a budget.

Per step at version V (DESIGN.md §5, docs/trainer.md):
1. the batch of step V→V+1 is `trainer/batch-{V+1}` if that record exists (a step that was started
   before a crash, or by another trainer), else the ingestor selects one and records it create-only;
2. `train_step` (fp32 master, micro-batched, AdamW, clip);
3. publish V+1 (bf16 by default) through the PULSE publisher — the fence: FencedError if another trainer
   owns the run;
4. commit the batch to the ingestion cursor; write metrics; checkpoint every `checkpoint_every` steps.

On resume, the newest checkpoint C is loaded and every published version in (C, P] is replayed from its
batch record, so the in-memory state (weights, optimizer, cursor) is exactly the state that produced P;
a replay whose bits differ from the published P (non-deterministic kernels) adopts the published bits.

Test hook: `PNYX_TEST_CRASH_AT=after_step:N` or `after_publish:N` SIGKILLs this process right after the
optimizer step that produces version N, or right after publishing N (before its checkpoint). Used by the
kill tests only. Knows nothing about generation internals.
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

from pnyx.config import PnyxConfig, overlay_changed, resolve_model_path
from pnyx.errors import ConfigError, FencedError, IntegrityError, NotFoundError, RecordRejected
from pnyx.train import bootstrap, checkpoint
from pnyx.train.ingest import Cursor, Ingestor, IngestSettings, ScoredGroup
from pnyx.train.losses import LossSettings
from pnyx.train.step import StepStats, make_optimizer, train_step
from pnyx.train.supply import DemandPublisher

log = logging.getLogger("pnyx.train")

CRASH_ENV = "PNYX_TEST_CRASH_AT"
KEEP_CHECKPOINTS = 2


def _crash_point(name: str, version: int) -> None:
    """The kill-test hook (see module docstring): SIGKILL ourselves at a named point."""
    if os.environ.get(CRASH_ENV) == f"{name}:{version}":
        log.warning("test hook %s=%s: SIGKILL", CRASH_ENV, os.environ[CRASH_ENV])
        os.kill(os.getpid(), signal.SIGKILL)


def loss_settings(cfg: PnyxConfig) -> LossSettings:
    a = cfg.algorithm
    return LossSettings(
        clip_eps_low=a.clip_low,
        clip_eps_high=a.clip_high,
        dual_clip=a.dual_clip,
        tis_cap=a.tis_cap,
        dppo_delta=a.dppo_delta,
        aggregation=a.aggregation,
        kl_coef=a.kl_coef,
    )


def ingest_settings(cfg: PnyxConfig) -> IngestSettings:
    a = cfg.algorithm
    return IngestSettings(
        max_staleness=a.max_staleness,
        max_reuse=a.max_reuse,
        max_groups_per_prompt=a.max_groups_per_prompt,
        advantage=a.advantage,
    )


def published_digests(store: Any, version: int) -> frozenset[str] | None:
    """Chain digests a group of `version` may carry, one per plane (a worker on the int8 actor plane stamps
    its groups with that plane's digest); None if the version is not published."""
    from pnyx.weights.manifest import read_manifest

    try:
        m = read_manifest(store, version)
    except NotFoundError:
        return None
    planes = [m.weights] + ([m.int8] if m.int8 is not None else [])
    return frozenset(p.chain_digest for p in planes)


def merge_resume_config(run_config: dict[str, Any], given: PnyxConfig) -> PnyxConfig:
    """On resume the run's config is the base; fields the caller set away from their defaults win."""
    return overlay_changed(run_config, given)


@dataclass
class StepResult:
    version: int
    stats: StepStats
    groups: list[ScoredGroup]
    publish_s: float
    publish_kind: str


class Trainer:
    """One run's trainer process. `start()` bootstraps or resumes; `run()` steps until a stop condition."""

    def __init__(self, cfg: PnyxConfig, store: Any, *, resume: bool = False, steps: int | None = None):
        self.cfg = cfg
        self.store = store
        self.resume = resume
        self._steps_override = steps
        self.steps = steps if steps is not None else cfg.run.steps
        self.version = 0
        self.last_checkpoint: int | None = None
        self._stop = False  # set by the signal handler: a plain flag, no locks inside a handler
        self.trainer_id = f"trainer-{os.getpid()}"

    # --- setup ---------------------------------------------------------------------------------------

    def _load(self) -> None:
        from pnyx.config import resolve_device
        from pnyx.envs import get_env
        from pnyx.models import load_model, load_tokenizer, render_prompt, tokenizer_digest
        from pnyx.weights.publisher import Publisher

        cfg = self.cfg
        torch.manual_seed(cfg.run.seed)  # nothing in a step samples today; keeps any future use seeded
        model_dir = resolve_model_path(cfg)
        self.device = resolve_device(cfg.trainer.device)
        self.model = load_model(model_dir, dtype="float32", device=self.device)
        self.tokenizer = load_tokenizer(model_dir)
        self.env = get_env(cfg.env.name, **cfg.env.kwargs)
        self.ref_model = None
        if cfg.algorithm.kl_coef > 0:
            self.ref_model = load_model(model_dir, dtype="float32", device=self.device)
            self.ref_model.requires_grad_(False)
        self.optimizer = make_optimizer(
            self.model, cfg.trainer.lr, tuple(cfg.trainer.betas), cfg.trainer.weight_decay
        )
        self.publisher = Publisher(self.store, anchor_every=cfg.trainer.anchor_every, int8_plane=cfg.worker.int8)
        self.supply = DemandPublisher(self.store, cfg.trainer.groups_per_step, cfg.algorithm.max_staleness)
        vocab = int(self.model.config.vocab_size)
        self.model_info = {
            "name": model_dir.name,
            "path": str(model_dir),
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
        )

    def _published_digest(self, version: int) -> frozenset[str] | None:
        """`published_digests` of `version`, cached once known."""
        if version not in self._digests:
            digests = published_digests(self.store, version)
            if digests is None:
                return None
            self._digests[version] = digests
        return self._digests[version]

    def publish_tensors(self) -> dict[str, torch.Tensor]:
        dtype = getattr(torch, self.cfg.trainer.publish_dtype)
        return {k: v.detach().to("cpu", dtype) for k, v in self.model.state_dict().items()}

    def start(self) -> None:
        """Load the model and either create the run (publish v0) or resume it from the store."""
        from pnyx.weights.manifest import latest_version

        existing = bootstrap.read_run(self.store)
        if self.resume:
            if existing is None:
                raise ConfigError(
                    f"nothing to resume at {self.store.url}: it has no run.json. Start without --resume."
                )
            self.cfg = merge_resume_config(existing.config, self.cfg)
            self.steps = self._steps_override if self._steps_override is not None else self.cfg.run.steps
        self._load()
        config_json = self.cfg.model_dump(mode="json")
        config_json["store"]["url"] = None  # where the run lives is not part of what it is
        if existing is not None:
            bootstrap.check_compatible(existing, config_json, self.model_info, self.store.url)
            self.manifest = existing
        else:
            self.manifest = bootstrap.init_run(self.store, config_json, self.model_info)
        self.ingestor.run_id = self.manifest.run_id
        if not self.resume:
            try:
                self.publisher.publish(0, self.publish_tensors(), force_anchor=True)
            except FencedError:
                raise FencedError(
                    f"the run at {self.store.url} already has published weights: another trainer owns it. "
                    "Resume it with --resume (if its trainer is dead) or use another --store."
                ) from None
            self.version = 0
            log.info("trainer run=%s created: v0 published (%s)", self.manifest.run_id, self.model_info["name"])
            return
        self._restore(latest_version(self.store))

    def _restore(self, published: int | None) -> None:
        """Load the newest checkpoint and roll forward through every version published after it."""
        from pnyx.weights.manifest import read_manifest

        versions = checkpoint.checkpoint_versions(self.store)
        base = versions[-1] if versions else 0
        if versions:
            state = checkpoint.load_checkpoint(self.store, base)
            owner = state["extra"].get("run_id")
            if owner != self.manifest.run_id:
                raise IntegrityError(
                    f"{checkpoint.ckpt_key(base)} belongs to run {owner!r}, not to this run "
                    f"({self.manifest.run_id!r}): the trainer/ folder was copied from another run"
                )
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            checkpoint.restore_rng(state["rng"])
            self.ingestor.cursor = Cursor.from_json(state["cursor"].encode())
            self.last_checkpoint = base
        if published is None:  # killed before v0 was published: publish it now
            self.publisher.publish(0, self.publish_tensors(), force_anchor=True)
            published = 0
        if published < base:
            raise IntegrityError(
                f"checkpoint v{base} is newer than the newest published weights v{published}: the weights "
                "of this run were deleted or the checkpoint belongs to another run"
            )
        for v in range(base + 1, published + 1):
            rec = checkpoint.read_batch_record(self.store, v)
            if rec is None:
                raise IntegrityError(
                    f"cannot roll forward from checkpoint v{base} to published v{published}: "
                    f"{checkpoint.batch_key(v)} is missing"
                )
            groups = self._load_recorded(rec)
            self.version = v - 1
            stats = self._train(groups)
            self.ingestor.commit(rec.keys)
            kind = read_manifest(self.store, v).kind
            checkpoint.write_metrics(self.store, v, self.metrics(StepResult(v, stats, groups, 0.0, kind)))
            log.info("trainer resume: replayed step to v%d from its batch record (%d groups)", v, len(groups))
        self.version = published
        if published > base:
            self._verify_or_adopt(published)
        log.info("trainer run=%s resumed at v%d (checkpoint v%d)", self.manifest.run_id, published, base)

    def _verify_or_adopt(self, version: int) -> None:
        """After a replay, the cast of our master weights must be the published bits; else adopt those."""
        from pnyx.weights.bits import from_torch, state_digest
        from pnyx.weights.manifest import read_manifest

        want = read_manifest(self.store, version).weights.state_digest
        if state_digest(from_torch(self.publish_tensors())) == want:
            return
        from pnyx.weights import Syncer

        log.warning("trainer resume: replayed v%d differs from the published bits; adopting them", version)
        _, tensors = Syncer(self.store).sync(to_version=version)
        with torch.no_grad():
            for k, p in self.model.state_dict().items():
                p.copy_(tensors[k].to(p.dtype))

    # --- one step ------------------------------------------------------------------------------------

    def _train(self, groups: list[ScoredGroup]) -> StepStats:
        return train_step(
            self.model,
            self.optimizer,
            groups,
            loss_settings(self.cfg),
            micro_batch_tokens=self.cfg.trainer.micro_batch_tokens,
            grad_clip=self.cfg.trainer.grad_clip,
            max_len=self.cfg.worker.max_new_tokens,
            ref_model=self.ref_model,
            policy_version=self.version,
        )

    def _wait_for_batch(self) -> list[ScoredGroup] | None:
        """Poll the window with bounded backoff until a full batch is available (None: stop or timeout)."""
        need = self.cfg.trainer.groups_per_step
        deadline = time.monotonic() + self.cfg.trainer.max_wait_s
        delay, last_note = 0.2, 0.0
        while not self._stop:
            have = self.ingestor.poll(self.version)
            if have >= need:
                return self.ingestor.select(self.version, need)
            now = time.monotonic()
            if now > deadline:
                log.warning("trainer v=%d no usable rollouts for %.0fs: stopping", self.version, self.cfg.trainer.max_wait_s)
                return None
            if now - last_note > 10.0:
                drops = self.ingestor.cursor.drops
                log.info(
                    "trainer v=%d waiting for rollouts: have %d/%d groups drops=%s",
                    self.version, have, need, _fmt_counts(drops),
                )
                last_note = now
            self._sleep(min(delay, max(0.0, deadline - now)))
            delay = min(delay * 1.5, 5.0)
        return None

    def _load_recorded(self, rec: checkpoint.BatchRecord) -> list[ScoredGroup]:
        """The groups a batch record names, validated and re-scored again (they are immutable)."""
        try:
            return [self.ingestor.load(k) for k in rec.keys]
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
        """One step V → V+1 (None if stopped while waiting for data)."""
        target = self.version + 1
        rec = checkpoint.read_batch_record(self.store, target)
        if rec is None:
            chosen = self._wait_for_batch()
            if chosen is None:
                return None
            rec = checkpoint.write_batch_record(self.store, target, [g.key for g in chosen], self.trainer_id)
            by_key = {g.key: g for g in chosen}
            groups = [by_key[k] for k in rec.keys] if set(rec.keys) == set(by_key) else self._load_recorded(rec)
        else:
            log.info("trainer v=%d: reusing the recorded batch of v%d (%d groups)", self.version, target, len(rec.keys))
            groups = self._load_recorded(rec)
        stats = self._train(groups)
        _crash_point("after_step", target)
        t0 = time.perf_counter()
        m = self.publisher.publish(target, self.publish_tensors())
        publish_s = time.perf_counter() - t0
        self.ingestor.commit(rec.keys)
        self.version = target
        _crash_point("after_publish", target)
        return StepResult(target, stats, groups, publish_s, m.kind)

    def checkpoint(self) -> None:
        if self.last_checkpoint == self.version:
            return
        checkpoint.save_checkpoint(
            self.store, self.version, self.model, self.optimizer, self.ingestor.cursor.to_json(),
            {"run_id": self.manifest.run_id},
        )
        self.last_checkpoint = self.version
        checkpoint.prune_checkpoints(self.store, KEEP_CHECKPOINTS)
        # Weights retention: keep the newest anchors, and every version a group in the staleness window
        # may name (its manifest holds the digest ingestion checks).
        from pnyx.weights import apply_retention

        apply_retention(self.store, self.cfg.trainer.keep_anchors, window=self.cfg.algorithm.max_staleness + 1)

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
            "micro_batches": s.micro_batches,
            "lp_gap": s.lp_gap,
            **self.ingestor.stats(),
        }

    # --- the loop ------------------------------------------------------------------------------------

    def request_stop(self, *_: Any) -> None:
        """Finish the current step, publish, checkpoint, return (installed for SIGINT/SIGTERM)."""
        if not self._stop:
            log.info("trainer: stop requested; finishing the current step")
        self._stop = True

    def run(self, sinks: list[Any] | None = None) -> int:
        """Step until `steps` versions exist, a stop is requested, or data stops arriving. Returns V."""
        sinks = sinks or []
        try:
            while self.version < self.steps and not self._stop:
                r = self.step()
                if r is None:
                    break
                # supply control, first thing after a publish: tell workers what the next step can use
                self.supply.after_publish(r.version, waiting=self.ingestor.poll(r.version))
                m = self.metrics(r)
                checkpoint.write_metrics(self.store, r.version, m)
                for sink in sinks:
                    sink.write(m)
                log.info(format_line(m))
                if r.version % self.cfg.trainer.checkpoint_every == 0:
                    self.checkpoint()
        finally:
            for sink in sinks:
                sink.close()
        self.checkpoint()
        return self.version


def _fmt_counts(d: dict[str, int]) -> str:
    return ",".join(f"{k}:{v}" for k, v in sorted(d.items()) if v) or "0"


def format_line(m: dict[str, Any]) -> str:
    """The dense greppable per-step line."""
    return (
        f"trainer v={m['version']} groups={m['groups']} reward={m['reward']:.3f} stale={m['stale_mean']:.2f} "
        f"masked={100 * m['masked_frac']:.2f}% clip={100 * m['clip_frac']:.2f}% ess={m['ess']:.3f} "
        f"ent={m['entropy']:.3f} gnorm={m['grad_norm']:.3f} loss={m['loss']:+.4f} tok/s={m['tok_s']:.0f} "
        f"pub={m['publish_kind']}:{m['publish_s']:.2f}s drops={_fmt_counts(m['drops'])} "
        f"disagree={_fmt_counts(m['disagreements'])}"
    )
