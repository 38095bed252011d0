"""Swarm wire records: a shared group as decoded text (plus the sender's token view), and a node heartbeat.

A swarm node shares what any other node can use whatever its tokenizer: the decoded completion text,
the task id and environment (name and constructor kwargs) so the receiver can rebuild the task and
re-score with its own verifier, and the sender's own token view (ids, per-token behaviour logprobs,
loss mask, and the character offset where each token's text ends) so that a receiver can estimate the
behaviour probability of the text under the sender's policy. Rewards the sender claims travel too, but
no receiver ever trains on them.

Framing, limits and the checks every group record shares (header fields, the per-sample token view) are
those of `pnyx.protocol.codec` (one definition: `encode_frame`, `decode_frame`, `Limits`,
`header_problems`, `check_sample_view`); this module adds only what text records have on top (the text,
its token end offsets, the env kwargs). `decode_swarm_group` trusts nothing and raises
`RecordRejected(reason)` with a short reason that the node counts as a drop. Knows nothing about torch,
models or the store.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

import msgspec
import numpy as np

from pnyx.errors import RecordRejected
from pnyx.protocol.codec import (
    REASONS,
    Limits,
    check_sample_view,
    decode_frame,
    encode_frame,
    header_problems,
)
from pnyx.protocol.layout import check_name
from pnyx.protocol.records import GroupHeader, TokenView

if TYPE_CHECKING:
    from pnyx.security.signing import Signer

SWARM_GROUP_SCHEMA = 1
NODE_HEARTBEAT_SCHEMA = 1

SWARM_REASONS = (*REASONS, "bad_text")
"""Every `RecordRejected.reason` `decode_swarm_group` raises: the rollout codec's, plus bad text."""

MAX_SEQ = 9_999_999_999
"""The largest seq a swarm key can hold (`layout.swarm_key`: ten digits)."""

SWARM_LIMITS = Limits(max_bytes=4 << 20, max_decompressed_bytes=16 << 20)
"""Groups from untrusted peers: the rollout limits with tighter byte bounds."""


class SwarmSample(TokenView, kw_only=True):
    """One completion as text plus the sender's token view of it (`tokens` are the sender's ids: meaningful
    only to a receiver with the same tokenizer; `reward` is claimed, receivers re-score)."""

    text: str
    """The completion decoded by the sender (special tokens skipped): what every receiver re-tokenizes."""
    token_ends: list[int]
    """Character offset in `text` where each token's text ends (non-decreasing, <= len(text))."""
    eos: bool = False
    """The sender's last token is its end-of-sequence token (the model chose to stop; not in `text`)."""


class SwarmGroup(GroupHeader, kw_only=True):
    """G completions of one task by one node, shared at `layout.swarm_key(node, seq)` (create-only).

    `policy_version` is the sender's (its optimizer steps); sampling settings are the sender's.
    """

    SCHEMA: ClassVar[int] = SWARM_GROUP_SCHEMA

    schema: int = SWARM_GROUP_SCHEMA
    node: str
    model_id: str
    """The sender's model (folder name and architecture), informational."""
    tokenizer_digest: str
    """`pnyx.models.tokenizer_digest` of the sender's tokenizer: equal digests mean equal token ids."""
    env_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)
    """Constructor kwargs of the sender's environment: the task id is only meaningful with them."""
    samples: list[SwarmSample]


