"""What one node round did and what its step trains on: `RoundStats` (one log line per round),
`trainable` (the groups of the mix that carry a GRPO signal), `ensure_trainable` (parameters autograd can
use after generation), `refuse_nonfinite` (the optimizer hook that skips a step with a non-finite gradient).

No torch at import (`ensure_trainable` imports it when called). Knows nothing about the store, the peers
or how the mix was drawn (`pnyx.swarm.node` runs the round).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pnyx.protocol.rules import is_zero_variance
from pnyx.train.stepstats import StepStats

if TYPE_CHECKING:
    import torch

    from pnyx.train.ingest import ScoredGroup

log = logging.getLogger("pnyx.swarm")


@dataclass
class RoundStats:
    """What one round did (logged as one line; the benchmark sums `local_reward`)."""

    round: int
    version: int
    local_groups: int = 0
    external_groups: int = 0
    trained_groups: int = 0
    """Groups in the optimizer step (the mix minus zero-variance groups)."""
    trained_local: int = 0
    trained_external: int = 0
    local_reward: float = 0.0
    """Mean reward (own verifier) of the completions this node generated this round."""
    external_reward: float = 0.0
    """Mean reward (own verifier) of the external completions in the mix."""
    paths: Counter = field(default_factory=Counter)
    """External groups by token path: exact / aligned."""
    zero_variance: int = 0
    forged: int = 0
    """Claimed foreign rewards this node overwrote in the mix."""
    step: StepStats | None = None
    seconds: float = 0.0

    def line(self, node: str) -> str:
        s = self.step
        step = (
            f"loss={s.loss:.4f} masked={100 * s.masked_frac:.2f}% clip={100 * s.clip_frac:.2f}% iw={s.iw_mean:.3f}"
            if s is not None
            else "no-step"
        )
        return (
            f"node={node} round={self.round} v={self.version} local={self.local_groups} ext={self.external_groups} "
            f"trained={self.trained_groups} reward={self.local_reward:.3f} ext_reward={self.external_reward:.3f} "
            f"zero_var={self.zero_variance} forged={self.forged} paths={dict(self.paths)} {step} "
            f"s={self.seconds:.2f}"
        )


def trainable(groups: list[ScoredGroup]) -> list[ScoredGroup]:
    """The groups that carry a GRPO signal (rewards that differ) and have completion tokens."""
    return [g for g in groups if not is_zero_variance(g.rewards) and any(s.tokens for s in g.group.samples)]


def ensure_trainable(model: torch.nn.Module) -> None:
    """Give back autograd-usable storage to any parameter the engine left as an inference-mode tensor.

    An engine that re-points parameters at tensors built inside `torch.inference_mode` (an early version of
    the fused decoder did) leaves them unusable by autograd. A no-op when no parameter is affected; when
    one is, it is copied and a warning names the regression instead of the step failing.
    """
    import torch

    fixed = 0
    with torch.no_grad():
        for p in model.parameters():
            if p.is_inference():
                p.data = p.data.clone()
                fixed += 1
    if fixed:
        log.warning(
            "%d parameters were inference-mode tensors after generation (engine regression?); copied", fixed
        )


class NonFiniteStep(Exception):
    """Raised by the optimizer's pre-step hook: the step would write a non-finite gradient into the weights."""


def refuse_nonfinite(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Optimizer pre-step hook: refuse a step whose gradient is not finite, before AdamW touches its state."""
    import torch

    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if grads and not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()):
        raise NonFiniteStep("a gradient is not finite")
