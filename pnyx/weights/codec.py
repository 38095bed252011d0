"""The PULSE delta codec: the exact difference between two bit-states as a stream of zstd-compressed chunks.

Per tensor segment (a range of the flattened tensor, so large tensors stream), a `diff` record holds
  - the changed positions, gap-encoded (gap = distance to the previous change minus one), stored in the
    smallest unsigned byte width that fits the largest gap, byte planes split;
  - the change as the modular integer difference of the bit patterns (new - old mod 2^bits, never floating
    point), zigzag-mapped minus one (a change is never zero), stored in the smallest of 1/2/4/8/16/32/64
    bits that fits: sub-byte codes are bit-packed, wider ones byte-plane split.
Tensors that appear, or change dtype or shape, go `whole` (their bytes, byte planes split). A `value`
record stores new values instead of differences (kept for the benchmark's baseline).

This module owns the chunk format, the public encode/apply API and the threads; finding the changes lives
in `scan.py` and the integer packing in `pack.py` (their public names are re-exported here).
Reconstruction is `old + change mod 2^bits`, bit-exact by construction; callers verify digests anyway.
Decoding copies each record's range from the base and patches it `APPLY_ELEMS` at a time, into arrays the
caller may recycle (`reuse`); the base is never written.
Knows nothing about the store, manifests or torch. Chunk layout: MAGIC, u32 header length, msgpack
`ChunkHeader`, then the body of zstd frames the records point into.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import msgspec
import numpy as np
import zstandard

from pnyx.errors import IntegrityError
from pnyx.weights.bits import BitState, TensorBits, unsigned_dtype
from pnyx.weights.pack import (
    CODE_BITS,
    UINT,
    code_candidates,
    gaps_of,
    packed_len,
    planes,
    unpack_codes,
    unplanes,
    unzigzag,
    width_for,
    zigzag,
)
from pnyx.weights.scan import SCAN_ELEMS, changed_positions, changes, entropy_bound_bytes

__all__ = [
    "APPLY_ELEMS",
    "CHUNK_BYTES",
    "MAGIC",
    "SCAN_ELEMS",
    "SEGMENT_ELEMS",
    "ChunkHeader",
    "DeltaApplier",
    "DeltaMode",
    "DeltaStats",
    "Layout",
    "Op",
    "Record",
    "Segment",
    "apply_delta",
    "changed_positions",
    "changes",
    "default_threads",
    "encode_delta",
    "encode_window",
    "encode_windows",
    "entropy_bound_bytes",
    "expected_of",
    "plan_windows",
    "read_header",
    "unzigzag",
    "zigzag",
]

MAGIC = b"PULSEDv1"
SEGMENT_ELEMS = 1 << 22  # 4M elements per record: bounds the working memory of one encode/decode step
CHUNK_BYTES = 64 << 20  # raw state bytes covered by one chunk object

Op = Literal["diff", "value", "whole"]
DeltaMode = Literal["diff", "value"]


class Record(msgspec.Struct, array_like=True):
    """One segment of one tensor inside a chunk: a gaps frame then a codes frame, back to back."""

    name: str
    op: str  # Op
    dtype: str
    shape: list[int]
    start: int  # first element (flattened) this record covers
    count: int  # number of elements covered
    n: int  # changed positions (diff/value); == count for whole
    gap_width: int  # bytes per gap (diff/value), 0 for whole
    code_bits: int  # bits per packed code; the top code value escapes when esc_n > 0
    esc_n: int  # escaped codes, stored after the packed codes as (code - top) in esc_width bytes
    esc_width: int
    offset: int  # the gaps frame starts here in the body; the codes frame follows it
    gap_len: int
    code_len: int


class ChunkHeader(msgspec.Struct):
    records: list[Record]


@dataclass
class DeltaStats:
    """Counts accumulated while encoding (changed elements, elements compared, raw bytes compared)."""

    changed: int = 0
    elements: int = 0
    raw_bytes: int = 0
    whole_tensors: set[str] = field(default_factory=set)


# --- one segment ----------------------------------------------------------------------------------------


def _encode_segment(
    a: np.ndarray | None, b: np.ndarray, mode: DeltaMode, cctx: zstandard.ZstdCompressor
) -> tuple[Op, int, int, int, int, int, bytes, bytes] | None:
    """(op, n, gap_width, code_bits, esc_n, esc_width, gaps frame, codes frame), or None if unchanged."""
    w = b.dtype.itemsize
    if a is None:
        return "whole", len(b), 0, 8 * w, 0, 0, b"", cctx.compress(planes(b, w))
    pos, new, base = changes(a, b)
    n = len(pos)
    if n == 0:
        return None
    gaps = gaps_of(pos)
    gw = width_for(int(gaps.max()))
    gframe = cctx.compress(planes(gaps, gw))
    if mode == "value":
        return "value", n, gw, 8 * w, 0, 0, gframe, cctx.compress(planes(new, w))
    codes = zigzag(new - base) - b.dtype.type(1)
    bits, esc_n, esc_w, cframe = code_candidates(codes, cctx)
    return "diff", n, gw, bits, esc_n, esc_w, gframe, cframe


def _segments(tb: TensorBits, segment_elems: int) -> Iterator[tuple[int, int]]:
    size = tb.data.size
    for start in range(0, max(size, 1), segment_elems):
        yield start, min(segment_elems, size - start)


def default_threads() -> int:
    """Worker threads for encoding/decoding segments (numpy and zstd release the GIL)."""
    return max(1, min(4, os.cpu_count() or 1))


_local = threading.local()


def _cctx(level: int) -> zstandard.ZstdCompressor:
    """A per-thread compressor (zstd contexts must not be shared across threads)."""
    c = getattr(_local, "cctx", None)
    if c is None or _local.level != level:
        c, _local.level = zstandard.ZstdCompressor(level=level), level
        _local.cctx = c
    return c


def _dctx() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


Segment = tuple[str, int, int]
"""(tensor name, first element, element count): one record's range of one tensor."""
Layout = Mapping[str, tuple[str, tuple[int, ...]]]
"""Tensor name -> (dtype, shape): what a state looks like, without its bits."""


