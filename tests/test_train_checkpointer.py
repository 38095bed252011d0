"""Sharded (DCP) checkpoints: exact round trips across rank counts, asynchronous writes, commit, retention.

A checkpoint exists only once COMMIT.json is written; what it holds must be bit-for-bit the model and
AdamW state at the moment `save` was called, whatever training does meanwhile, and it must load into any
number of ranks (DCP reshards).
"""

from __future__ import annotations

from pathlib import Path

import dist_support as ds
import pytest
import torch

from pnyx.errors import IntegrityError
from pnyx.store import open_store
from pnyx.train import checkpoint, checkpointer
from pnyx.train.checkpointer import Checkpointer
from pnyx.train.distributed import Dist

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from pnyx_harness.models import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-ckpt"))


def assert_same(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def trained(model_dir: Path, steps: int = 1):
    model, opt = ds.tiny_trainer_state(str(model_dir), Dist.single())
    for s in range(steps):
        ds.one_step(model, opt, seed=s)
    return model, opt


def test_async_checkpoint_holds_the_state_at_save_time_while_training_goes_on(tmp_path, model_dir):
    model, opt = trained(model_dir)
    store = open_store(str(tmp_path / "run"))
    ck = Checkpointer(store, Dist.single(), tmp_path / "local", asynchronous=True)
    at_save = ds.full_state(model, opt)
    ck.save(1, model, opt, '{"uses": {"a": 1}}', "run-x")
    ds.one_step(model, opt, seed=9)  # the next step runs while v1 is written
    ck.wait()
    fresh, fresh_opt = ds.tiny_trainer_state(str(model_dir), Dist.single())
    commit = Checkpointer(store, Dist.single(), tmp_path / "other").load(1, fresh, fresh_opt)
    assert_same(ds.full_state(fresh, fresh_opt), at_save)
    assert commit.cursor == '{"uses": {"a": 1}}' and commit.run_id == "run-x" and commit.world == 1


def test_synchronous_checkpoint_is_committed_when_save_returns(tmp_path, model_dir):
    model, opt = trained(model_dir)
    store = open_store(str(tmp_path / "run"))
    Checkpointer(store, Dist.single(), tmp_path / "local", asynchronous=False).save(3, model, opt, "{}", "r")
    assert checkpoint.checkpoint_versions(store) == [3]
    assert not (tmp_path / "local" / "ckpt-00000003").exists()  # local shards removed after upload


def test_only_committed_checkpoints_count_and_retention_keeps_the_newest(tmp_path, model_dir):
    model, opt = trained(model_dir)
    store = open_store(str(tmp_path / "run"))
    ck = Checkpointer(store, Dist.single(), tmp_path / "local", keep=2, asynchronous=False)
    ck.save(1, model, opt, "{}", "r")
    store.put("trainer/ckpt-00000002/r00000-000.p00000", b"half a checkpoint")  # killed before its commit
    store.put("trainer/ckpt-00000009/r00000-000.p00000", b"being written")  # newer than any commit
    assert checkpoint.checkpoint_versions(store) == [1]
    ck.save(3, model, opt, "{}", "r")
    ck.save(4, model, opt, "{}", "r")
    assert checkpoint.checkpoint_versions(store) == [3, 4]
    stored = {(s.version, s.committed) for s in checkpointer.list_checkpoints(store)}
    assert stored == {(3, True), (4, True), (9, False)}  # 1 pruned, the abandoned 2 deleted, 9 left alone


def test_a_corrupt_checkpoint_part_is_refused(tmp_path, model_dir):
    model, opt = trained(model_dir)
    store = open_store(str(tmp_path / "run"))
    ck = Checkpointer(store, Dist.single(), tmp_path / "local", asynchronous=False)
    ck.save(1, model, opt, "{}", "r")
    key = "trainer/ckpt-00000001/r00000-000.p00000"
    data = bytearray(store.get(key))
    data[len(data) // 2] ^= 0xFF
    store.put(key, bytes(data))
    with pytest.raises(IntegrityError, match="does not match its commit"):
        ck.load(1, *ds.tiny_trainer_state(str(model_dir), Dist.single()))


def test_only_sharded_checkpoint_folders_are_listed(tmp_path):
    """An old one-object `ckpt-V.pt` is not a checkpoint any more; a folder counts once it has its commit."""
    store = open_store(str(tmp_path / "run"))
    store.put("trainer/ckpt-00000001.pt", b"old", mode="overwrite")
    store.put("trainer/ckpt-00000002/r00000-000.p00000", b"part", mode="overwrite")
    store.put("trainer/ckpt-00000003/r00000-000.p00000", b"part", mode="overwrite")
    store.put(f"trainer/ckpt-00000003/{checkpointer.COMMIT}", b"{}", mode="overwrite")
    assert checkpointer.list_checkpoints(store) == [
        checkpointer.Stored(2, False),
        checkpointer.Stored(3, True),
    ]
    assert [s.version for s in checkpointer.committed(store)] == [3]


@pytest.mark.slow
def test_a_checkpoint_written_by_two_ranks_loads_exactly_on_two_ranks_and_on_one(tmp_path, model_dir):
    url = str(tmp_path / "run")
    ds.spawn(ds.checkpoint_ranks, 2, str(model_dir), url, str(tmp_path))
    got = torch.load(tmp_path / "dcp.pt", weights_only=False)
    assert got["world"] == 2 and got["cursor"] == '{"uses": {"k": 1}}'
    assert_same(got["loaded"], got["ref"])  # 2 ranks -> 2 ranks
    model, opt = ds.tiny_trainer_state(str(model_dir), Dist.single())
    Checkpointer(open_store(url), Dist.single(), tmp_path / "one").load(1, model, opt)
    assert_same(ds.full_state(model, opt), got["ref"])  # 2 ranks -> 1 rank
