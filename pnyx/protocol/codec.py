"""Encoding and validation of wire records: binary rollout groups and human-readable JSON records.

A rollout group on the wire is a frame:

    b"PNYX" | format version (1 byte) | xxh3-128 of the payload (16 bytes) | payload             (format 1)
    b"PNYX" | 2 | xxh3-128 of the payload | Ed25519 public key (32) | signature (64) | payload  (format 2)
    payload = zstd(msgpack(RolloutGroup))

Format 2 is a signed frame (every worker writes it; docs/security.md): the signature covers the payload
bytes, so a reader checks who produced a record (`frame_signer`) before inflating or decoding anything,
and the signature travels inside the object (no extra request). Format 1 frames (swarm records, records of
old workers) still decode; the trainer refuses them as `unsigned`.

`decode_group` trusts nothing: it bounds the compressed and the decompressed size before
allocating (a zip bomb is rejected without being inflated), checks the digest, the schema, and
every per-token invariant, and raises `RecordRejected(reason)` with a short machine-readable reason
that the trainer uses as a drop counter key. Knows nothing about torch, the store or envs.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import numpy as np
import xxhash
import zstandard

from pnyx.errors import RecordRejected
from pnyx.protocol.layout import check_name
from pnyx.protocol.records import GROUP_SCHEMA, RolloutGroup, Sample

if TYPE_CHECKING:
    from pnyx.security.signing import Signer

MAGIC = b"PNYX"
FORMAT_VERSION = 1
SIGNED_FORMAT = 2
HEADER_SIZE = len(MAGIC) + 1 + 16
SIGNED_HEADER_SIZE = HEADER_SIZE + 32 + 64
"""A signed frame's header: the format-1 header, then the signer's raw public key and its signature."""
GROUP_DOMAIN = "group"
"""The signing domain of rollout groups (see `pnyx.security.signing`)."""
ZSTD_LEVEL = 3

REASONS = (
    "bad_magic",
    "digest_mismatch",
    "oversize_bytes",
    "decode_error",
    "wrong_schema",
    "too_many_samples",
    "too_many_tokens",
    "token_out_of_range",
    "bad_logprob",
    "length_mismatch",
    "bad_mask",
    "bad_reward",
    "empty_group",
    "bad_field",
    "unsigned",
    "bad_signature",
)
"""Every `RecordRejected.reason` this module raises."""

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()
_group_decoder = msgspec.msgpack.Decoder(RolloutGroup)


class _SchemaProbe(msgspec.Struct):
    schema: Any = None


_probe_decoder = msgspec.msgpack.Decoder(_SchemaProbe)


@dataclass(frozen=True)
class Limits:
    """Bounds a decoded record (a rollout group, or a swarm group) must respect.

    The defaults fit the shipped configs with headroom; `pnyx.swarm.records.SWARM_LIMITS` is the same
    family with tighter byte bounds for groups fetched from untrusted peers.
    """

    max_bytes: int = 8 << 20
    """Largest encoded (compressed) record accepted."""
    max_decompressed_bytes: int = 32 << 20
    """Largest msgpack payload inflated from it; decompression stops here (zip bombs)."""
    max_samples: int = 64
    """Most completions per group."""
    max_tokens_per_sample: int = 4096
    """Longest completion, in tokens (model and tool tokens together)."""
    max_prompt_tokens: int = 4096
    """Longest prompt, in tokens."""
    max_chars_per_sample: int = 32_768
    """Longest completion text, in characters (records that carry decoded text)."""


DEFAULT_LIMITS = Limits()


# --- binary rollout groups -------------------------------------------------------------------------------


def encode_frame(record: msgspec.Struct, level: int = ZSTD_LEVEL, signer: Signer | None = None) -> bytes:
    """The framed wire bytes of any msgpack record: magic, format, xxh3-128 of the payload, (with a
    `signer`: its public key and signature of the payload,) zstd(msgpack)."""
    payload = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(_encoder.encode(record))
    digest = xxhash.xxh3_128_digest(payload)
    if signer is None:
        return MAGIC + bytes([FORMAT_VERSION]) + digest + payload
    return (
        MAGIC
        + bytes([SIGNED_FORMAT])
        + digest
        + signer.public_raw
        + signer.sign(GROUP_DOMAIN, payload)
        + payload
    )


def encode_group(group: RolloutGroup, level: int = ZSTD_LEVEL, signer: Signer | None = None) -> bytes:
    """The framed wire bytes of `group`, signed by `signer` when given (does not validate; `decode_group`
    does)."""
    return encode_frame(group, level, signer)


def frame_signer(data: bytes) -> bytes:
    """The raw public key that signed this frame, after verifying its signature over the payload (nothing
    is inflated or decoded). Raises RecordRejected("unsigned" | "bad_signature" | "bad_magic")."""
    from pnyx.security.signing import Verifier

    if len(data) < HEADER_SIZE or data[:4] != MAGIC:
        raise RecordRejected("bad_magic", f"not a pnyx rollout record (first bytes {bytes(data[:4])!r})")
    if data[4] != SIGNED_FORMAT:
        raise RecordRejected("unsigned", f"frame format {data[4]} carries no signature")
    if len(data) < SIGNED_HEADER_SIZE:
        raise RecordRejected("bad_signature", "signed frame shorter than its header")
    public = bytes(data[HEADER_SIZE : HEADER_SIZE + 32])
    signature = bytes(data[HEADER_SIZE + 32 : SIGNED_HEADER_SIZE])
    try:
        verifier = Verifier.from_hex(public.hex())
    except ValueError as exc:
        raise RecordRejected("bad_signature", f"not an Ed25519 public key: {exc}") from None
    if not verifier.check(GROUP_DOMAIN, bytes(memoryview(data)[SIGNED_HEADER_SIZE:]), signature):
        raise RecordRejected("bad_signature", "the signature does not verify over the payload (tampered)")
    return public


def decode_frame(data: bytes, decoder: msgspec.msgpack.Decoder, schema: int, limits: Limits) -> Any:
    """The record inside a frame: size-bounded before allocating, digest-checked, typed by `decoder`.

    Checks the frame only, not the record's own invariants (each record type validates those).
    Raises RecordRejected("oversize_bytes" | "bad_magic" | "digest_mismatch" | "decode_error" |
    "wrong_schema" | "bad_field").
    """
    if len(data) > limits.max_bytes:
        raise RecordRejected("oversize_bytes", f"{len(data)} bytes > max_bytes {limits.max_bytes}")
    check_frame(data)
    raw = inflate(memoryview(data)[payload_offset(data) :], limits.max_decompressed_bytes)
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as exc:
        found = _probe_schema(raw)
        if found is not None and found != schema:
            raise RecordRejected(
                "wrong_schema", f"record schema {found!r}, this reader knows {schema}"
            ) from exc
        raise RecordRejected("bad_field", str(exc)) from exc
    except msgspec.DecodeError as exc:
        raise RecordRejected("decode_error", str(exc)) from exc


def group_digest(data: bytes) -> str:
    """Hex xxh3-128 of an encoded group's payload (its identity), after verifying it against the frame.

    Raises RecordRejected("bad_magic" | "wrong_schema" | "digest_mismatch").
    """
    return check_frame(data).hex()


def decode_group(data: bytes, limits: Limits | None = None, vocab_size: int | None = None) -> RolloutGroup:
    """Decode and fully validate a framed rollout group. Raises RecordRejected(reason, detail).

    `vocab_size`, when given, bounds every prompt and completion token id to [0, vocab_size).
    """
    limits = limits or DEFAULT_LIMITS
    group = decode_frame(data, _group_decoder, GROUP_SCHEMA, limits)
    validate_group(group, limits, vocab_size)
    return group


def validate_group(group: RolloutGroup, limits: Limits | None = None, vocab_size: int | None = None) -> None:
    """Check every invariant of a decoded group (see records.py). Raises RecordRejected(reason)."""
    limits = limits or DEFAULT_LIMITS
    if group.schema != GROUP_SCHEMA:
        raise RecordRejected(
            "wrong_schema", f"group schema {group.schema!r}, this reader knows {GROUP_SCHEMA}"
        )
    _check_header_fields(group)
    if not group.samples:
        raise RecordRejected("empty_group", "a group needs at least one sample")
    if len(group.samples) > limits.max_samples:
        raise RecordRejected("too_many_samples", f"{len(group.samples)} > max_samples {limits.max_samples}")
    if len(group.prompt_tokens) > limits.max_prompt_tokens:
        raise RecordRejected(
            "too_many_tokens", f"prompt has {len(group.prompt_tokens)} > {limits.max_prompt_tokens} tokens"
        )
    _check_token_ids(group.prompt_tokens, vocab_size, "prompt")
    for i, sample in enumerate(group.samples):
        _check_sample(sample, i, limits, vocab_size)


def payload_offset(data: bytes) -> int:
    """Where a frame's payload starts (after the format-1 or the signed header)."""
    return SIGNED_HEADER_SIZE if len(data) > 4 and data[4] == SIGNED_FORMAT else HEADER_SIZE


