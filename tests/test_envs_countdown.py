"""`countdown`: the safe expression evaluator and the number-usage rules."""

from __future__ import annotations

from fractions import Fraction

import pytest

from pnyx.envs import Task, get_env
from pnyx.envs.countdown import ExprError, evaluate


def _task(numbers: list[int], target: int) -> Task:
    return Task(
        id="countdown/train/0/0", prompt="", answer={"numbers": numbers, "target": target, "solution": ""}
    )


def test_evaluator_respects_precedence_and_parentheses():
    assert evaluate("2+3*4")[0] == 14
    assert evaluate("(2+3)*4")[0] == 20
    assert evaluate("8-3-2")[0] == 3
    assert evaluate("7/2")[0] == Fraction(7, 2)
    assert evaluate("(50 + 25) = 75") == (75, [50, 25])


def test_evaluator_refuses_what_is_not_arithmetic():
    for expr, reason in [
        ("__import__('os')", "bad_character"),
        ("2**3", "unexpected_token"),
        ("-3+5", "unexpected_token"),
        ("(1+2", "unexpected_end"),
        ("1+2)", "trailing_tokens"),
        ("4/(2-2)", "division_by_zero"),
        ("(" * 20 + "1" + ")" * 20, "nesting_too_deep"),
        ("1234567+1", "number_too_long"),
    ]:
        with pytest.raises(ExprError) as e:
            evaluate(expr)
        assert e.value.reason == reason, expr


def test_exact_division_reaches_the_target():
    env = get_env("countdown")
    assert env.score(_task([3, 6, 4], 8), "<answer>(6/3)*4</answer>").reward == 1.0
    # 7/2*2 is exactly 7 with fractions (float rounding could disagree; Fraction cannot).
    assert env.score(_task([7, 2, 2], 7), "<answer>7/2*2</answer>").reward == 1.0


def test_each_number_at_most_once():
    env = get_env("countdown")
    score = env.score(_task([5, 3], 25), "<answer>5*5</answer>")
    assert score.reward == 0.0 and score.reason == "number_reused"
    # a number given twice may be used twice
    assert env.score(_task([5, 5, 3], 25), "<answer>5*5</answer>").reward == 1.0


def test_numbers_not_given_are_refused():
    score = get_env("countdown").score(_task([5, 3], 8), "<answer>4+4</answer>")
    assert score.reward == 0.0 and score.reason == "number_not_available"


def test_not_every_number_needs_to_be_used():
    assert get_env("countdown").score(_task([5, 3, 9], 8), "<answer>5+3</answer>").reward == 1.0


def test_generated_targets_are_within_bounds_and_solutions_use_given_numbers():
    env = get_env("countdown", num_numbers=5, max_number=20, max_target=200)
    for task in env.sample("train", seed=0, n=40):
        numbers, target = task.answer["numbers"], task.answer["target"]
        assert len(numbers) == 5 and all(1 <= x <= 20 for x in numbers)
        assert 1 <= target <= 200
        assert str(target) in task.prompt[-1]["content"]
