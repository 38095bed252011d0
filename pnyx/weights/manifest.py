"""Weight manifests and the HEAD hint: the wire types, their JSON encoding, and reading them from a store.

A `WeightManifest` (create-only at `weights/v{V:08d}/manifest.json`) names everything a reader needs to
rebuild and verify version V: per plane (the published weights, and optionally the int8 actor plane) the
tensors (name, dtype, shape, xxh3-128), the payload objects with their sizes and digests, the parent's
chain digest and the chain digest `D_v = H(D_{v-1} || payload digest || state digest)`. The manifest also
carries a digest of its own canonical encoding, so a flipped byte anywhere in it is detected.

Truth is the highest manifest listed, never HEAD (a hint that may lag, or lead a missing version).

Signed weights (docs/security.md): a publisher with a `Signer` writes version V's manifest at
`weights/v{V:08d}/manifest-{tag}.json`, where the tag is its Ed25519 signature of V, and signs the
manifest's content and HEAD. A reader given the trainer's `Verifier` (`trust=`) sees only manifests whose
name tag verifies (from the listing alone, no download): junk or squatted names, forged future versions
and unsigned manifests are invisible to it, so they can neither block the trainer nor be followed; a
manifest whose content signature does not verify (an overwritten object) raises IntegrityError; each name
it ignores is logged once, with why (`ignored_reason`), and kept in `trust.ignored`. Readers of a run get
their `trust` from run.json through `pnyx.weights.trusted`. Readers without `trust` (tests, stores without a
run, views of an unsigned run) take `manifest.json`, else the first manifest-* that decodes.
Knows nothing about torch, the codec or RL; the `Signer`/`Verifier` are passed in.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal

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

if TYPE_CHECKING:
    from pnyx.security.signing import Signer, Verifier

log = logging.getLogger("pnyx.weights")

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
    parent_tag: str = ""  # name tag of the parent's signed manifest (signed readers walk parents unlisted)
    manifest_digest: str = ""  # H(canonical encoding with this field and `signature` empty)
    signature: str = ""  # the trainer's Ed25519 signature (hex) of the encoding with this field empty

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
    signature: str = ""  # the trainer's signature of (version, digest), hex; "" from an unsigned publisher


def _head_message(version: int, digest: str) -> bytes:
    return b"%d\0" % version + digest.encode()


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
    return h(msgspec.json.encode(msgspec.structs.replace(m, manifest_digest="", signature="")))


def _signed_bytes(m: WeightManifest) -> bytes:
    return msgspec.json.encode(msgspec.structs.replace(m, signature=""))


def encode_manifest(m: WeightManifest, signer: Signer | None = None) -> bytes:
    """The manifest's JSON with its self digest, and its signature when a `signer` is given."""
    m = msgspec.structs.replace(m, manifest_digest=_self_digest(m), signature="")
    if signer is not None:
        m = msgspec.structs.replace(m, signature=signer.sign_hex("manifest", _signed_bytes(m)))
    return msgspec.json.format(msgspec.json.encode(m), indent=1)


def decode_manifest(data: bytes, version: int | None = None, trust: Verifier | None = None) -> WeightManifest:
    """Decode and check a manifest (schema, self digest, version, and with `trust` its signature);
    IntegrityError on any problem."""
    try:
        m = msgspec.json.decode(data, type=WeightManifest)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as e:
        raise IntegrityError(f"weight manifest does not decode: {e}") from None
    if m.schema != SCHEMA:
        raise IntegrityError(f"weight manifest schema {m.schema} is not {SCHEMA}: upgrade pnyx")
    if m.manifest_digest != _self_digest(m):
        raise IntegrityError(f"weight manifest v{m.version} fails its self digest (corrupt)")
    if version is not None and m.version != version:
        raise IntegrityError(f"manifest at v{version:08d} claims version {m.version}")
    if trust is not None and not trust.check_hex("manifest", _signed_bytes(m), m.signature):
        raise IntegrityError(
            f"weight manifest v{m.version} is {'not signed' if not m.signature else 'wrongly signed'}: "
            f"it does not verify under the trainer key {trust.fingerprint}; refused"
        )
    parent = m.parent_version
    if trust is not None and parent is not None and m.parent_tag and trust.check_tag(parent, m.parent_tag):
        trust.manifest_names.setdefault(parent, layout.signed_weights_manifest(parent, m.parent_tag))
    return m


def encode_head(head: Head, signer: Signer | None = None) -> bytes:
    if signer is not None:
        head = Head(
            head.version, head.digest, signer.sign_hex("head", _head_message(head.version, head.digest))
        )
    return msgspec.json.encode(head)


