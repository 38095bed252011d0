"""`arith`: procedural integer arithmetic, the default task of `pnyx run` with the shipped tiny model.

A task is `Compute 37+48.` as the user's turn after the system prompt, which states the answer format
(`SYSTEM_PROMPT`); the expected completion is `<answer>85</answer>` and generation stops at `</answer>`.
Difficulty: `digits` (1-4, one level or a list of levels to mix) and `ops` (any of + - *); each task's
level (`meta["level"]`, e.g. `2+`) is its digit count and operator. Operands have exactly `digits` digits
(0-9 for one digit); results of `-` may be negative. `answer="lenient"` reads the last number of a
completion that has no answer tag (part `lenient` = 1; `format` stays 0), for models that do not follow
the tag format yet.

Knows nothing about models. Invariants: the task id `arith/<split>/<seed>/<index>` rebuilds the task
(given the same configuration); a problem (`37+48`) is in `test` iff its canonical form hashes into the
reserved bucket, so the splits never share a problem.
"""

from __future__ import annotations

from typing import Literal

from pnyx.envs.base import (
    AnswerMode,
    Environment,
    Score,
    Split,
    Task,
    check_answer_mode,
    check_fraction,
    check_split,
    parse_procedural_id,
    seeded_rng,
    split_of,
    zero,
)
from pnyx.envs.parsing import Answer, last_answer, last_number, parse_int
from pnyx.errors import ConfigError

Op = Literal["+", "-", "*"]
OPS: tuple[Op, ...] = ("+", "-", "*")
SYSTEM_PROMPT = "Give the result as an integer in answer tags, e.g. <answer>42</answer>."
_MAX_ATTEMPTS = 100_000


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


class ArithEnv(Environment):
    """Integer arithmetic (+ - *) with digit-count difficulty levels; answer in <answer>...</answer>."""

    name = "arith"
    system_prompt = SYSTEM_PROMPT
    max_new_tokens = 64
    stop_strings = ["</answer>"]

    def __init__(
        self,
        digits: int | list[int] = 2,
        ops: list[str] | tuple[str, ...] | str = ("+", "-"),
        test_fraction: float = 0.1,
        answer: AnswerMode = "tag",
    ):
        levels = [digits] if isinstance(digits, int) else list(digits)
        if not levels or any(not isinstance(d, int) or not 1 <= d <= 4 for d in levels):
            raise ConfigError(f"arith digits must be integers in 1..4, got {digits!r}")
        op_list = list(ops)
        if not op_list or any(op not in OPS for op in op_list):
            raise ConfigError(f"arith ops must be a non-empty subset of {OPS}, got {ops!r}")
        self.levels: list[int] = levels
        self.ops: list[str] = op_list
        self.test_fraction = check_fraction(test_fraction)
        self.answer = check_answer_mode(answer, self.name)
        # with tag answers the one correct completion is `<answer>N</answer>`; lenient ones pass other texts
        self.screen_by_reference = self.answer == "tag"
        if self.answer == "lenient":
            self.part_names = (*self.part_names, "lenient")

    def _operand(self, rng, digits: int) -> int:
        lo = 0 if digits == 1 else 10 ** (digits - 1)
        return rng.randint(lo, 10**digits - 1)

    def _make(self, split: Split, seed: int, index: int) -> Task:
        for attempt in range(_MAX_ATTEMPTS):
            rng = seeded_rng(self.name, split, seed, index, attempt)
            digits = rng.choice(self.levels)
            op = rng.choice(self.ops)
            a, b = self._operand(rng, digits), self._operand(rng, digits)
            canonical = f"{a}{op}{b}"
            if split_of(canonical, self.test_fraction, salt=self.name) == split:
                return Task(
                    id=f"{self.name}/{split}/{seed}/{index}",
                    prompt=self.chat(f"Compute {canonical}."),
                    answer=_apply(a, op, b),
                    meta={"digits": digits, "op": op, "problem": canonical, "level": f"{digits}{op}"},
                )
        raise ConfigError(f"arith could not draw a {split} problem; widen digits/ops or test_fraction")

    def sample(self, split: Split, seed: int, n: int, start: int = 0) -> list[Task]:
        check_split(split)
        return [self._make(split, seed, i) for i in range(start, start + n)]

    def task(self, task_id: str) -> Task:
        split, seed, index = parse_procedural_id(task_id, self.name)
        return self._make(split, seed, index)

    def grade(self, task: Task, text: str) -> Score:
        ans = last_answer(text)
        lenient = 0.0
        if ans.text is None and ans.count == 0 and self.answer == "lenient":
            number = last_number(text)
            if number is not None:
                ans, lenient = Answer(text=number, count=0, well_formed=False), 1.0
        if ans.text is None:
            return zero(ans.missing_reason, correct=0, format=0)
        value = parse_int(ans.text)
        fmt = float(ans.count == 1 and ans.well_formed and value is not None)
        extra = {"lenient": lenient} if self.answer == "lenient" else {}
        if value is None:
            return zero("answer_not_an_integer", correct=0, format=fmt, **extra)
        correct = float(value == task.answer)
        return Score(
            reward=correct,
            parts={"correct": correct, "format": fmt, **extra},
            reason=None if correct else "wrong_answer",
        )

    def reference_completion(self, task: Task) -> str:
        """`<answer>85</answer>`: the whole ideal completion (the stop string included)."""
        return f"<answer>{task.answer}</answer>"
