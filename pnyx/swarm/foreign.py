"""Turning a peer's shared group into training data for this node: rebuild, re-score, re-tokenize, estimate μ.

For every foreign group the node first checks that it was made the way this node makes its own (its
environment name and kwargs: `EnvCache`; its sampling settings, at most its group size, a train-split
task: `admit`), then
(1) rebuilds the task from its id with its own environment (its own kwargs and system prompt: a peer
never configures our verifier) and re-scores every completion text with it (the sender's rewards are
never used);
(2) renders the prompt with its own tokenizer; (3) gets token ids for each completion:

- ``exact`` path: the sender's tokenizer digest equals ours, its token ids decode to exactly the shared
  text and hold no special token but a final EOS, so we train on the sender's own ids (the tokens it
  actually sampled) and its recorded logprobs are a true behaviour probability μ for them;
- ``aligned`` path (any other tokenizer): the text is re-tokenized with ours; it must decode back to the
  same text, and μ is estimated per token by character-segment alignment (`align.aligned_behaviour`),
  which needs our own logprobs π of those tokens.

(4) The behaviour logprobs the loss sees depend on `ForeignMode`: ``onpolicy`` uses our own pre-step π
(ratio ≡ 1, SAPO's reference behaviour); ``gated`` uses the sender's μ (exact) or the aligned estimate,
so the trainer's PPO clip and DPPO gate treat foreign text as off-policy data. Foreign groups are scored
at their temperature, which `admit` requires to be ours, with no top-k/top-p truncation (a truncated own
distribution could give foreign tokens probability 0). Both paths cap a completion at `max_tokens`.

Knows nothing about the store, peers or the optimizer. Torch is imported only in `own_logprobs`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pnyx.envs.base import SPLITS
from pnyx.errors import ConfigError, RecordRejected
from pnyx.swarm.align import aligned_behaviour, char_ends
from pnyx.swarm.records import SwarmGroup, SwarmSample

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from pnyx.config_sections import AcceptedEnv
    from pnyx.envs.base import Environment
    from pnyx.train.advantages import AdvantageMode
    from pnyx.train.ingest import ScoredGroup

ForeignMode = Literal["onpolicy", "gated"]
Path_ = Literal["exact", "aligned"]


@dataclass
class Candidate:
    """A validated foreign group with this node's own rewards (re-scored at fetch time)."""

    key: str
    peer: str
    group: SwarmGroup
    rewards: list[float]
    """Our verifier's rewards, one per sample (never the sender's)."""
    uploaded: float
    """Store timestamp (epoch seconds) of the upload."""
    forged: int = 0
    """Samples whose claimed reward differed from ours (overwritten)."""

    @property
    def has_variance(self) -> bool:
        return max(self.rewards) - min(self.rewards) > 1e-9

    @property
    def content(self) -> bytes:
        """Digest of what the group teaches (its task and texts): copies under other keys or names share it."""
        import hashlib

        import msgspec

        data = msgspec.msgpack.encode(
            [self.group.env, self.group.task_id, [s.text for s in self.group.samples]]
        )
        return hashlib.blake2b(data, digest_size=16).digest()


@dataclass
class ForeignRows:
    """A foreign group in this node's token space, before the behaviour logprobs are chosen."""

    cand: Candidate
    path: Path_
    prompt: list[int]
    completions: list[list[int]]
    loss_masks: list[list[int]]
    sender_logprobs: list[list[float]]
    """exact path: the sender's μ per token (aligned with `completions`)."""
    sender_view: list[tuple[list[int], list[float], list[int]]] = field(default_factory=list)
    """aligned path: (sender ends, logprobs, mask) per sample, EOS excluded."""
    own_ends: list[list[int]] = field(default_factory=list)
    """aligned path: our token end offsets per sample (EOS excluded)."""
    eos_logprobs: list[float | None] = field(default_factory=list)
    """aligned path: the sender's EOS logprob when its sample ended with EOS (we append our EOS)."""


def _canonical(kwargs: Mapping[str, Any]) -> str:
    """Constructor kwargs as a peer's record carries them (msgpack gives lists and dicts, never tuples), as
    one comparable string."""
    import msgspec

    return msgspec.json.encode(
        msgspec.json.decode(msgspec.json.encode(dict(kwargs))), order="sorted"
    ).decode()


