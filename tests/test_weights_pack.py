"""The PULSE integer packing (pnyx.weights.pack): its byte layouts are the wire format, pinned here byte for
byte, and every packer's inverse returns its exact input at every width."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pnyx.weights.pack import UINT, pack_codes, packed_len, planes, unpack_codes, unplanes


def test_byte_planes_are_all_low_bytes_then_the_next():
    v = np.array([0x0102, 0x0304, 0xA0B0], np.uint16)
    assert planes(v, 2) == bytes([0x02, 0x04, 0xB0, 0x01, 0x03, 0xA0])
    w = np.array([0x01020304, 0xA0B0C0D0], np.uint32)
    assert planes(w, 4) == bytes([0x04, 0xD0, 0x03, 0xC0, 0x02, 0xB0, 0x01, 0xA0])
    assert planes(np.array([1, 2], np.uint64), 1) == b"\x01\x02"  # narrowed to the width asked for
    assert planes(np.array([1 << 56], np.uint64), 8) == bytes(7) + b"\x01"


def test_sub_byte_codes_put_the_first_code_in_the_lowest_bits():
    assert pack_codes(np.array([1, 2, 3, 0, 1], np.uint8), 2) == bytes([0b00111001, 0b00000001])
    assert pack_codes(np.array([0xA, 0x5, 0xF], np.uint8), 4) == bytes([0x5A, 0x0F])
    assert pack_codes(np.array([1, 0, 1, 1, 0, 0, 0, 1, 1], np.uint8), 1) == bytes([0b10001101, 0b1])


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.lists(st.integers(0, (1 << 64) - 1), max_size=300))
def test_unplanes_inverts_planes(width, values):
    v = (np.array(values, np.uint64) & np.uint64((1 << (8 * width)) - 1)).astype(UINT[width])
    raw = planes(v, width)
    assert len(raw) == width * len(v)
    back = unplanes(raw + b"trailing bytes are ignored", len(v), width)
    assert back.dtype == UINT[width]
    np.testing.assert_array_equal(back, v)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 2, 4, 8, 16, 32]), st.lists(st.integers(0, (1 << 32) - 1), max_size=300))
def test_unpack_codes_inverts_pack_codes(bits, values):
    dtype = np.uint8 if bits <= 8 else UINT[bits // 8]
    codes = (np.array(values, np.uint64) & np.uint64((1 << bits) - 1)).astype(dtype)
    raw = pack_codes(codes, bits)
    assert len(raw) == packed_len(len(codes), bits)
    np.testing.assert_array_equal(unpack_codes(raw, len(codes), bits), codes)


@pytest.mark.parametrize("width", [2, 4, 8])
def test_large_streams_round_trip(width):
    rng = np.random.default_rng(width)
    v = rng.integers(0, np.iinfo(UINT[width]).max, 1_000_003, dtype=UINT[width], endpoint=True)
    np.testing.assert_array_equal(unplanes(planes(v, width), len(v), width), v)
