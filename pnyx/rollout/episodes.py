"""The multi-turn tool loop: generate until a tool call, append the tool's reply as tokens, continue.

Episodes are assembled as token ids. The model's own tokens are kept exactly as sampled (loss mask 1, their
behaviour logprob); a tool reply is encoded once and appended with loss mask 0 and logprob 0.0; nothing is
ever re-tokenized. Each turn re-reads the whole context (prompt + episode so far), so a recorded logprob is
the model's probability given exactly the tokens the trainer will see.

Finish reasons: "stop" (EOS, a non-tool stop string, or the tool answered None), "length" (the episode
token cap or the per-turn `max_new_tokens` was reached), "turn_limit" (a tool call when no model turn is
left), "tool_error" (the tool raised, returned a non-string, or a reply over `max_tool_tokens`; the reason
is in `Episode.error`). A failing tool never raises into the caller. Knows nothing about which environment
the tool belongs to, the store or the trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from pnyx.errors import ConfigError

if TYPE_CHECKING:
    from pnyx.rollout.engine import Engine, SamplingParams

ToolFn = Callable[[str], "str | None"]
EpisodeFinish = Literal["stop", "length", "turn_limit", "tool_error"]

# A reply longer than this many characters per allowed token is refused before tokenizing it.
_MAX_CHARS_PER_TOKEN = 32


@dataclass
class Episode:
    """One multi-turn completion: model and tool tokens interleaved, with loss mask and behaviour logprobs."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    finish_reason: EpisodeFinish = "stop"
    num_tool_calls: int = 0
    text: str = ""
    error: str | None = None
    """Why the episode failed (tool_error), else None."""
    turns: int = 0

    def _append(self, tokens: list[int], logprobs: list[float], mask: int) -> None:
        self.tokens.extend(tokens)
        self.logprobs.extend(logprobs)
        self.loss_mask.extend([mask] * len(tokens))


def _call_tool(tool: ToolFn, text: str, tokenizer, max_tool_tokens: int) -> tuple[list[int] | None, str | None]:
    """(reply token ids or None for no reply, error message or None). Never raises."""
    try:
        reply = tool(text)
    except Exception as e:  # the tool is user/environment code: any failure ends this episode only
        return None, f"tool raised {type(e).__name__}: {e}"
    if reply is None:
        return None, None
    if not isinstance(reply, str):
        return None, f"tool returned {type(reply).__name__}, expected str or None"
    if len(reply) > max_tool_tokens * _MAX_CHARS_PER_TOKEN:
        return None, f"tool reply of {len(reply)} characters exceeds max_tool_tokens={max_tool_tokens}"
    ids = list(tokenizer.encode(reply, add_special_tokens=False))
    if len(ids) > max_tool_tokens:
        return None, f"tool reply of {len(ids)} tokens exceeds max_tool_tokens={max_tool_tokens}"
    return ids, None


def run_episodes(
    engine: Engine,
    prompt_ids: list[list[int]],
    params: SamplingParams,
    tool: ToolFn | Sequence[ToolFn],
    tool_stops: list[str],
    max_turns: int,
    max_episode_tokens: int = 1024,
    max_tool_tokens: int = 512,
) -> list[Episode]:
    """One episode per prompt. `tool` is one callable for all, or one per prompt; it gets the episode's
    decoded text so far (completion part) and returns the reply text, or None to end the episode.

    `max_turns` bounds model turns (generate calls) per episode; `max_episode_tokens` bounds model plus
    tool tokens; `params.max_new_tokens` bounds each turn. Turn t is sampled with seed `params.seed + t`.
    """
    if max_turns < 1:
        raise ConfigError(f"max_turns must be >= 1, got {max_turns}")
    if max_episode_tokens < 1:
        raise ConfigError(f"max_episode_tokens must be >= 1, got {max_episode_tokens}")
    tools = list(tool) if isinstance(tool, Sequence) else [tool] * len(prompt_ids)
    if len(tools) != len(prompt_ids):
        raise ConfigError(f"{len(tools)} tools for {len(prompt_ids)} prompts: pass one, or one per prompt")
    tokenizer = engine.tokenizer
    stops = list(dict.fromkeys([*params.stop, *tool_stops]))
    tool_only = set(tool_stops) - set(params.stop)
    episodes = [Episode() for _ in prompt_ids]
    active = list(range(len(prompt_ids)))
    turn = 0
    while active:
        budget = max(max_episode_tokens - len(episodes[i].tokens) for i in active)
        turn_params = replace(
            params, stop=stops, seed=params.seed + turn, max_new_tokens=min(params.max_new_tokens, budget)
        )
        contexts = [prompt_ids[i] + episodes[i].tokens for i in active]
        completions = engine.generate(contexts, turn_params)
        still: list[int] = []
        for i, c in zip(active, completions, strict=True):
            ep = episodes[i]
            ep.turns += 1
            room = max_episode_tokens - len(ep.tokens)
            ep._append(c.tokens[:room], c.logprobs[:room], 1)
            if len(c.tokens) > room or c.finish_reason == "length":
                ep.finish_reason = "length"
            elif c.stop is None or c.stop not in tool_only:
                ep.finish_reason = "stop"
            else:
                ep.num_tool_calls += 1
                if ep.turns >= max_turns:
                    ep.finish_reason = "turn_limit"
                    continue
                text = tokenizer.decode(ep.tokens, skip_special_tokens=True)
                reply, error = _call_tool(tools[i], text, tokenizer, max_tool_tokens)
                if error is not None:
                    ep.finish_reason, ep.error = "tool_error", error
                elif reply is None:
                    ep.finish_reason = "stop"
                elif len(ep.tokens) + len(reply) >= max_episode_tokens:
                    ep.finish_reason = "length"
                else:
                    ep._append(reply, [0.0] * len(reply), 0)
                    still.append(i)
        active = still
        turn += 1
    for ep in episodes:
        ep.text = tokenizer.decode(ep.tokens, skip_special_tokens=True)
    return episodes
