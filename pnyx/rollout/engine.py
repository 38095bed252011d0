"""The generation engine: batched sampling with a KV cache, per-token behaviour logprobs, stop strings.

`Engine.generate` samples completions for a batch of token-id prompts of any lengths (left-padded, masked,
position ids counting real tokens only). For every sampled token it records the log-probability under the
exact distribution it was drawn from (`pnyx.models.logprobs.sampling_logprobs`: temperature, top-k, top-p),
so `completion_logprobs` on the trainer reproduces it. Greedy (temperature 0) records the temperature-1,
untruncated logprob of the argmax token. Completions end at EOS (the EOS token is kept, it is the model's
choice to stop), at a stop string (the token that completes it is kept; detected on a decoded window of the
last few tokens, never by re-tokenizing), or at `max_new_tokens`. Finished rows leave the batch.

Seeded: the same model, prompts and `SamplingParams` (seed included) give the same tokens. A row's draw
depends on the whole batch, so the same prompt in a different batch may sample differently.
`Engine.run_episodes` (the multi-turn tool loop) lives in `episodes.py`. Knows nothing about
environments' scoring, the store or the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from pnyx.errors import ConfigError
from pnyx.models.logprobs import sampling_logprobs
from pnyx.models.tokenizer import eos_token_ids
from pnyx.rollout.decoder import left_pad, open_session

if TYPE_CHECKING:
    from collections.abc import Sequence

    from pnyx.rollout.episodes import Episode, ToolFn

FinishReason = Literal["stop", "length"]

# Compact the KV cache once this fraction of the rows in it have finished: copying the cache costs about
# one decode step, decoding dead rows costs a little every step.
COMPACT_FRACTION = 0.25


@dataclass
class SamplingParams:
    """How to sample. temperature 0 means greedy; top_k 0 and top_p 1 mean no truncation."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop: list[str] = field(default_factory=list)
    seed: int = 0
    ignore_eos: bool = False
    """Keep sampling past EOS (benchmarks use it so every row produces max_new_tokens)."""

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError(f"stop strings must be non-empty strings, got {self.stop!r}")


@dataclass
class Completion:
    """One sampled completion: token ids, behaviour logprob per token, why it ended, its text."""

    tokens: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    text: str
    stop: str | None = None
    """The stop string that ended it (None for EOS or length)."""


