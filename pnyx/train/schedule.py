"""The learning-rate schedule: a pure function of the step, so a replayed step uses the same rate.

Step v is the optimizer step that produces version v (1-based). Every schedule starts with an optional
linear warm-up (`warmup_steps`: lr·v/(warmup_steps+1) for v ≤ warmup_steps), then:

    constant   lr
    linear     lr → lr·min_lr_ratio, linearly, at `total_steps`
    cosine     lr·(min_lr_ratio + (1 - min_lr_ratio)·(1 + cos(π·t))/2), t from 0 to 1 at `total_steps`

Steps past `total_steps` keep the final rate. Knows nothing about optimizers or the store: the loop sets
the rate on the optimizer and records it in the step's batch record, so a resume that changes the step
budget still replays the recorded steps with the rates they used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pnyx.errors import ConfigError

ScheduleKind = Literal["constant", "linear", "cosine"]


@dataclass(frozen=True)
class Schedule:
    lr: float
    kind: ScheduleKind = "constant"
    warmup_steps: int = 0
    total_steps: int = 1
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.warmup_steps < 0 or self.total_steps < 1 or not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(
                f"invalid learning-rate schedule {self}: need lr > 0, warmup_steps >= 0, total_steps >= 1 and "
                "0 <= min_lr_ratio <= 1 (trainer.lr, trainer.warmup_steps, run.steps, trainer.min_lr_ratio)"
            )

    def at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (>= 1)."""
        if step < 1:
            raise ValueError(f"steps count from 1, got {step}")
        if step <= self.warmup_steps:
            return self.lr * step / (self.warmup_steps + 1)
        if self.kind == "constant":
            return self.lr
        span = max(1, self.total_steps - self.warmup_steps)
        t = min(1.0, (step - self.warmup_steps) / span)
        floor = self.lr * self.min_lr_ratio
        if self.kind == "linear":
            return self.lr - (self.lr - floor) * t
        return floor + (self.lr - floor) * (1 + math.cos(math.pi * t)) / 2
