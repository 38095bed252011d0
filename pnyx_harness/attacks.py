"""Hostile workers of the attack suite (issue #15 item 5, docs/security.md): each makes hostile groups, or
hostile weights, out of the honest machinery (the run's env and tokenizer, the follower's real engine, the
real `encode_group` with a real Ed25519 signer) and changes only what its attack needs.

Group producers (`produce(arena, n) -> list[Upload]`, uploaded by the arena like a worker's courier; their
base `Producer` and the `HonestWorker` are in `producer.py`):

- `HonestWorker`: what `pnyx worker` does (sample at the run's settings, score, skip zero-variance groups,
  sign with its own key). The baseline every attack runs beside.
- `CopierWorker`: never runs the model. Half of each group is the task's reference answer, half a wrong
  answer, with made-up logprobs (`MADE_UP_LOGPROB` per token): fabricated completions, honest rewards.
- `TemperatureLiar`: samples at 0.3 and claims the run's 1.0; the logprobs it claims are its own model's
  at 1.0 for the tokens it drew (so the claimed-vs-trainer logprob gap looks honest; only the shape of
  the sample gives it away: its tokens are too likely). It draws with its seeded uniforms (its best try
  at looking honest), so a group it sends is either the honest draw or a token its uniform did not draw.
- `RewardLiar`: honest samples, every claimed reward flipped (1 - r).
- `Replayer`: groups of another run (same model, another trainer key and weights history), either
  verbatim or re-labelled with this run's id and re-signed by the replayer's key. (A replay re-labelled
  with this run's current version and digest is a fabricated group with someone else's logprobs: the
  copier's case. Another run's v0 of the same model has the same bits, so its groups are on-policy
  samples of this run's v0 and no attack.)
- `Flooder`: one key behind many worker names, uploading more honest-looking groups per version than the
  run's flood limit (`security.flood_limit`; copies of a few fresh samples under new seqs).
- `IdThief`: claims an honest worker's name, signs with its own key (seqs far above the owner's).
- `JunkWriter`: no key at all: one-byte objects and copies of an honest worker's signed records under
  that worker's name and other seqs, more than the flood limit at one version.
- `Sybil`: a copier, reward liar, poisoner or temperature liar with a fresh key and a fresh name for every
  group, so per-key quotas and quarantine never bind.
- `CherryPicker`: honest samples, chosen: within a group (the shortest right and longest wrong samples of
  several honest groups of one task, uploaded as one group) or whole groups (only those it wants are
  uploaded; the others left as gaps, announced as skip records, forged, or dropped with their seq reused
  for the next draw). Every sample is an honest draw with exact logprobs.
- `Poisoner`: correct answers carrying a payload the model would never sample (`PAYLOAD` before the answer
  tag), half of each group, beside wrong honest samples so the payload gets a positive advantage; claimed
  logprobs are the model's own for those tokens (ratio, gate and logprob gap look clean).

The attacks on names and the store rather than on content (`Replayer`, `Flooder`, `JunkWriter`, `IdThief`)
are in `identity_attacks.py` and re-exported here. Weight attacks (`WeightForger`, `ForkSquatter`:
`act(arena)`) are in `weight_attacks.py`.

Knows nothing about how the trainer checks: `arena.py` reads verdicts from the trainer's own cursor.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pnyx_harness.arena import Arena, Upload
from pnyx_harness.identity_attacks import Flooder, IdThief, JunkWriter, Replayer, foreign_groups
from pnyx_harness.producer import Producer, is_zero_variance, new_signer

__all__ = ["Flooder", "IdThief", "JunkWriter", "Replayer", "foreign_groups"]  # re-exported (see above)

MADE_UP_LOGPROB = -0.05
"""The copier's claimed logprob of every token (a confident-looking number it never computed)."""
PAYLOAD = "PNYX "
"""The poisoner's payload: text before the answer tag, which the model never writes on its own."""
LIAR_TEMPERATURE = 0.3
"""The temperature liar samples at this and claims the run's temperature."""


