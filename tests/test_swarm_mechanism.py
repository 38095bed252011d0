"""SAPO's mechanism, as a test: a skill one node has spreads, through sharing, to a node that lacks it.

Both nodes start from the shipped tiny model after a short supervised fine-tune on 1-digit + and - (`pm1`,
train split only): node A on the right answers (held-out reward about 0.7), node B 1,000 steps on answers off by
one (a deliberately damaged checkpoint: the same answer format, a wrong rule; held-out reward about 0.01).
Both generate and train on pm1 for the same rounds at the same batch (8 groups of 8 per step). B trains on
its own 8 groups (no sharing) or on 4 of its own and 4 of A's (SAPO 4/4), re-scored by its own verifier,
in each foreign-text mode. With sharing, B trains on A's groups and its held-out reward on pm1 rises from
its start. (Alone, B's rare correct samples give it a signal of its own in some seeds: over 10 seeds it
ended at 0.197 alone and 0.658 with `onpolicy` sharing, +0.461 [+0.271, +0.652]; the benchmark measures
that difference, this test the mechanism at one seed.)
`benchmarks/bench_swarm_mechanism.py` measures the same over seeds, with a late joiner (BENCHMARKS.md).

Deterministic (fixed seeds, one thread, nodes round-robin in one process). The premise (A can, B cannot)
is asserted first, so a change to the shipped model that breaks it fails with that message.
"""

from __future__ import annotations

import pytest
import torch

from pnyx.store import open_store

ROUNDS = 30
MARGIN = 0.1


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from pnyx.config import shipped_model_path
    from pnyx.swarm.experiment import Family, mechanism_starts

    torch.set_num_threads(1)
    family = Family("pm1", "arith", {"digits": 1, "ops": ["+", "-"]})
    root = tmp_path_factory.mktemp("mechanism")
    able, damaged = mechanism_starts(
        shipped_model_path(), root, family, a_steps=100, b_start="off1", b_steps=1000
    )
    return root, family, able, damaged


def _run(setup, external: int, mode: str):
    from pnyx.swarm.experiment import transfer_run

    root, family, able, damaged = setup
    overrides = {
        "worker": {"group_size": 8, "max_new_tokens": 12},
        "trainer": {"lr": 2e-4},
        "swarm": {"max_per_peer": 8, "recent_per_peer": 8, "window_s": 1e6, "peer_timeout_s": 1e6,
                  "checkpoint_every": 0},
    }  # fmt: skip
    return transfer_run(
        open_store(str(root / f"{mode}-{external}")), able, damaged, family, rounds=ROUNDS, b_external=external,
        mode=mode, seed=0, overrides=overrides, b_lr=3e-4, eval_every=ROUNDS, eval_tasks=64, eval_samples=4,
    )  # fmt: skip


@pytest.fixture(scope="module")
def alone(setup):
    return _run(setup, 0, "gated")


@pytest.mark.slow
@pytest.mark.timeout(1800)
# `onpolicy` only: with the tiny model re-adapted to the env system prompts (2026-12-01), `gated` sharing
# did NOT carry the skill at this seed (B ended at 0.172 with sharing vs 0.238 alone, start 0.016), so the
# claim holds for `onpolicy` alone until the seeded benchmark (issue #17) says more about `gated`.
@pytest.mark.parametrize("mode", ["onpolicy"])
def test_a_node_lacking_a_skill_learns_it_while_training_on_a_peers_groups(setup, alone, mode):
    assert alone.start < 0.1, f"premise: B must start unable to solve pm1 (held-out {alone.start:.3f})"
    assert alone.a_end > 0.5, f"premise: A must solve pm1 (held-out {alone.a_end:.3f})"
    shared = _run(setup, 4, mode)
    assert shared.start == alone.start and shared.a_end == alone.a_end  # the same B and the same A
    assert shared.external_trained >= ROUNDS and alone.external_trained == 0
    # B learns pm1 while training on A's groups. Whether it learns *more* than alone is measured over seeds
    # by `bench_swarm_mechanism.py` (issue #17: +0.461 [+0.271, +0.652] over 10 seeds, B start from 1,000
    # off-by-one steps); a single seed is not asserted on (alone, B relearned in 5 of 10 seeds).
    assert shared.end - shared.start >= MARGIN, (
        f"{mode}: with sharing B reached {shared.end:.3f} from {shared.start:.3f} (alone {alone.end:.3f})"
    )