def check_frame(data: bytes) -> bytes:
    if len(data) < HEADER_SIZE or data[:4] != MAGIC:
        raise RecordRejected("bad_magic", f"not a pnyx rollout record (first bytes {bytes(data[:4])!r})")
    if data[4] not in (FORMAT_VERSION, SIGNED_FORMAT):
        raise RecordRejected(
            "wrong_schema", f"frame format {data[4]}, this reader knows {FORMAT_VERSION} and {SIGNED_FORMAT}"
        )
    if len(data) < payload_offset(data):
        raise RecordRejected("bad_magic", "frame shorter than its header")
    stored = bytes(data[5:HEADER_SIZE])
    actual = xxhash.xxh3_128_digest(memoryview(data)[payload_offset(data) :])
    if stored != actual:
        raise RecordRejected(
            "digest_mismatch", f"frame says {stored.hex()}, payload hashes to {actual.hex()}"
        )
    return actual


def inflate(payload: memoryview, max_out: int) -> bytes:
    # Never trust the frame's content-size field: read through a bounded stream, one byte past the cap.
    try:
        declared = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as exc:
        raise RecordRejected("decode_error", f"zstd frame header: {exc}") from exc
    if declared > max_out:
        raise RecordRejected("oversize_bytes", f"declares {declared} decompressed bytes > {max_out}")
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(payload)) as reader:
            out = reader.read(max_out + 1)
    except zstandard.ZstdError as exc:
        raise RecordRejected("decode_error", f"zstd: {exc}") from exc
    if len(out) > max_out:
        raise RecordRejected("oversize_bytes", f"decompresses past {max_out} bytes")
    return out