class NodeHeartbeat(msgspec.Struct, kw_only=True):
    """`swarm/nodes/{node}.json`: how peers discover a node (no addresses), overwritten every round."""

    SCHEMA: ClassVar[int] = NODE_HEARTBEAT_SCHEMA

    schema: int = NODE_HEARTBEAT_SCHEMA
    node: str
    model_id: str = ""
    tokenizer_digest: str = ""
    env: str = ""
    version: int = 0
    """Optimizer steps taken so far."""
    rounds: int = 0
    """Rounds completed (a round without a usable signal takes no step)."""
    next_seq: Annotated[int, msgspec.Meta(ge=0, le=MAX_SEQ)] = 0
    """The seq of this node's next upload (readers start listing just below it, and fetch nothing at or above
    it); a heartbeat with any other value does not decode."""
    groups: int = 0
    """Groups uploaded so far."""
    local_trained: int = 0
    """Own groups this node has trained on so far (groups with a reward signal)."""
    external_trained: int = 0
    """Foreign groups this node has trained on so far."""
    peers: list[str] = msgspec.field(default_factory=list)
    """Peers live at the last refresh (at most 64 names)."""
    peers_seen: int = 0
    """Distinct peers seen live since the node started (checkpoints keep the count)."""
    reward: float = 0.0
    """Mean reward of the completions the node generated in its last round (its own verifier)."""
    resumed_from: int = -1
    """Rounds restored from this node's checkpoint when it started (-1: started from its model)."""
    checkpoint_round: int = -1
    """Rounds at the last checkpoint written (-1: none yet)."""
    updated_at: float
    status: str = "running"
    """"starting" | "waiting" | "running" | "stopped" | "error"."""
    detail: str = ""


_decoder = msgspec.msgpack.Decoder(SwarmGroup)


def encode_swarm_group(group: SwarmGroup, signer: Signer | None = None) -> bytes:
    """The framed wire bytes of `group` (the rollout frame; does not validate), signed by `signer` (the
    node's key: peers bind its name to it) when given."""
    return encode_frame(group, signer=signer)


def decode_swarm_group(data: bytes, limits: Limits | None = None) -> SwarmGroup:
    """Decode and fully validate a framed swarm group. Raises RecordRejected(reason, detail)."""
    limits = limits or SWARM_LIMITS
    group = decode_frame(data, _decoder, SWARM_GROUP_SCHEMA, limits)
    validate_swarm_group(group, limits)
    return group


def validate_swarm_group(g: SwarmGroup, limits: Limits | None = None) -> None:
    """Check every invariant of a decoded swarm group. Raises RecordRejected(reason)."""
    limits = limits or SWARM_LIMITS
    if g.schema != SWARM_GROUP_SCHEMA:
        raise RecordRejected(
            "wrong_schema", f"swarm group schema {g.schema!r}, this reader knows {SWARM_GROUP_SCHEMA}"
        )
    try:
        check_name(g.node, "node name")
    except ValueError as exc:
        raise RecordRejected("bad_field", str(exc)) from exc
    names = {"env": g.env, "task_id": g.task_id, "tokenizer_digest": g.tokenizer_digest}
    problems = header_problems(g.seq, g.policy_version, names, g.temperature, g.top_p, g.top_k)
    if not 0 < g.temperature <= 100:
        problems.append(f"temperature {g.temperature} must be in (0, 100] (receivers rescore at it)")
    if len(g.model_id) > 256 or len(msgspec.json.encode(g.env_kwargs)) > 4096:
        problems.append("model_id or env_kwargs too large")
    if not math.isfinite(g.created_at):
        problems.append("created_at must be finite")
    if problems:
        raise RecordRejected("bad_field", "; ".join(problems))
    if not g.samples:
        raise RecordRejected("empty_group", "a group needs at least one sample")
    if len(g.samples) > limits.max_samples:
        raise RecordRejected("too_many_samples", f"{len(g.samples)} > max_samples {limits.max_samples}")
    for i, s in enumerate(g.samples):
        check_sample_view(
            i, s.tokens, s.logprobs, s.loss_mask, s.reward, s.finish_reason, s.num_tool_calls, limits
        )
        _check_text(s, i, limits)


def _check_text(s: SwarmSample, i: int, limits: Limits) -> None:
    if len(s.text) > limits.max_chars_per_sample:
        raise RecordRejected(
            "bad_text", f"sample {i}: {len(s.text)} > {limits.max_chars_per_sample} characters"
        )
    if len(s.token_ends) != len(s.tokens):
        raise RecordRejected(
            "length_mismatch", f"sample {i}: {len(s.tokens)} tokens, {len(s.token_ends)} token_ends"
        )
    if s.token_ends:
        ends = np.asarray(s.token_ends, dtype=np.int64)
        if ends[0] < 0 or (np.diff(ends) < 0).any() or ends[-1] > len(s.text):
            raise RecordRejected("bad_text", f"sample {i}: token_ends must be non-decreasing within the text")
