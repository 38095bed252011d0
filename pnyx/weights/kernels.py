"""The PULSE codec's two full-size passes, compiled (numba), each beside the pure-numpy version it must equal.

A delta's cost is two passes over the whole state; everything else touches only the ~1-3% that changed.
numpy cannot fuse either pass:
- `diff_codes(a, b)`, encoding: the gaps between the positions where two flat unsigned arrays differ and
  the zigzag codes of the changes (`zigzag(new - old) - 1`). numpy compares into a mask, finds its nonzeros,
  gathers old and new there, then takes gaps and codes (six passes, four of them full size); the kernel
  reads each pair once, four 16-bit elements at a time through their 64-bit view, and writes only the hits.
- `patch_codes(dst, src, gaps, codes)`, decoding: `dst = src` with the decoded change added (mod 2^bits) at
  each position the gaps reach. numpy takes a cumulative sum and an unzigzag, copies, then scatters with
  fancy indexing (~10 ns per change); the kernel copies `PATCH_ELEMS` at a time and patches that block while
  it is in cache, decoding positions and changes on the way.
- `add_codes(dst, gaps, codes)`, decoding in place: the same changes added to `dst`, which already holds the
  base's values (a route's own intermediate state, `DeltaApplier(in_place=...)`): no copy; the changes only.
Both release the GIL: the codec's thread pool runs segments side by side on them.

The compiled kernels are used when numba imports and `PNYX_PULSE_KERNELS` is not `numpy`; `KERNELS` says
which are in force. numba compiles them at first use (a few seconds) and caches them on disk (`cache=True`);
from the cache a process's first call still costs ~0.65 s (numba's import and start-up).
The wire format does not depend on the choice: both versions produce and consume the same arrays
(tests/test_weights_kernels.py compares them on the same inputs, hostile ones included). Knows nothing about
chunks, zstd, tensors or the store.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Literal

import numpy as np

from pnyx.errors import IntegrityError
from pnyx.weights.pack import gaps_of, unzigzag, zigzag
from pnyx.weights.scan import changes

__all__ = [
    "KERNELS",
    "MIN_ELEMS",
    "PATCH_ELEMS",
    "add_codes",
    "check_gaps",
    "diff_codes",
    "patch_codes",
    "positions",
    "use",
]

Kernels = Literal["numba", "numpy"]
PATCH_ELEMS = 1 << 18  # elements copied and then patched while in cache (256K: 512 KB of bf16)
MIN_ELEMS = 1 << 18
"""Segments smaller than this take the numpy path even with numba in force: a process's first compiled call
costs ~0.65 s (numba's import and start-up, even from its cache), more than the numpy path spends on a small
model's whole state (the shipped tiny model's tensors are all below it)."""


def check_gaps(gaps: np.ndarray, n: int) -> None:
    """IntegrityError unless every gap is < n: then positions only grow and never overflow int64."""
    if len(gaps) and int(gaps.max()) >= n:
        raise IntegrityError("delta record points past its segment")


def positions(gaps: np.ndarray, n: int) -> np.ndarray:
    """The ascending positions (int64) the gaps reach in a segment of `n` elements; IntegrityError if any
    falls outside it."""
    check_gaps(gaps, n)
    pos = gaps.astype(np.int64)
    pos += 1
    np.cumsum(pos, out=pos)  # < n * n: no overflow once every gap is < n
    pos -= 1
    if len(pos) and pos[-1] >= n:
        raise IntegrityError("delta record points past its segment")
    return pos


# --- numpy ----------------------------------------------------------------------------------------------


def diff_codes_numpy(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(gaps int64, codes of a's dtype) where the equal-length flat unsigned arrays `a`, `b` differ."""
    pos, new, old = changes(a, b)
    return gaps_of(pos), zigzag(new - old) - b.dtype.type(1)


def patch_codes_numpy(dst: np.ndarray, src: np.ndarray, gaps: np.ndarray, codes: np.ndarray) -> None:
    """dst[:] = src, then add unzigzag(code + 1) (modular, dst's dtype) at each position the gaps reach.

    Raises IntegrityError when a position falls outside dst (a hostile or corrupt record)."""
    n = dst.size
    pos = positions(gaps, n)
    delta = unzigzag(codes.astype(dst.dtype) + dst.dtype.type(1))
    cuts = np.searchsorted(pos, np.arange(0, n, PATCH_ELEMS)[1:]).tolist()
    lo = 0
    for s, hi in zip(range(0, n, PATCH_ELEMS), [*cuts, len(pos)], strict=True):
        np.copyto(dst[s : s + PATCH_ELEMS], src[s : s + PATCH_ELEMS])
        dst[pos[lo:hi]] += delta[lo:hi]
        lo = hi