def _fabricate(arena: Arena, task: Any, texts: list[str], rewards_from_env: bool = True) -> list[Any]:
    """Samples whose completions are `texts` (tokenized by the run's tokenizer), scored by the env."""
    from pnyx.protocol import Sample

    out = []
    for text in texts:
        toks = [int(t) for t in arena.tokenizer.encode(text, add_special_tokens=False)]
        score = arena.env.score(task, text)
        out.append(
            Sample(
                tokens=toks, logprobs=[MADE_UP_LOGPROB] * len(toks), loss_mask=[1] * len(toks),
                reward=float(score.reward), reward_parts={k: float(v) for k, v in score.parts.items()},
            )
        )  # fmt: skip
    return out


def _group_for(arena: Arena, task: Any, samples: list[Any]) -> Any:
    """A group record of `task` with `samples`, stamped like the follower's own (version, digest, run)."""
    import time

    from pnyx.models import render_prompt
    from pnyx.protocol import GROUP_SCHEMA, RolloutGroup

    w = arena.cfg.worker
    return RolloutGroup(
        schema=GROUP_SCHEMA, run_id=arena.run_id, worker_id="arena", seq=0, policy_version=arena.version,
        weights_digest=arena.digest, env=arena.env.name, task_id=task.id,
        prompt_tokens=list(render_prompt(arena.tokenizer, task.prompt)), samples=samples,
        temperature=w.temperature, top_p=w.top_p, top_k=w.top_k, created_at=time.time(),
        gen_seconds=0.0, score_seconds=0.0,
    )  # fmt: skip


