"""Weight manifests and the HEAD hint: the wire types, their JSON encoding, and reading them from a store.

A `WeightManifest` (create-only at `weights/v{V:08d}/manifest.json`) names everything a reader needs to
rebuild and verify version V: per plane (the published weights, and optionally the int8 actor plane) the
tensors (name, dtype, shape, xxh3-128), the payload objects with their sizes and digests, the parent's
chain digest and the chain digest `D_v = H(D_{v-1} || payload digest || state digest)`. The manifest also
carries a digest of its own canonical encoding, so a flipped byte anywhere in it is detected.

Truth is the highest manifest listed, never HEAD (a hint that may lag, or lead a missing version).
Knows nothing about torch, the codec or RL.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

import msgspec

from pnyx.errors import IntegrityError, NotFoundError
from pnyx.protocol import layout
from pnyx.store import Store
from pnyx.weights.bits import (
    ZERO_DIGEST,
    TensorBits,
    chain_digest_of,
    h,
    payload_digest_of,
    state_digest_of,
    unsigned_dtype,
)

SCHEMA = 1
Kind = Literal["anchor", "delta"]


class PayloadObject(msgspec.Struct):
    name: str  # object name inside the version folder (layout.weights_payload(version, name))
    size: int
    digest: str  # xxh3-128 of the object's bytes


class TensorEntry(msgspec.Struct):
    name: str
    dtype: str
    shape: list[int]
    digest: str  # xxh3-128 of the tensor's raw little-endian bytes


class PlaneManifest(msgspec.Struct):
    """One chain of states (the published weights, or the int8 actor plane) at one version."""

    tensors: list[TensorEntry]
    state_digest: str
    parent_digest: str  # chain digest of the parent version's plane (ZERO_DIGEST for the first)
    payload_digest: str  # H(digests of delta objects then anchor objects)
    chain_digest: str
    has_delta: bool  # the `delta` objects turn the parent's state into this one (possibly zero objects)
    delta: list[PayloadObject] = []
    anchor: list[PayloadObject] = []  # full state shards (anchors only)
    full_bytes: int = 0  # raw bytes of the full state
    changed: int = 0  # elements that differ from the parent (when has_delta)
    elements: int = 0

    def expected(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {t.name: (t.dtype, tuple(t.shape)) for t in self.tensors}

    def delta_bytes(self) -> int:
        return sum(o.size for o in self.delta)

    def anchor_bytes(self) -> int:
        return sum(o.size for o in self.anchor)


class WeightManifest(msgspec.Struct):
    schema: int
    version: int
    kind: str  # Kind
    parent_version: int | None
    anchor_version: int  # newest anchor at or before this version (this version, for an anchor)
    publisher: str  # the publisher's nonce; its payload object names carry it
    created_at: float
    weights: PlaneManifest
    int8: PlaneManifest | None = None
    int8_group: int = 64
    manifest_digest: str = ""  # H(canonical encoding with this field empty)

    @property
    def digest(self) -> str:
        """The chain digest of the published weights (what HEAD and parents point at)."""
        return self.weights.chain_digest

    def plane(self, name: Literal["weights", "int8"]) -> PlaneManifest:
        p = self.weights if name == "weights" else self.int8
        if p is None:
            raise IntegrityError(
                f"version {self.version} has no {name} plane: start the publisher with int8_plane=True"
            )
        return p


class Head(msgspec.Struct):
    version: int
    digest: str


def make_plane(
    state: Mapping[str, TensorBits],
    parent_digest: str,
    delta: list[PayloadObject] | None,
    anchor: list[PayloadObject],
    changed: int = 0,
    elements: int = 0,
    digests: Mapping[str, str] | None = None,
) -> PlaneManifest:
    """The plane manifest of `state` (tensor digests computed here unless given)."""
    digests = digests or {n: tb.digest() for n, tb in state.items()}
    layout = {n: (tb.dtype, tb.shape) for n, tb in state.items()}
    return plane_of(layout, digests, parent_digest, delta, anchor, changed, elements)


def plane_of(
    layout: Mapping[str, tuple[str, tuple[int, ...]]],
    digests: Mapping[str, str],
    parent_digest: str,
    delta: list[PayloadObject] | None,
    anchor: list[PayloadObject],
    changed: int = 0,
    elements: int = 0,
) -> PlaneManifest:
    """The plane manifest of a state known by its layout (name -> dtype, shape) and tensor digests only:
    what a parallel publisher's rank 0 has, since no process holds the whole state."""
    missing = sorted(set(layout) - set(digests))
    if missing:
        raise ValueError(f"no digest for tensors {missing[:3]} ({len(missing)} in all)")
    tensors = [
        TensorEntry(n, layout[n][0], [int(x) for x in layout[n][1]], digests[n]) for n in sorted(layout)
    ]
    sd = state_digest_of((t.name, t.dtype, t.shape, t.digest) for t in tensors)
    objs = list(delta or []) + list(anchor)
    pd = payload_digest_of(o.digest for o in objs)
    full = 0
    for t in tensors:
        n = unsigned_dtype(t.dtype).itemsize
        for d in t.shape:
            n *= d
        full += n
    return PlaneManifest(
        tensors=tensors,
        state_digest=sd,
        parent_digest=parent_digest,
        payload_digest=pd,
        chain_digest=chain_digest_of(parent_digest, pd, sd),
        has_delta=delta is not None,
        delta=list(delta or []),
        anchor=list(anchor),
        full_bytes=full,
        changed=changed,
        elements=elements,
    )


