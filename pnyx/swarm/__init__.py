"""Swarm mode (SAPO): every node trains its own policy on I local + J shared groups per step.

Public surface (imported lazily, so `import pnyx.swarm` does not import torch): `SwarmNode`, `open_node`,
`RoundStats` (node loop), `SwarmGroup`, `SwarmSample`, `NodeHeartbeat`, `encode_swarm_group`,
`decode_swarm_group` (wire records), `PeerFeed`, `to_swarm_group`, `check_node_name` (sharing),
`sample_external`, `Pool` (the mix), `aligned_behaviour`, `char_ends` (cross-tokenizer behaviour
estimate), `save_node_checkpoint`, `load_node_checkpoint` (checkpoints), `Family`, `specialize`,
`heldout_reward`, `RoundRobin`, `transfer_run` (experiments). See docs/swarm.md. Knows nothing about the
central trainer's loop or PULSE.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SwarmNode": "pnyx.swarm.node",
    "open_node": "pnyx.swarm.node",
    "RoundStats": "pnyx.swarm.node",
    "SwarmGroup": "pnyx.swarm.records",
    "SwarmSample": "pnyx.swarm.records",
    "NodeHeartbeat": "pnyx.swarm.records",
    "encode_swarm_group": "pnyx.swarm.records",
    "decode_swarm_group": "pnyx.swarm.records",
    "PeerFeed": "pnyx.swarm.share",
    "to_swarm_group": "pnyx.swarm.share",
    "check_node_name": "pnyx.swarm.share",
    "sample_external": "pnyx.swarm.sample",
    "Pool": "pnyx.swarm.sample",
    "aligned_behaviour": "pnyx.swarm.align",
    "char_ends": "pnyx.swarm.align",
    "save_node_checkpoint": "pnyx.swarm.checkpoint",
    "load_node_checkpoint": "pnyx.swarm.checkpoint",
    "Family": "pnyx.swarm.experiment",
    "specialize": "pnyx.swarm.experiment",
    "heldout_reward": "pnyx.swarm.experiment",
    "RoundRobin": "pnyx.swarm.experiment",
    "transfer_run": "pnyx.swarm.experiment",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pnyx.swarm' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