# --- reading from a store ---------------------------------------------------------------------------


def read_manifest(store: Store, version: int, trust: Verifier | None = None) -> WeightManifest:
    """The manifest of `version` (NotFoundError if absent, IntegrityError if corrupt or, with `trust`,
    not signed by the trainer). With `trust`, only the manifest named by the trainer's tag is read."""
    if trust is not None:
        key = trust.manifest_names.get(version)
        if key is None:
            keys = manifest_keys(store.list(layout.weights_manifest_candidates(version)), trust)
            key = keys.get(version)
        if key is None:
            raise NotFoundError(
                f"no manifest of weights v{version} signed by the trainer key {trust.fingerprint}"
            )
        return decode_manifest(store.get(key), version, trust)
    try:
        return decode_manifest(store.get(layout.weights_manifest(version)), version)
    except NotFoundError:
        keys = [m.key for m in store.list(layout.weights_manifest_candidates(version))]
    problems = []
    for key in sorted(k for k in keys if (layout.parse_any_weights_manifest(k) or (-1,))[0] == version):
        try:
            return decode_manifest(store.get(key), version)
        except (IntegrityError, NotFoundError) as e:
            problems.append(str(e))
    if problems:
        raise IntegrityError(f"no manifest of weights v{version} decodes: {'; '.join(problems)}")
    raise NotFoundError(f"weights v{version} has no manifest")


def read_head(store: Store, trust: Verifier | None = None) -> Head | None:
    """The HEAD hint, or None if absent, unreadable or (with `trust`) not signed by the trainer."""
    try:
        head = msgspec.json.decode(store.get(layout.WEIGHTS_HEAD), type=Head)
    except (NotFoundError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    if trust is not None and not trust.check_hex(
        "head", _head_message(head.version, head.digest), head.signature
    ):
        return None
    return head


def manifest_keys(metas: Iterable, trust: Verifier | None = None) -> dict[int, str]:
    """Version -> manifest key, from listed objects. With `trust`, only names whose tag the trainer signed
    (and they are remembered in `trust.manifest_names`, so reading them needs no listing); without, the
    unsigned `manifest.json` or else the first signed-form name."""
    out: dict[int, str] = {}
    for meta in metas:
        key = getattr(meta, "key", meta)
        parsed = layout.parse_any_weights_manifest(key)
        if parsed is None:
            continue
        version, tag = parsed
        if trust is None:
            if tag is None or version not in out:
                out[version] = key
        elif tag is not None and trust.check_tag(version, tag):
            out[version] = key
            trust.manifest_names[version] = key
        elif key not in trust.ignored:
            why = f"{ignored_reason(tag)}, not signed by the trainer key {trust.fingerprint}"
            trust.ignored[key] = why
            log.warning("weights: ignoring v%d (%s): %s", version, key, why)
    return out


def ignored_reason(tag: str | None) -> str:
    """What a manifest object the trainer's key did not name is, from its name's `tag` alone (None: the
    unsigned `manifest.json` name; nothing is downloaded to tell)."""
    if tag is None:
        return "an unsigned manifest.json"
    return "another key's manifest, or junk (its name is not the trainer's signature)"


def manifest_versions(metas: Iterable[Any], trust: Verifier | None = None) -> list[int]:
    """Versions with a manifest among listed objects (or keys); see `manifest_keys`."""
    return sorted(manifest_keys(metas, trust))


def list_versions(store: Store, after: int | None = None, trust: Verifier | None = None) -> list[int]:
    """Versions that have a manifest (with `trust`: a manifest the trainer named), ascending (only those >
    `after` when given)."""
    start = layout.weights_dir(after + 1)[:-1] if after is not None else None
    return manifest_versions(store.list(layout.WEIGHTS_PREFIX, start_after=start), trust)


def latest_version(store: Store, trust: Verifier | None = None) -> int | None:
    """The newest version with a manifest (with `trust`: one the trainer named; forged or squatted future
    versions are not seen). Reads HEAD as a hint, then lists from it (HEAD may lag, or name a version whose
    manifest is missing; then the whole listing decides)."""
    head = read_head(store, trust)
    if head is not None and 0 <= head.version <= 99_999_999:
        newer = manifest_versions(
            store.list(layout.WEIGHTS_PREFIX, start_after=layout.weights_dir(head.version)[:-1]), trust
        )
        if newer:
            return newer[-1]
    versions = list_versions(store, trust=trust)
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
    "ignored_reason",
    "latest_version",
    "list_versions",
    "make_plane",
    "manifest_keys",
    "plane_of",
    "read_head",
    "read_manifest",
    "verify_plane",
]
