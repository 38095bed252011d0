"""The environment API: `Task`, `Score` and the `Environment` base class every verifier implements.

An environment samples tasks from a seeded stream with `train` and `test` splits and scores a completion.
It knows nothing about models, tokenizers, torch or the object store: it sees prompts and completion text only.

Invariants every environment keeps (tests prove them for each built-in):
- `env.task(task.id)` rebuilds exactly the task that `sample` returned, from the id alone (the trainer
  re-scores from the id and never trusts a worker's copy of the answer).
- `sample(split, seed, n)` is a pure function of its arguments, and no problem appears in both splits.
- `score` never raises on arbitrary text and returns a reward in [0, 1] within a bounded time: the text is
  capped at `max_chars` before any parsing, and parsers are linear in their input.
- Every prompt an environment builds (through `chat`) starts with its system prompt, so every caller that
  renders `task.prompt` (worker, trainer, evaluation, swarm) sees the same text; the system prompt states
  the answer format the verifier expects.

Options every environment has, set by `configure` (`get_env` passes them from its keyword arguments):
`system_prompt` (None keeps the class default, "" means none) and `format_reward` (the share of the reward
paid for the `format` part; 0 by default).
"""

from __future__ import annotations

import hashlib
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from pnyx.errors import ConfigError

BASE_OPTIONS = ("system_prompt", "format_reward")
"""Options every environment accepts through `get_env`, handled by `Environment.configure`."""
MAX_FORMAT_REWARD = 0.5
"""`format_reward` must stay below this, so a correct answer always outscores a well-formatted wrong one."""

Split = Literal["train", "test"]
SPLITS: tuple[Split, ...] = ("train", "test")

Prompt = str | list[dict[str, str]]
AnswerMode = Literal["tag", "lenient"]
ANSWER_MODES: tuple[AnswerMode, ...] = ("tag", "lenient")


@dataclass(frozen=True)
class Task:
    """One problem: a self-describing id, the prompt (chat messages or text), the hidden answer data."""

    id: str
    prompt: Prompt
    answer: Any
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Score:
    """A verifier's verdict: reward in [0, 1], named parts (`correct`, `format`, ...), and why it is 0."""

    reward: float
    parts: dict[str, float] = field(default_factory=dict)
    reason: str | None = None


def user_prompt(content: str) -> list[dict[str, str]]:
    """A one-message chat prompt (no system message); environments build theirs with `Environment.chat`."""
    return [{"role": "user", "content": content}]


def stable_hash(*parts: object) -> int:
    """A 64-bit hash of `parts` that is the same in every process and Python version (unlike `hash`)."""
    data = "\x1f".join(str(p) for p in parts).encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def seeded_rng(*parts: object) -> random.Random:
    """A `random.Random` seeded from `parts` with `stable_hash` (int seeding is stable across versions)."""
    return random.Random(stable_hash(*parts))


def split_of(canonical: str, test_fraction: float, salt: str = "") -> Split:
    """Which split a problem belongs to, from the hash of its canonical form.

    A problem is in `test` iff its hash falls in the reserved bucket, so the two splits can never share a
    problem however many tasks either stream produces.
    """
    bucket = stable_hash("split", salt, canonical) % 1_000_000
    return "test" if bucket < round(test_fraction * 1_000_000) else "train"


def check_fraction(test_fraction: float) -> float:
    """Validate a `test_fraction` option: both splits must be able to hold problems."""
    if not isinstance(test_fraction, int | float) or not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"test_fraction must be a number in (0, 1), got {test_fraction!r}")
    return float(test_fraction)


def check_answer_mode(answer: str, env: str) -> AnswerMode:
    """Validate an `answer=` option: "tag" (only the tagged answer counts) or "lenient" (the tagged answer
    when there is one, else what the environment can read from the bare text, e.g. the last number)."""
    if answer not in ANSWER_MODES:
        raise ConfigError(f"{env} answer must be one of {ANSWER_MODES}, got {answer!r}")
    return answer  # type: ignore[return-value]


