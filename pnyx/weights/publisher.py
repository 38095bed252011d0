"""The trainer side of PULSE: publish each version as an anchor or a delta, then its manifest, then HEAD.

Order is the protocol (docs/architecture.md, "Commit protocol"): payload objects first (create-only, named with this publisher's
nonce), the manifest second (create-only: its existence means the payload is complete, and a second
publisher of the same version fails here with FencedError), HEAD last (a hint; compare-and-swap where the
store has it, so HEAD never moves backwards). Anchors also carry the delta from their parent, so a warm
follower never has to download a full state.

N processes may publish one version together (a sharded trainer): each encodes and uploads its own part
of the payload (`parallel.PublishPlan`), rank 0 gathers the objects' digests and commits the one manifest.
No process ever holds the whole state.

With a `signer` (the trainer's key, bound to the run: docs/security.md) the manifest is written at the name
only that key can compute (`manifest-{signature of V}.json`), its content and HEAD are signed, and the
fence check sees only versions that key named: a forged or squatted future version, a junk name or an
overwritten HEAD can neither fence this publisher out nor pull it off its chain.

Knows nothing about RL or optimizers; torch only at the `publish()` boundary (tensors -> bits).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from pnyx.errors import (
    AlreadyExistsError,
    ConfigError,
    FencedError,
    NotFoundError,
    PeerFailedError,
    PnyxError,
    PreconditionError,
)
from pnyx.protocol import layout
from pnyx.store import IfMatch, Store
from pnyx.weights import int8 as q8
from pnyx.weights.bits import ZERO_DIGEST, BitState, TensorBits, from_torch, to_torch
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
    plane_of,
    read_head,
    read_manifest,
)
from pnyx.weights.parallel import Collective, PublishPlan, Solo, int8_base, layout_of
from pnyx.weights.payload import write_shards, write_windows

if TYPE_CHECKING:
    import torch

    from pnyx.security.signing import Signer, Verifier

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


@dataclass
class _Part:
    """What one rank wrote for a version: its objects (by window/shard index), digests and counts."""

    rank: int
    delta: list[tuple[int, PayloadObject]] | None
    anchor: list[tuple[int, PayloadObject]]
    digests: dict[str, str]
    changed: int
    elements: int
    int8_delta: list[tuple[int, PayloadObject]] | None = None
    int8_anchor: list[tuple[int, PayloadObject]] = field(default_factory=list)
    int8_digests: dict[str, str] = field(default_factory=dict)
    int8_changed: int = 0
    int8_elements: int = 0
    error: str | None = None


def _merged(parts: list[_Part], what: str) -> list[PayloadObject] | None:
    lists = [getattr(p, what) for p in parts]
    if any(x is None for x in lists):
        return None
    return [o for _, o in sorted((pair for x in lists for pair in x), key=lambda pair: pair[0])]


def _plane_of_parts(
    parts: list[_Part], prefix: str, plane_layout: dict[str, tuple[str, tuple[int, ...]]], parent_digest: str
) -> PlaneManifest:
    """One plane's manifest from every rank's part: `prefix` "" for the weights, "int8_" for the int8 plane."""
    digests: dict[str, str] = {}
    for p in parts:
        digests.update(getattr(p, f"{prefix}digests"))
    return plane_of(
        plane_layout,
        digests,
        parent_digest,
        _merged(parts, f"{prefix}delta"),
        _merged(parts, f"{prefix}anchor") or [],
        sum(getattr(p, f"{prefix}changed") for p in parts),
        sum(getattr(p, f"{prefix}elements") for p in parts),
    )


class Publisher:
    """Publishes versions of one run's weights. One live publisher per run: others are fenced.

    anchor_every: a full anchor when `version - last_anchor >= anchor_every` (and for the first publish
    of this process, which has no previous state to diff against). int8_plane: also publish the int8
    actor plane (grid frozen at each anchor).

    comm: the publisher's peers when N processes publish one version together (`parallel.Collective`;
    default: this process alone). Every rank calls `publish` with the same version and layout and the
    tensors `needs(layout)` names; each encodes and uploads its own windows and shards, and rank 0 writes
    the one manifest and HEAD. The objects are the same bits for any number of ranks (`parallel.py`), so
    the chain digest of a state does not depend on how many processes published it.
    hook: called as `hook("before_manifest", version)` once this rank's payload is uploaded, before the
    manifest (the trainer's kill-test hook).
    signer: the trainer's `Signer`, bound to the run (None: unsigned manifests at `manifest.json`, for
    tests and tools; workers refuse those). Rank 0 alone uses it; it may be set after construction.
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
        comm: Collective | None = None,
        hook: Callable[[str, int], None] | None = None,
        signer: Signer | None = None,
    ):
        if anchor_every < 1:
            raise ConfigError(f"anchor_every must be >= 1 (trainer.anchor_every), got {anchor_every}")
        self.store = store
        self.anchor_every = anchor_every
        self.int8_plane = int8_plane
        self.chunk_bytes = chunk_bytes
        self.level = level
        self.comm: Collective = comm or Solo()
        self.hook = hook
        self.signer = signer
        self.nonce = layout.check_name(nonce or secrets.token_hex(4), "publisher nonce")
        self.version: int | None = None
        self.anchor_version: int | None = None
        self.last_stats: PublishStats | None = None
        self._state: BitState | None = None
        self._int8: BitState | None = None
        self._grid: q8.Grid = {}
        self._digest = ZERO_DIGEST
        self._int8_digest = ZERO_DIGEST
        self._plan: PublishPlan | None = None

    def plan(self, state_layout: Mapping[str, tuple[str, tuple[int, ...]]]) -> PublishPlan:
        """Who publishes what for this layout (the same plan on every rank)."""
        lay = {n: (d, tuple(int(x) for x in s)) for n, (d, s) in state_layout.items()}
        if self._plan is None or self._plan.layout != lay:
            self._plan = PublishPlan(lay, self.comm.world, self.chunk_bytes, int8=self.int8_plane)
        return self._plan

    def needs(self, state_layout: Mapping[str, tuple[str, tuple[int, ...]]]) -> set[str]:
        """The tensors this rank must be given in full to publish a state of this layout."""
        return self.plan(state_layout).needs(self.comm.rank)

    def publish(
        self,
        version: int,
        tensors: Mapping[str, torch.Tensor],
        force_anchor: bool = False,
        state_layout: Mapping[str, tuple[str, tuple[int, ...]]] | None = None,
    ) -> WeightManifest:
        """Publish `tensors` (any supported dtype, copied) as `version`. Raises FencedError if the version
        exists or another publisher has written past this one's last version.

        state_layout: the whole state's name -> (dtype, shape), when `tensors` is only this rank's share
        (`needs`); default: `tensors` is the whole state."""
        return self.publish_bits(version, from_torch(tensors), force_anchor, state_layout)

    def publish_bits(
        self,
        version: int,
        state: Mapping[str, TensorBits],
        force_anchor: bool = False,
        state_layout: Mapping[str, tuple[str, tuple[int, ...]]] | None = None,
    ) -> WeightManifest:
        """`publish` for a state already in bits (the state is kept; do not mutate it afterwards)."""
        t0 = time.perf_counter()
        plan = self.plan(state_layout if state_layout is not None else layout_of(state))
        rank = self.comm.rank
        need = plan.needs(rank)
        missing = sorted(need - set(state))
        if missing:
            raise ValueError(
                f"publish v{version}: rank {rank} was not given {missing[:3]} ({len(missing)} in all)"
            )
        state = {n: state[n] for n in need}
        for n, tb in state.items():
            if (tb.dtype, tb.shape) != plan.layout[n]:
                raise ValueError(
                    f"publish v{version}: {n!r} is {tb.dtype}{list(tb.shape)}, the layout says {plan.layout[n]}"
                )
        parent, anchor = self._decide(version, force_anchor)
        try:
            part = self._write_part(version, plan, state, anchor)
        except Exception as e:  # re-raised below, after the peers have heard of it (no one hangs)
            part, failure = _Part(rank, None, [], {}, 0, 0, error=f"{type(e).__name__}: {e}"), e
        else:
            failure = None
        if self.hook is not None and failure is None:
            self.hook("before_manifest", version)
        parts = self.comm.gather(part)
        outcome: tuple[str, Any] = ("", None)
        commit_error: PnyxError | None = None
        if parts is not None:
            try:
                outcome = self._commit(version, parent, anchor, plan, parts)
            except PnyxError as e:  # e.g. the store is down: tell the peers before raising it here
                outcome, commit_error = ("failed", f"rank 0 could not commit v{version}: {e}"), e
        outcome = self.comm.broadcast(outcome)
        if failure is not None:
            raise failure
        if commit_error is not None:
            raise commit_error
        if outcome[0] == "fenced":
            raise FencedError(outcome[1])
        if outcome[0] == "failed":
            raise PeerFailedError(outcome[1])
        m = cast(WeightManifest, outcome[1])
        anchor_version = version if anchor else self.anchor_version
        self.version, self.anchor_version, self._digest = version, anchor_version, m.weights.chain_digest
        self._state = {n: state[n] for n in plan.kept(rank)}
        if m.int8 is not None:
            self._int8_digest = m.int8.chain_digest
        w = m.weights
        self.last_stats = PublishStats(
            version=version,
            kind=m.kind,
            changed=w.changed,
            elements=w.elements,
            delta_bytes=w.delta_bytes(),
            anchor_bytes=w.anchor_bytes(),
            full_bytes=w.full_bytes,
            seconds=time.perf_counter() - t0,
            int8_changed=m.int8.changed if m.int8 else 0,
            int8_elements=m.int8.elements if m.int8 else 0,
            int8_bytes=(m.int8.delta_bytes() + m.int8.anchor_bytes()) if m.int8 else 0,
        )
        s = self.last_stats
        if rank == 0:
            log.info(
                "weights v=%d kind=%s changed=%.3f%% delta=%dB anchor=%dB full=%dB ranks=%d %.2fs",
                version,
                m.kind,
                100 * s.changed_fraction,
                s.delta_bytes,
                s.anchor_bytes,
                s.full_bytes,
                self.comm.world,
                s.seconds,
            )
        return m

    def published_tensors(self, plane: str = "weights") -> dict[str, torch.Tensor] | None:
        """The last version this publisher published, as workers decode it: the weights plane in the published
        dtype (sharing memory with the bits kept as the next delta's base: read only), the int8 plane
        dequantized to float32. None when this process does not hold the whole state (N ranks publish
        together) or has published nothing (or no int8 plane)."""
        if self.comm.world != 1:
            return None
        if plane == "weights":
            return None if self._state is None else to_torch(self._state)
        return None if self._int8 is None else q8.dequantize_torch(self._int8)

    # -- internals --
    def _decide(self, version: int, force_anchor: bool) -> tuple[int | None, bool]:
        """(parent version, anchor?), decided by rank 0 (fence check) and shared with every rank, together
        with the nonce and the parent's chain digests (a restarted trainer learns them from the store)."""
        decision: tuple[str, Any] = ("", None)
        error: Exception | None = None
        if self.comm.rank == 0:
            try:
                parent = self._check_fence(version)
                anchor = (
                    self._state is None
                    or force_anchor
                    or version - (self.anchor_version or 0) >= self.anchor_every
                )
                decision = ("ok", (parent, anchor, self.nonce, self._digest, self._int8_digest))
            except (PnyxError, ValueError) as e:  # fenced, a bad version, the store down: every rank stops
                decision, error = ("error", (type(e).__name__, str(e))), e
        decision = self.comm.broadcast(decision)
        if error is not None:
            raise error
        if decision[0] == "error":
            kind, msg = decision[1]
            raise {"FencedError": FencedError, "ValueError": ValueError}.get(kind, PeerFailedError)(msg)
        parent, anchor, self.nonce, self._digest, self._int8_digest = cast(tuple[Any, ...], decision[1])
        return parent, anchor

    def _write_part(self, version: int, plan: PublishPlan, state: BitState, anchor: bool) -> _Part:
        """Encode and upload this rank's windows and shards of every plane; hash the tensors it owns."""
        rank = self.comm.rank
        wp = plan.weights
        stats = DeltaStats()
        delta = None
        if self._state is not None:
            delta = write_windows(
                self.store,
                version,
                f"delta-{self.nonce}",
                self._state,
                state,
                wp.my_windows(rank),
                self.level,
                stats,
            )
        shards = (
            write_shards(self.store, version, f"anchor-{self.nonce}", state, wp.my_shards(rank))
            if anchor
            else []
        )
        digests = {n: state[n].digest() for n, r in wp.digest_owner().items() if r == rank}
        part = _Part(rank, delta, shards, digests, stats.changed, stats.elements)
        ip = plan.int8_plane
        if ip is None:
            return part
        base = {n: state[n] for n in {int8_base(x) for x in ip.needs(rank, anchor=True)}}
        if anchor:
            self._grid = q8.make_grid(base)
        plane_state, self._grid = q8.quantize(base, self._grid)
        plane_state = {n: plane_state[n] for n in ip.needs(rank, anchor)}
        istats = DeltaStats()
        if self._int8 is not None:
            part.int8_delta = write_windows(
                self.store,
                version,
                f"int8d-{self.nonce}",
                self._int8,
                plane_state,
                ip.my_windows(rank),
                self.level,
                istats,
            )
        if anchor:
            part.int8_anchor = write_shards(
                self.store, version, f"int8a-{self.nonce}", plane_state, ip.my_shards(rank)
            )
        part.int8_digests = {n: plane_state[n].digest() for n, r in ip.digest_owner().items() if r == rank}
        part.int8_changed, part.int8_elements = istats.changed, istats.elements
        self._int8 = {n: plane_state[n] for n in ip.needs(rank, anchor=False)}
        return part

    def _commit(
        self, version: int, parent: int | None, anchor: bool, plan: PublishPlan, parts: list[_Part]
    ) -> tuple[str, Any]:
        """Rank 0: the manifest from every rank's part (create-only: the fence), then HEAD."""
        failed = [p for p in parts if p.error is not None]
        if failed:
            return "failed", "; ".join(
                f"rank {p.rank} could not publish v{version}: {p.error}" for p in failed
            )
        plane = _plane_of_parts(parts, "", plan.weights.layout, self._digest)
        int8_plane = None
        if plan.int8_plane is not None:
            int8_plane = _plane_of_parts(parts, "int8_", plan.int8_plane.layout, self._int8_digest)
        anchor_version = version if anchor else self.anchor_version
        if anchor_version is None:
            raise RuntimeError("a delta always follows an anchor published by this process")  # unreachable
        m = WeightManifest(
            schema=SCHEMA,
            version=version,
            kind="anchor" if anchor else "delta",
            parent_version=parent,
            anchor_version=anchor_version,
            publisher=self.nonce,
            created_at=time.time(),
            weights=plane,
            int8=int8_plane,
            int8_group=q8.GROUP,
            parent_tag=self.signer.manifest_tag(parent)
            if self.signer is not None and parent is not None
            else "",
        )
        if self.signer is not None:
            key = layout.signed_weights_manifest(version, self.signer.manifest_tag(version))
        else:
            key = layout.weights_manifest(version)
        try:
            self.store.put(key, encode_manifest(m, self.signer), mode="create")
        except AlreadyExistsError:
            return "fenced", (
                f"weights v{version} was published by another trainer while this one ({self.nonce}) was "
                "writing: this process does not own the run. Stop it, or start a new run."
            )
        self._advance_head(version, plane.chain_digest)
        return "ok", m

    def _check_fence(self, version: int) -> int | None:
        """The parent version; FencedError if this publisher no longer owns the head of the run."""
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be a non-negative int, got {version!r}")
        if self.version is not None and version <= self.version:
            raise ValueError(f"version {version} must be greater than the last published {self.version}")
        latest = latest_version(self.store, self.trust)
        if self.version is None:
            if latest is not None and version <= latest:
                raise FencedError(
                    f"weights v{version} is not past the run's newest version v{latest}: another trainer owns it"
                )
            if latest is not None:  # a restarted trainer: chain onto the newest version, anchored
                m = read_manifest(self.store, latest, self.trust)
                self._digest = m.weights.chain_digest
                self._int8_digest = m.int8.chain_digest if m.int8 else ZERO_DIGEST
            return latest
        if latest != self.version:
            raise FencedError(
                f"weights v{latest} appeared after this publisher's v{self.version}: another trainer is "
                "publishing to this run. Stop this one."
            )
        return self.version

    @property
    def trust(self) -> Verifier | None:
        """The verifier of this publisher's own signatures (None when unsigned)."""
        return self.signer.verifier if self.signer is not None else None

    def _advance_head(self, version: int, digest: str) -> None:
        """Point HEAD at `version` unless it already names a newer one (CAS where supported)."""
        data = encode_head(Head(version, digest), self.signer)
        if not self.store.supports_cas:
            self.store.put(layout.WEIGHTS_HEAD, data, mode="overwrite")
            return
        for _ in range(8):
            try:
                etag = self.store.head(layout.WEIGHTS_HEAD).etag
            except NotFoundError:
                etag = None
            cur = read_head(self.store, self.trust)
            if cur is not None and cur.version >= version:
                return
            try:
                self.store.put(layout.WEIGHTS_HEAD, data, mode=IfMatch(etag) if etag else "create")
                return
            except (PreconditionError, AlreadyExistsError):
                continue
        log.warning(
            "weights HEAD: lost the compare-and-swap 8 times for v%d; readers list manifests anyway", version
        )
