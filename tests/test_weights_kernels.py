"""The compiled PULSE kernels equal the numpy ones bit for bit (pnyx.weights.kernels).

Each case runs both versions on the same inputs: the encode pass (`diff_codes`) on sizes around its 4-wide
stride, at every density, with changes that wrap; the decode pass (`patch_codes`) on the codes that pass
produced and on hostile positions, which both must refuse without writing outside the segment; and the
whole codec, whose chunks must be byte-identical whichever kernels encoded them.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from pnyx.errors import IntegrityError
from pnyx.weights import kernels
from pnyx.weights.apply import apply_delta
from pnyx.weights.bits import TensorBits
from pnyx.weights.codec import encode_delta, expected_of

pytestmark = pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="needs numba")


@pytest.fixture(autouse=True)
def compiled_at_every_size(monkeypatch):
    """The compiled kernels on every segment here, however small (in use they start at MIN_ELEMS)."""
    monkeypatch.setattr(kernels, "MIN_ELEMS", 0)


@pytest.fixture
def restore_kernels():
    before = kernels.KERNELS
    yield
    kernels.use(before)


def edited(rng: np.random.Generator, a: np.ndarray, frac: float) -> np.ndarray:
    b = a.copy()
    k = int(round(frac * a.size))
    idx = rng.choice(a.size, k, replace=False)
    steps = rng.choice(np.array([1, -1, 2, -2, 3, 255, -32768, 32767, 12345], np.int64), k)
    b[idx] = (b[idx].astype(np.int64) + steps).astype(a.dtype)  # wraps mod 2^bits
    b[idx[b[idx] == a[idx]]] ^= 1  # a step of 2^16 would be no change: make every chosen element differ
    return b


@pytest.mark.parametrize("size", [0, 1, 3, 4, 5, 7, 8, 1001, 65_539])
@pytest.mark.parametrize("frac", [0.0, 0.02, 0.5, 1.0])
def test_diff_codes_equals_numpy(size, frac):
    rng = np.random.default_rng(size + int(frac * 100))
    a = rng.integers(0, 1 << 16, size, dtype=np.uint16)
    b = edited(rng, a, frac)
    g_np, c_np = kernels.diff_codes_numpy(a, b)
    g_nb, c_nb = kernels.diff_codes_numba(a, b)
    assert g_nb.dtype == g_np.dtype and c_nb.dtype == c_np.dtype == np.uint16
    np.testing.assert_array_equal(g_nb, g_np)
    np.testing.assert_array_equal(c_nb, c_np)
    assert len(g_nb) == int(np.count_nonzero(a != b))


def test_diff_codes_of_other_widths_and_strided_views_equal_numpy():
    rng = np.random.default_rng(3)
    a32 = rng.integers(0, 1 << 32, 10_001, dtype=np.uint32)
    for a, b in [(a32, edited(rng, a32, 0.1))]:
        for x, y in [(a, b), (a[1::2], b[1::2])]:
            got, want = kernels.diff_codes_numba(x, y), kernels.diff_codes_numpy(x, y)
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])
    a16 = rng.integers(0, 1 << 16, 10_001, dtype=np.uint16)
    b16 = edited(rng, a16, 0.1)
    got, want = kernels.diff_codes_numba(a16[::3], b16[::3]), kernels.diff_codes_numpy(a16[::3], b16[::3])
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.uint8])
@pytest.mark.parametrize("size", [1, 5, 300_001])
@pytest.mark.parametrize("frac", [0.0, 0.018, 1.0])
def test_patch_codes_equals_numpy_and_rebuilds_the_new_array(dtype, size, frac):
    rng = np.random.default_rng(size)
    a = rng.integers(0, np.iinfo(dtype).max, size, dtype=dtype, endpoint=True)
    b = edited(rng, a.astype(np.uint16) if dtype == np.uint16 else a, frac).astype(dtype)
    gaps, codes = kernels.diff_codes_numpy(a, b)
    out_np, out_nb = np.full_like(a, 7), np.full_like(a, 9)
    kernels.patch_codes_numpy(out_np, a, gaps, codes)
    kernels.patch_codes_numba(out_nb, a, gaps, codes)
    np.testing.assert_array_equal(out_np, b)
    np.testing.assert_array_equal(out_nb, b)


@pytest.mark.parametrize("patch", [kernels.patch_codes_numpy, kernels.patch_codes_numba])
@pytest.mark.parametrize(
    "gaps",
    [
        np.array([100], np.uint64),  # the first position is past the end
        np.array([10, 40, 49], np.uint64),  # the third is past it (10, 51, 101)
        np.array([0, np.iinfo(np.uint64).max, 0], np.uint64),  # wraps to a negative int64 step
        np.array([0, 1 << 62, 1 << 62, 1 << 62], np.uint64),  # sums past int64
    ],
)
def test_patch_codes_refuses_positions_outside_the_segment(patch, gaps):
    src = np.arange(100, dtype=np.uint16)
    backing = np.zeros(300, np.uint16)  # the segment is the middle third: nothing outside it may change
    dst = backing[100:200]
    with pytest.raises(IntegrityError, match="past its segment"):
        patch(dst, src, gaps, np.zeros(len(gaps), np.uint16))
    assert not backing[:100].any() and not backing[200:].any()


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.uint8])
@pytest.mark.parametrize("size", [1, 5, 300_001])
@pytest.mark.parametrize("frac", [0.0, 0.018, 1.0])
def test_add_codes_equals_numpy_and_turns_the_base_into_the_new_array_in_place(dtype, size, frac):
    rng = np.random.default_rng(size + 1)
    a = rng.integers(0, np.iinfo(dtype).max, size, dtype=dtype, endpoint=True)
    b = edited(rng, a.astype(np.uint16) if dtype == np.uint16 else a, frac).astype(dtype)
    gaps, codes = kernels.diff_codes_numpy(a, b)
    out_np, out_nb = a.copy(), a.copy()
    kernels.add_codes_numpy(out_np, gaps, codes)
    kernels.add_codes_numba(out_nb, gaps, codes)
    np.testing.assert_array_equal(out_np, b)
    np.testing.assert_array_equal(out_nb, b)


@pytest.mark.parametrize("add", [kernels.add_codes_numpy, kernels.add_codes_numba])
@pytest.mark.parametrize(
    "gaps",
    [
        np.array([100], np.uint64),
        np.array([10, 40, 49], np.uint64),
        np.array([0, np.iinfo(np.uint64).max, 0], np.uint64),
        np.array([0, 1 << 62, 1 << 62, 1 << 62], np.uint64),
    ],
)
def test_add_codes_refuses_positions_outside_the_segment_and_writes_nothing(add, gaps, monkeypatch):
    monkeypatch.setattr(kernels, "MIN_ELEMS", 1)  # the compiled path, even for 100 elements
    backing = np.arange(300, dtype=np.uint16)
    dst = backing[100:200]
    with pytest.raises(IntegrityError, match="past its segment"):
        add(dst, gaps, np.zeros(len(gaps), np.uint16))
    np.testing.assert_array_equal(backing, np.arange(300, dtype=np.uint16))


def state(rng: np.random.Generator, frac: float) -> tuple[dict, dict]:
    old, new = {}, {}
    for name, size, dtype in [
        ("a.weight", 1_000_003, "bfloat16"),
        ("b.weight", 4096, "float16"),
        ("c.bias", 513, "float32"),
    ]:
        u = np.uint32 if dtype == "float32" else np.uint16
        x = rng.integers(0, np.iinfo(u).max, size, dtype=u, endpoint=True)
        old[name] = TensorBits(dtype, x)
        new[name] = TensorBits(dtype, edited(rng, x, frac))
    return old, new


@pytest.mark.parametrize("frac", [0.0, 0.015, 0.3])
def test_the_codec_writes_the_same_chunks_and_rebuilds_the_same_state_with_either_kernels(
    frac, restore_kernels
):
    rng = np.random.default_rng(11)
    old, new = state(rng, frac)
    out = {}
    for kind in ("numpy", "numba"):
        kernels.use(kind)
        chunks = list(encode_delta(old, new, segment_elems=1 << 18, threads=2))
        out[kind] = (chunks, apply_delta(old, chunks, expected_of(new), threads=2))
    assert out["numba"][0] == out["numpy"][0]  # the wire bytes do not depend on the kernels
    for kind in ("numpy", "numba"):
        for name, tb in new.items():
            np.testing.assert_array_equal(out[kind][1][name].data, tb.data)
    kernels.use("numpy")  # chunks from the compiled encoder, applied by the numpy decoder, and back
    np.testing.assert_array_equal(
        apply_delta(old, out["numba"][0], expected_of(new))["a.weight"].data, new["a.weight"].data
    )


def test_small_segments_take_the_numpy_path_even_with_numba_in_force(monkeypatch):
    monkeypatch.setattr(kernels, "MIN_ELEMS", 1000)
    calls = []
    monkeypatch.setattr(kernels, "_kernels", lambda: calls.append(1) or kernels.__dict__["_compiled"])
    a = np.zeros(999, np.uint16)
    b = a.copy()
    b[3] = 1
    gaps, codes = kernels.diff_codes_numba(a, b)
    kernels.patch_codes_numba(np.empty_like(a), a, gaps, codes)
    assert calls == []  # neither call reached a compiled kernel


def test_the_environment_can_force_the_numpy_kernels(monkeypatch):
    import subprocess
    import sys

    code = "from pnyx.weights import kernels; print(kernels.KERNELS)"
    for value, want in [("numpy", "numpy"), ("", "numba")]:
        env = {"PNYX_PULSE_KERNELS": value, "PATH": "/usr/bin:/bin"}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == want