class EnvCache:
    """This node's verifiers for foreign groups: its own environment, and those its operator accepts.

    A foreign group is scored only by an environment this node's configuration names: its own (`own`, built
    from `own_kwargs`, the kwargs it shares with its own groups) or an entry of `accept`
    (`swarm.accept_envs`: a name with its default kwargs, or a name with exactly the kwargs given), each
    built once. A group of another name is `unknown_env`; of an accepted name with other kwargs,
    `env_kwargs_mismatch`: a task id means something only with its kwargs, and the kwargs (system prompt,
    answer mode, format reward, data paths, sizes) are this node's operator's to choose, never a peer's.
    """

    def __init__(
        self, own: Environment, own_kwargs: dict[str, Any], accept: Iterable[str | AcceptedEnv] = ()
    ):
        self._accepted: dict[str, dict[str, Mapping[str, Any]]] = {
            own.name: {_canonical(own_kwargs): own_kwargs}
        }
        for entry in accept:
            name, kwargs = (entry, {}) if isinstance(entry, str) else (entry.name, entry.kwargs)
            self._accepted.setdefault(name, {}).setdefault(_canonical(kwargs), kwargs)
        self._envs: dict[tuple[str, str], Environment] = {(own.name, _canonical(own_kwargs)): own}

    @property
    def accept(self) -> set[str]:
        """The environment names this node scores foreign groups of."""
        return set(self._accepted)

    def get(self, name: str, kwargs: dict[str, Any]) -> Environment:
        from pnyx.envs import get_env

        allowed = self._accepted.get(name)
        if allowed is None:
            raise RecordRejected(
                "unknown_env", f"environment {name!r} is not accepted here ({sorted(self._accepted)})"
            )
        key = _canonical(kwargs)
        if key not in allowed:
            raise RecordRejected(
                "env_kwargs_mismatch",
                f"{name} kwargs {kwargs} are none this node accepts ({sorted(allowed)}: swarm.accept_envs)",
            )
        env = self._envs.get((name, key))
        if env is None:
            try:
                env = get_env(name, **dict(allowed[key]))
            except (ConfigError, TypeError, ValueError, KeyError, OSError) as exc:
                raise RecordRejected("bad_env", f"{name}({kwargs}): {exc}") from exc
            self._envs[name, key] = env
        return env


@dataclass(frozen=True)
class Admission:
    """What this node requires of a foreign group besides its environment: the node's own sampling settings
    (a group is trained at the temperature it claims, so a claimed setting must be ours) and at most its
    own group size."""

    temperature: float
    top_p: float
    top_k: int
    group_size: int


def admit(group: SwarmGroup, admission: Admission) -> None:
    """Raise RecordRejected unless `group` was sampled with our settings, is no larger than our groups, and
    is on a train-split task (a peer must not teach us our held-out test problems)."""
    a = admission
    same = (
        math.isclose(group.temperature, a.temperature, rel_tol=1e-6)
        and math.isclose(group.top_p, a.top_p, rel_tol=1e-6)
        and group.top_k == a.top_k
    )
    if not same:
        raise RecordRejected(
            "sampling_mismatch",
            f"sampled at temperature={group.temperature} top_p={group.top_p} top_k={group.top_k}, this node "
            f"samples at {a.temperature}/{a.top_p}/{a.top_k}",
        )
    if len(group.samples) > a.group_size:
        raise RecordRejected("group_too_large", f"{len(group.samples)} samples > group size {a.group_size}")
    # Task ids are `name/.../<split>/...`: the first field that names a split is the task's split.
    split = next((f for f in group.task_id.split("/")[1:] if f in SPLITS), None)
    if split != "train":
        raise RecordRejected("not_train_split", f"task {group.task_id!r} is not a train-split task")


RUN_ON_CHARS = 16
"""Characters a single-turn sample may hold after the first stop string in it: the rest of the token that
completed the stop (an engine stops there; tokenizers differ in where a token ends)."""


def _past_stop(text: str, stops: list[str]) -> int:
    """Characters of `text` after the end of the first stop string in it (0 if none)."""
    ends = [i + len(stop) for stop in stops if (i := text.find(stop)) >= 0]
    return len(text) - min(ends) if ends else 0


