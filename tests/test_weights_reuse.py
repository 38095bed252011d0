"""Decoding into recycled arrays: `DeltaApplier`'s `reuse` gives bit-exact states in the arrays it is handed,
never writes the base (even when a reuse array is the base), fills ranges no record covers, and the Syncer's
multi-step warm route (which recycles each intermediate state's arrays) never writes the served state.
`in_place` arrays (holding the base's values already) are patched in place, as each later step of a route
patches the route's own intermediate state."""

from __future__ import annotations

import numpy as np
import pytest

from pnyx.store import open_store
from pnyx.weights import Publisher, Syncer
from pnyx.weights.apply import apply_delta
from pnyx.weights.bits import BitState, TensorBits, unsigned_dtype
from pnyx.weights.codec import encode_delta, expected_of

GARBAGE = 0xAB  # fill byte of recycled arrays: whatever a retired state left behind


def rand_bits(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> TensorBits:
    u = unsigned_dtype(dtype)
    return TensorBits(dtype, rng.integers(0, np.iinfo(u).max, shape, dtype=u, endpoint=True))


def nudge(rng: np.random.Generator, tb: TensorBits, frac: float, max_step: int = 5) -> TensorBits:
    """A copy with small integer steps (both signs, wrapping) added to a random fraction of the bits."""
    flat = tb.data.reshape(-1).copy()
    n = max(1, int(round(frac * flat.size)))
    idx = rng.choice(flat.size, size=n, replace=False)
    steps = rng.integers(1, max_step + 1, n) * rng.choice([-1, 1], n)
    flat[idx] += steps.astype(flat.dtype)
    return TensorBits(tb.dtype, flat.reshape(tb.shape))


def garbage_like(state: BitState) -> dict[str, np.ndarray]:
    out = {}
    for name, tb in state.items():
        arr = np.empty_like(tb.data)
        arr.view(np.uint8).fill(GARBAGE)
        out[name] = arr
    return out


def snapshot(state: BitState) -> dict[str, np.ndarray]:
    return {name: tb.data.copy() for name, tb in state.items()}


def assert_bits_equal(got: BitState, want: BitState) -> None:
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype
        assert np.array_equal(got[name].data, want[name].data), name


@pytest.fixture
def step() -> tuple[BitState, BitState, list[bytes]]:
    """(old, new, chunks): several tensors and dtypes, several records per tensor, several chunks."""
    rng = np.random.default_rng(0)
    old = {f"w{i}": rand_bits(rng, "bfloat16", (300, 70)) for i in range(3)}
    old["f"] = rand_bits(rng, "float32", (1001,))
    new = {name: nudge(rng, tb, 0.03) for name, tb in old.items()}
    new["w2"] = old["w2"]  # untouched: no record, shared with the base
    chunks = list(encode_delta(old, new, segment_elems=5000, chunk_bytes=20000, threads=1))
    assert len(chunks) > 1
    return old, new, chunks


def test_decoding_into_garbage_filled_reuse_arrays_gives_the_exact_state_in_those_arrays(step):
    old, new, chunks = step
    reuse = garbage_like(new)
    out = apply_delta(old, chunks, expected_of(new), reuse=reuse)
    assert_bits_equal(out, new)
    for name in ("w0", "w1", "f"):  # every touched tensor was built in the array it was handed
        assert np.shares_memory(out[name].data, reuse[name]), name
    assert out["w2"] is old["w2"]  # untouched tensors stay shared with the base, not copied into reuse


def test_reuse_arrays_that_overlap_the_base_are_ignored_and_the_base_is_untouched(step):
    old, new, chunks = step
    before = snapshot(old)
    reuse = {name: tb.data for name, tb in old.items()}
    reuse["f"] = old["f"].data.view()  # a different array object over the same memory
    out = apply_delta(old, chunks, expected_of(new), reuse=reuse)
    assert_bits_equal(out, new)
    for name, tb in old.items():
        assert np.array_equal(tb.data, before[name]), f"base tensor {name} was written"


@pytest.mark.parametrize("unfit", ["wrong_shape", "wrong_width", "read_only", "not_contiguous"])
def test_reuse_arrays_that_do_not_fit_are_ignored(step, unfit):
    old, new, chunks = step
    shape = new["w0"].data.shape
    if unfit == "wrong_shape":
        arr = np.zeros(shape[::-1], np.uint16)
    elif unfit == "wrong_width":
        arr = np.zeros(shape, np.uint32)
    elif unfit == "read_only":
        arr = np.zeros(shape, np.uint16)
        arr.flags.writeable = False
    else:
        arr = np.zeros((shape[0], 2 * shape[1]), np.uint16)[:, ::2]
    out = apply_delta(old, chunks, expected_of(new), reuse={"w0": arr})
    assert_bits_equal(out, new)
    assert not np.shares_memory(out["w0"].data, arr)


def test_segments_without_change_come_out_right_in_reused_arrays():
    """Only the middle segment of a tensor changes: the ranges before and after it have no record and must
    be copied from the base over the recycled array's garbage."""
    rng = np.random.default_rng(1)
    old = {"w": rand_bits(rng, "bfloat16", (300, 70)), "f": rand_bits(rng, "float32", (4096,))}
    arr = old["w"].data.copy()
    arr.reshape(-1)[12345] += np.uint16(1)  # in segment [10000, 15000) of 21000 elements
    new = {"w": TensorBits("bfloat16", arr), "f": old["f"]}
    chunks = list(encode_delta(old, new, segment_elems=5000, threads=1))
    reuse = garbage_like(new)
    out = apply_delta(old, chunks, expected_of(new), reuse=reuse)
    assert np.shares_memory(out["w"].data, reuse["w"])
    assert_bits_equal(out, new)


def test_warm_multi_step_sync_never_writes_the_served_state():
    """A warm route of several deltas recycles each intermediate state's arrays into the next step; the
    starting state is the one being served and must come through bit-for-bit unchanged."""
    store = open_store("memory://")
    rng = np.random.default_rng(2)
    state = {f"w{i}": rand_bits(rng, "bfloat16", (200, 50)) for i in range(4)}
    pub = Publisher(store, anchor_every=100)
    states = []
    for v in range(8):
        pub.publish_bits(v, state)
        states.append(state)
        # most tensors change each step; some sit out a step, so arrays are also shared across versions
        state = {n: nudge(rng, tb, 0.02, 3) if (v + int(n[1:])) % 3 else tb for n, tb in state.items()}
    syncer = Syncer(store)
    syncer.sync(1)
    served = dict(syncer.state)
    before = snapshot(served)
    syncer.sync(7)
    assert syncer.last_route is not None and syncer.last_route.kind == "warm"
    assert len(syncer.last_route.steps) == 6
    for name, tb in served.items():
        assert np.array_equal(tb.data, before[name]), f"served tensor {name} was written"
    assert_bits_equal(syncer.state, states[7])


def test_in_place_arrays_holding_the_base_are_patched_in_place_and_the_base_is_untouched(step):
    old, new, chunks = step
    before = snapshot(old)
    mirror = {name: tb.data.copy() for name, tb in old.items()}
    out = apply_delta(old, chunks, expected_of(new), in_place=mirror)
    assert_bits_equal(out, new)
    for name in ("w0", "w1", "f"):
        assert np.shares_memory(out[name].data, mirror[name]), name
    assert out["w2"] is old["w2"]  # no record: the base's, the mirror unused
    for name, tb in old.items():
        assert np.array_equal(tb.data, before[name]), f"base tensor {name} was written"
