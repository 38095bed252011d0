"""A verifiers single-turn environment (classic API): two-digit arithmetic, `<answer>N</answer>`.

Written as any verifiers environment is (`load_environment(**kwargs) -> vf.SingleTurnEnv`), with the
prompt and answer format the shipped tiny model knows (pnyx's `arith` system prompt). Train it with

    pnyx run --env.name=verifiers:examples/verifiers/arith_single.py \
        --env.kwargs='{"pnyx": {"stop_strings": ["</answer>"], "max_new_tokens": 64}}'

or `pnyx run -c examples/verifiers/arith_single.toml`.
"""

from __future__ import annotations

import random

import verifiers as vf
from datasets import Dataset

from pnyx.envs.arith import SYSTEM_PROMPT
from pnyx.envs.parsing import last_answer, parse_int


def arith_rows(num_rows: int, seed: int) -> list[dict[str, str]]:
    """`num_rows` distinct problems `Compute a+b.` / `Compute a-b.` with two-digit operands."""
    rng = random.Random(seed)
    rows: dict[str, str] = {}
    while len(rows) < num_rows:
        a, b, op = rng.randint(10, 99), rng.randint(10, 99), rng.choice("+-")
        rows[f"{a}{op}{b}"] = str(a + b if op == "+" else a - b)
    return [{"question": f"Compute {p}.", "answer": answer} for p, answer in rows.items()]


def _reply(completion: list) -> str:
    return (completion[-1].content or "") if completion else ""


async def correct(completion: list, answer: str) -> float:
    """1 when the last tagged answer is the right integer."""
    text = last_answer(_reply(completion)).text
    return float(text is not None and parse_int(text) == int(answer))


def format(completion: list) -> float:  # noqa: A001 (pnyx reports a part named `format` as the format rate)
    """1 when the reply holds exactly one well-formed answer tag (a metric: weight 0)."""
    ans = last_answer(_reply(completion))
    return float(ans.text is not None and ans.count == 1 and ans.well_formed)


def load_environment(num_rows: int = 4000, seed: int = 0) -> vf.SingleTurnEnv:
    rubric = vf.Rubric(funcs=[correct, format], weights=[1.0, 0.0])
    dataset = Dataset.from_list(arith_rows(num_rows, seed))
    return vf.SingleTurnEnv(dataset=dataset, system_prompt=SYSTEM_PROMPT, rubric=rubric)
