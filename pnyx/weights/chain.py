"""Reading a run's whole weight history: a cheap structural inspection and an end-to-end re-verification.

`inspect_chain` reads only manifests (versions, kinds, sizes, and whether each version's parent digest
links to its parent's chain digest). `verify_chain` downloads every payload and rebuilds every state from
anchors and deltas, checking each tensor digest and the chain digests: what `pnyx weights verify` runs.
Given the trainer's `Verifier` (`trust=`), both check every manifest's signature and report every manifest
object the trainer did not name (unsigned, forged, squatted) as a problem. Knows nothing about torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from pnyx.errors import IntegrityError, NotFoundError
from pnyx.protocol import layout
from pnyx.store import Store
from pnyx.weights.bits import BitState
from pnyx.weights.manifest import Head, WeightManifest, manifest_keys, read_head, read_manifest, verify_plane
from pnyx.weights.payload import read_anchor, read_delta

if TYPE_CHECKING:
    from pnyx.security.signing import Verifier


@dataclass
class VersionInfo:
    version: int
    kind: str
    parent_version: int | None
    anchor_version: int
    publisher: str
    delta_bytes: int
    anchor_bytes: int
    full_bytes: int
    changed_fraction: float
    int8_bytes: int
    status: str  # "ok", "linked", "anchor", "unverified" or what is wrong


@dataclass
class ChainReport:
    versions: list[VersionInfo] = field(default_factory=list)
    head: Head | None = None
    latest: int | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _info(m: WeightManifest, status: str) -> VersionInfo:
    p = m.weights
    return VersionInfo(
        version=m.version,
        kind=m.kind,
        parent_version=m.parent_version,
        anchor_version=m.anchor_version,
        publisher=m.publisher,
        delta_bytes=p.delta_bytes(),
        anchor_bytes=p.anchor_bytes(),
        full_bytes=p.full_bytes,
        changed_fraction=p.changed / p.elements if p.elements else 0.0,
        int8_bytes=(m.int8.delta_bytes() + m.int8.anchor_bytes()) if m.int8 else 0,
        status=status,
    )


def _manifests(store: Store, report: ChainReport, trust: Verifier | None) -> list[WeightManifest]:
    metas = [m.key for m in store.list(layout.WEIGHTS_PREFIX)]
    named = manifest_keys(metas, trust)
    if trust is not None:
        for key in metas:
            if layout.parse_any_weights_manifest(key) is not None and key not in named.values():
                report.problems.append(f"{key}: not signed by the trainer key {trust.fingerprint} (ignored)")
    out = []
    for v in sorted(named):
        try:
            out.append(read_manifest(store, v, trust))
        except (NotFoundError, IntegrityError) as e:
            report.problems.append(f"v{v}: manifest unreadable: {e}")
    report.head = read_head(store, trust)
    report.latest = out[-1].version if out else None
    if report.head is not None and report.latest is not None and report.head.version > report.latest:
        report.problems.append(
            f"HEAD names v{report.head.version} but the newest manifest is v{report.latest}"
        )
    return out


def inspect_chain(store: Store, trust: Verifier | None = None) -> ChainReport:
    """Versions, kinds, sizes and link status from manifests alone (no payload is downloaded)."""
    report = ChainReport()
    by_v: dict[int, WeightManifest] = {}
    for m in _manifests(store, report, trust):
        parent = by_v.get(m.parent_version) if m.parent_version is not None else None
        if m.weights.anchor:
            status = "anchor"
        elif parent is None:
            status = "unverified (parent missing)"
        elif m.weights.parent_digest == parent.weights.chain_digest:
            status = "linked"
        else:
            status = "BROKEN: parent digest mismatch"
            report.problems.append(
                f"v{m.version}: parent digest does not match v{parent.version}'s chain digest"
            )
        if m.weights.anchor and parent is not None and m.weights.parent_digest != parent.weights.chain_digest:
            status = "anchor (parent digest mismatch)"
            report.problems.append(f"v{m.version}: anchor's parent digest does not match v{parent.version}")
        by_v[m.version] = m
        report.versions.append(_info(m, status))
    return report


def verify_chain(
    store: Store, plane: Literal["weights", "int8"] = "weights", trust: Verifier | None = None
) -> ChainReport:
    """Download and re-verify every version end to end (anchors rebuilt, deltas applied, all digests;
    with `trust`, every signature)."""
    report = ChainReport()
    state: BitState | None = None
    prev: WeightManifest | None = None
    seen_anchor = False
    for m in _manifests(store, report, trust):
        what = f"v{m.version} ({plane})"
        try:
            p = m.plane(plane)
            pp = prev.plane(plane) if prev is not None else None
            linked = (
                pp is not None
                and prev is not None
                and m.parent_version == prev.version
                and p.parent_digest == pp.chain_digest
            )
            new: BitState | None = None
            if p.has_delta and linked and state is not None:
                new = read_delta(store, m.version, p, state)
                verify_plane(p, new, what)
            if p.anchor:
                seen_anchor = True
                anchor_state = read_anchor(store, m.version, p)
                verify_plane(p, anchor_state, what)
                new = new or anchor_state
            if new is None and not seen_anchor:  # history before the oldest retained anchor
                report.versions.append(_info(m, "skipped (before the oldest anchor)"))
                continue
            if new is None:
                raise IntegrityError("not an anchor and does not chain onto a verified parent")
            state, prev = new, m
            report.versions.append(_info(m, "ok"))
        except (IntegrityError, NotFoundError) as e:
            report.problems.append(f"{what}: {e}")
            report.versions.append(_info(m, f"FAILED: {e}"))
            state, prev = None, None
    return report
