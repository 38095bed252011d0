"""The KL reference: prefetched logprobs are exactly what a direct forward under the group's sampling gives."""

from __future__ import annotations

import time

import pytest
import torch
from train_support import scored_groups

from pnyx.models import completion_logprobs
from pnyx.train.reference import Reference

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from pnyx.models import load_model, load_tokenizer

    return tiny_model_dir, load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)


def test_reference_logprobs_are_the_direct_ones_whether_prefetched_or_not(tiny):
    model_dir, model, tok = tiny
    groups = scored_groups(model, tok, n_groups=2, g=3)
    groups[1].group.temperature = 0.7  # per-group sampling settings are honoured
    ahead = Reference(model_dir, "cpu", torch.float32)
    ahead.prefetch(groups)
    deadline = time.monotonic() + 60
    while len(ahead._cache) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(ahead._cache) == 2  # the background thread scored both before anyone asked
    on_demand = Reference(model_dir, "cpu", torch.float32)
    got_ahead, got_now = ahead.logprobs(groups), on_demand.logprobs(groups)
    ahead.close()
    on_demand.close()
    assert got_ahead == got_now
    for g in groups:
        rec = g.group
        comps = [list(s.tokens) for s in rec.samples]
        with torch.no_grad():
            lp, _, _ = completion_logprobs(
                model, [list(rec.prompt_tokens)] * len(comps), comps, temperature=rec.temperature
            )
        for i, c in enumerate(comps):
            assert got_now[(g.key, i)] == lp[i, : len(c)].tolist()
