"""The worker's task selection remembers problems: a problem last seen all-pass or all-fail is passed over
while its class keeps making zero-variance groups, comes back when its outcome is forgotten, and the
selection wastes far fewer groups than the plain stream; environments name their problems and levels.

The "policy" is a fake skill per problem (solved always, never, or half the time), fed to the curriculum
directly: deterministic, no model.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from pnyx.envs import get_env, stable_hash
from pnyx.protocol.rules import is_zero_variance
from pnyx.rollout.curriculum import Curriculum, ProblemMemory

GROUP = 8


def skill(problem: str) -> float:
    """A fixed pass probability per problem: 60% always solved, 20% never, 20% half the time."""
    bucket = stable_hash("skill", problem) % 10
    return 1.0 if bucket < 6 else 0.0 if bucket < 8 else 0.5


def group_for(env, task, rng: random.Random) -> SimpleNamespace:
    p = skill(str(env.problem_key(task)))
    samples = []
    for _ in range(GROUP):
        ok = float(rng.random() < p)
        samples.append(SimpleNamespace(reward=ok, reward_parts={"correct": ok}))
    return SimpleNamespace(samples=samples)


def zero_variance_share(env, cohorts: int, curriculum: Curriculum | None, first_seed: int = 0) -> float:
    """Share of zero-variance groups over the last half of `cohorts` cohorts of 4 tasks (one version per
    cohort), picked by `curriculum` (None: the plain stream)."""
    rng = random.Random(first_seed)
    zero = total = 0
    for c in range(cohorts):
        seed = first_seed + c
        tasks = curriculum.sample(seed, 4, c) if curriculum else env.sample("train", seed, 4)
        groups = [group_for(env, t, rng) for t in tasks]
        if curriculum:
            curriculum.observe(tasks, groups, c)
        if c >= cohorts // 2:
            zero += sum(is_zero_variance([s.reward for s in g.samples]) for g in groups)
            total += len(groups)
    return zero / total


def test_remembering_problems_cuts_zero_variance_groups_on_a_small_problem_set():
    # one-digit additions: 100 problems, each recurring under many task ids, all of one level
    env = get_env("arith", digits=1, ops=["+"])
    plain = zero_variance_share(env, 200, None)
    chosen = zero_variance_share(env, 200, Curriculum(env))
    assert plain > 0.7  # 80% of the problems are always or never solved
    assert chosen < 0.35


def test_a_problem_last_seen_all_pass_is_passed_over_while_such_problems_stay_all_pass():
    env = get_env("arith", digits=1, ops=["+"])
    curriculum = Curriculum(env)
    tasks = env.sample("train", 0, 80)
    keys = {env.problem_key(t) for t in tasks[:40]}
    solved, other = (
        [t for t in tasks if env.problem_key(t) in keys],
        [t for t in tasks if env.problem_key(t) not in keys],
    )
    all_pass = SimpleNamespace(samples=[SimpleNamespace(reward=1.0, reward_parts={"correct": 1.0})] * GROUP)
    half = SimpleNamespace(
        samples=[SimpleNamespace(reward=float(i % 2), reward_parts={}) for i in range(GROUP)]
    )
    for task in solved * 2:  # new, then passed: both times all-pass
        curriculum.observe([task], [all_pass], version=0)
    for task in other:  # new problems make mixed groups
        curriculum.observe([task], [half], version=0)
    level = env.level_of(tasks[0])
    assert curriculum.share((level, "passed", False)) == 0.0 and curriculum.share((level, "new", False)) > 0.5
    picked = [t for seed in range(100, 150) for t in curriculum.sample(seed, 4, version=1)]
    stream = [t for seed in range(100, 150) for t in env.sample("train", seed, 4)]
    in_stream = sum(env.problem_key(t) in keys for t in stream) / len(stream)
    in_picked = sum(env.problem_key(t) in keys for t in picked) / len(picked)
    assert in_stream > 0.25 and in_picked < 0.1


def test_an_outcome_becomes_old_after_old_after_versions():
    memory = ProblemMemory(old_after=10)
    memory.record("3+4", "passed", version=5)
    assert memory.state("3+4", 15) == ("passed", False)
    assert memory.state("3+4", 16) == ("passed", True)
    assert memory.state("5+5", 5) == ("new", False)


def test_old_failures_are_measured_apart_and_come_back_when_they_turn_solvable():
    env = get_env("arith", digits=1, ops=["+"])
    curriculum = Curriculum(env, old_after=10)
    level = env.level_of(env.sample("train", 0, 1)[0])
    tasks = env.sample("train", 0, 60)
    fail = SimpleNamespace(samples=[SimpleNamespace(reward=0.0, reward_parts={"correct": 0.0})] * GROUP)
    half = SimpleNamespace(
        samples=[SimpleNamespace(reward=float(i % 2), reward_parts={}) for i in range(GROUP)]
    )
    for t in tasks:  # every problem seen failing at v0; the recent failures stay failures
        curriculum.observe([t], [fail], version=0)
    for t in tasks[:20]:
        curriculum.observe([t], [fail], version=1)
    for t in tasks[20:40]:  # ... but problems that failed long ago are now half solved
        curriculum.observe([t], [half], version=30)
    assert curriculum.share((level, "failed", False)) == 0.0
    assert curriculum.share((level, "failed", True)) == 1.0


def test_the_memory_is_bounded_and_forgets_the_least_recently_observed_problem():
    memory = ProblemMemory(capacity=2)
    memory.record("a", "passed", 0)
    memory.record("b", "failed", 0)
    memory.record("a", "mixed", 1)  # a is now the most recent
    memory.record("c", "passed", 1)
    assert len(memory) == 2
    assert [memory.state(k, 1)[0] for k in "abc"] == ["mixed", "new", "passed"]


def test_a_cohort_never_holds_one_problem_twice_when_others_are_left():
    env = get_env("arith", digits=1, ops=["+"])
    curriculum = Curriculum(env)
    rng = random.Random(0)
    for seed in range(30):  # observations give the candidates different weights
        tasks = curriculum.sample(seed, 4, seed)
        curriculum.observe(tasks, [group_for(env, t, rng) for t in tasks], seed)
    for seed in range(100, 200):
        keys = [env.problem_key(t) for t in curriculum.sample(seed, 8, 30)]
        assert len(set(keys)) == len(keys)


def test_searchqa_names_a_question_as_its_problem_and_the_asked_attribute_as_its_level():
    env = get_env("searchqa", num_people=20)
    tasks = env.sample("train", 0, 200)
    assert {env.level_of(t) for t in tasks} == {"city", "year", "job"}
    by_question: dict[str, set[str]] = {}
    for t in tasks:
        by_question.setdefault(str(env.problem_key(t)), set()).add(t.id)
    assert len(by_question) < len(tasks)  # 60 questions: each recurs under several task ids
    assert all(env.problem_key(env.task(t.id)) == env.problem_key(t) for t in tasks)


def test_arith_names_its_problem_across_task_ids():
    env = get_env("arith", digits=1, ops=["+"])
    tasks = env.sample("train", 0, 300)
    assert len({env.problem_key(t) for t in tasks}) < len({t.id for t in tasks})
    assert all(env.problem_key(t) == t.meta["problem"] for t in tasks)


@pytest.mark.parametrize(
    ("settings", "on"),
    [
        ({"skip_zero_variance": True}, True),  # the default run: skip zero-variance groups, so avoid them
        ({"skip_zero_variance": False}, False),  # every group uploaded: the plain stream
        ({"skip_zero_variance": False, "curriculum": True}, True),
        ({"skip_zero_variance": True, "curriculum": False}, False),
    ],
)
def test_the_worker_selects_tasks_by_default_whenever_it_skips_zero_variance_groups(
    tmp_path, tiny_model_dir, settings, on
):
    from worker_support import make_run

    from pnyx.config_sections import WorkerConfig
    from pnyx.rollout.worker import Worker, WorkerOptions

    assert WorkerConfig().curriculum is None and WorkerConfig().skip_zero_variance
    run = make_run(str(tmp_path / "run"), tiny_model_dir, **settings)
    worker = Worker(run.store, WorkerOptions(worker_id="w1"))
    worker.join()
    try:
        assert worker.gen is not None and (worker.gen.curriculum is not None) == on
    finally:
        worker.close()