def add_codes_numpy(dst: np.ndarray, gaps: np.ndarray, codes: np.ndarray) -> None:
    """Add unzigzag(code + 1) (modular, dst's dtype) at each position the gaps reach, in place.

    Raises IntegrityError when a position falls outside dst (nothing is written then)."""
    pos = positions(gaps, dst.size)
    dst[pos] += unzigzag(codes.astype(dst.dtype) + dst.dtype.type(1))


# --- numba (kernels_nb.py) --------------------------------------------------------------------------------

_compiled = None


def _kernels():
    global _compiled
    if _compiled is None:
        from pnyx.weights import kernels_nb

        _compiled = (kernels_nb.diff16, kernels_nb.patch, kernels_nb.add)
    return _compiled


def diff_codes_numba(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`diff_codes_numpy`, fused (16-bit contiguous arrays of `MIN_ELEMS` or more; others take the numpy path)."""
    if a.size < MIN_ELEMS or a.dtype.itemsize != 2 or not (a.flags.c_contiguous and b.flags.c_contiguous):
        return diff_codes_numpy(a, b)
    n = a.size
    # np.empty reserves address space; only the pages the kernel writes (the hits) become resident
    gaps = np.empty(n, np.int64)
    codes = np.empty(n, b.dtype)
    m = n - n % 4
    k = _kernels()[0](a, b, a[:m].view(np.uint64), b[:m].view(np.uint64), gaps, codes)
    return gaps[:k].copy(), codes[:k].copy()


def patch_codes_numba(dst: np.ndarray, src: np.ndarray, gaps: np.ndarray, codes: np.ndarray) -> None:
    """`patch_codes_numpy`, fused (`MIN_ELEMS` or more elements of up to 32 bits; others take the numpy path)."""
    if dst.size < MIN_ELEMS or dst.dtype.itemsize > 4:
        return patch_codes_numpy(dst, src, gaps, codes)
    check_gaps(gaps, dst.size)  # the kernel has no bounds checks: positions must only grow
    if not _kernels()[1](dst, src, gaps, codes, PATCH_ELEMS):
        raise IntegrityError("delta record points past its segment")


def add_codes_numba(dst: np.ndarray, gaps: np.ndarray, codes: np.ndarray) -> None:
    """`add_codes_numpy`, compiled (`MIN_ELEMS` or more elements of up to 32 bits; others take the numpy path).
    A record that points past dst is refused before anything is written (`check_gaps` bounds each gap; the
    kernel stops at the first position past the end, so the sum is checked first)."""
    if dst.size < MIN_ELEMS or dst.dtype.itemsize > 4:
        return add_codes_numpy(dst, gaps, codes)
    check_gaps(gaps, dst.size)
    if len(gaps) and int(gaps.sum(dtype=np.int64)) + len(gaps) > dst.size:
        raise IntegrityError("delta record points past its segment")
    if not _kernels()[2](dst, gaps, codes):
        raise IntegrityError("delta record points past its segment")


KERNELS: Kernels = "numpy"
diff_codes = diff_codes_numpy
patch_codes = patch_codes_numpy
add_codes = add_codes_numpy


def use(kind: Kernels) -> None:
    """Put `kind`'s kernels in force (`PNYX_PULSE_KERNELS` chooses at import; tests switch to compare).

    Callers reach the kernels as `kernels.diff_codes` / `kernels.patch_codes`, so a switch applies at once."""
    global KERNELS, diff_codes, patch_codes, add_codes
    if kind == "numba" and importlib.util.find_spec("numba") is None:
        raise ImportError("numba is not installed: pip install numba (the numpy kernels need nothing)")
    KERNELS = kind
    if kind == "numba":
        diff_codes, patch_codes, add_codes = diff_codes_numba, patch_codes_numba, add_codes_numba
    else:
        diff_codes, patch_codes, add_codes = diff_codes_numpy, patch_codes_numpy, add_codes_numpy


use(
    "numba"
    if importlib.util.find_spec("numba") is not None and os.environ.get("PNYX_PULSE_KERNELS") != "numpy"
    else "numpy"
)
