"""`pnyx run` under committed draws (`security.committed_draws`), real processes: a trainer and two workers on
the shipped tiny model, interrupted with SIGINT and resumed (every process restarts: the trainer reads its
ticks back, each worker finds the seqs it committed before), to the step budget. Every group uploaded must
name a tick that included its commitment, and none may be dropped as `uncommitted`."""

from __future__ import annotations

import json

import pytest
from test_run_e2e import _pnyx, interrupt_at

from pnyx.config import shipped_model_path

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

STEPS = 16
INTERRUPT_AT = 4


def test_a_committed_run_trains_through_a_restart_and_every_group_matches_its_tick(tmp_path):
    from pnyx.protocol import decode_group, layout
    from pnyx.protocol.commits import decode_tick
    from pnyx.store import open_store
    from pnyx.weights import latest_version

    if not shipped_model_path().is_dir():
        pytest.skip(f"the shipped base model is missing at {shipped_model_path()}")
    store_dir = tmp_path / "runs" / "committed"
    common = [
        "--no-live", "--workers", "2", "--run.name=committed", f"--run.steps={STEPS}", "--run.eval_every=0",
        "--run.eval_tasks=50", "--run.time_budget_s=600", "--worker.heartbeat_interval_s=0.5",
        "--security.committed_draws=true",
    ]  # fmt: skip
    seen, rc = interrupt_at(
        _pnyx(["run", *common], tmp_path, tmp_path / "phase1.log"), store_dir, INTERRUPT_AT, 240
    )
    assert seen is not None and rc == 0, (tmp_path / "phase1.log").read_text()[-3000:]
    second = _pnyx(["run", "--resume", *common], tmp_path, tmp_path / "phase2.log")
    try:
        rc = second.wait(timeout=600)
    finally:
        if second.poll() is None:
            second.kill()
    logs = (tmp_path / "phase1.log").read_text() + (tmp_path / "phase2.log").read_text()
    assert rc == 0, logs[-3000:]
    store = open_store(store_dir)
    assert latest_version(store) == STEPS

    status = json.loads((store_dir / "trainer" / "status.json").read_text())
    assert "uncommitted" not in (status.get("drops") or {}), status.get("drops")
    assert not status.get("quarantined"), status.get("quarantined")
    assert status["ticks"]["included"] > 0, status.get("ticks")

    run = json.loads((store_dir / "run.json").read_text())
    trainer_fp = run["trainer_key"]["fingerprint"]
    ticks = {}
    for meta in store.list(layout.TICKS_PREFIX):
        n = layout.parse_tick_key(meta.key)
        if n is not None:
            ticks[n] = decode_tick(store.get(meta.key), run["run_id"], trainer_fp)
    groups = [
        decode_group(store.get(m.key))
        for m in store.list(layout.ROLLOUTS_PREFIX)
        if layout.parse_rollout_key(m.key) is not None and "evil" not in m.key
    ]
    assert len(groups) >= 2 * STEPS
    for g in groups:
        tick = ticks.get(g.tick)
        assert tick is not None and g.beacon == tick.beacon, (g.worker_id, g.seq, g.tick)
        inc = tick.included[g.commit]
        assert inc.worker_id == g.worker_id and inc.tasks[g.seq - inc.first_seq] == g.task_id
        assert inc.version == g.policy_version
    # each seq of a worker name was committed once (the trainer refuses a second commitment)
    committed = [(i.worker_id, s) for t in ticks.values() for i in t.included.values()
                 for s in range(i.first_seq, i.first_seq + len(i.tasks))]  # fmt: skip
    assert len(committed) == len(set(committed))
    print(f"\ncommitted run: {len(groups)} groups, {len(ticks)} ticks, {status['ticks']}")
