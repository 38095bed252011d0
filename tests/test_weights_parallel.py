"""Parallel publishing: N ranks encode and upload their own windows and shards, one manifest commits them.

The contract: the same bits give the same payload objects and the same chain digests whether one process
publishes or N do (the cut of a version into objects depends on its layout only), no rank is given the
whole state, and a fenced or failing publish ends the same way on every rank, without a manifest.
"""

from __future__ import annotations

import json

import dist_support as ds
import pytest

from pnyx.store import open_store
from pnyx.weights import Syncer, read_manifest, verify_chain
from pnyx.weights.bits import from_torch
from pnyx.weights.parallel import PublishPlan, layout_of
from pnyx.weights.publisher import Publisher


def test_plan_gives_every_window_and_shard_to_exactly_one_rank_in_contiguous_runs():
    lay = layout_of(from_torch(ds.state(0)))
    for world in (1, 2, 3, 5):
        plan = PublishPlan(lay, world, chunk_bytes=8192, int8=True)
        for p in (plan.weights, plan.int8_plane):
            assert len(p.window_owner) == len(p.windows) and len(p.shard_owner) == len(p.shards)
            assert p.window_owner == sorted(p.window_owner) and p.shard_owner == sorted(p.shard_owner)
            assert set(p.window_owner) <= set(range(world))
        held = set().union(*(plan.needs(r) for r in range(world)))
        assert held == set(lay)
        if world > 1:
            assert all(plan.needs(r) != set(lay) for r in range(world))  # nobody holds everything


def test_plan_does_not_depend_on_the_number_of_ranks():
    lay = layout_of(from_torch(ds.state(0)))
    one, three = PublishPlan(lay, 1, chunk_bytes=8192), PublishPlan(lay, 3, chunk_bytes=8192)
    assert one.weights.windows == three.weights.windows and one.weights.shards == three.weights.shards


@pytest.mark.slow
def test_two_ranks_publish_the_objects_and_chain_one_process_publishes(tmp_path):
    solo_store = open_store(str(tmp_path / "solo"))
    solo = Publisher(solo_store, anchor_every=2, int8_plane=True, chunk_bytes=8192)
    for v in range(3):
        solo.publish(v, ds.state(v), force_anchor=v == 0)
    fenced = str(tmp_path / "fenced")
    Publisher(open_store(fenced)).publish(0, ds.state(0))  # someone else owns that run
    par = str(tmp_path / "par")

    ds.spawn(ds.publish_ranks, 2, par, fenced, str(tmp_path / "failing"), str(tmp_path))

    reports = [json.loads((tmp_path / f"publish-{r}.json").read_text()) for r in range(2)]
    store = open_store(par)
    for v in range(3):
        a, b = read_manifest(solo_store, v), read_manifest(store, v)
        assert (a.kind, a.weights.chain_digest, a.int8.chain_digest) == (
            b.kind,
            b.weights.chain_digest,
            b.int8.chain_digest,
        )
        assert [o.digest for o in a.weights.delta + a.weights.anchor] == [
            o.digest for o in b.weights.delta + b.weights.anchor
        ]
    assert read_manifest(store, 2).kind == "anchor" and read_manifest(store, 1).kind == "delta"
    version, tensors = Syncer(store).sync()
    assert version == 2 and all((tensors[k].view(-1) == t.view(-1)).all() for k, t in ds.state(2).items())
    assert verify_chain(store).ok
    assert all(len(r["needs"]) < len(ds.SHAPES) for r in reports)
    assert set(reports[0]["needs"]) | set(reports[1]["needs"]) == set(ds.SHAPES)
    assert all(r["fenced"] and "another trainer" in r["fenced"] for r in reports)
    assert [r["failure"] for r in reports] == ["PeerFailedError", "StoreUnavailableError"]
    assert not any(
        m.key.endswith("manifest.json") for m in open_store(str(tmp_path / "failing")).list("weights/")
    )