def check_split(split: str) -> Split:
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r}: expected one of {SPLITS}")
    return split  # type: ignore[return-value]


def zero(reason: str, **parts: float) -> Score:
    """A zero score with a reason (and whatever parts were already known)."""
    return Score(reward=0.0, parts={k: float(v) for k, v in parts.items()}, reason=reason)


class Environment(ABC):
    """Base class of every environment. Subclasses implement `sample`, `task` and `grade`.

    Class attributes a subclass may override:
    - `name`: the registry name (also the first segment of every task id).
    - `system_prompt`: the default system message of every prompt (`chat` prepends it); it should state
      the answer format the verifier expects, briefly and with an example. "" for none.
    - `max_new_tokens`: the generation budget per model turn that the env needs (`worker.max_new_tokens`
      unset means this).
    - `stop_strings`: the engine stops generation after any of these.
    - `tool_stops`: the engine stops here to ask `respond` for a tool reply ([] for single-turn).
    - `max_turns`: model turns per episode (1 for single-turn).
    - `max_chars`: `score` looks at no more than this many characters of a completion (the tail).
    - `part_names`: the parts every `Score` carries (0.0 when the verifier did not get that far), so
      metrics can average them across completions.
    - `screen_by_reference`: True when a completion passes essentially only if it is the reference
      (`reference_completion`), so the policy's probability of the reference is its pass rate and workers
      may screen tasks by it before generating (`pnyx.rollout.screen`). False (default) for tasks with many
      correct completions (reasoning, several solutions).
    """

    name: str = "base"
    system_prompt: str = ""
    max_new_tokens: int = 256
    format_reward: float = 0.0
    stop_strings: list[str] = []
    tool_stops: list[str] = []
    max_turns: int = 1
    max_chars: int = 16_384
    part_names: tuple[str, ...] = ("correct", "format")
    screen_by_reference: bool = False

    # --- options every environment has -------------------------------------------------------

    def configure(self, system_prompt: str | None = None, format_reward: float = 0.0) -> Environment:
        """Set the options every environment has; returns `self`. Call before sampling tasks.

        `system_prompt`: None keeps the class default, "" drops the system message, any other text replaces
        it. `format_reward` in [0, 0.5): the reward becomes (1 - f) * reward + f * format, so a
        well-formatted wrong answer earns f, a correct one without the format 1 - f, a correct formatted one
        1; the paid amount is reported as the part `format_reward`.
        """
        if system_prompt is not None:
            if not isinstance(system_prompt, str):
                raise ConfigError(f'system_prompt must be a string ("" for none), got {system_prompt!r}')
            self.system_prompt = system_prompt
        if (
            not isinstance(format_reward, int | float)
            or isinstance(format_reward, bool)
            or not 0.0 <= format_reward < MAX_FORMAT_REWARD
        ):
            raise ConfigError(
                f"format_reward must be a number in [0, {MAX_FORMAT_REWARD}) so that correctness dominates, "
                f"got {format_reward!r}"
            )
        self.format_reward = float(format_reward)
        return self

    def chat(self, content: str) -> list[dict[str, str]]:
        """The chat prompt of one task: the system prompt (if any), then `content` as the user's turn."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": content}]

    def level_of(self, task: Task) -> Hashable | None:
        """The task's difficulty level (what the online curriculum tracks pass rates by), None if the env has
        none. Default: `task.meta["level"]`."""
        return task.meta.get("level")

    def problem_key(self, task: Task) -> Hashable:
        """What identifies the task's problem across task ids (a procedural stream draws the same problem
        under many ids): the worker's curriculum remembers outcomes by it. Default: `task.meta["problem"]`
        (arith `37+48`, countdown), else the task id."""
        return task.meta.get("problem", task.id)

    # --- the stream -------------------------------------------------------------------------

    @abstractmethod
    def sample(self, split: Split, seed: int, n: int, start: int = 0) -> list[Task]:
        """Tasks `start .. start+n-1` of the stream for (`split`, `seed`): deterministic, infinite or cycling."""

    @abstractmethod
    def task(self, task_id: str) -> Task:
        """Rebuild the task with this id (raises `ConfigError` if the id is not one of this environment's)."""

    def stream(self, split: Split, seed: int, start: int = 0, chunk: int = 64) -> Iterator[Task]:
        """The stream for (`split`, `seed`) from position `start`, forever (or cycling for datasets)."""
        while True:
            yield from self.sample(split, seed, chunk, start=start)
            start += chunk

    # --- scoring ----------------------------------------------------------------------------

    def score(self, task: Task, completion_text: str) -> Score:
        """Score a completion. Never raises on any text; returns reward in [0, 1] and a reason when 0."""
        if not isinstance(completion_text, str):
            result = zero("not_text")
        elif not completion_text.strip():
            result = zero("empty")
        else:
            # The answer lives at the end of a completion, so a huge one is judged by its tail.
            result = self.grade(task, completion_text[-self.max_chars :])
        parts = {name: 0.0 for name in self.part_names} | result.parts
        if self.format_reward > 0.0:
            parts["format_reward"] = 0.0
        reward = result.reward
        if not isinstance(reward, int | float) or math.isnan(reward):
            return Score(reward=0.0, parts=parts, reason="verifier_returned_nan")
        reward = min(1.0, max(0.0, float(reward)))
        if self.format_reward > 0.0:
            # Partial credit for the format only: correctness still dominates (format_reward < 0.5).
            fmt = parts.get("format", 0.0)
            fmt = (
                min(1.0, max(0.0, float(fmt)))
                if isinstance(fmt, int | float) and not math.isnan(fmt)
                else 0.0
            )
            parts["format_reward"] = self.format_reward * fmt
            reward = min(1.0, (1.0 - self.format_reward) * reward + parts["format_reward"])
        return Score(reward=reward, parts=parts, reason=result.reason)

    @abstractmethod
    def grade(self, task: Task, text: str) -> Score:
        """Score non-empty text already capped at `max_chars`. Must not raise on any input."""

    def respond(self, task: Task, text_so_far: str) -> str | None:
        """Multi-turn: the tool's reply to the call `text_so_far` ends with; None ends the episode."""
        return None

    # --- helpers for pretraining data and `pnyx envs show` -----------------------------------

    def reference_completion(self, task: Task) -> str | list[tuple[str, str]]:
        """An ideal completion: a string (single-turn) or (role, text) turns, role in {"model", "tool"}."""
        raise NotImplementedError(f"environment {self.name!r} has no reference completion")

    def describe(self) -> str:
        """One line for `pnyx envs list`."""
        doc = (type(self).__doc__ or "").strip().splitlines()
        return doc[0] if doc else ""


def parse_task_id(task_id: str, name: str, nfields: int) -> list[str]:
    """Split `name/a/b/...` into its `nfields` fields after the name, or raise an actionable `ConfigError`."""
    if not isinstance(task_id, str) or len(task_id) > 512:
        raise ConfigError(f"not a task id: {str(task_id)[:80]!r}")
    parts = task_id.split("/")
    if len(parts) != nfields + 1 or parts[0] != name:
        raise ConfigError(
            f"task id {task_id[:120]!r} is not a {name!r} task id (expected {name}/ and {nfields} fields)"
        )
    return parts[1:]


def parse_procedural_id(task_id: str, name: str) -> tuple[Split, int, int]:
    """(split, seed, index) of a procedural id `name/<split>/<seed>/<index>`."""
    split, seed, index = parse_task_id(task_id, name, 3)
    if split not in SPLITS or not _is_int(seed) or not index.isdigit():
        raise ConfigError(f"task id {task_id!r}: expected {name}/<train|test>/<int seed>/<index>")
    return split, int(seed), int(index)  # type: ignore[return-value]


def _is_int(s: str) -> bool:
    return 0 < len(s) <= 20 and (s.isdigit() or (s[0] == "-" and s[1:].isdigit()))
