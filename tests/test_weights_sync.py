"""Publisher and Syncer against every store backend: cold join, warm follow, fail-closed on corruption
and missing objects, re-anchoring, fencing, HEAD as a hint, dtype and shape changes, background prefetch."""

from __future__ import annotations

import time

import pytest
import torch

from pnyx.errors import FencedError, IntegrityError, NotFoundError
from pnyx.protocol import layout
from pnyx.store import open_store
from pnyx.weights import Publisher, Syncer, latest_version, read_manifest
from pnyx.weights.bits import from_torch, state_digest

torch.set_num_threads(1)


class Trainer:
    """fp32 master weights nudged like a small Adam step; publishes the bf16 cast."""

    def __init__(self, seed: int = 0, extra: dict | None = None, noise: float = 3e-4):
        g = torch.Generator().manual_seed(seed)
        self.noise = noise
        self.g = g
        self.w = {
            "emb": torch.randn(96, 64, generator=g) * 0.02,
            "proj": torch.randn(64, 64, generator=g) * 0.02,
            "norm": torch.ones(64),
        }
        self.extra = extra or {}

    def step(self) -> dict[str, torch.Tensor]:
        for t in self.w.values():
            t += self.noise * torch.randn(t.shape, generator=self.g)
        return self.bf16()

    def bf16(self) -> dict[str, torch.Tensor]:
        return {**{k: v.to(torch.bfloat16) for k, v in self.w.items()}, **self.extra}


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return state_digest(from_torch(a)) == state_digest(from_torch(b))


def publish_run(
    store, n: int, anchor_every: int = 4, **kw
) -> tuple[Publisher, list[dict[str, torch.Tensor]]]:
    pub = Publisher(store, anchor_every=anchor_every, **kw)
    tr = Trainer()
    states = []
    for v in range(n):
        s = tr.step()
        pub.publish(v, s)
        states.append(s)
    return pub, states


def flip(store, key: str, pos: int) -> bytes:
    data = store.get(key)
    bad = bytearray(data)
    bad[pos % len(bad)] ^= 0x01
    store.put(key, bytes(bad))
    return data


def test_cold_joiner_and_warm_follower_end_with_identical_digests(store_url):
    store = open_store(store_url)
    pub = Publisher(store, anchor_every=3)
    tr = Trainer()
    warm = Syncer(store, backoff_s=0)
    for v in range(7):
        s = tr.step()
        pub.publish(v, s)
        wv, wt = warm.sync()
        assert wv == v and same_bits(wt, s)
    cold = Syncer(store, backoff_s=0)
    cv, ct = cold.sync()
    assert cv == 6 and cold.digest == warm.digest == pub._digest
    assert cold.last_route.kind == "cold" and warm.last_route.kind == "warm"
    assert same_bits(ct, tr.bf16())


def test_warm_follower_never_downloads_an_anchor(tmp_path):
    store = open_store(str(tmp_path / "s"))
    pub, states = publish_run(store, 2, anchor_every=2)
    syn = Syncer(store, backoff_s=0)
    syn.sync()
    pub.publish(2, Trainer(seed=1).step())  # an anchor version (2 - 0 >= 2)
    syn.sync()
    assert syn.last_route.kind == "warm" and read_manifest(store, 2).kind == "anchor"