def verify_plane(
    plane: PlaneManifest, state: Mapping[str, TensorBits], what: str, digests: Mapping[str, str] | None = None
) -> None:
    """Raise IntegrityError unless `state` is exactly the plane's state and its digests chain up.

    `digests` may give already computed digests of (some of) these exact arrays, to skip re-hashing them."""
    digests = digests or {}
    exp = {t.name: t for t in plane.tensors}
    if set(exp) != set(state):
        missing, extra = sorted(set(exp) - set(state)), sorted(set(state) - set(exp))
        raise IntegrityError(
            f"{what}: tensor set differs from the manifest (missing {missing[:3]}, extra {extra[:3]})"
        )
    for name, t in exp.items():
        tb = state[name]
        if tb.dtype != t.dtype or list(tb.shape) != list(t.shape):
            raise IntegrityError(
                f"{what}: {name!r} is {tb.dtype}{list(tb.shape)}, manifest says {t.dtype}{t.shape}"
            )
        if (digests.get(name) or tb.digest()) != t.digest:
            raise IntegrityError(f"{what}: tensor {name!r} digest mismatch (the payload is corrupt or stale)")
    sd = state_digest_of((t.name, t.dtype, t.shape, t.digest) for t in plane.tensors)
    pd = payload_digest_of(o.digest for o in [*plane.delta, *plane.anchor])
    if sd != plane.state_digest or pd != plane.payload_digest:
        raise IntegrityError(f"{what}: state or payload digest does not match the manifest's own entries")
    if chain_digest_of(plane.parent_digest, pd, sd) != plane.chain_digest:
        raise IntegrityError(f"{what}: chain digest does not recompute from parent, payload and state")


# --- encoding -------------------------------------------------------------------------------------------


def _self_digest(m: WeightManifest) -> str:
    return h(msgspec.json.encode(msgspec.structs.replace(m, manifest_digest="")))


def encode_manifest(m: WeightManifest) -> bytes:
    m = msgspec.structs.replace(m, manifest_digest=_self_digest(m))
    return msgspec.json.format(msgspec.json.encode(m), indent=1)


def decode_manifest(data: bytes, version: int | None = None) -> WeightManifest:
    """Decode and check a manifest (schema, self digest, version); IntegrityError on any problem."""
    try:
        m = msgspec.json.decode(data, type=WeightManifest)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise IntegrityError(f"weight manifest does not decode: {e}") from None
    if m.schema != SCHEMA:
        raise IntegrityError(f"weight manifest schema {m.schema} is not {SCHEMA}: upgrade pnyx")
    if m.manifest_digest != _self_digest(m):
        raise IntegrityError(f"weight manifest v{m.version} fails its self digest (corrupt)")
    if version is not None and m.version != version:
        raise IntegrityError(f"manifest at v{version:08d} claims version {m.version}")
    return m


def encode_head(head: Head) -> bytes:
    return msgspec.json.encode(head)


# --- reading from a store ---------------------------------------------------------------------------


def read_manifest(store: Store, version: int) -> WeightManifest:
    """The manifest of `version` (NotFoundError if absent, IntegrityError if corrupt)."""
    return decode_manifest(store.get(layout.weights_manifest(version)), version)


def read_head(store: Store) -> Head | None:
    """The HEAD hint, or None if absent or unreadable (it is only a hint)."""
    try:
        return msgspec.json.decode(store.get(layout.WEIGHTS_HEAD), type=Head)
    except (NotFoundError, msgspec.DecodeError):
        return None


def manifest_versions(keys: Iterable[str]) -> list[int]:
    out = [v for v in (layout.parse_weights_manifest(k) for k in keys) if v is not None]
    return sorted(out)


def list_versions(store: Store, after: int | None = None) -> list[int]:
    """Versions that have a manifest, ascending (only those > `after` when given)."""
    start = layout.weights_dir(after + 1)[:-1] if after is not None else None
    return manifest_versions(m.key for m in store.list(layout.WEIGHTS_PREFIX, start_after=start))


def latest_version(store: Store) -> int | None:
    """The newest version with a manifest. Reads HEAD as a hint, then lists from it (HEAD may lag, or
    name a version whose manifest is missing; then the whole listing decides)."""
    head = read_head(store)
    if head is not None and 0 <= head.version <= 99_999_999:
        newer = manifest_versions(
            m.key
            for m in store.list(layout.WEIGHTS_PREFIX, start_after=layout.weights_dir(head.version)[:-1])
        )
        if newer:
            return newer[-1]
    versions = list_versions(store)
    return versions[-1] if versions else None


__all__ = [
    "SCHEMA",
    "ZERO_DIGEST",
    "Head",
    "Kind",
    "PayloadObject",
    "PlaneManifest",
    "TensorEntry",
    "WeightManifest",
    "decode_manifest",
    "encode_head",
    "encode_manifest",
    "latest_version",
    "list_versions",
    "make_plane",
    "plane_of",
    "read_head",
    "read_manifest",
    "verify_plane",
]
