"""One optimizer step: pack a batch of scored groups into micro-batches under a token budget, recompute
π with `completion_logprobs`, accumulate the decoupled-PPO loss, clip the gradient, AdamW.

Knows nothing about the store, publishing or checkpoints (the loop does those) and nothing about how the
groups were chosen (ingestion). Imports torch at module level: only heavy code imports this module.

Invariants:
- memory is bounded by `micro_batch_tokens`: a micro-batch's padded size (rows x longest prompt+completion)
  never exceeds it, except a single row longer than the budget, which goes alone;
- the accumulated gradient equals the full-batch gradient: aggregation weights use batch-global counts
  (`losses.token_weights`), so micro-batching changes memory, not the update;
- master weights stay fp32; on CUDA the forward runs in bf16 (autocast on one process, the FSDP2
  mixed-precision policy when sharded);
- across N ranks (`distributed.py`) the same batch gives the same update up to fp32 summation order: the
  micro-batch plan and its assignment to ranks are pure functions of the batch, the loss weights are
  batch-global, the gradients are summed, and every statistic is merged from all ranks;
- given the same model, optimizer state and batch (same order) on the same device, thread count and
  number of ranks, the step is deterministic (resume relies on this to replay a step; it verifies against
  the published bits).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pnyx.train.ingest import ScoredGroup
from pnyx.train.losses import LossSettings, policy_terms, token_weights


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

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.completion)


def build_rows(groups: list[ScoredGroup]) -> list[Row]:
    """Flatten groups into rows (one per sample), carrying the trainer's advantages; skip empty completions."""
    rows = []
    for g in groups:
        rec = g.group
        sampling = (float(rec.temperature), int(rec.top_k), float(rec.top_p))
        for i, (s, adv) in enumerate(zip(rec.samples, g.advantages, strict=True)):
            if not s.tokens:
                continue
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
                )
            )
    return rows


def plan_micro_batches(rows: list[Row], token_budget: int) -> list[list[int]]:
    """Row indices per micro-batch: same sampling settings, padded size within `token_budget`.

    Rows are sorted by length inside each sampling setting so padding is small; the plan is a pure
    function of the rows, so a replayed step packs identically.
    """
    by_sampling: dict[tuple[float, int, float], list[int]] = {}
    for i, r in enumerate(rows):
        by_sampling.setdefault(r.sampling, []).append(i)
    plan: list[list[int]] = []
    for key in sorted(by_sampling):
        idx = sorted(by_sampling[key], key=lambda i: (rows[i].length, i))
        cur: list[int] = []
        longest = 0
        for i in idx:
            n = rows[i].length
            if cur and max(longest, n) * (len(cur) + 1) > token_budget:
                plan.append(cur)
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, n)
        if cur:
            plan.append(cur)
    return plan


def _pad(seqs: list[list[Any]], width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    out = torch.zeros(len(seqs), width, dtype=dtype)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=dtype)
    return out.to(device)


@dataclass
class StepStats:
    """What one step measured (logged and written as metrics)."""

    loss: float = 0.0
    grad_norm: float = 0.0
    tokens: int = 0
    """Counted (model-generated) completion tokens."""
    masked_frac: float = 0.0
    """Fraction of counted tokens the DPPO gate removed."""
    clip_frac: float = 0.0
    iw_mean: float = 0.0
    iw_max: float = 0.0
    iw_min: float = 0.0
    ess: float = 0.0
    """Normalised effective sample size of the importance weights, (Σw)² / (n·Σw²) in (0, 1]."""
    entropy: float = 0.0
    kl: float = 0.0
    seconds: float = 0.0
    micro_batches: int = 0
    lp_gap: dict[str, float] = field(default_factory=dict)
    """Per worker: mean |log π - log μ| over its fresh tokens (groups generated by the policy being stepped
    from). Near 0 for an honest worker on the same precision; large means wrong weights or forged logprobs."""
    lp_gap_engine: dict[str, float] = field(default_factory=dict)
    """The same gap per worker engine ("torch", "mlx", "vllm"): how closely each engine's recorded
    behaviour logprobs agree with the trainer's recompute (precision, kernels, its logprob definition)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def make_optimizer(
    model: torch.nn.Module, lr: float, betas: tuple[float, float], weight_decay: float
) -> torch.optim.Optimizer:
    """AdamW over the fp32 master parameters (sharded ones too: each rank steps its own shard)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay)


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


