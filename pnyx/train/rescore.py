"""Validation and re-scoring of one rollout group: the trainer never trusts what a worker claims.

`rescore(key, group, ...)` checks a decoded group against its key (version, worker, seq), the run, the
published weights digest of its version (a forked or foreign history is refused), the environment, the
task id and the prompt (re-rendered by the trainer's tokenizer), then **re-scores every sample with the
trainer's own verifier** from the task id and the decoded completion text, and computes advantages. The
worker's rewards are kept only to count disagreements. Raises `RecordRejected(reason)`; the reason is a
counter key. `check_sampling` checks a group's sampling settings and per-turn budget against the run's.

Knows nothing about the store, listings or selection; no torch (text comes from an injected `detokenize`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pnyx.envs.base import Environment, Prompt
from pnyx.errors import ConfigError, RecordRejected
from pnyx.protocol.records import RolloutGroup
from pnyx.train.advantages import group_advantages
from pnyx.train.episode_check import EpisodeRules
from pnyx.train.ingest_state import IngestSettings

REWARD_TOL = 1e-6
"""A worker's reward 'agrees' with the re-score when they differ by at most this."""
RENDER_CACHE = 4096
"""Rendered prompts kept by task id (the oldest is forgotten first)."""


@dataclass
class ScoredGroup:
    """A validated group with the trainer's own rewards and advantages."""

    key: str
    version: int
    worker_id: str
    task_id: str
    group: RolloutGroup
    """The decoded record."""
    rewards: list[float]
    """Re-scored by the trainer's verifier, one per sample."""
    advantages: list[float]
    worker_rewards: list[float]
    """What the worker claimed (for disagreement statistics only)."""
    parts: list[dict[str, float]] = field(default_factory=list)
    """The trainer's reward parts per sample (`Score.parts`: `correct`, `format`, ...)."""
    signer: str = ""
    """Fingerprint of the worker key that signed the record ("" when the ingestor does not check)."""

    @property
    def num_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.group.samples)


def decode_record(data: bytes, vocab_size: int | None) -> RolloutGroup:
    """The group in a rollout object's bytes (`codec.decode_group`: the frame, the schema, the invariants)."""
    from pnyx.protocol.codec import decode_group

    return decode_group(data, vocab_size=vocab_size)


def disagreements(g: ScoredGroup) -> int:
    """Samples whose claimed reward differs from the trainer's re-score (more than `REWARD_TOL`)."""
    return sum(abs(a - b) > REWARD_TOL for a, b in zip(g.worker_rewards, g.rewards, strict=True))


def rescore(
    key: str,
    group: RolloutGroup,
    *,
    env: Environment,
    detokenize: Callable[[list[int]], str],
    settings: IngestSettings,
    run_id: str | None = None,
    expected_digest: Callable[[int], frozenset[str] | None] | None = None,
    render: Callable[[Prompt], list[int]] | None = None,
    rendered: dict[str, list[int]] | None = None,
    episodes: EpisodeRules | None = None,
) -> ScoredGroup:
    """Validate the decoded `group` stored at `key` and re-score it (see the module docstring).

    `settings` gives `advantage` and `adv_eps`; `rendered` caches rendered prompts by task id; `episodes`
    checks every tool reply and turn ending (`forged_episode`) before anything is scored.
    """
    from pnyx.protocol import layout

    parsed = layout.parse_rollout_key(key)
    if parsed is None:
        raise RecordRejected("bad_key", key)
    version, worker, seq = parsed
    if group.policy_version != version or group.worker_id != worker or group.seq != seq:
        raise RecordRejected(
            "key_mismatch",
            f"{key} holds v={group.policy_version} worker={group.worker_id} seq={group.seq}",
        )
    if run_id is not None and group.run_id != run_id:
        raise RecordRejected("run_mismatch", f"{group.run_id!r} != {run_id!r}")
    if expected_digest is not None:
        want = expected_digest(version)
        if want is None:
            raise RecordRejected("unknown_version", f"{key}: weights v{version} are not published")
        if group.weights_digest not in want:
            raise RecordRejected("weights_mismatch", f"{key}: generated from a forked or foreign history")
    env_name = getattr(env, "name", None)
    if env_name is not None and group.env != env_name:
        raise RecordRejected("env_mismatch", f"{key} is from env {group.env!r}, the run's is {env_name!r}")
    if len(group.samples) < 2:
        raise RecordRejected("group_too_small", f"{len(group.samples)} samples")
    try:
        task = env.task(group.task_id)
    except (ConfigError, KeyError, ValueError) as e:
        raise RecordRejected("unknown_task", f"{group.task_id!r}: {e}") from None
    if render is not None:
        cache = rendered if rendered is not None else {}
        expected = cache.get(task.id)
        if expected is None:
            if len(cache) >= RENDER_CACHE:  # procedural envs have endless task ids: keep memory bounded
                del cache[next(iter(cache))]
            expected = cache[task.id] = list(render(task.prompt))
        if list(group.prompt_tokens) != expected:
            raise RecordRejected("prompt_mismatch", f"prompt tokens do not render task {task.id}")
    if episodes is not None:
        episodes.check(task, group)
    rewards, parts = [], []
    for s in group.samples:
        score = env.score(task, detokenize(list(s.tokens)))
        rewards.append(float(score.reward))
        parts.append({k: float(v) for k, v in (getattr(score, "parts", None) or {}).items()})
    claimed = [float(s.reward) for s in group.samples]
    adv = group_advantages(rewards, settings.advantage, settings.adv_eps)
    return ScoredGroup(key, version, worker, group.task_id, group, rewards, adv, claimed, parts)


def check_sampling(group: RolloutGroup, settings: IngestSettings) -> None:
    """`settings` gives the run's `temperature`, `top_p`, `top_k`, `group_size`, `max_new_tokens` (None: not
    checked). Raise RecordRejected unless the group's sampling settings are the run's (`sampling_mismatch`;
    a group with seeded draws must hold exactly `group_size` samples: sample i is the draw of stream i, so
    keeping only some of them would choose by outcome) and every model turn (a run of loss-mask 1 tokens)
    fits the per-turn budget (`over_budget`)."""
    want = {"temperature": settings.temperature, "top_p": settings.top_p, "top_k": settings.top_k}
    wrong = [
        f"{k}={getattr(group, k)!r} (run: {v!r})"
        for k, v in want.items()
        if v is not None and getattr(group, k) != v
    ]
    if group.draws and settings.group_size is not None and len(group.samples) != settings.group_size:
        wrong.append(f"{len(group.samples)} samples (run: group_size={settings.group_size})")
    if wrong:
        raise RecordRejected("sampling_mismatch", ", ".join(wrong))
    budget = settings.max_new_tokens
    if budget is None:
        return
    for i, s in enumerate(group.samples):
        turn = longest = 0
        for m in s.loss_mask:
            turn = turn + 1 if m else 0
            longest = max(longest, turn)
        if longest > budget:
            raise RecordRejected("over_budget", f"sample {i} has a model turn of {longest} > {budget} tokens")
