"""The text protocol of a `verifiers` environment under pnyx: how tool calls and env replies look as text.

pnyx has no structured tool calls: the model writes a call as text, the engine stops at a tool stop, and
the environment's reply is appended as text (its tokens masked out of the loss by
`pnyx.rollout.episodes`). Two formats:
- `tool_format="json"` (default): `<tool_call>{"name": "calc", "arguments": {"expression": "2+3"}}</tool_call>`,
  reply `<tool_response>5</tool_response>`;
- `tool_format="tags"` (one-argument tools): `<calc>2+3</calc>`, reply wrapped in `reply_tags` (e.g.
  `<information>…</information>`, the searchqa protocol the shipped tiny model knows).

Also holds `AdapterOptions`, the options of the adapter itself (`env.kwargs["pnyx"]`), validated once.
Knows nothing about verifiers' classes, models or tokenizers. Invariant: the rendering of a reply is a
pure function of the env's reply messages, so replaying a completion re-derives every reply byte for byte.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

from pnyx.errors import ConfigError

ToolFormat = Literal["json", "tags"]
Call = tuple[str, dict[str, Any]]
"""A parsed tool call: (tool name, arguments)."""


class ReplayMismatch(Exception):
    """The completion text is not what this environment's replies would have produced (a forged or
    altered tool reply, or one the tokenizer's round trip changed)."""