@dataclass
class _Partial:
    """One rank's sums over its micro-batches; merged across ranks into `StepStats`."""

    loss: float = 0.0
    counts: Counter[str] = field(default_factory=Counter)
    iw_sum: float = 0.0
    iw_sq: float = 0.0
    iw_max: float = -math.inf
    iw_min: float = math.inf
    ent_sum: float = 0.0
    kl_sum: float = 0.0
    gap_sum: Counter[str] = field(default_factory=Counter)
    gap_n: Counter[str] = field(default_factory=Counter)
    eng_sum: Counter[str] = field(default_factory=Counter)
    eng_n: Counter[str] = field(default_factory=Counter)

    def merge(self, o: _Partial) -> None:
        self.loss += o.loss
        self.counts.update(o.counts)
        self.iw_sum += o.iw_sum
        self.iw_sq += o.iw_sq
        self.iw_max, self.iw_min = max(self.iw_max, o.iw_max), min(self.iw_min, o.iw_min)
        self.ent_sum += o.ent_sum
        self.kl_sum += o.kl_sum
        self.gap_sum.update(o.gap_sum)
        self.gap_n.update(o.gap_n)
        self.eng_sum.update(o.eng_sum)
        self.eng_n.update(o.eng_n)


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    groups: list[ScoredGroup],
    settings: LossSettings,
    *,
    micro_batch_tokens: int,
    grad_clip: float,
    max_len: int | None = None,
    ref_logprobs: Mapping[tuple[str, int], Sequence[float]] | None = None,
    policy_version: int | None = None,
    lr: float | None = None,
    dist: Any = None,
    compute_dtype: torch.dtype | None = None,
) -> StepStats:
    """Accumulate the loss of `groups` over micro-batches, clip, and take one AdamW step.

    `policy_version` (the version being stepped from) enables the per-worker `lp_gap` statistic.
    `ref_logprobs` maps (group key, sample index) to the reference policy's logprobs of that completion
    (needed when `settings.kl_coef > 0`); `lr`, when given, is set on every parameter group first.

    `dist` (a `distributed.Dist`; default one process): every rank passes the same groups, trains on its
    share of the micro-batches and the sharded model sums the gradients, so the update and the returned
    statistics are those of the whole batch on every rank. Ranks with fewer micro-batches run a zero-weight
    one so all ranks take part in the same number of forward/backward collectives.
    `compute_dtype`: bf16 runs the forward under autocast on a one-process model (the sharded model casts
    its own parameters); default: bf16 autocast on CUDA, fp32 elsewhere.
    """
    from pnyx.models.logprobs import completion_logprobs
    from pnyx.train.distributed import forward_view

    t0 = time.perf_counter()
    device = next(model.parameters()).device
    rank, world = (dist.rank, dist.world) if dist is not None else (0, 1)
    rows = build_rows(groups)
    if not rows:
        raise ValueError("train_step: the batch has no completion tokens")
    if settings.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("train_step: kl_coef > 0 needs the reference logprobs of the batch")
    n_seq = len(rows)
    n_tok = sum(sum(r.loss_mask) for r in rows)
    plan = plan_micro_batches(rows, micro_batch_tokens)
    shares = assign_micro_batches(rows, plan, world)
    mine, rounds = shares[rank], max(len(x) for x in shares)
    filler = [min(range(len(rows)), key=lambda i: (rows[i].length, i))]
    if compute_dtype is None:
        compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    autocast = world == 1 and compute_dtype != torch.float32
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    model.train()
    optimizer.zero_grad(set_to_none=True)
    view = forward_view(model)

    part = _Partial()
    for j in range(rounds):
        idx, scale = (mine[j], 1.0) if j < len(mine) else (filler, 0.0)
        mb = [rows[i] for i in idx]
        temp, top_k, top_p = mb[0].sampling
        prompts = [r.prompt for r in mb]
        comps = [r.completion for r in mb]
        with torch.autocast(device.type, dtype=compute_dtype, enabled=autocast):
            logp, pad_mask, entropy = completion_logprobs(
                view, prompts, comps, temperature=temp, top_k=top_k, top_p=top_p, with_entropy=True
            )
        width = logp.shape[1]
        mu = _pad([r.behaviour_logp for r in mb], width, torch.float32, device)
        lmask = _pad([r.loss_mask for r in mb], width, torch.long, device).bool() & pad_mask
        logp = logp.float().masked_fill(~lmask, 0.0)
        mu = mu.masked_fill(~lmask, 0.0)
        adv = torch.tensor([r.advantage for r in mb], dtype=torch.float32, device=device)
        ref_logp = None
        if ref_logprobs is not None and settings.kl_coef > 0:
            ref = _pad([list(ref_logprobs[(r.key, r.index)]) for r in mb], width, torch.float32, device)
            ref_logp = ref.masked_fill(~lmask, 0.0)
        terms = policy_terms(logp, mu, adv, lmask, settings, ref_logp)
        w = token_weights(lmask, settings.aggregation, n_seq, n_tok, max_len)
        loss = (terms.loss * w).sum() * scale
        loss.backward()
        if scale == 0.0:
            continue  # the filler only keeps this rank in step with the others' collectives
        part.loss += float(loss.detach())
        _accumulate(part, terms, logp, mu, entropy, mb, policy_version)

    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    full_tensor = getattr(grad_norm, "full_tensor", None)  # a DTensor under FSDP2
    if full_tensor is not None:
        grad_norm = full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    total = _Partial()
    for p in dist.all_gather(part) if dist is not None else [part]:
        total.merge(p)
    c = total.counts
    n = max(c["counted"], 1)
    return StepStats(
        loss=total.loss,
        grad_norm=float(grad_norm),
        tokens=c["counted"],
        masked_frac=c["gated"] / n,
        clip_frac=c["clipped"] / n,
        iw_mean=total.iw_sum / n,
        iw_max=total.iw_max if c["counted"] else 0.0,
        iw_min=total.iw_min if c["counted"] else 0.0,
        ess=(total.iw_sum * total.iw_sum) / (n * total.iw_sq) if total.iw_sq > 0 else 0.0,
        entropy=total.ent_sum / n,
        kl=total.kl_sum / n,
        seconds=time.perf_counter() - t0,
        micro_batches=len(plan),
        lp_gap={w: total.gap_sum[w] / total.gap_n[w] for w in sorted(total.gap_n) if total.gap_n[w]},
        lp_gap_engine={e: total.eng_sum[e] / total.eng_n[e] for e in sorted(total.eng_n) if total.eng_n[e]},
    )


