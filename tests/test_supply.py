"""Supply control: the worker's throttle (pure control law), the trainer's demand record, the run's account."""

from __future__ import annotations

import json
import os
import time

import pytest

from pnyx.protocol import Demand, Heartbeat, decode_json, encode_json, layout
from pnyx.rollout.throttle import Throttle
from pnyx.store import RetryPolicy, open_store
from pnyx.train.supply import DemandPublisher, supply_report
from pnyx_harness.faults import FaultyStore

B = 8


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def demand(
    version: int,
    waiting: int,
    workers: int = 1,
    step_s: float = 0.5,
    staleness: int = 3,
    left: int | None = None,
) -> Demand:
    return Demand(
        version=version, groups_per_step=B, max_staleness=staleness, waiting=waiting, step_s=step_s,
        workers=workers, steps_left=left, updated_at=time.time(),
    )  # fmt: skip


def throttle(clock: Clock | None = None, lead: float = 1.25) -> Throttle:
    return Throttle(B, lead=lead, cohort=4, clock=clock or Clock())


# --- the worker's throttle ---------------------------------------------------------------------------


def test_before_any_demand_a_worker_makes_the_first_batch_and_the_lead_then_waits():
    t = throttle()
    assert t.allowance() == 18  # (1 + 1.25) x 8: the trainer's first batch, then 1.25 batches waiting
    t.note_made(18)
    assert t.allowance() == 0


def test_each_new_version_adds_this_workers_share_of_one_step():
    t = throttle()
    t.note_made(18)
    t.observe(demand(1, waiting=10, workers=2))  # the queue is on target: feed-forward only
    assert t.allowance() == 4  # half of a step of 8
    t.note_made(4)
    t.observe(demand(2, waiting=10, workers=2))
    assert t.allowance() == 4


def test_an_old_or_repeated_demand_changes_nothing():
    t = throttle()
    assert t.observe(demand(3, waiting=10))
    before = t.allowance()
    assert not t.observe(demand(3, waiting=0)) and not t.observe(demand(2, waiting=0))
    assert t.allowance() == before


def test_short_queue_raises_production_and_long_queue_lowers_it():
    short, long = throttle(), throttle()
    for t, waiting in ((short, 0), (long, 30)):
        t.observe(demand(1, waiting=10))
        t.note_made(t.allowance())
        t.observe(demand(2, waiting=waiting))
    assert short.allowance() > B > long.allowance()


def test_a_worker_keeps_taking_more_while_the_queue_stays_short():
    """The integral term: a faster worker (or one whose peers are gone) takes on more than 1/N."""
    t = throttle()
    t.observe(demand(1, waiting=10, workers=2))
    for v in range(2, 30):
        t.note_made(t.allowance())
        t.observe(demand(v, waiting=4, workers=2))  # always short of 10: the other worker does not deliver
    assert t.quota > 6  # from 4 (= 8 / 2) towards a whole step


def test_a_worker_that_falls_behind_is_forgiven_older_debt():
    t = throttle()
    t.observe(demand(1, waiting=10))
    t.observe(demand(40, waiting=10))  # 39 steps it did not make: it must not burst 39 x 8 groups
    assert t.allowance() <= t.quota + t.cohort + 1


def test_stalled_demand_grants_one_cohort_then_backs_off():
    clock = Clock()
    t = throttle(clock)
    t.observe(demand(1, waiting=10, step_s=0.5))
    t.note_made(t.allowance())
    assert t.allowance() == 0
    clock.t += 0.9  # less than 2 steps without a new demand: keep waiting
    assert t.allowance() == 0
    clock.t += 0.2
    assert t.allowance() == 4 and t.grants == 1
    t.note_made(4)
    clock.t += 1.1  # the next grant needs twice as long
    assert t.allowance() == 0
    clock.t += 1.0
    assert t.allowance() == 4 and t.grants == 2
    t.note_made(4)
    t.observe(demand(2, waiting=10, step_s=0.5))  # the trainer moved: back to normal pacing
    assert t.stall_after() == pytest.approx(1.0)


def test_near_the_end_of_the_step_budget_a_worker_makes_only_what_the_last_steps_can_take():
    """The default run's worker made ~1% of its groups for versions no step read (`steps_left`)."""
    far, near = throttle(), throttle()
    for t in (far, near):
        t.observe(demand(1, waiting=10, workers=2))
        t.note_made(t.allowance())
    far.observe(demand(2, waiting=6, workers=2, left=50))
    near.observe(demand(2, waiting=6, workers=2, left=1))  # one step of 8 left, 6 wait: 2 more, half each
    assert far.allowance() > 1 and near.allowance() == 1
    near.note_made(1)
    near.observe(demand(3, waiting=12, workers=2, left=0))  # the last step is taken: nothing more
    assert near.allowance() == 0 and "steps_left=0" in near.describe()


