"""Tensors as raw bits: the dtype table, torch <-> numpy bit views, digests and safetensors shards.

PULSE never does floating-point arithmetic on weights: every tensor is held as an unsigned-integer view of
its bits (`TensorBits`), so NaN payloads, infinities and negative zero survive every copy unchanged.
Knows nothing about the store, versions or RL. torch is imported only inside the two conversion functions.

Digests (docs/pulse.md), all xxh3-128 as 32 hex characters:
    tensor digest  = H(raw little-endian bytes, C order)
    state digest   = H(for each tensor sorted by name: "name\\0dtype\\0d0,d1,..\\0tensor_digest\\n")
    chain digest   = H(parent_chain_digest || payload_digest || state_digest)   (the hex strings, ASCII)
    payload digest = H(the digests of the payload objects, in manifest order, joined by ",")
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from pnyx.errors import ConfigError, IntegrityError

if TYPE_CHECKING:
    import torch

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("pnyx.weights assumes a little-endian host (digests are over little-endian bytes)")

ZERO_DIGEST = "0" * 32

# logical dtype name -> (unsigned view, signed view used to cross into torch, safetensors code)
DTYPES: dict[str, tuple[type, type, str]] = {
    "bfloat16": (np.uint16, np.int16, "BF16"),
    "float16": (np.uint16, np.int16, "F16"),
    "float32": (np.uint32, np.int32, "F32"),
    "float64": (np.uint64, np.int64, "F64"),
    "int8": (np.uint8, np.int8, "I8"),
    "uint8": (np.uint8, np.uint8, "U8"),
    "int16": (np.uint16, np.int16, "I16"),
    "int32": (np.uint32, np.int32, "I32"),
    "int64": (np.uint64, np.int64, "I64"),
    "bool": (np.uint8, np.uint8, "BOOL"),
}
_ST_CODES = {code: name for name, (_, _, code) in DTYPES.items()}


@dataclass(frozen=True)
class TensorBits:
    """One tensor as its bits: `data` is a C-contiguous unsigned-int array of the tensor's shape.

    Treated as immutable once built: states share unchanged arrays across versions (copy on write).
    """

    dtype: str
    data: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def digest(self) -> str:
        return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(self.data).reshape(-1).data.cast("B"))


BitState = dict[str, TensorBits]


def unsigned_dtype(dtype: str) -> np.dtype:
    try:
        return np.dtype(DTYPES[dtype][0])
    except KeyError:
        raise ConfigError(
            f"unsupported weight dtype {dtype!r}: PULSE carries {sorted(DTYPES)}; load the model in one of them "
            "(model.dtype)"
        ) from None


def make_bits(dtype: str, data: np.ndarray) -> TensorBits:
    """Wrap an array already holding the bits of `dtype` (any integer view of the right width)."""
    u = unsigned_dtype(dtype)
    if data.dtype.itemsize != u.itemsize:
        raise ValueError(f"{dtype} needs {u.itemsize}-byte elements, got {data.dtype}")
    if not data.flags.c_contiguous:  # (np.ascontiguousarray would turn a 0-d array into 1-d)
        data = data.copy(order="C")
    return TensorBits(dtype, data.view(u))


# --- torch crossing ---------------------------------------------------------------------------------


def from_torch(tensors: Mapping[str, torch.Tensor], copy: bool = True) -> BitState:
    """Bits of a torch state dict (moved to CPU, made contiguous; copied unless `copy=False`)."""
    import torch

    out: BitState = {}
    for name, t in tensors.items():
        dtype = str(t.dtype).removeprefix("torch.")
        _, signed, _ = DTYPES.get(dtype, (None, None, None))
        if signed is None:
            raise ConfigError(
                f"tensor {name!r} has unsupported dtype {t.dtype}; PULSE carries {sorted(DTYPES)}"
            )
        t = t.detach().to("cpu").contiguous()
        view = t.view(getattr(torch, np.dtype(signed).name)) if t.dtype != torch.bool else t.view(torch.uint8)
        arr = view.numpy()
        out[name] = make_bits(dtype, arr.copy() if copy else arr)
    return out


def to_torch(state: Mapping[str, TensorBits]) -> dict[str, torch.Tensor]:
    """torch tensors (exact published dtype, CPU) sharing memory with the bits: do not write into them."""
    import torch

    out: dict[str, torch.Tensor] = {}
    for name, tb in state.items():
        signed = DTYPES[tb.dtype][1]
        t = torch.from_numpy(tb.data.view(signed))
        out[name] = t.view(getattr(torch, tb.dtype))
    return out


# --- digests ----------------------------------------------------------------------------------------


def h(data: bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def state_digest_of(entries: Iterable[tuple[str, str, Iterable[int], str]]) -> str:
    """State digest from (name, dtype, shape, tensor digest) tuples (sorted here by name)."""
    lines = [f"{n}\0{d}\0{','.join(str(int(x)) for x in s)}\0{g}\n" for n, d, s, g in sorted(entries)]
    return h("".join(lines).encode())


def state_digest(state: Mapping[str, TensorBits]) -> str:
    return state_digest_of((n, tb.dtype, tb.shape, tb.digest()) for n, tb in state.items())


def payload_digest_of(object_digests: Iterable[str]) -> str:
    return h(",".join(object_digests).encode())


def chain_digest_of(parent_chain: str, payload_digest: str, state_dig: str) -> str:
    return h(f"{parent_chain}{payload_digest}{state_dig}".encode())


# --- safetensors (written and read here so bf16 needs no torch) -------------------------------------


def write_safetensors(state: Mapping[str, TensorBits], metadata: dict[str, str] | None = None) -> bytes:
    """One safetensors file holding `state` (loadable by `safetensors.torch.load`)."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or {})}
    offset = 0
    names = sorted(state)
    for name in names:
        tb = state[name]
        header[name] = {
            "dtype": DTYPES[tb.dtype][2],
            "shape": list(tb.shape),
            "data_offsets": [offset, offset + tb.nbytes],
        }
        offset += tb.nbytes
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)
    parts = [len(hbytes).to_bytes(8, "little"), hbytes]
    parts += [np.ascontiguousarray(state[n].data).reshape(-1).data.cast("B") for n in names]
    return b"".join(parts)


def read_safetensors(data: bytes) -> BitState:
    """Parse a safetensors file into bits; any malformation raises IntegrityError."""
    if len(data) < 8:
        raise IntegrityError("safetensors shard shorter than its 8-byte header length")
    hlen = int.from_bytes(data[:8], "little")
    if hlen > len(data) - 8:
        raise IntegrityError(f"safetensors header length {hlen} exceeds the shard ({len(data)} bytes)")
    try:
        header = json.loads(bytes(data[8 : 8 + hlen]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise IntegrityError(f"safetensors header is not JSON: {e}") from None
    body = memoryview(data)[8 + hlen :]
    out: BitState = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _ST_CODES[spec["dtype"]]
            shape = tuple(int(x) for x in spec["shape"])
            start, end = (int(x) for x in spec["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise IntegrityError(f"safetensors entry {name!r} is malformed: {e!r}") from None
        u = unsigned_dtype(dtype)
        if not 0 <= start <= end <= len(body) or end - start != int(np.prod(shape)) * u.itemsize:
            raise IntegrityError(f"safetensors entry {name!r} has bad offsets [{start}, {end})")
        out[name] = TensorBits(dtype, np.frombuffer(body[start:end], dtype=u).reshape(shape).copy())
    return out
