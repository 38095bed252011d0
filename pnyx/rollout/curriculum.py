"""Online task selection from what the run measures: a worker prefers tasks likely to make a group with mixed
rewards, judged by each problem's last outcome and each difficulty level's recent record.

A GRPO group whose completions all get the same reward teaches nothing; the worker skips it and the
trainer would drop it, so generating it was waste. `Curriculum.sample(seed, n, version)` replaces
`env.sample("train", seed, n)` in a worker: it draws `n * OVERSAMPLE` candidates from the same seeded
train stream and picks `n` of them by what this worker has seen:

- a *problem memory* (`ProblemMemory`): for each problem (`env.problem_key`: arith `37+48`, searchqa the
  question; a problem recurs under many task ids) the state its last group left it in: `passed` (every
  sample solved it), `failed` (none did), `edge` (all but one agreed) or `mixed`, and the policy version
  that made it; a problem never observed is `new`. Bounded: the least recently observed are forgotten.
- a *record per class*, a class being (level, state, old): the env's difficulty level (`env.level_of`:
  arith digits and operator, countdown how many numbers, searchqa the asked attribute; None without
  levels), the problem's state, and whether that outcome is more than `OLD_AFTER` versions old (an old
  failure may be solvable now; old and recent outcomes are measured apart). Its *share* is the fraction
  of its last `window` observed groups that had mixed rewards: what a group of that class is worth to the
  trainer now. A class not yet observed counts as 1, so every class gets measured.

Each pick is, with probability `explore`, a uniform draw from the candidates left (so a class whose share
moves, as the policy learns or forgets, is noticed), otherwise a draw weighted by `(share / best)^SHARPNESS`,
`best` the largest share among the candidates left: candidates of the best classes are taken, those of
classes a few times less likely to be informative almost never, and classes with close shares (arith's
`2+` and `2-`, both new) are mixed as drawn. When every candidate left weighs the same (nothing observed
yet), the pick is the next one in stream order, so a fresh curriculum returns the stream's first `n`
tasks. A problem is picked at most once per cohort.

Knows nothing about models, the store or the trainer. Invariant: every task it returns is a task of the
env's seeded train stream, unchanged (same id, same prompt), so the trainer rebuilds it from its id; the
choice among them is the worker's alone. Deterministic: the same observations and seed give the same pick.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pnyx.envs.base import Environment, Task, seeded_rng
from pnyx.protocol.records import Sample
from pnyx.protocol.rules import is_zero_variance

State = Literal["new", "mixed", "edge", "passed", "failed"]
Class = tuple[Hashable, State, bool]

OVERSAMPLE = 32
"""Candidates drawn per task returned: late in a run most problems are remembered as solved, and the pool
must still hold enough of the informative ones (drawing a candidate costs no generation)."""
EXPLORE = 0.05
"""The chance that a pick ignores the record and draws uniformly from the candidates left."""
WINDOW = 16
"""A class's share is measured over its last this many observed groups."""
OLD_AFTER = 50
"""A problem's last outcome is `old` once it is more than this many policy versions old: old and recent
outcomes are separate classes, measured separately (an old failure may be solvable now)."""
SHARPNESS = 4.0
"""A candidate's weight is `(share / best)^SHARPNESS`: a class half as informative as the best weighs 1/16."""
CAPACITY = 1 << 17
"""Problems remembered at most (the least recently observed are forgotten first)."""


@dataclass(frozen=True)
class Outcome:
    """The last group of one problem: its state and the policy version that generated it."""

    state: State
    version: int


class ProblemMemory:
    """The last outcome of each recently observed problem, at most `capacity` of them (least recent out)."""

    def __init__(self, capacity: int = CAPACITY, old_after: int = OLD_AFTER):
        self.capacity = max(1, int(capacity))
        self.old_after = old_after
        self._last: OrderedDict[Hashable, Outcome] = OrderedDict()

    def __len__(self) -> int:
        return len(self._last)

    def record(self, key: Hashable, state: State, version: int) -> None:
        self._last[key] = Outcome(state, version)
        self._last.move_to_end(key)
        while len(self._last) > self.capacity:
            self._last.popitem(last=False)

    def state(self, key: Hashable, version: int) -> tuple[State, bool]:
        """(the problem's last state, whether it is more than `old_after` versions old); ("new", False) for
        a problem not remembered."""
        last = self._last.get(key)
        if last is None:
            return "new", False
        return last.state, version - last.version > self.old_after


