"""The PULSE delta codec: the exact difference between two bit-states as a stream of zstd-compressed chunks.

Per tensor segment (a range of the flattened tensor, so large tensors stream), a `diff` record holds
  - the changed positions, gap-encoded (gap = distance to the previous change minus one), stored in the
    smallest unsigned byte width that fits the largest gap, byte planes split;
  - the change as the modular integer difference of the bit patterns (new - old mod 2^bits, never floating
    point), zigzag-mapped minus one (a change is never zero), stored in the smallest of 1/2/4/8/16/32/64
    bits that fits: sub-byte codes are bit-packed, wider ones byte-plane split.
Tensors that appear, or change dtype or shape, go `whole` (their bytes, byte planes split). A `value`
record stores new values instead of differences (kept for the benchmark's baseline).

Reconstruction is `old + change mod 2^bits`, bit-exact by construction; callers verify digests anyway.
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


# --- integer packing ------------------------------------------------------------------------------------

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _width_for(max_value: int) -> int:
    for w in (1, 2, 4, 8):
        if max_value < 1 << (8 * w):
            return w
    raise ValueError(f"value {max_value} does not fit in 64 bits")


def _bits_for(max_value: int) -> int:
    need = max(1, int(max_value).bit_length())
    return next(b for b in (1, 2, 4, 8, 16, 32, 64) if b >= need)


def _planes(values: np.ndarray, width: int) -> bytes:
    """Byte planes of `values` stored as `width`-byte unsigned ints: all low bytes, then the next, ..."""
    v = np.ascontiguousarray(values.astype(_UINT[width], copy=False))
    if width == 1:
        return v.tobytes()
    return v.view(np.uint8).reshape(-1, width).T.tobytes()


def _unplanes(data: memoryview | bytes, n: int, width: int) -> np.ndarray:
    arr = np.frombuffer(data, dtype=np.uint8, count=n * width)
    if width == 1:
        return arr.copy()
    return np.ascontiguousarray(arr.reshape(width, n).T).view(_UINT[width]).reshape(n)


def _pack_codes(codes: np.ndarray, bits: int) -> bytes:
    if bits >= 8:
        return _planes(codes, bits // 8)
    per = 8 // bits
    c = codes.astype(np.uint8)
    pad = -len(c) % per
    if pad:
        c = np.concatenate([c, np.zeros(pad, np.uint8)])
    c = c.reshape(-1, per)
    out = np.zeros(len(c), np.uint8)
    for i in range(per):
        out |= c[:, i] << np.uint8(i * bits)
    return out.tobytes()


_UNPACK = {
    bits: ((np.arange(256, dtype=np.uint16)[:, None] >> np.arange(0, 8, bits)) & ((1 << bits) - 1)).astype(np.uint8)
    for bits in (1, 2, 4)
}  # byte -> its 8/bits codes: one gather unpacks a whole stream


def _unpack_codes(data: memoryview | bytes, n: int, bits: int) -> np.ndarray:
    if bits >= 8:
        return _unplanes(data, n, bits // 8)
    arr = np.frombuffer(data, dtype=np.uint8, count=-(-n // (8 // bits)))
    return _UNPACK[bits][arr].reshape(-1)[:n]


def _packed_len(n: int, bits: int) -> int:
    return n * bits // 8 if bits >= 8 else -(-n // (8 // bits))


def zigzag(diff: np.ndarray) -> np.ndarray:
    """Map a modular difference (unsigned view) to its zigzag code: 0,-1,1,-2,2 -> 0,1,2,3,4."""
    s = diff.view(np.dtype(f"i{diff.dtype.itemsize}"))
    return ((s << 1) ^ (s >> (8 * diff.dtype.itemsize - 1))).view(diff.dtype)


def unzigzag(code: np.ndarray) -> np.ndarray:
    one = code.dtype.type(1)
    return (code >> one) ^ (code.dtype.type(0) - (code & one))


# --- one segment ----------------------------------------------------------------------------------------


def changed_positions(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Flat positions where two equal-length unsigned arrays differ (int64, ascending).

    (Comparing 8-byte words first was measured slower: the cost is in `nonzero`, per hit.)"""
    return np.flatnonzero(a != b)


