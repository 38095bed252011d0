"""Classic verifiers environments for tests/test_verifiers_env.py (loaded as `path.py:load_x`).

A tool env with a `calc` tool, a `MultiTurnEnv` game with its own `env_response` and per-rollout state,
and envs the adapter must refuse. Imports verifiers at module level: load only where it is installed.
"""

from __future__ import annotations

import re
import time

import verifiers as vf
from datasets import Dataset

from pnyx.envs.arith import SYSTEM_PROMPT as ARITH_SYSTEM
from pnyx.envs.parsing import last_answer
from vf_envs.common import arith_rows, calc


def _final_answer(completion: list) -> str | None:
    turns = [m for m in completion if m.role == "assistant"]
    return last_answer(turns[-1].content or "").text if turns else None


def load_calc_tool(n: int = 32, max_turns: int = 3) -> vf.ToolEnv:
    async def correct(completion: list, answer: str) -> float:
        return float(_final_answer(completion) == answer)

    async def used_tool(state) -> float:  # reads `state`, as many rubrics do
        return float(len(state["trajectory"]) > 1)

    rubric = vf.Rubric(funcs=[correct, used_tool], weights=[1.0, 0.0])
    return vf.ToolEnv(
        dataset=Dataset.from_list(arith_rows(n)), tools=[calc], max_turns=max_turns, system_prompt=ARITH_SYSTEM,
        rubric=rubric,
    )  # fmt: skip


def load_guess(n: int = 20, max_turns: int = 4) -> vf.MultiTurnEnv:
    """Guess a number: the env answers each `<guess>` with higher/lower and ends the game on the secret."""

    class GuessEnv(vf.MultiTurnEnv):
        async def setup_state(self, state):
            state["secret"], state["guesses"] = int(state["answer"]), []
            return state

        async def env_response(self, messages, state, **kwargs):
            found = re.findall(r"<guess>(-?\d+)</guess>", messages[-1].content or "")
            guess = int(found[-1]) if found else None
            state["guesses"].append(guess)
            secret = state["secret"]
            hint = (
                "invalid"
                if guess is None
                else "higher"
                if guess < secret
                else "lower"
                if guess > secret
                else "correct"
            )
            if hint == "correct":  # verifiers' way to end right after an env reply
                state["final_env_response"] = [vf.UserMessage(content=hint)]
            return [vf.UserMessage(content=hint)]

    async def won(state) -> float:
        return float(state["secret"] in state["guesses"])

    async def num_guesses(state) -> float:
        return float(len(state["guesses"]))

    rows = [{"question": "Guess my number (0-99).", "answer": str(7 * i % 100)} for i in range(n)]
    rubric = vf.Rubric(funcs=[won, num_guesses], weights=[1.0, 0.0])
    return GuessEnv(dataset=Dataset.from_list(rows), max_turns=max_turns, rubric=rubric)


def load_group_reward() -> vf.SingleTurnEnv:
    """A reward over the whole group (refused: pnyx re-scores one completion at a time)."""

    async def diversity(completions: list) -> list[float]:
        return [1.0 / len(completions)] * len(completions)

    return vf.SingleTurnEnv(dataset=Dataset.from_list(arith_rows(8)), rubric=vf.Rubric(funcs=[diversity]))


def load_wide_reward() -> vf.SingleTurnEnv:
    """A reward in [-1, 1]: 1 for the right answer, -1 otherwise."""

    async def signed(completion: list, answer: str) -> float:
        return 1.0 if _final_answer(completion) == answer else -1.0

    return vf.SingleTurnEnv(dataset=Dataset.from_list(arith_rows(8)), rubric=vf.Rubric(funcs=[signed]))


def load_slow_on_demand() -> vf.SingleTurnEnv:
    """A synchronous reward that blocks for 5 s on a completion containing SLOW (a stuck verifier)."""

    def correct(completion: list, answer: str) -> float:
        text = completion[-1].content or "" if completion else ""
        if "SLOW" in text:
            time.sleep(5.0)
        return float(_final_answer(completion) == answer)

    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(arith_rows(8)),
        system_prompt=ARITH_SYSTEM,
        rubric=vf.Rubric(funcs=[correct]),
    )


def make_list() -> list[int]:
    """Builds something that is not a verifiers environment."""
    return [1, 2, 3]
