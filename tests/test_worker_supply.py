"""The worker under supply control, in process: zero-variance groups skipped and counted, pacing by the
trainer's demand, spooled groups the trainer can no longer use counted expired (and uploaded late, so their
seqs are accounted for).

Real store (a tmp folder), the trainer's own `init_run`, the real PULSE publisher, the real engine and
`arith` with the tiny random model. Where a test needs groups with and without reward variance, it wraps
the worker's environment so that half the tasks score alternately 0 and 1 (the random model alone scores 0).
"""

from __future__ import annotations

import dataclasses
import time

import pytest
from worker_support import make_run, rollout_groups, wait_for

from pnyx.envs import stable_hash
from pnyx.protocol import Demand, Heartbeat, decode_json, encode_json, layout
from pnyx.protocol.rules import is_zero_variance
from pnyx.rollout.worker import Worker, WorkerOptions


@pytest.fixture(autouse=True)
def _one_thread():
    import torch

    torch.set_num_threads(1)


class MixedRewards:
    """The run's env, except rewards: tasks whose id hashes odd alternate 0/1 per sample, the others score 0."""

    def __init__(self, env):
        self._env = env
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self._env, name)

    def score(self, task, text):
        self.calls += 1
        score = self._env.score(task, text)
        reward = float(self.calls % 2) if stable_hash(task.id) % 2 else 0.0
        return dataclasses.replace(score, reward=reward)


def _write_demand(store, version: int, waiting: int, staleness: int = 3) -> None:
    """A trainer's demand; its long step time keeps stall grants (after 2 steps) out of these tests."""
    d = Demand(
        version=version, groups_per_step=8, max_staleness=staleness, waiting=waiting, step_s=30.0, workers=1,
        updated_at=time.time(),
    )  # fmt: skip
    store.put(layout.WEIGHTS_DEMAND, encode_json(d))


def test_zero_variance_groups_are_skipped_counted_and_their_seqs_accounted_for(tmp_path, tiny_model_dir):
    """A seeded group's seq is reserved before it is generated (its draws name it): a skipped group is
    uploaded as its skip record, so the worker's seqs in the store are contiguous, and every uploaded group
    keeps the seq it was drawn under."""
    run = make_run(str(tmp_path / "run"), tiny_model_dir, skip_zero_variance=True, supply_control=False)
    worker = Worker(run.store, WorkerOptions(worker_id="w1", max_groups=4, spool_dir=str(tmp_path / "spool")))
    worker.join()
    worker.gen.env = MixedRewards(worker.gen.env)
    summary = worker.run()

    groups = [g for _, g in rollout_groups(run.store)]
    assert len(groups) == 4 and summary.groups_skipped_zero_variance > 0
    assert not any(is_zero_variance([s.reward for s in g.samples]) for g in groups)
    seqs = sorted(g.seq for g in groups)
    assert all(g.draws for g in groups)
    skips = [g for _, g in rollout_groups(run.store, skips=True)]
    assert skips and all(g.draws and is_zero_variance([s.reward for s in g.samples]) for g in skips)
    accounted = sorted(seqs + [g.seq for g in skips])
    assert accounted == list(range(len(accounted)))  # contiguous: nothing kept back unseen
    assert len(set(seqs)) == 4 and len(skips) <= summary.groups_skipped_zero_variance
    hb = decode_json(run.store.get(layout.worker_heartbeat("w1")), Heartbeat)
    assert hb.groups == 4 and hb.groups_skipped_zero_variance == summary.groups_skipped_zero_variance


