"""The classic verifiers API (`load_environment() -> vf.Environment`) behind the adapter.

verifiers <= 0.3.x ships it (0.3.x as `verifiers.legacy`, aliased at `import verifiers as vf`):
`SingleTurnEnv`, `ToolEnv`, `MultiTurnEnv` and any env whose `rollout` asks `client.get_response`. pnyx
generates; this backend **replays the env's own rollout** over the generated text with a scripted
in-process client (`_ReplayClient`): each `get_response` hands the rollout the model's next turn, cut at a
tool stop, so `setup_state`, `env_response`, the tools, the stop conditions and
`rubric.score_rollout(state)` all run unchanged. `respond` replays up to the end of the text and returns
the reply the env gives there; `score` replays the whole episode and runs the rubric.

Refused at load (a `ConfigError` saying why): group reward functions and LLM judges (the trainer re-scores
one completion at a time, with no model to call) and sandbox/agent/MCP envs (their state lives outside
the process). Knows nothing about pnyx's engine or tokenizers. Invariant: a completion whose env replies
differ from what the env says now is refused (`ReplayMismatch`), never scored. Cost: a replay re-runs the
env's earlier turns, so an episode of T turns costs O(T^2) env steps; T is at most `max_turns` (the
replay refuses a text with more model turns, whatever the env's own limit).
"""

from __future__ import annotations

import copy
import importlib
import json
from collections.abc import Callable
from typing import Any

from pnyx.envs.verifiers.protocol import (
    AdapterOptions,
    Call,
    Protocol,
    ReplayMismatch,
    ToolSpec,
    content_text,
    plain_messages,
)
from pnyx.errors import ConfigError

REFUSED_ENVS = {
    "SandboxEnv": "runs tools in a remote sandbox",
    "PythonEnv": "runs code in a remote sandbox",
    "CliAgentEnv": "runs an agent program outside the process",
    "HarborEnv": "runs tasks in containers",
    "BrowserEnv": "drives a browser outside the process",
    "MCPEnv": "calls tools on MCP servers",
    "OpenEnvEnv": "talks to an OpenEnv server",
    "EnvGroup": "mixes several envs (load one at a time)",
}
"""Classic env classes whose episodes cannot be replayed in-process from the text alone, and why."""


class _Pause(Exception):
    """Raised inside the replayed rollout when the text ends and the env has answered: carries the reply."""

    def __init__(self, reply: str):
        self.reply = reply


class _End(Exception):
    """Raised inside the replayed rollout when the text ends and only the reply is wanted, not given."""


