"""Swarm mode (SAPO): every node trains its own policy on I local + J shared groups per step.

Public surface (imported lazily, so `import pnyx.swarm` does not import torch): `SwarmNode`, `open_node`,
`RoundStats` (node loop), `SwarmGroup`, `SwarmSample`, `NodeHeartbeat`, `encode_swarm_group`,
`decode_swarm_group` (wire records), `PeerFeed`, `to_swarm_group`, `check_node_name` (sharing),
`sample_external`, `Pool` (the mix), `aligned_behaviour`, `char_ends` (cross-tokenizer behaviour
estimate), `save_node_checkpoint`, `load_node_checkpoint` (checkpoints). The experiments (`Family`, `specialize`,
`heldout_reward`, `RoundRobin`, `transfer_run`) are in `pnyx_harness.swarm_experiment`. See docs/swarm.md.
Knows nothing about the central trainer's loop or PULSE.
"""

from __future__ import annotations

from pnyx.lazy import export_names, lazy_exports

_EXPORTS = {
    "pnyx.swarm.node": ("SwarmNode",),
    "pnyx.swarm.opening": ("open_node",),
    "pnyx.swarm.rounds": ("RoundStats",),
    "pnyx.swarm.records": (
        "SwarmGroup",
        "SwarmSample",
        "NodeHeartbeat",
        "encode_swarm_group",
        "decode_swarm_group",
    ),
    "pnyx.swarm.share": ("PeerFeed", "to_swarm_group", "check_node_name"),
    "pnyx.swarm.sample": ("sample_external", "Pool"),
    "pnyx.swarm.align": ("aligned_behaviour", "char_ends"),
    "pnyx.swarm.checkpoint": ("save_node_checkpoint", "load_node_checkpoint"),
}

__all__ = export_names(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