def rescore(group: SwarmGroup, envs: EnvCache) -> tuple[list[float], int]:
    """Our own rewards for a foreign group's texts, and how many claimed rewards we overwrote."""
    env = envs.get(group.env, group.env_kwargs)
    try:
        task = env.task(group.task_id)
    except (ConfigError, ValueError, KeyError) as exc:
        raise RecordRejected("bad_task", f"{group.task_id!r}: {exc}") from exc
    if env.max_turns <= 1 and any(0 in s.loss_mask for s in group.samples):
        # Scoring reads the whole text but only mask-1 tokens are trained: "tool" text in an environment
        # without tools could carry the answer that earns a reward the trained tokens do not.
        raise RecordRejected("tool_text", "a sample marks tool text in an environment without tools")
    if env.max_turns <= 1:
        for i, s in enumerate(group.samples):
            if (past := _past_stop(s.text, env.stop_strings)) > RUN_ON_CHARS:
                raise RecordRejected(
                    "run_on", f"sample {i} goes on {past} characters after its first stop string"
                )
    rewards = [float(env.score(task, s.text).reward) for s in group.samples]
    forged = sum(abs(r - s.reward) > 1e-6 for r, s in zip(rewards, group.samples, strict=True))
    return rewards, forged


def make_candidate(
    key: str,
    peer: str,
    group: SwarmGroup,
    envs: EnvCache,
    admission: Admission,
    uploaded: float | None = None,
) -> Candidate:
    """Admit and re-score a validated foreign group into a `Candidate` (raises RecordRejected)."""
    admit(group, admission)
    rewards, forged = rescore(group, envs)
    return Candidate(key, peer, group, rewards, uploaded if uploaded is not None else time.time(), forged)


def _encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    # Special-token strings inside foreign text must stay text, never become our EOS or role tokens.
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def to_rows(
    cand: Candidate,
    envs: EnvCache,
    tokenizer: PreTrainedTokenizerBase,
    tokenizer_digest: str,
    eos_id: int | None,
    max_tokens: int,
    eos_ids: set[int],
) -> ForeignRows:
    """Rebuild the prompt and the completions of `cand` in our token space (raises RecordRejected).

    The sender's own ids are used only when they are exactly what the text path could not tell apart from
    ours: the same tokenizer, in-vocabulary, decoding to the shared text, and no special token (EOS, role
    markers) but a final one in `eos_ids`, which decoding would hide. Any other group takes the text path,
    where special-token strings stay text. Either way a completion over `max_tokens` drops the group."""
    from pnyx.models import render_prompt

    g = cand.group
    env = envs.get(g.env, g.env_kwargs)
    task = env.task(g.task_id)
    prompt = list(render_prompt(tokenizer, task.prompt))
    vocab, special = len(tokenizer), set(tokenizer.all_special_ids)

    def exact(s: SwarmSample) -> bool:
        body = s.tokens[:-1] if s.tokens and s.tokens[-1] in eos_ids else s.tokens
        return (
            all(0 <= t < vocab for t in s.tokens)
            and special.isdisjoint(body)
            and tokenizer.decode(s.tokens, skip_special_tokens=True) == s.text
        )

    if g.tokenizer_digest == tokenizer_digest and all(exact(s) for s in g.samples):
        rows = ForeignRows(
            cand=cand,
            path="exact",
            prompt=prompt,
            completions=[list(s.tokens) for s in g.samples],
            loss_masks=[list(s.loss_mask) for s in g.samples],
            sender_logprobs=[list(s.logprobs) for s in g.samples],
        )
    else:
        rows = _aligned_rows(cand, prompt, tokenizer, eos_id)
    longest = max(len(c) for c in rows.completions)
    if longest > max_tokens:
        raise RecordRejected("too_many_tokens", f"a completion has {longest} > {max_tokens} tokens")
    return rows


def _aligned_rows(
    cand: Candidate, prompt: list[int], tokenizer: PreTrainedTokenizerBase, eos_id: int | None
) -> ForeignRows:
    """The text path: every completion re-tokenized with ours (it must round-trip), with the sender's token
    view kept for the segment-aligned μ."""
    rows = ForeignRows(
        cand=cand, path="aligned", prompt=prompt, completions=[], loss_masks=[], sender_logprobs=[]
    )
    for s in cand.group.samples:
        ids = _encode_text(tokenizer, s.text)
        if tokenizer.decode(ids, skip_special_tokens=True) != s.text:
            raise RecordRejected("retokenize_mismatch", "our tokenizer does not round-trip the shared text")
        n = len(s.tokens) - (1 if s.eos and s.tokens else 0)
        view = (list(s.token_ends[:n]), list(s.logprobs[:n]), list(s.loss_mask[:n]))
        eos_lp = float(s.logprobs[-1]) if s.eos and s.tokens and eos_id is not None else None
        comp = ids + ([eos_id] if eos_lp is not None and eos_id is not None else [])
        rows.completions.append(comp)
        rows.loss_masks.append([1] * len(comp))  # refined by `behaviour` (tool segments)
        rows.sender_view.append(view)
        rows.own_ends.append(char_ends(tokenizer, ids))
        rows.eos_logprobs.append(eos_lp)
    return rows


