"""verifiers v1 tasksets for tests/test_verifiers_env.py (loaded as `path.py:Class`).

A single-turn arithmetic taskset, the same with a `calc` toolset, a search taskset over pnyx's synthetic
world (the searchqa protocol), and one whose reward needs a runtime (refused by the adapter).
"""

from __future__ import annotations

import verifiers.v1 as vf

from pnyx.envs.arith import SYSTEM_PROMPT as ARITH_SYSTEM
from pnyx.envs.parsing import cover_em, last_answer
from pnyx.envs.retrieval import BM25Index
from pnyx.envs.searchqa import SYSTEM_PROMPT as SEARCH_SYSTEM
from pnyx.envs.world import QUESTIONS, make_world
from vf_envs.common import arith_rows, calc

SEARCHES: list[str] = []
"""Every query the search tool ran (tests count tool calls)."""


class ArithData(vf.TaskData):
    answer: str


class ArithTask(vf.Task[ArithData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(last_answer(trace.last_reply or "").text == self.data.answer)

    @vf.metric
    async def turns(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class ArithConfig(vf.TasksetConfig):
    num_tasks: int = 32


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self):
        for r in arith_rows(self.config.num_tasks):
            data = ArithData(prompt=r["question"], system_prompt=ARITH_SYSTEM, answer=r["answer"])
            yield ArithTask(data, self.config.task)


class CalcToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # advertise `calc`, not `calc_toolset_calc`

    @vf.tool
    def calc(self, expression: str) -> str:
        """Evaluate an integer expression with + - * and parentheses."""
        return calc(expression)


class ToolTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class CalcTask(vf.Task[ArithData, vf.State, ToolTaskConfig]):
    @classmethod
    def toolsets(cls, config: ToolTaskConfig) -> list[vf.Toolset]:
        return [CalcToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(last_answer(trace.last_reply or "").text == self.data.answer)

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class CalcConfig(vf.TasksetConfig):
    num_tasks: int = 32
    task: ToolTaskConfig = ToolTaskConfig()


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    def load(self):
        for r in arith_rows(self.config.num_tasks):
            data = ArithData(prompt=r["question"], system_prompt=ARITH_SYSTEM, answer=r["answer"])
            yield CalcTask(data, self.config.task)


class CounterToolset(vf.Toolset[vf.ToolsetConfig]):
    """A toolset with state: `tick` answers how many calls this episode's toolset has had."""

    TOOL_PREFIX = None

    @vf.tool
    def tick(self, label: str) -> str:
        """Count a call."""
        self._calls = getattr(self, "_calls", 0) + 1
        return f"{label}:{self._calls}"


class CounterTask(CalcTask):
    @classmethod
    def toolsets(cls, config: ToolTaskConfig) -> list[vf.Toolset]:
        return [CounterToolset(config.tools)]


class CounterTaskset(vf.Taskset[CounterTask, CalcConfig]):
    def load(self):
        for r in arith_rows(self.config.num_tasks):
            data = ArithData(prompt=r["question"], system_prompt=ARITH_SYSTEM, answer=r["answer"])
            yield CounterTask(data, self.config.task)


_WORLD = make_world(0, 60)
_INDEX = BM25Index(_WORLD.documents())


class SearchToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None

    @vf.tool
    def search(self, query: str) -> str:
        """Look a fact up in the corpus."""
        SEARCHES.append(query)
        return " ".join(d.render() for d in _INDEX.search(query, 1))


class SearchTask(vf.Task[ArithData, vf.State, ToolTaskConfig]):
    @classmethod
    def toolsets(cls, config: ToolTaskConfig) -> list[vf.Toolset]:
        return [SearchToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        text = last_answer(trace.last_reply or "").text
        return float(text is not None and cover_em(text, self.data.answer))


class SearchConfig(vf.TasksetConfig):
    num_tasks: int = 40
    task: ToolTaskConfig = ToolTaskConfig()


class SearchTaskset(vf.Taskset[SearchTask, SearchConfig]):
    def load(self):
        for i, person in enumerate(_WORLD.people[: self.config.num_tasks]):
            attr = sorted(QUESTIONS)[i % len(QUESTIONS)]
            question = f"Question: {QUESTIONS[attr].format(name=person.name)}"
            data = ArithData(prompt=question, system_prompt=SEARCH_SYSTEM, answer=person.attribute(attr))
            yield SearchTask(data, self.config.task)


class SandboxTask(vf.Task[ArithData]):
    @vf.reward(weight=1.0)
    async def tests_pass(self, trace: vf.Trace, runtime: vf.Runtime) -> float:
        return 1.0


class SandboxTaskset(vf.Taskset[SandboxTask, ArithConfig]):
    def load(self):
        for r in arith_rows(4):
            yield SandboxTask(ArithData(prompt=r["question"], answer=r["answer"]), self.config.task)
