"""A worker under committed draws commits its next cohort before it draws the current one
(`security.commit_ahead`, `pnyx.rollout.worker`): in process, a real store (a local folder), the trainer's
`init_run`, the real publisher, syncer, engine and ticker (`pnyx.train.ticker.Ticker`, in a thread, as the
trainer runs it). What must hold: the commitment of cohort k+1 is in the store while cohort k generates; it
names the version the next swap installs and the worker draws it at exactly that version, even when a newer
one was staged meanwhile; every group matches the commitment its tick included; and a stop draws the cohort
committed ahead before the worker leaves, so no committed seq is left undrawn."""

from __future__ import annotations

import pytest
from worker_support import make_run, on_generate, rollout_groups

from pnyx.protocol import commits, layout
from pnyx.rollout.worker import Worker, WorkerOptions
from pnyx.train.ticker import Ticker

COMMITTED = {"committed_draws": True}


@pytest.fixture(autouse=True)
def _one_thread():
    import torch

    torch.set_num_threads(1)


def _ticking(run):
    """The trainer's ticker on `run`'s store, started (close it)."""
    signer = run.publisher.signer
    ticker = Ticker(run.store, signer, signer.run_id, 0.01, lambda: 2, max_staleness=4)
    ticker.start()
    return ticker


def _commitments(store, worker_id: str) -> list[tuple[int, int, list[str]]]:
    """(first seq, version, tasks) of every commitment `worker_id` wrote (once per seq range: a commitment
    written again for a later tick is the same one), by first seq."""
    from pnyx.protocol import decode_json
    from pnyx.protocol.records import RunManifest

    run_id = decode_json(store.get(layout.RUN_MANIFEST), RunManifest).run_id
    out = {}
    for m in store.list(layout.COMMITS_PREFIX):
        _, c = commits.decode_commitment(store.get(m.key), run_id)
        if c.worker_id == worker_id:
            out[c.first_seq] = (c.first_seq, c.version, list(c.tasks))
    return sorted(out.values())


def _check_against_ticks(run, ticker, groups) -> None:
    for _, g in groups:
        inc = ticker.get(g.tick).included[g.commit]
        assert inc.worker_id == g.worker_id and inc.version == g.policy_version, (g.seq, inc)
        assert inc.tasks[g.seq - inc.first_seq] == g.task_id


def test_the_next_cohort_is_committed_before_the_current_one_draws_at_the_version_it_named(
    tmp_path, tiny_model_dir
):
    run = make_run(str(tmp_path / "run"), tiny_model_dir, security=COMMITTED, supply_control=False)
    ticker = _ticking(run)
    worker = Worker(run.store, WorkerOptions(worker_id="w1", max_groups=6))
    worker.join()
    seen: list[list[tuple[int, int, list[str]]]] = []

    def during(call: int) -> None:
        seen.append(_commitments(run.store, "w1"))
        if call < 2:  # a newer version is staged while each of the first two cohorts generates
            run.publish(call + 1)
            assert worker.link.syncer.prefetch_once() == call + 1

    on_generate(worker, during)
    try:
        worker.run()
    finally:
        ticker.close()

    # while cohort k generated, cohort k+1 (2 tasks each) was committed already, but not after the quota
    assert [[c[0] for c in s] for s in seen] == [[0, 2], [0, 2, 4], [0, 2, 4]], seen
    groups = sorted(rollout_groups(run.store), key=lambda kg: kg[1].seq)
    assert [g.seq for _, g in groups] == [0, 1, 2, 3, 4, 5]
    # cohort 2 was committed at v0 before v1 was staged: drawn at v0. Cohort 3 was committed at v1, the
    # version staged when it was committed, and drawn at v1 though v2 was staged by then.
    assert [g.policy_version for _, g in groups] == [0, 0, 0, 0, 1, 1]
    assert all(g.weights_digest == run.digests[g.policy_version] for _, g in groups)
    _check_against_ticks(run, ticker, groups)


def test_a_stop_draws_the_cohort_committed_ahead_before_leaving(tmp_path, tiny_model_dir):
    run = make_run(str(tmp_path / "run"), tiny_model_dir, security=COMMITTED, supply_control=False)
    ticker = _ticking(run)
    worker = Worker(run.store, WorkerOptions(worker_id="w1"))
    worker.join()
    on_generate(worker, lambda call: worker.request_stop("test") if call == 0 else None)
    try:
        summary = worker.run()
    finally:
        ticker.close()
    committed = _commitments(run.store, "w1")
    assert [c[0] for c in committed] == [0, 2]  # the cohort drawn at the stop and the one committed ahead
    groups = sorted(rollout_groups(run.store), key=lambda kg: kg[1].seq)
    assert [g.seq for _, g in groups] == [0, 1, 2, 3] and summary.groups_uploaded == 4  # nothing undrawn
    _check_against_ticks(run, ticker, groups)


