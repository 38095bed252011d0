"""pnyx's wire protocol: the run layout (keys), wire records and their validated codecs.

Knows nothing about torch or any store backend. Import keys from `pnyx.protocol.layout` (or this
package) and records/codecs from here:

    from pnyx.protocol import RolloutGroup, Sample, encode_group, decode_group, Limits
"""

from pnyx.protocol import layout
from pnyx.protocol.codec import (
    DEFAULT_LIMITS,
    REASONS,
    Limits,
    decode_group,
    decode_json,
    encode_group,
    encode_json,
    group_digest,
    validate_group,
)
from pnyx.protocol.records import (
    DEMAND_SCHEMA,
    GROUP_SCHEMA,
    HEARTBEAT_SCHEMA,
    PROTOCOL_VERSION,
    RUN_SCHEMA,
    Demand,
    Heartbeat,
    RolloutGroup,
    RunManifest,
    Sample,
)

__all__ = [
    "DEFAULT_LIMITS",
    "DEMAND_SCHEMA",
    "GROUP_SCHEMA",
    "HEARTBEAT_SCHEMA",
    "PROTOCOL_VERSION",
    "REASONS",
    "RUN_SCHEMA",
    "Demand",
    "Heartbeat",
    "Limits",
    "RolloutGroup",
    "RunManifest",
    "Sample",
    "decode_group",
    "decode_json",
    "encode_group",
    "encode_json",
    "group_digest",
    "layout",
    "validate_group",
]
