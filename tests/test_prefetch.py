"""The prefetcher: the next step's groups are fetched and re-scored in the background while a step runs;
its errors reach the main loop; a stop request ends any wait for groups at once."""

from __future__ import annotations

import threading
import time

import pytest
from ingest_support import make_group, make_ingestor, put

from pnyx.store import RetryPolicy, open_store
from pnyx.train.prefetch import Prefetcher
from pnyx_harness.faults import FaultyStore


def wait_until(cond, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


@pytest.fixture
def store(tmp_path):
    return FaultyStore(open_store(str(tmp_path / "run")), retry=RetryPolicy(deadline_s=0.3, base_s=0.01))


def test_the_next_steps_groups_are_fetched_while_the_current_step_runs(store):
    for seq in range(20):
        put(store, make_group(0, f"w{seq % 4}", seq, task_index=seq))
    ing = make_ingestor(store)
    pre = Prefetcher(ing, need=4, list_interval_s=0.0)
    pre.start()
    try:
        first = ing.select(0, 4)
        pre.ahead(1, [g.key for g in first])  # step 0 -> 1 "trains" now; the prefetcher works on step 1
        in_flight = [g.key for g in first]
        wait_until(lambda: (p := ing.plan(1, 4, in_flight)).unlisted is None and not p.unknown)
        ing.commit([g.key for g in first])
        gets = store.calls["get"]
        second = ing.select(1, 4)
        assert len(second) == 4 and store.calls["get"] == gets  # all four were already fetched
        assert not {g.key for g in first} & {g.key for g in second}
    finally:
        pre.close()
        ing.close()


def test_a_failure_in_the_prefetch_thread_is_raised_in_the_main_loop(store):
    put(store, make_group(0, "w", 0))
    ing = make_ingestor(store)

    def broken(data, vocab_size):
        raise RuntimeError("decoder bug")

    ing.admission.decode = broken
    pre = Prefetcher(ing, need=1, list_interval_s=0.0)
    pre.start()
    try:
        pre.ahead(0)
        wait_until(lambda: pre.error is not None)
        with pytest.raises(RuntimeError, match="decoder bug"):
            pre.check()
    finally:
        pre.close()
        ing.close()


def test_an_unavailable_store_is_retried_by_the_prefetcher_not_fatal(store):
    put(store, make_group(0, "w", 0))
    ing = make_ingestor(store)
    store.fail_when(lambda op, key: op in ("list", "get"))
    pre = Prefetcher(ing, need=1, list_interval_s=0.0)
    pre.start()
    try:
        pre.ahead(0)
        wait_until(lambda: store.injected >= 3)
        store.clear()
        pre.poke()
        wait_until(lambda: ing.available(0) == 1)
        pre.check()  # nothing to re-raise
    finally:
        pre.close()
        ing.close()


def test_a_stop_request_ends_a_selection_that_waits_on_slow_fetches(store):
    for seq in range(8):
        put(store, make_group(0, "w", seq, task_index=seq))
    ing = make_ingestor(store)
    ing.refresh(0)
    store.set_latency(5.0)  # every record takes 5 s to arrive
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    t0 = time.monotonic()
    assert ing.select(0, 4, stop=stop.is_set) is None
    assert time.monotonic() - t0 < 2.0
    ing.close()


def test_work_while_the_batch_is_short_and_a_check_before_it_is_taken(store):
    """`idle` runs while the batch is short (each call that did work reads the ranking again at once), and
    `ready` before a full batch is taken: False (its check changed what may be chosen) reads the ranking
    again, True takes it."""
    for seq in range(2):
        put(store, make_group(0, "w", seq, task_index=seq))
    ing = make_ingestor(store)
    pre = Prefetcher(ing, need=4, list_interval_s=0.0)
    pre.start()
    idle_calls, ready_calls = [], []

    def idle(chosen: list) -> bool:
        idle_calls.append(len(chosen))  # the groups of the batch so far
        if len(idle_calls) == 3:  # the rest of the batch lands while the trainer works
            for seq in range(2, 6):
                put(store, make_group(0, "w", seq, task_index=seq))
        return len(idle_calls) <= 3

    def ready() -> bool:
        ready_calls.append(True)
        return len(ready_calls) > 1

    try:
        pre.ahead(0)
        chosen = pre.next_batch(0, 4, stop=lambda: False, deadline_s=10.0, idle=idle, ready=ready)
        assert chosen is not None and len(chosen) == 4
        assert len(idle_calls) >= 3 and max(idle_calls) < 4  # never called with a full batch at hand
        assert len(ready_calls) == 2  # the first said the ranking changed; the second took it
    finally:
        pre.close()
        ing.close()
