"""One optimizer step: pack a batch of scored groups into micro-batches under a token budget, recompute
π with `completion_logprobs`, accumulate the decoupled-PPO loss, clip the gradient, AdamW.

Knows nothing about the store, publishing or checkpoints (the loop does those) and nothing about how the
groups were chosen (ingestion). Imports torch at module level: only heavy code imports this module. The
micro-batch plan is `pnyx.train.microbatch` and the statistics records are `pnyx.train.stepstats` (both
pure); this module runs the forward, the backward and the optimizer.

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

import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pnyx.security.calibration import Allowances, Drift
from pnyx.security.checks import GroupEvidence, Limits, judge
from pnyx.train.distributed import Dist
from pnyx.train.ingest import ScoredGroup
from pnyx.train.losses import LossSettings, LossTerms, policy_terms, token_weights
from pnyx.train.microbatch import Row, assign_micro_batches, build_rows, plan_micro_batches
from pnyx.train.stepstats import PartialStats, StepStats


def _pad(seqs: list[list[Any]], width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    out = torch.zeros(len(seqs), width, dtype=dtype)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=dtype)
    return out.to(device)


def make_optimizer(
    model: torch.nn.Module, lr: float, betas: tuple[float, float], weight_decay: float
) -> torch.optim.Optimizer:
    """AdamW over the fp32 master parameters (sharded ones too: each rank steps its own shard)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay)


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
    dist: Dist | None = None,
    compute_dtype: torch.dtype | None = None,
    checks: Limits | None = None,
    probe: Sequence[Row] | None = None,
) -> StepStats:
    """Accumulate the loss of `groups` over micro-batches, clip, and take one AdamW step.

    `policy_version` (the version being stepped from) enables the per-worker `lp_gap` statistic.
    `ref_logprobs` maps (group key, sample index) to the reference policy's logprobs of that completion
    (needed when `settings.kl_coef > 0`); `lr`, when given, is set on every parameter group first.

    `checks` (with `policy_version`): the sampling checks of `pnyx.security.checks` on every group, from
    this step's own forward (the entropy's second moment is the only extra work). A failing group is
    rejected **before the optimizer step**: its rows are forwarded and back-propagated once more with the
    opposite sign (the only extra forward, paid for rejected groups alone), and the gradient is rescaled
    to the batch-global normaliser without them, so the update is the one of the batch without those
    groups (up to floating-point summation). If every group fails, no optimizer step is taken.

    `dist` (a `distributed.Dist`; default one process): every rank passes the same groups, trains on its
    share of the micro-batches and the sharded model sums the gradients, so the update and the returned
    statistics are those of the whole batch on every rank. Ranks with fewer micro-batches run a zero-weight
    one so all ranks take part in the same number of forward/backward collectives.
    `compute_dtype`: bf16 runs the forward under autocast on a one-process model (the sharded model casts
    its own parameters); default: bf16 autocast on CUDA, fp32 elsewhere.
    """
    from pnyx.models.logprobs import completion_stats
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
    check = checks is not None and policy_version is not None
    if compute_dtype is None:
        compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    autocast = world == 1 and compute_dtype != torch.float32
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    model.train()
    optimizer.zero_grad(set_to_none=True)
    view = forward_view(model)

    rows_of: Counter[str] = Counter(r.key for r in rows)
    # The drift probe's first forward, before any backward of this step (a forward between the backward and
    # the optimizer step would run the sharded model's hooks with gradients pending).
    held_out = bool(probe)
    if check and not probe and isinstance(checks, Allowances):
        probe = _own_rows(rows, {})  # nothing held out yet (the run's first step): an upper bound
    probe = list(probe or []) if check else []
    t2 = time.perf_counter()
    before = _probe_terms(view, probe, compute_dtype, autocast) if probe else None
    probe_s = time.perf_counter() - t2 if probe else 0.0

    def rounds(plan: list[list[int]], sign: float, part: PartialStats | None) -> None:
        """Forward and backward `plan` (this rank's share), the loss times `sign`; sums into `part`.
        With the checks, a group whole in a micro-batch that fails is judged there and weighs 0 in its
        backward (`part.rejected`)."""
        shares = assign_micro_batches(rows, plan, world)
        mine, n_rounds = shares[rank], max(len(x) for x in shares)
        filler = [min(range(len(rows)), key=lambda i: (rows[i].length, i))]
        for j in range(n_rounds):
            idx, scale = (mine[j], sign) if j < len(mine) else (filler, 0.0)
            mb = [rows[i] for i in idx]
            temp, top_k, top_p = mb[0].sampling
            prompts = [r.prompt for r in mb]
            comps = [r.completion for r in mb]
            judging = check and part is not None and scale != 0.0
            with torch.autocast(device.type, dtype=compute_dtype, enabled=autocast):
                out = completion_stats(
                    view, prompts, comps, temperature=temp, top_k=top_k, top_p=top_p, with_entropy=True,
                    with_var=judging,
                )  # fmt: skip
            logp, pad_mask, entropy = out.logp, out.mask, out.entropy
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
            if judging and part is not None and out.var is not None and entropy is not None:
                here = _evidence(logp, mu, entropy, out.var, lmask, mb, policy_version)
                for key, ev in here.items():
                    whole = ev.rows == rows_of[key]  # every row of the group is in this micro-batch
                    reason = judge(ev, checks) if whole and checks is not None else None
                    if reason is not None:
                        part.rejected[key] = reason
                    known = part.evidence.get(key)
                    if known is None:
                        part.evidence[key] = ev
                    else:
                        known.add(ev)
                drop = [k for k, r in enumerate(mb) if r.key in part.rejected]
                if drop:  # judged here: the group weighs nothing in this backward
                    w = w.clone()
                    w[drop] = 0.0
            loss = (terms.loss * w).sum() * scale
            loss.backward()
            if scale == 0.0 or part is None:
                continue  # the filler only keeps this rank in step with the others' collectives
            part.loss += float(loss.detach())
            _accumulate(part, terms, logp, mu, entropy, mb, policy_version)

    part = PartialStats()
    rounds(plan, 1.0, part)
    total = PartialStats()
    for p in dist.all_gather(part) if dist is not None else [part]:
        total.merge(p)

    rejected: dict[str, str] = dict(total.rejected)
    undo_s = 0.0
    step = True
    if check and checks is not None:
        split = sorted(k for k in total.evidence if k not in rejected)
        late = {k: r for k in split if (r := judge(total.evidence[k], checks)) is not None}
        if late:
            # A group too big for one micro-batch was judged after its backward: replay exactly its own
            # micro-batches (split groups never share one) with the opposite sign.
            t1 = time.perf_counter()
            rounds([mb for mb in plan if rows[mb[0]].key in late], -1.0, None)
            undo_s = time.perf_counter() - t1
            rejected.update(late)
    if rejected:
        bad = [i for i, r in enumerate(rows) if r.key in rejected]
        kept_seq = n_seq - len(bad)
        kept_tok = n_tok - sum(sum(rows[i].loss_mask) for i in bad)
        if kept_seq == 0 or kept_tok == 0:
            step = False
        else:  # the batch-global normaliser without the rejected groups
            factor = (n_tok / kept_tok) if settings.aggregation == "token_mean" else (n_seq / kept_seq)
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(factor)
    rejected = dict(sorted(rejected.items()))

    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    full_tensor = getattr(grad_norm, "full_tensor", None)  # a DTensor under FSDP2
    if full_tensor is not None:
        grad_norm = full_tensor()
    if step:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    drift = None
    if before is not None and step:
        t2 = time.perf_counter()
        drift = _drift(before, _probe_terms(view, probe, compute_dtype, autocast), held_out)
        probe_s += time.perf_counter() - t2

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
        evidence=total.evidence,
        rejected=rejected,
        undo_s=undo_s,
        drift=drift,
        probe_s=probe_s,
    )


