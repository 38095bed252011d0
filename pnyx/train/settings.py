"""The config's `algorithm` and `security` sections (and the run's sampling settings from `worker`) turned
into the settings the step and the ingestor take (one place; each setting keeps its config name).

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
        clip_low=a.clip_low,
        clip_high=a.clip_high,
        dual_clip=a.dual_clip,
        tis_cap=a.tis_cap,
        dppo_delta=a.dppo_delta,
        aggregation=a.aggregation,
        kl_coef=a.kl_coef,
    )


def ingest_settings(cfg: PnyxConfig) -> IngestSettings:
    """The ingestor's filters, with the run's sampling settings and budget every group must match (call it
    after `worker.max_new_tokens` is resolved, as the trainer does)."""
    a, w, sec = cfg.algorithm, cfg.worker, cfg.security
    return IngestSettings(
        max_staleness=a.max_staleness,
        max_reuse=a.max_reuse,
        last_chance_share=a.last_chance_share,
        max_groups_per_prompt=a.max_groups_per_prompt,
        advantage=a.advantage,
        temperature=w.temperature,
        top_p=w.top_p,
        top_k=w.top_k,
        group_size=w.group_size,
        max_new_tokens=w.max_new_tokens,
        checks=check_settings(cfg),
        quarantine=QuarantineSettings(
            quarantine_rate=sec.quarantine_rate,
            quarantine_min=sec.quarantine_min,
            quarantine_key_z=sec.quarantine_key_z,
        ),
        max_key_share=sec.max_key_share,
        flood_limit=flood_limit(cfg),
        max_groups_per_key_step=sec.max_groups_per_key_step,
        max_groups_per_key_version=sec.max_groups_per_key_version,
        reject_reward_lies=sec.reject_reward_lies,
        trusted_keys=frozenset(normalize_fingerprint(fp) for fp in sec.trusted_keys),
    )


def check_settings(cfg: PnyxConfig) -> CheckSettings:
    """The step's sampling checks (`pnyx.security.checks`) from the `security` section."""
    sec = cfg.security
    return CheckSettings(
        lp_gap_base=sec.lp_gap_base,
        lp_gap_per_version=sec.lp_gap_per_version,
        plausibility_z=sec.plausibility_z,
        draw_tolerance=sec.draw_tolerance if sec.seeded_draws else None,
        stale_draw_audit=sec.stale_draw_audit,
    )