def _accumulate(
    part: _Partial,
    terms: Any,
    logp: torch.Tensor,
    mu: torch.Tensor,
    entropy: torch.Tensor | None,
    mb: list[Row],
    policy_version: int | None,
) -> None:
    """Add one micro-batch's counts and sums (tool and padding tokens never count)."""
    counted = terms.counted
    iw = terms.iw[counted].double()
    part.counts["counted"] += int(counted.sum())
    part.counts["gated"] += int(terms.gate_masked.sum())
    part.counts["clipped"] += int(terms.clipped.sum())
    if iw.numel():
        part.iw_sum += float(iw.sum())
        part.iw_sq += float((iw * iw).sum())
        part.iw_max = max(part.iw_max, float(iw.max()))
        part.iw_min = min(part.iw_min, float(iw.min()))
    if entropy is not None:
        part.ent_sum += float(entropy.detach().float()[counted].sum())
    if terms.kl is not None:
        part.kl_sum += float(terms.kl[counted].sum())
    if policy_version is not None:
        gap = (logp.detach() - mu).abs()
        for j, r in enumerate(mb):
            if r.version == policy_version:
                row_sum, row_n = float(gap[j][counted[j]].sum()), int(counted[j].sum())
                part.gap_sum[r.worker] += row_sum  # pyright: ignore[reportArgumentType]  (a Counter sums floats)
                part.gap_n[r.worker] += row_n
                part.eng_sum[r.engine] += row_sum  # pyright: ignore[reportArgumentType]
                part.eng_n[r.engine] += row_n
