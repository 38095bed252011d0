"""`gsm8k`: grade-school math from any JSONL file of `{"question", "answer"}` rows, graded by math-verify.

Answers in GSM8K's format (`reasoning ... #### 42`) are understood; a bare answer works too. The model
is asked to end with `<answer>42</answer>`; a final `\\boxed{42}` is accepted when there is no tag (with
`format` 0). The repo ships `data/gsm8k_mini.jsonl`, 40 self-written problems, used by default and in tests.

Knows nothing about models. Invariants: a question's split is a function of its text (hash bucket),
task ids `gsm8k/<split>/<question key>` survive reordering of the file, and grading is bounded in
time on any output (see `mathcheck.py`).
"""

from __future__ import annotations

from pathlib import Path

from pnyx.envs.base import Environment, Score, Split, Task, check_split, parse_task_id, user_prompt, zero
from pnyx.envs.dataset import QADataset, read_jsonl
from pnyx.envs.mathcheck import MAX_ANSWER_CHARS, gsm8k_gold, math_equal
from pnyx.envs.parsing import last_answer

SHIPPED = Path(__file__).parent / "data" / "gsm8k_mini.jsonl"
INSTRUCTIONS = "Solve step by step, then give the final number as <answer>number</answer>."


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (braces balanced by a linear scan), else None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, min(len(text), i + MAX_ANSWER_CHARS + 1)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


class Gsm8kEnv(Environment):
    """Math word problems from a JSONL file (GSM8K `#### n` answers understood), graded by math-verify."""

    name = "gsm8k"
    stop_strings = ["</answer>"]

    def __init__(self, path: str | None = None, test_fraction: float = 0.2, instructions: str = INSTRUCTIONS):
        self.path = Path(path) if path else SHIPPED
        self.dataset = QADataset(
            read_jsonl(self.path, "gsm8k"), test_fraction, salt=self.name, source=str(self.path)
        )
        self.instructions = instructions

    def _task(self, split: Split, key: str) -> Task:
        item = self.dataset.get(key)
        content = f"{item.question}\n{self.instructions}" if self.instructions else item.question
        return Task(
            id=f"{self.name}/{split}/{item.key}",
            prompt=user_prompt(content),
            answer=gsm8k_gold(str(item.answer)),
            meta={"solution": str(item.answer)},
        )

    def sample(self, split: Split, seed: int, n: int, start: int = 0) -> list[Task]:
        check_split(split)
        return [self._task(split, self.dataset.at(split, seed, i).key) for i in range(start, start + n)]

    def task(self, task_id: str) -> Task:
        split, key = parse_task_id(task_id, self.name, 2)
        return self._task(check_split(split), key)

    def grade(self, task: Task, text: str) -> Score:
        ans = last_answer(text, max_len=MAX_ANSWER_CHARS)
        prediction, fmt = ans.text, float(ans.count == 1 and ans.well_formed)
        if prediction is None:
            prediction, fmt = last_boxed(text), 0.0
        if prediction is None or not prediction.strip():
            return zero(ans.missing_reason, correct=0, format=0)
        verdict = math_equal(task.answer, prediction)
        if verdict == "refused":
            return zero("answer_refused", correct=0, format=fmt)
        correct = float(verdict == "equal")
        return Score(
            reward=correct,
            parts={"correct": correct, "format": fmt},
            reason=None if correct else "wrong_answer",
        )

    def reference_completion(self, task: Task) -> str:
        return f"<answer>{task.answer}</answer>"
