"""PULSE, the weight plane: anchors plus sparse lossless deltas, a hash chain, cold join, int8 actor plane.

    from pnyx.weights import Publisher, Syncer, TrustedWeights
    Publisher(store, anchor_every=20, signer=signer).publish(version, bf16_state_dict)  # trainer
    version, tensors = Syncer(store, trust=verifier).sync()                            # worker
    TrustedWeights.open(store).latest()        # any other reader: only what run.json's key signed

Knows nothing about RL or environments. Importing this package does not import torch (see docs/pulse.md).
"""

from pnyx.weights.bits import TensorBits, from_torch, to_torch
from pnyx.weights.chain import ChainReport, VersionInfo, inspect_chain, verify_chain
from pnyx.weights.manifest import (
    Head,
    PlaneManifest,
    WeightManifest,
    latest_version,
    list_versions,
    read_manifest,
)
from pnyx.weights.publisher import Publisher, PublishStats
from pnyx.weights.retention import apply_retention, plan_retention
from pnyx.weights.syncer import Syncer, Verified
from pnyx.weights.trusted import TrustedWeights, trusted_latest

__all__ = [
    "ChainReport",
    "Head",
    "PlaneManifest",
    "PublishStats",
    "Publisher",
    "Syncer",
    "TensorBits",
    "TrustedWeights",
    "Verified",
    "VersionInfo",
    "WeightManifest",
    "apply_retention",
    "from_torch",
    "inspect_chain",
    "latest_version",
    "list_versions",
    "plan_retention",
    "read_manifest",
    "to_torch",
    "trusted_latest",
    "verify_chain",
]
