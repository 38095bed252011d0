"""What a real model needs from an environment: a system prompt stating the answer format, a generation
budget, lenient answer reading, an optional format reward, and difficulty levels for the curriculum."""

from __future__ import annotations

import pytest

from pnyx.config import load_config, resolve_env_kwargs, resolve_max_new_tokens
from pnyx.envs import get_env
from pnyx.envs.base import MAX_FORMAT_REWARD
from pnyx.envs.countdown import last_expression
from pnyx.envs.parsing import last_number
from pnyx.errors import ConfigError

pytestmark = pytest.mark.timeout(90)

OPTIONS: dict[str, dict] = {
    "arith": {},
    "countdown": {},
    "gsm8k": {},
    "searchqa": {"num_people": 50},
    "reasoning_gym": {"dataset": "chain_sum"},
}
NAMES = sorted(OPTIONS)


def _env(name: str, **extra):
    return get_env(name, **OPTIONS[name], **extra)


def _answer_of(completion) -> str:
    text = completion if isinstance(completion, str) else "".join(t for _, t in completion)
    return text[text.rindex("<answer>") :]


@pytest.mark.parametrize("name", NAMES)
def test_every_prompt_opens_with_a_system_prompt_that_shows_the_answer_format(name):
    env = _env(name)
    for task in env.sample("train", seed=0, n=3) + env.sample("test", seed=0, n=2):
        assert [m["role"] for m in task.prompt] == ["system", "user"]
        system = task.prompt[0]["content"]
        assert system == env.system_prompt and "<answer>" in system and "</answer>" in system
        assert env.task(task.id).prompt == task.prompt  # a rebuilt task renders the same prompt


@pytest.mark.parametrize("name", NAMES)
def test_system_prompt_option_replaces_or_removes_the_system_message(name):
    replaced = _env(name, system_prompt="Answer like <answer>this</answer>.").sample("train", seed=0, n=1)[0]
    assert replaced.prompt[0] == {"role": "system", "content": "Answer like <answer>this</answer>."}
    removed = _env(name, system_prompt="").sample("train", seed=0, n=1)[0]
    assert [m["role"] for m in removed.prompt] == ["user"]
    assert removed.prompt[0] == replaced.prompt[1]


def test_config_system_prompt_reaches_the_environment_and_must_not_disagree_with_kwargs():
    cfg = load_config(None, ["--env.system_prompt=Be brief."])
    task = get_env(cfg.env.name, **resolve_env_kwargs(cfg)).sample("train", 0, 1)[0]
    assert task.prompt[0]["content"] == "Be brief."
    assert resolve_env_kwargs(load_config(None, [])) == {}  # None: the env's own default applies
    clash = load_config(None, ["--env.system_prompt=A", '--env.kwargs={"system_prompt": "B"}'])
    with pytest.raises(ConfigError, match="system prompt in one place"):
        resolve_env_kwargs(clash)


def test_generation_budgets_fit_each_task():
    assert get_env("arith").max_new_tokens == 64
    assert get_env("countdown").max_new_tokens >= 256
    assert get_env("gsm8k").max_new_tokens >= 256
    assert get_env("searchqa", num_people=20).max_new_tokens >= 64


def test_max_new_tokens_unset_means_the_environments_budget():
    arith, gsm8k = get_env("arith"), get_env("gsm8k")
    assert load_config(None, []).worker.max_new_tokens is None
    assert resolve_max_new_tokens(None, arith) == 64 and resolve_max_new_tokens(None, gsm8k) == 384
    assert resolve_max_new_tokens(17, gsm8k) == 17


def test_unknown_environment_option_is_a_config_error_that_lists_the_options():
    with pytest.raises(ConfigError, match="digits") as err:
        get_env("arith", digitz=3)
    assert "format_reward" in str(err.value) and "system_prompt" in str(err.value)


# --- format reward ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["arith", "countdown", "gsm8k", "searchqa"])
def test_format_reward_pays_the_format_but_correctness_dominates(name):
    env = _env(name, format_reward=0.2)
    plain = _env(name)
    task = env.sample("train", seed=1, n=1)[0]
    right = env.reference_completion(task)
    right_text = right if isinstance(right, str) else "".join(t for _, t in right)
    answer = _answer_of(right)
    right_unclosed = right_text.replace(answer, answer.replace("</answer>", ""))
    wrong = right_text.replace(answer, "<answer>999999</answer>")
    scores = {
        "right": env.score(task, right_text),
        "wrong_formatted": env.score(task, wrong),
        "nothing": env.score(task, "I do not know."),
    }
    assert scores["right"].reward == 1.0 and scores["right"].parts["format_reward"] == pytest.approx(0.2)
    assert scores["wrong_formatted"].reward == pytest.approx(0.2)
    assert scores["wrong_formatted"].parts["correct"] == 0.0
    assert scores["nothing"].reward == 0.0 and scores["nothing"].parts["format_reward"] == 0.0
    # A correct answer that breaks the format (unclosed tag) still beats any wrong one.
    unclosed = env.score(task, right_unclosed)
    assert unclosed.parts["correct"] == 1.0 and unclosed.parts["format"] == 0.0
    assert unclosed.reward == pytest.approx(0.8)
    assert "format_reward" not in plain.score(task, right_text).parts  # off by default: no extra part


