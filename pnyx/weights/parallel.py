"""Parallel publishing: which process encodes and uploads which payload object of a version.

A version's payload is cut from its layout alone (names, dtypes, shapes; never values): delta windows by
`codec.plan_windows`, anchor shards by `plan_shards`. `PublishPlan` gives each window and shard to one of
`world` publishers, in contiguous runs of about equal raw bytes, so every process holds the full bits of
only the tensors its own objects cover (a tensor that straddles two runs is held by both). Because the
cut does not depend on the number of processes, the objects, their order in the manifest, and so the
payload and chain digests are the same bits whether one process publishes or N do.

`Collective` is the only thing a publisher needs from its peers: gather a small object to rank 0 and
broadcast one back. `Solo` is the one-process collective; the trainer adapts torch.distributed to it.
Knows nothing about torch, the store or RL.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol, TypeVar

from pnyx.weights import int8 as q8
from pnyx.weights.bits import TensorBits, unsigned_dtype
from pnyx.weights.codec import CHUNK_BYTES, SEGMENT_ELEMS, Layout, Segment, plan_windows

T = TypeVar("T")


class Collective(Protocol):
    """The peers of a publisher: `rank` in `[0, world)`; rank 0 commits the manifest."""

    rank: int
    world: int

    def gather(self, obj: T) -> list[T] | None:
        """Every rank's `obj`, in rank order, on rank 0 (None elsewhere). Called by all ranks together."""
        ...

    def broadcast(self, obj: T) -> T:
        """Rank 0's `obj` on every rank. Called by all ranks together."""
        ...


class Solo:
    """The collective of a single publisher."""

    rank = 0
    world = 1

    def gather(self, obj: T) -> list[T] | None:
        return [obj]

    def broadcast(self, obj: T) -> T:
        return obj


def nbytes_of(dtype: str, shape: tuple[int, ...]) -> int:
    n = unsigned_dtype(dtype).itemsize
    for d in shape:
        n *= int(d)
    return n


def layout_of(state: Mapping[str, TensorBits]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {n: (tb.dtype, tb.shape) for n, tb in state.items()}


def plan_shards(layout: Layout, shard_bytes: int = CHUNK_BYTES) -> list[list[str]]:
    """Tensor names of each anchor shard: sorted by name, a shard closed before it would pass
    `shard_bytes` (a tensor is never split). An empty layout has one empty shard."""
    shards: list[list[str]] = []
    cur: list[str] = []
    size = 0
    for name in sorted(layout):
        nb = nbytes_of(*layout[name])
        if cur and size + nb > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += nb
    if cur or not layout:
        shards.append(cur)
    return shards


def int8_layout(layout: Layout, group: int = q8.GROUP) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The layout of the int8 actor plane of a state shaped like `layout` (see `int8.quantize`)."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, (dtype, shape) in layout.items():
        shape = tuple(shape)
        if q8.quantizable_shape(dtype, shape, group):
            out[name + q8.Q] = ("uint8", shape)
            out[name + q8.SCALE] = ("float32", (*shape[:-1], shape[-1] // group))
            out[name + q8.ZERO] = ("uint8", (*shape[:-1], shape[-1] // group))
        else:
            out[name] = (dtype, shape)
    return out


def int8_base(name: str) -> str:
    """The published tensor an int8-plane tensor is derived from."""
    for suffix in (q8.Q, q8.SCALE, q8.ZERO):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _owners(sizes: list[int], world: int) -> list[int]:
    """Contiguous runs of about equal bytes: item i goes to the rank whose share holds its first byte."""
    total = sum(sizes) or 1
    out, at = [], 0
    for s in sizes:
        out.append(min(world - 1, at * world // total))
        at += s
    return out


@dataclass(frozen=True)
class PlanePlan:
    """Who encodes what, for one plane (the published weights, or the int8 plane)."""

    layout: dict[str, tuple[str, tuple[int, ...]]]
    windows: list[list[Segment]]
    shards: list[list[str]]
    window_owner: list[int]
    shard_owner: list[int]

    @classmethod
    def make(cls, layout: Layout, world: int, chunk_bytes: int, segment_elems: int) -> PlanePlan:
        lay = {n: (d, tuple(s)) for n, (d, s) in layout.items()}
        windows = plan_windows(lay, chunk_bytes, segment_elems)
        shards = plan_shards(lay, chunk_bytes)
        item = {n: unsigned_dtype(d).itemsize for n, (d, _) in lay.items()}
        wsizes = [sum(c * item[n] for n, _, c in w) for w in windows]
        ssizes = [sum(nbytes_of(*lay[n]) for n in s) for s in shards]
        return cls(lay, windows, shards, _owners(wsizes, world), _owners(ssizes, world))

    def my_windows(self, rank: int) -> list[tuple[int, list[Segment]]]:
        return [(i, w) for i, w in enumerate(self.windows) if self.window_owner[i] == rank]

    def my_shards(self, rank: int) -> list[tuple[int, list[str]]]:
        return [(i, s) for i, s in enumerate(self.shards) if self.shard_owner[i] == rank]

    def digest_owner(self) -> dict[str, int]:
        """Each tensor is hashed by the rank whose window holds its first segment."""
        out: dict[str, int] = {}
        for i, w in enumerate(self.windows):
            for name, start, _ in w:
                if start == 0:
                    out.setdefault(name, self.window_owner[i])
        return out

    def needs(self, rank: int, anchor: bool) -> set[str]:
        """Tensors `rank` must hold in full: those of its windows, its digests, and (anchors) its shards."""
        out = {n for _, w in self.my_windows(rank) for n, _, _ in w}
        out |= {n for n, r in self.digest_owner().items() if r == rank}
        if anchor:
            out |= {n for _, s in self.my_shards(rank) for n in s}
        return out


@dataclass(frozen=True)
class PublishPlan:
    """The plans of every plane of one layout, for `world` publishers."""

    layout: dict[str, tuple[str, tuple[int, ...]]]
    world: int
    chunk_bytes: int = CHUNK_BYTES
    segment_elems: int = SEGMENT_ELEMS
    int8: bool = False

    @cached_property
    def weights(self) -> PlanePlan:
        return PlanePlan.make(self.layout, self.world, self.chunk_bytes, self.segment_elems)

    @cached_property
    def int8_plane(self) -> PlanePlan | None:
        if not self.int8:
            return None
        return PlanePlan.make(int8_layout(self.layout), self.world, self.chunk_bytes, self.segment_elems)

    def needs(self, rank: int) -> set[str]:
        """Published tensors `rank` must be given in full to publish any version (anchor or delta)."""
        out = self.weights.needs(rank, anchor=True)
        if self.int8_plane is not None:
            out |= {int8_base(n) for n in self.int8_plane.needs(rank, anchor=True)}
        return out

    def kept(self, rank: int) -> set[str]:
        """Published tensors whose bits `rank` keeps between versions (the base of its next delta)."""
        return self.weights.needs(rank, anchor=False)
