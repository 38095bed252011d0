"""`gsm8k`: grade-school math from any JSONL file of `{"question", "answer"}` rows, graded by math-verify.

Answers in GSM8K's format (`reasoning ... #### 42`) are understood; a bare answer works too. The system
prompt asks the model to end with `<answer>42</answer>` and says that a final `\\boxed{42}` or a last
line `#### 42` count too, so all three earn `format` 1 (what instruct models write by habit). With
`answer="lenient"`, a completion with none of them is read by its last number (part `lenient` = 1, format
0). The repo ships `data/gsm8k_mini.jsonl`, 40 self-written problems, used by default and in tests.

Knows nothing about models. Invariants: a question's split is a function of its text (hash bucket),
task ids `gsm8k/<split>/<question key>` survive reordering of the file, and grading is bounded in
time on any output (see `mathcheck.py`).
"""

from __future__ import annotations

from pathlib import Path

from pnyx.envs.base import (
    AnswerMode,
    Environment,
    Score,
    Split,
    Task,
    check_answer_mode,
    check_split,
    parse_task_id,
    zero,
)
from pnyx.envs.dataset import QADataset, read_jsonl
from pnyx.envs.mathcheck import MAX_ANSWER_CHARS, gsm8k_gold, math_equal
from pnyx.envs.parsing import last_answer, last_number

SHIPPED = Path(__file__).parent / "data" / "gsm8k_mini.jsonl"
SYSTEM_PROMPT = (
    "Solve the problem step by step, then give the final number in answer tags, e.g. <answer>42</answer>. "
    "A final \\boxed{42} or a last line #### 42 also counts."
)


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


def last_hashes(text: str) -> str | None:
    """The rest of the line after the last `####` (GSM8K's own answer marker), else None."""
    start = text.rfind("####")
    if start < 0:
        return None
    line = text[start + 4 : start + 4 + MAX_ANSWER_CHARS + 1].split("\n", 1)[0].strip()
    return line or None


class Gsm8kEnv(Environment):
    """Math word problems from a JSONL file (GSM8K `#### n` answers understood), graded by math-verify."""

    name = "gsm8k"
    system_prompt = SYSTEM_PROMPT
    max_new_tokens = 384
    stop_strings = ["</answer>"]

    def __init__(self, path: str | None = None, test_fraction: float = 0.2, answer: AnswerMode = "tag"):
        self.path = Path(path) if path else SHIPPED
        self.dataset = QADataset(
            read_jsonl(self.path, "gsm8k"), test_fraction, salt=self.name, source=str(self.path)
        )
        self.answer = check_answer_mode(answer, self.name)
        if self.answer == "lenient":
            self.part_names = (*self.part_names, "lenient")

    def _task(self, split: Split, key: str) -> Task:
        item = self.dataset.get(key)
        return Task(
            id=f"{self.name}/{split}/{item.key}",
            prompt=self.chat(item.question),
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
        prediction, fmt, how = self._read(text)
        extra = {"lenient": float(how == "lenient")} if self.answer == "lenient" else {}
        if prediction is None or not prediction.strip():
            return zero(how, correct=0, format=0, **extra)
        verdict = math_equal(task.answer, prediction)
        if verdict == "refused":
            return zero("answer_refused", correct=0, format=fmt, **extra)
        correct = float(verdict == "equal")
        return Score(
            reward=correct,
            parts={"correct": correct, "format": fmt, **extra},
            reason=None if correct else "wrong_answer",
        )

    def _read(self, text: str) -> tuple[str | None, float, str]:
        """(the answer, its format part, how it was read or why there is none): the answer tag first, then a
        final `\\boxed{}`, then a `####` line (all three as the system prompt states), then the last number
        when lenient."""
        ans = last_answer(text, max_len=MAX_ANSWER_CHARS)
        if ans.text is not None or ans.count:
            how = ans.missing_reason if ans.text is None else "tag" if ans.text.strip() else "empty_answer"
            return ans.text, float(ans.count == 1 and ans.well_formed), how
        for how, found in (("boxed", last_boxed(text)), ("hashes", last_hashes(text))):
            if found is not None:
                return found, 1.0, how
        if self.answer == "lenient" and (number := last_number(text)) is not None:
            return number, 0.0, "lenient"
        return None, 0.0, "no_answer"

    def reference_completion(self, task: Task) -> str:
        return f"<answer>{task.answer}</answer>"
