"""The optimizer step on a tiny model: micro-batching, parameter change, publishing a verifiable delta."""

from __future__ import annotations

import copy

import pytest
import torch
from train_support import scored_groups

from pnyx.train.losses import LossSettings
from pnyx.train.microbatch import Row, build_rows, plan_micro_batches
from pnyx.train.step import make_optimizer, train_step

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from pnyx.models import load_model, load_tokenizer
    from pnyx_harness.models import make_tiny_model_dir

    d = make_tiny_model_dir(tmp_path_factory.mktemp("tiny-step"))
    return load_model(d), load_tokenizer(d)


def test_micro_batch_plan_respects_the_token_budget():
    rows = [Row([1] * 3, [2] * n, [0.0] * n, [1] * n, 0.0, (1.0, 0, 1.0)) for n in (2, 9, 4, 5, 1)]
    plan = plan_micro_batches(rows, token_budget=16)
    assert sorted(i for mb in plan for i in mb) == list(range(5))
    for mb in plan:
        assert len(mb) == 1 or max(rows[i].length for i in mb) * len(mb) <= 16


def test_micro_batches_never_mix_sampling_settings():
    rows = [Row([1], [2], [0.0], [1], 0.0, (t, 0, 1.0)) for t in (1.0, 0.7, 1.0)]
    plan = plan_micro_batches(rows, token_budget=1000)
    assert sorted(sorted(mb) for mb in plan) == [[0, 2], [1]]


def test_build_rows_carries_each_sample_advantage(tiny):
    model, tokenizer = tiny
    groups = scored_groups(model, tokenizer, n_groups=1, g=3)
    assert [r.advantage for r in build_rows(groups)] == [1.0, -0.5, -0.5]


def test_micro_batching_gives_the_full_batch_gradient(tiny):
    model, tokenizer = tiny
    groups = scored_groups(model, tokenizer)
    settings = LossSettings(dppo_delta=None)
    results = []
    for budget in (10_000, 64):  # one micro-batch vs. several
        m = copy.deepcopy(model)
        before = [p.detach().clone() for p in m.parameters()]
        opt = torch.optim.SGD(m.parameters(), lr=1.0)  # parameter change == -gradient
        stats = train_step(m, opt, groups, settings, micro_batch_tokens=budget, grad_clip=1e9)
        results.append(([b - p.detach() for b, p in zip(before, m.parameters(), strict=True)], stats))
    (g_full, s_full), (g_micro, s_micro) = results
    assert s_micro.micro_batches > s_full.micro_batches == 1
    for a, b in zip(g_full, g_micro, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_on_policy_step_reports_unit_ratios_and_no_masking(tiny):
    model, tokenizer = tiny
    m = copy.deepcopy(model)
    stats = train_step(
        m,
        make_optimizer(m, 1e-3, (0.9, 0.99), 0.0),
        scored_groups(model, tokenizer),
        LossSettings(),
        micro_batch_tokens=4096,
        grad_clip=1.0,
    )
    assert stats.masked_frac == 0.0 and stats.clip_frac == 0.0
    assert stats.iw_mean == pytest.approx(1.0, abs=1e-4) and stats.ess == pytest.approx(1.0, abs=1e-6)
    assert stats.tokens > 0 and stats.grad_norm > 0 and stats.entropy > 0


def test_lp_gap_exposes_a_worker_whose_logprobs_are_not_its_policys(tiny):
    model, tokenizer = tiny
    groups = scored_groups(model, tokenizer)  # worker "w", honest
    forged = scored_groups(model, tokenizer, n_groups=1)[0]
    forged.worker_id = "forger"
    for smp in forged.group.samples:
        smp.logprobs = [lp - 1.0 for lp in smp.logprobs]
    m = copy.deepcopy(model)
    stats = train_step(
        m,
        make_optimizer(m, 1e-3, (0.9, 0.99), 0.0),
        [*groups, forged],
        LossSettings(),
        micro_batch_tokens=4096,
        grad_clip=1.0,
        policy_version=0,
    )
    assert stats.lp_gap["w"] < 1e-4
    assert stats.lp_gap["forger"] == pytest.approx(1.0, abs=1e-4)


def test_one_step_changes_parameters_and_publishes_a_verifiable_delta(tiny):
    from pnyx.store import open_store
    from pnyx.weights import Publisher, Syncer, read_manifest

    model, tokenizer = tiny
    m = copy.deepcopy(model)
    store = open_store("memory://")
    pub = Publisher(store, anchor_every=20)

    def cast():
        return {k: v.detach().to(torch.bfloat16) for k, v in m.state_dict().items()}

    pub.publish(0, cast(), force_anchor=True)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    train_step(
        m,
        make_optimizer(m, 1e-2, (0.9, 0.99), 0.0),
        scored_groups(model, tokenizer),
        LossSettings(),
        micro_batch_tokens=4096,
        grad_clip=1.0,
    )
    assert any(not torch.equal(before[k], v) for k, v in m.state_dict().items())
    pub.publish(1, cast())

    assert read_manifest(store, 1).kind == "delta"
    version, tensors = Syncer(store).sync()
    assert version == 1
    for k, v in cast().items():
        assert torch.equal(tensors[k], v), k


@pytest.mark.gpu
def test_cuda_step_keeps_fp32_master_weights_under_bf16_autocast(tiny):
    model, tokenizer = tiny
    groups = scored_groups(model, tokenizer)
    m = copy.deepcopy(model).cuda()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    stats = train_step(
        m,
        make_optimizer(m, 1e-2, (0.9, 0.99), 0.0),
        groups,
        LossSettings(),
        micro_batch_tokens=4096,
        grad_clip=1.0,
    )
    assert all(p.dtype == torch.float32 for p in m.parameters())
    assert any(not torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert torch.isfinite(torch.tensor(stats.loss)) and stats.grad_norm > 0


def test_tokens_outside_the_truncated_support_do_not_make_the_loss_nan(tiny):
    model, tokenizer = tiny
    m = copy.deepcopy(model)
    groups = scored_groups(model, tokenizer)
    for sg in groups:  # pretend the worker sampled with top_k=1: most recorded tokens are not the argmax
        sg.group.top_k = 1
    stats = train_step(
        m,
        make_optimizer(m, 1e-3, (0.9, 0.99), 0.0),
        groups,
        LossSettings(),
        micro_batch_tokens=4096,
        grad_clip=1.0,
    )
    assert all(torch.isfinite(p).all() for p in m.parameters())
    assert torch.isfinite(torch.tensor(stats.loss))


def test_lp_gap_engine_reports_each_engines_gap_separately(tiny):
    import msgspec

    model, tokenizer = tiny
    groups = scored_groups(model, tokenizer)  # the torch engine (the field's default), honest
    off = scored_groups(model, tokenizer, n_groups=1)[0]
    off.group = msgspec.structs.replace(off.group, engine="mlx")
    for smp in off.group.samples:
        smp.logprobs = [lp - 0.5 for lp in smp.logprobs]
    m = copy.deepcopy(model)
    stats = train_step(
        m, make_optimizer(m, 1e-3, (0.9, 0.99), 0.0), [*groups, off], LossSettings(),
        micro_batch_tokens=4096, grad_clip=1.0, policy_version=0,
    )  # fmt: skip
    assert stats.lp_gap_engine["torch"] < 1e-4
    assert stats.lp_gap_engine["mlx"] == pytest.approx(0.5, abs=1e-4)
