"""The numba versions of `pnyx.weights.kernels` (imported only when numba is installed and in force).

Module-level functions, so numba's on-disk cache (`cache=True`) finds them again in the next process; the
contracts, the numpy twins and the bounds checks that make these safe to call are in `kernels.py`.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(nogil=True, cache=True, inline="always")
def hits16(a, b, lo, hi, prev, k, gaps, codes):  # pragma: no cover - compiled
    """Write the gap and code of every i in [lo, hi) where a[i] != b[i]; returns the new (prev, k)."""
    for i in range(lo, hi):
        x = np.int64(a[i])
        y = np.int64(b[i])
        if x != y:
            s = (y - x) & 0xFFFF  # the modular difference, as a signed 16-bit value
            if s >= 32768:
                s -= 65536
            gaps[k] = i - prev - 1
            codes[k] = (2 * s if s >= 0 else -2 * s - 1) - 1
            prev = i
            k += 1
    return prev, k


@njit(nogil=True, cache=True)
def diff16(a, b, a64, b64, gaps, codes):  # pragma: no cover - compiled
    """Gaps and zigzag codes (minus one) where the uint16 arrays a, b differ; a64/b64: their first
    4 * len(a64) elements viewed as uint64 (one compare per four elements). Returns how many were written."""
    k = 0
    prev = -1
    for j in range(a64.size):
        if a64[j] != b64[j]:
            prev, k = hits16(a, b, 4 * j, 4 * j + 4, prev, k, gaps, codes)
    prev, k = hits16(a, b, 4 * a64.size, a.size, prev, k, gaps, codes)  # the tail the view does not cover
    return k


@njit(nogil=True, cache=True)
def copy(dst, src):  # pragma: no cover - compiled; a loop of its own vectorizes like memcpy
    for i in range(dst.size):
        dst[i] = src[i]


@njit(nogil=True, cache=True)
def patch(dst, src, gaps, codes, block):  # pragma: no cover - compiled
    n = dst.size
    m = gaps.size
    j = 0
    p = np.int64(gaps[0]) if m else n
    for s in range(0, n, block):
        e = min(s + block, n)
        copy(dst[s:e], src[s:e])
        while j < m and p < e:
            c = np.int64(codes[j]) + 1
            dst[p] = src[p] + ((c >> 1) ^ (-(c & 1)))  # unzigzag, wrapped to dst's width on store
            j += 1
            if j < m:
                p += np.int64(gaps[j]) + 1
    return j == m


@njit(nogil=True, cache=True)
def add(dst, gaps, codes):  # pragma: no cover - compiled
    """Add each decoded change at the position its gap reaches, in place; False if one falls outside dst."""
    n = dst.size
    p = np.int64(-1)
    for j in range(gaps.size):
        p += np.int64(gaps[j]) + 1
        if p >= n:
            return False
        c = np.int64(codes[j]) + 1
        dst[p] = dst[p] + ((c >> 1) ^ (-(c & 1)))  # unzigzag, wrapped to dst's width on store
    return True
