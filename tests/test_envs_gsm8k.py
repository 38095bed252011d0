"""`gsm8k`: JSONL loading, GSM8K `####` answers, math-verify grading and its guards."""

from __future__ import annotations

import json

import pytest

from pnyx.envs import Task, get_env
from pnyx.envs.mathcheck import gsm8k_gold, math_equal
from pnyx.errors import ConfigError


def _task(gold: str) -> Task:
    return Task(id="gsm8k/train/0", prompt="", answer=gold)


def test_gsm8k_answer_format_is_understood():
    assert gsm8k_gold("Half is 625.\n#### 1,250") == "1250"
    assert gsm8k_gold("#### $18.50") == "18.50"
    assert gsm8k_gold("42") == "42"


def test_shipped_file_has_both_splits():
    env = get_env("gsm8k")
    assert len(env.dataset.splits["train"]) >= 20 and len(env.dataset.splits["test"]) >= 4


def test_equivalent_forms_are_correct_via_math_verify():
    env = get_env("gsm8k")
    for text in [
        "<answer>7.5</answer>",
        "<answer>\\frac{15}{2}</answer>",
        "<answer>15/2</answer>",
        "<answer>$7.50</answer>",
        "<answer>7.5 liters</answer>",
    ]:
        assert env.score(_task("7.5"), text).reward == 1.0, text


def test_boxed_and_hashes_answers_are_the_format_too_as_the_prompt_states():
    env = get_env("gsm8k")
    assert "\\boxed{42}" in env.system_prompt and "#### 42" in env.system_prompt
    for text in ["so each pays \\boxed{43}", "Each pays 43.\n#### 43", "<answer>43</answer>"]:
        score = env.score(_task("43"), text)
        assert score.reward == 1.0 and score.parts["format"] == 1.0, text


def test_close_but_wrong_numbers_are_wrong():
    env = get_env("gsm8k")
    for text in ["<answer>42.999</answer>", "<answer>-43</answer>", "<answer>430</answer>"]:
        assert env.score(_task("43"), text).reward == 0.0, text


def test_hazardous_expressions_are_refused_before_sympy_sees_them():
    for text in ["10^{10^{10}}", "9999999!", "1e999999", "2^{100000}", "1" * 40]:
        assert math_equal("43", text) == "refused", text


def test_any_jsonl_file_works_and_ids_survive_reordering(tmp_path):
    rows = [
        {"question": f"What is {i} plus {i}?", "answer": f"{i}+{i}={2 * i}\n#### {2 * i}"} for i in range(30)
    ]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps(r) + "\n" for r in rows))
    b.write_text("".join(json.dumps(r) + "\n" for r in reversed(rows)))
    env_a, env_b = get_env("gsm8k", path=str(a)), get_env("gsm8k", path=str(b))
    for task in env_a.sample("train", seed=0, n=10) + env_a.sample("test", seed=0, n=3):
        assert env_b.task(task.id) == task
        assert env_a.score(task, f"<answer>{task.answer}</answer>").reward == 1.0


def test_stream_cycles_through_the_split_once_per_epoch():
    env = get_env("gsm8k")
    n = len(env.dataset.splits["train"])
    first_epoch = env.sample("train", seed=0, n=n)
    assert len({t.id for t in first_epoch}) == n


def test_missing_file_is_a_config_error():
    with pytest.raises(ConfigError, match="does not exist"):
        get_env("gsm8k", path="/no/such/file.jsonl")


def test_math_verify_grading_works_off_the_main_thread():
    # math-verify's own timeout uses SIGALRM, which only the main thread may set: a worker scoring in a
    # thread must still get the right verdict.
    from concurrent.futures import ThreadPoolExecutor

    env = get_env("gsm8k")
    with ThreadPoolExecutor(1) as pool:
        score = pool.submit(env.score, _task("7.5"), "<answer>\\frac{15}{2}</answer>").result(timeout=60)
    assert score.reward == 1.0
