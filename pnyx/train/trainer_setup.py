"""Setting up a trainer: load what a step needs (`load_parts`), then create the run or join it (`open_run`).

`load_parts` returns a `TrainerParts`: the model (sharded under torchrun: `distributed.py`), tokenizer,
environment, optimizer, schedule, KL reference, the weights publishing (`Publishing`), checkpointer, supply
publisher, the ingestor with its prefetcher, and the config resolved for the run (the generation budget
filled in from the environment). `open_run` loads them and creates the run (run.json, create-only, then v0
published as an anchor: FencedError if another trainer owns the run) or joins it to resume, and returns an
`OpenRun`; replaying the steps published after the newest checkpoint is `resume.py`'s. Also here: which
chain digests a group of a version may carry (`PublishedDigests`), and the resume config overlay.

Knows nothing about how a step chooses or trains on its batch (`loop.py`) or about generation internals.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from pnyx.config import PnyxConfig, check_worker_dtype, overlay_changed
from pnyx.envs import Environment
from pnyx.errors import ConfigError, FencedError, NotFoundError
from pnyx.models.source import resolve_model_source
from pnyx.protocol.records import RunManifest
from pnyx.protocol.runfile import read_run
from pnyx.security.signing import Verifier
from pnyx.store import Store
from pnyx.train import bootstrap, hooks
from pnyx.train.checkpointer import Checkpointer, local_folder
from pnyx.train.distributed import Dist
from pnyx.train.drawcheck import unseeded_policy
from pnyx.train.ingest import Ingestor
from pnyx.train.prefetch import Prefetcher
from pnyx.train.published import PublishedModel
from pnyx.train.reference import Reference
from pnyx.train.rejudge import Rejudge
from pnyx.train.schedule import Schedule
from pnyx.train.settings import ingest_settings
from pnyx.train.step import make_optimizer
from pnyx.train.supply import DemandPublisher
from pnyx.train.ticker import Ticker
from pnyx.weights.manifest import WeightManifest
from pnyx.weights.publisher import Publisher
from pnyx.weights.syncer import Plane
from pnyx.weights.trust import check_trainer_key, run_verifier, trainer_key_record, trainer_signer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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


class PublishedDigests:
    """`published_digests` of each version, cached once known: what the ingestor checks a group's weights
    digest against. `trust` (the run's trainer key) is set once the run is created or joined."""

    def __init__(self, store: Store):
        self.store = store
        self.trust: Verifier | None = None
        self._known: dict[int, frozenset[str]] = {}

    def __call__(self, version: int) -> frozenset[str] | None:
        if version not in self._known:
            digests = published_digests(self.store, version, self.trust)
            if digests is None:
                return None
            self._known[version] = digests
        return self._known[version]

    def note(self, version: int, m: WeightManifest) -> None:
        """The trainer just published `m` as `version`: no need to read it back."""
        self._known[version] = manifest_digests(m)


@dataclass
class Publishing:
    """The trainer's side of PULSE: the publisher and what it publishes, the cast of the model's masters."""

    publisher: Publisher
    model: torch.nn.Module
    dtype: torch.dtype
    names: dict[str, str] | None = None
    """A LoRA run: {state-dict key: published name} of the adapter, the only tensors published
    (`pnyx.models.lora`); None: the whole state dict, under its own keys."""
    exact: Sequence[PublishedModel] = ()
    """The exact checks' models (`PublishedModel`, one per plane): each version published is handed to them
    as published (`PublishedModel.remember`), so they never fetch it back from the store."""

    @cached_property
    def layout(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """name -> (published dtype, global shape) of the whole published state: fixed for the run, computed
        once."""
        from pnyx.train.distributed import state_layout

        return state_layout(self.model, self.dtype, self.names)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The published cast of the tensors this rank publishes (all of them in one process); on CPU."""
        from pnyx.train.distributed import gather_published

        return gather_published(self.model, self.dtype, self.publisher.needs(self.layout), self.names)

    @cached_property
    def _keys(self) -> dict[str, str]:
        return {pub: key for key, pub in (self.names or {}).items()}

    def state_key(self, name: str) -> str:
        """The model's state-dict key of published tensor `name`."""
        return name if self.names is None else self._keys[name]

    def publish(self, version: int, force_anchor: bool = False) -> WeightManifest:
        """Publish the current weights as `version` (every rank takes part; rank 0 commits)."""
        m = self.publisher.publish(version, self.tensors(), force_anchor, self.layout)
        for pm in self.exact:
            plane = m.weights if pm.plane == "weights" else m.int8
            tensors = self.publisher.published_tensors(pm.plane)
            if plane is not None and tensors is not None:
                pm.remember(version, plane.chain_digest, tensors)
        return m


@dataclass
class TrainerParts:
    """Everything a step needs, loaded once (`load_parts`)."""

    cfg: PnyxConfig
    """The run's config, resolved: `worker.max_new_tokens` is the number run.json records."""
    dist: Dist
    compute_dtype: torch.dtype
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    env: Environment
    reference: Reference | None
    optimizer: torch.optim.Optimizer
    schedule: Schedule
    publishing: Publishing
    checkpointer: Checkpointer
    supply: DemandPublisher
    model_info: dict[str, Any]
    """What run.json records of the model: name, source identity, vocab, tokenizer digest, HF config."""
    digests: PublishedDigests
    ingestor: Ingestor
    prefetcher: Prefetcher
    rejudge: Rejudge | None = None
    """The exact forwards under a version's published weights (`security.rejudge`: of groups the step
    would drop; `security.seeded_draws`: of rows the step's forward puts over the draw tolerance), or None."""
    rounding: torch.dtype | None = None
    ticker: Ticker | None = None
    """The beacon of committed draws (`security.committed_draws`; rank 0, from `Trainer.start`)."""
    """The dtype the steps round their weights to in the forward (`forward_rounding`), or None."""
    published: list[PublishedModel] = field(default_factory=list)
    """The second models the exact checks compute with (one per plane), pointed at the run's key by
    `attach_run`."""


def load_parts(cfg: PnyxConfig, store: Store, steps: int, run: RunManifest | None = None) -> TrainerParts:
    """Load model, tokenizer, env, optimizer and the rest for a run of `steps` steps; resuming `run` (its
    RunManifest), exactly its recorded model (a hub id pinned to its commit)."""
    from pnyx.config import resolve_device, resolve_env_kwargs, resolve_max_new_tokens
    from pnyx.envs import get_env
    from pnyx.models import load_model, load_tokenizer, render_prompt, resolve_run_model, tokenizer_digest
    from pnyx.models.tokenizer import StopMatcher, eos_token_ids
    from pnyx.train.distributed import init_distributed, prepare_model, resolve_compute_dtype
    from pnyx.train.episode_check import EpisodeRules

    t = cfg.trainer
    torch.manual_seed(cfg.run.seed)  # nothing in a step samples today; keeps any future use seeded
    if run is not None:
        source = resolve_run_model(run.model, cfg.model.path, cfg.model.revision)
    else:
        source = resolve_model_source(cfg)
    model_dir = source.folder
    dist = init_distributed(resolve_device(t.device), wait_s=t.max_wait_s)
    compute_dtype = resolve_compute_dtype(t.compute_dtype, dist.device)
    model = load_model(model_dir, dtype="float32", device=dist.device)
    adapter = None
    if t.lora.enabled and cfg.worker.int8:
        raise ConfigError("trainer.lora publishes the adapter, which has no int8 plane: drop worker.int8")
    if t.lora.enabled:  # before sharding: FSDP2 shards the injected layers with the rest
        from pnyx.models.lora import attach, describe

        adapter = attach(model, t.lora)
        log.info(
            "trainer: %s, %d trainable parameters of %d", describe(t.lora),
            sum(p.numel() for p in model.parameters() if p.requires_grad), sum(p.numel() for p in model.parameters()),
        )  # fmt: skip
    generation_config = getattr(model, "generation_config", None)  # its EOS ids end a worker's completion
    model = prepare_model(model, dist, compute_dtype, t.activation_checkpointing)
    tokenizer = load_tokenizer(model_dir)
    env = get_env(cfg.env.name, **resolve_env_kwargs(cfg))
    # The generation budget is run-defining: run.json records the resolved number (None = the env's),
    # and workers and the Dr.GRPO normaliser read that one number.
    budget = resolve_max_new_tokens(cfg.worker.max_new_tokens, env)
    cfg = cfg.model_copy(update={"worker": cfg.worker.model_copy(update={"max_new_tokens": budget})})
    rounding = forward_rounding(dist.world, compute_dtype, getattr(torch, t.publish_dtype))
    reference = None
    if cfg.algorithm.kl_coef > 0 and dist.is_main:
        reference = Reference(model_dir, t.reference_device or dist.device, compute_dtype, rounding)
    publisher = Publisher(
        store, anchor_every=t.anchor_every, int8_plane=cfg.worker.int8, chunk_bytes=t.publish_chunk_bytes,
        comm=dist, hook=hooks.point,
    )  # fmt: skip
    checkpoints = Checkpointer(
        store, dist, local_folder(t.checkpoint_dir, store.url), t.keep_checkpoints, t.async_checkpoint,
        hook=hooks.point, frozen_base=adapter is not None,
    )  # fmt: skip
    vocab = int(model.config.vocab_size)
    model_info = {
        "name": source.name,
        "path": str(model_dir),
        "source": source.identity(),
        "model_type": getattr(model.config, "model_type", None),
        "vocab_size": vocab,
        "tokenizer_digest": tokenizer_digest(model_dir),
        "num_parameters": sum(
            p.numel() for p in model.parameters() if adapter is None or not p.requires_grad
        ),
        "publish_dtype": t.publish_dtype,
        "hf_config": model.config.to_dict(),
    }
    digests = PublishedDigests(store)
    sec, lora = cfg.security, (t.lora if adapter is not None else None)
    planes: list[Plane] = ["weights", "int8"] if cfg.worker.int8 else ["weights"]
    published = (
        {
            p: PublishedModel(store, model_dir, lora, plane=p, keep=cfg.algorithm.max_staleness + 1)
            for p in planes
        }
        if sec.seeded_draws or sec.rejudge
        else {}
    )
    ingestor = Ingestor(
        store=store,
        env=env,
        detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        settings=ingest_settings(cfg),
        vocab_size=vocab,
        render=lambda prompt: render_prompt(tokenizer, prompt),
        expected_digest=digests,
        require_signatures=True,  # every group signed by its worker's key (docs/security.md)
    )
    ingestor.admission.episodes = EpisodeRules(
        env=env,
        eos_ids=frozenset(eos_token_ids(tokenizer, SimpleNamespace(generation_config=generation_config))),
        stops=StopMatcher(tokenizer, [*env.stop_strings, *env.tool_stops]),
        detokenize=ingestor.admission.detokenize,
        tokenize=lambda text: list(tokenizer.encode(text, add_special_tokens=False)),
        max_new_tokens=budget,
    )
    skips = ingestor.skips
    if sec.seeded_draws:
        ingestor.admission.check_draws = unseeded_policy(sec.accept_unseeded, ingestor.settings.trusted_keys)
        skips.check_draws = ingestor.admission.check_draws
        skips.skip_draw_audit, skips.skip_draw_samples = sec.skip_draw_audit, sec.skip_draw_samples
        skips.skip_audit_first, skips.skip_audit_trusted = sec.skip_audit_first, sec.skip_audit_trusted
    else:
        skips.skip_draw_audit = 0.0
    ingestor.admission.decode = hooks.decoder(ingestor.admission.decode)
    return TrainerParts(
        cfg=cfg,
        dist=dist,
        compute_dtype=compute_dtype,
        model=model,
        tokenizer=tokenizer,
        env=env,
        reference=reference,
        optimizer=make_optimizer(model, t.lr, t.betas, t.weight_decay),
        schedule=Schedule(t.lr, t.lr_schedule, t.warmup_steps, steps, t.min_lr_ratio),
        publishing=Publishing(
            publisher, model, getattr(torch, t.publish_dtype), adapter, tuple(published.values())
        ),
        checkpointer=checkpoints,
        supply=DemandPublisher(store, t.groups_per_step, cfg.algorithm.max_staleness),
        model_info=model_info,
        digests=digests,
        ingestor=ingestor,
        prefetcher=Prefetcher(ingestor, t.groups_per_step),
        rejudge=Rejudge(published["weights"], published) if published else None,
        published=list(published.values()),
        rounding=rounding,
    )


def forward_rounding(
    world: int, compute_dtype: torch.dtype, publish_dtype: torch.dtype
) -> torch.dtype | None:
    """The dtype a trainer's steps round their weights to in the forward (`train_step(forward_dtype=)`): the
    publish dtype, so a fresh group is measured under the very weights it was sampled from, when one
    process computes in fp32; None when sharded (its ranks hold shards) or computing in bf16 already."""
    if world > 1 or compute_dtype != torch.float32 or publish_dtype == torch.float32:
        return None
    return publish_dtype


def merge_resume_config(run_config: dict[str, Any], given: PnyxConfig) -> PnyxConfig:
    """On resume the run's config is the base; every field the caller gave wins (even one set back to its
    default)."""
    return overlay_changed(run_config, given)


@dataclass
class OpenRun:
    """A run created or joined by `open_run`."""

    parts: TrainerParts
    steps: int
    """The step budget: the caller's, else the (resumed) config's."""
    manifest: RunManifest
    trust: Verifier
    """The verifier of the run's trainer key (from run.json)."""
    published: int | None
    """0 for a new run (v0 is published); resuming, the newest version published under the run's key
    (None: none yet)."""


def attach_run(parts: TrainerParts, run: RunManifest) -> Verifier:
    """Point the parts at `run`: the ingestor checks its run id and the digests its trainer key signed.
    Returns that key's verifier."""
    trust = run_verifier(run)
    parts.digests.trust = trust
    for published in parts.published:
        published.trust = trust
    parts.ingestor.admission.run_id = run.run_id
    return trust


def open_run(cfg: PnyxConfig, store: Store, resume: bool, steps: int | None) -> OpenRun:
    """Load the parts and create the run (publish v0) or join it to resume (`resume.restore` then replays)."""
    from pnyx.weights.manifest import latest_version

    existing = read_run(store)
    if resume:
        if existing is None:
            raise ConfigError(
                f"nothing to resume at {store.url}: it has no run.json. Start without --resume."
            )
        cfg = merge_resume_config(existing.config, cfg)
    check_worker_dtype(cfg)
    budget = steps if steps is not None else cfg.run.steps
    parts = load_parts(cfg, store, budget, existing if resume else None)
    dist = parts.dist
    config_json = parts.cfg.model_dump(mode="json")
    config_json["store"]["url"] = None  # where the run lives is not part of what it is
    signer = trainer_signer() if dist.is_main else None  # rank 0 alone signs (and holds the key)
    if existing is not None:
        bootstrap.check_compatible(existing, config_json, parts.model_info, store.url)
        manifest = existing
    else:
        record = trainer_key_record(signer) if signer is not None else None
        manifest = dist.on_main(lambda: bootstrap.init_run(store, config_json, parts.model_info, record))
    if signer is not None:
        check_trainer_key(manifest, signer, store.url)
        parts.publishing.publisher.signer = signer.for_run(manifest.run_id)
        log.info("trainer: weights signed by key %s", signer.fingerprint)
    trusted = sorted(parts.ingestor.settings.trusted_keys)
    if trusted:
        log.info(
            "trainer: %d trusted worker key(s), never quarantined, calibrating the checks: %s",
            len(trusted), ", ".join(trusted),
        )  # fmt: skip
    trust = attach_run(parts, manifest)
    if resume:
        published = dist.broadcast(latest_version(store, trust) if dist.is_main else None)
        return OpenRun(parts, budget, manifest, trust, published)
    try:
        parts.publishing.publish(0, force_anchor=True)
    except FencedError:
        raise FencedError(
            f"the run at {store.url} already has published weights: another trainer owns it. "
            "Resume it with --resume (if its trainer is dead) or use another --store."
        ) from None
    log.info("trainer run=%s created: v0 published (%s)", manifest.run_id, parts.model_info["name"])
    return OpenRun(parts, budget, manifest, trust, 0)