def _probe_schema(raw: bytes) -> Any:
    try:
        return _probe_decoder.decode(raw).schema
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


def _check_header_fields(g: RolloutGroup) -> None:
    try:
        check_name(g.worker_id, "worker id")
        check_name(g.run_id, "run id")
        check_name(g.engine, "engine")  # becomes a metrics key on the trainer
    except ValueError as exc:
        raise RecordRejected("bad_field", str(exc)) from exc
    problems = header_problems(
        g.seq,
        g.policy_version,
        {"env": g.env, "task_id": g.task_id, "weights_digest": g.weights_digest},
        g.temperature,
        g.top_p,
        g.top_k,
    )
    for name in ("created_at", "gen_seconds", "score_seconds"):
        value = getattr(g, name)
        if not (math.isfinite(value) and value >= 0):
            problems.append(f"{name} {value} must be finite and >= 0")
    if problems:
        raise RecordRejected("bad_field", "; ".join(problems))


def header_problems(
    seq: int, policy_version: int, names: dict[str, str], temperature: float, top_p: float, top_k: int
) -> list[str]:
    """What is wrong with the header fields every group record shares (empty if nothing)."""
    problems = []
    if seq < 0 or seq > 9_999_999_999:
        problems.append(f"seq {seq} outside [0, 9999999999]")
    if policy_version < 0 or policy_version > 99_999_999:
        problems.append(f"policy_version {policy_version} outside [0, 99999999]")
    for name, value in names.items():
        if not value or len(value) > 256:
            problems.append(f"{name} must be 1-256 characters")
    if not (math.isfinite(temperature) and temperature >= 0):
        problems.append(f"temperature {temperature} must be finite and >= 0")
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        problems.append(f"top_p {top_p} must be in (0, 1]")
    if top_k < 0:
        problems.append(f"top_k {top_k} must be >= 0")
    return problems


def _check_token_ids(tokens: list[int] | np.ndarray, vocab_size: int | None, where: str) -> None:
    if len(tokens) == 0:
        return
    ids = np.asarray(tokens, dtype=np.int64)
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or (vocab_size is not None and hi >= vocab_size):
        bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise RecordRejected("token_out_of_range", f"{where} token ids span [{lo}, {hi}], need {bound}")