def test_format_reward_must_stay_below_one_half():
    for bad in (MAX_FORMAT_REWARD, 0.9, -0.1, "0.1", True):
        with pytest.raises(ConfigError, match="format_reward"):
            get_env("arith", format_reward=bad)


# --- lenient answer reading ---------------------------------------------------------------------------


def test_last_number_reads_signs_separators_and_decimals_but_not_operators():
    assert last_number("76-75 = 1") == "1"
    assert last_number("so the answer is -12.") == "-12"
    assert last_number("(3)-4") == "4" and last_number("a-5") == "5"
    assert last_number("total 1,250 apples") == "1,250"
    assert last_number("it costs 7.5.") == "7.5"
    assert last_number("no digits here") is None


def test_lenient_arith_reads_the_last_number_only_when_there_is_no_tag():
    strict, lenient = get_env("arith"), get_env("arith", answer="lenient")
    task = strict.sample("train", seed=0, n=1)[0]
    bare = f"{task.meta['problem']} = {task.answer}"
    assert strict.score(task, bare).reward == 0.0
    score = lenient.score(task, bare)
    assert score.reward == 1.0 and score.parts == {"correct": 1.0, "format": 0.0, "lenient": 1.0}
    tagged_wrong = f"{task.answer} hmm <answer>{task.answer + 1}</answer>"
    assert lenient.score(task, tagged_wrong).reward == 0.0  # the tag wins over a bare number
    tagged = lenient.score(task, f"<answer>{task.answer}</answer>")
    assert tagged.parts["lenient"] == 0.0 and tagged.parts["format"] == 1.0


def test_lenient_gsm8k_falls_back_to_the_last_number():
    strict, lenient = get_env("gsm8k"), get_env("gsm8k", answer="lenient")
    task = strict.sample("test", seed=0, n=1)[0]
    text = f"Adding it all up, the total is {task.answer} in the end."
    assert strict.score(task, text).reward == 0.0
    score = lenient.score(task, text)
    assert score.reward == 1.0 and score.parts["lenient"] == 1.0 and score.parts["format"] == 0.0


def test_lenient_countdown_reads_the_last_expression():
    assert last_expression("First 50 - 25 = 25, then 25 * 3 = 75.") == "25 * 3 = 75"
    assert last_expression("no maths at all, 12 only") is None
    env = get_env("countdown", answer="lenient")
    task = env.sample("train", seed=0, n=1)[0]
    text = f"We can do {task.answer['solution']} = {task.answer['target']}."
    score = env.score(task, text)
    assert score.reward == 1.0 and score.parts["lenient"] == 1.0
    assert get_env("countdown").score(task, text).reward == 0.0


def test_unknown_answer_mode_is_refused():
    with pytest.raises(ConfigError, match="answer must be one of"):
        get_env("arith", answer="loose")


# --- levels -------------------------------------------------------------------------------------------


def test_levels_are_arith_digits_and_operator_and_countdown_size():
    arith = get_env("arith", digits=[1, 3], ops=["+", "*"])
    levels = {arith.level_of(t) for t in arith.sample("train", seed=0, n=80)}
    assert levels == {"1+", "1*", "3+", "3*"}
    countdown = get_env("countdown", num_numbers=[3, 5])
    assert {countdown.level_of(t) for t in countdown.sample("train", seed=0, n=30)} == {3, 5}
    gsm8k = get_env("gsm8k")
    assert gsm8k.level_of(gsm8k.sample("train", seed=0, n=1)[0]) is None


def test_a_fixed_countdown_size_keeps_the_stream_it_had_before_sizes_could_mix():
    # Pinned from the stream before `num_numbers` accepted a list: ids must keep naming the same problems.
    env = get_env("countdown")
    assert env.task("countdown/train/0/0").answer == {
        "numbers": [23, 43, 22, 1],
        "target": 24,
        "solution": "23+1",
    }
    assert env.task("countdown/test/3/5").answer["solution"] == "(31+(11*33))+40"
