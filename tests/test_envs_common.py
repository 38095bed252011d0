"""Properties every built-in environment keeps: correct answers score 1, wrong ones 0, broken format 0
with a reason, hostile text never raises, streams are reproducible, ids rebuild tasks, splits are disjoint."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pnyx.envs import Environment, Score, Task, get_env

pytestmark = pytest.mark.timeout(90)

# Each built-in with a small configuration (small problem spaces make the split test discriminating:
# without the hash bucket, the two streams would share problems).
SMALL: dict[str, dict] = {
    "arith": {"digits": 1, "ops": ["+"]},
    "countdown": {"num_numbers": 2, "max_number": 6, "max_target": 40},
    "gsm8k": {},
    "searchqa": {"num_people": 20},
    "reasoning_gym": {
        "dataset": "basic_arithmetic",
        "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    },
}
DEFAULT: dict[str, dict] = {
    "arith": {},
    "countdown": {},
    "gsm8k": {},
    "searchqa": {"num_people": 100},
    "reasoning_gym": {"dataset": "chain_sum"},
}
NAMES = sorted(DEFAULT)

_cache: dict[tuple[str, str], Environment] = {}


def env_for(name: str, size: str = "default") -> Environment:
    key = (name, size)
    if key not in _cache:
        _cache[key] = get_env(name, **(SMALL if size == "small" else DEFAULT)[name])
    return _cache[key]


def full_text(completion) -> str:
    return completion if isinstance(completion, str) else "".join(text for _, text in completion)


def wrong_completion(env: Environment, task: Task) -> str:
    """A well-formed completion with a wrong answer."""
    if env.name == "countdown":
        wrong = next(x for x in task.answer["numbers"] if x != task.answer["target"])
        return f"<answer>{wrong}</answer>"
    if env.name == "searchqa":
        turns = env.reference_completion(task)
        return full_text(turns[:-1]) + "<answer>nobody knows</answer>"
    if env.name == "reasoning_gym":
        return f"<answer>{int(task.answer['answer']) + 1}</answer>"
    if env.name == "gsm8k":
        return f"<answer>{float(task.answer) + 1}</answer>"
    return f"<answer>{task.answer + 1}</answer>"


def broken_completion(env: Environment, task: Task) -> str:
    """The right answer, but without the answer tag."""
    text = full_text(env.reference_completion(task))
    return text.replace("<answer>", "The answer is ").replace("</answer>", ".")


def prompt_text(task: Task) -> str:
    return task.prompt if isinstance(task.prompt, str) else task.prompt[-1]["content"]


def _hostile() -> list[str]:
    rng = random.Random(0)
    binary = bytes(rng.randrange(256) for _ in range(4096)).decode("latin-1")
    return [
        "",
        "   \n\t ",
        "\x00" * 1000,
        binary,
        "\ud800\udfff lone surrogates",
        "🙂" * 5000,
        "<answer>",
        "</answer>",
        "<answer>" * 20_000,
        "</answer>" * 20_000,
        "<answer><answer>1</answer>",
        "<answer>1</answer></answer>",
        "<answer>" + "9" * 200_000 + "</answer>",
        "<answer>1e999999</answer>",
        "<answer>-1e-999999</answer>",
        "<answer>10^{10^{10}}</answer>",
        "<answer>9999999!</answer>",
        "<answer>2**2**2**2**2**2</answer>",
        "<answer>" + "(" * 10_000 + "1" + ")" * 10_000 + "</answer>",
        "<answer>" + "1+" * 10_000 + "1</answer>",
        "<answer>__import__('os').system('echo pwned')</answer>",
        "<answer>\\boxed{" + "{" * 5000 + "</answer>",
        "\\boxed{" * 5000,
        "<answer>nan</answer>",
        "<answer>inf</answer>",
        "<answer>" + "a " * 50_000 + "</answer>",
        "<search>" * 5000 + "<information>" * 5000,
        "<search>" + "x" * 100_000 + "</search>",
        "<information><answer>1</answer>",
        "x" * 2_000_000,
    ]


HOSTILE = _hostile()


@pytest.mark.parametrize("name", NAMES)
def test_reference_completions_score_one_in_both_splits(name):
    env = env_for(name)
    for split in ("train", "test"):
        for task in env.sample(split, seed=3, n=8):
            score = env.score(task, full_text(env.reference_completion(task)))
            assert score.reward == 1.0, (task, score)
            assert score.parts["correct"] == 1.0 and score.parts["format"] == 1.0
            assert score.reason is None


@pytest.mark.parametrize("name", NAMES)
def test_wrong_answers_score_zero_with_reason(name):
    env = env_for(name)
    for task in env.sample("train", seed=4, n=8):
        score = env.score(task, wrong_completion(env, task))
        assert score.reward == 0.0 and score.parts["correct"] == 0.0, (task, score)
        assert score.reason


@pytest.mark.parametrize("name", NAMES)
def test_format_broken_output_scores_zero_with_reason(name):
    env = env_for(name)
    for task in env.sample("train", seed=5, n=4):
        score = env.score(task, broken_completion(env, task))
        assert score.reward == 0.0 and score.parts["format"] == 0.0, (task, score)
        assert score.reason


@pytest.mark.parametrize("name", NAMES)
def test_hostile_strings_never_raise_and_score_zero(name):
    env = env_for(name)
    task = env.sample("train", seed=6, n=1)[0]
    for text in HOSTILE:
        score = env.score(task, text)
        assert isinstance(score, Score)
        assert score.reward == 0.0, (text[:80], score)
        assert score.reason, text[:80]
        assert set(env.part_names) <= set(score.parts)
    assert env.score(task, None).reward == 0.0  # type: ignore[arg-type]


@pytest.mark.parametrize("name", NAMES)
def test_hostile_strings_never_make_respond_raise(name):
    env = env_for(name)
    task = env.sample("train", seed=6, n=1)[0]
    for text in HOSTILE:
        reply = env.respond(task, text)
        assert reply is None or isinstance(reply, str)


@pytest.mark.parametrize("name", NAMES)
def test_seeded_streams_are_reproducible_and_seed_dependent(name):
    env = env_for(name)
    a = env.sample("train", seed=11, n=10)
    assert a == env.sample("train", seed=11, n=10)
    assert a[4:] == env.sample("train", seed=11, n=6, start=4)
    assert [prompt_text(t) for t in a] != [prompt_text(t) for t in env.sample("train", seed=12, n=10)]


@pytest.mark.parametrize("name", NAMES)
def test_task_id_rebuilds_the_task_in_a_fresh_environment(name):
    tasks = env_for(name).sample("train", seed=7, n=5) + env_for(name).sample("test", seed=7, n=5)
    fresh = get_env(name, **DEFAULT[name])
    for task in tasks:
        assert fresh.task(task.id) == task


@pytest.mark.parametrize("name", NAMES)
def test_train_and_test_splits_never_share_a_problem(name):
    env = env_for(name, "small")
    train = {prompt_text(t) for t in env.sample("train", seed=0, n=300)}
    test = {prompt_text(t) for t in env.sample("test", seed=0, n=100)}
    assert len(test) >= 2 and len(train) >= 10
    assert not train & test


_FRAGMENTS = st.sampled_from(
    ["<answer>", "</answer>", "<search>", "</search>", "<information>", "</information>", "\\boxed{", "{", "}",
     "(", ")", "+", "-", "*", "/", "^", "!", "=", "e", "1", "9" * 50, "0", ".", ",", "$", " ", "\n", "Tamsk", "\x00"]
)  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(_FRAGMENTS | st.text(max_size=8), max_size=40))
def test_random_tag_soup_never_raises(name, pieces):
    env = env_for(name)
    task = env.sample("train", seed=6, n=1)[0]
    text = "".join(pieces)
    score = env.score(task, text)
    assert 0.0 <= score.reward <= 1.0
    assert score.reward == 0.0 or score.reason is None
    env.respond(task, text)
