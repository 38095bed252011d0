"""`qa`: question/answer pairs from a file or a hub dataset, graded by exact match, by number, or by math-verify.

`data=` is a JSONL, parquet or Arrow file or a Hugging Face hub dataset id (with `split=`, `subset=`),
read by `pnyx.envs.dataset.read_rows`; `question_column=` and `answer_column=` name the columns (default
`question` and `answer`). An answer may be a list of acceptable answers. `checker` says how the answer in
the model's `<answer>` tag is compared with the gold one:

- "exact": equal after SQuAD normalization (case, punctuation, articles, spacing), or by case and
  spacing alone for a gold that normalizes to nothing (a multiple-choice "A", "B");
- "numeric": the same number, compared exactly (`7.50` = `7.5` = `15/2`, `1,250` = `1250`);
- "math": math-verify (`\\frac{15}{2}` = `7.5`), where a final `\\boxed{}` also counts as the answer.

Numeric and math golds in GSM8K's form (`reasoning ... #### 42`) are read by their final answer. Each
checker has a system prompt stating its format (`GRADINGS`); `answer="lenient"` (numeric and math only)
reads the last number of a completion that has no answer (part `lenient` = 1, `format` 0). `gsm8k` is
this environment with the math checker, its own prompt and answer forms, and a shipped file.

Knows nothing about models. Invariants: those of `QADataset` (a question's split is a function of its
text; the task id `<name>/<split>/<question key>` survives reordering or converting the file), every gold
answer is checked when the environment is built (a numeric checker refuses a file with a non-number
answer), and grading is bounded in time on any output (`mathcheck.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pnyx.envs.base import (
    AnswerMode,
    Environment,
    Score,
    Split,
    Task,
    check_answer_mode,
    check_fraction,
    check_split,
    parse_task_id,
    zero,
)
from pnyx.envs.dataset import QADataset, read_rows
from pnyx.envs.mathcheck import MAX_ANSWER_CHARS, Verdict, as_fraction, gsm8k_gold, math_equal
from pnyx.envs.parsing import last_answer, last_number, normalize_answer
from pnyx.errors import ConfigError

Checker = Literal["exact", "numeric", "math"]


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


READERS: dict[str, Callable[[str], str | None]] = {"boxed": last_boxed, "hashes": last_hashes}
"""Answer forms besides the tag that a grading may count as the format, by name."""


def exact_equal(gold: str, prediction: str) -> Verdict:
    """Whether the two are equal after SQuAD normalization, or, when that leaves nothing of the gold (a
    multiple-choice "A" is an article), after case folding and trimming alone; a blank gold matches nothing."""
    prediction = prediction[: 4 * MAX_ANSWER_CHARS]
    if g := normalize_answer(gold):
        return "equal" if g == normalize_answer(prediction) else "different"
    g = gold.strip().casefold()
    return "equal" if g and g == prediction.strip().casefold() else "different"


def numeric_equal(gold: str, prediction: str) -> Verdict:
    """Whether `prediction` is the number `gold`, exactly; "refused" when it is not a plain number."""
    p = as_fraction(prediction) if len(prediction) <= MAX_ANSWER_CHARS else None
    if p is None:
        return "refused"
    return "equal" if p == as_fraction(gold) else "different"


@dataclass(frozen=True)
class Grading:
    """How one checker grades: the comparison, the system prompt that states the format, the answer forms
    besides the tag that count (`READERS`), the generation budget, and the reason a refused answer gets."""

    compare: Callable[[str, str], Verdict]
    system_prompt: str
    forms: tuple[str, ...] = ()
    max_new_tokens: int = 256
    refused: str = "answer_refused"


GRADINGS: dict[str, Grading] = {
    "exact": Grading(exact_equal, "Give the final answer in answer tags, e.g. <answer>Paris</answer>."),
    "numeric": Grading(
        numeric_equal,
        "Give the final answer as a number in answer tags, e.g. <answer>42</answer>.",
        refused="answer_not_a_number",
    ),
    "math": Grading(
        math_equal,
        "Solve the problem step by step, then give the final answer in answer tags, e.g. <answer>42</answer>. "
        "A final \\boxed{42} also counts.",
        forms=("boxed",),
        max_new_tokens=384,
    ),
}


class QAEnv(Environment):
    """Question/answer pairs from a JSONL, parquet or Arrow file or a hub dataset; exact, numeric or math check."""

    name = "qa"
    stop_strings = ["</answer>"]
    gradings: dict[str, Grading] = GRADINGS
    """The checkers this environment offers (a subclass may offer its own)."""

    def __init__(
        self,
        data: str | None = None,
        question_column: str = "question",
        answer_column: str = "answer",
        split: str | None = None,
        subset: str | None = None,
        checker: Checker = "exact",
        test_fraction: float = 0.2,
        answer: AnswerMode = "tag",
    ):
        if checker not in self.gradings:
            raise ConfigError(f"{self.name} checker must be one of {tuple(self.gradings)}, got {checker!r}")
        if not data:
            raise ConfigError(
                f"{self.name} needs data=: a .jsonl, .parquet or .arrow file, or a hub dataset id org/name"
            )
        self.checker = checker
        self.grading = self.gradings[checker]
        self.system_prompt = self.grading.system_prompt
        self.max_new_tokens = self.grading.max_new_tokens
        self.answer = check_answer_mode(answer, self.name)
        if self.answer == "lenient":
            if checker == "exact":
                raise ConfigError(
                    f'{self.name} answer="lenient" reads the last number: use a numeric or math checker'
                )
            self.part_names = (*self.part_names, "lenient")
        # with tag answers and a short gold, a correct completion is essentially `<answer>gold</answer>`
        self.screen_by_reference = checker != "math" and self.answer == "tag"
        rows = read_rows(data, self.name, (question_column, answer_column), split=split, subset=subset)
        self.source = str(data)
        self.dataset = QADataset(
            rows,
            check_fraction(test_fraction),
            salt=self.name,
            source=self.source,
            question=question_column,
            answer=answer_column,
        )
        for item in self.dataset.by_key.values():
            self._check_golds(item.question, self._gold(item.answer))

    def _gold(self, answer: Any) -> str | list[str]:
        """The gold answer of a row: a string, or a list of acceptable strings (numeric and math golds in
        GSM8K's `... #### 42` form by their final answer)."""
        clean = str.strip if self.checker == "exact" else gsm8k_gold
        return [clean(str(a)) for a in answer] if isinstance(answer, list) else clean(str(answer))

    def _check_golds(self, question: str, gold: str | list[str]) -> None:
        golds = [gold] if isinstance(gold, str) else gold
        usable = {"numeric": lambda g: as_fraction(g) is not None}.get(self.checker, str.strip)
        if not golds or not all(usable(g) for g in golds):
            raise ConfigError(
                f"{self.source}: the answer {gold!r} of the question {question[:80]!r} cannot be graded by "
                f"the {self.checker} checker (numeric needs plain numbers, the others non-empty text)"
            )

    def _task(self, split: Split, key: str) -> Task:
        item = self.dataset.get(key, split)
        return Task(
            id=f"{self.name}/{split}/{item.key}",
            prompt=self.chat(item.question),
            answer=self._gold(item.answer),
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
        golds = [task.answer] if isinstance(task.answer, str) else task.answer
        verdicts = {self.grading.compare(gold, prediction) for gold in golds}
        if "equal" not in verdicts and "refused" in verdicts:
            return zero(self.grading.refused, correct=0, format=fmt, **extra)
        correct = float("equal" in verdicts)
        return Score(
            reward=correct,
            parts={"correct": correct, "format": fmt, **extra},
            reason=None if correct else "wrong_answer",
        )

    def _read(self, text: str) -> tuple[str | None, float, str]:
        """(the answer, its format part, how it was read or why there is none): the answer tag first, then
        the grading's other forms in order (as its system prompt states), then the last number when lenient."""
        ans = last_answer(text, max_len=MAX_ANSWER_CHARS)
        if ans.text is not None or ans.count:
            how = ans.missing_reason if ans.text is None else "tag" if ans.text.strip() else "empty_answer"
            return ans.text, float(ans.count == 1 and ans.well_formed), how
        for how in self.grading.forms:
            if (found := READERS[how](text)) is not None:
                return found, 1.0, how
        if self.answer == "lenient" and (number := last_number(text)) is not None:
            return number, 0.0, "lenient"
        return None, 0.0, "no_answer"

    def reference_completion(self, task: Task) -> str:
        gold = task.answer if isinstance(task.answer, str) else task.answer[0]
        return f"<answer>{gold}</answer>"
