"""A verifiers multi-turn tool environment (classic API): question answering with a BM25 `search` tool.

Written as any verifiers environment is (`load_environment(**kwargs) -> vf.ToolEnv` with a Python tool),
over pnyx's synthetic world (`pnyx.envs.world`: people, their city, birth year and job), in the protocol
the shipped tiny model knows: it calls `<search>query</search>`, the reply comes back in
`<information>...</information>`, and it answers `<answer>...</answer>`. pnyx's adapter options make the
text match (`tool_format="tags"`, `reply_tags`, no tool preamble). Train it with

    pnyx run --env.name=verifiers:examples/verifiers/search_tool.py --env.kwargs='{"pnyx": {
        "tool_format": "tags", "reply_tags": ["<information>", "</information>"], "tool_prompt": false,
        "stop_strings": ["</answer>"], "max_new_tokens": 128}}'

or `pnyx run -c examples/verifiers/search_tool.toml`.
"""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset

from pnyx.envs.parsing import cover_em, last_answer
from pnyx.envs.retrieval import BM25Index
from pnyx.envs.searchqa import SYSTEM_PROMPT
from pnyx.envs.world import QUESTIONS, make_world


def qa_rows(world, num_rows: int | None) -> list[dict[str, str]]:
    """One question per (person, attribute), in a fixed order; the first `num_rows` (None: all)."""
    rows = [
        {"question": f"Question: {QUESTIONS[attr].format(name=p.name)}", "answer": p.attribute(attr)}
        for p in world.people
        for attr in sorted(QUESTIONS)
    ]
    return rows[:num_rows]


def load_environment(
    world_seed: int = 0,
    num_people: int = 500,
    num_rows: int | None = None,
    top_k: int = 1,
    max_turns: int = 2,
) -> vf.ToolEnv:
    world = make_world(world_seed, num_people)
    index = BM25Index(world.documents())

    def search(query: str) -> str:
        """Look a fact up in the corpus: the best-matching documents."""
        return " ".join(d.render() for d in index.search(query, top_k))

    async def correct(completion: list, answer: str) -> float:
        """Cover-EM of the last answer in the model's own turns (tool replies are other messages)."""
        own = "".join(m.content or "" for m in completion if m.role == "assistant")
        text = last_answer(own).text
        return float(text is not None and len(text) <= 128 and cover_em(text, answer))

    async def searched(state) -> float:
        """1 when the episode called the tool (a metric: weight 0)."""
        return float(len(state["trajectory"]) > 1)

    rubric = vf.Rubric(funcs=[correct, searched], weights=[1.0, 0.0])
    dataset = Dataset.from_list(qa_rows(world, num_rows))
    return vf.ToolEnv(
        dataset=dataset, tools=[search], max_turns=max_turns, system_prompt=SYSTEM_PROMPT, rubric=rubric
    )
