"""Trainer state in the run: step intents (batch records), per-step metrics, and legacy checkpoints.

Objects under `<run>/trainer/` (keys from `pnyx.protocol.layout`):

    trainer/batch-{V:08d}.json     create-only: the group keys (and learning rate) of the step producing V
    trainer/metrics-{V:08d}.json   the metrics of the step that produced version V
    trainer/ckpt-{V:08d}/...       sharded DCP checkpoints (`checkpointer.py`)
    trainer/ckpt-{V:08d}.pt        legacy: one torch.save object (fp32 model, AdamW state, RNG, cursor),
                                   written by pnyx before sharded checkpoints; still read on resume

A batch record is written create-only *before* the step's publish: the weights of version V were trained
on exactly `batch-V`, whichever process computed them (see docs/trainer.md for the crash argument); with
the learning rate it records, a replay does not depend on the schedule or step budget of the process
that replays it.

Knows nothing about the training loop's policy; imports torch only inside the functions that need it.
"""

from __future__ import annotations

import io
import json
import random
import time
from typing import TYPE_CHECKING, Any

import msgspec

from pnyx.errors import AlreadyExistsError, IntegrityError, NotFoundError
from pnyx.protocol import layout
from pnyx.store import Store

if TYPE_CHECKING:
    import torch

CKPT_FORMAT = 1
_CKPT_PREFIX = "ckpt-"
_BATCH_PREFIX = "batch-"
_METRICS_PREFIX = "metrics-"


def ckpt_key(version: int) -> str:
    return layout.trainer_key(f"{_CKPT_PREFIX}{version:08d}.pt")


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


def write_batch_record(
    store: Store, version: int, keys: list[str], trainer_id: str, lr: float | None = None
) -> BatchRecord:
    """Record the step's batch create-only; if a record already exists, return it (it wins, use it)."""
    rec = BatchRecord(version=version, keys=list(keys), trainer_id=trainer_id, created_at=time.time(), lr=lr)
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


# --- legacy checkpoints (one object) ---------------------------------------------------------------------


def save_checkpoint(
    store: Store,
    version: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    cursor_json: bytes,
    extra: dict | None = None,
) -> str:
    """Write the whole trainer state at `version` as one object, in the legacy format (pnyx now writes
    sharded checkpoints; this stays so runs and tests can hold one). Returns its key."""
    import torch

    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": repr(random.getstate())}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    state = {
        "format": CKPT_FORMAT,
        "version": version,
        "model": {k: v.detach().to("cpu") for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "rng": rng,
        "cursor": cursor_json.decode(),
        "extra": json.dumps(extra or {}),
        "saved_at": time.time(),
    }
    buf = io.BytesIO()
    torch.save(state, buf)
    key = ckpt_key(version)
    store.put(key, buf.getvalue(), mode="overwrite")
    return key


def checkpoint_versions(store: Store) -> list[int]:
    """Versions with a complete checkpoint (sharded and committed, or legacy), ascending."""
    from pnyx.train.checkpointer import committed

    return sorted({s.version for s in committed(store)})


def load_checkpoint(store: Store, version: int) -> dict[str, Any]:
    """Read a legacy checkpoint (tensors on CPU). Restores nothing by itself: see `restore_rng`."""
    import torch

    data = store.get(ckpt_key(version))
    state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if state.get("format") != CKPT_FORMAT or state.get("version") != version:
        raise IntegrityError(
            f"{ckpt_key(version)} has format {state.get('format')} / version {state.get('version')}; "
            f"expected format {CKPT_FORMAT}, version {version}"
        )
    state["extra"] = json.loads(state.get("extra") or "{}")
    return state


def restore_rng(rng: dict[str, Any]) -> None:
    """Restore the RNG state of a legacy checkpoint."""
    import ast

    import torch

    torch.set_rng_state(rng["torch"])
    random.setstate(ast.literal_eval(rng["python"]))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


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
