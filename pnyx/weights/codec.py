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
Applying chunks onto a base lives in `apply.py`.
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
from pnyx.weights import kernels
from pnyx.weights.bits import TensorBits, unsigned_dtype
from pnyx.weights.pack import (
    code_candidates,
    gaps_of,
    planes,
    unzigzag,
    width_for,
    zigzag,
)
from pnyx.weights.scan import SCAN_ELEMS, changed_positions, changes, entropy_bound_bytes

__all__ = [
    "CHUNK_BYTES",
    "MAGIC",
    "SCAN_ELEMS",
    "SEGMENT_ELEMS",
    "ChunkHeader",
    "DeltaMode",
    "DeltaStats",
    "Layout",
    "Op",
    "Record",
    "Segment",
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
    if mode == "value":
        pos, new, _ = changes(a, b)
        if len(pos) == 0:
            return None
        gaps = gaps_of(pos)
        gw = width_for(int(gaps.max()))
        gframe = cctx.compress(planes(gaps, gw))
        return "value", len(pos), gw, 8 * w, 0, 0, gframe, cctx.compress(planes(new, w))
    gaps, codes = kernels.diff_codes(a, b)  # the one full-size pass (compiled where numba is installed)
    n = len(gaps)
    if n == 0:
        return None
    gw = width_for(int(gaps.max()))
    gframe = cctx.compress(planes(gaps, gw))
    bits, esc_n, esc_w, cframe = code_candidates(codes, cctx)
    return "diff", n, gw, bits, esc_n, esc_w, gframe, cframe


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


def expected_of(state: Mapping[str, TensorBits]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The `expected` map of `DeltaApplier` (name -> (dtype, shape)) for a state."""
    return {n: (tb.dtype, tb.shape) for n, tb in state.items()}
