"""The records of generation every engine shares (torch, MLX, vLLM): `SamplingParams`, `Completion`, the
per-turn `Turn` (stop strings are found by `pnyx.models.tokenizer.StopMatcher`, which the trainer's episode
check shares). No torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from pnyx.errors import ConfigError

if TYPE_CHECKING:
    from pnyx.protocol.draws import UniformStream

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
    draws: list[UniformStream] | None = None
    """Seeded draws (`pnyx.protocol.draws`): one uniform stream per prompt row, in order; row i's model
    tokens take its stream's uniforms instead of `seed`'s, so its tokens depend on nothing but the weights,
    its context and its stream (not on the batch). Only engines with `seeded_draws` accept them."""

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
        if self.draws is not None and self.temperature <= 0:
            raise ConfigError("seeded draws need temperature > 0 (greedy decoding draws nothing)")

    def check_rows(self, rows: int) -> None:
        """ConfigError unless `draws` (when set) holds one stream per prompt row."""
        if self.draws is not None and len(self.draws) != rows:
            raise ConfigError(f"seeded draws: {len(self.draws)} uniform streams for {rows} prompt rows")


@dataclass
class Completion:
    """One sampled completion: token ids, behaviour logprob per token, why it ended, its text."""

    tokens: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    text: str
    stop: str | None = None
    """The stop string that ended it (None for EOS or length)."""


@dataclass
class Turn:
    """What one decode turn produced for each of its rows, and which rows the session still holds."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    reasons: list[FinishReason]
    stops: list[str | None]
    resident: list[int]
    """The turn's rows still in the session after the turn, in session order (rows ended by a `park` stop
    always are; their last token is not in the cache yet)."""