def test_worker_waits_for_the_trainers_demand_then_makes_one_more_step(tmp_path, tiny_model_dir, monkeypatch):
    # supply control on; trainer.groups_per_step 8; a lead of 1.25 steps (the default is 1). No stall grant
    # here: its first one is due 2 s after the last demand (before any, after the start), which a loaded CI
    # machine once spent on these 8 steps (12 groups made, not 10); stall grants have their own tests.
    from pnyx.rollout.throttle import Throttle

    monkeypatch.setattr(Throttle, "stall_after", lambda self: 3600.0)
    run = make_run(str(tmp_path / "run"), tiny_model_dir, supply_lead=1.25)
    worker = Worker(run.store, WorkerOptions(worker_id="w1", spool_dir=str(tmp_path / "spool")))
    worker.join()
    made = lambda: worker.link.spool.stats.uploaded + len(worker.link.spool)  # noqa: E731
    try:
        for _ in range(12):
            worker.step()
        assert made() == 18  # before any demand: the trainer's first step of 8, then the lead, 1.25 steps
        worker.step()
        assert made() == 18 and worker.progress.status == "waiting" and "supply" in worker.progress.detail
        _write_demand(run.store, version=1, waiting=10)  # the trainer stepped; its queue is on target
        wait_for(lambda: worker.supply.throttle.version == 1, 30, "the courier to read the demand")
        for _ in range(8):
            worker.step()
        assert made() == 26  # exactly one more step of 8
        wait_for(lambda: len(rollout_groups(run.store)) == 26, 60, "the uploads")
    finally:
        worker.close()


def test_spooled_groups_past_the_trainers_window_are_counted_expired_and_uploaded_late(
    tmp_path, tiny_model_dir
):
    from pnyx.store import RetryPolicy
    from pnyx_harness.faults import FaultyStore

    run = make_run(str(tmp_path / "run"), tiny_model_dir, supply_control=False)
    spool = str(tmp_path / "spool")
    down = FaultyStore(run.store, retry=RetryPolicy(deadline_s=0.05, base_s=0.01, cap_s=0.01))
    down.fail_when(lambda op, key: op == "put" and key.startswith(layout.ROLLOUTS_PREFIX))
    first = Worker(down, WorkerOptions(worker_id="w1", spool_dir=spool, final_flush_s=0.2))
    first.join()
    first.step()  # 2 groups of v0, spooled, never uploaded
    first.request_stop("test")
    assert first.run().groups_pending == 2

    for v in range(1, 6):
        run.publish(v)
    _write_demand(run.store, version=5, waiting=10, staleness=3)  # the window is now v2..v5
    again = Worker(run.store, WorkerOptions(worker_id="w1", spool_dir=spool, max_groups=2))
    summary = again.run()

    assert summary.groups_expired == 2
    versions = sorted(g.policy_version for _, g in rollout_groups(run.store))
    assert versions == [0, 0, 5, 5]  # the expired ones uploaded all the same: their seqs are accounted for
    hb = decode_json(run.store.get(layout.worker_heartbeat("w1")), Heartbeat)
    assert hb.groups_expired == 2 and hb.groups == 2


def test_a_worker_whose_groups_all_have_zero_variance_keeps_drawing_past_its_version_cap(
    tmp_path, tiny_model_dir
):
    """The version cap (half the flood limit) counts groups offered for training, not skip records: a
    trainer short of a batch publishes no new version, so a worker whose draws all come out zero-variance
    (the random model scores 0 on every task) must go on drawing at that version. A cap on its skip records
    once stopped the worker and the run with it (1 group and 8 skip records, the trainer waiting 224 s
    for its second group). Its cohorts are cut to the group places left."""
    run = make_run(
        str(tmp_path / "run"), tiny_model_dir, security={"flood_limit": 4}, skip_zero_variance=True,
        supply_control=False, prompts_per_cohort=4,
    )  # fmt: skip
    worker = Worker(run.store, WorkerOptions(worker_id="w1", spool_dir=str(tmp_path / "spool")))
    worker.join()
    try:
        for _ in range(3):  # cohorts cut to the cap's 2 places, all skipped: still no group made
            worker.step()
            assert worker.progress.status != "waiting"
        assert worker.progress.skipped_zero_variance == 6
        wait_for(lambda: len(rollout_groups(run.store, skips=True)) == 6, 60, "the courier's uploads")
    finally:
        worker.close()
    assert rollout_groups(run.store) == [] and worker.progress.rollouts == 6 * worker.cfg.worker.group_size
