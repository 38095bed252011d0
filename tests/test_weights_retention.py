"""Retention never breaks a reachable chain; the int8 actor plane; the `pnyx weights` CLI."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from pnyx.protocol import layout
from pnyx.store import open_store
from pnyx.weights import Publisher, Syncer, apply_retention, list_versions, plan_retention, read_manifest
from pnyx.weights import int8 as q8
from pnyx.weights.bits import from_torch, state_digest

torch.set_num_threads(1)


def small_state(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"w": torch.randn(16, 128, generator=g) * 0.02, "b": torch.randn(16, generator=g) * 0.02}


def run_of(store, n: int, anchor_every: int, int8: bool = False, noise: float = 1e-3):
    g = torch.Generator().manual_seed(0)
    w = small_state(g)
    pub = Publisher(store, anchor_every=anchor_every, int8_plane=int8)
    for v in range(n):
        for t in w.values():
            t += noise * torch.randn(t.shape, generator=g)
        pub.publish(v, {k: t.to(torch.bfloat16) for k, t in w.items()})
    return pub, w


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 60),
    every=st.integers(1, 12),
    keep=st.integers(1, 4),
    window=st.integers(0, 30),
)
def test_plan_keeps_every_version_reachable_from_retained_anchors_and_the_window(n, every, keep, window):
    versions = [(v, v % every == 0) for v in range(n)]
    doomed = set(plan_retention(versions, keep, window))
    kept = [v for v, _ in versions if v not in doomed]
    head = n - 1
    anchors = [v for v, a in versions if a]
    retained_anchors = [a for a in anchors if a not in doomed]
    assert head in kept
    assert retained_anchors[-keep:] == anchors[-keep:]  # the newest `keep` anchors survive
    oldest = min(kept)
    assert kept == list(range(oldest, n))  # contiguous: every delta after a kept version survives
    assert oldest <= max(0, head - window)  # a follower within the window can still go warm


def test_apply_retention_leaves_a_chain_cold_joiners_and_warm_followers_can_use(store_url):
    store = open_store(store_url)
    pub, w = run_of(store, 5, anchor_every=2, noise=2e-5)  # anchors at 0, 2, 4
    follower = Syncer(store, backoff_s=0)
    follower.sync(to_version=3)
    g = torch.Generator().manual_seed(1)
    for v in range(5, 9):  # anchors at 6, 8
        for t in w.values():
            t += 2e-5 * torch.randn(t.shape, generator=g)
        pub.publish(v, {k: t.to(torch.bfloat16) for k, t in w.items()})
    deleted = apply_retention(store, keep_anchors=2, window=5)  # floor = min(6, 8 - 5) = 3
    assert list_versions(store) == [3, 4, 5, 6, 7, 8] and deleted
    assert follower.sync()[0] == 8 and follower.last_route.kind == "warm" and not follower.failures
    cold = Syncer(store, backoff_s=0)
    assert cold.sync()[0] == 8 and cold.digest == follower.digest


def test_retention_removes_a_fenced_losers_orphaned_payload(tmp_path):
    store = open_store(str(tmp_path / "s"))
    run_of(store, 3, anchor_every=10)
    orphan = layout.weights_payload(1, "delta-deadbeef-00000")
    store.put(orphan, b"loser bytes")
    apply_retention(store, keep_anchors=1, window=10)
    assert not store.exists(orphan) and Syncer(store).sync()[0] == 2


def test_int8_plane_dequantizes_close_to_the_weights_and_loads_into_a_model(tmp_path):
    store = open_store(str(tmp_path / "s"))
    model = torch.nn.Linear(128, 16)
    pub = Publisher(store, int8_plane=True)
    pub.publish(0, {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    worker = torch.nn.Linear(128, 16)
    v, tensors = Syncer(store, "int8").sync()
    worker.load_state_dict(tensors, strict=True)
    step = (model.weight.max() - model.weight.min()) / 255
    assert (worker.weight - model.weight).abs().max() <= step
    assert torch.equal(worker.bias, model.bias.to(torch.bfloat16).float())  # not quantizable: bits as is


def test_int8_grid_is_frozen_between_anchors_so_few_codes_change(tmp_path):
    store = open_store(str(tmp_path / "s"))
    pub, _ = run_of(store, 4, anchor_every=10, int8=True, noise=2e-5)
    syn = Syncer(store, "int8", backoff_s=0)
    syn.sync(to_version=2)
    before = dict(syn.state)
    syn.sync()
    after = syn.state
    assert np.array_equal(before["w@scale"].data, after["w@scale"].data)
    assert after["w@scale"] is before["w@scale"]  # untouched by the delta
    assert 0 < q8.code_change_fraction(before, after) < 0.05
    assert read_manifest(store, 3).int8.delta_bytes() < 0.1 * read_manifest(store, 0).int8.anchor_bytes()


def test_int8_cold_and_warm_agree(tmp_path):
    store = open_store(str(tmp_path / "s"))
    run_of(store, 6, anchor_every=3, int8=True)
    warm = Syncer(store, "int8", backoff_s=0)
    for v in range(6):
        warm.sync(to_version=v)
    cold = Syncer(store, "int8", backoff_s=0)
    cold.sync()
    assert cold.digest == warm.digest and state_digest(cold.state) == state_digest(warm.state)


def test_cli_inspect_and_verify_pass_on_a_good_chain_and_fail_on_a_corrupt_one(tmp_path):
    from pnyx.cli.weights import app

    url = str(tmp_path / "s")
    store = open_store(url)
    run_of(store, 4, anchor_every=2)
    runner = CliRunner()
    r = runner.invoke(app, ["inspect", "--store", url])
    assert r.exit_code == 0, r.output
    assert "anchor" in r.output and "linked" in r.output
    r = runner.invoke(app, ["verify", "--store", url])
    assert r.exit_code == 0 and "OK" in r.output, r.output
    (o,) = read_manifest(store, 3).weights.delta
    key = layout.weights_payload(3, o.name)
    data = bytearray(store.get(key))
    data[len(data) // 2] ^= 0x10
    store.put(key, bytes(data))
    r = runner.invoke(app, ["verify", "--store", url])
    assert r.exit_code == 1 and "PROBLEMS" in r.output, r.output


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_handles_every_float_dtype(dtype):
    t = {"w": (torch.randn(4, 64) * 0.1).to(dtype)}
    bits = from_torch(t)
    plane, grid = q8.quantize(bits, q8.make_grid(bits))
    back = q8.dequantize(plane)["w"]
    assert (
        np.abs(back - t["w"].float().numpy()).max() <= np.abs(t["w"].float().numpy()).max() * 2 / 255 + 1e-6
    )
