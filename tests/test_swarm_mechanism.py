"""SAPO's mechanism, as a test: a skill one node has spreads to a node that lacks it, through sharing alone.

Node A starts from the shipped tiny model after a short supervised fine-tune on 1-digit + and - (`pm1`,
train split only), so it solves most of that family; node B is the shipped model itself, which was never
trained on 1-digit problems and answers them with 2-3 digit numbers (held-out reward about 0.01). Both
generate and train on pm1 for the same rounds at the same batch (8 groups per step). Without sharing
(8/0), B's own groups almost never hold a correct answer, so it has no signal and its held-out reward
stays where it started; with sharing (4/4, gated, the default foreign-text mode), B trains on A's groups,
re-scored by its own verifier, and its held-out reward on pm1 rises. `benchmarks/bench_swarm_mechanism.py`
measures the same with more rounds and seeds, both foreign-text modes and a late joiner (BENCHMARKS.md).

Deterministic (fixed seeds, one thread, round-robin nodes in one process). Depends on the shipped model
not knowing 1-digit arithmetic; the premise is asserted first, so a retrained model that does fails here
with that message rather than somewhere vaguer.
"""

from __future__ import annotations

import pytest
import torch

from pnyx.store import open_store

ROUNDS = 24


@pytest.mark.slow
def test_sharing_carries_a_skill_to_a_node_that_lacks_it(tmp_path):
    from pnyx.config import shipped_model_path
    from pnyx.swarm.experiment import Family, specialize, transfer_run

    torch.set_num_threads(1)
    base = shipped_model_path()
    family = Family("pm1", "arith", {"digits": 1, "ops": ["+", "-"]})
    able = specialize(base, tmp_path / "a", family, steps=100, lr=1e-3)
    overrides = {
        "worker": {"group_size": 8, "max_new_tokens": 12},
        "trainer": {"lr": 2e-4},
        "swarm": {
            "max_per_peer": 8,
            "recent_per_peer": 8,
            "window_s": 1e6,
            "peer_timeout_s": 1e6,
            "checkpoint_every": 0,
        },
    }

    def run(external: int, name: str):
        return transfer_run(
            open_store(str(tmp_path / name)), able, base, family, rounds=ROUNDS, b_external=external,
            mode="gated", seed=0, overrides=overrides, b_lr=1e-3, eval_every=ROUNDS, eval_tasks=64, eval_samples=4,
        )  # fmt: skip

    alone = run(0, "alone")
    assert alone.start < 0.05, f"premise: B must start unable to solve pm1 (held-out {alone.start:.3f})"
    assert alone.a_end > 0.5, f"premise: A must solve pm1 (held-out {alone.a_end:.3f})"
    shared = run(4, "shared")
    assert shared.start == alone.start and shared.a_end == alone.a_end  # same B, same A in both arms
    assert shared.external_trained >= ROUNDS  # B trained on A's groups (and only the sharing arm did)
    assert alone.external_trained == 0
    assert alone.end - alone.start < 0.03, f"without sharing B moved {alone.start:.3f} -> {alone.end:.3f}"
    assert shared.end - alone.end >= 0.05, (
        f"with sharing B reached {shared.end:.3f}, without {alone.end:.3f} (start {alone.start:.3f})"
    )
