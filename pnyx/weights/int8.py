"""The int8 actor plane: group-wise asymmetric 8-bit codes against a grid frozen at each anchor.

For every floating tensor with at least two dimensions whose last dimension is a multiple of the group
(64), each group of 64 consecutive elements along the last axis gets a float32 `scale` and a uint8
`zero` computed at an anchor from that anchor's weights; until the next anchor the grid stays fixed, so
a code changes only when a weight crosses a grid boundary and the plane's deltas stay tiny. Other tensors
(norms, biases, odd shapes) travel as their published bits.

The plane is itself a bit-state (names `T@q` for codes, `T@scale`, `T@zero`; other tensors under their own
name), so it rides the same codec, manifests and chain as the published weights. Knows nothing about the
store; torch only inside `dequantize_torch`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from pnyx.weights.bits import BitState, TensorBits

if TYPE_CHECKING:
    import torch

GROUP = 64
Q, SCALE, ZERO = "@q", "@scale", "@zero"
_FLOAT = ("bfloat16", "float16", "float32", "float64")

Grid = dict[str, tuple[np.ndarray, np.ndarray]]  # name -> (scale float32 [..., G], zero uint8 [..., G])


def to_float32(tb: TensorBits) -> np.ndarray:
    """Float32 values of a floating tensor's bits (exact for bf16 and fp16)."""
    d = tb.data
    if tb.dtype == "bfloat16":
        return (d.astype(np.uint32) << np.uint32(16)).view(np.float32)
    if tb.dtype == "float16":
        return d.view(np.float16).astype(np.float32)
    if tb.dtype == "float32":
        return d.view(np.float32)
    if tb.dtype == "float64":
        return d.view(np.float64).astype(np.float32)
    raise ValueError(f"{tb.dtype} is not a floating dtype")


def quantizable_shape(dtype: str, shape: tuple[int, ...], group: int = GROUP) -> bool:
    """Whether a tensor of this dtype and shape gets int8 codes (else it travels as its bits)."""
    return dtype in _FLOAT and len(shape) >= 2 and shape[-1] % group == 0 and shape[-1] > 0


def quantizable(tb: TensorBits, group: int = GROUP) -> bool:
    return quantizable_shape(tb.dtype, tb.shape, group)


def _grouped(w: np.ndarray, group: int) -> np.ndarray:
    return w.reshape(*w.shape[:-1], w.shape[-1] // group, group)


def grid_for(tb: TensorBits, group: int = GROUP) -> tuple[np.ndarray, np.ndarray]:
    """(scale, zero) per group from the tensor's current values (non-finite values are ignored)."""
    w = _grouped(to_float32(tb), group)
    finite = np.isfinite(w)
    lo = np.minimum(np.where(finite, w, np.inf).min(axis=-1), 0.0)
    hi = np.maximum(np.where(finite, w, -np.inf).max(axis=-1), 0.0)
    scale = ((hi - lo) / 255.0).astype(np.float32)
    scale = np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)
    zero = np.clip(np.rint(-lo / scale), 0, 255).astype(np.uint8)
    return scale, zero


def make_grid(state: Mapping[str, TensorBits], group: int = GROUP) -> Grid:
    """A fresh grid for every quantizable tensor (done at anchors)."""
    return {n: grid_for(tb, group) for n, tb in state.items() if quantizable(tb, group)}


def quantize(state: Mapping[str, TensorBits], grid: Grid, group: int = GROUP) -> tuple[BitState, Grid]:
    """The int8 plane of `state` on `grid`. Tensors new to the grid (or reshaped) get a grid of their own,
    returned in the updated grid (the caller keeps it until the next anchor)."""
    grid = dict(grid)
    out: BitState = {}
    for name, tb in state.items():
        if not quantizable(tb, group):
            out[name] = tb
            continue
        g = grid.get(name)
        if g is None or g[0].shape != (*tb.shape[:-1], tb.shape[-1] // group):
            g = grid[name] = grid_for(tb, group)
        scale, zero = g
        w = _grouped(to_float32(tb), group)
        w = np.nan_to_num(
            w, nan=0.0, posinf=float(np.finfo(np.float32).max), neginf=float(np.finfo(np.float32).min)
        )
        q = np.clip(np.rint(w / scale[..., None]) + zero[..., None], 0, 255).astype(np.uint8)
        out[name + Q] = TensorBits("uint8", q.reshape(tb.shape))
        out[name + SCALE] = TensorBits("float32", np.ascontiguousarray(scale).view(np.uint32))
        out[name + ZERO] = TensorBits("uint8", np.ascontiguousarray(zero))
    for name in grid.keys() - state.keys():
        del grid[name]
    return out, grid


def dequantize(plane: Mapping[str, TensorBits], group: int = GROUP) -> dict[str, np.ndarray]:
    """Float32 weights from an int8 plane: (code - zero) * scale; passthrough tensors as their values
    (non-floating passthrough tensors keep their integer values)."""
    out: dict[str, np.ndarray] = {}
    for name, tb in plane.items():
        if name.endswith((SCALE, ZERO)):
            continue
        if name.endswith(Q):
            base = name[: -len(Q)]
            scale = plane[base + SCALE].data.view(np.float32)
            zero = plane[base + ZERO].data.astype(np.float32)
            q = _grouped(tb.data.astype(np.float32), group)
            out[base] = ((q - zero[..., None]) * scale[..., None]).reshape(tb.shape)
        elif tb.dtype in _FLOAT:
            out[name] = to_float32(tb)
        else:
            out[name] = tb.data.view(np.dtype(tb.dtype) if tb.dtype != "bool" else np.bool_)
    return out


def dequantize_torch(plane: Mapping[str, TensorBits], group: int = GROUP) -> dict[str, torch.Tensor]:
    """`dequantize` as torch tensors (float32 for floating weights), ready for `load_state_dict`."""
    import torch

    return {n: torch.from_numpy(np.ascontiguousarray(a)) for n, a in dequantize(plane, group).items()}


def code_change_fraction(old: Mapping[str, TensorBits], new: Mapping[str, TensorBits]) -> float:
    """Fraction of int8 codes (only the `@q` tensors) that differ between two planes."""
    changed = total = 0
    for name, tb in new.items():
        if name.endswith(Q) and name in old and old[name].shape == tb.shape:
            changed += int(np.count_nonzero(old[name].data != tb.data))
            total += tb.data.size
    return changed / total if total else 0.0