def _check_sample(s: Sample, i: int, limits: Limits, vocab_size: int | None) -> None:
    check_sample_view(
        i, s.tokens, s.logprobs, s.loss_mask, s.reward, s.finish_reason, s.num_tool_calls, limits, vocab_size
    )
    if not all(math.isfinite(v) for v in s.reward_parts.values()):
        raise RecordRejected("bad_reward", f"sample {i}: reward_parts must be finite")


def check_sample_view(
    i: int,
    tokens: list[int],
    logprobs: list[float],
    loss_mask: list[int],
    reward: float,
    finish_reason: str,
    num_tool_calls: int,
    limits: Limits,
    vocab_size: int | None = None,
) -> None:
    """Check the token view every group record's sample shares (ids, behaviour logprobs, mask, reward).

    Raises RecordRejected("too_many_tokens" | "length_mismatch" | "bad_mask" | "token_out_of_range" |
    "bad_logprob" | "bad_reward" | "bad_field").
    """
    n = len(tokens)
    if n > limits.max_tokens_per_sample:
        raise RecordRejected("too_many_tokens", f"sample {i} has {n} > {limits.max_tokens_per_sample} tokens")
    if len(logprobs) != n or len(loss_mask) != n:
        raise RecordRejected(
            "length_mismatch",
            f"sample {i}: {n} tokens, {len(logprobs)} logprobs, {len(loss_mask)} mask entries",
        )
    if n:
        # msgspec has already checked element types; numpy makes the range checks cheap.
        mask = np.asarray(loss_mask, dtype=np.int64)
        if ((mask != 0) & (mask != 1)).any():
            raise RecordRejected("bad_mask", f"sample {i}: loss_mask values must be 0 or 1")
        _check_token_ids(tokens, vocab_size, f"sample {i}")
        lp = np.asarray(logprobs, dtype=np.float64)
        if not np.isfinite(lp).all() or (lp > 0).any():
            raise RecordRejected("bad_logprob", f"sample {i}: logprobs must be finite and <= 0")
        if (lp[mask == 0] != 0.0).any():
            raise RecordRejected("bad_logprob", f"sample {i}: logprob must be 0.0 where loss_mask is 0")
    if not (math.isfinite(reward) and 0.0 <= reward <= 1.0):
        raise RecordRejected("bad_reward", f"sample {i}: reward {reward} must be finite and in [0, 1]")
    if not finish_reason or len(finish_reason) > 64 or num_tool_calls < 0:
        raise RecordRejected("bad_field", f"sample {i}: bad finish_reason or num_tool_calls")


# --- JSON records (run.json, heartbeats) ------------------------------------------------------------------


def encode_json(record: msgspec.Struct) -> bytes:
    """Human-readable, indented JSON for a record (run.json, heartbeats, other small manifests)."""
    return msgspec.json.format(msgspec.json.encode(record), indent=2) + b"\n"


def decode_json(data: bytes, type: type[T], max_bytes: int = 1 << 20) -> T:
    """Decode a JSON record of `type`, checking its `schema` against the class's `SCHEMA`.

    Raises RecordRejected("oversize_bytes" | "decode_error" | "bad_field" | "wrong_schema").
    """
    if len(data) > max_bytes:
        raise RecordRejected("oversize_bytes", f"{len(data)} bytes > {max_bytes}")
    expected = getattr(type, "SCHEMA", None)
    try:
        record = msgspec.json.decode(data, type=type)
    except msgspec.ValidationError as exc:
        found = _json_schema(data)
        if expected is not None and found is not None and found != expected:
            raise RecordRejected(
                "wrong_schema", f"{type.__name__} schema {found!r}, this reader knows {expected}"
            ) from exc
        raise RecordRejected("bad_field", f"{type.__name__}: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise RecordRejected("decode_error", f"{type.__name__}: {exc}") from exc
    found = getattr(record, "schema", None)
    if expected is not None and found != expected:
        raise RecordRejected(
            "wrong_schema", f"{type.__name__} schema {found!r}, this reader knows {expected}"
        )
    return record


def _json_schema(data: bytes) -> Any:
    try:
        return msgspec.json.decode(data, type=_SchemaProbe).schema
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