def _own_rows(rows: list[Row], rejected: Mapping[str, str]) -> list[Row]:
    """A probe from the batch itself, when no held-out rows exist yet (the run's first step): one row per
    passing group, up to `calibration.PROBE_ROWS`, under the first row's sampling settings. The update
    moves the rows it trains on further than fresh ones, so the drift it measures errs wide."""
    from pnyx.security.calibration import PROBE_ROWS

    out: list[Row] = []
    seen: set[str] = set()
    for r in rows:
        if r.key in rejected or r.key in seen or r.sampling != rows[0].sampling or not any(r.loss_mask):
            continue
        seen.add(r.key)
        out.append(r)
        if len(out) >= PROBE_ROWS:
            break
    return out


def _probe_terms(
    view: Any, mb: list[Row], compute_dtype: torch.dtype, autocast: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log q, model-token mask) of the probe rows under the current weights, no gradient."""
    from pnyx.models.logprobs import completion_stats

    device = next(view.parameters()).device
    temp, top_k, top_p = mb[0].sampling
    with torch.no_grad(), torch.autocast(device.type, dtype=compute_dtype, enabled=autocast):
        out = completion_stats(
            view, [r.prompt for r in mb], [r.completion for r in mb], temperature=temp, top_k=top_k,
            top_p=top_p,
        )  # fmt: skip
    width = out.logp.shape[1]
    lmask = _pad([r.loss_mask for r in mb], width, torch.long, device).bool() & out.mask
    return out.logp.float(), lmask


def _drift(
    before: tuple[torch.Tensor, torch.Tensor], after: tuple[torch.Tensor, torch.Tensor], held_out: bool
) -> Drift | None:
    """Per model token (finite ones): mean |Δ log q|, the token count, and whether the rows were held out
    from the step (else they are the step's own rows, which the update moves further)."""
    (lp0, mask), (lp1, _) = before, after
    d = lp1 - lp0
    ok = mask & torch.isfinite(d)
    n = int(ok.sum())
    if n == 0:
        return None
    return Drift(float(d[ok].abs().mean()), n, held_out)


def _evidence(
    logp: torch.Tensor,
    mu: torch.Tensor,
    entropy: torch.Tensor,
    var: torch.Tensor,
    lmask: torch.Tensor,
    mb: list[Row],
    policy_version: int | None,
) -> dict[str, GroupEvidence]:
    """Each group's sums over its model tokens in this micro-batch (`pnyx.security.checks`)."""
    with torch.no_grad():
        lp = logp.detach().float()
        zero = torch.zeros_like(lp)
        gap = torch.where(lmask, (lp - mu).abs(), zero).sum(1).tolist()
        dev = torch.where(lmask, lp + entropy.detach().float(), zero).sum(1).tolist()
        v = torch.where(lmask, var.float(), zero).sum(1).tolist()
        n = lmask.sum(1).tolist()
    out: dict[str, GroupEvidence] = {}
    for j, r in enumerate(mb):
        staleness = (policy_version - r.version) if policy_version is not None else 0
        ev = out.get(r.key)
        if ev is None:
            ev = out[r.key] = GroupEvidence(staleness, engine=r.engine)
        ev.add(GroupEvidence(staleness, int(n[j]), float(gap[j]), float(dev[j]), float(v[j]), 1))
    return out


def _accumulate(
    part: PartialStats,
    terms: LossTerms,
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


def measure_evidence(
    model: torch.nn.Module,
    groups: list[ScoredGroup],
    policy_version: int,
    *,
    micro_batch_tokens: int = 8192,
    compute_dtype: torch.dtype | None = None,
) -> dict[str, GroupEvidence]:
    """The per-group evidence `train_step(checks=...)` computes, from a forward alone (no gradient, no
    step): for measuring honest distributions (`benchmarks/bench_lp_gap.py`) and for tools."""
    from pnyx.models.logprobs import completion_stats

    device = next(model.parameters()).device
    if compute_dtype is None:
        compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = build_rows(groups)
    part = PartialStats()
    with torch.no_grad():
        for idx in plan_micro_batches(rows, micro_batch_tokens):
            mb = [rows[i] for i in idx]
            temp, top_k, top_p = mb[0].sampling
            with torch.autocast(device.type, dtype=compute_dtype, enabled=compute_dtype != torch.float32):
                out = completion_stats(
                    model, [r.prompt for r in mb], [r.completion for r in mb], temperature=temp,
                    top_k=top_k, top_p=top_p, with_var=True,
                )  # fmt: skip
            width = out.logp.shape[1]
            mu = _pad([r.behaviour_logp for r in mb], width, torch.float32, device)
            lmask = _pad([r.loss_mask for r in mb], width, torch.long, device).bool() & out.mask
            logp = out.logp.float().masked_fill(~lmask, 0.0)
            assert out.entropy is not None and out.var is not None
            for key, ev in _evidence(
                logp, mu.masked_fill(~lmask, 0.0), out.entropy, out.var, lmask, mb, policy_version
            ).items():
                known = part.evidence.get(key)
                if known is None:
                    part.evidence[key] = ev
                else:
                    known.add(ev)
    return part.evidence
