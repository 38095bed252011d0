"""Integer packing for the PULSE delta codec: gaps, zigzag codes, byte planes, bit-packed codes, escapes.

Turns arrays of small unsigned integers (the gaps between changed positions, the zigzag codes of the
changes) into the raw byte streams that `codec.py` compresses, and back. Byte planes: a `width`-byte
integer array is stored as all its low bytes, then all the next bytes, ... (zstd finds the structure).
Sub-byte codes (1/2/4 bits) are bit-packed, lowest code in the lowest bits of each byte.

Knows nothing about chunks, records, zstd framing (beyond compressing candidate streams to compare their
size), tensors or the store. Invariant: every packer has an inverse here that returns the exact input
(`unplanes(planes(v, w), len(v), w) == v`, `unpack_codes(pack_codes(c, b), len(c), b) == c`,
`unzigzag(zigzag(d)) == d`); the byte layouts are the wire format and must never change.
"""

from __future__ import annotations

import numpy as np
import zstandard

UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}  # byte width -> unsigned dtype
CODE_BITS = (1, 2, 4, 8, 16, 32, 64)  # the widths a packed code may have


def width_for(max_value: int) -> int:
    """The smallest byte width (1, 2, 4 or 8) whose unsigned range holds `max_value`."""
    for w in (1, 2, 4, 8):
        if max_value < 1 << (8 * w):
            return w
    raise ValueError(f"value {max_value} does not fit in 64 bits")


def bits_for(max_value: int) -> int:
    """The smallest code width in `CODE_BITS` that holds `max_value`."""
    need = max(1, int(max_value).bit_length())
    return next(b for b in CODE_BITS if b >= need)


def planes(values: np.ndarray, width: int) -> bytes:
    """Byte planes of `values` stored as `width`-byte unsigned ints: all low bytes, then the next, ...

    Each plane is a shift and a narrowing cast (contiguous, vectorized), not a transposed copy of the
    bytes (a strided gather, ~10x slower)."""
    v = values.astype(UINT[width], copy=False)
    if width == 1:
        return np.ascontiguousarray(v).tobytes()
    out = np.empty((width, len(v)), np.uint8)
    for i in range(width):
        np.copyto(out[i], v >> UINT[width](8 * i), casting="unsafe")  # the low byte of each shifted value
    return out.tobytes()


def unplanes(data: memoryview | bytes, n: int, width: int) -> np.ndarray:
    """The `n` unsigned `width`-byte integers whose byte planes start `data` (a fresh array)."""
    arr = np.frombuffer(data, dtype=np.uint8, count=n * width)
    if width == 1:
        return arr.copy()
    arr = arr.reshape(width, n)
    out = arr[0].astype(UINT[width])
    for i in range(1, width):
        out |= arr[i].astype(UINT[width]) << UINT[width](8 * i)
    return out


def pack_codes(codes: np.ndarray, bits: int) -> bytes:
    """`codes` (each < 2**bits) as a byte stream: byte planes from 8 bits up, bit-packed below."""
    if bits >= 8:
        return planes(codes, bits // 8)
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


def unpack_codes(data: memoryview | bytes, n: int, bits: int) -> np.ndarray:
    """The `n` codes `pack_codes` wrote at the start of `data`."""
    if bits >= 8:
        return unplanes(data, n, bits // 8)
    per = 8 // bits
    arr = np.frombuffer(data, dtype=np.uint8, count=-(-n // per))
    out = np.empty((len(arr), per), np.uint8)
    mask = np.uint8((1 << bits) - 1)
    for i in range(per):  # code i of each byte: one shift and mask over the whole stream
        np.bitwise_and(arr >> np.uint8(i * bits), mask, out=out[:, i])
    return out.reshape(-1)[:n]


def packed_len(n: int, bits: int) -> int:
    """Bytes `pack_codes` writes for `n` codes of `bits` bits."""
    return n * bits // 8 if bits >= 8 else -(-n // (8 // bits))


def zigzag(diff: np.ndarray) -> np.ndarray:
    """Map a modular difference (unsigned view) to its zigzag code: 0,-1,1,-2,2 -> 0,1,2,3,4."""
    s = diff.view(np.dtype(f"i{diff.dtype.itemsize}"))
    return ((s << 1) ^ (s >> (8 * diff.dtype.itemsize - 1))).view(diff.dtype)


def unzigzag(code: np.ndarray) -> np.ndarray:
    """The inverse of `zigzag` (same unsigned dtype)."""
    one = code.dtype.type(1)
    return (code >> one) ^ (code.dtype.type(0) - (code & one))


def gaps_of(pos: np.ndarray) -> np.ndarray:
    """g_i = pos_i - pos_{i-1} - 1 with pos_{-1} = -1 (two passes, no concatenation)."""
    gaps = np.empty_like(pos)
    gaps[:1] = pos[:1]
    np.subtract(pos[1:], pos[:-1], out=gaps[1:])
    gaps[1:] -= 1
    return gaps


def code_candidates(codes: np.ndarray, cctx: zstandard.ZstdCompressor) -> tuple[int, int, int, bytes]:
    """(bits, esc_n, esc_width, compressed frame) of the smallest packing of `codes`.

    Candidates: the plain width that fits every code, and narrower widths whose top value escapes to an
    exception stream (weights near zero move many ulps per step, so a few codes are huge: without
    escapes they would widen every code of the segment). The plain width is skipped when it is 8 bits
    or more and 2-bit codes escape at most 1/4 of the changes: on Adam updates of a 100M Qwen2 it won only
    where >= 96% escaped, and compressing the wide stream costs as much as the rest of the segment."""
    full = bits_for(int(codes.max()))
    best: tuple[int, int, int, bytes] | None = None
    esc2 = int(np.count_nonzero(codes >= 3))
    # 2-bit codes (+-1, -2 inline; the rest escaped) win on real Adam updates; 4 only when 2 escapes a lot.
    narrow = [2] if esc2 <= len(codes) // 7 else [2, 4]
    tries = {b for b in narrow if b < full}
    if not (tries and full >= 8 and esc2 <= len(codes) // 4):
        tries.add(full)
    for bits in sorted(tries):
        if bits == full:
            raw, esc_n, esc_w = pack_codes(codes, bits), 0, 0
        else:
            top = codes.dtype.type((1 << bits) - 1)
            esc_n = esc2 if bits == 2 else int(np.count_nonzero(codes >= top))
            if esc_n > len(codes) // 4:
                continue
            exc = codes[codes >= top] - top if esc_n else codes[:0]
            esc_w = width_for(int(exc.max())) if esc_n else 0
            raw = pack_codes(np.minimum(codes, top), bits) + (planes(exc, esc_w) if esc_n else b"")
        frame = cctx.compress(raw)
        if best is None or len(frame) < len(best[3]):
            best = (bits, esc_n, esc_w, frame)
    if best is None:  # unreachable (the plain width is skipped only when 2-bit codes qualify); kept total
        best = (full, 0, 0, cctx.compress(pack_codes(codes, full)))
    return best
