"""Swarm wire records: a shared group as decoded text (plus the sender's token view), and a node heartbeat.

A swarm node shares what any other node can use whatever its tokenizer: the decoded completion text,
the task id and environment (name and constructor kwargs) so the receiver can rebuild the task and
re-score with its own verifier, and the sender's own token view (ids, per-token behaviour logprobs,
loss mask, and the character offset where each token's text ends) so that a receiver can estimate the
behaviour probability of the text under the sender's policy. Rewards the sender claims travel too, but
no receiver ever trains on them.

Framing is the rollout frame of `pnyx.protocol.codec` (magic, format byte, xxh3-128 of the payload,
zstd(msgpack)), reused through its helpers; `decode_swarm_group` trusts nothing and raises
`RecordRejected(reason)` with a short reason that the node counts as a drop. Knows nothing about torch,
models or the store.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec
import numpy as np
import xxhash
import zstandard

from pnyx.errors import RecordRejected
from pnyx.protocol.codec import FORMAT_VERSION, HEADER_SIZE, MAGIC, ZSTD_LEVEL, check_frame, inflate
from pnyx.protocol.layout import check_name

SWARM_GROUP_SCHEMA = 1
NODE_HEARTBEAT_SCHEMA = 1

SWARM_REASONS = (
    "bad_magic",
    "digest_mismatch",
    "oversize_bytes",
    "decode_error",
    "wrong_schema",
    "bad_field",
    "too_many_samples",
    "too_many_tokens",
    "length_mismatch",
    "bad_mask",
    "bad_logprob",
    "bad_reward",
    "bad_text",
    "empty_group",
)
"""Every `RecordRejected.reason` `decode_swarm_group` raises."""


class SwarmSample(msgspec.Struct, kw_only=True):
    """One completion as text plus the sender's token view of it."""

    text: str
    """The completion decoded by the sender (special tokens skipped): what every receiver re-tokenizes."""
    tokens: list[int]
    """The sender's token ids (meaningful only to a receiver with the same tokenizer)."""
    logprobs: list[float]
    """The sender's behaviour logprob per token (0.0 where loss_mask is 0)."""
    loss_mask: list[int]
    """1 = sender's model token, 0 = tool/env token."""
    token_ends: list[int]
    """Character offset in `text` where each token's text ends (non-decreasing, <= len(text))."""
    eos: bool = False
    """The sender's last token is its end-of-sequence token (the model chose to stop; not in `text`)."""
    reward: float
    """The sender's claimed reward (informational: receivers re-score)."""
    finish_reason: str = "stop"
    num_tool_calls: int = 0


class SwarmGroup(msgspec.Struct, kw_only=True):
    """G completions of one task by one node, shared at `layout.swarm_key(node, seq)` (create-only)."""

    SCHEMA: ClassVar[int] = SWARM_GROUP_SCHEMA

    schema: int = SWARM_GROUP_SCHEMA
    node: str
    seq: int
    policy_version: int
    """The sender's policy version (number of optimizer steps) that generated the group."""
    model_id: str
    """The sender's model (folder name and architecture), informational."""
    tokenizer_digest: str
    """`pnyx.models.tokenizer_digest` of the sender's tokenizer: equal digests mean equal token ids."""
    env: str
    env_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)
    """Constructor kwargs of the sender's environment: the task id is only meaningful with them."""
    task_id: str
    samples: list[SwarmSample]
    temperature: float
    top_p: float
    top_k: int
    created_at: float


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
    next_seq: int = 0
    """The seq of this node's next upload (readers start listing just below it)."""
    groups: int = 0
    """Groups uploaded so far."""
    external_trained: int = 0
    """Foreign groups this node has trained on so far."""
    updated_at: float
    status: str = "running"
    """"starting" | "running" | "stopped" | "error"."""
    detail: str = ""


@dataclass(frozen=True)
class SwarmLimits:
    """Bounds a received swarm group must respect."""

    max_bytes: int = 4 << 20
    max_decompressed_bytes: int = 16 << 20
    max_samples: int = 64
    max_tokens_per_sample: int = 4096
    max_chars_per_sample: int = 32_768


DEFAULT_SWARM_LIMITS = SwarmLimits()

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SwarmGroup)


def encode_swarm_group(group: SwarmGroup) -> bytes:
    """The framed wire bytes of `group` (same frame as rollout groups; does not validate)."""
    payload = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(_encoder.encode(group))
    return MAGIC + bytes([FORMAT_VERSION]) + xxhash.xxh3_128_digest(payload) + payload


