"""One micro-batch's forward as the trainer computes it: π (and the entropy, the variance of log q, each
token's distance from its seeded draw) over rows of one sampling setting, next to the rows' padded
tensors (`Forward.run` -> `MicroBatch`), and each group's evidence for the sampling checks from it
(`group_evidence`, `merge_evidence`; `measure_evidence` for a forward alone).

The one forward the step (`pnyx.train.step`, under its gradient), the drift probe and the exact re-checks
(`pnyx.train.rejudge`, under the published weights of a version) share. Knows nothing about the loss,
the optimizer or the store.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from pnyx.security.checks import GroupEvidence
from pnyx.train.ingest import ScoredGroup
from pnyx.train.microbatch import Row, build_rows, plan_micro_batches

RefLogprobs = Mapping[tuple[str, int], Sequence[float]]
"""(group key, sample index) -> the reference policy's logprobs of that completion."""


@dataclass
class MicroBatch:
    """One micro-batch's rows and, [rows, T] (T: its longest completion), the trainer's forward over them
    next to the rows' padded tensors: `logp` (log π, float32, with a graph unless run under no_grad), `mu`
    (the behaviour logprobs), `ref` (the reference logprobs, when asked for), all 0 off `lmask` (bool:
    loss mask 1, within the completion); `entropy` (with `entropy` or `var`) and `var` (Var[log q], with
    `var`) per position; `adv` [rows]."""

    rows: list[Row]
    logp: torch.Tensor
    mu: torch.Tensor
    lmask: torch.Tensor
    adv: torch.Tensor
    ref: torch.Tensor | None
    entropy: torch.Tensor | None
    var: torch.Tensor | None
    draw: torch.Tensor | None = None
    """[rows, T] each token's distance from its seeded draw (with `draws`; 0 where a row has no uniform)."""
    draw_s: float = 0.0
    """Seconds the forward spent computing `draw`."""


@dataclass(frozen=True)
class Forward:
    """How a micro-batch is forwarded: the model as `completion_stats` calls it (a `RootForward` duck-typed
    as a Module when sharded), its device, and the compute dtype (autocast or not)."""

    view: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    autocast: bool

    def run(
        self, mb: list[Row], *, entropy: bool, var: bool, ref: RefLogprobs | None = None, draws: bool = False
    ) -> MicroBatch:
        """Forward `mb` (rows of one sampling setting) and assemble its tensors; the one micro-batch
        preparation of the step, `measure_evidence`, the drift probe and the exact re-checks. The caller
        picks grad or no_grad. `draws`: also each token's distance from its seeded draw (rows with
        uniforms)."""
        from pnyx.models.logprobs import completion_stats

        temp, top_k, top_p = mb[0].sampling
        uniforms = [r.uniforms for r in mb] if draws and any(r.uniforms for r in mb) else None
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.autocast):
            out = completion_stats(
                self.view, [r.prompt for r in mb], [r.completion for r in mb], temperature=temp, top_k=top_k,
                top_p=top_p, with_entropy=entropy, with_var=var, uniforms=uniforms,
            )  # fmt: skip
        width, device = out.logp.shape[1], self.device
        mu = _pad([r.behaviour_logp for r in mb], width, torch.float32, device)
        lmask = _pad([r.loss_mask for r in mb], width, torch.long, device).bool() & out.mask
        logp = out.logp.float().masked_fill(~lmask, 0.0)
        mu = mu.masked_fill(~lmask, 0.0)
        adv = torch.tensor([r.advantage for r in mb], dtype=torch.float32, device=device)
        ref_logp = None
        if ref is not None:
            ref_logp = _pad([list(ref[(r.key, r.index)]) for r in mb], width, torch.float32, device)
            ref_logp = ref_logp.masked_fill(~lmask, 0.0)
        return MicroBatch(mb, logp, mu, lmask, adv, ref_logp, out.entropy, out.var, out.draw, out.draw_s)

    def logp(self, mb: list[Row]) -> MicroBatch:
        """`run` for log π alone (the drift probe: no entropy, variance or draws; `mu` and `adv` zeros): the
        rows' prefix tree in one forward where the model fits it (`prefix_tree.packs_prefixes`, no
        autocast), each distinct prefix once (the chat template the probe's rows share); else `run`. The
        same values up to floating-point summation order."""
        from pnyx.train.prefix_tree import packs_prefixes, tree_logits

        if self.autocast or not packs_prefixes(self.view):
            return self.run(mb, entropy=False, var=False)
        from pnyx.models.logprobs import sampling_logprobs

        temp, top_k, top_p = mb[0].sampling
        width = max((len(r.completion) for r in mb), default=0)
        logp = torch.zeros((len(mb), width), dtype=torch.float32, device=self.device)
        wanted = [list(range(len(r.completion))) for r in mb]
        for part, logits in tree_logits(
            self.view, [r.prompt for r in mb], [r.completion for r in mb], wanted
        ):
            targets = _pad([mb[i].completion for i in part], logits.shape[1], torch.long, self.device)
            got = sampling_logprobs(logits, temp, top_k, top_p).gather(-1, targets[..., None]).squeeze(-1)
            for j, i in enumerate(part):
                n = len(mb[i].completion)
                logp[i, :n] = got[j, :n]
        lmask = _pad([r.loss_mask for r in mb], width, torch.long, self.device).bool()
        lmask &= (
            torch.arange(width, device=self.device)[None, :]
            < torch.tensor([len(r.completion) for r in mb], device=self.device)[:, None]
        )
        zeros = torch.zeros_like(logp)
        adv = torch.zeros(len(mb), dtype=torch.float32, device=self.device)
        return MicroBatch(mb, logp.masked_fill(~lmask, 0.0), zeros, lmask, adv, None, None, None)


