"""Hand-computed checks of the advantage and loss building blocks (pnyx.train.advantages / losses)."""

from __future__ import annotations

import math

import pytest
import torch

from pnyx.errors import ConfigError
from pnyx.protocol.rules import is_zero_variance
from pnyx.train.advantages import group_advantages
from pnyx.train.losses import (
    LossSettings,
    aggregate,
    clipped_surrogate,
    dppo_gate,
    importance_ratio,
    k3_kl,
    policy_loss,
    policy_terms,
    token_weights,
    truncated_importance_weight,
)

L = math.log


def t(x):
    return torch.tensor(x, dtype=torch.float32)


# --- advantages ---------------------------------------------------------------------------------------


def test_grpo_advantage_is_centred_and_divided_by_population_std():
    # mean 0.25, population std sqrt(0.1875) = 0.4330
    adv = group_advantages([1.0, 0.0, 0.0, 0.0], "grpo", eps=0.0)
    s = math.sqrt(0.1875)
    assert adv == pytest.approx([0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s])


def test_grpo_advantage_eps_is_added_to_std():
    adv = group_advantages([1.0, 0.0], "grpo", eps=0.5)  # std 0.5 -> divide by 1.0
    assert adv == pytest.approx([0.5, -0.5])


def test_dr_grpo_advantage_is_only_centred():
    assert group_advantages([1.0, 0.0, 0.0, 0.0], "drgrpo") == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_zero_variance_group_is_detected_and_varied_group_is_not():
    assert is_zero_variance([0.7, 0.7, 0.7])
    assert not is_zero_variance([0.7, 0.7, 0.6])


# --- ratio, clip, dual clip -----------------------------------------------------------------------------


def test_importance_ratio_is_pi_over_mu():
    assert importance_ratio(t([L(0.5)]), t([L(0.25)])).item() == pytest.approx(2.0)


def test_ppo_clip_caps_positive_advantage_above_one_plus_eps_high():
    obj, clipped = clipped_surrogate(t([1.5, 0.5]), t([1.0, 1.0]), 0.2, 0.3, None)
    assert obj.tolist() == pytest.approx([1.3, 0.5])
    assert clipped.tolist() == [True, False]


def test_ppo_clip_caps_negative_advantage_below_one_minus_eps_low():
    obj, clipped = clipped_surrogate(t([0.5, 1.1]), t([-1.0, -1.0]), 0.2, 0.3, None)
    assert obj.tolist() == pytest.approx([-0.8, -1.1])
    assert clipped.tolist() == [True, False]


def test_dual_clip_bounds_negative_advantage_with_huge_ratio():
    ratio, adv = t([5.0]), t([-1.0])
    no_dual, c0 = clipped_surrogate(ratio, adv, 0.2, 0.2, None)
    dual, c1 = clipped_surrogate(ratio, adv, 0.2, 0.2, 3.0)
    assert no_dual.item() == pytest.approx(-5.0) and not c0.item()
    assert dual.item() == pytest.approx(-3.0) and c1.item()


def test_dual_clip_never_touches_positive_advantage():
    obj, _ = clipped_surrogate(t([5.0]), t([1.0]), 0.2, 0.2, 3.0)
    assert obj.item() == pytest.approx(1.2)


# --- DPPO gate ------------------------------------------------------------------------------------------


def test_gate_masks_positive_advantage_token_that_rose_beyond_delta():
    # p_pi 0.6, p_mu 0.3: Delta = +0.3 > 0.2 in the direction A > 0 pushes
    assert dppo_gate(t([L(0.6)]), t([L(0.3)]), t([1.0]), 0.2).item()


def test_gate_masks_negative_advantage_token_that_fell_beyond_delta():
    assert dppo_gate(t([L(0.1)]), t([L(0.5)]), t([-1.0]), 0.2).item()


def test_gate_never_masks_corrective_moves():
    # A > 0 but the token fell; A < 0 but the token rose: both moves go against the advantage
    assert not dppo_gate(t([L(0.1)]), t([L(0.5)]), t([1.0]), 0.2).item()
    assert not dppo_gate(t([L(0.6)]), t([L(0.3)]), t([-1.0]), 0.2).item()


def test_gate_keeps_moves_within_delta():
    assert not dppo_gate(t([L(0.45)]), t([L(0.3)]), t([1.0]), 0.2).item()
    assert not dppo_gate(t([L(0.15)]), t([L(0.3)]), t([-1.0]), 0.2).item()


def test_gate_measures_delta_in_probability_not_log_space():
    # ratio 3x (log-ratio 1.1) but Delta only 0.02: kept; ratio 1.5x but Delta 0.3: masked
    assert not dppo_gate(t([L(0.03)]), t([L(0.01)]), t([1.0]), 0.2).item()
    assert dppo_gate(t([L(0.9)]), t([L(0.6)]), t([1.0]), 0.2).item()


# --- truncated IS, KL -----------------------------------------------------------------------------------


def test_truncated_importance_weight_caps_at_c_and_carries_no_gradient():
    logp = t([L(0.8), L(0.1)]).requires_grad_(True)
    w = truncated_importance_weight(logp, t([L(0.2), L(0.2)]), cap=2.0)
    assert w.tolist() == pytest.approx([2.0, 0.5])
    assert not w.requires_grad


