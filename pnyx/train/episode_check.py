"""The shape of a sample beyond its draws: every tool reply is the environment's own, and every model turn
ends where the worker's engine would have stopped it.

The check of seeded draws (`pnyx.train.drawcheck`) proves that each model token (loss mask 1) is the draw of
its uniform given everything before it. Two things it cannot see, both found by a red-team review
(2026-12-04, docs/security.md):

- **Tool tokens** (loss mask 0) take no uniform. Unchecked, a worker could append `<answer>N</answer>` as
  "tool" tokens and so set any sample's reward, insert tokens that change the context (and so re-roll the
  rest of the sample from the same uniforms), or end a "turn" to get another `max_new_tokens`. Here every
  run of tool tokens must be exactly the environment's reply to the text before it (`env.respond(task,
  text)`, encoded as the worker's tool loop encodes it), in an environment that has tools, within its
  `max_turns`.
- **Where a sample ends.** A prefix of an honest draw is itself a run of honest draws, and so is a draw
  continued past EOS or a stop string. Unchecked, a worker could cut any sample short (zeroing a correct
  answer) or run one on. Here, as the engines stop (`pnyx.rollout.engine`, `engines/mlx_decode.py`): no
  model turn holds EOS or completes a stop string before its last token, and each ends at EOS, at a stop
  string (a turn followed by a tool reply: a tool stop), at the per-turn budget, or at the episode's token
  cap.

`EpisodeRules.check(task, group)` raises `RecordRejected("forged_episode")`. Tool replies are checked on
every group; the endings only on seeded groups, the ones pnyx's own decode loops produce (an engine with its
own stop logic, vLLM, is taken from trusted keys only). Deterministic and cheap: one `respond` per tool
reply (a BM25 search in `searchqa`) and a stop-window decode per token that could end a stop. Knows nothing
about the store or torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pnyx.envs.base import Environment, Task
from pnyx.errors import RecordRejected
from pnyx.models.tokenizer import StopMatcher
from pnyx.protocol.records import RolloutGroup, Sample

EPISODE_TOKENS = 1024
"""The tool loop's cap on an episode's model plus tool tokens (`WorkerEngine.run_episodes`' default, which
`pnyx.rollout.cohort.sample_env` keeps): a last turn cut there ends the episode."""


def _runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, mask value) of each maximal run of equal loss-mask values."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((start, i, mask[start]))
            start = i
    return runs


@dataclass
class EpisodeRules:
    """What the worker's tool loop and engine allow (see the module docstring)."""

    env: Environment
    eos_ids: frozenset[int]
    """The ids that end a completion (`pnyx.models.tokenizer.eos_token_ids` of the run's model)."""
    stops: StopMatcher
    """The environment's stop strings and tool stops, matched as the engines match them."""
    detokenize: Callable[[list[int]], str]
    """Completion ids to text as the tool loop decodes them (`skip_special_tokens=True`)."""
    tokenize: Callable[[str], list[int]]
    """A tool reply to ids as the tool loop encodes it (`add_special_tokens=False`)."""
    max_new_tokens: int | None
    """The per-turn budget (None: not known, so a turn that stops short is not judged by it)."""
    max_episode_tokens: int = EPISODE_TOKENS

    def check(self, task: Task, group: RolloutGroup) -> None:
        for i, s in enumerate(group.samples):
            try:
                self._sample(task, s, bool(group.draws))
            except _Forged as e:
                raise RecordRejected("forged_episode", f"sample {i}: {e}") from None

    def _sample(self, task: Task, s: Sample, seeded: bool) -> None:
        tokens, mask = list(s.tokens), list(s.loss_mask)
        if not tokens:
            raise _Forged("no tokens (an engine's sample ends with a token: EOS, a stop or the budget)")
        runs = _runs(mask)
        if runs[0][2] == 0:
            raise _Forged("starts with tool tokens")
        for start, end, m in runs:
            if m == 0:
                self._tool_reply(task, tokens, start, end)
        turns = self._model_turns(task, tokens, runs)
        max_turns = int(getattr(self.env, "max_turns", 1) or 1)
        if len(turns) > max_turns:
            raise _Forged(f"{len(turns)} model turns (the environment allows {max_turns})")
        if not seeded:
            return
        tool_stops = set(self.env.tool_stops)
        for start, end, reply_follows in turns:
            capped = end == len(tokens) and len(tokens) >= self.max_episode_tokens
            self._turn_end(
                tokens[start:end], capped=capped, tool_follows=reply_follows, tool_stops=tool_stops
            )

    def _model_turns(
        self, task: Task, tokens: list[int], runs: list[tuple[int, int, int]]
    ) -> list[tuple[int, int, bool]]:
        """(start, end, a reply follows) of each model turn. A run of model tokens is one turn, unless a tool
        call inside it got an empty reply (no tokens): the tool loop then went on with the next turn right
        after the call, so the run is split there."""
        turns: list[tuple[int, int, bool]] = []
        tool_stops = set(self.env.tool_stops)
        for k, (start, end, m) in enumerate(runs):
            if not m:
                continue
            cur = start
            if tool_stops:
                for j in range(start + 1, end):
                    if self._stop_at(tokens, cur, j) in tool_stops and self._empty_reply(task, tokens[:j]):
                        turns.append((cur, j, True))
                        cur = j
            turns.append((cur, end, k + 1 < len(runs)))
        return turns

    def _stop_at(self, tokens: list[int], start: int, end: int) -> str | None:
        """The stop the turn `tokens[start:end]` completes with its last token, as the engine matches after
        each token (`StopMatcher.match` reads only the last `window` tokens: no longer slice is copied)."""
        return self.stops.match(tokens[max(start, end - self.stops.window) : end])

    def _empty_reply(self, task: Task, before: list[int]) -> bool:
        reply = self.env.respond(task, self.detokenize(before))
        return reply is not None and not list(self.tokenize(reply))

    def _tool_reply(self, task: Task, tokens: list[int], start: int, end: int) -> None:
        if not self.env.tool_stops:
            raise _Forged(f"tool tokens at {start}-{end} in an environment without tools")
        reply = self.env.respond(task, self.detokenize(tokens[:start]))
        if reply is None:
            raise _Forged(f"tool tokens at {start}-{end} where the environment gives no reply")
        if list(self.tokenize(reply)) != tokens[start:end]:
            raise _Forged(f"tool tokens at {start}-{end} are not the environment's reply")

    def _turn_end(self, turn: list[int], *, capped: bool, tool_follows: bool, tool_stops: set[str]) -> None:
        """The engine's stop rules on one model turn (`tool_follows`: the tool loop answered its call)."""
        for j in range(1, len(turn)):  # what the engine checked after each token but the last
            if turn[j - 1] in self.eos_ids:
                raise _Forged(f"continues past EOS at turn token {j - 1}")
            if (stop := self._stop_at(turn, 0, j)) is not None:
                raise _Forged(f"continues past the stop {stop!r} at turn token {j - 1}")
        stop = self.stops.match(turn)
        if tool_follows:
            if stop not in tool_stops:
                raise _Forged("a tool reply follows a turn that did not end with a tool call")
            return
        if turn[-1] in self.eos_ids or stop is not None or capped:
            return
        if self.max_new_tokens is None or len(turn) >= self.max_new_tokens:
            return  # at the budget (or no budget known: a short turn cannot be judged by it)
        raise _Forged(f"a turn of {len(turn)} tokens ends before EOS, a stop or the budget")


class _Forged(Exception):
    pass
