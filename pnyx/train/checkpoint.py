"""Trainer state in the run: step intents (batch records) and per-step metrics.

Objects under `<run>/trainer/` (keys from `pnyx.protocol.layout`):

    trainer/batch-{V:08d}.json     create-only: the group keys (and learning rate) of the step producing V
    trainer/metrics-{V:08d}.json   the metrics of the step that produced version V
    trainer/ckpt-{V:08d}/...       sharded DCP checkpoints (`checkpointer.py`)

A batch record is written create-only *before* the step's publish: the weights of version V were trained
on exactly `batch-V`, whichever process computed them (see docs/trainer.md for the crash argument); with
the learning rate it records, a replay does not depend on the schedule or step budget of the process
that replays it.

Knows nothing about the training loop's policy; imports torch only inside the functions that need it.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import msgspec

from pnyx.errors import AlreadyExistsError, IntegrityError, NotFoundError
from pnyx.protocol import layout
from pnyx.store import Store

if TYPE_CHECKING:
    pass

_BATCH_PREFIX = "batch-"
_METRICS_PREFIX = "metrics-"


def batch_key(version: int) -> str:
    return layout.trainer_key(f"{_BATCH_PREFIX}{version:08d}.json")


def metrics_key(version: int) -> str:
    return layout.trainer_key(f"{_METRICS_PREFIX}{version:08d}.json")


def _version_of(key: str, prefix: str, suffix: str) -> int | None:
    name = key[len(layout.TRAINER_PREFIX) :]
    if not (name.startswith(prefix) and name.endswith(suffix)):
        return None
    digits = name[len(prefix) : len(name) - len(suffix)]
    return int(digits) if len(digits) == 8 and digits.isdigit() else None


# --- batch records (step intents) -------------------------------------------------------------------


class BatchRecord(msgspec.Struct):
    """The batch of the step that turns version `version - 1` into `version`."""

    version: int
    keys: list[str]
    trainer_id: str
    created_at: float
    lr: float | None = None
    """The learning rate of the step (None in records written before schedules: the configured lr)."""
    rounded: str | None = None
    """The dtype the step's forward rounded the trained weights to (`train_step(forward_dtype=)`), so a
    replay does the same; None: the masters as they are (sharded runs, records written before it)."""


def write_batch_record(
    store: Store,
    version: int,
    keys: list[str],
    trainer_id: str,
    lr: float | None = None,
    rounded: str | None = None,
) -> BatchRecord:
    """Record the step's batch create-only; if a record already exists, return it (it wins, use it)."""
    rec = BatchRecord(
        version=version,
        keys=list(keys),
        trainer_id=trainer_id,
        created_at=time.time(),
        lr=lr,
        rounded=rounded,
    )
    try:
        store.put(batch_key(version), msgspec.json.encode(rec), mode="create")
        return rec
    except AlreadyExistsError:
        existing = read_batch_record(store, version)
        if existing is None:  # deleted in between: nobody should delete these
            raise IntegrityError(f"batch record for v{version} vanished while being read") from None
        return existing


def read_batch_record(store: Store, version: int) -> BatchRecord | None:
    try:
        data = store.get(batch_key(version))
    except NotFoundError:
        return None
    try:
        return msgspec.json.decode(data, type=BatchRecord)
    except msgspec.DecodeError as e:  # ValidationError is a DecodeError: malformed JSON lands here too
        raise IntegrityError(f"{batch_key(version)} is not a batch record: {e}") from e


def checkpoint_versions(store: Store) -> list[int]:
    """Versions with a committed (sharded) checkpoint, ascending."""
    from pnyx.train.checkpointer import committed

    return sorted({s.version for s in committed(store)})


# --- metrics --------------------------------------------------------------------------------------------


def write_metrics(store: Store, version: int, metrics: dict[str, Any]) -> None:
    store.put(metrics_key(version), json.dumps(metrics, sort_keys=True).encode(), mode="overwrite")


def read_metrics(store: Store, since_version: int | None = None) -> list[dict[str, Any]]:
    """Per-step trainer metrics in version order; only versions > `since_version` when given.

    For `pnyx status` and the live view: reads `trainer/metrics-*.json` objects (one per step).
    """
    start_after = metrics_key(since_version) if since_version is not None else None
    out = []
    for meta in store.list(layout.trainer_key(_METRICS_PREFIX.rstrip("-") + "-"), start_after=start_after):
        if _version_of(meta.key, _METRICS_PREFIX, ".json") is None:
            continue
        try:
            out.append(json.loads(store.get(meta.key)))
        except NotFoundError:
            continue
    return out
