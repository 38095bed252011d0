"""The config's `algorithm` section turned into the settings the step and the ingestor take (one place).

`loss_settings` feeds `train_step` (the trainer loop and every swarm node); `ingest_settings` feeds the
trainer's `Ingestor`. Knows nothing about the loop, the store or models; imports no torch itself beyond
what `losses` needs.
"""

from __future__ import annotations

from pnyx.config import PnyxConfig
from pnyx.train.ingest import IngestSettings
from pnyx.train.losses import LossSettings


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
    """The ingestor's filters, with the run's sampling settings and budget every group must match (call it
    after `worker.max_new_tokens` is resolved, as the trainer does)."""
    a, w = cfg.algorithm, cfg.worker
    return IngestSettings(
        max_staleness=a.max_staleness,
        max_reuse=a.max_reuse,
        max_groups_per_prompt=a.max_groups_per_prompt,
        advantage=a.advantage,
        temperature=w.temperature,
        top_p=w.top_p,
        top_k=w.top_k,
        max_new_tokens=w.max_new_tokens,
    )
