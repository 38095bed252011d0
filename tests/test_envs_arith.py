"""`arith`: the prompt/answer format other parts depend on, difficulty levels, and answer parsing."""

from __future__ import annotations

import re

import pytest

from pnyx.envs import get_env
from pnyx.errors import ConfigError


def test_prompt_is_the_system_prompt_then_one_user_message_in_the_fixed_format():
    task = get_env("arith").sample("train", seed=0, n=1)[0]
    assert [m["role"] for m in task.prompt] == ["system", "user"]
    assert "<answer>42</answer>" in task.prompt[0]["content"]  # the format, with an example
    m = re.fullmatch(r"Compute (\d+)([+-])(\d+)\.", task.prompt[1]["content"])
    assert m, task.prompt
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    assert task.answer == (a + b if op == "+" else a - b)
    assert re.fullmatch(r"arith/train/0/0", task.id)


def test_reference_completion_is_the_answer_tag_and_stop_string_is_its_end():
    env = get_env("arith")
    task = env.sample("train", seed=0, n=1)[0]
    assert env.reference_completion(task) == f"<answer>{task.answer}</answer>"
    assert env.stop_strings == ["</answer>"] and env.tool_stops == [] and env.max_turns == 1


@pytest.mark.parametrize("digits", [1, 2, 3, 4])
def test_operands_have_the_requested_digit_count(digits):
    env = get_env("arith", digits=digits, ops=["*"])
    for task in env.sample("train", seed=1, n=50):
        a, b = map(int, task.meta["problem"].split("*"))
        lo = 0 if digits == 1 else 10 ** (digits - 1)
        assert lo <= a < 10**digits and lo <= b < 10**digits
        assert task.answer == a * b


def test_a_list_of_levels_mixes_digit_counts():
    levels = {t.meta["digits"] for t in get_env("arith", digits=[1, 3]).sample("train", seed=0, n=60)}
    assert levels == {1, 3}


def test_subtraction_can_be_negative_and_negative_answers_are_parsed():
    env = get_env("arith", ops=["-"])
    task = next(t for t in env.sample("train", seed=0, n=100) if t.answer < 0)
    assert env.score(task, f"<answer>{task.answer}</answer>").reward == 1.0
    assert env.score(task, f"<answer>{-task.answer}</answer>").reward == 0.0


def test_whitespace_inside_the_tag_is_tolerated():
    env = get_env("arith")
    task = env.sample("train", seed=0, n=1)[0]
    score = env.score(task, f"<answer>  {task.answer}\n</answer>")
    assert score.reward == 1.0 and score.parts["format"] == 1.0


def test_the_last_answer_counts_and_two_answers_break_format():
    env = get_env("arith")
    task = env.sample("train", seed=0, n=1)[0]
    score = env.score(task, f"<answer>{task.answer + 1}</answer> no, <answer>{task.answer}</answer>")
    assert score.reward == 1.0 and score.parts["format"] == 0.0
    score = env.score(task, f"<answer>{task.answer}</answer> no, <answer>{task.answer + 1}</answer>")
    assert score.reward == 0.0


def test_an_unclosed_final_tag_counts_as_the_answer_but_not_as_well_formed():
    # An engine may strip the stop string `</answer>` from the completion text.
    env = get_env("arith")
    task = env.sample("train", seed=0, n=1)[0]
    score = env.score(task, f"<answer>{task.answer}")
    assert score.reward == 1.0 and score.parts["format"] == 0.0


def test_non_integer_answers_score_zero_with_reason():
    env = get_env("arith")
    task = env.sample("train", seed=0, n=1)[0]
    for text in [f"<answer>{task.answer}.5</answer>", "<answer>eighty</answer>", "<answer></answer>"]:
        score = env.score(task, text)
        assert score.reward == 0.0 and score.reason == "answer_not_an_integer", text


def test_foreign_task_ids_are_refused():
    env = get_env("arith")
    for bad in ["countdown/train/0/0", "arith/valid/0/0", "arith/train/x/0", "arith/train/0", ""]:
        with pytest.raises(ConfigError):
            env.task(bad)


def test_invalid_ops_are_refused():
    with pytest.raises(ConfigError, match="ops"):
        get_env("arith", ops=["/"])
