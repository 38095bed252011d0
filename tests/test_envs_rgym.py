"""`reasoning_gym`: the adapter scores with the dataset's own score_answer and fails clearly without it."""

from __future__ import annotations

import sys

import pytest

from pnyx.envs import get_env
from pnyx.errors import ConfigError


def test_adapter_uses_the_datasets_own_scoring():
    env = get_env("reasoning_gym", dataset="leg_counting")
    task = env.sample("train", seed=0, n=1)[0]
    assert task.id == "reasoning_gym/leg_counting/train/0/0"
    assert task.prompt[-1]["content"] == task.answer["question"].rstrip()
    assert env.score(task, f"<answer>{task.answer['answer']}</answer>").reward == 1.0
    assert env.score(task, f"<answer>{int(task.answer['answer']) + 1}</answer>").reward == 0.0


def test_dataset_config_is_passed_through():
    env = get_env("reasoning_gym", dataset="leg_counting", config={"min_animals": 1, "max_animals": 1})
    assert all(t.answer["metadata"]["num_animals"] == 1 for t in env.sample("train", seed=0, n=5))


def test_task_id_of_another_dataset_is_refused():
    env = get_env("reasoning_gym", dataset="leg_counting")
    with pytest.raises(ConfigError, match="chain_sum"):
        env.task("reasoning_gym/chain_sum/train/0/0")


def test_unknown_dataset_is_a_config_error():
    with pytest.raises(ConfigError, match="no_such_dataset"):
        get_env("reasoning_gym", dataset="no_such_dataset")


def test_missing_package_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # makes `import reasoning_gym` raise ImportError
    with pytest.raises(ConfigError, match=r"pip install 'pnyx\[rgym\]'"):
        get_env("reasoning_gym")