def plan_windows(
    layout: Layout, chunk_bytes: int = CHUNK_BYTES, segment_elems: int = SEGMENT_ELEMS
) -> list[list[Segment]]:
    """The segments of each chunk of a delta into a state shaped like `layout`, in order.

    A pure function of names, dtypes and shapes (never of values): tensors sorted by name, each cut into
    segments of `segment_elems`, a window closed once it covers `chunk_bytes` of state. Every publisher of
    the same layout cuts the same windows, so a window encodes to the same bytes whichever process
    encodes it (parallel publishing relies on this); a window whose segments did not change yields no
    chunk.
    """
    windows: list[list[Segment]] = []
    pending: list[Segment] = []
    covered = 0
    for name in sorted(layout):
        dtype, shape = layout[name]
        size = 1
        for d in shape:
            size *= int(d)
        itemsize = unsigned_dtype(dtype).itemsize
        for start in range(0, max(size, 1), segment_elems):
            count = min(segment_elems, size - start)
            pending.append((name, start, count))
            covered += count * itemsize
            if covered >= chunk_bytes:
                windows.append(pending)
                pending, covered = [], 0
    if pending:
        windows.append(pending)
    return windows


def encode_window(
    old: Mapping[str, TensorBits],
    new: Mapping[str, TensorBits],
    window: list[Segment],
    mode: DeltaMode = "diff",
    level: int = 1,
    stats: DeltaStats | None = None,
    pool: ThreadPoolExecutor | None = None,
) -> bytes | None:
    """The chunk of one window (`plan_windows`), or None if none of its segments changed.

    Only the tensors the window names are read from `old` and `new`; the segments are encoded on `pool`'s
    threads when given (the output does not depend on it).
    """
    stats = stats if stats is not None else DeltaStats()
    items: list[tuple[TensorBits, np.ndarray | None, int, int]] = []
    for name, start, count in window:
        tb = new[name]
        base = old.get(name)
        same = base is not None and base.dtype == tb.dtype and base.shape == tb.shape
        if not same:
            stats.whole_tensors.add(name)
        fa = base.data.reshape(-1) if same and base is not None else None
        items.append((tb, fa, start, count))

    def encode(item: tuple[TensorBits, np.ndarray | None, int, int]):
        tb, fa, start, count = item
        a = fa[start : start + count] if fa is not None else None
        return _encode_segment(a, tb.data.reshape(-1)[start : start + count], mode, _cctx(level))

    results = pool.map(encode, items) if pool is not None else map(encode, items)
    records: list[Record] = []
    frames: list[bytes] = []
    offset = 0
    for (name, start, count), (tb, _, _, _), enc in zip(window, items, results, strict=True):
        stats.elements += count
        stats.raw_bytes += count * tb.data.dtype.itemsize
        if enc is None:
            continue
        op, n, gw, bits, esc_n, esc_w, gframe, cframe = enc
        stats.changed += n
        records.append(
            Record(
                name,
                op,
                tb.dtype,
                list(tb.shape),
                start,
                count,
                n,
                gw,
                bits,
                esc_n,
                esc_w,
                offset,
                len(gframe),
                len(cframe),
            )
        )
        frames += [gframe, cframe]
        offset += len(gframe) + len(cframe)
    return _assemble(records, frames) if records else None


