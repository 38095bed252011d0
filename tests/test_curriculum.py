"""Online difficulty filtering: the curriculum moves to levels the policy solves sometimes, keeps exploring
the others so a level can come back, never changes a task, and is wired into the worker's loop.

The "model" here is a fake skill (which arith levels it solves, and how often), first fed to the curriculum
directly, then behind a fake engine inside a real `Worker` on a real store.
"""

from __future__ import annotations

import random
import re
import time
from collections import Counter
from types import SimpleNamespace

import pytest
from worker_support import create_signed_run

from pnyx.envs import get_env
from pnyx.rollout.curriculum import Curriculum

pytestmark = pytest.mark.timeout(120)

GROUP = 8


def solves(skill: dict[int, float], digits: int, rng: random.Random) -> bool:
    return rng.random() < skill.get(digits, 0.0)


def fake_group(skill: dict[int, float], digits: int, rng: random.Random) -> SimpleNamespace:
    samples = []
    for _ in range(GROUP):
        ok = float(solves(skill, digits, rng))
        samples.append(SimpleNamespace(reward=ok, reward_parts={"correct": ok, "format": 1.0}))
    return SimpleNamespace(samples=samples)


def run_cohorts(curriculum: Curriculum, skill: dict[int, float], cohorts: int, first_seed: int) -> Counter:
    """`cohorts` rounds of sample(4) → score with `skill` → observe; the digit counts drawn."""
    rng = random.Random(first_seed)
    drawn: Counter = Counter()
    for c in range(cohorts):
        tasks = curriculum.sample(first_seed + c, 4)
        groups = [fake_group(skill, t.meta["digits"], rng) for t in tasks]
        curriculum.observe(tasks, groups)
        drawn.update(t.meta["digits"] for t in tasks)
    return drawn


def test_curriculum_moves_to_the_level_solved_only_sometimes():
    env = get_env("arith", digits=[1, 2, 3, 4], ops=["+"])
    curriculum = Curriculum(env)
    skill = {1: 1.0, 2: 0.5}  # 1 digit always right, 2 digits half the time, 3-4 digits never
    run_cohorts(curriculum, skill, 10, first_seed=0)  # warm-up: every level gets observed
    drawn = run_cohorts(curriculum, skill, 40, first_seed=100)
    assert (
        curriculum.pass_rate("1+") == 1.0 and curriculum.pass_rate("3+") == curriculum.pass_rate("4+") == 0.0
    )
    assert drawn[2] / sum(drawn.values()) > 0.7  # the plain stream draws each level 25% of the time
    assert all(drawn[d] < drawn[2] / 5 for d in (1, 3, 4))


def test_a_level_comes_back_when_its_pass_rate_moves():
    env = get_env("arith", digits=[1, 2, 3, 4], ops=["+"])
    curriculum = Curriculum(env)
    run_cohorts(curriculum, {1: 1.0, 2: 0.5}, 40, first_seed=0)
    # The policy learned: 2 digits are now always right, 3 digits half the time. Only exploration can
    # notice that 3 digits stopped failing.
    drawn = run_cohorts(curriculum, {1: 1.0, 2: 1.0, 3: 0.5}, 80, first_seed=1000)
    late = run_cohorts(curriculum, {1: 1.0, 2: 1.0, 3: 0.5}, 20, first_seed=5000)
    assert drawn[3] > 0 and late[3] / sum(late.values()) > 0.6


def test_every_task_is_an_unchanged_task_of_the_seeded_train_stream():
    env = get_env("arith", digits=[1, 2, 3, 4])
    curriculum = Curriculum(env)
    run_cohorts(curriculum, {1: 1.0, 2: 0.5}, 5, first_seed=0)
    stream = {t.id: t for t in env.sample("train", 7, 4 * curriculum.oversample)}
    for task in curriculum.sample(7, 4):
        assert stream[task.id] == task == env.task(task.id)


def test_a_curriculum_that_has_observed_nothing_returns_the_plain_stream():
    for env in (get_env("gsm8k"), get_env("arith", digits=[1, 2, 3, 4])):
        assert Curriculum(env).sample(3, 4) == env.sample("train", 3, 4)


# --- wired into the worker ------------------------------------------------------------------------------


class SkillEngine:
    """A fake engine: answers `Compute a+b.` right with the probability `skill[digits of a]`."""

    name = "torch"

    def __init__(self, tokenizer, skill: dict[int, float]):
        self.tokenizer, self.skill, self.rng = tokenizer, skill, random.Random(0)

    def generate(self, prompt_ids, params):
        from pnyx.rollout.sampling import Completion

        out = []
        for ids in prompt_ids:
            prompt = self.tokenizer.decode(ids, skip_special_tokens=True)
            a, b = map(int, re.findall(r"Compute (\d+)\+(\d+)\.", prompt)[-1])
            answer = a + b if solves(self.skill, len(str(a)), self.rng) else a + b + 1
            text = f"<answer>{answer}</answer>"
            tokens = self.tokenizer.encode(text, add_special_tokens=False)
            out.append(Completion(tokens, [-1.0] * len(tokens), "stop", text, "</answer>"))
        return out


def test_worker_with_curriculum_on_makes_most_groups_at_the_informative_level(tmp_path, tiny_model_dir):
    import torch

    from pnyx.config import load_config
    from pnyx.models import load_model, tokenizer_digest
    from pnyx.protocol import decode_group, layout
    from pnyx.rollout.worker import Worker, WorkerOptions
    from pnyx.store import open_store
    from pnyx.weights.publisher import Publisher

    torch.set_num_threads(1)
    store = open_store(tmp_path / "run")
    cfg = load_config(overrides={
        "model": {"path": str(tiny_model_dir)},
        "env": {"name": "arith", "kwargs": {"digits": [1, 2, 3, 4], "ops": ["+"]}},
        "worker": {"group_size": 4, "prompts_per_cohort": 4, "max_new_tokens": 8, "curriculum": True,
                   "poll_interval_s": 0.05, "heartbeat_interval_s": 5.0,
                   # every group made is uploaded (no trainer paces it; zero-variance ones are counted too)
                   "supply_control": False, "skip_zero_variance": False},
        # no trainer publishes a second version: without a flood limit the worker's per-version cap is off
        "security": {"flood_limit": None},
    })  # fmt: skip
    model = load_model(tiny_model_dir)
    info = {"vocab_size": int(model.config.vocab_size), "tokenizer_digest": tokenizer_digest(tiny_model_dir),
            "model_type": model.config.model_type}  # fmt: skip
    _, signer = create_signed_run(store, cfg.model_dump(mode="json"), info)
    Publisher(store, signer=signer).publish(
        0, {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    )

    worker = Worker(store, WorkerOptions(worker_id="w1"))
    worker.join()
    try:
        worker.gen.engine = SkillEngine(worker.gen.tokenizer, {1: 1.0, 2: 0.5})
        for _ in range(30):
            worker.step()
        end = time.monotonic() + 60
        while len(worker.link.spool) and time.monotonic() < end:  # the courier uploads in the background
            time.sleep(0.05)
    finally:
        worker.close()
    groups = [decode_group(store.get(m.key)) for m in store.list(layout.ROLLOUTS_PREFIX)]
    env = get_env("arith", digits=[1, 2, 3, 4], ops=["+"])
    late = Counter(env.task(g.task_id).meta["digits"] for g in sorted(groups, key=lambda g: g.seq)[60:])
    assert len(groups) == 120 and late[2] / sum(late.values()) > 0.6
    assert worker.gen.curriculum.pass_rate("3+") == 0.0 and worker.gen.curriculum.pass_rate("1+") == 1.0
