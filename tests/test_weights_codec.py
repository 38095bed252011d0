"""The PULSE delta codec and bit handling: bit-exact round trips, special bit patterns, whole tensors,
streaming chunks, corruption, safetensors shards, and the entropy bound."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pnyx.errors import IntegrityError
from pnyx.weights.apply import DeltaApplier, apply_delta
from pnyx.weights.bits import (
    TensorBits,
    from_torch,
    read_safetensors,
    state_digest,
    to_torch,
    unsigned_dtype,
    write_safetensors,
)
from pnyx.weights.codec import (
    DeltaStats,
    encode_delta,
    entropy_bound_bytes,
    expected_of,
    unzigzag,
    zigzag,
)

DTYPES = ["bfloat16", "float16", "float32", "float64", "int8", "int32", "int64", "bool"]


def rand_bits(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> TensorBits:
    u = unsigned_dtype(dtype)
    if dtype == "bool":
        return TensorBits(dtype, rng.integers(0, 2, shape, dtype=np.uint8))
    return TensorBits(dtype, rng.integers(0, np.iinfo(u).max, shape, dtype=u, endpoint=True))


def sparse_edit(rng: np.random.Generator, tb: TensorBits, frac: float, max_step: int) -> TensorBits:
    """Add small integer steps (both signs, wrapping) to a random fraction of the bits."""
    flat = tb.data.reshape(-1).copy()
    n = int(round(frac * flat.size))
    idx = rng.choice(flat.size, size=n, replace=False) if n else np.array([], dtype=np.int64)
    steps = rng.integers(1, max_step + 1, n) * rng.choice([-1, 1], n)
    flat[idx] = flat[idx] + steps.astype(flat.dtype)  # modular: wraps like the codec
    if tb.dtype == "bool":
        flat[idx] = 1 - tb.data.reshape(-1)[idx]
    return TensorBits(tb.dtype, flat.reshape(tb.shape))


def roundtrip(old, new, **kw) -> dict:
    chunks = list(encode_delta(old, new, **kw))
    return apply_delta(old, chunks, expected_of(new))


def assert_same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        assert np.array_equal(a[k].data, b[k].data), k


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple),
    frac=st.sampled_from([0.0, 0.001, 0.02, 0.3, 1.0]),
    max_step=st.sampled_from([1, 2, 7, 300, 70000]),
)
def test_random_sparse_edits_roundtrip_bit_exactly(seed, dtype, shape, frac, max_step):
    rng = np.random.default_rng(seed)
    old = {"t": rand_bits(rng, dtype, shape)}
    new = {"t": sparse_edit(rng, old["t"], frac, max_step)}
    assert_same(roundtrip(old, new), new)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), frac=st.sampled_from([0.01, 0.2, 1.0]))
def test_roundtrip_is_exact_when_streamed_in_tiny_chunks_and_segments(seed, frac):
    rng = np.random.default_rng(seed)
    old = {f"w{i}": rand_bits(rng, "bfloat16", (13, 17)) for i in range(4)}
    new = {k: sparse_edit(rng, v, frac, 3) for k, v in old.items()}
    chunks = list(encode_delta(old, new, chunk_bytes=100, segment_elems=50))
    assert len(chunks) > 1
    assert_same(apply_delta(old, chunks, expected_of(new)), new)


def test_nan_inf_and_negative_zero_patterns_survive_exactly():
    special = np.array([0x7FC0, 0x7FC1, 0xFFC0, 0x7F80, 0xFF80, 0x8000, 0x0000, 0x0001, 0x7F81], np.uint16)
    old = {"s": TensorBits("bfloat16", special.copy())}
    new = {"s": TensorBits("bfloat16", special[::-1].copy())}
    assert_same(roundtrip(old, new), new)
    f32 = np.array([0x7FC00001, 0xFF800000, 0x80000000, 0x7F800000], np.uint32)
    old32 = {"f": TensorBits("float32", f32.copy())}
    new32 = {"f": TensorBits("float32", np.roll(f32, 1).copy())}
    assert_same(roundtrip(old32, new32), new32)


def test_value_mode_roundtrips_the_same_state():
    rng = np.random.default_rng(1)
    old = {"w": rand_bits(rng, "bfloat16", (64, 64))}
    new = {"w": sparse_edit(rng, old["w"], 0.05, 2)}
    assert_same(roundtrip(old, new, mode="value"), new)


def test_tensors_that_appear_reshape_or_change_dtype_go_whole():
    rng = np.random.default_rng(2)
    old = {
        "keep": rand_bits(rng, "bfloat16", (8, 8)),
        "gone": rand_bits(rng, "float32", (3,)),
        "reshaped": rand_bits(rng, "bfloat16", (4, 6)),
        "retyped": rand_bits(rng, "float16", (5,)),
    }
    new = {
        "keep": old["keep"],
        "born": rand_bits(rng, "int64", (2, 3)),
        "reshaped": TensorBits("bfloat16", old["reshaped"].data.reshape(6, 4).copy()),
        "retyped": rand_bits(rng, "float32", (5,)),
    }
    stats = DeltaStats()
    chunks = list(encode_delta(old, new, stats=stats))
    assert stats.whole_tensors == {"born", "reshaped", "retyped"}
    assert_same(apply_delta(old, chunks, expected_of(new)), new)


def test_unchanged_state_encodes_to_no_chunks():
    rng = np.random.default_rng(3)
    s = {"w": rand_bits(rng, "bfloat16", (32, 32))}
    assert list(encode_delta(s, s)) == []


def test_applying_never_writes_into_the_base_state():
    rng = np.random.default_rng(4)
    old = {"w": rand_bits(rng, "bfloat16", (32, 32))}
    before = old["w"].data.copy()
    new = {"w": sparse_edit(rng, old["w"], 0.1, 2)}
    roundtrip(old, new)
    assert np.array_equal(old["w"].data, before)


def test_small_changes_use_two_bit_codes():
    rng = np.random.default_rng(5)
    old = {"w": rand_bits(rng, "bfloat16", (256, 256))}
    new = {"w": sparse_edit(rng, old["w"], 0.02, 2)}
    from pnyx.weights.codec import read_header

    (chunk,) = list(encode_delta(old, new))
    header, _ = read_header(chunk)
    assert [r.code_bits for r in header.records] == [2]


def test_zigzag_roundtrips_every_16_bit_difference():
    d = np.arange(1 << 16, dtype=np.uint16)
    assert np.array_equal(unzigzag(zigzag(d)), d)
    assert list(zigzag(np.array([0, 1, 0xFFFF, 2, 0xFFFE], np.uint16))) == [0, 2, 1, 4, 3]


def test_a_flipped_byte_in_a_chunk_raises_integrity_error_or_changes_the_state():
    """Body flips always show (an IntegrityError or another state); a header flip may hit an unused field."""
    from pnyx.weights.codec import MAGIC

    rng = np.random.default_rng(6)
    old = {"w": rand_bits(rng, "bfloat16", (64, 64))}
    new = {"w": sparse_edit(rng, old["w"], 0.05, 2)}
    (chunk,) = list(encode_delta(old, new))
    body_at = len(MAGIC) + 4 + int.from_bytes(chunk[len(MAGIC) : len(MAGIC) + 4], "little")
    want = state_digest(new)
    for pos in range(0, len(chunk), max(1, len(chunk) // 97)):
        bad = bytearray(chunk)
        bad[pos] ^= 0x01
        try:
            got = apply_delta(old, [bytes(bad)], expected_of(new))
        except IntegrityError:
            continue
        assert pos < body_at or state_digest(got) != want, f"flip at body byte {pos} went unnoticed"


def test_a_record_for_an_unlisted_tensor_is_rejected():
    rng = np.random.default_rng(7)
    old = {"w": rand_bits(rng, "bfloat16", (8, 8))}
    new = {"w": sparse_edit(rng, old["w"], 0.5, 2)}
    chunks = list(encode_delta(old, new))
    with pytest.raises(IntegrityError):
        apply_delta(old, chunks, {"other": ("bfloat16", (8, 8))})


def test_safetensors_shards_roundtrip_and_load_in_the_reference_reader():
    import safetensors.torch
    import torch

    state = {
        "a": torch.randn(3, 4).to(torch.bfloat16),
        "b": torch.arange(5),
        "c": torch.tensor(True),
        "d": torch.randn(2, 2, dtype=torch.float16),
    }
    bits = from_torch(state)
    data = write_safetensors(bits)
    assert_same(read_safetensors(data), bits)
    ref = safetensors.torch.load(data)
    for k, t in state.items():
        assert ref[k].dtype == t.dtype and torch.equal(ref[k], t)


def test_truncated_safetensors_shard_is_an_integrity_error():
    data = write_safetensors({"a": TensorBits("float32", np.arange(10, dtype=np.uint32))})
    with pytest.raises(IntegrityError):
        read_safetensors(data[:-3])


def test_torch_crossing_keeps_dtype_and_bits():
    import torch

    t = {"x": torch.tensor([float("nan"), -0.0, float("inf"), 1.5]).to(torch.bfloat16), "i": torch.arange(4)}
    back = to_torch(from_torch(t))
    assert back["x"].dtype == torch.bfloat16
    assert torch.equal(back["x"].view(torch.int16), t["x"].view(torch.int16))
    assert torch.equal(back["i"], t["i"])


def test_entropy_bound_matches_a_hand_computed_case():
    # 4 changes at positions 1, 3, 5, 7 -> gaps all 1 (H=0); changes +1,-1,+1,-1 -> H=1 bit each
    a = np.zeros(8, np.uint16)
    b = a.copy()
    b[[1, 3, 5, 7]] = np.array([1, 0xFFFF, 1, 0xFFFF], np.uint16)
    old, new = {"w": TensorBits("bfloat16", a)}, {"w": TensorBits("bfloat16", b)}
    assert entropy_bound_bytes(old, new) == pytest.approx(4 * 1.0 / 8)


def test_threaded_encode_and_decode_match_the_serial_ones():
    rng = np.random.default_rng(8)
    old = {f"w{i}": rand_bits(rng, "bfloat16", (40, 50)) for i in range(6)}
    new = {k: sparse_edit(rng, v, 0.05, 3) for k, v in old.items()}
    serial = list(encode_delta(old, new, segment_elems=700, threads=1))
    threaded = list(encode_delta(old, new, segment_elems=700, threads=3))
    assert serial == threaded
    ap = DeltaApplier(old, expected_of(new), threads=3)
    for c in threaded:
        ap.apply(c)
    assert_same(ap.result(), new)