class ClassicBackend:
    """A classic `vf.Environment`: rows, prompts, replies and rewards (see the module docstring)."""

    api = "classic"

    def __init__(self, env: Any, opts: AdapterOptions):
        import verifiers as vf

        self.vf = vf
        self.env = env
        _refuse_unreplayable(env)
        self.part_names = tuple(dict.fromkeys(f.__name__ for r in _rubrics(env.rubric) for f in r.funcs))
        tools = [ToolSpec(t.name, t.description or "", dict(t.parameters)) for t in (env.tool_defs or [])]
        self.protocol = Protocol.make(tools, opts)
        own = getattr(env, "max_turns", -1)
        self.max_turns: int = opts.max_turns or (own if isinstance(own, int) and own > 0 else 8)

    def datasets(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """(rows, eval rows): the env's dataset and eval dataset; (the only one, None) when it has one."""
        env = self.env
        has_train = getattr(env, "dataset_source", None) is not None or env.dataset is not None
        has_test = getattr(env, "eval_dataset_source", None) is not None or env.eval_dataset is not None
        train = [dict(r) for r in env.build_dataset()] if has_train else []
        test = [dict(r) for r in env.build_eval_dataset()] if has_test else []
        return (train, test) if has_train and has_test else (train or test, None)

    def identity(self, row: dict[str, Any]) -> Any:
        """What makes two dataset rows the same task."""
        return {k: row.get(k) for k in ("prompt", "answer", "info", "task", "question")}

    def answer(self, row: dict[str, Any]) -> Any:
        return row.get("answer")

    def prompt(self, row: dict[str, Any]) -> list[dict[str, str]]:
        return plain_messages(row["prompt"])

    async def score(self, row: dict[str, Any], text: str) -> tuple[float, dict[str, float]]:
        state, _ = await self.replay(row, text, pause=False)
        await self.env.rubric.score_rollout(state)
        metrics = {k: float(v) for k, v in (state.get("metrics") or {}).items() if isinstance(v, int | float)}
        return float(state["reward"] or 0.0), metrics

    async def respond(self, row: dict[str, Any], text: str) -> str | None:
        _, reply = await self.replay(row, text, pause=True)
        return reply

    async def replay(self, row: dict[str, Any], text: str, pause: bool) -> tuple[Any, str | None]:
        """Run the env's own rollout over `text`: (state, None) when the episode ended inside the text;
        (state, reply) in pause mode when the env answered the call `text` ends with."""
        client = _client_class(self.vf)(self, text, pause)
        try:
            state = await self.env.rollout(copy.deepcopy(row), client, "pnyx", {})
        except _Pause as p:
            return client.state, p.reply
        except _End:
            return client.state, None
        if client.pos != len(text):
            raise ReplayMismatch(f"the env ended the episode at char {client.pos} of {len(text)}")
        return state, None

    def response(self, segment: str, call: Call | str | None, turn: int) -> Any:
        """A verifiers `Response` carrying the model's turn `segment` and its parsed tool call."""
        # `verifiers.types` is the classic module's historical path (0.3.x aliases it to verifiers.legacy.types)
        types = importlib.import_module("verifiers.types")
        Response, ResponseMessage, ToolCall = types.Response, types.ResponseMessage, types.ToolCall
        tool_calls = None
        if isinstance(call, tuple):
            tool_calls = [ToolCall(id=f"call_{turn}", name=call[0], arguments=json.dumps(call[1]))]
        elif isinstance(call, str):  # malformed: arguments json.loads refuses -> ToolEnv's own error reply
            tool_calls = [ToolCall(id=f"call_{turn}", name="invalid", arguments=call)]
        message = ResponseMessage(
            role="assistant",
            content=segment,
            tool_calls=tool_calls,
            finish_reason="tool_calls" if tool_calls else "stop",
            is_truncated=False,
        )
        return Response(id="pnyx", created=0, model="pnyx", message=message)


def _rubrics(rubric: Any) -> list[Any]:
    return list(getattr(rubric, "rubrics", None) or [rubric])


def _class_names(obj: Any) -> set[str]:
    # by name, not isinstance: `getattr(vf, "BrowserEnv")` imports optional extras, or fails without them
    return {c.__name__ for c in type(obj).__mro__}


def _refuse_unreplayable(env: Any) -> None:
    for cls_name in sorted(_class_names(env) & set(REFUSED_ENVS)):
        raise ConfigError(
            f"verifiers {type(env).__name__} is a {cls_name}, which {REFUSED_ENVS[cls_name]}: pnyx's trainer "
            "re-scores every completion from its text alone, in-process, so it cannot load this env"
        )
    for r in _rubrics(env.rubric):
        if "JudgeRubric" in _class_names(r):
            raise ConfigError(
                f"the env's rubric {type(r).__name__} asks an LLM judge: pnyx's trainer re-scores every completion "
                "itself and would get a different (and paid) verdict; use rule-based reward functions"
            )
        group = [f.__name__ for f in r.funcs if r._is_group_func(f)]
        if group:
            raise ConfigError(
                f"group reward functions {group} score a whole group together; pnyx scores (and re-scores) one "
                "completion at a time: write them per completion"
            )


_CLIENT_CLASSES: dict[int, type] = {}


def _client_class(vf: Any) -> Callable[[ClassicBackend, str, bool], Any]:
    """The scripted in-process `vf.Client` (built once per verifiers module: it subclasses its `Client`)."""
    if id(vf) in _CLIENT_CLASSES:
        return _CLIENT_CLASSES[id(vf)]

    class _ReplayClient(vf.Client):
        """Answers the rollout's `get_response` with the model's next turn of the text; when the text is
        used up, ends the rollout (`_End`) or returns the env's reply to the last call (`_Pause`)."""

        def __init__(self, backend: ClassicBackend, text: str, pause: bool):
            super().__init__(object())
            self.backend, self.text, self.pause = backend, text, pause
            self.pos, self.turns, self.state = 0, 0, None

        def setup_client(self, config: Any) -> Any:
            return object()

        async def to_native_tool(self, tool: Any) -> Any:
            return tool

        async def to_native_prompt(self, messages: Any) -> Any:
            return messages, {}

        async def get_native_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError("the replay client answers get_response itself")

        async def raise_from_native_response(self, response: Any) -> None:
            return None

        async def from_native_response(self, response: Any) -> Any:
            return response

        async def close(self) -> None:
            return None

        async def get_response(
            self, prompt: Any, model: Any, sampling_args: Any, tools: Any = None, **kwargs: Any
        ) -> Any:
            self.state = kwargs.get("state", self.state)
            protocol = self.backend.protocol
            if self.turns:
                # the env's reply since the model's last turn: every message after the last assistant one
                last = max(i for i, m in enumerate(prompt) if _role(m) == "assistant")
                reply = protocol.render_reply([content_text(_content(m)) for m in prompt[last + 1 :]])
                if self.pos == len(self.text):
                    raise _Pause(reply) if self.pause else _End()
                if not self.text.startswith(reply, self.pos):
                    raise ReplayMismatch(f"the env's reply at char {self.pos} differs from the text's")
                self.pos += len(reply)
            if self.turns >= self.backend.max_turns:
                # an honest worker's episode has at most max_turns model turns (its engine stops there); the
                # env's own limit may be none (MultiTurnEnv's -1), so the replay enforces the run's
                raise ReplayMismatch(f"more than max_turns={self.backend.max_turns} model turns in the text")
            self.turns += 1
            segment, self.pos = protocol.next_segment(self.text, self.pos)
            return self.backend.response(segment, protocol.parse_call(segment), self.turns)

    _CLIENT_CLASSES[id(vf)] = _ReplayClient
    return _ReplayClient


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, dict) else getattr(message, "role", None)


def _content(message: Any) -> Any:
    return message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
