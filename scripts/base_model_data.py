"""Procedural pretraining transcripts for the tiny base model: noisy arith answers, searchqa episodes
(search-and-copy or a guess of the right type), and the weight that keeps the search rate partial.

Used by `scripts/make_base_model.py`; knows nothing about models or training. Every example comes from the
environments' own tasks and reference completions (`pnyx.envs`), never from a private copy of the format.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from pnyx.envs import Environment, Task

Segment = tuple[str, bool]  # (text, trained on): tool replies are in the transcript but never trained on


@dataclass
class Example:
    env: str
    prompt: Any
    segments: list[Segment]


def _answer_variants(value: int, rng: random.Random) -> str:
    """A plausible wrong integer answer near `value`: off by a little, a digit slip, a sign error."""
    kind = rng.random()
    if kind < 0.30:
        wrong = value + rng.choice([-2, -1, 1, 2])
    elif kind < 0.55:
        wrong = value + rng.choice([-20, -10, 10, 20])
    elif kind < 0.70:
        wrong = value + rng.choice([-11, -9, 9, 11])
    elif kind < 0.82:
        digits = list(str(abs(value)))
        if len(digits) >= 2:
            i = rng.randrange(len(digits) - 1)
            digits[i], digits[i + 1] = digits[i + 1], digits[i]
        else:
            digits = [str((int(digits[0]) + rng.choice([1, 2, 3])) % 10)]
        wrong = int("".join(digits)) * (1 if value >= 0 else -1)
    elif kind < 0.92:
        wrong = -value if value != 0 else rng.choice([-1, 1])
    else:
        wrong = value + rng.choice([-100, 100, -3, 3, -5, 5])
    if wrong == value:
        wrong = value + 1
    return str(wrong)


def arith_example(
    env: Environment, task: Task, p_correct: float, p_format_error: float, rng: random.Random
) -> Example:
    """A noisy `arith` transcript: correct with `p_correct`, else a format error or a near-miss answer."""
    reference = env.reference_completion(task)
    value = int(task.answer)
    u = rng.random()
    if u < p_correct:
        text = reference
    elif u < p_correct + p_format_error:
        text = (
            str(value) if rng.random() < 0.5 else f"<answer>{value} {_answer_variants(value, rng)}</answer>"
        )
    else:
        text = reference.replace(f">{value}<", f">{_answer_variants(value, rng)}<")
    return Example(env.name, task.prompt, [(text, True)])


def searchqa_example(
    env: Environment, task: Task, p_search: float, guesses: list[str], rng: random.Random
) -> Example:
    """A `searchqa` transcript: with `p_search` the reference (search, tool reply, answer); else a guess."""
    reference = env.reference_completion(task)
    if rng.random() < p_search:
        turns = [(reference, "model")] if isinstance(reference, str) else [(t, r) for r, t in reference]
        return Example(env.name, task.prompt, [(text, role == "model") for text, role in turns])
    return Example(env.name, task.prompt, [(f"<answer>{rng.choice(guesses)}</answer>", True)])


# --- tokenizer -------------------------------------------------------------------------------------


def answer_type(task: Task) -> str:
    return str(task.meta.get("attribute", task.meta.get("relation", "any")))


def guess_vocabulary(tasks: list[Task]) -> dict[str, list[str]]:
    """Per answer type, the answers seen in the training pool: guesses of the right type."""
    vocab: dict[str, set[str]] = {}
    for t in tasks:
        answer = t.answer if isinstance(t.answer, str) else t.answer[0]
        vocab.setdefault(answer_type(t), set()).add(answer)
    return {k: sorted(v) for k, v in vocab.items()}


def searchqa_copy_example(
    env: Environment, task: Task, p_copy: float, p_decide: float, guesses: list[str], rng: random.Random
) -> Example:
    """A phase-3 `searchqa` transcript: with `p_copy` a clean copying episode (search with the exact
    entity name, answer with the exact attribute of the reply), else a guess of the right type.

    The first tag (`<search>` or `<answer>`) decides whether the model searches. In a copying episode
    that token is trained only with probability `p_decide`, so the copying skill gets most of the data
    while the search *rate* stays partial (see `decision_weight`).
    """
    if rng.random() < p_copy:
        (_, call), (_, reply), (_, answer) = env.reference_completion(task)
        rest = call[len("<search>") :]
        return Example(
            env.name,
            task.prompt,
            [("<search>", rng.random() < p_decide), (rest, True), (reply, False), (answer, True)],
        )
    return Example(env.name, task.prompt, [("<answer>", True), (f"{rng.choice(guesses)}</answer>", True)])


def decision_weight(p_copy: float, search_rate: float) -> float:
    """The probability to train the `<search>` tag of a copying episode so that, among the trained first
    tags, a fraction `search_rate` is `<search>`: p_copy * w / (p_copy * w + 1 - p_copy) = search_rate."""
    if not 0.0 < search_rate < 1.0 or not 0.0 < p_copy <= 1.0:
        raise ValueError(f"need 0 < search_rate < 1 and 0 < p_copy <= 1, got {search_rate}, {p_copy}")
    return min(1.0, search_rate * (1.0 - p_copy) / (p_copy * (1.0 - search_rate)))
