"""Ingestion: from rollout objects in the store to scored, filtered groups ready for a training step.

The trainer at version V lists only the prefixes `rollouts/v{v}/` for v in [V - max_staleness, V] (never
the whole history), fetches groups it has not seen, decodes and validates them (protocol limits, key vs.
record consistency, the prompt re-rendered from the task), **re-scores every sample with the trainer's own
verifier** (the worker's reward is only compared, never used), computes advantages, and drops
zero-variance groups. Selection then applies reuse (`max_reuse` uses per group) and the per-prompt cap
(`max_groups_per_prompt` groups of one task per step). Every drop is counted by reason.

Knows nothing about torch or models: text comes from an injected `detokenize` callable and prompts from an
optional `render` callable, so this module is testable with plain bytes.

Invariants:
- the `Cursor` (uses per group key, rejections, drop counters, the stale sweep mark) is the only state
  that survives a restart; everything else here is a cache rebuilt from the store;
- a group's use count changes only through `commit`, with the keys of a step's batch, so a group is used
  at most once per step and at most `max_reuse` times overall;
- a group whose version leaves the window unused is counted once as a `stale` drop (one listing of that
  version's prefix when it leaves), then forgotten, so the cursor stays bounded by the window.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pnyx.errors import ConfigError, NotFoundError, RecordRejected
from pnyx.protocol import layout
from pnyx.train.advantages import AdvantageMode, group_advantages, is_zero_variance

log = logging.getLogger("pnyx.train.ingest")

REWARD_TOL = 1e-6
"""A worker's reward 'agrees' with the re-score when they differ by at most this."""


@dataclass(frozen=True)
class IngestSettings:
    """The filters of ingestion (from the config's `algorithm` section)."""

    max_staleness: int = 3
    max_reuse: int = 1
    max_groups_per_prompt: int = 2
    advantage: AdvantageMode = "grpo"
    adv_eps: float = 1e-6


@dataclass
class ScoredGroup:
    """A validated group with the trainer's own rewards and advantages."""

    key: str
    version: int
    worker_id: str
    task_id: str
    group: Any
    """The decoded `RolloutGroup` record."""
    rewards: list[float]
    """Re-scored by the trainer's verifier, one per sample."""
    advantages: list[float]
    worker_rewards: list[float]
    """What the worker claimed (for disagreement statistics only)."""

    @property
    def num_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.group.samples)


class Cursor(msgspec.Struct):
    """Ingestion state persisted with every checkpoint (JSON)."""

    uses: dict[str, int] = {}
    """Group key -> times consumed, for keys still inside the window."""
    rejected: dict[str, str] = {}
    """Group key -> drop reason, for keys still inside the window (never fetched again)."""
    drops: dict[str, int] = {}
    """Cumulative drop counts by reason."""
    disagreements: dict[str, int] = {}
    """Cumulative per-worker count of samples whose claimed reward differed from the re-score."""
    scored: dict[str, int] = {}
    """Cumulative per-worker count of re-scored samples."""
    swept_below: int = 0
    """Versions below this have left the window and been swept for stale drops."""

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def from_json(cls, data: bytes) -> Cursor:
        return msgspec.json.decode(data, type=cls)


def _default_decode(data: bytes, vocab_size: int | None) -> Any:
    from pnyx.protocol.codec import decode_group

    return decode_group(data, vocab_size=vocab_size)


