"""Resuming a trainer: the newest committed checkpoint, then a replay of every step published after it.

The checkpoint at version C holds the model, the optimizer, the RNG and the ingestion cursor after step C
(a sharded DCP checkpoint, loadable by any number of ranks). Every version P > C that was published since
has a batch record naming exactly the groups (and the learning rate) it was trained on, so replaying C+1..P rebuilds the state that produced P. A
replay whose cast differs from the published bits (non-deterministic kernels, another number of ranks:
the sum over ranks rounds differently) adopts the published bits where its cast differs, so the chain
continues from what the workers run.

Functions of a `loop.Trainer` (they read and set its model, optimizer, cursor and version); every rank
calls them together. Knows nothing about how batches are chosen.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch

from pnyx.errors import IntegrityError
from pnyx.security.signing import Verifier
from pnyx.store import Store
from pnyx.train import checkpoint, checkpointer
from pnyx.train.batch import Batch, StepResult
from pnyx.train.ingest import ScoredGroup
from pnyx.train.ingest_state import Cursor
from pnyx.train.stepstats import StepStats
from pnyx.train.trainer_setup import TrainerParts
from pnyx.weights.manifest import WeightManifest

log = logging.getLogger("pnyx.train")
T = TypeVar("T")


class Resumable(Protocol):
    """What a resume reads and sets of the trainer (`loop.Trainer`)."""

    store: Store
    trust: Verifier | None
    version: int
    last_checkpoint: int | None

    @property
    def parts(self) -> TrainerParts: ...
    @property
    def run_id(self) -> str: ...
    def publish(self, version: int, force_anchor: bool = False) -> WeightManifest: ...
    def on_main(self, fn: Callable[[], T]) -> T: ...
    def make_batch(self, rec: checkpoint.BatchRecord, groups: list[ScoredGroup]) -> Batch: ...
    def load_recorded(self, rec: checkpoint.BatchRecord) -> list[ScoredGroup]: ...
    def train_batch(self, batch: Batch) -> StepStats: ...
    def metrics(self, r: StepResult) -> dict[str, Any]: ...


def restore(t: Resumable, published: int | None) -> None:
    """Load the newest committed checkpoint into `t`, then replay every version published after it."""
    from pnyx.weights.manifest import read_manifest

    done = checkpointer.committed(t.store)
    base = done[-1].version if done else 0
    if done:
        load_checkpoint(t, done[-1])
        t.last_checkpoint = base
    if published is None:  # killed before v0 was published: publish it now
        t.publish(0, force_anchor=True)
        published = 0
    if published < base:
        raise IntegrityError(
            f"checkpoint v{base} is newer than the newest published weights v{published}: the weights "
            "of this run were deleted or the checkpoint belongs to another run"
        )
    for v in range(base + 1, published + 1):
        batch = t.on_main(lambda v=v: recorded_batch(t, v, base, published))
        t.version = v - 1
        stats = t.train_batch(batch)
        if t.parts.dist.is_main:
            t.parts.ingestor.commit(
                batch.keys,
                batch.groups,
                stats.rejected,
                stats.verdict_evidence,
                batch.checks,
                stats.drift,
                v - 1,
            )
            kind = read_manifest(t.store, v, t.trust).kind
            checkpoint.write_metrics(
                t.store, v, t.metrics(StepResult(v, stats, batch.groups, 0.0, kind, batch.lr, batch.checks))
            )
        log.info("trainer resume: replayed step to v%d from its batch record (%d groups)", v, len(batch.keys))
    t.version = published
    if published > base:
        verify_or_adopt(t, published)
    log.info("trainer run=%s resumed at v%d (checkpoint v%d)", t.run_id, published, base)


def load_checkpoint(t: Resumable, stored: checkpointer.Stored) -> None:
    """Model, optimizer, RNG and cursor from a committed (sharded) checkpoint."""
    v = stored.version
    commit = t.parts.checkpointer.load(v, t.parts.model, t.parts.optimizer)
    owner, cursor = commit.run_id, commit.cursor.encode()
    checkpointer.restore_rng(commit.rng)
    if owner != t.run_id:
        raise IntegrityError(
            f"checkpoint v{v} belongs to run {owner!r}, not to this run ({t.run_id!r}): "
            "the trainer/ folder was copied from another run"
        )
    t.parts.ingestor.cursor = Cursor.from_json(cursor)


def recorded_batch(t: Resumable, version: int, base: int, published: int) -> Batch:
    """Rank 0: the batch of an already published step, from its record (for a replay)."""
    rec = checkpoint.read_batch_record(t.store, version)
    if rec is None:
        raise IntegrityError(
            f"cannot roll forward from checkpoint v{base} to published v{published}: "
            f"{checkpoint.batch_key(version)} is missing"
        )
    return t.make_batch(rec, t.load_recorded(rec))


def verify_or_adopt(t: Resumable, version: int) -> None:
    """After a replay, the cast of the master weights must be the published bits; else adopt those.

    Each rank checks the tensors it publishes against the manifest's digests (together: every tensor). On
    a mismatch only the elements whose cast differs take the published value: the others keep their fp32
    masters. (Rounding every master to the published dtype moves the whole model by up to half an ulp of
    bf16, and Adam, which normalises each update, turns that into a different next step for ~10% of the
    weights of the tiny model; adopting elementwise leaves the replay as close to the uninterrupted run as
    the sums over ranks allow.)"""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from pnyx.weights import Syncer
    from pnyx.weights.bits import from_torch
    from pnyx.weights.manifest import read_manifest

    want = {e.name: e.digest for e in read_manifest(t.store, version, t.trust).weights.tensors}
    mine = from_torch(t.parts.publishing.tensors(), copy=False)
    same = all(want.get(n) == tb.digest() for n, tb in mine.items())
    if all(t.parts.dist.all_gather(same)):
        return
    _, published = Syncer(t.store, trust=t.trust).sync(to_version=version)
    options = StateDictOptions(full_state_dict=True, strict=False)
    masters = get_model_state_dict(t.parts.model, options=options)
    merged, moved = {}, 0
    for name, pub in published.items():
        key = t.parts.publishing.state_key(name)  # a LoRA run publishes the adapter under other names
        master = masters.get(key)
        if not isinstance(master, torch.Tensor):
            continue
        master = master.detach().to("cpu", torch.float32)
        differ = _bits(master.to(pub.dtype)) != _bits(pub)
        moved += int(differ.sum())
        merged[key] = torch.where(differ, pub.to(torch.float32), master)
    log.warning(
        "trainer resume: the replayed v%d differs from the published bits in %d values; adopting those",
        version, moved,
    )  # fmt: skip
    set_model_state_dict(t.parts.model, merged, options=options)  # pyright: ignore[reportArgumentType]  (dict invariance)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits of `x`, so that -0.0 and 0.0 (equal as numbers, not as published bytes) differ."""
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])