def test_without_commit_ahead_each_cohort_is_committed_when_it_starts(tmp_path, tiny_model_dir):
    security = COMMITTED | {"commit_ahead": False}
    run = make_run(str(tmp_path / "run"), tiny_model_dir, security=security, supply_control=False)
    ticker = _ticking(run)
    worker = Worker(run.store, WorkerOptions(worker_id="w1", max_groups=4))
    worker.join()
    seen: list[list[int]] = []
    on_generate(worker, lambda call: seen.append([c[0] for c in _commitments(run.store, "w1")]))
    try:
        worker.run()
    finally:
        ticker.close()
    assert seen == [[0], [0, 2]]
    groups = rollout_groups(run.store)
    assert sorted(g.seq for _, g in groups) == [0, 1, 2, 3]
    _check_against_ticks(run, ticker, groups)


def test_a_long_cohort_commits_the_next_one_late_at_the_version_staged_meanwhile(tmp_path, tiny_model_dir):
    """The commitment of cohort k+1 is written `AHEAD_MARGIN_S` before cohort k should end (by the recent
    cohorts' length), not when it starts: a version staged early in cohort k is the one k+1 is drawn at."""
    import time

    from pnyx.rollout.worker import AHEAD_MARGIN_S

    run = make_run(str(tmp_path / "run"), tiny_model_dir, security=COMMITTED, supply_control=False)
    ticker = _ticking(run)
    worker = Worker(run.store, WorkerOptions(worker_id="w1", max_groups=6))
    worker.join()
    long_s = AHEAD_MARGIN_S + 0.7
    seen: dict[str, list] = {}

    def during(call: int) -> None:
        if call == 1:  # v1 staged as cohort 2 starts; cohort 3's commitment is not written yet
            run.publish(1)
            assert worker.link.syncer.prefetch_once() == 1
            seen["start"] = _commitments(run.store, "w1")
        time.sleep(long_s)  # every cohort takes this long: slow hardware
        if call == 1:
            seen["end"] = _commitments(run.store, "w1")

    on_generate(worker, during)
    try:
        worker.run()
    finally:
        ticker.close()
    assert [c[0] for c in seen["start"]] == [0, 2], seen
    # cohort 3's commitment was written during cohort 2, at v1
    assert [(c[0], c[1]) for c in seen["end"]] == [(0, 0), (2, 0), (4, 1)], seen
    groups = sorted(rollout_groups(run.store), key=lambda kg: kg[1].seq)
    assert [g.policy_version for _, g in groups] == [0, 0, 0, 0, 1, 1]
    _check_against_ticks(run, ticker, groups)


def test_a_deferred_call_runs_once_on_its_timer_or_where_it_is_taken():
    import threading
    import time

    from pnyx.rollout.deferred import Deferred

    ran: list[str] = []
    fired = Deferred(lambda: ran.append(threading.current_thread().name) or 1, 0.05)
    time.sleep(0.3)
    assert fired.take() == 1 and len(ran) == 1 and ran[0] != threading.current_thread().name  # on its timer
    ran.clear()
    early = Deferred(lambda: ran.append(threading.current_thread().name) or 2, 30.0)
    assert early.take() == 2 and ran == [threading.current_thread().name]  # taken first: run here, once
    assert early.take() == 2 and len(ran) == 1

    def boom() -> None:
        raise RuntimeError("store down")

    with pytest.raises(RuntimeError, match="store down"):
        Deferred(boom, 30.0).take()
    cancelled = Deferred(lambda: ran.append("late"), 0.05)
    cancelled.cancel()
    time.sleep(0.2)
    assert "late" not in ran


def test_a_stop_during_the_wait_for_a_tick_draws_the_cohort_at_its_version_though_a_newer_one_was_staged(
    tmp_path, tiny_model_dir
):
    """A stop that interrupts a cohort's wait for its tick (after the boundary's swap) leaves the cohort to
    `_drain`, which draws it at the version it committed to: the newer version staged meanwhile is not
    swapped in (it was, and the worker died with "a cohort committed ahead at v1, the engine holds v2":
    tests/test_fleet_s3.py, 2026-12-05)."""
    import threading
    import time

    run = make_run(str(tmp_path / "run"), tiny_model_dir, security=COMMITTED, supply_control=False)
    worker = Worker(run.store, WorkerOptions(worker_id="w1", max_groups=4))
    worker.join()
    failed: list[BaseException] = []

    def running() -> None:
        try:
            worker.run()
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            failed.append(e)

    thread = threading.Thread(target=running)
    thread.start()
    ticker = None
    try:
        deadline = time.monotonic() + 60
        while not _commitments(run.store, "w1") and time.monotonic() < deadline:  # no ticker: it waits
            time.sleep(0.05)
        assert _commitments(run.store, "w1") == [(0, 0, _commitments(run.store, "w1")[0][2])]
        run.publish(1)
        while worker.link.syncer.staged is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.link.syncer.staged is not None and worker.link.syncer.staged[0] == 1
        worker.request_stop("test: stop while waiting for a tick")
        ticker = _ticking(run)  # the tick comes within `_drain`'s wait
        thread.join(60)
    finally:
        if ticker is not None:
            ticker.close()
    assert not thread.is_alive() and not failed, failed
    groups = rollout_groups(run.store)
    assert groups and all(g.policy_version == 0 for _, g in groups), [g.policy_version for _, g in groups]
    _check_against_ticks(run, ticker, groups)
