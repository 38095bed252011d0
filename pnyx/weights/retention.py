"""Retention of published weights: keep the last N anchors and every version reachable from them.

The policy (`plan_retention`, pure) deletes a version only if it is older than both the oldest retained
anchor and `head - window`, so (a) every delta after a retained anchor stays, so a cold joiner can reach
the head from any retained anchor, and (b) a syncer that holds any version within `window` of the head can
still follow warm. `apply_retention` deletes a version's manifest before its payload (a reader then sees
the version as absent, never as a manifest with missing objects), and removes orphaned payload objects (a
fenced publisher's, or a crashed publish's) only below the head, where no live publisher can be writing.
With the trainer's `Verifier` (`trust=`) only the manifests it named count; any other manifest object in
a finished version (unsigned, forged, squatted) is removed with the orphans. Knows nothing about torch or
the codec.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pnyx.errors import ConfigError, IntegrityError, NotFoundError
from pnyx.protocol import layout
from pnyx.store import Store
from pnyx.weights.manifest import manifest_keys, read_manifest

if TYPE_CHECKING:
    from pnyx.security.signing import Verifier

log = logging.getLogger("pnyx.weights")


def plan_retention(versions: Iterable[tuple[int, bool]], keep_anchors: int = 2, window: int = 0) -> list[int]:
    """Versions to delete, given (version, is_anchor) for every published version.

    keep_anchors: how many of the newest anchors to keep (>= 1). window: versions within `window` of the
    head are never deleted, whatever the anchors."""
    if keep_anchors < 1 or window < 0:
        raise ConfigError(f"need keep_anchors >= 1 and window >= 0, got {keep_anchors}, {window}")
    vs = sorted(versions)
    anchors = [v for v, a in vs if a]
    if not vs or len(anchors) < keep_anchors:
        return []
    head = vs[-1][0]
    floor = min(anchors[-keep_anchors], head - window)
    return [v for v, _ in vs if v < floor]


def apply_retention(
    store: Store,
    keep_anchors: int = 2,
    window: int = 0,
    dry_run: bool = False,
    trust: Verifier | None = None,
) -> list[str]:
    """Apply the policy to a run; returns the deleted keys (or those it would delete when `dry_run`)."""
    by_version: dict[int, list[str]] = defaultdict(list)
    for meta in store.list(layout.WEIGHTS_PREFIX):
        parts = meta.key.split("/")
        if len(parts) == 3 and parts[1].startswith("v") and parts[1][1:].isdigit():
            by_version[int(parts[1][1:])].append(meta.key)
    kinds: dict[int, bool] = {}
    referenced: dict[int, set[str]] = {}
    named = manifest_keys([k for keys in by_version.values() for k in keys], trust)
    for v in sorted(by_version):
        if v not in named:
            continue
        try:
            m = read_manifest(store, v, trust)
        except (NotFoundError, IntegrityError) as e:
            log.warning("retention: skipping unreadable manifest v%d: %s", v, e)
            continue
        kinds[v] = bool(m.weights.anchor)
        planes = [m.weights, *([m.int8] if m.int8 else [])]
        referenced[v] = {layout.weights_payload(v, o.name) for p in planes for o in [*p.delta, *p.anchor]}
    if not kinds:
        return []
    head = max(kinds)
    doomed = set(plan_retention(kinds.items(), keep_anchors, window))
    deleted: list[str] = []
    for v in sorted(by_version):
        manifest = named.get(v)
        if v in doomed:
            keys = [manifest] + sorted(k for k in by_version[v] if k != manifest)  # the manifest first
            keys = [k for k in keys if k in by_version[v]]
        elif v < head:  # orphans: unreferenced payloads (and unnamed manifests) of finished versions
            keep = referenced.get(v, set()) | {manifest}
            if v not in referenced and manifest is not None:
                continue  # an unreadable manifest: leave the folder for a human
            keys = sorted(k for k in by_version[v] if k not in keep)
        else:
            continue
        for k in keys:
            if not dry_run:
                store.delete(k)
            deleted.append(k)
    if deleted:
        log.info(
            "retention: %s %d objects (%d versions)",
            "would delete" if dry_run else "deleted",
            len(deleted),
            len(doomed),
        )
    return deleted