@dataclass
class Ingestor:
    """Window listing, validation, re-scoring and selection of rollout groups for one run.

    `env` is the run's environment (`task`, `score`); `detokenize(ids) -> str` turns completion tokens into
    the text the verifier scores; `render(prompt) -> ids` (optional) re-renders a task's prompt so a group
    whose prompt tokens do not match its task id is rejected; `expected_digest(version)` (optional) gives
    the published chain digests a group of that version may carry (one per plane: bf16 weights, int8).
    """

    store: Any
    env: Any
    detokenize: Callable[[list[int]], str]
    settings: IngestSettings = field(default_factory=IngestSettings)
    cursor: Cursor = field(default_factory=Cursor)
    run_id: str | None = None
    vocab_size: int | None = None
    render: Callable[[Any], list[int]] | None = None
    expected_digest: Callable[[int], frozenset[str] | None] | None = None
    decode: Callable[[bytes, int | None], Any] = _default_decode
    _cache: dict[str, ScoredGroup] = field(default_factory=dict, init=False, repr=False)
    _rendered: dict[str, list[int]] = field(default_factory=dict, init=False, repr=False)

    # --- window -----------------------------------------------------------------------------------

    def window(self, version: int) -> range:
        """Rollout versions the trainer at `version` may train on: [version - max_staleness, version]."""
        return range(max(0, version - self.settings.max_staleness), version + 1)

    def poll(self, version: int) -> int:
        """Sweep versions that left the window, list the window, fetch and score new groups.

        Returns the number of usable groups (see `available`).
        """
        self._sweep(version)
        for v in self.window(version):
            for meta in self.store.list(layout.rollouts_dir(v)):
                key = meta.key
                if key in self._cache or key in self.cursor.rejected:
                    continue
                if self.cursor.uses.get(key, 0) >= self.settings.max_reuse:
                    continue
                self._admit(key)
        return self.available(version)

    def _sweep(self, version: int) -> None:
        """Count groups of versions that left the window unused as `stale`, then forget those versions."""
        low = max(0, version - self.settings.max_staleness)
        for v in range(self.cursor.swept_below, low):
            prefix = layout.rollouts_dir(v)
            for meta in self.store.list(prefix):
                if layout.parse_rollout_key(meta.key) is None:
                    continue
                if self.cursor.uses.get(meta.key, 0) == 0 and meta.key not in self.cursor.rejected:
                    self._drop("stale")
            for d in (self.cursor.uses, self.cursor.rejected, self._cache):
                for k in [k for k in d if k.startswith(prefix)]:
                    del d[k]
        self.cursor.swept_below = max(self.cursor.swept_below, low)

    # --- admission: decode, validate, re-score --------------------------------------------------------

    def _drop(self, reason: str) -> None:
        self.cursor.drops[reason] = self.cursor.drops.get(reason, 0) + 1

    def _reject(self, key: str, reason: str, detail: str = "") -> None:
        self.cursor.rejected[key] = reason
        self._drop(reason)
        log.debug("rejected %s: %s %s", key, reason, detail)

    def _admit(self, key: str) -> None:
        try:
            scored = self.load(key, count=True)
        except RecordRejected as e:
            self._reject(key, e.reason, str(e))
            return
        except NotFoundError:  # listed then deleted (retention of a foreign run): nothing to count
            return
        if is_zero_variance(scored.rewards):
            self._reject(key, "zero_variance")
            return
        self._cache[key] = scored

    def load(self, key: str, count: bool = False) -> ScoredGroup:
        """Fetch, validate and re-score one group (no filters). Raises RecordRejected(reason).

        Used by `poll` (with `count`: reward disagreements enter the per-worker counters) and, on resume,
        to rebuild exactly the batch a recorded step consumed.
        """
        parsed = layout.parse_rollout_key(key)
        if parsed is None:
            raise RecordRejected("bad_key", key)
        version, worker, seq = parsed
        group = self.decode(self.store.get(key), self.vocab_size)
        if group.policy_version != version or group.worker_id != worker or group.seq != seq:
            raise RecordRejected(
                "key_mismatch",
                f"{key} holds v={group.policy_version} worker={group.worker_id} seq={group.seq}",
            )
        if self.run_id is not None and group.run_id != self.run_id:
            raise RecordRejected("run_mismatch", f"{group.run_id!r} != {self.run_id!r}")
        if self.expected_digest is not None:
            want = self.expected_digest(version)
            if want is None:
                raise RecordRejected("unknown_version", f"{key}: weights v{version} are not published")
            if group.weights_digest not in want:
                raise RecordRejected("weights_mismatch", f"{key}: generated from a forked or foreign history")
        env_name = getattr(self.env, "name", None)
        if env_name is not None and group.env != env_name:
            raise RecordRejected("env_mismatch", f"{key} is from env {group.env!r}, the run's is {env_name!r}")
        if len(group.samples) < 2:
            raise RecordRejected("group_too_small", f"{len(group.samples)} samples")
        try:
            task = self.env.task(group.task_id)
        except (ConfigError, KeyError, ValueError) as e:
            raise RecordRejected("unknown_task", f"{group.task_id!r}: {e}") from None
        if self.render is not None:
            expected = self._rendered.get(task.id)
            if expected is None:
                expected = self._rendered[task.id] = list(self.render(task.prompt))
            if list(group.prompt_tokens) != expected:
                raise RecordRejected("prompt_mismatch", f"prompt tokens do not render task {task.id}")
        rewards = []
        for s in group.samples:
            text = self.detokenize(list(s.tokens))
            rewards.append(float(self.env.score(task, text).reward))
        claimed = [float(s.reward) for s in group.samples]
        bad = sum(abs(a - b) > REWARD_TOL for a, b in zip(claimed, rewards, strict=True))
        w = group.worker_id
        if count:
            self.cursor.scored[w] = self.cursor.scored.get(w, 0) + len(rewards)
            if bad:
                self.cursor.disagreements[w] = self.cursor.disagreements.get(w, 0) + bad
        adv = group_advantages(rewards, self.settings.advantage, self.settings.adv_eps)
        return ScoredGroup(key, version, worker, group.task_id, group, rewards, adv, claimed)

    # --- selection ----------------------------------------------------------------------------------

    def _candidates(self, version: int) -> list[ScoredGroup]:
        lo = version - self.settings.max_staleness
        out = [
            g
            for g in self._cache.values()
            if lo <= g.version <= version and self.cursor.uses.get(g.key, 0) < self.settings.max_reuse
        ]
        # Fresh groups before replayed ones; among equals the newest policy version first (least stale);
        # within a version, workers take turns (each worker's oldest group first), so one worker whose id
        # sorts first cannot crowd the others out of every batch.
        rank: dict[str, int] = {}
        by_worker: dict[tuple[int, str], list[ScoredGroup]] = {}
        for g in out:
            by_worker.setdefault((g.version, g.worker_id), []).append(g)
        for groups in by_worker.values():
            for i, g in enumerate(sorted(groups, key=lambda g: g.key)):
                rank[g.key] = i
        out.sort(key=lambda g: (self.cursor.uses.get(g.key, 0), -g.version, rank[g.key], g.key))
        return out

    def select(self, version: int, n: int) -> list[ScoredGroup]:
        """Up to `n` distinct groups for the step at `version`, honouring reuse and the per-prompt cap.

        Does not change any state: the caller `commit`s the keys once the step is recorded.
        """
        per_prompt: Counter[str] = Counter()
        chosen: list[ScoredGroup] = []
        for g in self._candidates(version):
            if per_prompt[g.task_id] >= self.settings.max_groups_per_prompt:
                continue
            per_prompt[g.task_id] += 1
            chosen.append(g)
            if len(chosen) == n:
                break
        return chosen

    def available(self, version: int) -> int:
        """How many groups `select` could return now (without a size limit)."""
        return len(self.select(version, 1 << 30))

    def commit(self, keys: Iterable[str]) -> None:
        """Record that one step consumed these groups (each once)."""
        keys = list(keys)
        if len(set(keys)) != len(keys):
            raise ValueError("a step's batch must not contain the same group twice")
        for k in keys:
            self.cursor.uses[k] = self.cursor.uses.get(k, 0) + 1
            if self.cursor.uses[k] >= self.settings.max_reuse:
                self._cache.pop(k, None)

    def stats(self) -> dict[str, Any]:
        """Cumulative counters for the step log: drops by reason, reward disagreements per worker."""
        return {
            "drops": dict(self.cursor.drops),
            "disagreements": dict(self.cursor.disagreements),
            "scored": dict(self.cursor.scored),
        }
