"""`reasoning_gym`: an adapter that wraps any reasoning-gym dataset by name (optional extra `pnyx[rgym]`).

    get_env("reasoning_gym", dataset="leg_counting", config={"min_animals": 3})

Each task is one entry of a reasoning-gym procedural dataset (`create_dataset(name, size, seed, **config)`)
and is scored by that dataset's own `score_answer` on the content of the last `<answer>` tag, which the
system prompt asks for.

Knows nothing about models; imports reasoning-gym only when built. Invariants: the task id
`reasoning_gym/<dataset>/<split>/<seed>/<index>` names one entry of one fixed-seed dataset (the index
into it is a stable hash of the id), a question is in `test` iff its text hashes into the reserved
bucket, and a failure inside third-party scoring code becomes a 0 with a reason, never an exception.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from pnyx.envs.base import (
    Environment,
    Score,
    Split,
    Task,
    check_fraction,
    check_split,
    parse_task_id,
    split_of,
    stable_hash,
    zero,
)
from pnyx.envs.parsing import last_answer
from pnyx.errors import ConfigError

SYSTEM_PROMPT = "Think it through, then give the final answer in answer tags: <answer>your answer</answer>."
MAX_ANSWER_CHARS = 4096
_DATASET_SEED = 0x5EED
_DATASET_SIZE = 2**31 - 1
_MAX_ATTEMPTS = 10_000


def _import_reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError as e:
        raise ConfigError(
            "the reasoning_gym environment needs the reasoning-gym package: pip install 'pnyx[rgym]'"
        ) from e
    return reasoning_gym


class ReasoningGymEnv(Environment):
    """Any reasoning-gym dataset by name, scored by its own score_answer (needs pnyx[rgym])."""

    name = "reasoning_gym"
    system_prompt = SYSTEM_PROMPT
    max_new_tokens = 256
    stop_strings = ["</answer>"]

    def __init__(
        self,
        dataset: str = "leg_counting",
        config: dict[str, Any] | None = None,
        test_fraction: float = 0.1,
    ):
        rg = _import_reasoning_gym()
        if "/" in dataset:
            raise ConfigError(f"reasoning-gym dataset name {dataset!r} must not contain '/'")
        try:
            self.ds = rg.create_dataset(dataset, size=_DATASET_SIZE, seed=_DATASET_SEED, **(config or {}))
        except (KeyError, ValueError, TypeError) as e:
            raise ConfigError(
                f"cannot build reasoning-gym dataset {dataset!r} with config {config!r}: {e}"
            ) from e
        self.dataset = dataset
        self.test_fraction = check_fraction(test_fraction)

    def _make(self, split: Split, seed: int, index: int) -> Task:
        for attempt in range(_MAX_ATTEMPTS):
            ds_index = stable_hash(self.name, self.dataset, split, seed, index, attempt) % _DATASET_SIZE
            entry = self.ds[ds_index]
            question = str(entry["question"])
            if split_of(question, self.test_fraction, salt=f"{self.name}/{self.dataset}") == split:
                return Task(
                    id=f"{self.name}/{self.dataset}/{split}/{seed}/{index}",
                    prompt=self.chat(question.rstrip()),
                    answer=entry,
                    meta={"dataset": self.dataset, "dataset_index": ds_index},
                )
        raise ConfigError(f"reasoning-gym dataset {self.dataset!r} produced no {split} question")

    def problem_key(self, task: Task) -> Hashable:
        """The question's text: a small procedural dataset asks the same question under many entries."""
        return str(task.answer["question"])

    def sample(self, split: Split, seed: int, n: int, start: int = 0) -> list[Task]:
        check_split(split)
        return [self._make(split, seed, i) for i in range(start, start + n)]

    def task(self, task_id: str) -> Task:
        dataset, split, seed, index = parse_task_id(task_id, self.name, 4)
        if dataset != self.dataset:
            raise ConfigError(
                f"task id {task_id!r} is for dataset {dataset!r}, this env wraps {self.dataset!r}"
            )
        try:
            return self._make(check_split(split), int(seed), int(index))
        except ValueError as e:
            raise ConfigError(f"task id {task_id!r}: seed and index must be integers") from e

    def grade(self, task: Task, text: str) -> Score:
        ans = last_answer(text, max_len=MAX_ANSWER_CHARS)
        if ans.text is None:
            return zero(ans.missing_reason, correct=0, format=0)
        fmt = float(ans.count == 1 and ans.well_formed)
        try:
            value = float(self.ds.score_answer(ans.text.strip(), task.answer))
        # Third-party scoring code may fail on hostile text in ways we cannot enumerate; a verifier must
        # not crash the worker or trainer, so the failure becomes a zero with its type as the reason.
        except Exception as e:
            return zero(f"score_answer_raised:{type(e).__name__}", correct=0, format=fmt)
        correct = value if 0.0 <= value <= 1.0 else 0.0
        return Score(
            reward=correct,
            parts={"correct": correct, "format": fmt},
            reason=None if correct > 0.0 else "wrong_answer",
        )

    def reference_completion(self, task: Task) -> str:
        return f"<answer>{task.answer['answer']}</answer>"
