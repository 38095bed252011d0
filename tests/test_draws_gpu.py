"""Seeded draws with a GPU on either side (skipped without CUDA; this repository's CI has none).

- A worker sampling on CUDA in float32: every honest group passes the trainer's exact check (on the CPU, in
  float32, under the version's published weights) at the default tolerance. Other kernels move a token's
  CDF interval by float rounding only; how far a bf16 or fp16 worker lands is measured by
  `benchmarks/bench_draw_check.py --device cuda --dtype bfloat16` (BENCHMARKS.md), not asserted here.
- A trainer stepping on CUDA (bf16 autocast over fp32 masters) measures every token in its own forward,
  re-checks the rows over the tolerance under the exact published weights (on the CPU), keeps every honest
  group, fresh or stale, and rejects the temperature liar's groups that differ from the honest draw.
"""

from __future__ import annotations

import pytest
import test_draws as td
import torch

pytestmark = pytest.mark.gpu

run = td.run  # the signed run of the shipped tiny model with v0 and v1 published
TOLERANCE = 1e-3  # security.draw_tolerance's default


def _cuda_engine(run, version: int, dtype: str = "float32"):
    from pnyx.rollout.engines import make_engine
    from pnyx.weights import Syncer

    syncer = Syncer(run["store"], trust=run["trust"])
    syncer.sync(version)
    engine = make_engine("torch", run["model_dir"], run["tok"], dtype=dtype, device="cuda")
    engine.update(version, syncer.state, syncer.manifest)
    return engine, syncer.digest or ""


def test_a_cuda_fp32_workers_honest_groups_pass_the_exact_check_on_the_cpu(run):
    check = td._Exact(run, tolerance=TOLERANCE)
    for v in (0, 1):
        engine, digest = _cuda_engine(run, v)
        groups = td._groups(run, engine, digest, v, key="k1", n=16)
        assert all(g.draws == td.SCHEME for g in groups)
        assert [check.check(g, "k1") for g in groups] == [None] * len(groups)
    print(f"\ncuda fp32 worker, cpu fp32 check: {check.tokens} tokens, largest distance {check.worst:.3g}")
    assert check.tokens > 0 and check.worst <= TOLERANCE


def test_a_cuda_trainer_keeps_honest_groups_and_rejects_the_liars_that_differ(run):
    _, stats, rows, differ, _ = td._step_on_fresh_stale_and_liars(run, device="cuda")
    tally = stats.draws
    assert tally is not None
    n0, flagged0, failed0 = tally.by_staleness["0"]
    n1, flagged1, failed1 = tally.by_staleness["1"]
    print(
        f"\ncuda bf16-autocast step: fresh {n0} rows, {flagged0} flagged; stale {n1} rows, {flagged1} flagged"
    )
    assert n0 == rows[1] and failed0 == 0  # fresh honest rows: flagged at most by bf16 rounding, never failed
    assert n1 == rows[0] and 0 < failed1 <= flagged1 <= n1
    assert stats.rejected == dict.fromkeys(sorted(differ), "draw_mismatch")
    assert torch.isfinite(torch.tensor(stats.loss))