def group_evidence(
    mb: MicroBatch, policy_version: int | None, draws: Sequence[float | None] | None = None
) -> dict[str, GroupEvidence]:
    """Each group's sums over its model tokens in this micro-batch (`pnyx.security.checks`); `mb` must
    come from a forward with `var`. `draws`: per row, its largest distance from its seeded draws."""
    if mb.entropy is None or mb.var is None:
        raise ValueError("group_evidence: the micro-batch was forwarded without var=True")
    with torch.no_grad():
        lp, lmask = mb.logp.detach().float(), mb.lmask
        zero = torch.zeros_like(lp)
        gap = torch.where(lmask, (lp - mb.mu).abs(), zero).sum(1).tolist()
        dev = torch.where(lmask, lp + mb.entropy.detach().float(), zero).sum(1).tolist()
        v = torch.where(lmask, mb.var.float(), zero).sum(1).tolist()
        n = lmask.sum(1).tolist()
    out: dict[str, GroupEvidence] = {}
    for j, r in enumerate(mb.rows):
        staleness = (policy_version - r.version) if policy_version is not None else 0
        ev = out.get(r.key)
        if ev is None:
            ev = out[r.key] = GroupEvidence(staleness, engine=r.engine)
        draw = draws[j] if draws is not None else None
        ev.add(GroupEvidence(staleness, int(n[j]), float(gap[j]), float(dev[j]), float(v[j]), 1, draw=draw))
    return out


def merge_evidence(into: dict[str, GroupEvidence], here: Mapping[str, GroupEvidence]) -> None:
    """Sum one micro-batch's evidence into the running per-group evidence (in plan order)."""
    for key, ev in here.items():
        known = into.get(key)
        if known is None:
            into[key] = ev
        else:
            known.add(ev)


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
    device = next(model.parameters()).device
    if compute_dtype is None:
        compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    fwd = Forward(model, device, compute_dtype, compute_dtype != torch.float32)
    rows = build_rows(groups)
    evidence: dict[str, GroupEvidence] = {}
    with torch.no_grad():
        for idx in plan_micro_batches(rows, micro_batch_tokens):
            mb = fwd.run([rows[i] for i in idx], entropy=False, var=True)
            merge_evidence(evidence, group_evidence(mb, policy_version))
    return evidence


def _pad(
    seqs: Sequence[Sequence[float]], width: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[len(seqs), width] of `dtype` on `device`: each sequence left-aligned, zeros after it."""
    out = torch.zeros(len(seqs), width, dtype=dtype)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=dtype)
    return out.to(device)