def behaviour(
    rows: ForeignRows, own: list[list[float]] | None, mode: ForeignMode
) -> tuple[list[list[float]], list[list[int]]]:
    """(behaviour logprobs, loss masks) per sample of a foreign group for the loss, under `mode`.

    `own` are our pre-step logprobs of `rows.completions` (detached); required unless the path is
    ``exact`` and the mode ``gated``. Tokens outside the loss mask get 0.0 (the record invariant).
    """
    if rows.path == "exact":
        masks = rows.loss_masks
        if mode == "gated":
            return rows.sender_logprobs, masks
        if own is None:
            raise ValueError("onpolicy mode needs our own logprobs")
        return [
            [lp if m else 0.0 for lp, m in zip(o, mk, strict=True)] for o, mk in zip(own, masks, strict=True)
        ], masks
    if own is None:
        raise ValueError("the aligned path needs our own logprobs")
    mus, masks = [], []
    for i, comp in enumerate(rows.completions):
        ends, slp, smask = rows.sender_view[i]
        eos_lp = rows.eos_logprobs[i]
        has_eos = eos_lp is not None
        n_text = len(comp) - (1 if has_eos else 0)
        mu, mask = aligned_behaviour(ends, slp, smask, rows.own_ends[i], own[i][:n_text])
        if eos_lp is not None:
            mu.append(min(0.0, float(eos_lp)))
            mask.append(1)
        if mode == "onpolicy":
            mu = [lp if m else 0.0 for lp, m in zip(own[i], mask, strict=True)]
        mus.append(mu)
        masks.append(mask)
    return mus, masks


def own_logprobs(
    model: torch.nn.Module, rows: list[ForeignRows], micro_batch_tokens: int
) -> list[list[list[float]] | None]:
    """Our detached logprobs of every completion of `rows` (None for groups that do not need them)."""
    import torch

    from pnyx.models.logprobs import completion_logprobs

    out: list[list[list[float]] | None] = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for r in rows:
                temp = float(r.cand.group.temperature)
                prompts = [r.prompt] * len(r.completions)
                lp, mask, _ = completion_logprobs(
                    model, prompts, r.completions, temperature=temp, max_tokens=micro_batch_tokens
                )
                lp = lp.float().cpu()
                out.append([lp[i, : len(c)].tolist() for i, c in enumerate(r.completions)])
    finally:
        model.train(was_training)
    return out


def scored_group(
    rows: ForeignRows, mus: list[list[float]], masks: list[list[int]], advantage: AdvantageMode
) -> ScoredGroup:
    """The trainer's `ScoredGroup` for a foreign group: our token ids, the chosen behaviour logprobs and
    masks, our verifier's rewards and advantages (the sender's claimed rewards kept only for the record)."""
    from pnyx.protocol.records import RolloutGroup, Sample
    from pnyx.train.advantages import group_advantages
    from pnyx.train.ingest import ScoredGroup

    g = rows.cand.group
    samples = [
        Sample(tokens=comp, logprobs=mu, loss_mask=mk, reward=rew, finish_reason=s.finish_reason)
        for comp, mu, mk, rew, s in zip(
            rows.completions, mus, masks, rows.cand.rewards, g.samples, strict=True
        )
    ]
    rec = RolloutGroup(
        run_id="swarm",
        worker_id=g.node,
        seq=g.seq,
        policy_version=g.policy_version,
        weights_digest=g.tokenizer_digest,
        env=g.env,
        task_id=g.task_id,
        prompt_tokens=rows.prompt,
        samples=samples,
        temperature=g.temperature,
        top_p=1.0,
        top_k=0,
        created_at=g.created_at,
        gen_seconds=0.0,
        score_seconds=0.0,
    )
    adv = group_advantages(rows.cand.rewards, advantage)
    claimed = [s.reward for s in g.samples]
    return ScoredGroup(
        rows.cand.key, g.policy_version, g.node, g.task_id, rec, rows.cand.rewards, adv, claimed
    )