@pytest.mark.parametrize("where", ["manifest", "delta", "anchor"])
def test_flipped_byte_anywhere_is_detected_and_keeps_served_weights(tmp_path, where):
    store = open_store(str(tmp_path / "s"))
    pub, states = publish_run(store, 3, anchor_every=10)  # v0 anchor, v1 and v2 deltas
    keys = {
        "manifest": [layout.weights_manifest(2)],
        "delta": [layout.weights_payload(2, o.name) for o in read_manifest(store, 2).weights.delta],
        "anchor": [layout.weights_payload(0, o.name) for o in read_manifest(store, 0).weights.anchor],
    }[where]
    for key in keys:
        size = len(store.get(key))
        for pos in (0, 7, size // 3, size // 2, size - 1):
            good = flip(store, key, pos)
            warm = Syncer(store, backoff_s=0)
            store.put(key, good)
            warm.sync(to_version=1)
            flip(store, key, pos)
            before = warm.digest
            if where == "anchor":  # off the warm route: the follower is unaffected
                assert same_bits(warm.sync(to_version=2)[1], states[2])
            else:
                with pytest.raises(IntegrityError):
                    warm.sync(to_version=2)
                assert warm.version == 1 and warm.digest == before and same_bits(warm.tensors, states[1])
            cold = Syncer(store, backoff_s=0)
            with pytest.raises(IntegrityError):
                cold.sync(to_version=2)
            assert cold.version is None
            store.put(key, good)
    assert same_bits(Syncer(store).sync()[1], states[2])


def test_cold_joiner_detects_a_flipped_anchor_byte(tmp_path):
    store = open_store(str(tmp_path / "s"))
    publish_run(store, 2)
    (obj,) = read_manifest(store, 0).weights.anchor
    flip(store, layout.weights_payload(0, obj.name), 1000)
    syn = Syncer(store, backoff_s=0)
    with pytest.raises(IntegrityError, match="digest"):
        syn.sync()
    assert syn.version is None and syn.tensors == {}


def test_missing_delta_triggers_reanchor(store_url):
    store = open_store(store_url)
    pub, tr = Publisher(store, anchor_every=3), Trainer()
    syn = Syncer(store, backoff_s=0, retries=1)
    for v in range(4):  # v0 anchor, v1 and v2 deltas, v3 anchor (+ delta from v2)
        pub.publish(v, tr.step())
        if v == 1:
            syn.sync()
    for o in read_manifest(store, 2).weights.delta:
        store.delete(layout.weights_payload(2, o.name))
    v, t = syn.sync()
    assert v == 3 and syn.last_route.kind == "cold" and same_bits(t, tr.bf16())
    assert len(syn.failures) == 2 and all("from v1" in f for f in syn.failures)
    assert syn.digest == read_manifest(store, 3).digest


def test_missing_delta_with_no_newer_anchor_keeps_the_served_version(tmp_path):
    store = open_store(str(tmp_path / "s"))
    pub, states = publish_run(store, 4, anchor_every=10)
    syn = Syncer(store, backoff_s=0)
    syn.sync(to_version=1)
    for o in read_manifest(store, 2).weights.delta:
        store.delete(layout.weights_payload(2, o.name))
    with pytest.raises(IntegrityError, match="kept v1"):
        syn.sync()
    assert syn.version == 1 and same_bits(syn.tensors, states[1])


def test_parent_digest_mismatch_reanchors(tmp_path):
    a, b = open_store(str(tmp_path / "a")), open_store(str(tmp_path / "b"))
    publish_run(a, 2, anchor_every=2)
    pub_b = Publisher(b, anchor_every=2)
    tr = Trainer(seed=9)
    for v in range(4):
        pub_b.publish(v, tr.step())
    syn = Syncer(a, backoff_s=0)
    syn.sync(to_version=1)  # v1 of run a
    syn.store = b  # the same version numbers, other history
    v, t = syn.sync()
    assert v == 3 and syn.last_route.kind == "cold" and same_bits(t, tr.bf16())


def test_second_publisher_of_a_version_is_fenced(store_url):
    store = open_store(store_url)
    a, b = Publisher(store), Publisher(store)
    a.publish(0, Trainer(0).bf16())
    with pytest.raises(FencedError):
        b.publish(0, Trainer(1).bf16())
    b.publish(1, Trainer(1).step())  # b takes over the run (like a restarted trainer)
    with pytest.raises(FencedError):
        a.publish(2, Trainer(0).step())  # a learns it no longer owns the run
    assert read_manifest(store, 1).publisher == b.nonce and latest_version(store) == 1


class RacingStore:
    """Wraps a real store; runs `hook` once, just before the first payload put, to lose a race."""

    def __init__(self, inner, hook):
        self.inner, self.hook, self.fired = inner, hook, False

    def put(self, key, data, mode="overwrite"):
        if not self.fired and "/manifest.json" not in key and key != layout.WEIGHTS_HEAD:
            self.fired = True
            self.hook()
        return self.inner.put(key, data, mode)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_racing_loser_is_fenced_and_cannot_touch_the_winners_payload(store_url):
    store = open_store(store_url)
    winner = Publisher(store)
    win_state = Trainer(0).bf16()
    loser = Publisher(RacingStore(store, lambda: winner.publish(0, win_state)))
    with pytest.raises(FencedError):
        loser.publish(0, Trainer(1).bf16())
    v, t = Syncer(store, backoff_s=0).sync()
    assert v == 0 and same_bits(t, win_state)


def test_restarted_publisher_chains_an_anchor_onto_the_newest_version(tmp_path):
    store = open_store(str(tmp_path / "s"))
    publish_run(store, 3)
    syn = Syncer(store, backoff_s=0)
    syn.sync()
    again = Publisher(store)
    s = Trainer(4).bf16()
    m = again.publish(3, s)
    assert m.kind == "anchor" and m.parent_version == 2 and m.weights.parent_digest == syn.digest
    assert same_bits(syn.sync()[1], s)


def test_head_is_only_a_hint(tmp_path):
    store = open_store(str(tmp_path / "s"))
    publish_run(store, 3)
    store.put(layout.WEIGHTS_HEAD, b'{"version": 0, "digest": "x"}')  # lags
    assert latest_version(store) == 2
    store.put(layout.WEIGHTS_HEAD, b'{"version": 9, "digest": "x"}')  # leads a missing version
    assert latest_version(store) == 2
    store.put(layout.WEIGHTS_HEAD, b"garbage")
    assert Syncer(store).sync()[0] == 2


def test_nothing_published_is_not_found(tmp_path):
    with pytest.raises(NotFoundError):
        Syncer(open_store(str(tmp_path / "s"))).sync()


def test_other_dtypes_and_tensors_that_appear_vanish_or_reshape(store_url):
    store = open_store(store_url)
    pub = Publisher(store, anchor_every=50)
    syn = Syncer(store, backoff_s=0)
    s0 = {
        "h": torch.randn(8, 8, dtype=torch.float16),
        "f": torch.randn(5),
        "step": torch.tensor(3),
        "mask": torch.tensor([True, False]),
        "gone": torch.randn(3).to(torch.bfloat16),
    }
    s1 = {
        "h": s0["h"] + 1e-3,
        "f": torch.tensor([float("nan"), float("-inf"), -0.0, 1.0, 2.0]),
        "step": torch.tensor(4),
        "mask": torch.tensor([[True], [True]]),
        "born": torch.zeros(2, 2),
    }
    for v, s in enumerate([s0, s1]):
        pub.publish(v, s)
        got = syn.sync()[1]
        assert same_bits(got, s) and all(got[k].dtype == s[k].dtype for k in s)
    assert syn.last_route.kind == "warm"


def test_published_tensors_load_with_strict_state_dict(tmp_path):
    store = open_store(str(tmp_path / "s"))
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).to(torch.bfloat16)
    Publisher(store).publish(0, model.state_dict())
    other = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).to(torch.bfloat16)
    other.load_state_dict(Syncer(store).sync()[1], strict=True)
    assert same_bits(other.state_dict(), model.state_dict())


