"""The verifiers v1 API (`import verifiers.v1 as vf`: `Taskset`, `Task`, `@vf.reward`, `vf.Toolset`) behind
the adapter.

Tasks come from `taskset.load()` (a finite taskset). Tools are the tasks' and the taskset's `vf.Toolset`
methods marked `@vf.tool`, called in-process: no MCP server, no harness program, no interception server.
`respond` re-runs the conversation the text encodes and calls the tool the text ends with; `score` builds
a `vf.Trace` from the text (system and user messages, then the model's turns and the tool replies) and
runs `task.score(trace)` without a runtime.

Refused at load (a `ConfigError` saying why): rewards or metrics that need a runtime (verifiers would skip
them silently without one, so the reward would not be the env's) and plugged judges (an LLM the trainer
cannot call). Knows nothing about pnyx's engine or tokenizers. Invariants: a completion whose tool replies
differ from what the tools return now is refused (`ReplayMismatch`); a tool's result is a function of the
task and the text before its call (the calls before it included: a toolset may keep state), so results are
cached by (task, digest of that text), which keeps a T-turn episode at T tool calls instead of O(T^2)
replayed ones; on a miss, fresh toolsets first re-run the episode's earlier calls, in order.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections import OrderedDict
from typing import Any

from pnyx.envs.verifiers.protocol import (
    AdapterOptions,
    Call,
    Protocol,
    ReplayMismatch,
    ToolSpec,
    plain_messages,
)
from pnyx.errors import ConfigError

TOOL_CACHE = 4096
"""Tool results kept by (task, digest of the text before the call) (the oldest is forgotten first)."""
_JSON_TYPES = {"int": "integer", "float": "number", "str": "string", "bool": "boolean"}


class V1Backend:
    """A v1 `vf.Taskset`: tasks, prompts, tool replies and rewards (see the module docstring)."""

    api = "v1"

    def __init__(self, taskset: Any, opts: AdapterOptions):
        from verifiers.v1.utils.decorators import discover_decorated

        self.taskset = taskset
        self.tasks = list(taskset)
        if not self.tasks:
            raise ConfigError(f"the verifiers taskset {type(taskset).__name__} yielded no tasks")
        first = self.tasks[0]
        _refuse_unscorable(first)
        rewards, metrics = first.hooks("reward"), first.hooks("metric")
        self.part_names = tuple(dict.fromkeys(f.__name__ for f in [*rewards, *metrics]))
        tools = [
            ToolSpec(name, (fn.__doc__ or "").strip(), _schema(fn))
            for prefix, toolset in self._toolsets(first)
            for name, fn in _named_tools(prefix, discover_decorated(toolset, "tool"))
        ]
        self.protocol = Protocol.make(tools, opts)
        self.max_turns: int = opts.max_turns or (8 if self.protocol.tool_stops else 1)
        self._cache: OrderedDict[tuple[str, str], str] = OrderedDict()

    def _toolsets(self, task: Any) -> list[tuple[str | None, Any]]:
        servers = [*type(task).toolsets(task.config), *type(self.taskset).toolsets(self.taskset.config)]
        return [(s.server_name, s) for s in servers]

    def datasets(self) -> tuple[list[Any], None]:
        """(every task, None): a taskset has no eval split of its own, the adapter splits it by hash."""
        return self.tasks, None

    def identity(self, task: Any) -> Any:
        return task.data.model_dump(mode="json", exclude={"idx"}, exclude_none=True)

    def answer(self, task: Any) -> Any:
        return getattr(task.data, "answer", None)

    def prompt(self, task: Any) -> list[dict[str, str]]:
        data = task.data
        system = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        if isinstance(data.prompt, str):
            return [*system, {"role": "user", "content": data.prompt}]
        return [*system, *plain_messages(data.prompt)]

    async def score(self, task: Any, text: str) -> tuple[float, dict[str, float]]:
        messages, _ = await self.replay(task, text, pause=False)
        trace = self._trace(task, messages)
        await task.score(trace)  # no runtime: the rewards that need one were refused at load
        parts = {k: float(r.score) for k, r in trace.rewards.items() if r is not None}
        parts |= {k: float(v) for k, v in trace.metrics.items() if v is not None}
        return float(trace.reward), parts

    async def respond(self, task: Any, text: str) -> str | None:
        _, reply = await self.replay(task, text, pause=True)
        return reply

    async def replay(self, task: Any, text: str, pause: bool) -> tuple[list[Any], str | None]:
        """(messages, pending reply | None): the conversation `text` encodes, tool replies checked."""
        from verifiers.v1.types import AssistantMessage, ToolCall, ToolMessage

        messages: list[Any] = []
        tools: dict[str, Any] | None = None  # built on the first cache miss
        earlier: list[Any] = []  # the calls before this one, served from the cache
        pos = turns = 0
        while pos < len(text) or (pause and turns == 0):
            segment, pos = self.protocol.next_segment(text, pos)
            turns += 1
            call = self.protocol.parse_call(segment)
            calls = None
            if isinstance(call, tuple):
                calls = [ToolCall(id=f"call_{turns}", name=call[0], arguments=json.dumps(call[1]))]
            messages.append(AssistantMessage(content=segment, tool_calls=calls))
            if call is None or turns >= self.max_turns:
                if pos != len(text):
                    raise ReplayMismatch(f"the text goes on after the episode ended at char {pos}")
                return messages, None
            key = (str(task.hash), hashlib.blake2b(text[:pos].encode(), digest_size=16).hexdigest())
            result = self._cache.get(key)
            if result is None:
                if tools is None:
                    # fresh toolsets see this episode's earlier calls first, in order: a toolset may keep
                    # state across calls, so a result must not depend on what the cache served before
                    tools = await self._episode_tools(task)
                    for before in earlier:
                        await _call_tool(tools, before)
                result = await _call_tool(tools, call)
                self._remember(key, result)
            earlier.append(call)
            reply = self.protocol.render_reply([result])
            if pos == len(text):
                return messages, (reply if pause else None)
            if not text.startswith(reply, pos):
                raise ReplayMismatch(f"the tool reply at char {pos} differs from the tool's")
            pos += len(reply)
            messages.append(ToolMessage(tool_call_id=f"call_{turns}", content=result))
        return messages, None

    def _remember(self, key: tuple[str, str], result: str) -> None:
        """Keep `result` under (task, digest of the text before the call): bounded in count and, since the
        key holds a digest and not the text, in size."""
        self._cache[key] = result
        if len(self._cache) > TOOL_CACHE:
            self._cache.popitem(last=False)

    async def _episode_tools(self, task: Any) -> dict[str, Any]:
        """Fresh toolsets for one episode (a `Toolset` may keep per-task state): set up, then set up for `task`."""
        from verifiers.v1.utils.decorators import discover_decorated

        fns: dict[str, Any] = {}
        for prefix, toolset in self._toolsets(task):
            await toolset.setup()
            await toolset.setup_task(task)
            fns.update(_named_tools(prefix, discover_decorated(toolset, "tool")))
        return fns

    def _trace(self, task: Any, messages: list[Any]) -> Any:
        import verifiers.v1 as vf
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.trace import AgentInfo, Trace, TraceTask
        from verifiers.v1.types import SystemMessage, UserMessage

        data = task.data
        head: list[Any] = [SystemMessage(content=data.system_prompt)] if data.system_prompt else []
        head += (
            [UserMessage(content=data.prompt)] if isinstance(data.prompt, str) else list(data.prompt or [])
        )
        nodes = [
            MessageNode(
                parent=i - 1 if i else None, message=m, sampled=i >= len(head) and m.role == "assistant"
            )
            for i, m in enumerate([*head, *messages])
        ]
        return Trace(
            task=TraceTask(type=type(task).__name__, data=data, key=task.key, hash=task.hash),
            agent=AgentInfo(config=vf.AgentConfig()),
            nodes=nodes,
            is_completed=True,
            ok=True,
        )


def _named_tools(prefix: str | None, fns: list[Any]) -> list[tuple[str, Any]]:
    """(advertised name, function) of a toolset's tools: `prefix_name` unless the toolset has no prefix."""
    out = []
    for fn in fns:
        name = getattr(fn, "tool_name", None) or fn.__name__
        out.append((f"{prefix}_{name}" if prefix else name, fn))
    return out


