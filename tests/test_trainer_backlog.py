"""The trainer's cost per step does not follow the backlog: with many more groups waiting than a step
uses, a step downloads about what it trains on, and the demand it writes after each publish counts the
waiting groups from what ingestion already listed (no LIST or GET of the whole window per step)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from train_support import make_trainer, overrides, write_groups

from pnyx.config import load_config, with_fields
from pnyx.protocol import Demand, decode_json, layout
from pnyx.store import open_store
from pnyx.train.loop import Trainer
from pnyx_harness.faults import FaultyStore

torch.set_num_threads(1)

BACKLOG = 40
STEPS = 2
GROUPS_PER_STEP = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from pnyx_harness.models import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-backlog"))


def test_a_large_backlog_is_neither_fetched_nor_relisted_after_each_publish(tmp_path, model_dir):
    url = str(tmp_path / "run")
    first = make_trainer(url, model_dir)
    first.start()  # run.json and v0
    write_groups(first.store, model_dir, 0, BACKLOG)
    cfg = load_config(None, overrides(model_dir, run__steps=STEPS, trainer__groups_per_step=GROUPS_PER_STEP))
    store = FaultyStore(open_store(url))
    calls: list[tuple[str, str]] = []

    def record(op: str, key: str) -> bool:
        calls.append((op, key))
        return False  # never fails: a recorder

    store.fail_when(record)
    t = Trainer(with_fields(cfg, {"store.url": url}), store, resume=True)
    t.start()
    calls.clear()
    assert t.run() == STEPS
    gets = [k for op, k in calls if op == "get" and layout.parse_rollout_key(k) is not None]
    lists = [k for op, k in calls if op == "list" and k.startswith(layout.ROLLOUTS_PREFIX)]
    # Each step reads about what it trains on (its batch, and the next one prefetched), never the backlog:
    # listing and fetching every waiting group after each publish read all 40.
    assert len(gets) <= 2 * GROUPS_PER_STEP * (STEPS + 1), len(gets)
    assert len(set(gets)) < BACKLOG // 2
    assert len(lists) <= 6 * STEPS, lists
    # ...and the demand still counts the whole backlog, from the listings it holds.
    demand = decode_json(open_store(url).get(layout.WEIGHTS_DEMAND), Demand)
    assert demand.version == STEPS
    assert demand.waiting == BACKLOG - STEPS * GROUPS_PER_STEP


def test_waiting_counts_listed_groups_without_reading_the_store(tmp_path):
    from ingest_support import make_group, make_ingestor, put

    store = FaultyStore(open_store(str(tmp_path / "run")))
    for seq in range(10):
        put(store, make_group(0, f"w{seq % 2}", seq, task_index=seq))
    for seq in range(10, 14):  # zero-variance: both answers wrong
        put(store, make_group(0, "w2", seq, task_index=seq, answers=["x", "y"]))
    ing = make_ingestor(store)
    try:
        ing.refresh(0, full=True)
        before = dict(store.calls)
        assert ing.waiting(0) == 14  # listed, none fetched: nothing known to drop yet
        assert dict(store.calls) == before
        fetched = ing.select(0, 14)
        assert fetched is not None and len(fetched) == 10
        assert ing.waiting(0) == 10  # the zero-variance ones were dropped when fetched
        put(store, make_group(0, "w3", 20, task_index=20))
        put(store, make_group(0, "w3", 21, task_index=21))
        ing.refresh(0)
        before = dict(store.calls)
        # two new keys, not fetched: counted at the recent survival rate, 10 of 14
        assert ing.waiting(0) == 10 + round(2 * 10 / 14)
        assert dict(store.calls) == before
    finally:
        ing.close()