def decode_swarm_group(data: bytes, limits: SwarmLimits | None = None) -> SwarmGroup:
    """Decode and fully validate a framed swarm group. Raises RecordRejected(reason, detail)."""
    limits = limits or DEFAULT_SWARM_LIMITS
    if len(data) > limits.max_bytes:
        raise RecordRejected("oversize_bytes", f"{len(data)} bytes > max_bytes {limits.max_bytes}")
    check_frame(data)
    raw = inflate(memoryview(data)[HEADER_SIZE:], limits.max_decompressed_bytes)
    try:
        group = _decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise RecordRejected("bad_field", str(exc)) from exc
    except msgspec.DecodeError as exc:
        raise RecordRejected("decode_error", str(exc)) from exc
    validate_swarm_group(group, limits)
    return group


def validate_swarm_group(g: SwarmGroup, limits: SwarmLimits | None = None) -> None:
    """Check every invariant of a decoded swarm group. Raises RecordRejected(reason)."""
    limits = limits or DEFAULT_SWARM_LIMITS
    if g.schema != SWARM_GROUP_SCHEMA:
        raise RecordRejected("wrong_schema", f"swarm group schema {g.schema!r}, this reader knows {SWARM_GROUP_SCHEMA}")
    try:
        check_name(g.node, "node name")
    except ValueError as exc:
        raise RecordRejected("bad_field", str(exc)) from exc
    problems = []
    if not 0 <= g.seq <= 9_999_999_999 or not 0 <= g.policy_version <= 99_999_999:
        problems.append("seq or policy_version out of range")
    for name in ("env", "task_id", "tokenizer_digest"):
        value = getattr(g, name)
        if not value or len(value) > 256:
            problems.append(f"{name} must be 1-256 characters")
    if len(g.model_id) > 256 or len(msgspec.json.encode(g.env_kwargs)) > 4096:
        problems.append("model_id or env_kwargs too large")
    if not (math.isfinite(g.temperature) and 0 < g.temperature <= 100):
        problems.append(f"temperature {g.temperature} must be in (0, 100]")
    if not (math.isfinite(g.top_p) and 0 < g.top_p <= 1) or g.top_k < 0:
        problems.append("top_p must be in (0, 1] and top_k >= 0")
    if not math.isfinite(g.created_at):
        problems.append("created_at must be finite")
    if problems:
        raise RecordRejected("bad_field", "; ".join(problems))
    if not g.samples:
        raise RecordRejected("empty_group", "a group needs at least one sample")
    if len(g.samples) > limits.max_samples:
        raise RecordRejected("too_many_samples", f"{len(g.samples)} > max_samples {limits.max_samples}")
    for i, s in enumerate(g.samples):
        _check_sample(s, i, limits)


def _check_sample(s: SwarmSample, i: int, limits: SwarmLimits) -> None:
    n = len(s.tokens)
    if n > limits.max_tokens_per_sample:
        raise RecordRejected("too_many_tokens", f"sample {i}: {n} > {limits.max_tokens_per_sample} tokens")
    if len(s.text) > limits.max_chars_per_sample:
        raise RecordRejected("bad_text", f"sample {i}: {len(s.text)} > {limits.max_chars_per_sample} characters")
    if not (len(s.logprobs) == len(s.loss_mask) == len(s.token_ends) == n):
        raise RecordRejected(
            "length_mismatch",
            f"sample {i}: {n} tokens, {len(s.logprobs)} logprobs, {len(s.loss_mask)} mask, "
            f"{len(s.token_ends)} token_ends",
        )
    if n:
        mask = np.asarray(s.loss_mask, dtype=np.int64)
        if ((mask != 0) & (mask != 1)).any():
            raise RecordRejected("bad_mask", f"sample {i}: loss_mask values must be 0 or 1")
        if min(s.tokens) < 0:
            raise RecordRejected("bad_field", f"sample {i}: negative token id")
        lp = np.asarray(s.logprobs, dtype=np.float64)
        if not np.isfinite(lp).all() or (lp > 0).any() or (lp[mask == 0] != 0.0).any():
            raise RecordRejected("bad_logprob", f"sample {i}: logprobs must be finite, <= 0, and 0.0 where mask is 0")
        ends = np.asarray(s.token_ends, dtype=np.int64)
        if ends[0] < 0 or (np.diff(ends) < 0).any() or ends[-1] > len(s.text):
            raise RecordRejected("bad_text", f"sample {i}: token_ends must be non-decreasing within the text")
    if not (math.isfinite(s.reward) and 0.0 <= s.reward <= 1.0):
        raise RecordRejected("bad_reward", f"sample {i}: reward {s.reward} must be finite and in [0, 1]")
    if not s.finish_reason or len(s.finish_reason) > 64 or s.num_tool_calls < 0:
        raise RecordRejected("bad_field", f"sample {i}: bad finish_reason or num_tool_calls")