def test_background_prefetch_stages_and_swaps_without_waiting(tmp_path):
    store = open_store(str(tmp_path / "s"))
    pub = Publisher(store, anchor_every=4)
    tr = Trainer()
    pub.publish(0, tr.step())
    syn = Syncer(store, backoff_s=0, poll_interval_s=0.02)
    syn.sync()
    syn.start()
    try:
        assert syn.swap() is None
        s1 = tr.step()
        pub.publish(1, s1)
        deadline = time.monotonic() + 20
        got = None
        while got is None and time.monotonic() < deadline:
            got = syn.swap()
            time.sleep(0.01)
        assert got is not None and got[0] == 1 and same_bits(got[1], s1)
    finally:
        syn.stop()


def test_a_pinned_version_is_the_one_the_next_swap_installs_whatever_is_staged_after_it(tmp_path):
    """`Syncer.pin` (a worker committing a cohort ahead names the version it will draw at): the next swap
    installs exactly the pinned state though a newer one was staged since; pinned with nothing newer
    staged, the next swap installs nothing; after that swap the newest staged one is installed again."""
    store = open_store(str(tmp_path / "s"))
    pub, states = publish_run(store, 1)
    tr = Trainer()
    syn = Syncer(store, backoff_s=0)
    syn.sync()
    assert syn.pin() is None  # nothing newer staged
    s1 = tr.step()
    pub.publish(1, s1)
    assert syn.prefetch_once() == 1
    assert syn.swap() is None and syn.version == 0  # pinned before v1 was staged: stays on v0
    assert syn.pin() == 1
    s2 = tr.step()
    pub.publish(2, s2)
    assert syn.prefetch_once() == 2  # v2 staged on top of the pinned v1
    assert syn.staged is not None and syn.staged[0] == 2  # what the heartbeat reports as fetched, not loaded
    got = syn.swap()
    assert got is not None and got[0] == 1 and same_bits(got[1], s1) and syn.version == 1
    assert syn.staged is not None and syn.staged[0] == 2
    got = syn.swap()  # no pin: the newest staged
    assert got is not None and got[0] == 2 and same_bits(got[1], s2)
    assert syn.staged is None and syn.swap() is None


class BrokenListing:
    def __init__(self, inner):
        self.inner = inner

    def list(self, *a, **k):
        raise RuntimeError("bug in the listing")

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_prefetch_thread_bug_is_reraised_in_the_caller(tmp_path):
    syn = Syncer(BrokenListing(open_store(str(tmp_path / "s"))), poll_interval_s=0.01)
    syn.start()
    try:
        deadline = time.monotonic() + 10
        while syn._fatal is None and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(RuntimeError, match="bug in the listing"):
            syn.swap()
    finally:
        syn.stop()


def test_prefetch_reports_integrity_failures_and_keeps_serving(tmp_path):
    store = open_store(str(tmp_path / "s"))
    pub, states = publish_run(store, 2, anchor_every=10)
    syn = Syncer(store, backoff_s=0, retries=0, poll_interval_s=0.01)
    syn.sync(to_version=1)
    pub.publish(2, Trainer(3).step())
    (o,) = read_manifest(store, 2).weights.delta
    flip(store, layout.weights_payload(2, o.name), 10)
    syn.start()
    try:
        deadline = time.monotonic() + 10
        while syn.last_error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert syn.last_error is not None and "v2" in syn.last_error
        assert syn.swap() is None and syn.version == 1
    finally:
        syn.stop()


def test_deltas_are_small_for_small_updates(tmp_path):
    store = open_store(str(tmp_path / "s"))
    pub, tr = Publisher(store, anchor_every=10), Trainer(noise=2e-6)
    for v in range(3):
        pub.publish(v, tr.step())
    st = pub.last_stats
    assert st.kind == "delta" and 0 < st.changed_fraction < 0.1
    assert st.delta_bytes < 0.05 * st.full_bytes
