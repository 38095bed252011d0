"""The swarm section of `pnyx status`: every swarm node's heartbeat as one table row, read from the store alone.

A swarm store has node heartbeats under `swarm/nodes/` (and no trainer run); a store can also hold both. One
row per node: status (silent when its heartbeat is old), version (optimizer steps), rounds, the local and
foreign groups it has trained on, its last round's reward, the peers it saw live at its last refresh (and
how many distinct peers it has seen), whether it resumed from a checkpoint, and the heartbeat's age.

`with_swarm(renderable, store, snap)` is what `pnyx status` calls: it returns the run view unchanged when
the store has no swarm nodes, the swarm table alone for a swarm-only store, and both otherwise. Knows
nothing about processes; never writes to the store; a heartbeat it cannot read is skipped, never fatal.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pnyx.errors import NotFoundError, RecordRejected
from pnyx.protocol import layout
from pnyx.store import Store

if TYPE_CHECKING:
    from rich.console import RenderableType
    from rich.table import Table

    from pnyx.cli.live import Snapshot
    from pnyx.swarm.records import NodeHeartbeat

SILENT_AFTER_S = 120.0
"""A running node whose heartbeat is older than this shows as silent (a round can take a while)."""


def read_nodes(store: Store) -> list[NodeHeartbeat]:
    """Every readable node heartbeat in the store, by node name."""
    from pnyx.protocol.codec import decode_json
    from pnyx.swarm.records import NodeHeartbeat

    out = []
    for meta in store.list(layout.SWARM_NODES_PREFIX):
        if not meta.key.endswith(".json"):
            continue
        try:
            out.append(decode_json(store.get(meta.key), NodeHeartbeat))
        except (NotFoundError, RecordRejected):
            continue
    return sorted(out, key=lambda hb: hb.node)


def swarm_table(nodes: list[NodeHeartbeat], now: float | None = None) -> Table:
    """A rich table with one row per node heartbeat."""
    from rich.table import Table

    now = time.time() if now is None else now
    t = Table(title=f"swarm nodes ({len(nodes)})", expand=False)
    cols = (
        "node",
        "status",
        "version",
        "rounds",
        "local used",
        "foreign used",
        "reward",
        "peers",
        "resumed",
        "age",
    )
    for col in cols:
        t.add_column(col)
    for hb in nodes:
        age = max(0.0, now - hb.updated_at)
        live = hb.status in ("starting", "waiting", "running")
        status = f"silent ({hb.status})" if live and age > SILENT_AFTER_S else hb.status
        peers = ", ".join(hb.peers[:6]) + (f" +{len(hb.peers) - 6}" if len(hb.peers) > 6 else "")
        t.add_row(
            hb.node,
            status,
            str(hb.version),
            str(hb.rounds),
            str(hb.local_trained),
            str(hb.external_trained),
            f"{hb.reward:.3f}",
            f"{peers or '-'} ({hb.peers_seen} seen)",
            f"round {hb.resumed_from}" if hb.resumed_from >= 0 else "-",
            f"{age:.0f}s" if age < 120 else f"{age / 60:.0f}m",
        )
    return t


def with_swarm(renderable: RenderableType, store: Store, snap: Snapshot) -> RenderableType:
    """`renderable` (the run view of `snap`) plus the swarm table when the store has swarm nodes."""
    from rich.console import Group

    from pnyx.errors import StoreError

    try:
        nodes = read_nodes(store)
    except StoreError:  # a flaky connection: show the run view now, the next refresh retries
        return renderable
    if not nodes:
        return renderable
    table = swarm_table(nodes)
    return table if getattr(snap, "run_id", None) is None else Group(renderable, table)
