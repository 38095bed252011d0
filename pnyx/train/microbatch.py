"""Micro-batch planning: flatten scored groups into rows, pack them under a token budget, share the
micro-batches among ranks.

Pure functions of the batch (no torch, no model; a row's seeded uniforms are derived here), so every rank and a replayed step plan identically.
Knows nothing about the forward, the loss or the optimizer (`pnyx.train.step` does those).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pnyx.protocol.draws import SCHEME, sample_seed, uniforms

if TYPE_CHECKING:
    from pnyx.protocol.records import RolloutGroup
    from pnyx.train.ingest import ScoredGroup


@dataclass
class Row:
    """One completion of the batch, ready for the forward pass."""

    prompt: list[int]
    completion: list[int]
    behaviour_logp: list[float]
    loss_mask: list[int]
    advantage: float
    sampling: tuple[float, int, float]
    """(temperature, top_k, top_p) of the group: π is recomputed under the same distribution."""
    worker: str = ""
    """Who produced it (for the per-worker behaviour-logprob check)."""
    version: int = -1
    """The policy version that produced it."""
    key: str = ""
    """The group's key, with `index`: where the reference logprobs of this completion are found."""
    index: int = 0
    """The sample's index in its group."""
    engine: str = "torch"
    """The worker engine that generated it (for the per-engine behaviour-logprob check)."""
    uniforms: list[float] | None = None
    """Its seeded draws (`pnyx.protocol.draws`), per completion position: the uniform a model token was
    drawn from, NaN at a tool token; None for a group without seeded draws or without a known signer."""
    weights_digest: str = ""
    """The chain digest of the weights its group says it sampled from (which published plane)."""

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.completion)


def build_rows(groups: list[ScoredGroup]) -> list[Row]:
    """Flatten groups into rows (one per sample), carrying the trainer's advantages; skip empty completions."""
    rows = []
    for g in groups:
        rec = g.group
        sampling = (float(rec.temperature), int(rec.top_k), float(rec.top_p))
        seeded = rec.draws == SCHEME and bool(g.signer)
        for i, (s, adv) in enumerate(zip(rec.samples, g.advantages, strict=True)):
            if not s.tokens:
                continue
            u = row_uniforms(rec, g.signer, i) if seeded else None
            rows.append(
                Row(
                    list(rec.prompt_tokens),
                    list(s.tokens),
                    list(s.logprobs),
                    list(s.loss_mask),
                    adv,
                    sampling,
                    g.worker_id,
                    g.version,
                    g.key,
                    i,
                    str(getattr(rec, "engine", "torch")),
                    u,
                    rec.weights_digest,
                )
            )
    return rows


def row_uniforms(group: RolloutGroup, key: str, index: int) -> list[float]:
    """Sample `index`'s uniforms per completion position (NaN at a tool token: loss mask 0): model token t
    was drawn from the t-th uniform of its stream, bound to the signing `key`."""
    s = group.samples[index]
    seed = sample_seed(
        group.run_id,
        key,
        group.worker_id,
        group.task_id,
        group.policy_version,
        group.seq,
        index,
        group.beacon,
    )
    drawn = iter(uniforms(seed, sum(1 for m in s.loss_mask if m)).tolist())
    return [next(drawn) if m else math.nan for m in s.loss_mask]


def plan_micro_batches(rows: list[Row], token_budget: int) -> list[list[int]]:
    """Row indices per micro-batch: same sampling settings, padded size within `token_budget`, and the
    rows of one group together whenever the group fits the budget.

    Groups (by key) are packed whole, shortest first inside each sampling setting, so the sampling
    checks can judge a group from the micro-batch's own forward before its backward. A group whose padded
    size exceeds the budget is split into micro-batches of its own (rows sorted by length, as before; a
    single row longer than the budget goes alone). The plan is a pure function of the rows, so a replayed
    step packs identically.
    """
    units: dict[tuple[tuple[float, int, float], str], list[int]] = {}
    for i, r in enumerate(rows):
        units.setdefault((r.sampling, r.key), []).append(i)
    by_sampling: dict[tuple[float, int, float], list[list[int]]] = {}
    for (sampling, _), idx in units.items():
        by_sampling.setdefault(sampling, []).append(sorted(idx, key=lambda i: (rows[i].length, i)))
    plan: list[list[int]] = []
    for key in sorted(by_sampling):
        cur: list[int] = []
        longest = 0
        for unit in sorted(by_sampling[key], key=lambda u: (max(rows[i].length for i in u), u[0])):
            top = max(rows[i].length for i in unit)
            if top * len(unit) > token_budget:  # too big to go whole: its own micro-batches, by rows
                plan.extend(_pack(rows, unit, token_budget))
                continue
            if cur and max(longest, top) * (len(cur) + len(unit)) > token_budget:
                plan.append(cur)
                cur, longest = [], 0
            cur.extend(unit)
            longest = max(longest, top)
        if cur:
            plan.append(cur)
    return plan


def _pack(rows: list[Row], idx: list[int], token_budget: int) -> list[list[int]]:
    """Rows `idx` (sorted by length) packed greedily into micro-batches within the budget."""
    out: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i in idx:
        n = rows[i].length
        if cur and max(longest, n) * (len(cur) + 1) > token_budget:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        out.append(cur)
    return out


def assign_micro_batches(rows: list[Row], plan: list[list[int]], world: int) -> list[list[list[int]]]:
    """Micro-batches per rank: each, in plan order, to the rank with the fewest padded tokens so far.

    A pure function of the plan, so every rank computes the same assignment without talking."""
    out: list[list[list[int]]] = [[] for _ in range(world)]
    load = [0] * world
    for mb in plan:
        r = min(range(world), key=lambda k: (load[k], k))
        out[r].append(mb)
        load[r] += len(mb) * max(rows[i].length for i in mb)
    return out
