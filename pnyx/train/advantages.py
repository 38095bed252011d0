"""Group-relative advantages: the per-completion learning signal of GRPO and Dr.GRPO.

Pure functions over a group's rewards (plain floats, no torch), so they are trivially testable and the
ingestion filter can use them without importing torch. Knows nothing about tokens, models or the store.

Invariant: advantages are computed from the trainer's own re-scored rewards, one group at a time; a group
whose rewards all agree (zero variance) carries no signal and is reported as such, never silently
turned into zeros that would still cost a forward/backward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pnyx.errors import ConfigError
from pnyx.protocol.rules import reward_std

AdvantageMode = Literal["grpo", "drgrpo"]


def group_advantages(
    rewards: Sequence[float], mode: AdvantageMode = "grpo", eps: float = 1e-6
) -> list[float]:
    """Advantage of each completion of one group.

    - ``"grpo"``:    A_i = (R_i - mean(R)) / (std(R) + eps), population std.
    - ``"drgrpo"``: A_i = R_i - mean(R)   (Dr.GRPO removes the std normalisation, which up-weights
      near-deterministic prompts).
    """
    if not rewards:
        raise ValueError("group_advantages: empty group")
    mean = sum(rewards) / len(rewards)
    centred = [float(r) - mean for r in rewards]
    if mode == "drgrpo":
        return centred
    if mode == "grpo":
        std = reward_std(rewards)
        return [c / (std + eps) for c in centred]
    raise ConfigError(f"unknown advantage mode {mode!r}: expected 'grpo' or 'drgrpo'")
