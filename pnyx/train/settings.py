"""The config's `algorithm` section turned into the settings the step and the ingestor take (one place).

`loss_settings` feeds `train_step` (the trainer loop and every swarm node); `ingest_settings` feeds the
trainer's `Ingestor`. Knows nothing about the loop, the store or models; imports no torch itself beyond
what `losses` needs.
"""

from __future__ import annotations

from pnyx.config import PnyxConfig
from pnyx.protocol.rules import flood_limit
from pnyx.security.checks import CheckSettings, QuarantineSettings
from pnyx.security.keys import normalize_fingerprint
from pnyx.train.ingest_state import IngestSettings
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
    a, w, t = cfg.algorithm, cfg.worker, cfg.trainer
    return IngestSettings(
        max_staleness=a.max_staleness,
        max_reuse=a.max_reuse,
        max_groups_per_prompt=a.max_groups_per_prompt,
        advantage=a.advantage,
        temperature=w.temperature,
        top_p=w.top_p,
        top_k=w.top_k,
        max_new_tokens=w.max_new_tokens,
        checks=check_settings(cfg),
        quarantine=QuarantineSettings(
            rate=t.quarantine_rate, min_faults=t.quarantine_min, key_z=t.quarantine_key_z
        ),
        max_key_share=t.max_key_share,
        flood_limit=flood_limit(cfg),
        max_groups_per_key_step=t.max_groups_per_key_step,
        max_groups_per_key_version=t.max_groups_per_key_version,
        reject_reward_lies=t.reject_reward_lies,
        trusted_keys=frozenset(normalize_fingerprint(fp) for fp in t.trusted_keys),
    )


def check_settings(cfg: PnyxConfig) -> CheckSettings:
    """The step's sampling checks (`pnyx.security.checks`) from the `trainer` section."""
    t = cfg.trainer
    return CheckSettings(
        lp_gap_base=t.lp_gap_base, lp_gap_per_version=t.lp_gap_per_version, z_limit=t.plausibility_z
    )