def encode_windows(
    old: Mapping[str, TensorBits],
    new: Mapping[str, TensorBits],
    windows: list[tuple[int, list[Segment]]],
    mode: DeltaMode = "diff",
    level: int = 1,
    stats: DeltaStats | None = None,
    threads: int | None = None,
) -> Iterator[tuple[int, bytes]]:
    """(window index, chunk) for each given window that changed, lazily, in the order given."""
    threads = threads or default_threads()
    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    try:
        for i, window in windows:
            chunk = encode_window(old, new, window, mode, level, stats, pool)
            if chunk is not None:
                yield i, chunk
    finally:
        if pool is not None:
            pool.shutdown(wait=True)


def encode_delta(
    old: Mapping[str, TensorBits],
    new: Mapping[str, TensorBits],
    mode: DeltaMode = "diff",
    level: int = 1,
    chunk_bytes: int = CHUNK_BYTES,
    segment_elems: int = SEGMENT_ELEMS,
    stats: DeltaStats | None = None,
    threads: int | None = None,
) -> Iterator[bytes]:
    """Yield chunk objects that turn `old` into `new` (lazily: each chunk is encoded when asked for).

    Tensors missing from `new` need no record (the manifest lists the new state's tensors); unchanged
    segments produce no record; a delta with no change at all yields no chunk. The segments of one chunk
    are encoded on `threads` threads (default `default_threads()`); the output does not depend on it.
    """
    windows = plan_windows(expected_of(new), chunk_bytes, segment_elems)
    for _, chunk in encode_windows(old, new, list(enumerate(windows)), mode, level, stats, threads):
        yield chunk


def _assemble(records: list[Record], frames: list[bytes]) -> bytes:
    header = msgspec.msgpack.encode(ChunkHeader(records))
    return b"".join([MAGIC, len(header).to_bytes(4, "little"), header, *frames])


# --- decoding -------------------------------------------------------------------------------------------


def read_header(chunk: bytes) -> tuple[ChunkHeader, memoryview]:
    if len(chunk) < len(MAGIC) + 4 or chunk[: len(MAGIC)] != MAGIC:
        raise IntegrityError("delta chunk does not start with the PULSE magic")
    hlen = int.from_bytes(chunk[len(MAGIC) : len(MAGIC) + 4], "little")
    start = len(MAGIC) + 4
    if hlen > len(chunk) - start:
        raise IntegrityError("delta chunk header length exceeds the chunk")
    try:
        header = msgspec.msgpack.decode(chunk[start : start + hlen], type=ChunkHeader)
    except msgspec.DecodeError as e:
        raise IntegrityError(f"delta chunk header does not decode: {e}") from None
    return header, memoryview(chunk)[start + hlen :]


APPLY_ELEMS = 1 << 20  # elements copied from the base and then patched while still in cache


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
    """

    def __init__(
        self,
        base: Mapping[str, TensorBits],
        expected: Mapping[str, tuple[str, tuple[int, ...]]],
        threads: int | None = None,
        reuse: Mapping[str, np.ndarray] | None = None,
    ):
        self.base = base
        self.expected = expected
        self.work: dict[str, np.ndarray] = {}
        self.covered: dict[str, list[tuple[int, int]]] = {}
        self.threads = threads or default_threads()
        self.reuse = reuse or {}

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
        if n and int(gaps.max()) >= r.count:
            raise IntegrityError(f"delta record for {r.name!r} points past its segment")
        pos = gaps.astype(np.int64)
        pos += 1
        np.cumsum(pos, out=pos)
        pos -= 1
        if n and pos[-1] >= r.count:
            raise IntegrityError(f"delta record for {r.name!r} points past its segment")
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
        if r.op == "diff":
            codes += flat.dtype.type(1)
            codes = unzigzag(codes)
        src = self._base_of(r)
        assert src is not None  # _target checked it
        src = src.reshape(-1)[r.start : r.start + r.count]
        cuts = np.searchsorted(pos, np.arange(0, r.count, APPLY_ELEMS)[1:]).tolist()
        lo = 0
        for s, hi in zip(range(0, r.count, APPLY_ELEMS), [*cuts, n], strict=True):
            np.copyto(seg[s : s + APPLY_ELEMS], src[s : s + APPLY_ELEMS])
            p = pos[lo:hi]
            if r.op == "value":
                seg[p] = codes[lo:hi]
            else:
                seg[p] += codes[lo:hi]
            lo = hi
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
) -> BitState:
    """Convenience: apply all chunks at once (see DeltaApplier)."""
    ap = DeltaApplier(base, expected, threads=threads, reuse=reuse)
    for c in chunks:
        ap.apply(c)
    return ap.result()


def expected_of(state: Mapping[str, TensorBits]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The `expected` map of `DeltaApplier` (name -> (dtype, shape)) for a state."""
    return {n: (tb.dtype, tb.shape) for n, tb in state.items()}
