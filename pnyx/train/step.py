"""One optimizer step: pack a batch of scored groups into micro-batches under a token budget, recompute
π with `completion_logprobs`, accumulate the decoupled-PPO loss, clip the gradient, AdamW.

Knows nothing about the store, publishing or checkpoints (the loop does those) and nothing about how the
groups were chosen (ingestion). Imports torch at module level: only heavy code imports this module. The
micro-batch plan is `pnyx.train.microbatch` and the statistics records are `pnyx.train.stepstats` (both
pure); this module runs the forward, the backward and the optimizer.

Stages, the first and third alternating micro-batch by micro-batch (a graph lives until its backward):
1. forward and evidence (`forward.Forward.run`, also used by the drift probe and the exact re-checks;
   `forward.group_evidence`, each row's distance from its seeded draws settled by `drawcheck.row_draws`);
2. judgement (`judgement.py`: `judge_whole` before a micro-batch's backward for the groups whole in it,
   `judge_rest` on the evidence merged from every micro-batch and rank, `keep_rejudged` for a failing
   group's exact re-check; `security.checks.judge`);
3. the update (`_forward_backward`: a rejected whole group weighs 0; `_undo`: a rejected split group's
   micro-batches replayed with the opposite sign; `_rescale`, `_clip`, AdamW).

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
from dataclasses import dataclass

import torch

from pnyx.security.calibration import Allowances, Drift
from pnyx.security.checks import Limits
from pnyx.train.distributed import Dist
from pnyx.train.drawcheck import rounded_weights, row_draws
from pnyx.train.forward import Forward, MicroBatch, RefLogprobs, group_evidence, merge_evidence
from pnyx.train.ingest import ScoredGroup
from pnyx.train.judgement import ExactDraws, Rejudge, judge_rest, judge_whole, keep_rejudged
from pnyx.train.losses import LossSettings, LossTerms, policy_terms, token_weights
from pnyx.train.microbatch import Row, assign_micro_batches, build_rows, plan_micro_batches
from pnyx.train.stepstats import PartialStats, StepStats


def make_optimizer(
    model: torch.nn.Module, lr: float, betas: tuple[float, float], weight_decay: float
) -> torch.optim.Optimizer:
    """AdamW over the fp32 master parameters (sharded ones too: each rank steps its own shard)."""
    trained = [p for p in model.parameters() if p.requires_grad]  # a LoRA run: the adapter alone
    return torch.optim.AdamW(trained, lr=lr, betas=betas, weight_decay=weight_decay)


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
    probe_before: MicroBatch | None = None,
    rejudge: Rejudge | None = None,
    exact_draws: ExactDraws | None = None,
    forward_dtype: torch.dtype | None = None,
) -> StepStats:
    """Accumulate the loss of `groups` over micro-batches, clip, and take one AdamW step.

    `policy_version` (the version being stepped from) enables the per-worker `lp_gap` statistic.
    `ref_logprobs` maps (group key, sample index) to the reference policy's logprobs of that completion
    (needed when `settings.kl_coef > 0`); `lr`, when given, is set on every parameter group first.

    `checks` (with `policy_version`): the sampling checks of `pnyx.security.checks` on every group, from
    this step's own forward (the entropy's second moment is the only extra work). A failing group is
    rejected **before the optimizer step**: a group whole in one micro-batch is judged before that
    micro-batch's backward and weighs 0 in it; a group split across micro-batches is judged on its merged
    evidence after them, and its micro-batches are forwarded and back-propagated once more with the
    opposite sign (the only extra forward, paid for rejected split groups alone). The gradient is then
    rescaled to the batch-global normaliser without the rejected groups, so the update is the one of the
    batch without them (up to floating-point summation). If every group fails, no optimizer step is taken.
    `rejudge` (with the checks): a group the step's own forward would reject is judged once more, before
    its verdict takes effect, on a forward under the exact published weights of the version it claims
    (`pnyx.train.rejudge`); it is kept if it passes there, with that evidence (`StepStats.rejudged`,
    `StepStats.exact`). The master forward judges through drift allowances (the trainer's fp32 masters are
    not the bf16 weights sampled from, and a stale group was sampled from an older policy); the exact
    forward has no drift to allow for, so a group failing there is dishonest, not drifted.
    `probe` (with the checks): rows held out from the step, forwarded before and after the update to
    measure its drift (`StepStats.drift`; None when no step is taken); with `Allowances` and no probe,
    rows of the batch itself stand in. `probe_before`: those rows' forward at the current weights, when the
    caller has it (the previous step's `StepStats.probe_after`, the same rows: the forward is not repeated).

    Seeded draws (`checks.draw_tolerance` set): the same forward gives each model token's distance from
    the draw of its uniform (`logprobs.draw_distance`). Those forward weights are the trainer's, not the
    ones a stale group was sampled from, so a row with a token over the tolerance is measured once more by
    `exact_draws` (a forward of that row, up to its last token over, under the exact published weights of
    its version); its group fails (`draw_mismatch`) only on that exact distance (`StepStats.draws` counts
    both). Without `exact_draws`, the step's own distances are final.
    `forward_dtype` (the run's publish dtype): on one process computing in fp32, the forward and backward
    run on the trained parameters rounded to it, as published (mixed precision: the fp32 masters take the
    update), so a fresh group's tokens are measured under the very weights it was sampled from.

    `dist` (a `distributed.Dist`; default one process): every rank passes the same groups, trains on its
    share of the micro-batches and the sharded model sums the gradients, so the update and the returned
    statistics are those of the whole batch on every rank. Ranks with fewer micro-batches run a zero-weight
    one so all ranks take part in the same number of forward/backward collectives.
    `compute_dtype`: bf16 runs the forward under autocast on a one-process model (the sharded model casts
    its own parameters); default: bf16 autocast on CUDA, fp32 elsewhere.
    """
    t0 = time.perf_counter()
    st = _setup(model, groups, settings, micro_batch_tokens, max_len, ref_logprobs, policy_version, dist,
                compute_dtype, checks, rejudge, exact_draws)  # fmt: skip
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    model.train()
    optimizer.zero_grad(set_to_none=True)
    # The drift probe's first forward, before any backward of this step (a forward between the backward and
    # the optimizer step would run the sharded model's hooks with gradients pending).
    probe_rows, held_out = _probe_rows(st, probe)
    t2 = time.perf_counter()
    if probe_rows and held_out and probe_before is not None:
        before = probe_before  # the previous step's forward after, of these rows at these weights
    else:
        before = _probe(st, probe_rows) if probe_rows else None
    probe_s = time.perf_counter() - t2 if probe_rows else 0.0

    part = PartialStats()
    with rounded_weights(model, forward_dtype if st.world == 1 and st.fwd.dtype == torch.float32 else None):
        _rounds(st, st.plan, 1.0, part)  # stages 1-3, micro-batch by micro-batch
        total = PartialStats()
        for p in dist.all_gather(part) if dist is not None else [part]:
            total.merge(p)
        done = {**total.rejected, **total.rejudged}  # judged already: rejected, or kept by the exact re-check
        late = judge_rest(total.evidence, done, st.checks) if st.checks is not None else {}
        late = keep_rejudged(st.rejudge, st.checks, st.rows, late, total)  # the same on every rank
        undo_s = _undo(st, late)
    rejected = {**total.rejected, **late}
    step = _rescale(model, st, rejected)
    grad_norm = _clip(model, grad_clip)
    if step:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    drift = after = None
    if before is not None and step:
        t2 = time.perf_counter()
        after = _probe(st, probe_rows)
        drift = _drift(before, after, held_out)
        probe_s += time.perf_counter() - t2
    return total.step_stats(
        grad_norm=grad_norm, seconds=time.perf_counter() - t0, micro_batches=len(st.plan),
        rejected=dict(sorted(rejected.items())), undo_s=undo_s, drift=drift, probe_s=probe_s,
        probe_after=after if held_out else None,
    )  # fmt: skip


# --- the step's state -----------------------------------------------------------------------------------


@dataclass
class _Step:
    """What the stages of one step read: the batch as rows, its plan and batch-global counts, the loss
    settings, the checks (None: not judging), and this rank's place."""

    fwd: Forward
    rows: list[Row]
    plan: list[list[int]]
    n_seq: int
    n_tok: int
    rows_of: Counter[str]
    """Group key -> its number of rows in the batch (a group whole in a micro-batch is judged there)."""
    settings: LossSettings
    max_len: int | None
    ref: RefLogprobs | None
    """The reference logprobs, when `settings.kl_coef > 0`; else None."""
    policy_version: int | None
    checks: Limits | None
    """The limits, when `train_step` got both `checks` and `policy_version`; else None."""
    rejudge: Rejudge | None
    exact_draws: ExactDraws | None
    rank: int
    world: int

    @property
    def draws(self) -> bool:
        """Whether this step checks seeded draws."""
        return self.checks is not None and self.checks.draw_tolerance is not None


def _setup(
    model: torch.nn.Module,
    groups: list[ScoredGroup],
    settings: LossSettings,
    micro_batch_tokens: int,
    max_len: int | None,
    ref_logprobs: RefLogprobs | None,
    policy_version: int | None,
    dist: Dist | None,
    compute_dtype: torch.dtype | None,
    checks: Limits | None,
    rejudge: Rejudge | None = None,
    exact_draws: ExactDraws | None = None,
) -> _Step:
    """The step's state for this batch, model and rank. ValueError for a batch it cannot train on (no
    completion tokens; `kl_coef > 0` without reference logprobs)."""
    from pnyx.train.distributed import forward_view

    device = next(model.parameters()).device
    rank, world = (dist.rank, dist.world) if dist is not None else (0, 1)
    rows = build_rows(groups)
    if not rows:
        raise ValueError("train_step: the batch has no completion tokens")
    if settings.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("train_step: kl_coef > 0 needs the reference logprobs of the batch")
    if compute_dtype is None:
        compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    fwd = Forward(forward_view(model), device, compute_dtype, world == 1 and compute_dtype != torch.float32)
    return _Step(
        fwd=fwd, rows=rows, plan=plan_micro_batches(rows, micro_batch_tokens), n_seq=len(rows),
        n_tok=sum(sum(r.loss_mask) for r in rows), rows_of=Counter(r.key for r in rows), settings=settings,
        max_len=max_len, ref=ref_logprobs if settings.kl_coef > 0 else None, policy_version=policy_version,
        checks=checks if policy_version is not None else None, rejudge=rejudge, exact_draws=exact_draws,
        rank=rank, world=world,
    )  # fmt: skip


# --- stages 1 and 3, micro-batch by micro-batch -----------------------------------------------------------


def _rounds(st: _Step, plan: list[list[int]], sign: float, part: PartialStats | None) -> None:
    """Forward and backward this rank's share of `plan`, the loss times `sign`, summing into `part` (None:
    the undo, which sums and judges nothing). A rank with fewer micro-batches than another runs a filler
    (the batch's shortest row) at weight 0, so every rank takes part in every round's collectives."""
    shares = assign_micro_batches(st.rows, plan, st.world)
    mine, n_rounds = shares[st.rank], max(len(x) for x in shares)
    filler = [min(range(len(st.rows)), key=lambda i: (st.rows[i].length, i))]
    for j in range(n_rounds):
        if j < len(mine):
            _forward_backward(st, [st.rows[i] for i in mine[j]], sign, part)
        else:
            _forward_backward(st, [st.rows[i] for i in filler], 0.0, None)


def _forward_backward(st: _Step, rows: list[Row], scale: float, part: PartialStats | None) -> None:
    """One micro-batch: forward (stage 1); with the checks and `part`, its groups' evidence and the
    verdict on those whole in it (stage 2); the backward of its loss times `scale`, a rejected group
    weighing 0 (stage 3); its statistics into `part`."""
    judging = st.checks is not None and part is not None
    mb = st.fwd.run(rows, entropy=True, var=judging, ref=st.ref, draws=judging and st.draws)
    terms = policy_terms(mb.logp, mb.mu, mb.adv, mb.lmask, st.settings, mb.ref)
    w = token_weights(mb.lmask, st.settings.aggregation, st.n_seq, st.n_tok, st.max_len)
    if st.checks is not None and part is not None:
        here = group_evidence(mb, st.policy_version, _row_draws(st, mb, part))
        failing = judge_whole(here, st.rows_of, st.checks)
        part.rejected.update(keep_rejudged(st.rejudge, st.checks, st.rows, failing, part))
        merge_evidence(part.evidence, here)
        drop = [k for k, r in enumerate(rows) if r.key in part.rejected]
        if drop:  # judged here: the group weighs nothing in this backward
            w = w.clone()
            w[drop] = 0.0
    loss = (terms.loss * w).sum() * scale
    loss.backward()
    if part is not None:
        part.loss += float(loss.detach())
        _accumulate(part, terms, mb, st.policy_version)


def _row_draws(st: _Step, mb: MicroBatch, part: PartialStats) -> list[float | None] | None:
    """Per row of `mb`, its largest distance from its seeded draws (`drawcheck.row_draws`: the exact one
    for each row this forward put over the tolerance); None when the step does not check draws."""
    if mb.draw is None or st.checks is None or (tol := st.checks.draw_tolerance) is None:
        return None
    part.draws.forward_s += mb.draw_s
    stale = [st.policy_version - r.version if st.policy_version is not None else 0 for r in mb.rows]
    return row_draws(
        mb.draw.detach(), mb.rows, tol, stale, st.exact_draws, part.draws, audit=st.checks.stale_draw_audit
    )


def _accumulate(part: PartialStats, terms: LossTerms, mb: MicroBatch, policy_version: int | None) -> None:
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
    if mb.entropy is not None:
        part.ent_sum += float(mb.entropy.detach().float()[counted].sum())
    if terms.kl is not None:
        part.kl_sum += float(terms.kl[counted].sum())
    if policy_version is not None:
        gap = (mb.logp.detach() - mb.mu).abs()
        for j, r in enumerate(mb.rows):
            if r.version == policy_version:
                row_sum, row_n = float(gap[j][counted[j]].sum()), int(counted[j].sum())
                part.gap_sum[r.worker] += row_sum  # pyright: ignore[reportArgumentType]  (a Counter sums floats)
                part.gap_n[r.worker] += row_n
                part.eng_sum[r.engine] += row_sum  # pyright: ignore[reportArgumentType]
                part.eng_n[r.engine] += row_n


# --- stage 3 after the micro-batches: undo, rescale, clip ---------------------------------------------------


def _undo(st: _Step, late: Mapping[str, str]) -> float:
    """Take the groups of `late` (judged after their backward) out of the gradient; returns its seconds.
    It replays exactly their own micro-batches (a split group never shares one) with the opposite sign."""
    if not late:
        return 0.0
    t1 = time.perf_counter()
    _rounds(st, [mb for mb in st.plan if st.rows[mb[0]].key in late], -1.0, None)
    return time.perf_counter() - t1


def _rescale(model: torch.nn.Module, st: _Step, rejected: Mapping[str, str]) -> bool:
    """Rescale the gradient to the batch-global normaliser without the `rejected` groups; False when
    nothing is left to train on (then no optimizer step may be taken)."""
    if not rejected:
        return True
    bad = [i for i, r in enumerate(st.rows) if r.key in rejected]
    kept_seq = st.n_seq - len(bad)
    kept_tok = st.n_tok - sum(sum(st.rows[i].loss_mask) for i in bad)
    if kept_seq == 0 or kept_tok == 0:
        return False
    if st.settings.aggregation == "token_mean":
        factor = st.n_tok / kept_tok
    else:
        factor = st.n_seq / kept_seq
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)
    return True


def _clip(model: torch.nn.Module, grad_clip: float) -> float:
    """Clip the gradient's global norm to `grad_clip`; returns the norm before clipping (all shards')."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    full_tensor = getattr(grad_norm, "full_tensor", None)  # a DTensor under FSDP2
    if full_tensor is not None:
        grad_norm = full_tensor()
    return float(grad_norm)


# --- the drift probe ------------------------------------------------------------------------------------


def _probe_rows(st: _Step, probe: Sequence[Row] | None) -> tuple[list[Row], bool]:
    """The drift probe's rows (none without the checks) and whether they are held out from the step. With
    `Allowances` and no held-out rows yet (the run's first step), rows of the batch itself stand in."""
    held_out = bool(probe)
    if st.checks is None:
        return [], held_out
    if not probe and isinstance(st.checks, Allowances):
        probe = _own_rows(st.rows)  # nothing held out yet: an upper bound
    return list(probe or []), held_out


def _own_rows(rows: list[Row]) -> list[Row]:
    """A probe from the batch itself, when no held-out rows exist yet (the run's first step): the first row
    with model tokens of each group, up to `calibration.PROBE_ROWS`, under the first row's sampling
    settings. The update moves the rows it trains on further than fresh ones, so the drift it measures
    errs wide."""
    from pnyx.security.calibration import PROBE_ROWS

    out: list[Row] = []
    seen: set[str] = set()
    for r in rows:
        if r.key in seen or r.sampling != rows[0].sampling or not any(r.loss_mask):
            continue
        seen.add(r.key)
        out.append(r)
        if len(out) >= PROBE_ROWS:
            break
    return out


def _probe(st: _Step, rows: list[Row]) -> MicroBatch:
    """The probe rows' log q under the current weights, no gradient (as a prefix tree where the model fits
    one: `Forward.logp`)."""
    with torch.no_grad():
        return st.fwd.logp(rows) if st.world == 1 else st.fwd.run(rows, entropy=False, var=False)


def _drift(before: MicroBatch, after: MicroBatch, held_out: bool) -> Drift | None:
    """Per model token (finite ones): mean |Δ log q|, the token count, and whether the rows were held out
    from the step (else they are the step's own rows, which the update moves further)."""
    d = after.logp - before.logp
    ok = before.lmask & torch.isfinite(d)
    n = int(ok.sum())
    if n == 0:
        return None
    return Drift(float(d[ok].abs().mean()), n, held_out)