async def _call_tool(tools: dict[str, Any], call: Call | str) -> str:
    """The tool's result as text; a malformed call, an unknown tool or a raising tool answer with the error
    (as an MCP server would), so the model sees it and the episode goes on."""
    if isinstance(call, str):
        return call
    name, args = call
    fn = tools.get(name)
    if fn is None:
        return f"unknown tool {name!r}; tools: {sorted(tools)}"
    try:
        out = fn(**args)
        if inspect.isawaitable(out):
            out = await out
    except Exception as e:  # noqa: BLE001 - a failing tool is the model's problem to read, not a crash
        return f"tool error: {type(e).__name__}: {e}"
    return out if isinstance(out, str) else json.dumps(out, default=str)


def _schema(fn: Any) -> dict[str, Any]:
    """A JSON schema of a tool's parameters, from its signature."""
    props, required = {}, []
    for name, p in inspect.signature(fn).parameters.items():
        annotation = p.annotation if isinstance(p.annotation, str) else getattr(p.annotation, "__name__", "")
        props[name] = {"type": _JSON_TYPES.get(annotation, "string")}
        if p.default is inspect.Parameter.empty:
            required.append(name)
    return {"type": "object", "properties": props, "required": required}


def _refuse_unscorable(task: Any) -> None:
    def needs_runtime(fn: Any) -> bool:
        param = inspect.signature(fn).parameters.get("runtime")
        return param is not None and param.default is inspect.Parameter.empty

    bound = [fn.__name__ for fn in [*task.hooks("reward"), *task.hooks("metric")] if needs_runtime(fn)]
    if bound:
        raise ConfigError(
            f"rewards/metrics {bound} of {type(task).__name__} need a runtime (a sandbox or a container): pnyx's "
            "trainer re-scores every completion from its text alone, in-process, and verifiers would skip them"
        )
    judges = list(getattr(task.config, "judges", None) or [])
    if judges:
        raise ConfigError(
            f"{type(task).__name__} plugs {len(judges)} judge(s): an LLM judge cannot re-score in pnyx's trainer "
            "(no model to call, and a paid, non-deterministic verdict); use @vf.reward functions"
        )
