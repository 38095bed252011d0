"""The worker's upload spool: bounded, ordered, at-most-once uploads, collisions, on-disk restart copy."""

from __future__ import annotations

import pytest

from pnyx.errors import AlreadyExistsError, StorePermissionError
from pnyx.protocol import layout
from pnyx.rollout.spool import Spool
from pnyx.store import RetryPolicy, open_store
from pnyx_harness.faults import FaultyStore

FAST = RetryPolicy(deadline_s=0.05, base_s=0.01, cap_s=0.01)


def _key(seq: int, worker: str = "w1", version: int = 0) -> str:
    # a fixed stamp: the tests build the same key more than once
    return layout.rollout_key(version, worker, seq, stamp_ms=1_700_000_000_000 + seq)


def _store(tmp_path):
    return open_store(str(tmp_path / "run"))


def test_spool_uploads_in_order_and_empties(tmp_path):
    store = _store(tmp_path)
    spool = Spool(8)
    for i in range(3):
        spool.add(_key(i), b"g%d" % i)
    assert spool.flush(store) == 3
    assert len(spool) == 0 and [m.key for m in store.list("rollouts/")] == [_key(0), _key(1), _key(2)]
    assert store.get(_key(1)) == b"g1"


def test_spool_drops_oldest_beyond_its_bound(tmp_path):
    spool = Spool(2)
    for i in range(3):
        spool.add(_key(i), b"x")
    assert spool.pending_keys() == [_key(1), _key(2)] and spool.stats.dropped == 1


def test_spool_keeps_groups_while_store_is_down_and_uploads_them_after(tmp_path):
    store = FaultyStore(_store(tmp_path), retry=FAST)
    spool = Spool(8)
    spool.add(_key(0), b"a")
    spool.add(_key(1), b"b")
    store.fail_when(lambda op, key: op == "put")
    assert spool.flush(store) == 0
    assert len(spool) == 2 and spool.stats.failed_flushes == 1
    store.clear()
    assert spool.flush(store) == 2
    assert [store.get(_key(i)) for i in range(2)] == [b"a", b"b"]


def test_spool_counts_an_earlier_landed_put_of_its_own_bytes_as_uploaded(tmp_path):
    store = _store(tmp_path)
    store.put(_key(0), b"same", mode="create")  # e.g. a put that landed but whose reply was lost
    spool = Spool(4)
    spool.add(_key(0), b"same")
    assert spool.flush(store) == 1
    assert spool.stats.collisions == 0 and spool.stats.uploaded == 1


def test_spool_rekeys_a_collision_with_foreign_bytes(tmp_path):
    store = _store(tmp_path)
    store.put(_key(0), b"theirs", mode="create")  # a duplicate worker id got there first
    spool = Spool(4, rekey=lambda key, data: (_key(7), data))
    spool.add(_key(0), b"ours")
    assert spool.flush(store) == 1
    assert store.get(_key(0)) == b"theirs" and store.get(_key(7)) == b"ours"
    assert spool.stats.collisions == 1


def test_spool_without_rekey_refuses_to_overwrite_a_foreign_group(tmp_path):
    store = _store(tmp_path)
    store.put(_key(0), b"theirs", mode="create")
    spool = Spool(4)
    spool.add(_key(0), b"ours")
    with pytest.raises(AlreadyExistsError, match="unique --id"):
        spool.flush(store)
    assert store.get(_key(0)) == b"theirs"


def test_spool_on_disk_copy_is_uploaded_by_the_next_process(tmp_path):
    store = FaultyStore(_store(tmp_path), retry=FAST)
    store.fail_when(lambda op, key: op == "put")
    first = Spool(4, folder=tmp_path / "spool")
    first.add(_key(0), b"a")
    first.add(_key(1), b"b")
    first.flush(store)  # the store is down: both stay pending (and on disk)
    store.clear()
    second = Spool(4, folder=tmp_path / "spool")  # a restarted worker
    assert second.pending_keys() == [_key(0), _key(1)]
    assert second.flush(store) == 2 and store.get(_key(1)) == b"b"
    assert list((tmp_path / "spool").iterdir()) == []


def test_spool_permission_error_propagates_and_keeps_the_group(tmp_path):
    store = FaultyStore(_store(tmp_path), retry=FAST)
    store.fail_when(lambda op, key: op == "put", kind="permission")
    spool = Spool(4)
    spool.add(_key(0), b"a")
    with pytest.raises(StorePermissionError):
        spool.flush(store)
    assert spool.pending_keys() == [_key(0)]


def test_spool_refuses_a_key_that_is_not_a_rollout_key():
    with pytest.raises(ValueError, match="not a rollout key"):
        Spool(4).add("weights/HEAD", b"x")


def test_uploaded_plus_pending_never_misses_a_group_while_a_flush_moves_it(tmp_path):
    """`accounted()` is what `max_groups` counts against: read while the courier flushes, it never drops
    below the groups made (two separate reads of uploaded and pending once let a worker make one too many)."""
    import threading

    store = open_store(tmp_path / "s")
    spool = Spool(400, folder=tmp_path / "spool")
    for i in range(300):
        spool.add(layout.rollout_key(0, "w1", i), b"x" * 64)
    seen: list[int] = []
    flusher = threading.Thread(target=spool.flush, args=(store,))
    flusher.start()
    while flusher.is_alive():
        seen.append(spool.accounted())
    flusher.join()
    assert spool.stats.uploaded == 300 and len(spool) == 0
    assert seen and set(seen) == {300}
