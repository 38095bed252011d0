"""One step's metrics record (`trainer/metrics-{v}.json`, the step log line, the trackers): what the step
measured (`StepStats`), the groups it trained on, and the ingestion's state beside it (backlog, zero-variance
share, drops, keys). A pure read of its inputs: the trainer loop writes the record (`checkpoint.write_metrics`)
and a replayed step writes the same fields (`resume.py`).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from pnyx.security.calibration import evidence_summary
from pnyx.train.batch import StepResult
from pnyx.train.drawcheck import MISMATCH, UNVERIFIABLE
from pnyx.train.ingest import Ingestor
from pnyx.train.progress import reward_parts
from pnyx.train.stepstats import StepStats


def step_metrics(
    r: StepResult,
    ingestor: Ingestor,
    *,
    version: int,
    world: int,
    max_staleness: int,
    ingest_wait_s: float,
    prefetch_busy_s: float,
    skip_audit: dict[str, Any] | None,
    precheck: dict[str, Any] | None = None,
    checks_background: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The metrics of step `r` (published as `r.version`), with the ingestion's state at the trainer's
    `version`, its `world` size, the seconds it waited for the batch and its prefetcher was busy, and the
    exact check of skip records made while its batch was chosen (`skip_audit`: `s` on the step's path, `idle_s`
    in time it waited for groups), and the exact measurements of its stale rows made while it waited
    (`precheck`: groups, rows and seconds, and `known`, the rows its exact re-check then read from them),
    and what the trainer's background thread checked since it started (`checks_background`, a running
    total: skip records' groups, rows, false ones and seconds; forecast stale rows, `pre_*`)."""
    s = r.stats
    stale = Counter(r.version - 1 - g.version for g in r.groups)
    rewards = [x for g in r.groups for x in g.rewards]
    claimed = [x for g in r.groups for x in g.worker_rewards]
    n_stale = sum(stale.values())
    return {
        "version": r.version,
        "time": time.time(),
        "groups": len(r.groups),
        "samples": len(rewards),
        "reward": sum(rewards) / len(rewards),
        "worker_reward": sum(claimed) / len(claimed),
        "staleness": {str(k): v for k, v in sorted(stale.items())},
        "stale_mean": sum(k * v for k, v in stale.items()) / n_stale,
        "loss": s.loss,
        "masked_frac": s.masked_frac,
        "clip_frac": s.clip_frac,
        "iw_mean": s.iw_mean,
        "iw_min": s.iw_min,
        "iw_max": s.iw_max,
        "ess": s.ess,
        "entropy": s.entropy,
        "kl": s.kl,
        "grad_norm": s.grad_norm,
        "tokens": s.tokens,
        "tok_s": s.tokens_per_s,
        "step_s": s.seconds,
        "publish_s": r.publish_s,
        "publish_kind": r.publish_kind,
        "lr": r.lr,
        "ranks": world,
        "micro_batches": s.micro_batches,
        "lp_gap": s.lp_gap,
        "reward_parts": reward_parts(r.groups),
        "backlog": ingestor.backlog(version),
        "zero_variance": ingestor.zero_variance(),
        "ingest_wait_s": ingest_wait_s,
        "prefetch_busy_s": round(prefetch_busy_s, 3),
        "lp_gap_engine": s.lp_gap_engine,
        "rejected": dict(Counter(s.rejected.values())),
        "rejudged": dict(Counter(s.rejudged.values())),
        "undo_s": round(s.undo_s, 4),
        "probe_s": round(s.probe_s, 4),
        "calibration": _calibration(r, max_staleness),
        "draws": _draw_metrics(s),
        "skip_audit": skip_audit,
        "precheck": precheck,
        "checks_background": checks_background,
        **ingestor.stats(),
    }


def _draw_metrics(s: StepStats) -> dict[str, Any] | None:
    """The step's check of seeded draws (`stepstats.DrawTally`): rows measured by its forward, rows over the
    tolerance there and measured again exactly, the seconds of those exact forwards, groups dropped, the
    largest distances; None when the run does not check draws."""
    if s.draws is None:
        return None
    out = s.draws.to_metrics()
    out["dropped"] = sum(1 for r in s.rejected.values() if r in (MISMATCH, UNVERIFIABLE))
    return out


def _calibration(r: StepResult, max_staleness: int) -> dict[str, Any] | None:
    """The allowances the step judged with and what its drift probe measured."""
    if r.checks is None:
        return None
    out = r.checks.to_metrics(max_staleness)
    out["groups"] = evidence_summary(r.stats.evidence, r.checks, r.stats.rejected, r.stats.rejudged)
    d = r.stats.drift
    out["probe"] = None if d is None else {"drift": round(d.a, 6), "tokens": d.tokens, "held_out": d.held_out}
    return out