class Curriculum:
    """Chooses a worker's training tasks from its own measurements (see the module docstring)."""

    def __init__(
        self,
        env: Environment,
        window: int = WINDOW,
        explore: float = EXPLORE,
        old_after: int = OLD_AFTER,
        capacity: int = CAPACITY,
        oversample: int = OVERSAMPLE,
    ):
        self.env = env
        self.window = window
        self.explore = explore
        self.oversample = max(1, int(oversample))
        self.memory = ProblemMemory(capacity, old_after)
        self.shares: dict[Class, deque[bool]] = {}
        """Per class: whether each of its last `window` groups had mixed rewards."""
        self.levels: dict[Hashable, deque[tuple[int, int]]] = {}
        """Per level: (samples passed, samples) of its last `window` groups (read only by `pass_rate`)."""

    def classify(self, task: Task, version: int) -> Class:
        """The task's class: (its level, its problem's state at `version`, whether that state is old)."""
        return self.env.level_of(task), *self.memory.state(self.env.problem_key(task), version)

    def share(self, cls: Class) -> float:
        """Fraction of the class's recent groups with mixed rewards; 1 when it has none yet."""
        record = self.shares.get(cls)
        return sum(record) / len(record) if record else 1.0

    def pass_rate(self, level: Hashable) -> float | None:
        """Passed / total samples of `level` over its last `window` groups; None if never observed."""
        groups = self.levels.get(level)
        total = sum(n for _, n in groups) if groups else 0
        return sum(c for c, _ in groups) / total if groups and total else None

    def sample(self, seed: int, n: int, version: int = 0) -> list[Task]:
        """`n` tasks of the train stream for `seed`, preferring those likely to make a mixed group at
        policy `version`."""
        candidates = self.env.sample("train", seed, n * self.oversample)
        rng = seeded_rng("curriculum", seed)
        keys = [self.env.problem_key(t) for t in candidates]
        weights = [self.share(self.classify(t, version)) for t in candidates]
        left = list(range(len(candidates)))
        chosen: list[int] = []
        taken: set[Hashable] = set()
        while left and len(chosen) < n:
            distinct = [i for i in left if keys[i] not in taken]
            pool = distinct or left  # a problem twice in one cohort only when nothing else is left
            best = max(weights[i] for i in pool)
            if all(weights[j] == best for j in pool):
                i = pool[0]  # nothing to prefer (e.g. nothing observed yet): the stream as drawn
            elif rng.random() < self.explore or best <= 0.0:
                i = rng.choice(pool)
            else:
                i = rng.choices(pool, weights=[(weights[j] / best) ** SHARPNESS for j in pool])[0]
            chosen.append(i)
            left.remove(i)
            taken.add(keys[i])
        return [candidates[i] for i in sorted(chosen)]  # stream order

    def observe(self, tasks: Sequence[Task], groups: Sequence[Any], version: int = 0) -> None:
        """Record each task's group (a `RolloutGroup`, in task order), generated at policy `version` (the
        version the tasks were classified at: a class's share is what its groups turned out to be).

        A sample passes when its `correct` reward part is 1 (its reward when the env reports no such part);
        a group is mixed when its rewards differ (the trainer's own test), so partial credit such as a
        format reward can make a group informative without any sample passing.
        """
        for task, group in zip(tasks, groups, strict=True):
            cls = self.classify(task, version)
            mixed = not is_zero_variance([s.reward for s in group.samples])
            self.shares.setdefault(cls, deque(maxlen=self.window)).append(mixed)
            passed = sum(_passed(s) for s in group.samples)
            self.memory.record(self.env.problem_key(task), _state(group.samples, mixed, passed), version)
            level = cls[0]
            if level is not None:
                self.levels.setdefault(level, deque(maxlen=self.window)).append((passed, len(group.samples)))

    def summary(self) -> dict[str, float]:
        """Each observed class's share of mixed groups (for logs)."""
        return {"/".join(map(str, cls)): self.share(cls) for cls in self.shares}


def _state(samples: Sequence[Sample], mixed: bool, passed: int) -> State:
    if mixed:
        return "edge" if passed in (1, len(samples) - 1) else "mixed"
    return "passed" if passed * 2 >= len(samples) else "failed"


def _passed(sample: Sample) -> bool:
    parts = getattr(sample, "reward_parts", None) or {}
    value = parts.get("correct", sample.reward)
    return float(value) >= 1.0 - 1e-9
