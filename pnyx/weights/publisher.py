"""The trainer side of PULSE: publish each version as an anchor or a delta, then its manifest, then HEAD.

Order is the protocol (DESIGN.md §3): payload objects first (create-only, named with this publisher's
nonce), the manifest second (create-only: its existence means the payload is complete, and a second
publisher of the same version fails here with FencedError), HEAD last (a hint; compare-and-swap where the
store has it, so HEAD never moves backwards). Anchors also carry the delta from their parent, so a warm
follower never has to download a full state.

Knows nothing about RL or optimizers; torch only at the `publish()` boundary (tensors -> bits).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pnyx.errors import AlreadyExistsError, FencedError, NotFoundError, PreconditionError
from pnyx.protocol import layout
from pnyx.store import IfMatch, Store
from pnyx.weights import int8 as q8
from pnyx.weights.bits import ZERO_DIGEST, BitState, TensorBits, from_torch
from pnyx.weights.codec import CHUNK_BYTES, DeltaStats
from pnyx.weights.manifest import (
    SCHEMA,
    Head,
    PayloadObject,
    PlaneManifest,
    WeightManifest,
    encode_head,
    encode_manifest,
    latest_version,
    make_plane,
    read_head,
    read_manifest,
)
from pnyx.weights.payload import write_anchor, write_delta

if TYPE_CHECKING:
    import torch

log = logging.getLogger("pnyx.weights")


@dataclass
class PublishStats:
    """What one publish did (for the trainer's step line and the benchmark)."""

    version: int
    kind: str
    changed: int  # elements that differ from the previous published version (0 without a parent state)
    elements: int
    delta_bytes: int
    anchor_bytes: int
    full_bytes: int
    seconds: float
    int8_changed: int = 0
    int8_elements: int = 0
    int8_bytes: int = 0

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.elements if self.elements else 0.0


class Publisher:
    """Publishes versions of one run's weights. One live publisher per run: others are fenced.

    anchor_every: a full anchor when `version - last_anchor >= anchor_every` (and for the first publish
    of this process, which has no previous state to diff against). int8_plane: also publish the int8
    actor plane (grid frozen at each anchor).
    """

    def __init__(
        self,
        store: Store,
        anchor_every: int = 20,
        *,
        int8_plane: bool = False,
        chunk_bytes: int = CHUNK_BYTES,
        level: int = 1,
        nonce: str | None = None,
    ):
        if anchor_every < 1:
            raise ValueError(f"anchor_every must be >= 1, got {anchor_every}")
        self.store = store
        self.anchor_every = anchor_every
        self.int8_plane = int8_plane
        self.chunk_bytes = chunk_bytes
        self.level = level
        self.nonce = layout.check_name(nonce or secrets.token_hex(4), "publisher nonce")
        self.version: int | None = None
        self.anchor_version: int | None = None
        self.last_stats: PublishStats | None = None
        self._state: BitState | None = None
        self._int8: BitState | None = None
        self._grid: q8.Grid = {}
        self._digest = ZERO_DIGEST
        self._int8_digest = ZERO_DIGEST

    def publish(
        self, version: int, tensors: Mapping[str, torch.Tensor], force_anchor: bool = False
    ) -> WeightManifest:
        """Publish `tensors` (any supported dtype, copied) as `version`. Raises FencedError if the version
        exists or another publisher has written past this one's last version."""
        return self.publish_bits(version, from_torch(tensors), force_anchor)

    def publish_bits(self, version: int, state: Mapping[str, TensorBits], force_anchor: bool = False) -> WeightManifest:
        """`publish` for a state already in bits (the state is kept; do not mutate it afterwards)."""
        t0 = time.perf_counter()
        state = dict(state)
        parent = self._check_fence(version)
        anchor = self._state is None or force_anchor or version - (self.anchor_version or 0) >= self.anchor_every
        kind = "anchor" if anchor else "delta"
        stats = DeltaStats()
        delta: list[PayloadObject] | None = None
        if self._state is not None:
            delta = write_delta(self.store, version, f"delta-{self.nonce}", self._state, state, self.chunk_bytes, self.level, stats)
        shards = write_anchor(self.store, version, f"anchor-{self.nonce}", state, self.chunk_bytes) if anchor else []
        plane = make_plane(state, self._digest, delta, shards, stats.changed, stats.elements)
        int8_plane, int8_state, int8_stats = self._int8_plane(version, state, anchor)
        anchor_version = version if anchor else self.anchor_version
        assert anchor_version is not None  # a delta always follows an anchor published by this process
        m = WeightManifest(
            schema=SCHEMA,
            version=version,
            kind=kind,
            parent_version=parent,
            anchor_version=anchor_version,
            publisher=self.nonce,
            created_at=time.time(),
            weights=plane,
            int8=int8_plane,
            int8_group=q8.GROUP,
        )
        try:
            self.store.put(layout.weights_manifest(version), encode_manifest(m), mode="create")
        except AlreadyExistsError:
            raise FencedError(
                f"weights v{version} was published by another trainer while this one ({self.nonce}) was "
                "writing: this process does not own the run. Stop it, or start a new run."
            ) from None
        self._advance_head(version, plane.chain_digest)
        self.version, self.anchor_version, self._state, self._digest = version, anchor_version, state, plane.chain_digest
        if int8_plane is not None:
            self._int8, self._int8_digest = int8_state, int8_plane.chain_digest
        self.last_stats = PublishStats(
            version=version,
            kind=kind,
            changed=stats.changed,
            elements=stats.elements,
            delta_bytes=plane.delta_bytes(),
            anchor_bytes=plane.anchor_bytes(),
            full_bytes=plane.full_bytes,
            seconds=time.perf_counter() - t0,
            int8_changed=int8_stats.changed,
            int8_elements=int8_stats.elements,
            int8_bytes=(int8_plane.delta_bytes() + int8_plane.anchor_bytes()) if int8_plane else 0,
        )
        s = self.last_stats
        log.info(
            "weights v=%d kind=%s changed=%.3f%% delta=%dB anchor=%dB full=%dB %.2fs",
            version, kind, 100 * s.changed_fraction, s.delta_bytes, s.anchor_bytes, s.full_bytes, s.seconds,
        )
        return m

    # -- internals --
    def _check_fence(self, version: int) -> int | None:
        """The parent version; FencedError if this publisher no longer owns the head of the run."""
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be a non-negative int, got {version!r}")
        if self.version is not None and version <= self.version:
            raise ValueError(f"version {version} must be greater than the last published {self.version}")
        latest = latest_version(self.store)
        if self.version is None:
            if latest is not None and version <= latest:
                raise FencedError(f"weights v{version} is not past the run's newest version v{latest}: another trainer owns it")
            if latest is not None:  # a restarted trainer: chain onto the newest version, anchored
                m = read_manifest(self.store, latest)
                self._digest = m.weights.chain_digest
                self._int8_digest = m.int8.chain_digest if m.int8 else ZERO_DIGEST
            return latest
        if latest != self.version:
            raise FencedError(
                f"weights v{latest} appeared after this publisher's v{self.version}: another trainer is "
                "publishing to this run. Stop this one."
            )
        return self.version

    def _int8_plane(self, version: int, state: BitState, anchor: bool) -> tuple[PlaneManifest | None, BitState, DeltaStats]:
        stats = DeltaStats()
        if not self.int8_plane:
            return None, {}, stats
        if anchor:
            self._grid = q8.make_grid(state)
        plane_state, self._grid = q8.quantize(state, self._grid)
        delta = None
        if self._int8 is not None:
            delta = write_delta(self.store, version, f"int8d-{self.nonce}", self._int8, plane_state, self.chunk_bytes, self.level, stats)
        shards = write_anchor(self.store, version, f"int8a-{self.nonce}", plane_state, self.chunk_bytes) if anchor else []
        return make_plane(plane_state, self._int8_digest, delta, shards, stats.changed, stats.elements), plane_state, stats

    def _advance_head(self, version: int, digest: str) -> None:
        """Point HEAD at `version` unless it already names a newer one (CAS where supported)."""
        data = encode_head(Head(version, digest))
        if not self.store.supports_cas:
            self.store.put(layout.WEIGHTS_HEAD, data, mode="overwrite")
            return
        for _ in range(8):
            try:
                etag = self.store.head(layout.WEIGHTS_HEAD).etag
            except NotFoundError:
                etag = None
            cur = read_head(self.store)
            if cur is not None and cur.version >= version:
                return
            try:
                self.store.put(layout.WEIGHTS_HEAD, data, mode=IfMatch(etag) if etag else "create")
                return
            except (PreconditionError, AlreadyExistsError):
                continue
        log.warning("weights HEAD: lost the compare-and-swap 8 times for v%d; readers list manifests anyway", version)
