"""Pre-rollout screening: one cheap forward per candidate task, so a worker avoids generating groups that
would have zero reward variance.

A GRPO group whose G samples all pass or all fail teaches nothing; the trainer drops it, and a worker that
generated it wasted G completions. Which tasks will do that is mostly predictable before generating: for an
environment whose correct completion is essentially one string (`Environment.screen_by_reference`: arith's
`<answer>85</answer>`), the probability p that one sample passes is the probability of that reference
completion under the sampling distribution, and a group of G is informative with probability

    u(p) = 1 - p^G - (1 - p)^G.

`Screen.pick(pool, n)` scores every candidate of a pool drawn from the worker's seeded train stream (`n x
candidates` tasks) with one batched forward of the engine (`WorkerEngine.reference_logprobs`) and keeps the
`n` with the largest u (ties: stream order). Tasks the policy has mastered (p near 1) or cannot yet reach
(p near 0) are skipped before any sampling; they come back by themselves as p moves, since every pool is
scored with the current weights.

Measured on the shipped tiny model, `arith` 2-digit (+, -), 320 train tasks x 8 samples, 4 candidates per
task (`benchmarks/bench_screen.py`): correlation of p with the observed pass rate 0.32 at the shipped model
and 0.83 after 200 steps of `pnyx run`; zero-variance groups among the picked 15.9% -> 4.9% and 23.4% ->
3.0%. `searchqa` is not screened: scoring its reference episode turn by turn (after each tool reply) was
tried; at the end of a default `pnyx run` p correlated 0.54 with the pass rate, but in the run itself
screening took 29% of the worker's time and left the consumed share of generated groups where the
curriculum alone had it (46.6% both): the policy ends near p = 0.9 on most questions, and a group of 8 is
then all-pass about half the time whichever question it asks. The price is the forward over the pool,
recorded by the worker as `screen_seconds` in its heartbeat next to `generate_seconds` (`pnyx run` prints
the share). In `pnyx run` (BENCHMARKS.md) 4 candidates per task raised the consumed share of generated
groups from 80-81% to 92-93%, took 19-21% of the worker's time, and slowed learning per version when on
from the first cohort (pass@1 0.5 at v80 and v110 against v60 and v50): ranking by u prefers p near 1/2
and passes over hard tasks (p near 0.1) whose rare successes carry the most signal. Hence it starts only
once zero-variance groups pile up (`worker.screen_start_above`).

Knows nothing about the store or the trainer. Invariant: every task it returns is a task of the pool,
unchanged (same id, same prompt), so the trainer rebuilds it from its id; which tasks a worker generates is
its own choice, as with the curriculum. An environment that does not declare `screen_by_reference`, or an
engine that cannot score (`reference_logprobs` returns None), gets the pool's first `n` tasks: exactly what
it would have generated without screening.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from pnyx.envs.base import Environment, Task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from pnyx.rollout.engines.base import WorkerEngine
    from pnyx.rollout.sampling import SamplingParams

log = logging.getLogger("pnyx.worker")


def informative(p: float, group_size: int) -> float:
    """u(p) = 1 - p^G - (1 - p)^G: the chance that G independent samples with pass probability p do not all
    agree (0 at p = 0 or 1, largest at p = 1/2)."""
    p = min(1.0, max(0.0, p))
    return 1.0 - p**group_size - (1.0 - p) ** group_size


def all_pass(p: float, group_size: int) -> float:
    """p^G: the chance that G independent samples with pass probability p all pass."""
    return min(1.0, max(0.0, p)) ** group_size


Rule = Literal["mastered", "informative"]


TRIGGER_EMA = 0.05
"""Weight of one cohort in the zero-variance share that starts screening (about the last 20 cohorts)."""


def choose(ps: Sequence[float], n: int, rule: Rule, group_size: int) -> list[int]:
    """Indices (ascending: stream order) of the `n` candidates a rule keeps, given each one's pass probability.

    `informative`: the n largest u(p). `mastered`: the n smallest p^G, the chance of an all-pass group: the
    most mastered candidates are passed over, and tasks the policy cannot solve yet are kept like any
    other (p^G is ~0 for both, ties go to stream order), so early in a run this keeps the stream as drawn.
    """
    if rule == "mastered":
        key = lambda i: (all_pass(ps[i], group_size), i)  # noqa: E731
    else:
        key = lambda i: (-informative(ps[i], group_size), i)  # noqa: E731
    return sorted(sorted(range(len(ps)), key=key)[:n])


class Screen:
    """Picks, from a pool of candidate tasks, those most likely to make a mixed group (module docstring).

    rule: `informative` (the worker's) takes the n largest u(p); `mastered` passes over the candidates most
    likely to give an all-pass group (largest p^G) and is kept for `bench_screen`'s comparison (`choose`). start_above: screening starts once the share
    of zero-variance groups among this worker's recent cohorts (`observe`) exceeds it, and then stays on;
    0 starts at once."""

    def __init__(
        self,
        env: Environment,
        engine: WorkerEngine,
        tokenizer: PreTrainedTokenizerBase,
        candidates: int,
        group_size: int,
        rule: Rule = "informative",
        start_above: float = 0.0,
    ):
        self.env = env
        self.engine = engine
        self.tokenizer = tokenizer
        self.candidates = max(1, int(candidates))
        self.group_size = group_size
        self.rule: Rule = rule
        self.start_above = start_above
        self.zero_variance = 0.0
        """Share of zero-variance groups among recent cohorts (EMA, weight TRIGGER_EMA)."""
        self.started = start_above <= 0
        self.enabled = self.candidates > 1 and bool(getattr(env, "screen_by_reference", False))
        self.seconds = 0.0
        """Time spent scoring pools (the screening's whole cost)."""
        self.scored = 0
        """Candidate tasks scored."""
        self.last_p: list[float] = []
        """p of the tasks picked by the last `pick` (for logs and tests)."""

    def observe(self, zero_variance: int, groups: int) -> None:
        """Record one generated cohort: `zero_variance` of its `groups` had all rewards equal."""
        if groups <= 0 or self.started:
            return
        self.zero_variance += TRIGGER_EMA * (zero_variance / groups - self.zero_variance)
        if self.zero_variance > self.start_above:
            self.started = True
            if self.enabled:
                log.info(
                    "screening on: %.0f%% of recent groups had zero variance (start_above %.0f%%)",
                    100 * self.zero_variance, 100 * self.start_above,
                )  # fmt: skip

    def pool_size(self, n: int) -> int:
        """How many candidates to draw for `n` tasks."""
        return n * self.candidates if self.enabled and self.started else n

    def pick(self, pool: Sequence[Task], n: int, params: SamplingParams) -> list[Task]:
        """The `n` tasks of `pool` with the largest u(p); `pool[:n]` when screening is off or cannot run."""
        from pnyx.models import render_prompt

        if not self.enabled or not self.started or len(pool) <= n:
            return list(pool[:n])
        t0 = time.perf_counter()
        prompts = [list(render_prompt(self.tokenizer, t.prompt)) for t in pool]
        refs = []
        for task in pool:
            ref = self.env.reference_completion(task)
            if not isinstance(ref, str):  # multi-turn references are not screened
                self.enabled = False
                return list(pool[:n])
            refs.append(self.tokenizer.encode(ref, add_special_tokens=False))
        totals = self.engine.reference_logprobs(prompts, refs, params)
        if totals is None:
            log.info("screening off: engine %s cannot score completions", getattr(self.engine, "name", "?"))
            self.enabled = False
            return list(pool[:n])
        ps = [math.exp(min(0.0, float(lp))) if math.isfinite(lp) else 0.0 for lp in totals]
        order = choose(ps, n, self.rule, self.group_size)
        self.seconds += time.perf_counter() - t0
        self.scored += len(pool)
        self.last_p = [ps[i] for i in order]
        return [pool[i] for i in order]
