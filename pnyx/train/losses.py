"""Per-token policy-gradient losses: importance ratio, PPO clip with dual clip, the DPPO gate, truncated
importance weights, KL to a reference, and the aggregation weights that turn per-token terms into a scalar.

Small pure torch functions over [B, T] tensors (B sequences, T completion positions, right-padded); no
model, no store, no config tree. Notation (docs/trainer.md): `logp` = log π(y_t) under the current parameters
(differentiable), `behaviour_logp` = log μ(y_t) recorded by the worker at its sampling temperature,
`adv` = one advantage per sequence [B], `loss_mask` = 1 for model tokens that count, 0 for tool tokens and
padding.

Invariants:
- tool/env tokens and padding (loss_mask 0) contribute nothing to the numerator *or* the denominator of
  any aggregation, and never count in a reported fraction;
- the DPPO gate is a binary mask, never a weight, and never masks a corrective move;
- aggregation weights depend only on the loss mask and batch-global counts, so a batch split into
  micro-batches sums to exactly the full-batch loss (the step relies on this).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from pnyx.errors import ConfigError

Aggregation = Literal["token_mean", "seq_mean_token_mean", "drgrpo"]


@dataclass(frozen=True)
class LossSettings:
    """The algorithm knobs the policy loss needs (built from the config's `algorithm` section)."""

    clip_low: float = 0.2
    """PPO clip lower bound: ratio is clipped at 1 - clip_low."""
    clip_high: float = 0.28
    """PPO clip upper bound: ratio is clipped at 1 + clip_high."""
    dual_clip: float | None = 3.0
    """Dual-clip constant c > 1 for negative advantages (None = off)."""
    tis_cap: float | None = None
    """Truncated importance weight cap C (None = off: the PPO ratio is taken against the behaviour policy)."""
    dppo_delta: float | None = 0.2
    """DPPO binary-TV gate threshold δ in probability space (None = off)."""
    aggregation: Aggregation = "token_mean"
    """How per-token terms become one scalar (see `token_weights`)."""
    kl_coef: float = 0.0
    """Coefficient of the k3 KL estimate to a reference policy (0 = off)."""


# --- building blocks --------------------------------------------------------------------------------


def importance_ratio(logp: torch.Tensor, behaviour_logp: torch.Tensor) -> torch.Tensor:
    """r_t = exp(log π_t - log μ_t), [B, T]; differentiable through `logp`."""
    return torch.exp(logp - behaviour_logp)


def clipped_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float, dual_clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO objective per token (to be *maximised*) and a bool mask of tokens whose gradient the clip removed.

    objective = min(r·A, clip(r, 1-eps_low, 1+eps_high)·A); for A < 0 with dual clip c:
    objective = max(objective, c·A), which bounds how hard a very large ratio can push a bad token down.
    `adv` broadcasts against `ratio` ([B, 1] or [B, T]).
    """
    unclipped = ratio * adv
    clipped_ratio = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    objective = torch.minimum(unclipped, clipped_ratio * adv)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ConfigError(f"dual_clip must be > 1 (got {dual_clip}); set it to None to turn it off")
        objective = torch.where(adv < 0, torch.maximum(objective, dual_clip * adv), objective)
    # A token is "clipped" when the objective no longer follows r·A (its gradient w.r.t. r is zero).
    clipped = objective.detach() != unclipped.detach()
    return objective, clipped


def dppo_gate(
    logp: torch.Tensor, behaviour_logp: torch.Tensor, adv: torch.Tensor, delta: float
) -> torch.Tensor:
    """Bool mask [B, T] of tokens the DPPO binary-TV gate removes from the loss (Qi et al. 2602.04879).

    With Δ_t = p_π(y_t) - p_μ(y_t) in probability space, mask iff (A > 0 and Δ > δ) or (A < 0 and Δ < -δ):
    the token has already moved more than δ away from μ in the direction the advantage pushes it. A move
    against the advantage's direction (corrective) is never masked.
    """
    diff = torch.exp(logp.detach()) - torch.exp(behaviour_logp)
    return ((adv > 0) & (diff > delta)) | ((adv < 0) & (diff < -delta))


def truncated_importance_weight(logp: torch.Tensor, behaviour_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """min(π_t / μ_t, C), detached: a behaviour-correction weight, never a path for gradients."""
    return torch.clamp(torch.exp(logp.detach() - behaviour_logp), max=cap)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π || ref): exp(ref - π) - (ref - π) - 1 ≥ 0 (Schulman's estimator)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def token_weights(
    loss_mask: torch.Tensor,
    mode: Aggregation,
    num_sequences: int,
    num_tokens: int,
    max_len: int | None = None,
) -> torch.Tensor:
    """Per-token weights [B, T] such that sum(term · weights) over the *whole batch* is its aggregate.

    `num_sequences` / `num_tokens` are batch-global counts (all micro-batches), so micro-batches can be
    summed. Modes:
    - ``token_mean``: every counted token of the batch weighs the same: 1 / num_tokens;
    - ``seq_mean_token_mean``: mean over a sequence's tokens, then over sequences: 1 / (len_i · num_sequences);
    - ``drgrpo``: Dr.GRPO's constant, length-independent normaliser: 1 / (num_sequences · max_len).
    """
    m = loss_mask.to(torch.float32)
    if mode == "token_mean":
        return m / max(num_tokens, 1)
    if mode == "seq_mean_token_mean":
        lens = m.sum(dim=1, keepdim=True).clamp(min=1.0)
        return m / (lens * max(num_sequences, 1))
    if mode == "drgrpo":
        if not max_len or max_len <= 0:
            raise ConfigError(
                "aggregation 'drgrpo' needs max_len > 0 (the generation budget in tokens): set "
                "worker.max_new_tokens, or choose another algorithm.aggregation"
            )
        return m / (max(num_sequences, 1) * max_len)
    raise ConfigError(
        f"unknown aggregation {mode!r}: expected 'token_mean', 'seq_mean_token_mean' or 'drgrpo'"
    )


def aggregate(
    values: torch.Tensor, loss_mask: torch.Tensor, mode: Aggregation, max_len: int | None = None
) -> torch.Tensor:
    """Aggregate per-token `values` [B, T] of one whole batch into a scalar (see `token_weights`)."""
    n_tok = int(loss_mask.to(torch.int64).sum())
    w = token_weights(loss_mask, mode, values.shape[0], n_tok, max_len)
    return (values * w).sum()


# --- the policy loss ----------------------------------------------------------------------------------


@dataclass
class LossTerms:
    """Per-token pieces of the policy loss for one (micro-)batch; all [B, T]."""

    loss: torch.Tensor
    """Per-token loss to minimise (0 where not counted); differentiable."""
    counted: torch.Tensor
    """bool: model tokens (loss_mask 1)."""
    gate_masked: torch.Tensor
    """bool: counted tokens the DPPO gate removed."""
    clipped: torch.Tensor
    """bool: counted, not gated tokens whose gradient the PPO clip removed."""
    iw: torch.Tensor
    """Importance weight π/μ per token (detached; truncated when tis_cap is set)."""
    kl: torch.Tensor | None
    """Per-token k3 KL (detached) when a reference was given."""


def policy_terms(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    adv: torch.Tensor,
    loss_mask: torch.Tensor,
    settings: LossSettings,
    ref_logp: torch.Tensor | None = None,
) -> LossTerms:
    """Per-token decoupled-PPO loss with the DPPO gate for one batch (`adv` is [B], one per sequence).

    Without `tis_cap` the ratio is taken directly against the behaviour policy μ (the worker's logprobs).
    With `tis_cap` (decoupled PPO with a proximal policy): the ratio is against the proximal policy, here
    the current parameters before the step (`logp.detach()`, since each batch gets one optimizer step), and
    the behaviour correction is the weight min(π_prox/μ, C).
    """
    counted = loss_mask.to(torch.bool)
    a = adv.to(logp.dtype).reshape(-1, 1).expand_as(logp)
    if settings.tis_cap is None:
        ratio = importance_ratio(logp, behaviour_logp)
        iw = ratio.detach()
        objective, clipped = clipped_surrogate(
            ratio, a, settings.clip_low, settings.clip_high, settings.dual_clip
        )
    else:
        ratio = torch.exp(logp - logp.detach())
        iw = truncated_importance_weight(logp, behaviour_logp, settings.tis_cap)
        objective, clipped = clipped_surrogate(
            ratio, a, settings.clip_low, settings.clip_high, settings.dual_clip
        )
        objective = iw * objective
    if settings.dppo_delta is not None:
        gated = dppo_gate(logp, behaviour_logp, a, settings.dppo_delta) & counted
    else:
        gated = torch.zeros_like(counted)
    keep = counted & ~gated
    loss = torch.where(keep, -objective, torch.zeros_like(objective))
    kl = None
    if ref_logp is not None and settings.kl_coef > 0:
        kl_t = k3_kl(logp, ref_logp)
        loss = loss + settings.kl_coef * torch.where(counted, kl_t, torch.zeros_like(kl_t))
        kl = kl_t.detach()
    return LossTerms(loss=loss, counted=counted, gate_masked=gated, clipped=clipped & keep, iw=iw, kl=kl)


def policy_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    adv: torch.Tensor,
    loss_mask: torch.Tensor,
    settings: LossSettings,
    max_len: int | None = None,
    ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossTerms]:
    """Scalar loss of one whole batch: `policy_terms` aggregated with `settings.aggregation`.

    Gated tokens keep their place in the denominator (they contribute 0 to the numerator): the
    normaliser must be known before the forward pass so that micro-batches sum to the batch loss.
    """
    terms = policy_terms(logp, behaviour_logp, adv, loss_mask, settings, ref_logp)
    return aggregate(terms.loss, terms.counted, settings.aggregation, max_len), terms