def _code_candidates(codes: np.ndarray, cctx: zstandard.ZstdCompressor) -> tuple[int, int, int, bytes]:
    """(bits, esc_n, esc_width, compressed frame) of the smallest packing of `codes`.

    Candidates: the plain width that fits every code, and narrower widths whose top value escapes to an
    exception stream (weights near zero move many ulps per step, so a few codes are huge: without
    escapes they would widen every code of the segment)."""
    full = _bits_for(int(codes.max()))
    best: tuple[int, int, int, bytes] | None = None
    # 2-bit codes (+-1, -2 inline; the rest escaped) win on real Adam updates; 4 only when 2 escapes a lot.
    narrow = [2] if int(np.count_nonzero(codes >= 3)) <= len(codes) // 7 else [2, 4]
    for bits in sorted({b for b in narrow if b < full} | {full}):
        if bits == full:
            raw, esc_n, esc_w = _pack_codes(codes, bits), 0, 0
        else:
            top = codes.dtype.type((1 << bits) - 1)
            esc = codes >= top
            esc_n = int(np.count_nonzero(esc))
            if esc_n > len(codes) // 4:
                continue
            exc = codes[esc] - top
            esc_w = _width_for(int(exc.max())) if esc_n else 0
            raw = _pack_codes(np.minimum(codes, top), bits) + (_planes(exc, esc_w) if esc_n else b"")
        frame = cctx.compress(raw)
        if best is None or len(frame) < len(best[3]):
            best = (bits, esc_n, esc_w, frame)
    assert best is not None  # the `full` candidate is always tried
    return best


def _encode_segment(
    a: np.ndarray | None, b: np.ndarray, mode: DeltaMode, cctx: zstandard.ZstdCompressor
) -> tuple[Op, int, int, int, int, int, bytes, bytes] | None:
    """(op, n, gap_width, code_bits, esc_n, esc_width, gaps frame, codes frame), or None if unchanged."""
    w = b.dtype.itemsize
    if a is None:
        return "whole", len(b), 0, 8 * w, 0, 0, b"", cctx.compress(_planes(b, w))
    pos = changed_positions(a, b)
    n = len(pos)
    if n == 0:
        return None
    gaps = np.diff(pos, prepend=-1) - 1
    gw = _width_for(int(gaps.max()))
    gframe = cctx.compress(_planes(gaps, gw))
    new = b[pos]
    if mode == "value":
        return "value", n, gw, 8 * w, 0, 0, gframe, cctx.compress(_planes(new, w))
    codes = zigzag(new - a[pos]) - b.dtype.type(1)
    bits, esc_n, esc_w, cframe = _code_candidates(codes, cctx)
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


