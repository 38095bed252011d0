"""The trainer: ingestion, advantages, losses, the optimizer step, publishing, checkpoint/resume.

Public surface (imported lazily, so `import pnyx.train` does not import torch):
`Trainer` (loop), `read_metrics` (per-step metrics for `pnyx status` and the live view), `init_run` /
`read_run` (run.json), `Ingestor` / `Cursor` / `IngestSettings` / `Prefetcher`, `group_advantages`, `LossSettings`,
`policy_loss`, `train_step`. See docs/trainer.md. Knows nothing about generation internals.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Trainer": "pnyx.train.loop",
    "format_line": "pnyx.train.loop",
    "read_metrics": "pnyx.train.checkpoint",
    "checkpoint_versions": "pnyx.train.checkpoint",
    "read_batch_record": "pnyx.train.checkpoint",
    "init_run": "pnyx.train.bootstrap",
    "read_run": "pnyx.train.bootstrap",
    "Ingestor": "pnyx.train.ingest",
    "Cursor": "pnyx.train.ingest",
    "IngestSettings": "pnyx.train.ingest",
    "ScoredGroup": "pnyx.train.ingest",
    "Prefetcher": "pnyx.train.prefetch",
    "group_advantages": "pnyx.train.advantages",
    "LossSettings": "pnyx.train.losses",
    "policy_loss": "pnyx.train.losses",
    "train_step": "pnyx.train.step",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pnyx.train' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