def test_k3_kl_is_zero_at_reference_and_matches_formula():
    assert k3_kl(t([L(0.3)]), t([L(0.3)])).item() == pytest.approx(0.0, abs=1e-7)
    assert k3_kl(t([L(0.25)]), t([L(0.5)])).item() == pytest.approx(2.0 - math.log(2.0) - 1.0)


# --- aggregation ----------------------------------------------------------------------------------------

VALUES = t([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_token_mean_averages_over_all_counted_tokens():
    assert aggregate(VALUES, MASK, "token_mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)


def test_seq_mean_token_mean_averages_each_sequence_first():
    assert aggregate(VALUES, MASK, "seq_mean_token_mean").item() == pytest.approx((2.0 + 4.0) / 2)


def test_constant_normaliser_divides_by_sequences_times_max_len():
    assert aggregate(VALUES, MASK, "drgrpo", max_len=8).item() == pytest.approx(10.0 / (2 * 8))


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "drgrpo"])
def test_micro_batches_sum_to_the_full_batch_aggregate(mode):
    full = aggregate(VALUES, MASK, mode, max_len=8)
    parts = sum((VALUES[i : i + 1] * token_weights(MASK[i : i + 1], mode, 2, 4, 8)).sum() for i in range(2))
    assert parts.item() == pytest.approx(full.item())


# --- the policy loss --------------------------------------------------------------------------------


def test_policy_loss_matches_hand_computation():
    # seq 0 (A=+1): ratios 1.0 and 1.5 (clipped to 1.28); seq 1 (A=-1): ratio 0.5 (clipped to 0.8)
    logp = t([[L(0.4), L(0.3)], [L(0.1), 0.0]])
    mu = t([[L(0.4), L(0.2)], [L(0.2), 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    settings = LossSettings(clip_low=0.2, clip_high=0.28, dual_clip=3.0, dppo_delta=None)
    loss, terms = policy_loss(logp, mu, t([1.0, -1.0]), mask, settings)
    assert loss.item() == pytest.approx(-(1.0 + 1.28 - 0.8) / 3)
    assert terms.clipped.tolist() == [[False, True], [True, False]]


def test_tool_tokens_never_count_even_with_wild_logprobs():
    # position 1 is a tool token whose (meaningless) pi/mu gap would be gated and clipped if it counted
    logp = t([[L(0.5), L(0.9)]]).requires_grad_(True)
    mu = t([[L(0.5), L(0.01)]])
    loss, terms = policy_loss(logp, mu, t([1.0]), torch.tensor([[1, 0]]), LossSettings())
    loss.backward()
    assert not terms.gate_masked[0, 1] and not terms.clipped[0, 1]
    assert logp.grad[0, 1].item() == 0.0
    assert loss.item() == pytest.approx(-1.0)  # only token 0 (ratio 1, A 1) over 1 counted token


def test_gated_token_contributes_no_gradient_but_stays_in_denominator():
    logp = t([[L(0.7), L(0.5)]]).requires_grad_(True)
    mu = t([[L(0.3), L(0.5)]])  # token 0 rose by 0.4 with A > 0: gated
    settings = LossSettings(dppo_delta=0.2, clip_high=10.0)
    loss, terms = policy_loss(logp, mu, t([1.0]), torch.ones(1, 2, dtype=torch.long), settings)
    loss.backward()
    assert terms.gate_masked.tolist() == [[True, False]]
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 1].item() != 0.0
    assert loss.item() == pytest.approx(-1.0 / 2)


def test_tis_mode_weights_the_gradient_by_the_capped_ratio():
    logp = t([[L(0.8), L(0.1)]]).requires_grad_(True)
    mu = t([[L(0.2), L(0.2)]])
    settings = LossSettings(tis_cap=2.0, dppo_delta=None, aggregation="token_mean")
    loss, terms = policy_loss(logp, mu, t([1.0]), torch.ones(1, 2, dtype=torch.long), settings)
    loss.backward()
    # ratio to the proximal (= current) policy is 1, so d loss / d logp_t = -w_t * A / n_tokens
    assert logp.grad[0].tolist() == pytest.approx([-2.0 / 2, -0.5 / 2])
    assert terms.iw[0].tolist() == pytest.approx([2.0, 0.5])


def test_kl_term_is_added_only_when_coefficient_is_positive():
    logp, mu, ref = t([[L(0.25)]]), t([[L(0.25)]]), t([[L(0.5)]])
    base = LossSettings(dppo_delta=None)
    with_kl = LossSettings(dppo_delta=None, kl_coef=0.1)
    l0, _ = policy_loss(logp, mu, t([1.0]), torch.ones(1, 1), base, ref_logp=ref)
    l1, terms = policy_loss(logp, mu, t([1.0]), torch.ones(1, 1), with_kl, ref_logp=ref)
    assert l1.item() - l0.item() == pytest.approx(0.1 * (2.0 - math.log(2.0) - 1.0))
    assert terms.kl is not None


def test_policy_terms_rejects_dual_clip_not_above_one():
    with pytest.raises(ConfigError, match="dual_clip"):
        policy_terms(t([[0.0]]), t([[0.0]]), t([-1.0]), torch.ones(1, 1), LossSettings(dual_clip=1.0))