def encode_delta(
    old: Mapping[str, TensorBits],
    new: Mapping[str, TensorBits],
    mode: DeltaMode = "diff",
    level: int = 3,
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
    stats = stats if stats is not None else DeltaStats()
    threads = threads or default_threads()
    pending: list[tuple[str, TensorBits, np.ndarray | None, int, int]] = []
    covered = 0

    def encode(item: tuple[str, TensorBits, np.ndarray | None, int, int]):
        _, tb, fa, start, count = item
        a = fa[start : start + count] if fa is not None else None
        return _encode_segment(a, tb.data.reshape(-1)[start : start + count], mode, _cctx(level))

    def flush(pool: ThreadPoolExecutor | None) -> bytes | None:
        results = pool.map(encode, pending) if pool is not None else map(encode, pending)
        records: list[Record] = []
        frames: list[bytes] = []
        offset = 0
        for (name, tb, _, start, count), enc in zip(pending, results, strict=True):
            stats.elements += count
            stats.raw_bytes += count * tb.data.dtype.itemsize
            if enc is None:
                continue
            op, n, gw, bits, esc_n, esc_w, gframe, cframe = enc
            stats.changed += n
            records.append(
                Record(name, op, tb.dtype, list(tb.shape), start, count, n, gw, bits, esc_n, esc_w, offset,
                       len(gframe), len(cframe))
            )
            frames += [gframe, cframe]
            offset += len(gframe) + len(cframe)
        return _assemble(records, frames) if records else None

    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    try:
        for name in sorted(new):
            tb = new[name]
            base = old.get(name)
            same = base is not None and base.dtype == tb.dtype and base.shape == tb.shape
            if not same:
                stats.whole_tensors.add(name)
            fa = base.data.reshape(-1) if same and base is not None else None
            for start, count in _segments(tb, segment_elems):
                pending.append((name, tb, fa, start, count))
                covered += count * tb.data.dtype.itemsize
                if covered >= chunk_bytes:
                    chunk = flush(pool)
                    pending, covered = [], 0
                    if chunk is not None:
                        yield chunk
        if pending:
            chunk = flush(pool)
            if chunk is not None:
                yield chunk
    finally:
        if pool is not None:
            pool.shutdown(wait=True)


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


class DeltaApplier:
    """Applies chunks onto a base state without ever writing into the base (copy on first touch).

    `expected` maps each tensor of the target state to (dtype, shape); records naming anything else, or
    disagreeing with it, raise IntegrityError. `result()` returns the new state (untouched tensors are
    shared with the base).
    """

    def __init__(
        self,
        base: Mapping[str, TensorBits],
        expected: Mapping[str, tuple[str, tuple[int, ...]]],
        threads: int | None = None,
    ):
        self.base = base
        self.expected = expected
        self.work: dict[str, np.ndarray] = {}
        self.threads = threads or default_threads()

    def apply(self, chunk: bytes) -> None:
        """Apply one chunk: first the copies of every touched tensor, then the records, each step spread
        over threads (records of one chunk cover disjoint element ranges)."""
        header, body = read_header(chunk)
        firsts = list({r.name: r for r in reversed(header.records)}.values())
        if self.threads > 1 and len(header.records) > 1:
            with ThreadPoolExecutor(self.threads) as pool:
                list(pool.map(self._target, firsts))
                list(pool.map(lambda r: self._apply_record(r, body), header.records))
        else:
            for r in header.records:
                self._apply_record(r, body)

    def _target(self, r: Record) -> np.ndarray:
        exp = self.expected.get(r.name)
        if exp is None or exp[0] != r.dtype or tuple(exp[1]) != tuple(r.shape):
            raise IntegrityError(f"delta record for {r.name!r} ({r.dtype}{r.shape}) is not in the manifest as such")
        arr = self.work.get(r.name)
        if arr is not None:
            return arr
        u = unsigned_dtype(r.dtype)
        base = self.base.get(r.name)
        if r.op == "whole":
            arr = np.zeros(tuple(r.shape), dtype=u)
        elif base is not None and base.dtype == r.dtype and base.shape == tuple(r.shape):
            arr = base.data.copy()
        else:
            raise IntegrityError(f"delta record for {r.name!r} needs a base tensor {r.dtype}{r.shape} we do not hold")
        self.work[r.name] = arr
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
            raise IntegrityError(f"delta frame for {r.name!r} decompressed to {len(raw)} bytes, expected {size}")
        return raw

    def _apply_record(self, r: Record, body: memoryview) -> None:
        if r.op not in ("diff", "value", "whole"):
            raise IntegrityError(f"unknown delta op {r.op!r}")
        arr = self._target(r)
        flat = arr.reshape(-1)
        w = flat.dtype.itemsize
        if not (r.start >= 0 and r.count >= 0 and r.start + r.count <= flat.size and 0 <= r.n <= r.count):
            raise IntegrityError(f"delta record for {r.name!r} covers a bad range")
        n, bits = (r.count, 8 * w) if r.op == "whole" else (r.n, r.code_bits)
        gw = 0 if r.op == "whole" else r.gap_width
        if (r.op != "whole" and gw not in _UINT) or (r.op == "whole" and (r.gap_width or r.gap_len)):
            raise IntegrityError(f"delta record for {r.name!r} has gap width {gw}")
        if bits not in (1, 2, 4, 8, 16, 32, 64) or bits > 8 * w or (r.op != "diff" and bits != 8 * w):
            raise IntegrityError(f"delta record for {r.name!r} has code width {bits}")
        if not 0 <= r.esc_n <= n or (r.esc_width not in _UINT if r.esc_n else r.esc_width != 0) or (
            r.esc_n and r.op != "diff"
        ):
            raise IntegrityError(f"delta record for {r.name!r} has bad escapes")
        gaps_raw = self._frame(r, body, r.offset, r.gap_len, n * gw)
        codes_raw = self._frame(
            r, body, r.offset + r.gap_len, r.code_len, _packed_len(n, bits) + r.esc_n * r.esc_width
        )
        seg = flat[r.start : r.start + r.count]
        if r.op == "whole":
            seg[:] = _unplanes(codes_raw, n, w)
            return
        pos = np.cumsum(_unplanes(gaps_raw, n, gw).astype(np.int64) + 1) - 1
        if n and (pos[-1] >= r.count or pos[-1] < 0):
            raise IntegrityError(f"delta record for {r.name!r} points past its segment")
        codes = _unpack_codes(codes_raw, n, bits).astype(flat.dtype)
        if r.esc_n:
            top = flat.dtype.type((1 << bits) - 1)
            at = np.flatnonzero(codes == top)
            if len(at) != r.esc_n:
                raise IntegrityError(f"delta record for {r.name!r} has {len(at)} escapes, header says {r.esc_n}")
            exc = _unplanes(memoryview(codes_raw)[_packed_len(n, bits) :], r.esc_n, r.esc_width)
            codes[at] = top + exc.astype(flat.dtype)
        if r.op == "value":
            seg[pos] = codes
        else:
            seg[pos] += unzigzag(codes + flat.dtype.type(1))

    def result(self) -> BitState:
        out: BitState = {}
        for name, (dtype, _shape) in self.expected.items():
            if name in self.work:
                out[name] = TensorBits(dtype, self.work[name])
            elif name in self.base:
                out[name] = self.base[name]
            else:
                raise IntegrityError(f"tensor {name!r} is in the manifest but neither in the base nor the delta")
        return out


def apply_delta(base: Mapping[str, TensorBits], chunks: list[bytes], expected: Mapping[str, tuple[str, tuple[int, ...]]]) -> BitState:
    """Convenience: apply all chunks at once (see DeltaApplier)."""
    ap = DeltaApplier(base, expected)
    for c in chunks:
        ap.apply(c)
    return ap.result()


def expected_of(state: Mapping[str, TensorBits]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {n: (tb.dtype, tb.shape) for n, tb in state.items()}


# --- the entropy bound ----------------------------------------------------------------------------------


def _entropy_bits(values: np.ndarray) -> float:
    """n * empirical order-0 entropy of `values`, in bits."""
    if len(values) == 0:
        return 0.0
    _, counts = np.unique(values, return_counts=True)
    n = len(values)
    p = counts / n
    return float(-(counts * np.log2(p)).sum())


def entropy_bound_bytes(old: Mapping[str, TensorBits], new: Mapping[str, TensorBits]) -> float:
    """The entropy bound of a delta, in bytes.

    For each tensor present in both states with the same dtype and shape: with `pos` its changed flat
    positions, gaps g_i = pos_i - pos_{i-1} - 1 (pos_{-1} = -1) and changes c_i = new - old as signed
    integers of the bit width, the bound is n*H(g) + n*H(c) bits, where H is the empirical order-0 entropy
    of the values. Summed over tensors, divided by 8. Tensors sent whole are not counted.
    """
    total = 0.0
    for name, tb in new.items():
        base = old.get(name)
        if base is None or base.dtype != tb.dtype or base.shape != tb.shape:
            continue
        a, b = base.data.reshape(-1), tb.data.reshape(-1)
        pos = changed_positions(a, b)
        if len(pos) == 0:
            continue
        gaps = np.diff(pos, prepend=-1) - 1
        diff = (b[pos] - a[pos]).view(np.dtype(f"i{b.dtype.itemsize}"))
        total += _entropy_bits(gaps) + _entropy_bits(diff)
    return total / 8.0