@dataclass(frozen=True)
class AdapterOptions:
    """Options of the adapter (`env.kwargs={"pnyx": {...}}`); every other keyword goes to the verifiers env."""

    test_fraction: float = 0.1
    """Share of rows held out as `test` (by content hash) when the env has no eval dataset."""
    tool_format: ToolFormat = "json"
    """How the model writes a tool call: `json` (`<tool_call>{...}</tool_call>`) or `tags` (`<name>arg</name>`)."""
    reply_tags: tuple[str, str] | None = None
    """(open, close) around an env reply; None: `<tool_response>` (json) or `<result>` (tags). Must be plain
    text for the model's tokenizer (decoding drops special tokens, and the replay would then refuse)."""
    tool_prompt: bool = True
    """Describe the tools and the call format in the system message."""
    max_new_tokens: int = 256
    """The generation budget per model turn (`worker.max_new_tokens` unset means this)."""
    max_turns: int | None = None
    """Model turns per episode; None: the env's own `max_turns` (classic), else 8 with tools, 1 without."""
    stop_strings: tuple[str, ...] = ()
    """Where the engine stops for good (e.g. `["</answer>"]`)."""
    turn_stops: tuple[str, ...] = ()
    """Where a model turn ends and the env answers without a tool call (a `MultiTurnEnv` game)."""
    reward_range: tuple[float, float] | None = None
    """(lo, hi) of the env's reward: rescaled to [0, 1] as (r - lo) / (hi - lo). None: pnyx clamps to [0, 1]."""
    timeout_s: float = 10.0
    """Deadline of one `score` or `respond` call into verifiers."""

    @classmethod
    def parse(cls, raw: dict[str, Any] | None) -> AdapterOptions:
        raw = dict(raw or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(
                f"unknown verifiers adapter options {unknown} in env.kwargs.pnyx; known: {sorted(known)}"
            )
        for name in ("reply_tags", "reward_range", "stop_strings", "turn_stops"):
            if raw.get(name) is not None:
                if isinstance(raw[name], str) or not isinstance(raw[name], list | tuple):
                    raise ConfigError(f"verifiers option {name} must be a list, got {raw[name]!r}")
                raw[name] = tuple(raw[name])
        opts = cls(**raw)
        opts._check()
        return opts

    def _check(self) -> None:
        if self.tool_format not in get_args(ToolFormat):
            raise ConfigError(f"tool_format must be one of {get_args(ToolFormat)}, got {self.tool_format!r}")
        if not 0.0 < self.test_fraction < 1.0:
            raise ConfigError(f"test_fraction must be in (0, 1), got {self.test_fraction!r}")
        if self.reply_tags is not None and (
            len(self.reply_tags) != 2 or not all(isinstance(t, str) and t for t in self.reply_tags)
        ):
            raise ConfigError(
                f"reply_tags must be two non-empty strings [open, close], got {self.reply_tags!r}"
            )
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.max_turns is not None and (not isinstance(self.max_turns, int) or self.max_turns < 1):
            raise ConfigError(f"max_turns must be an integer >= 1 (or null), got {self.max_turns!r}")
        if any(not isinstance(s, str) or not s for s in (*self.stop_strings, *self.turn_stops)):
            raise ConfigError("stop_strings and turn_stops must be non-empty strings")
        if self.reward_range is not None:
            rr = self.reward_range
            if len(rr) != 2 or not all(isinstance(v, int | float) for v in rr) or not rr[0] < rr[1]:
                raise ConfigError(
                    f"reward_range must be [lo, hi] with lo < hi, got {list(self.reward_range)!r}"
                )
        if not isinstance(self.timeout_s, int | float) or not 0 < self.timeout_s < math.inf:
            raise ConfigError(f"timeout_s must be a positive number, got {self.timeout_s!r}")

    def rescale(self, reward: float) -> float:
        """The env's reward mapped to pnyx's [0, 1] by `reward_range` (unchanged without one)."""
        if self.reward_range is None:
            return reward
        lo, hi = self.reward_range
        return (reward - lo) / (hi - lo)


@dataclass(frozen=True)
class ToolSpec:
    """One tool the model may call: its name, description and JSON-schema parameters."""

    name: str
    description: str
    parameters: dict[str, Any]


@dataclass
class Protocol:
    """Parses the model's turns and calls, renders the env's replies (see the module docstring)."""

    tools: list[ToolSpec]
    fmt: ToolFormat
    reply_open: str
    reply_close: str
    turn_stops: list[str] = field(default_factory=list)

    @classmethod
    def make(cls, tools: list[ToolSpec], opts: AdapterOptions) -> Protocol:
        default = (
            ("<tool_response>", "</tool_response>")
            if opts.tool_format == "json"
            else ("<result>", "</result>")
        )
        reply_open, reply_close = opts.reply_tags or default
        if opts.tool_format == "tags":
            for t in tools:
                if len(t.parameters.get("properties", {})) != 1:
                    raise ConfigError(
                        f"tool_format='tags' needs one-argument tools; {t.name!r} takes "
                        f"{sorted(t.parameters.get('properties', {}))}: use tool_format='json'"
                    )
        return cls(tools, opts.tool_format, reply_open, reply_close, list(opts.turn_stops))

    @property
    def tool_stops(self) -> list[str]:
        """Where the engine stops to ask for the env's reply."""
        if not self.tools:
            calls = []
        elif self.fmt == "json":
            calls = ["</tool_call>"]
        else:
            calls = [f"</{t.name}>" for t in self.tools]
        return [*calls, *self.turn_stops]

    def preamble(self) -> str:
        """The tools and the call format, for the system message ("" without tools)."""
        if not self.tools:
            return ""
        lines = ["Tools:"]
        lines += [
            json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters})
            for t in self.tools
        ]
        call = (
            '<tool_call>{"name": ..., "arguments": {...}}</tool_call>'
            if self.fmt == "json"
            else "<NAME>argument</NAME>"
        )
        lines.append(f"Call one as {call}; its result comes back as {self.reply_open}...{self.reply_close}.")
        return "\n".join(lines)

    def next_segment(self, text: str, pos: int) -> tuple[str, int]:
        """The model turn starting at `pos`: up to and including the first tool stop, else the rest."""
        ends = [i + len(s) for s in self.tool_stops if (i := text.find(s, pos)) >= 0]
        end = min(ends) if ends else len(text)
        return text[pos:end], end

    def parse_call(self, segment: str) -> Call | str | None:
        """(name, arguments) of the call the segment ends with; None if it ends with none; an error string
        if the call is malformed (the env then answers with that error, like verifiers' ToolEnv)."""
        if self.fmt == "json":
            return _parse_json_call(segment)
        for t in self.tools:
            close = f"</{t.name}>"
            if segment.endswith(close):
                start = segment.rfind(f"<{t.name}>")
                if start < 0:
                    return f"tool call has no <{t.name}> opening tag"
                (param,) = t.parameters.get("properties", {})
                return t.name, {param: segment[start + len(t.name) + 2 : -len(close)]}
        return None

    def render_reply(self, contents: list[str]) -> str:
        return "".join(f"{self.reply_open}{c}{self.reply_close}" for c in contents)


def _parse_json_call(segment: str) -> Call | str | None:
    if not segment.endswith("</tool_call>"):
        return None
    start = segment.rfind("<tool_call>")
    if start < 0:
        return "tool call has no <tool_call> opening tag"
    try:
        call = json.loads(segment[start + len("<tool_call>") : -len("</tool_call>")])
    except ValueError as e:
        return f"malformed tool call: {e}"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return 'malformed tool call: expected {"name": ..., "arguments": {...}}'
    args = call.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError as e:
            return f"malformed tool call arguments: {e}"
    if not isinstance(args, dict):
        return "malformed tool call: arguments must be an object"
    return call["name"], args


def content_text(content: Any) -> str:
    """The text of a message's content: a string, or the text parts of a content-part list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            (p.get("text", "") if isinstance(p, dict) else getattr(p, "text", "") or "") for p in content
        )
    return str(content)


def plain_messages(messages: Any) -> list[dict[str, str]]:
    """verifiers messages (dicts or pydantic models) as pnyx chat messages `{"role", "content"}`."""
    out = []
    for m in messages or []:
        role = m.get("role") if isinstance(m, dict) else getattr(m, "role", None)
        content = m.get("content") if isinstance(m, dict) else getattr(m, "content", None)
        out.append({"role": str(role), "content": content_text(content)})
    return out
