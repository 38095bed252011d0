"""Online difficulty filtering: a worker prefers task levels whose observed pass rate is strictly inside (0, 1).

A GRPO group whose completions all pass or all fail has zero reward variance and teaches nothing; the
trainer drops it. `Curriculum.sample(seed, n)` replaces `env.sample("train", seed, n)` in a worker: it draws
`n * OVERSAMPLE` candidates from the same seeded train stream, groups them by `env.level_of(task)` (arith:
digits and operator; countdown: how many numbers), and picks `n` of them, drawing each pick's level with
weight `max(EXPLORE, 4 p (1 - p))`, where p is that level's pass rate over its last `WINDOW` observed
groups (a level not yet observed counts as informative). Levels the policy always or never solves keep a
small weight, so a level whose rate moves (the policy learns, or forgets) comes back. `observe` feeds the
worker's own scored groups back in.

Knows nothing about models, the store or the trainer. Invariant: every task it returns is a task of the
env's seeded train stream, unchanged (same id, same prompt), so the trainer rebuilds it from its id; the
choice among them is the worker's alone. An environment without levels gets the stream's first `n` tasks,
exactly what `env.sample` returns.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from typing import Any

from pnyx.envs.base import Environment, Task, seeded_rng
from pnyx.protocol.records import Sample

OVERSAMPLE = 8
"""Candidates drawn per task returned: enough that every level of a few-level env is usually present."""
EXPLORE = 0.05
"""The weight of a level whose pass rate is 0 or 1 (an informative level weighs up to 1)."""
WINDOW = 8
"""A level's pass rate is measured over its last this many observed groups."""


class Curriculum:
    """Chooses a worker's training tasks by level from observed pass rates (see the module docstring)."""

    def __init__(self, env: Environment, window: int = WINDOW, explore: float = EXPLORE):
        self.env = env
        self.explore = explore
        self.window = window
        self.history: dict[Hashable, deque[tuple[int, int]]] = {}

    def pass_rate(self, level: Hashable) -> float | None:
        """Passed / total samples of `level` over its last `window` groups; None if never observed."""
        groups = self.history.get(level)
        if not groups:
            return None
        total = sum(n for _, n in groups)
        return sum(c for c, _ in groups) / total if total else None

    def weight(self, level: Hashable) -> float:
        """How much `level` is preferred: 4p(1-p) (1 at p = 0.5), at least `explore`; 1 when unobserved."""
        p = self.pass_rate(level)
        return 1.0 if p is None else max(self.explore, 4.0 * p * (1.0 - p))

    def sample(self, seed: int, n: int) -> list[Task]:
        """`n` tasks of the train stream for `seed`, preferring informative levels."""
        candidates = self.env.sample("train", seed, n * OVERSAMPLE)
        by_level: dict[Hashable, deque[Task]] = {}
        for task in candidates:
            by_level.setdefault(self.env.level_of(task), deque()).append(task)
        if len(by_level) <= 1 or None in by_level:
            return candidates[:n]
        rng = seeded_rng("curriculum", seed)
        chosen: list[Task] = []
        for _ in range(n):
            levels = [level for level, tasks in by_level.items() if tasks]
            level = rng.choices(levels, weights=[self.weight(lv) for lv in levels])[0]
            chosen.append(by_level[level].popleft())
        return chosen

    def observe(self, tasks: Sequence[Task], groups: Sequence[Any]) -> None:
        """Record the outcome of each task's group (a `RolloutGroup`, in task order): how many samples passed.

        A sample passes when its `correct` reward part is 1 (its reward when the env reports no such part),
        so partial credit such as a format reward never counts as solving a level.
        """
        for task, group in zip(tasks, groups, strict=True):
            level = self.env.level_of(task)
            if level is None:
                continue
            passed = sum(_passed(s) for s in group.samples)
            self.history.setdefault(level, deque(maxlen=self.window)).append((passed, len(group.samples)))

    def summary(self) -> dict[str, float | None]:
        """Each observed level's pass rate (for logs)."""
        return {str(level): self.pass_rate(level) for level in self.history}


def _passed(sample: Sample) -> bool:
    parts = getattr(sample, "reward_parts", None) or {}
    value = parts.get("correct", sample.reward)
    return float(value) >= 1.0 - 1e-9
