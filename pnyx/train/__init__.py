"""The trainer: ingestion, advantages, losses, the optimizer step, publishing, checkpoint/resume.

Public surface (imported lazily, so `import pnyx.train` does not import torch):
`Trainer` (loop), `read_metrics` (per-step metrics for `pnyx status` and the live view), `init_run`
(run.json; read with `pnyx.protocol.runfile.read_run`), `Ingestor` / `Cursor` / `IngestSettings` / `Prefetcher`, `group_advantages`, `LossSettings`,
`policy_loss`, `train_step`. See docs/trainer.md. Knows nothing about generation internals.
"""

from __future__ import annotations

from pnyx.lazy import export_names, lazy_exports

_EXPORTS = {
    "pnyx.train.loop": ("Trainer", "format_line"),
    "pnyx.train.checkpoint": ("read_metrics", "checkpoint_versions", "read_batch_record"),
    "pnyx.train.bootstrap": ("init_run",),
    "pnyx.train.ingest": ("Ingestor", "ScoredGroup"),
    "pnyx.train.ingest_state": ("Cursor", "IngestSettings"),
    "pnyx.train.prefetch": ("Prefetcher",),
    "pnyx.train.advantages": ("group_advantages",),
    "pnyx.train.losses": ("LossSettings", "policy_loss"),
    "pnyx.train.step": ("train_step",),
}

__all__ = export_names(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