def test_after_the_last_step_the_first_stall_grant_waits_a_minute():
    """A finished trainer publishes nothing more: no cohort for it before a minute (a trainer resumed with a
    larger budget is fed then), where a trainer still stepping gets one after two of its steps."""
    clock = Clock()
    t = throttle(clock)
    t.observe(demand(1, waiting=10, step_s=0.5, left=0))
    t.note_made(t.allowance())
    clock.t += 59.0
    assert t.allowance() == 0
    clock.t += 1.5
    assert t.allowance() == 4 and t.grants == 1


def test_demand_poll_follows_the_trainers_step_time():
    t = throttle()
    assert t.poll_interval(1.0) == 1.0  # nothing known yet: the run's poll interval
    t.observe(demand(1, waiting=10, step_s=0.8))
    assert t.poll_interval(1.0) == pytest.approx(0.1)
    t.observe(demand(2, waiting=10, step_s=60.0))
    assert t.poll_interval(1.0) == 1.0


def test_a_group_expires_only_once_its_version_has_left_the_trainers_window():
    t = throttle()
    assert not t.expired(0)  # no demand yet: nothing is known to be stale
    t.observe(demand(10, waiting=10, staleness=3))
    assert not t.expired(7) and t.expired(6)


# --- the trainer's demand ------------------------------------------------------------------------------


def _heartbeat(store, worker: str, age_s: float) -> None:
    hb = Heartbeat(worker_id=worker, updated_at=time.time())
    store.put(layout.worker_heartbeat(worker), encode_json(hb))
    path = store.local_path / layout.worker_heartbeat(worker)
    then = time.time() - age_s
    os.utime(path, (then, then))


def test_trainer_writes_its_demand_next_to_head_with_rate_and_live_workers(tmp_path):
    store = open_store(str(tmp_path / "run"))
    for name, age in (("a", 1.0), ("b", 5.0), ("gone", 300.0)):
        _heartbeat(store, name, age)
    clock = Clock()
    pub = DemandPublisher(store, groups_per_step=B, max_staleness=3, clock=clock)
    pub.after_publish(1, waiting=12)
    clock.t += 0.5
    pub.after_publish(2, waiting=9, steps_left=198)
    d = decode_json(store.get(layout.WEIGHTS_DEMAND), Demand)
    assert (d.version, d.groups_per_step, d.max_staleness, d.waiting, d.steps_left) == (2, B, 3, 9, 198)
    assert d.workers == 2  # "gone" wrote its heartbeat 300 s before the newest one
    assert d.step_s == pytest.approx(0.5)


def test_a_failed_demand_write_is_logged_not_fatal(tmp_path, caplog):
    store = FaultyStore(
        open_store(str(tmp_path / "run")), retry=RetryPolicy(deadline_s=0.05, base_s=0.01, cap_s=0.01)
    )
    store.fail_when(lambda op, key: op == "put" and key == layout.WEIGHTS_DEMAND)
    pub = DemandPublisher(store, groups_per_step=B, max_staleness=3)
    d = pub.after_publish(1, waiting=3)
    assert d.version == 1 and "demand not written" in caplog.text
    assert not store.exists(layout.WEIGHTS_DEMAND)


# --- the run's account -------------------------------------------------------------------------------


def test_supply_report_counts_generated_uploaded_and_consumed_groups(tmp_path):
    from pnyx.train.checkpoint import write_batch_record, write_metrics

    store = open_store(str(tmp_path / "run"))
    keys = [layout.rollout_key(0, "w1", i) for i in range(10)]
    for k in keys:
        store.put(k, b"group", mode="create")
    for i in range(10, 13):  # three of the five zero-variance groups announced as skip records (seeded)
        store.put(layout.rollout_key(0, "w1", i, skip=True), b"skip", mode="create")
    hb = Heartbeat(worker_id="w1", updated_at=time.time(), groups=10, groups_skipped_zero_variance=5)
    store.put(layout.worker_heartbeat("w1"), encode_json(hb))
    write_batch_record(store, 1, keys[:4], "t")
    write_batch_record(store, 2, keys[4:8], "t")
    write_metrics(store, 1, {"version": 1, "groups": 4, "drops": {}})
    write_metrics(store, 2, {"version": 2, "groups": 4, "drops": {"stale": 1}})
    r = supply_report(store)
    # a skip record is a zero-variance group the heartbeat counts already: counted once
    assert (r["generated"], r["uploaded"], r["skipped_zero_variance"], r["consumed"]) == (15, 10, 5, 8)
    assert r["skip_records"] == 3
    assert r["consumed_of_uploaded"] == 0.8 and r["consumed_of_generated"] == pytest.approx(8 / 15, abs=1e-4)
    assert r["dropped"] == {"stale": 1}
    json.dumps(r)  # goes into summary.json as is
