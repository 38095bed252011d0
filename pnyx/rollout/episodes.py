"""The multi-turn tool loop: generate until a tool call, append the tool's reply as tokens, continue.

Episodes are assembled as token ids. The model's own tokens are kept exactly as sampled (loss mask 1, their
behaviour logprob); a tool reply is encoded once and appended with loss mask 0 and logprob 0.0; nothing is
ever re-tokenized. Two loops give the same episodes for the same seed (up to float noise in the logits):
- on the cache (default where the model allows it): one decode session for the whole batch; a row that
  calls a tool waits in the session while the others finish the turn, then only its last token and the
  reply are prefilled on top of its KV cache;
- re-prefill: every turn is a fresh `generate` over prompt + episode so far.
Either way a recorded logprob is the model's probability given exactly the tokens the trainer will see
(position ids count real tokens only; waiting slots and padding are masked).

Finish reasons: "stop" (EOS, a non-tool stop string, or the tool answered None), "length" (the episode
token cap or the per-turn `max_new_tokens` was reached), "turn_limit" (a tool call when no model turn is
left), "tool_error" (the tool raised, returned a non-string, or a reply over `max_tool_tokens`; the reason
is in `Episode.error`). A failing tool never raises into the caller. Knows nothing about which environment
the tool belongs to, the store or the trainer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast, runtime_checkable

from pnyx.errors import ConfigError
from pnyx.rollout.sampling import Completion, SamplingParams, Turn

log = logging.getLogger("pnyx.engine")

if TYPE_CHECKING:
    import torch

    from pnyx.rollout.decoder import FastSession
    from pnyx.rollout.hf_session import HFSession


class Sampler(Protocol):
    """What the re-prefill loop drives: a tokenizer and batched `generate` (every engine of
    `pnyx.rollout.engines`, which runs its tool turns through `run_episodes` here)."""

    tokenizer: Any  # a transformers tokenizer: untyped library surface

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[Completion]: ...


@runtime_checkable
class Decoding(Sampler, Protocol):
    """What the loop on the KV cache drives as well: the torch decode loop `pnyx.rollout.engine.Engine`
    (the decode session it samples over turn by turn)."""

    pad_id: int
    device: torch.device

    def session(self, max_len: int) -> FastSession | HFSession: ...

    def decode(
        self,
        session: FastSession | HFSession,
        logits: torch.Tensor,
        params: SamplingParams,
        park: frozenset[str] = ...,
    ) -> Turn: ...


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


def _call_tool(
    tool: ToolFn, text: str, tokenizer, max_tool_tokens: int
) -> tuple[list[int] | None, str | None]:
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


def _settle(
    ep: Episode,
    tokens: list[int],
    logprobs: list[float],
    reason: str,
    stop: str | None,
    tool: ToolFn,
    tokenizer,
    tool_only: set[str],
    max_turns: int,
    max_episode_tokens: int,
    max_tool_tokens: int,
) -> list[int] | None:
    """Append one model turn to `ep`, run its tool call if it made one; the reply's token ids if the
    episode goes on (already appended with loss mask 0), else None with `ep.finish_reason` set."""
    ep.turns += 1
    room = max_episode_tokens - len(ep.tokens)
    ep._append(tokens[:room], logprobs[:room], 1)
    if len(tokens) > room or reason == "length":
        ep.finish_reason = "length"
        return None
    if stop is None or stop not in tool_only:
        ep.finish_reason = "stop"
        return None
    ep.num_tool_calls += 1
    if ep.turns >= max_turns:
        ep.finish_reason = "turn_limit"
        return None
    text = tokenizer.decode(ep.tokens, skip_special_tokens=True)
    reply, error = _call_tool(tool, text, tokenizer, max_tool_tokens)
    if error is not None:
        ep.finish_reason, ep.error = "tool_error", error
        return None
    if reply is None:
        ep.finish_reason = "stop"
        return None
    if len(ep.tokens) + len(reply) >= max_episode_tokens:
        ep.finish_reason = "length"
        return None
    ep._append(reply, [0.0] * len(reply), 0)
    return reply


def run_episodes(
    engine: Sampler,
    prompt_ids: list[list[int]],
    params: SamplingParams,
    tool: ToolFn | Sequence[ToolFn],
    tool_stops: list[str],
    max_turns: int,
    max_episode_tokens: int = 1024,
    max_tool_tokens: int = 512,
    reuse_cache: bool | None = None,
) -> list[Episode]:
    """One episode per prompt. `tool` is one callable for all, or one per prompt; it gets the episode's
    decoded text so far (completion part) and returns the reply text, or None to end the episode.

    `max_turns` bounds model turns (generate calls) per episode; `max_episode_tokens` bounds model plus
    tool tokens; `params.max_new_tokens` bounds each turn. Turn t is sampled with seed `params.seed + t`.
    `reuse_cache`: True = continue on the KV cache after each tool reply (error if `engine` is no `Decoding`
    or this model's cache cannot hold holes), False = re-prefill the whole context every turn, None = reuse
    where the engine and the model allow it.
    """
    if max_turns < 1:
        raise ConfigError(f"max_turns must be >= 1, got {max_turns}")
    if max_episode_tokens < 1:
        raise ConfigError(f"max_episode_tokens must be >= 1, got {max_episode_tokens}")
    tools = list(tool) if isinstance(tool, Sequence) else [tool] * len(prompt_ids)
    if len(tools) != len(prompt_ids):
        raise ConfigError(f"{len(tools)} tools for {len(prompt_ids)} prompts: pass one, or one per prompt")
    if not prompt_ids:
        return []
    if any(len(p) == 0 for p in prompt_ids):
        raise ConfigError("every prompt needs at least one token")
    loop = _Loop(engine, params, tools, tool_stops, max_turns, max_episode_tokens, max_tool_tokens)
    episodes = None
    if reuse_cache is True and not isinstance(engine, Decoding):
        raise ConfigError(f"reuse_cache=True, but {type(engine).__name__} has no decode session to reuse")
    if reuse_cache is not False and isinstance(engine, Decoding):
        episodes = loop.on_cache(engine, prompt_ids, required=reuse_cache is True)
    if episodes is None:
        episodes = loop.re_prefill(prompt_ids)
    for ep in episodes:
        ep.text = cast(str, engine.tokenizer.decode(ep.tokens, skip_special_tokens=True))
    return episodes


class _Loop:
    """The turn loop, in two implementations that give the same episodes (up to float noise)."""

    def __init__(
        self,
        engine: Sampler,
        params: SamplingParams,
        tools: list[ToolFn],
        tool_stops: list[str],
        max_turns: int,
        max_episode_tokens: int,
        max_tool_tokens: int,
    ):
        self.engine, self.params, self.tools = engine, params, tools
        self.stops = list(dict.fromkeys([*params.stop, *tool_stops]))
        self.tool_only = set(tool_stops) - set(params.stop)
        self.max_turns = max_turns
        self.max_episode_tokens = max_episode_tokens
        self.max_tool_tokens = max_tool_tokens

    def turn_params(self, episodes: list[Episode], active: list[int], turn: int) -> SamplingParams:
        budget = max(self.max_episode_tokens - len(episodes[i].tokens) for i in active)
        return replace(
            self.params,
            stop=self.stops,
            seed=self.params.seed + turn,
            max_new_tokens=min(self.params.max_new_tokens, budget),
            draws=None if self.params.draws is None else [self.params.draws[i] for i in active],
        )

    def settle(self, ep: Episode, i: int, tokens, logprobs, reason, stop) -> list[int] | None:
        return _settle(
            ep,
            tokens,
            logprobs,
            reason,
            stop,
            self.tools[i],
            self.engine.tokenizer,
            self.tool_only,
            self.max_turns,
            self.max_episode_tokens,
            self.max_tool_tokens,
        )

    def re_prefill(self, prompt_ids: list[list[int]]) -> list[Episode]:
        """Each turn is a fresh `generate` over prompt + episode so far."""
        episodes = [Episode() for _ in prompt_ids]
        active = list(range(len(prompt_ids)))
        turn = 0
        while active:
            turn_params = self.turn_params(episodes, active, turn)
            contexts = [prompt_ids[i] + episodes[i].tokens for i in active]
            completions = self.engine.generate(contexts, turn_params)
            active = [
                i
                for i, c in zip(active, completions, strict=True)
                if self.settle(episodes[i], i, c.tokens, c.logprobs, c.finish_reason, c.stop) is not None
            ]
            turn += 1
        return episodes

    def on_cache(self, engine: Decoding, prompt_ids: list[list[int]], required: bool) -> list[Episode] | None:
        """One decode session for the whole batch: a row that calls a tool waits in the session (holes),
        then its last token and the reply are appended on top of its cache. None if the model's session
        cannot hold holes (and `required` is False)."""
        import torch

        from pnyx.rollout.decoder import left_pad

        episodes = [Episode() for _ in prompt_ids]
        active = list(range(len(prompt_ids)))
        turn_params = self.turn_params(episodes, active, 0)
        with torch.inference_mode():
            ids, attn = left_pad(prompt_ids, engine.pad_id, engine.device)
            session = engine.session(ids.shape[1] + turn_params.max_new_tokens)
            if not session.holes_ok:
                if required:
                    raise ConfigError(
                        f"reuse_cache=True, but this model's cache cannot: {session.holes_reason}"
                    )
                _note_fallback(engine, session.holes_reason)
                return None
            logits = session.prefill(ids, attn)
            turn = 0
            park = frozenset(self.tool_only)
            while True:
                out = engine.decode(session, logits, turn_params, park)
                still, chunks, rows = [], [], []
                for j, i in enumerate(active):
                    reply = self.settle(
                        episodes[i], i, out.tokens[j], out.logprobs[j], out.reasons[j], out.stops[j]
                    )
                    if reply is not None:  # it ended on a park stop, so it is still in the session
                        still.append(i)
                        rows.append(out.resident.index(j))
                        chunks.append([out.tokens[j][-1], *reply])  # its last token is not in the cache yet
                if not still:
                    return episodes
                if rows != list(range(len(out.resident))):
                    session.keep(torch.tensor(rows, device=engine.device))
                chunk_ids, chunk_attn = left_pad(chunks, engine.pad_id, engine.device)
                logits = session.extend(chunk_ids, chunk_attn)
                active, turn = still, turn + 1
                turn_params = self.turn_params(episodes, active, turn)


def _note_fallback(engine: Decoding, reason: str | None) -> None:
    """Say once per engine why tool turns re-prefill instead of reusing the KV cache."""
    if not getattr(engine, "_told_fallback", False):
        log.info("tool turns re-prefill the context (no KV-cache reuse) for this model: %s", reason)
        engine._told_fallback = True  # pyright: ignore[reportAttributeAccessIssue]  (a mark on the instance)
