"""Applying PULSE delta chunks (`pnyx.weights.codec`'s format) onto a base state, bit-exact.

Decoding copies each record's range from the base and patches it in the same pass (`kernels.patch_codes`),
into arrays the caller may recycle (`reuse`); the base is never written. Or, for arrays the caller hands
over already holding the base's values (`in_place`: a route's own intermediate state), it
only adds the changes (`kernels.add_codes`): work in the changes, not the state. Knows nothing about the
store, manifests or torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import zstandard

from pnyx.errors import IntegrityError
from pnyx.weights import kernels
from pnyx.weights.bits import BitState, TensorBits, unsigned_dtype
from pnyx.weights.codec import Record, _dctx, default_threads, read_header
from pnyx.weights.pack import CODE_BITS, UINT, packed_len, unpack_codes, unplanes

__all__ = ["DeltaApplier", "apply_delta"]


class DeltaApplier:
    """Applies chunks onto a base state without ever writing into the base.

    `expected` maps each tensor of the target state to (dtype, shape); records naming anything else, or
    disagreeing with it, raise IntegrityError. `result()` returns the new state (untouched tensors are
    shared with the base). A touched tensor is built in a work array: each record copies its own range
    from the base and patches it while that range is in cache (one pass over the bytes, not a copy then a
    scatter), and `result()` copies whatever no record covered.

    reuse: arrays (by tensor name) the applier may overwrite as work arrays instead of allocating fresh
    pages, e.g. a retired state's. The caller guarantees nothing else reads them; an array of the wrong
    dtype/shape, or overlapping the base tensor's memory, is ignored.

    in_place: arrays (by tensor name) that already hold exactly the base's values of their tensor, which
    nothing else reads: a record of such a tensor is applied into it in place (only the changes are
    written), and its ranges no record covers need no copy. The caller guarantees the values; a wrong one
    shows as a digest mismatch of the result, which the caller verifies. An array that does not fit is
    ignored.
    """

    def __init__(
        self,
        base: Mapping[str, TensorBits],
        expected: Mapping[str, tuple[str, tuple[int, ...]]],
        threads: int | None = None,
        reuse: Mapping[str, np.ndarray] | None = None,
        in_place: Mapping[str, np.ndarray] | None = None,
    ):
        self.base = base
        self.expected = expected
        self.work: dict[str, np.ndarray] = {}
        self.covered: dict[str, list[tuple[int, int]]] = {}
        self.threads = threads or default_threads()
        self.reuse = reuse or {}
        self.in_place = {n: a for n, a in (in_place or {}).items() if self._fits(n, a)}

    def _fits(self, name: str, arr: np.ndarray) -> bool:
        exp = self.expected.get(name)
        base = self.base.get(name)
        return (
            exp is not None
            and arr.dtype.itemsize == unsigned_dtype(exp[0]).itemsize
            and arr.shape == tuple(exp[1])
            and arr.flags.c_contiguous
            and arr.flags.writeable
            and not (base is not None and np.may_share_memory(arr, base.data))
        )

    def apply(self, chunk: bytes) -> None:
        """Apply one chunk: first the work arrays of every touched tensor, then the records, spread over
        threads (records of one chunk cover disjoint element ranges)."""
        header, body = read_header(chunk)
        for r in {r.name: r for r in reversed(header.records)}.values():
            self._target(r)
        if self.threads > 1 and len(header.records) > 1:
            with ThreadPoolExecutor(self.threads) as pool:
                list(pool.map(lambda r: self._apply_record(r, body), header.records))
        else:
            for r in header.records:
                self._apply_record(r, body)

    def _base_of(self, r: Record) -> np.ndarray | None:
        base = self.base.get(r.name)
        if base is not None and base.dtype == r.dtype and base.shape == tuple(r.shape):
            return base.data
        return None

    def _target(self, r: Record) -> np.ndarray:
        exp = self.expected.get(r.name)
        if exp is None or exp[0] != r.dtype or tuple(exp[1]) != tuple(r.shape):
            raise IntegrityError(
                f"delta record for {r.name!r} ({r.dtype}{r.shape}) is not in the manifest as such"
            )
        arr = self.work.get(r.name)
        if arr is not None:
            return arr
        u = unsigned_dtype(r.dtype)
        if r.name in self.in_place:
            given = self.in_place[r.name]
            arr = self.work[r.name] = given if given.dtype == u else given.view(u)  # the caller's object
            self.covered[r.name] = [(0, arr.size)]  # it holds the base's values: nothing to copy
            return arr
        base = self._base_of(r)
        if r.op != "whole" and base is None:
            raise IntegrityError(
                f"delta record for {r.name!r} needs a base tensor {r.dtype}{r.shape} we do not hold"
            )
        arr = self.reuse.get(r.name)
        if (
            arr is None
            or arr.dtype.itemsize != u.itemsize
            or arr.shape != tuple(r.shape)
            or not arr.flags.c_contiguous
            or not arr.flags.writeable
            or (base is not None and np.may_share_memory(arr, base))
        ):
            arr = np.empty(tuple(r.shape), dtype=u)
        arr = arr.view(u)
        self.work[r.name] = arr
        self.covered[r.name] = []
        return arr

    def _frame(self, r: Record, body: memoryview, start: int, length: int, size: int) -> bytes:
        if length == 0 and size == 0:
            return b""
        if start < 0 or length < 0 or start + length > len(body):
            raise IntegrityError(f"delta record for {r.name!r} points outside its chunk")
        try:
            raw = _dctx().decompress(body[start : start + length], max_output_size=size)
        except zstandard.ZstdError as e:
            raise IntegrityError(f"delta frame for {r.name!r} does not decompress: {e}") from None
        if len(raw) != size:
            raise IntegrityError(
                f"delta frame for {r.name!r} decompressed to {len(raw)} bytes, expected {size}"
            )
        return raw

    def _check(self, r: Record, flat: np.ndarray) -> tuple[int, int, int]:
        """(n, code bits, gap width) of a record whose fields are consistent, else IntegrityError."""
        if r.op not in ("diff", "value", "whole"):
            raise IntegrityError(f"unknown delta op {r.op!r}")
        w = flat.dtype.itemsize
        if not (r.start >= 0 and r.count >= 0 and r.start + r.count <= flat.size and 0 <= r.n <= r.count):
            raise IntegrityError(f"delta record for {r.name!r} covers a bad range")
        n, bits = (r.count, 8 * w) if r.op == "whole" else (r.n, r.code_bits)
        gw = 0 if r.op == "whole" else r.gap_width
        if (r.op != "whole" and gw not in UINT) or (r.op == "whole" and (r.gap_width or r.gap_len)):
            raise IntegrityError(f"delta record for {r.name!r} has gap width {gw}")
        if bits not in CODE_BITS or bits > 8 * w or (r.op != "diff" and bits != 8 * w):
            raise IntegrityError(f"delta record for {r.name!r} has code width {bits}")
        if (
            not 0 <= r.esc_n <= n
            or (r.esc_width not in UINT if r.esc_n else r.esc_width != 0)
            or (r.esc_n and r.op != "diff")
        ):
            raise IntegrityError(f"delta record for {r.name!r} has bad escapes")
        return n, bits, gw

    def _apply_record(self, r: Record, body: memoryview) -> None:
        arr = self._target(r)
        flat = arr.reshape(-1)
        n, bits, gw = self._check(r, flat)
        gaps_raw = self._frame(r, body, r.offset, r.gap_len, n * gw)
        codes_raw = self._frame(
            r, body, r.offset + r.gap_len, r.code_len, packed_len(n, bits) + r.esc_n * r.esc_width
        )
        seg = flat[r.start : r.start + r.count]
        w = flat.dtype.itemsize
        if r.op == "whole":
            seg[:] = unplanes(codes_raw, n, w)
            self.covered[r.name].append((r.start, r.start + r.count))
            return
        gaps = unplanes(gaps_raw, n, gw)
        codes = unpack_codes(codes_raw, n, bits).astype(flat.dtype)
        if r.esc_n:
            top = flat.dtype.type((1 << bits) - 1)
            at = np.flatnonzero(codes == top)
            if len(at) != r.esc_n:
                raise IntegrityError(
                    f"delta record for {r.name!r} has {len(at)} escapes, header says {r.esc_n}"
                )
            exc = unplanes(memoryview(codes_raw)[packed_len(n, bits) :], r.esc_n, r.esc_width)
            codes[at] = top + exc.astype(flat.dtype)
        try:
            if r.name in self.in_place:  # seg already holds the base's values: write only the changes
                if r.op == "value":
                    seg[kernels.positions(gaps, r.count)] = codes
                else:
                    kernels.add_codes(seg, gaps, codes)
            else:
                src = self._base_of(r)
                assert src is not None  # _target checked it
                src = src.reshape(-1)[r.start : r.start + r.count]
                if r.op == "value":
                    pos = kernels.positions(gaps, r.count)
                    np.copyto(seg, src)
                    seg[pos] = codes
                else:  # one pass: copy each block of the base and add the decoded changes while in cache
                    kernels.patch_codes(seg, src, gaps, codes)
        except IntegrityError:
            raise IntegrityError(f"delta record for {r.name!r} points past its segment") from None
        self.covered[r.name].append((r.start, r.start + r.count))

    def result(self) -> BitState:
        """The new state; ranges of touched tensors that no record covered are copied from the base."""
        out: BitState = {}
        for name, (dtype, _shape) in self.expected.items():
            if name in self.work:
                arr = self.work[name]
                flat = arr.reshape(-1)
                base = self.base.get(name)
                src = (
                    base.data.reshape(-1)
                    if base is not None and base.dtype == dtype and base.shape == arr.shape
                    else None
                )
                at = 0
                for start, end in [*sorted(self.covered[name]), (flat.size, flat.size)]:
                    if start > at:
                        if src is not None:
                            np.copyto(flat[at:start], src[at:start])
                        else:
                            flat[at:start] = 0
                    at = max(at, end)
                out[name] = TensorBits(dtype, arr)
            elif name in self.base:
                out[name] = self.base[name]
            else:
                raise IntegrityError(
                    f"tensor {name!r} is in the manifest but neither in the base nor the delta"
                )
        return out


def apply_delta(
    base: Mapping[str, TensorBits],
    chunks: list[bytes],
    expected: Mapping[str, tuple[str, tuple[int, ...]]],
    reuse: Mapping[str, np.ndarray] | None = None,
    threads: int | None = None,
    in_place: Mapping[str, np.ndarray] | None = None,
) -> BitState:
    """Convenience: apply all chunks at once (see DeltaApplier)."""
    ap = DeltaApplier(base, expected, threads=threads, reuse=reuse, in_place=in_place)
    for c in chunks:
        ap.apply(c)
    return ap.result()
