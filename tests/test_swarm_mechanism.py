"""SAPO's mechanism, as a test: a skill one node has spreads, through sharing, to a node that lacks it.

Both nodes start from the shipped tiny model after a short supervised fine-tune on 1-digit + and - (`pm1`,
train split only): node A 50 steps on the right answers (held-out reward about 0.7), node B 150 steps on
answers off by one (a deliberately damaged checkpoint: the same answer format, a wrong rule; held-out reward
about 0.02). Both generate and train on pm1 for 20 rounds at the same batch (8 groups of 8 per step); B
trains on 4 of its own groups and 4 of A's (SAPO 4/4, `onpolicy`), re-scored by its own verifier, and its
held-out reward on pm1 rises from its start (measured here: 0.020 -> 0.605 in 20 rounds, 0.641 in 30).

What this test does not claim: that B learns *more* than it would alone. Alone, B's rare correct samples
give it a signal of its own in some seeds; `benchmarks/bench_swarm_mechanism.py` measures that difference
over 10 seeds (B from 1,000 off-by-one steps: alone 0.197, `onpolicy` sharing 0.658, +0.461 [+0.271,
+0.652]; BENCHMARKS.md). A single seed says nothing about it, so no arm without sharing is run here.

Fixed seeds, one thread, nodes round-robin in one process: deterministic on one machine, but not bit-equal
across CPUs, so every bound has a margin over what was measured. The premises (B cannot, A can) are
asserted first, so a change to the shipped model that breaks them fails with that message.
"""

from __future__ import annotations

import pytest
import torch

from pnyx.store import open_store

ROUNDS = 20
A_STEPS, B_STEPS = 50, 150
B_UNABLE = 0.25
"""B's start must be below this: measured 0.020 here (0.016 at 300 steps, 0.007-0.10 at 1,000 elsewhere)."""
A_ABLE = 0.5
"""A's held-out reward at the end must be above this: measured 0.750 (256 draws: a standard error of about
0.03)."""
MARGIN = 0.1
"""B must rise at least this much with sharing: measured +0.586."""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from pnyx.config import shipped_model_path
    from pnyx_harness.swarm_experiment import Family, mechanism_starts

    torch.set_num_threads(1)
    family = Family("pm1", "arith", {"digits": 1, "ops": ["+", "-"]})
    root = tmp_path_factory.mktemp("mechanism")
    able, damaged = mechanism_starts(
        shipped_model_path(), root, family, a_steps=A_STEPS, b_start="off1", b_steps=B_STEPS
    )
    return root, family, able, damaged


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_node_lacking_a_skill_learns_it_while_training_on_a_peers_groups(setup):
    from pnyx_harness.swarm_experiment import transfer_run

    root, family, able, damaged = setup
    overrides = {
        "worker": {"group_size": 8, "max_new_tokens": 12},
        "trainer": {"lr": 2e-4},
        "swarm": {"max_per_peer": 8, "recent_per_peer": 8, "window_s": 1e6, "peer_timeout_s": 1e6,
                  "checkpoint_every": 0},
    }  # fmt: skip
    shared = transfer_run(
        open_store(str(root / "onpolicy-4")), able, damaged, family, rounds=ROUNDS, b_external=4,
        mode="onpolicy", seed=0, overrides=overrides, b_lr=3e-4, eval_every=ROUNDS, eval_tasks=64,
        eval_samples=4,
    )  # fmt: skip
    assert shared.start < B_UNABLE, f"premise: B must start unable to solve pm1 (held-out {shared.start:.3f})"
    assert shared.a_end > A_ABLE, f"premise: A must solve pm1 (held-out {shared.a_end:.3f})"
    assert shared.external_trained >= ROUNDS  # B's steps did train on A's groups
    assert shared.end - shared.start >= MARGIN, (
        f"with sharing B reached {shared.end:.3f} from {shared.start:.3f}"
    )