def copied_group(arena: Arena, task: Any) -> Any:
    """Half reference answers, half wrong ones (the reference plus one), with made-up logprobs."""
    g = arena.cfg.worker.group_size
    right = str(arena.env.reference_completion(task))
    wrong = right.replace(str(task.answer), str(task.answer + 1)) if isinstance(task.answer, int) else ""
    return _group_for(arena, task, _fabricate(arena, task, [right] * (g - g // 2) + [wrong] * (g // 2)))


def with_own_logprobs(arena: Arena, group: Any) -> Any:
    """`group` with every sample's claimed logprobs replaced by the follower's model's own at the run's
    settings (the group must be single-turn: every token a model token)."""
    comps = [list(s.tokens) for s in group.samples]
    lps = arena.own_logprobs(list(group.prompt_tokens), comps)
    samples = [msgspec.structs.replace(s, logprobs=lp) for s, lp in zip(group.samples, lps, strict=True)]
    return msgspec.structs.replace(group, samples=samples)


def temperature_lie(arena: Arena, group: Any) -> Any:
    """A group sampled at another temperature, relabelled with the run's and its model's logprobs there."""
    return with_own_logprobs(arena, msgspec.structs.replace(group, temperature=arena.cfg.worker.temperature))


class CopierWorker(Producer):
    """Reference answers with made-up logprobs (see the module docstring)."""

    def produce(self, arena: Arena, n: int) -> list[Upload]:
        return [self.pack(copied_group(arena, t)) for t in self.tasks(arena, n)]


@dataclass
class TemperatureLiar(Producer):
    """Samples at `temperature` (0.3), claims the run's (see the module docstring)."""

    temperature: float = LIAR_TEMPERATURE

    def produce(self, arena: Arena, n: int) -> list[Upload]:
        return [self.pack(temperature_lie(arena, g)) for g in self.sampled(arena, n, self.temperature)]


def flipped(group: Any) -> Any:
    """`group` with every claimed reward flipped (1 - r)."""
    return msgspec.structs.replace(
        group, samples=[msgspec.structs.replace(s, reward=1.0 - s.reward) for s in group.samples]
    )


class RewardLiar(Producer):
    """Honest samples, every claimed reward flipped."""

    def produce(self, arena: Arena, n: int) -> list[Upload]:
        return [self.pack(flipped(g)) for g in self.sampled(arena, n)]


SYBIL_INNER = ("copier", "reward_liar", "poisoner", "temperature_liar", "cherry_picker", "cherry_whole")
"""What a Sybil's groups can be: the three deterministic content attacks, the temperature liar, or a
cherry-picker (within a group; or whole groups: a key abandoned after a group it does not want)."""


@dataclass
class Sybil(Producer):
    """A fresh key and name for every group; `inner` (one of `SYBIL_INNER`) is what the groups are."""

    inner: str = "copier"

    def produce(self, arena: Arena, n: int) -> list[Upload]:
        if self.inner not in SYBIL_INNER:
            raise ValueError(
                f"Sybil inner attack must be one of {', '.join(SYBIL_INNER)}, got {self.inner!r}"
            )
        home = (self.signer, self.worker_id, self.seq)
        out = []
        try:
            for _ in range(n):  # each group drawn and signed under its own fresh key and name
                self.signer, self.seq = new_signer(), 0
                self.worker_id = f"{home[1]}-{self.signer.fingerprint[:12]}"
                out += [self.pack(g) for g in self._one(arena)]
        finally:
            self.signer, self.worker_id, self.seq = home
        return out

    def _one(self, arena: Arena) -> list[Any]:
        if self.inner == "copier":
            return [copied_group(arena, t) for t in self.tasks(arena, 1)]
        if self.inner == "reward_liar":
            return [flipped(g) for g in self.sampled(arena, 1)]
        if self.inner == "poisoner":
            return poisoned_groups(self, arena, 1)
        if self.inner == "cherry_picker":
            g = picked_group(self, arena)
            return [] if g is None else [g]
        if self.inner == "cherry_whole":  # a group it does not want: the key is abandoned, never seen
            return [g for g in self.sampled(arena, 1) if brevity(g) > 0]
        # a lie that drew exactly the honest tokens is an honest group (the draw check rightly passes it):
        # the suite measures the liar on the groups its lie changed
        return [
            temperature_lie(arena, g)
            for g in self.sampled(arena, 1, LIAR_TEMPERATURE)
            if not _is_honest_draw(self, arena, g)
        ]


def _is_honest_draw(producer: Producer, arena: Arena, group: Any) -> bool:
    """`group` (drawn by `producer` at another temperature) holds the tokens its seeded uniforms draw at the
    run's temperature (the follower still serves the group's version)."""
    honest = arena.sample(
        [arena.env.task(group.task_id)], 0, key=producer.signer.fingerprint, worker_id=group.worker_id,
        next_seq=lambda: group.seq,
    )[0]  # fmt: skip
    return [s.tokens for s in honest.samples] == [s.tokens for s in group.samples]


def poisoned_group(arena: Arena, group: Any, task: Any, payload: str = PAYLOAD) -> Any:
    """`group` with its first half replaced by `payload` + the reference answer (correct), the rest kept
    as sampled, every claimed logprob the model's own, every claimed reward the env's."""
    from pnyx.protocol import Sample

    half = len(group.samples) - len(group.samples) // 2
    text = payload + str(arena.env.reference_completion(task))
    toks = [int(t) for t in arena.tokenizer.encode(text, add_special_tokens=False)]
    score = arena.env.score(task, text)
    poisoned = Sample(
        tokens=toks, logprobs=[0.0] * len(toks), loss_mask=[1] * len(toks), reward=float(score.reward),
        reward_parts={k: float(v) for k, v in score.parts.items()},
    )  # fmt: skip
    samples = [poisoned] * half + list(group.samples[half:])
    return with_own_logprobs(arena, msgspec.structs.replace(group, samples=samples))


def brevity(group: Any) -> float:
    """How much `group` rewards short answers: mean model tokens of its wrong samples minus its right ones'
    (> 0: GRPO's advantages push towards shorter answers). The cherry-picker's chosen behaviour."""
    right = [sum(s.loss_mask) for s in group.samples if s.reward >= 1.0]
    wrong = [sum(s.loss_mask) for s in group.samples if s.reward < 1.0]
    if not right or not wrong:
        return 0.0
    return sum(wrong) / len(wrong) - sum(right) / len(right)


WANTS = ("short", "even")
"""What a whole-group cherry-picker can keep (`CherryPicker.wants`)."""
WHOLE_FORMS = ("whole", "whole_skip", "whole_forged", "whole_forged_patient", "whole_reuse", "whole_abandon")
"""The cherry-picker's forms that choose whole groups (`CherryPicker`)."""


@dataclass
class CherryPicker(Producer):
    """Samples honestly and uploads a chosen subset, so GRPO rewards what it chose (here: short answers).

    - `form="within"`: draws `pool` seeded groups of one task (pool x G honest samples, each with exact
      logprobs) and uploads one group of G: its shortest right samples and longest wrong ones, half each;
    - `form="whole"`: draws groups and uploads only those that already favour short answers (`brevity` > 0),
      never the others (their seqs stay unused: gaps); its zero-variance groups' skip records it uploads
      like an honest worker;
    - `form="whole_skip"`: the same choice, and each group it keeps back is announced as a skip record (as
      if it had zero variance) with its honest tokens;
    - `form="whole_forged"`: the same, with the skip record's samples forged to zero variance (every sample
      a copy of the first);
    - `form="whole_forged_patient"`: the forger that knows the defence (`security.skip_audit_first`,
      `skip_draw_samples`): until that many of its true skip records have been uploaded it offers every
      group for training (source `<source>_standing`: no choice), then it hides each group it does not want
      behind a skip record that forges only the fewest samples (its minority reward's, each a copy of a
      majority sample), so a check of one random sample finds it with chance k/G;
    - `form="whole_reuse"`: the same choice, and a group it does not want (zero variance included) is never
      uploaded: its seq is used again for the next draw, with another task (the worker chooses its tasks
      and the seed names the task), so its seqs stay contiguous and nothing in the store shows a draw it
      dropped;
    - `form="whole_abandon"`: the Sybil form that keeps a key while it likes what it draws: it uploads each
      group it wants under its current key and name, and at the first one it does not want it abandons
      both (that seq stays empty, at the end of the key's life) and goes on under a fresh key and name."""

    form: str = "within"
    pool: int = 4
    true_skips: int = 0
    """Skip records of truly zero-variance groups uploaded so far (the patient forger's standing)."""
    forged_samples: list[int] = field(default_factory=list)
    """Per skip record the patient forger forged: how many of its samples it changed (k)."""
    wants: str = "short"
    """What a whole-group form keeps (`WANTS`): "short", groups that favour short answers (`brevity` > 0);
    "even", mixed groups whose right samples hold an even number of model tokens in all, a choice that
    has nothing to do with how likely the tokens are."""

    def wanted(self, group: Any) -> bool:
        if self.wants not in WANTS:
            raise ValueError(f"cherry-picker wants must be one of {WANTS}, got {self.wants!r}")
        if self.wants == "short":
            return brevity(group) > 0
        right = [sum(s.loss_mask) for s in group.samples if s.reward >= 1.0]
        return 0 < len(right) < len(group.samples) and sum(right) % 2 == 0

    def produce(self, arena: Arena, n: int) -> list[Upload]:
        if self.form == "whole_reuse":
            return self._reusing(arena, n)
        if self.form == "whole_abandon":
            return self._abandoning(arena, n)
        if self.form in WHOLE_FORMS:
            out: list[Upload] = []
            kept = 0
            for _ in range(50 * n + 10):
                if kept >= n:
                    break
                for g in self.sampled(arena, 1):
                    if self.form == "whole_forged_patient" and self._standing(arena):
                        kept += 1  # no choice yet: every group offered, under the `_standing` source
                        out.append(dataclasses.replace(self.pack(g), source=f"{self.source}_standing"))
                    elif self.wanted(g):
                        kept += 1
                        out.append(self.pack(g))
                    elif self.form == "whole_skip":
                        out.append(self.pack(g, skip=True))
                    elif self.form == "whole_forged":
                        forged = [g.samples[0]] * len(g.samples)
                        out.append(self.pack(msgspec.structs.replace(g, samples=forged), skip=True))
                    elif self.form == "whole_forged_patient":
                        out.append(self._minimally_forged(g))
            skips = self.skip_uploads()
            self.true_skips += len(skips)
            return out + skips
        if self.form != "within":
            raise ValueError(
                f"cherry-picker form must be 'within' or one of {WHOLE_FORMS}, got {self.form!r}"
            )
        return [
            self.pack(g) for g in (picked_group(self, arena, self.pool) for _ in range(n)) if g is not None
        ]

    def _standing(self, arena: Arena) -> bool:
        """The patient forger's standing phase: fewer of its true skip records uploaded than the run checks
        whole."""
        return self.true_skips < arena.cfg.security.skip_audit_first

    def _minimally_forged(self, group: Any) -> Upload:
        """Unwanted mixed `group` hidden behind a skip record with only its minority samples forged."""
        rewards = Counter(s.reward for s in group.samples)
        keep = rewards.most_common(1)[0][0]
        majority = [s for s in group.samples if s.reward == keep]
        samples = [
            s if s.reward == keep else majority[i % len(majority)] for i, s in enumerate(group.samples)
        ]
        self.forged_samples.append(len(group.samples) - len(majority))
        return self.pack(msgspec.structs.replace(group, samples=samples), skip=True)

    def _reusing(self, arena: Arena, n: int) -> list[Upload]:
        out: list[Upload] = []
        for _ in range(50 * n + 10):
            if len(out) >= n:
                break
            seq = self.seq
            group = self.draw(arena, self.tasks(arena, 1))[0]  # drawn under `seq`
            if self.wanted(group):
                out.append(self.pack(group))
            else:
                self.seq = seq  # dropped unseen: the next draw takes the same seq
        return out

    def _abandoning(self, arena: Arena, n: int) -> list[Upload]:
        out: list[Upload] = []
        for _ in range(50 * n + 10):
            if len(out) >= n:
                break
            (group,) = self.draw(arena, self.tasks(arena, 1))
            if self.wanted(group):
                out.append(self.pack(group))
            elif not is_zero_variance(group):  # unwanted: a fresh identity; this seq is never seen
                self.signer, self.seq = new_signer(), 0
                self.worker_id = f"{self.worker_id.split('.k')[0]}.k{self.signer.fingerprint[:8]}"
            else:  # zero variance: announced as a skip record, as an honest worker does
                out.append(self.pack(group, skip=True))
        return out


def picked_group(producer: Producer, arena: Arena, pool: int = 4) -> Any | None:
    """One group of G chosen from `pool` honest seeded groups of one task of `producer`'s: its shortest right
    samples and longest wrong ones (None when the pool has no right or no wrong sample)."""
    task = producer.tasks(arena, 1)
    groups = [producer.draw(arena, task)[0] for _ in range(pool)]
    samples = [s for g in groups for s in g.samples]
    size = len(groups[0].samples)
    right = sorted((s for s in samples if s.reward >= 1.0), key=lambda s: sum(s.loss_mask))
    wrong = sorted((s for s in samples if s.reward < 1.0), key=lambda s: -sum(s.loss_mask))
    k = max(min(len(right), size // 2), size - len(wrong))  # half right where the pool allows
    if not right or not wrong or k > len(right) or k >= size:
        return None  # nothing to choose from: a worker would skip it
    chosen = right[:k] + wrong[: size - k]
    # the other draws' seqs are accounted for as skip records, as far as the protocol lets a picker (a mixed
    # one is a false skip): what it cannot do is leave them empty unseen
    producer.skipped += [(g, producer.signer) for g in groups[1:]]
    return msgspec.structs.replace(groups[0], samples=chosen)  # under the first group's seq


@dataclass
class Poisoner(Producer):
    """Correct answers carrying `payload` (see the module docstring)."""

    payload: str = PAYLOAD

    def produce(self, arena: Arena, n: int) -> list[Upload]:
        return [self.pack(g, payload=True) for g in poisoned_groups(self, arena, n, self.payload)]


def poisoned_groups(producer: Producer, arena: Arena, n: int, payload: str = PAYLOAD) -> list[Any]:
    """`n` poisoned groups of `producer`'s tasks: sampled groups whose kept half holds a wrong answer (so
    the payload's half gets a positive advantage), poisoned (`poisoned_group`)."""
    out: list[Any] = []
    for _ in range(50 * n + 10):
        if len(out) >= n:
            break
        tasks = producer.tasks(arena, n - len(out))
        for g, t in zip(producer.draw(arena, tasks), tasks, strict=True):
            if any(s.reward < 1.0 for s in g.samples[len(g.samples) - len(g.samples) // 2 :]):
                out.append(poisoned_group(arena, g, t, payload))
    return out[:n]


EPISODE_FORMS = ("tool_answer", "truncate", "unseeded_skip")
"""What an `EpisodeForger` forges (the red-team review of 2026-12-04)."""


@dataclass
class EpisodeForger(Producer):
    """Honest seeded draws, with what the draw check cannot see changed (`form`, one of `EPISODE_FORMS`):

    - `"tool_answer"`: every sample gets an answer appended as tool tokens (loss mask 0, no uniform), right
      on even samples and wrong on odd ones, so the worker sets every reward (arith has no tool);
    - `"truncate"`: each right sample is cut before its last two tokens (a prefix of an honest draw is a run
      of honest draws), so the worker chooses which right answers count as wrong;
    - `"unseeded_skip"`: each group it keeps back is announced as a skip record with no seeded draws and
      made-up all-wrong samples (zero variance on re-score), so its seq is filled by a record no draw check
      reads."""

    form: str = "tool_answer"

    def produce(self, arena: Arena, n: int) -> list[Upload]:
        if self.form not in EPISODE_FORMS:
            raise ValueError(f"episode forger form must be one of {EPISODE_FORMS}, got {self.form!r}")
        out: list[Upload] = []
        for g in self.sampled(arena, n):
            task = arena.env.task(g.task_id)
            if self.form == "unseeded_skip":
                fake = _fabricate(arena, task, ["<answer>-1</answer>"] * len(g.samples))
                out.append(self.pack(msgspec.structs.replace(g, samples=fake, draws=""), skip=True))
                continue
            samples = [self._forged(arena, task, s, i) for i, s in enumerate(g.samples)]
            out.append(self.pack(msgspec.structs.replace(g, samples=samples)))
        return out

    def _forged(self, arena: Arena, task: Any, s: Any, i: int) -> Any:
        tokens, logprobs, mask = list(s.tokens), list(s.logprobs), list(s.loss_mask)
        if self.form == "tool_answer":
            answer = str(task.answer) if i % 2 == 0 else f"{task.answer}9"
            extra = [
                int(t) for t in arena.tokenizer.encode(f"<answer>{answer}</answer>", add_special_tokens=False)
            ]
            tokens, logprobs, mask = tokens + extra, logprobs + [0.0] * len(extra), mask + [0] * len(extra)
        elif s.reward >= 1.0 and len(tokens) > 2:
            tokens, logprobs, mask = tokens[:-2], logprobs[:-2], mask[:-2]
        text = arena.tokenizer.decode(tokens, skip_special_tokens=True)
        return msgspec.structs.replace(
            s,
            tokens=tokens,
            logprobs=logprobs,
            loss_mask=mask,
            reward=float(arena.env.score(task, text).reward),
        )
