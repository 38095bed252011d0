"""`gsm8k`: grade-school math from a file or a hub dataset of questions and answers, graded by math-verify.

The `qa` environment (`qa.py`) with the math checker, GSM8K's prompt and answer forms, and a shipped file.
Answers in GSM8K's format (`reasoning ... #### 42`) are understood; a bare answer works too. The system
prompt asks the model to end with `<answer>42</answer>` and says that a final `\\boxed{42}` or a last
line `#### 42` count too, so all three earn `format` 1 (what instruct models write by habit). With
`answer="lenient"`, a completion with none of them is read by its last number (part `lenient` = 1, format
0). `data=` (or its older name `path=`) takes what `qa` takes: a JSONL, parquet or Arrow file or a hub id
such as `openai/gsm8k` (`subset="main"`); the repo ships `data/gsm8k_mini.jsonl`, 40 self-written
problems, used by default and in tests.

Knows nothing about models. Invariants: those of `qa` (a question's split is a function of its text, task
ids `gsm8k/<split>/<question key>` survive reordering of the file, grading is bounded in time).
"""

from __future__ import annotations

from pathlib import Path

from pnyx.envs.base import AnswerMode
from pnyx.envs.qa import GRADINGS, Grading, QAEnv
from pnyx.errors import ConfigError

SHIPPED = Path(__file__).parent / "data" / "gsm8k_mini.jsonl"
SYSTEM_PROMPT = (
    "Solve the problem step by step, then give the final number in answer tags, e.g. <answer>42</answer>. "
    "A final \\boxed{42} or a last line #### 42 also counts."
)


class Gsm8kEnv(QAEnv):
    """Math word problems from a file or hub dataset (GSM8K `#### n` answers understood), graded by math-verify."""

    name = "gsm8k"
    system_prompt = SYSTEM_PROMPT
    max_new_tokens = 384
    gradings = {
        "math": Grading(
            GRADINGS["math"].compare, SYSTEM_PROMPT, forms=("boxed", "hashes"), max_new_tokens=384
        )
    }

    def __init__(
        self,
        data: str | None = None,
        path: str | None = None,
        question_column: str = "question",
        answer_column: str = "answer",
        split: str | None = None,
        subset: str | None = None,
        test_fraction: float = 0.2,
        answer: AnswerMode = "tag",
    ):
        if data is not None and path is not None:
            raise ConfigError("gsm8k: path is the older name of data; give one of them")
        super().__init__(
            data or path or str(SHIPPED),
            question_column=question_column,
            answer_column=answer_column,
            split=split,
            subset=subset,
            checker="math",
            test_fraction=test_fraction,
            answer=answer,
        )
