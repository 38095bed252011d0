"""Rules both sides of a run apply the same way, so that neither has to trust the other to.

- A **zero-variance group** (every reward equal) carries no learning signal: a worker does not upload it,
  the trainer drops it (`is_zero_variance`, on the population std of the rewards).
- The **flood limit**: the trainer quarantines a key with more than `flood_limit` groups it signed at one
  policy version (`pnyx.train.flood_audit`; skip records do not count); an honest worker stays at half of
  it (`worker_version_cap`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pnyx.config import PnyxConfig


def reward_std(rewards: Sequence[float]) -> float:
    """Population standard deviation of a group's rewards (the group is the whole population: ddof=0)."""
    if not rewards:
        raise ValueError("reward_std: empty group")
    m = sum(rewards) / len(rewards)
    return math.sqrt(sum((r - m) ** 2 for r in rewards) / len(rewards))


def is_zero_variance(rewards: Sequence[float], tol: float = 1e-9) -> bool:
    """True when every reward equals the others (within `tol`): the group's advantages are all zero."""
    return reward_std(rewards) <= tol


def flood_limit(cfg: PnyxConfig) -> int | None:
    """Groups one key may have at one policy version before it is quarantined as a flooder
    (`security.flood_limit`; "auto": twice the most that could ever be trained from one version)."""
    limit = cfg.security.flood_limit
    if limit == "auto":
        return 2 * (cfg.algorithm.max_staleness + 1) * cfg.trainer.groups_per_step
    return limit


def worker_version_cap(cfg: PnyxConfig) -> int | None:
    """Groups an honest worker makes at one policy version before it waits for the next: half the run's
    flood limit, or `worker.max_groups_per_version` if lower (None: no cap). Half, so a worker restarted at
    the same version (its count starts over) still stays under the limit. Skip records are not capped (see
    `pnyx.train.version_listing.SKIPS`)."""
    limit = flood_limit(cfg)
    caps = [
        c for c in (cfg.worker.max_groups_per_version, None if limit is None else max(1, limit // 2)) if c
    ]
    return min(caps) if caps else None