class StopMatcher:
    """Finds the first token whose text completes one of the stop strings, from a window of recent tokens."""

    def __init__(self, tokenizer: Any, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = list(stops)
        # Every token decodes to at least one byte, so a stop of n bytes is covered by its last n tokens;
        # two more absorb a partial UTF-8 character at the window's start.
        self.window = max((len(s.encode("utf-8")) for s in self.stops), default=0) + 2
        self.last_chars = {s[-1] for s in self.stops}
        self.token_text: dict[int, str] = {}

    def could_end(self, token: int) -> bool:
        """False if `token` cannot be the one completing a stop: a newly completed stop ends inside the
        newest token's text, so that text must hold a stop's last character (unknown for tokens that
        decode to nothing or to part of a UTF-8 character; those are always checked)."""
        text = self.token_text.get(token)
        if text is None:
            text = self.token_text[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return not text or "\ufffd" in text or any(c in text for c in self.last_chars)

    def match(self, tokens: list[int]) -> str | None:
        """The stop string the text of `tokens` now contains, checked after every appended token."""
        if not self.stops or not self.could_end(tokens[-1]):
            return None
        tail = self.tokenizer.decode(tokens[-self.window :], skip_special_tokens=False)
        for s in self.stops:
            if s in tail:
                return s
        return None


class Engine:
    """Batched sampling from a causal LM (any transformers model; a fast path for Llama-shaped ones)."""

    def __init__(self, model: Any, tokenizer: Any, fast: bool | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.fast = fast
        self.eos_ids = eos_token_ids(tokenizer, model)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad) if pad is not None else 0
        self.device = next(model.parameters()).device

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[Completion]:
        """One completion per prompt, in order."""
        if not prompt_ids:
            return []
        if any(len(p) == 0 for p in prompt_ids):
            raise ConfigError("every prompt needs at least one token")
        with torch.inference_mode():
            tokens, logprobs, reasons, stops = self._sample(prompt_ids, params)
        return [
            Completion(t, lp, r, self.tokenizer.decode(t, skip_special_tokens=True), s)
            for t, lp, r, s in zip(tokens, logprobs, reasons, stops, strict=True)
        ]

    def _sample(
        self, prompts: list[list[int]], params: SamplingParams
    ) -> tuple[list[list[int]], list[list[float]], list[FinishReason], list[str | None]]:
        n, max_new = len(prompts), params.max_new_tokens
        dev = self.device
        ids, attn = left_pad(prompts, self.pad_id, dev)
        session = open_session(self.model, ids.shape[1] + max_new, self.fast)
        gen = torch.Generator(device=dev).manual_seed(params.seed)
        matcher = StopMatcher(self.tokenizer, params.stop)
        eos = torch.tensor(self.eos_ids or [-1], dtype=torch.long, device=dev)

        out_tok = torch.zeros(n, max_new, dtype=torch.long, device=dev)
        out_lp = torch.zeros(n, max_new, dtype=torch.float32, device=dev)
        lengths = [max_new] * n
        reasons: list[FinishReason] = ["length"] * n
        stop_of: list[str | None] = [None] * n
        history: list[list[int]] = [[] for _ in range(n)] if matcher.stops else []
        rows = torch.arange(n, device=dev)  # original index of each row in the session
        alive = torch.ones(n, dtype=torch.bool, device=dev)

        logits = session.prefill(ids, attn)
        for step in range(max_new):
            tok, lp = self._draw(logits, params, gen)
            out_tok[rows, step] = tok
            out_lp[rows, step] = lp
            ended = torch.zeros_like(alive) if params.ignore_eos else torch.isin(tok, eos) & alive
            if matcher.stops:
                flags = ended.tolist()
                for j, (i, t, a) in enumerate(zip(rows.tolist(), tok.tolist(), alive.tolist(), strict=True)):
                    if not a:
                        continue
                    history[i].append(t)
                    if not flags[j] and (s := matcher.match(history[i])) is not None:
                        flags[j] = True
                        stop_of[i] = s
                ended = torch.tensor(flags, dtype=torch.bool, device=dev)
            for j in ended.nonzero().flatten().tolist():
                i = int(rows[j])
                lengths[i], reasons[i] = step + 1, "stop"
            alive &= ~ended
            if step == max_new - 1 or not bool(alive.any()):
                break
            dead = len(alive) - int(alive.sum())
            if dead >= max(1, COMPACT_FRACTION * len(alive)):
                keep = alive.nonzero().flatten()
                session.keep(keep)
                rows, alive, tok = rows[keep], alive[keep], tok[keep]
            logits = session.step(tok)

        tok_rows, lp_rows = out_tok.tolist(), out_lp.tolist()
        tokens = [tok_rows[i][: lengths[i]] for i in range(n)]
        logprobs = [lp_rows[i][: lengths[i]] for i in range(n)]
        return tokens, logprobs, reasons, stop_of

    @staticmethod
    def _draw(
        logits: torch.Tensor, params: SamplingParams, gen: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(token [b], its logprob [b]) from last-position logits [b, V] under `params`."""
        logp = sampling_logprobs(logits, params.temperature, params.top_k, params.top_p)
        if params.temperature <= 0:
            tok = logp.argmax(-1)
        else:
            # Inverse-CDF sampling: one uniform per row (cheaper than a Gumbel draw per vocabulary entry).
            # right=True returns the first index whose cumulative mass exceeds u, which always has p > 0.
            cdf = logp.exp().cumsum(-1)
            u = torch.rand(cdf.shape[0], 1, generator=gen, device=cdf.device, dtype=cdf.dtype) * cdf[:, -1:]
            tok = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)

    def run_episodes(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        tool: ToolFn | Sequence[ToolFn],
        tool_stops: list[str],
        max_turns: int,
        max_episode_tokens: int = 1024,
        max_tool_tokens: int = 512,
    ) -> list[Episode]:
        """Multi-turn episodes with tool calls; see `pnyx.rollout.episodes.run_episodes`."""
        from pnyx.rollout.episodes import run_episodes

        return run_episodes(
            self, prompt_ids, params, tool, tool_stops, max_turns, max_episode_tokens, max_tool_tokens
        )
