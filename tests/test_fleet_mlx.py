"""`pnyx worker --engine mlx` trains the shipped tiny model in a real fleet: a trainer process and an MLX worker
process meeting in a store folder, started as docs/fleet.md tells a Mac owner to.

The worker generates with mlx (its CPU build here), applies every PULSE delta in place and proves it; the
trainer re-scores, gates and steps. Reward (the trainer's own re-scored reward per step) must rise from the
first steps to the last, the trainer must report the gate-masked fraction (in every step's metrics and on
its per-step log line) and the logprob gap of the mlx engine, and the groups in the store must come from the
mlx engine.
"""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest
from worker_support import start, worker_command

from pnyx.protocol import decode_group, layout
from pnyx.store import open_store

pytestmark = [
    pytest.mark.slow,
    # ~4 min on the 2 shared cores at load ~8; at load ~18 it reached step 29 of 40 in 10 min, so the limit
    # is wider than the suite's 600 s and matches the trainer's own deadline below.
    pytest.mark.timeout(1500),
    pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None, reason="needs pnyx[mlx]"),
]

STEPS = 40
WINDOW = 8  # steps averaged at each end
RISE = 0.05  # reward must rise by at least this much (measured: ~0.26 -> ~0.35 over 30 steps)


def test_mlx_worker_trains_the_tiny_model_in_a_fleet(tmp_path):
    from pnyx.train.checkpoint import read_metrics

    url = str(tmp_path / "run")
    settings = [
        f"--run.steps={STEPS}",
        "--trainer.max_wait_s=240",
        "--worker.poll_interval_s=0.2",
    ]
    trainer = start(
        [sys.executable, "-m", "pnyx", "trainer", "--store", url, *settings], tmp_path / "trainer.log"
    )
    worker = start(worker_command(url, "mac-1", "--engine", "mlx"), tmp_path / "worker.log")
    try:
        code = trainer.wait(1380)
        assert code == 0, (tmp_path / "trainer.log").read_text(errors="replace")[-3000:]
    finally:
        for p in (trainer, worker):
            if p.poll() is None:
                p.terminate()
                p.wait(60)
    log = (tmp_path / "worker.log").read_text(errors="replace")
    assert "engine=mlx" in log, log[-3000:]
    store = open_store(url)
    metrics = read_metrics(store)
    assert len(metrics) >= STEPS
    first = sum(m["reward"] for m in metrics[:WINDOW]) / WINDOW
    last = sum(m["reward"] for m in metrics[-WINDOW:]) / WINDOW
    print(f"\nmlx fleet: reward first {WINDOW} steps {first:.3f} -> last {WINDOW} steps {last:.3f}; "
          f"masked {[round(m['masked_frac'], 4) for m in metrics[-WINDOW:]]}; "
          f"lp_gap_engine {[m['lp_gap_engine'] for m in metrics[-3:]]}")  # fmt: skip
    assert last > first + RISE, (first, last)
    assert all(0.0 <= m["masked_frac"] <= 1.0 for m in metrics)
    reported = re.findall(r"trainer v=\d+ .* masked=(\d+\.\d+)% ", (tmp_path / "trainer.log").read_text())
    assert len(reported) >= STEPS, "the trainer's per-step lines must report the gate-masked fraction"
    gaps = [m["lp_gap_engine"]["mlx"] for m in metrics if "mlx" in m.get("lp_gap_engine", {})]
    # The trainer recomputes with its fp32 master weights, the worker runs their bf16 cast: the gap is that
    # rounding (~2e-3 measured), far below what wrong weights give (the contract test's noise: ~1).
    assert gaps and max(gaps) < 0.02, gaps
    keys = [meta.key for meta in store.list(layout.ROLLOUTS_PREFIX)][:20]
    assert keys and all(decode_group(store.get(k)).engine == "mlx" for k in keys)
