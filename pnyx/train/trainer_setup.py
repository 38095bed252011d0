"""Setting up a trainer: load the model and everything a step needs, then create the run or resume it.

`TrainerSetup` is the setup layer of the `loop.Trainer` (a base class it builds on): `_load` loads the
model (sharded under torchrun: `distributed.py`), tokenizer, environment, optimizer, schedule, KL
reference, publisher, checkpointer, supply publisher and the ingestor with its prefetcher; `start`
creates the run (run.json, create-only, then v0 published as an anchor: FencedError if another trainer
owns the run) or joins it and resumes (`resume.py`: the newest checkpoint, then a replay of the steps
published after it). It also publishes the current weights (every rank its share, rank 0 commits) and
runs a call on rank 0 alone (`_on_main`), handing its result or error to every rank. Also here: which
chain digests a group of a version may carry (`published_digests`), and the resume config overlay.

Knows nothing about how a step chooses or trains on its batch (`loop.py`) or about generation internals.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

from pnyx.config import PnyxConfig, overlay_changed
from pnyx.errors import ConfigError, FencedError, NotFoundError, PnyxError
from pnyx.models.source import resolve_model_source
from pnyx.protocol.records import RunManifest
from pnyx.protocol.runfile import read_run
from pnyx.security.signing import Verifier
from pnyx.store import Store
from pnyx.train import bootstrap, checkpointer, hooks
from pnyx.train.ingest import Ingestor
from pnyx.train.prefetch import Prefetcher
from pnyx.train.progress import Progress
from pnyx.train.reference import Reference
from pnyx.train.settings import ingest_settings
from pnyx.train.step import make_optimizer
from pnyx.train.supply import DemandPublisher
from pnyx.weights.manifest import WeightManifest
from pnyx.weights.trust import check_trainer_key, run_verifier, trainer_key_record, trainer_signer

T = TypeVar("T")

log = logging.getLogger("pnyx.train")


def published_digests(store: Store, version: int, trust: Verifier | None = None) -> frozenset[str] | None:
    """Chain digests a group of `version` may carry, one per plane (a worker on the int8 actor plane stamps
    its groups with that plane's digest); None if the version is not published (with `trust`: by the
    run's key)."""
    from pnyx.weights.manifest import read_manifest

    try:
        m = read_manifest(store, version, trust)
    except NotFoundError:
        return None
    return manifest_digests(m)


def manifest_digests(m: WeightManifest) -> frozenset[str]:
    """The chain digests of a weight manifest's planes."""
    planes = [m.weights] + ([m.int8] if m.int8 is not None else [])
    return frozenset(p.chain_digest for p in planes)


def merge_resume_config(run_config: dict[str, Any], given: PnyxConfig) -> PnyxConfig:
    """On resume the run's config is the base; every field the caller gave wins (even one set back to its
    default)."""
    return overlay_changed(run_config, given)


class TrainerSetup:
    """The setup layer of the `Trainer` (see the module docstring); the attributes below are its."""

    cfg: PnyxConfig
    store: Store
    resume: bool
    steps: int
    _steps_override: int | None
    version: int
    ingestor: Ingestor | None
    progress: Progress
    reference: Reference | None
    trust: Verifier | None

    def load_model_and_parts(self, run: RunManifest | None = None) -> None:
        """Load model, tokenizer, env, optimizer; resuming `run` (its RunManifest), its recorded model."""
        from pnyx.config import resolve_device, resolve_env_kwargs, resolve_max_new_tokens
        from pnyx.envs import get_env
        from pnyx.models import load_model, load_tokenizer, render_prompt, resolve_run_model, tokenizer_digest
        from pnyx.train.distributed import init_distributed, prepare_model, resolve_compute_dtype
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
            chunk_bytes=t.publish_chunk_bytes, comm=self.dist, hook=hooks.point,
        )  # fmt: skip
        self.checkpointer = checkpointer.Checkpointer(
            self.store, self.dist, checkpointer.local_folder(t.checkpoint_dir, self.store.url), t.keep_checkpoints,
            t.async_checkpoint, hook=hooks.point,
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
        self.ingestor.decode = hooks.decoder(self.ingestor.decode)
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

    def publish(self, version: int, force_anchor: bool = False) -> WeightManifest:
        """Publish the current weights as `version` (every rank takes part; rank 0 commits)."""
        return self.publisher.publish(version, self.publish_tensors(), force_anchor, self.publish_layout())

    def on_main(self, fn: Callable[[], T]) -> T:
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
        return cast(T, out[1])

    def _start(self) -> int | None:
        """Load the model and create the run (publish v0: returns 0) or join it to resume (returns its newest
        published version, None when it has none; `loop.Trainer.start` then restores)."""
        from pnyx.weights.manifest import latest_version

        existing = read_run(self.store)
        if self.resume:
            if existing is None:
                raise ConfigError(
                    f"nothing to resume at {self.store.url}: it has no run.json. Start without --resume."
                )
            self.cfg = merge_resume_config(existing.config, self.cfg)
            self.steps = self._steps_override if self._steps_override is not None else self.cfg.run.steps
        self.load_model_and_parts(existing if self.resume else None)
        config_json = self.cfg.model_dump(mode="json")
        config_json["store"]["url"] = None  # where the run lives is not part of what it is
        signer = trainer_signer() if self.dist.is_main else None  # rank 0 alone signs (and holds the key)
        if existing is not None:
            bootstrap.check_compatible(existing, config_json, self.model_info, self.store.url)
            self.manifest = existing
        else:
            self.manifest = self.on_main(
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
        trusted = sorted(self._ingest.settings.trusted_keys)
        if trusted:
            log.info(
                "trainer: %d trusted worker key(s), never quarantined, calibrating the checks: %s",
                len(trusted), ", ".join(trusted),
            )  # fmt: skip
        self.trust = run_verifier(self.manifest)
        self._ingest.run_id = self.manifest.run_id
        if not self.resume:
            try:
                self.publish(0, force_anchor=True)
            except FencedError:
                raise FencedError(
                    f"the run at {self.store.url} already has published weights: another trainer owns it. "
                    "Resume it with --resume (if its trainer is dead) or use another --store."
                ) from None
            self.version = 0
            log.info(
                "trainer run=%s created: v0 published (%s)", self.manifest.run_id, self.model_info["name"]
            )
            return 0
        return self.dist.broadcast(latest_version(self.store, self.trust) if self.dist.is_main else None)

    @property
    def _ingest(self) -> Ingestor:
        """The ingestor, which exists from `start()` on."""
        if self.ingestor is None:
            raise RuntimeError("the trainer has no ingestor before start()")
        return self.ingestor
