"""The step on N ranks is the step on one: the same micro-batch plan shared out, gradients summed by FSDP2.

With SGD at lr 1 the update is minus the gradient, so comparing parameters compares gradients. Two gloo
ranks with three micro-batches (one rank also runs a zero-weight filler to stay in step) must give the
one-process gradient bit for bit here (each parameter's gradient is the sum of the same three micro-batch
gradients), and the same statistics.
"""

from __future__ import annotations

import copy

import dist_support as ds
import pytest
import torch
from train_support import scored_groups

from pnyx.train.distributed import Dist, prepare_model
from pnyx.train.losses import LossSettings
from pnyx.train.microbatch import Row, assign_micro_batches, plan_micro_batches
from pnyx.train.step import train_step

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from pnyx.models import load_model, load_tokenizer

    return tiny_model_dir, load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)


def test_micro_batches_are_shared_out_by_padded_tokens_and_every_one_is_used_once():
    rows = [Row([1] * 3, [2] * n, [0.0] * n, [1] * n, 0.0, (1.0, 0, 1.0)) for n in (2, 9, 4, 5, 1, 30, 6)]
    plan = plan_micro_batches(rows, token_budget=20)
    shares = assign_micro_batches(rows, plan, 3)
    assert sorted(map(sorted, (mb for share in shares for mb in share))) == sorted(map(sorted, plan))
    load = [sum(len(mb) * max(rows[i].length for i in mb) for mb in share) for share in shares]
    assert max(load) - min(load) <= max(len(mb) * max(rows[i].length for i in mb) for mb in plan)
    assert assign_micro_batches(rows, plan, 1) == [plan]


@pytest.mark.slow
def test_two_ranks_take_the_one_process_step_bit_for_bit(tmp_path, tiny):
    model_dir, model, tok = tiny
    ds.spawn(ds.sharded_step_ranks, 2, str(model_dir), str(tmp_path))
    got = torch.load(tmp_path / "sharded.pt", weights_only=False)
    one = copy.deepcopy(model)
    stats = train_step(
        one, torch.optim.SGD(one.parameters(), lr=1.0), scored_groups(model, tok, n_groups=3, g=3),
        LossSettings(dppo_delta=None), micro_batch_tokens=64, grad_clip=1e9,
    )  # fmt: skip
    assert stats.micro_batches == got["stats"]["micro_batches"] == 3
    for k, v in one.state_dict().items():
        assert torch.equal(got["state"][k], v), k
    for field in ("loss", "tokens", "entropy", "iw_mean", "clip_frac", "masked_frac"):
        assert got["stats"][field] == getattr(stats, field), field
    assert got["stats"]["grad_norm"] == pytest.approx(stats.grad_norm, rel=1e-5)


def test_activation_checkpointing_gives_the_same_update(tiny):
    _, model, tok = tiny
    groups = scored_groups(model, tok)
    results = []
    for checkpointing in (False, True):
        m = prepare_model(copy.deepcopy(model), Dist.single(), torch.float32, checkpointing)
        assert m.is_activation_checkpointing == checkpointing
        train_step(
            m,
            torch.optim.SGD(m.parameters(), lr=1.0),
            groups,
            LossSettings(),
            micro_batch_tokens=4096,
            grad_clip=1e9,
        )
        results.append(m.state_dict())
    for k, v in results[0].items():
        torch.testing.assert_close(results[1][k], v, rtol=1e-5, atol=1e-7)


def test_bf16_compute_on_cpu_keeps_fp32_master_weights(tiny):
    _, model, tok = tiny
    m = copy.deepcopy(model)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    stats = train_step(
        m, torch.optim.AdamW(m.parameters(), lr=1e-3), scored_groups(model, tok), LossSettings(),
        micro_batch_tokens=4096, grad_clip=1.0, compute_dtype=torch.bfloat16,
    )  # fmt: skip
    assert all(p.dtype == torch.float32 for p in m.parameters())
    assert any(not torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert torch.isfinite(torch.tensor(stats.loss)) and stats.grad_norm > 0
