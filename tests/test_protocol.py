"""Wire records: round trips, every rejection rule fed a hostile record, digests, zip bombs, keys."""

from __future__ import annotations

import copy
import math

import msgspec
import pytest
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pnyx.errors import RecordRejected
from pnyx.protocol import (
    REASONS,
    Heartbeat,
    Limits,
    RolloutGroup,
    RunManifest,
    Sample,
    decode_group,
    decode_json,
    encode_group,
    encode_json,
    group_digest,
)
from pnyx.protocol.codec import FORMAT_VERSION, HEADER_SIZE, MAGIC
from pnyx.protocol.layout import parse_rollout_key, rollout_key, rollout_stamp, rollouts_start_after


def make_group(**overrides) -> RolloutGroup:
    fields = dict(
        run_id="run-1",
        worker_id="w-0",
        seq=7,
        policy_version=3,
        weights_digest="d" * 32,
        env="arith",
        task_id="arith:train:1:42",
        prompt_tokens=[1, 2, 3, 4],
        samples=[
            Sample(
                tokens=[5, 6, 7, 8],
                logprobs=[-0.1, -2.0, 0.0, -0.5],
                loss_mask=[1, 1, 0, 1],
                reward=1.0,
                reward_parts={"correct": 1.0},
                finish_reason="stop",
            ),
            Sample(tokens=[9], logprobs=[-1.0], loss_mask=[1], reward=0.0, finish_reason="length"),
        ],
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        created_at=1_700_000_000.0,
        gen_seconds=0.5,
        score_seconds=0.01,
    )
    fields.update(overrides)
    return RolloutGroup(**fields)


def frame_raw(obj: object) -> bytes:
    """Frame an arbitrary msgpack object exactly as `encode_group` frames a group (valid digest)."""
    payload = zstandard.ZstdCompressor().compress(msgspec.msgpack.encode(obj))
    return MAGIC + bytes([FORMAT_VERSION]) + xxhash.xxh3_128_digest(payload) + payload


def hostile(mutate) -> bytes:
    """A framed record made from a valid group's raw dict after `mutate(d)` edits it in place."""
    d = copy.deepcopy(msgspec.to_builtins(make_group()))
    mutate(d)
    return frame_raw(d)


def reason_of(data: bytes, **kwargs) -> str:
    with pytest.raises(RecordRejected) as info:
        decode_group(data, **kwargs)
    assert info.value.reason in REASONS
    return info.value.reason


# --- round trips ---------------------------------------------------------------------------------------


def test_valid_group_round_trips():
    group = make_group()
    assert decode_group(encode_group(group), vocab_size=10) == group


def test_hostile_helper_frames_valid_records_that_decode():
    assert decode_group(hostile(lambda d: None)) == make_group()


@st.composite
def samples(draw) -> Sample:
    n = draw(st.integers(0, 20))
    mask = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
    lps = [draw(st.floats(min_value=-50.0, max_value=0.0, allow_nan=False)) if m else 0.0 for m in mask]
    return Sample(
        tokens=draw(st.lists(st.integers(0, 151_935), min_size=n, max_size=n)),
        logprobs=lps,
        loss_mask=mask,
        reward=draw(st.floats(0.0, 1.0)),
        reward_parts=draw(st.dictionaries(st.text(max_size=8), st.floats(-5, 5), max_size=3)),
        finish_reason=draw(st.sampled_from(["stop", "length", "tool_error", "turn_limit"])),
        num_tool_calls=draw(st.integers(0, 8)),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    samples=st.lists(samples(), min_size=1, max_size=8),
    prompt=st.lists(st.integers(0, 151_935), max_size=50),
    seq=st.integers(0, 9_999_999_999),
    version=st.integers(0, 99_999_999),
    worker=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,20}", fullmatch=True),
    temperature=st.floats(0.0, 2.0),
)
def test_property_round_trip(samples, prompt, seq, version, worker, temperature):
    group = make_group(
        samples=samples,
        prompt_tokens=prompt,
        seq=seq,
        policy_version=version,
        worker_id=worker,
        temperature=temperature,
    )
    assert decode_group(encode_group(group), vocab_size=151_936) == group


def test_json_records_round_trip():
    manifest = RunManifest(run_id="r", created_at=1.0, config={"a": {"b": 1}}, model={"vocab_size": 10})
    beat = Heartbeat(worker_id="w-1", updated_at=2.0, rollouts=5, tokens_per_s=12.5)
    assert decode_json(encode_json(manifest), RunManifest) == manifest
    assert decode_json(encode_json(beat), Heartbeat) == beat
    assert b"\n  " in encode_json(manifest)  # indented: humans read run.json


def test_json_wrong_schema_is_rejected():
    data = encode_json(Heartbeat(worker_id="w", updated_at=1.0)).replace(b'"schema": 1', b'"schema": 2')
    with pytest.raises(RecordRejected) as info:
        decode_json(data, Heartbeat)
    assert info.value.reason == "wrong_schema"


def test_json_garbage_is_decode_error():
    with pytest.raises(RecordRejected) as info:
        decode_json(b"{not json", RunManifest)
    assert info.value.reason == "decode_error"


def test_json_missing_field_is_bad_field():
    with pytest.raises(RecordRejected) as info:
        decode_json(b'{"schema": 1, "worker_id": "w"}', Heartbeat)
    assert info.value.reason == "bad_field"


# --- one test per rejection rule ---------------------------------------------------------------------


def test_bad_magic():
    assert reason_of(b"NOPE" + encode_group(make_group())[4:]) == "bad_magic"


def test_truncated_header_is_bad_magic():
    assert reason_of(MAGIC + b"\x01") == "bad_magic"


def test_unknown_frame_format_is_wrong_schema():
    data = bytearray(encode_group(make_group()))
    data[4] = FORMAT_VERSION + 0x7E  # 2 is the signed frame; this one no reader knows
    assert reason_of(bytes(data)) == "wrong_schema"


def test_digest_mismatch():
    data = bytearray(encode_group(make_group()))
    data[5] ^= 0xFF
    assert reason_of(bytes(data)) == "digest_mismatch"


def test_any_corrupted_byte_is_detected():
    data = encode_group(make_group())
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x01
        assert reason_of(bytes(bad)) in {"bad_magic", "wrong_schema", "digest_mismatch"}, i


def test_oversize_compressed_bytes():
    data = encode_group(make_group())
    assert reason_of(data, limits=Limits(max_bytes=len(data) - 1)) == "oversize_bytes"


def test_zip_bomb_is_rejected_without_inflating():
    # 256 MiB of zeros compresses to a few KiB; the declared content size alone must stop it.
    compressor = zstandard.ZstdCompressor(level=1)
    chunk = bytes(1 << 20)
    writer = compressor.chunker(size=256 << 20, chunk_size=1 << 20)
    payload = b"".join(c for _ in range(256) for c in writer.compress(chunk)) + b"".join(writer.finish())
    assert zstandard.frame_content_size(payload) == 256 << 20
    data = MAGIC + bytes([FORMAT_VERSION]) + xxhash.xxh3_128_digest(payload) + payload
    assert len(data) < 8 << 20
    assert reason_of(data) == "oversize_bytes"


def test_zip_bomb_without_declared_size_stops_at_the_cap():
    # No content size in the frame header: the bounded stream read is what stops it.
    compressor = zstandard.ZstdCompressor(level=1, write_content_size=False)
    obj = compressor.compressobj()
    payload = b"".join(obj.compress(bytes(1 << 20)) for _ in range(64)) + obj.flush()
    assert zstandard.frame_content_size(payload) == -1
    data = MAGIC + bytes([FORMAT_VERSION]) + xxhash.xxh3_128_digest(payload) + payload
    assert reason_of(data, limits=Limits(max_decompressed_bytes=1 << 20)) == "oversize_bytes"


def test_decode_error_on_garbage_payload():
    payload = b"\x00not zstd at all"
    data = MAGIC + bytes([FORMAT_VERSION]) + xxhash.xxh3_128_digest(payload) + payload
    assert reason_of(data) == "decode_error"


def test_decode_error_on_bad_msgpack():
    payload = zstandard.ZstdCompressor().compress(b"\xc1\xc1\xc1")  # 0xc1 is never valid msgpack
    data = MAGIC + bytes([FORMAT_VERSION]) + xxhash.xxh3_128_digest(payload) + payload
    assert reason_of(data) == "decode_error"


def test_wrong_schema():
    assert reason_of(hostile(lambda d: d.update(schema=2))) == "wrong_schema"


def test_wrong_schema_with_unknown_shape():
    # A future schema may change field types; the schema, not the shape, is what gets reported.
    assert reason_of(hostile(lambda d: d.update(schema=9, samples="v9-format"))) == "wrong_schema"


def test_too_many_samples():
    data = hostile(lambda d: d.update(samples=d["samples"] * 3))
    assert reason_of(data, limits=Limits(max_samples=5)) == "too_many_samples"


def test_too_many_completion_tokens():
    def mutate(d):
        d["samples"][1].update(tokens=[1] * 11, logprobs=[-1.0] * 11, loss_mask=[1] * 11)

    assert reason_of(hostile(mutate), limits=Limits(max_tokens_per_sample=10)) == "too_many_tokens"


def test_too_many_prompt_tokens():
    data = hostile(lambda d: d.update(prompt_tokens=[1] * 11))
    assert reason_of(data, limits=Limits(max_prompt_tokens=10)) == "too_many_tokens"


def test_token_out_of_vocab_range():
    data = hostile(lambda d: d["samples"][0].update(tokens=[5, 6, 7, 100]))
    assert reason_of(data, vocab_size=100) == "token_out_of_range"


def test_negative_token_is_out_of_range_without_vocab():
    assert reason_of(hostile(lambda d: d["samples"][0].update(tokens=[5, -1, 7, 8]))) == "token_out_of_range"


def test_prompt_token_out_of_vocab_range():
    assert (
        reason_of(hostile(lambda d: d.update(prompt_tokens=[1, 50])), vocab_size=50) == "token_out_of_range"
    )


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 0.25])
def test_bad_logprob_values(value):
    assert (
        reason_of(hostile(lambda d: d["samples"][0].update(logprobs=[-0.1, value, 0.0, -0.5])))
        == "bad_logprob"
    )


def test_logprob_under_zero_mask_must_be_zero():
    assert (
        reason_of(hostile(lambda d: d["samples"][0].update(logprobs=[-0.1, -2.0, -0.3, -0.5])))
        == "bad_logprob"
    )


def test_length_mismatch_logprobs():
    assert reason_of(hostile(lambda d: d["samples"][0].update(logprobs=[-0.1]))) == "length_mismatch"


def test_length_mismatch_mask():
    assert (
        reason_of(hostile(lambda d: d["samples"][0].update(loss_mask=[1, 1, 1, 1, 1]))) == "length_mismatch"
    )


def test_bad_mask_value():
    assert reason_of(hostile(lambda d: d["samples"][0].update(loss_mask=[1, 2, 0, 1]))) == "bad_mask"


@pytest.mark.parametrize("value", [math.nan, math.inf, -0.01, 1.01])
def test_bad_reward(value):
    assert reason_of(hostile(lambda d: d["samples"][1].update(reward=value))) == "bad_reward"


def test_non_finite_reward_part_is_bad_reward():
    assert reason_of(hostile(lambda d: d["samples"][0].update(reward_parts={"x": math.nan}))) == "bad_reward"


def test_empty_group():
    assert reason_of(hostile(lambda d: d.update(samples=[]))) == "empty_group"


@pytest.mark.parametrize(
    "field, value",
    [
        ("seq", -1),
        ("policy_version", -3),
        ("worker_id", "../etc"),
        ("worker_id", ""),
        ("run_id", "a/b"),
        ("top_p", 0.0),
        ("top_k", -1),
        ("temperature", math.nan),
        ("env", ""),
        ("gen_seconds", -1.0),
    ],
)
def test_bad_header_field(field, value):
    assert reason_of(hostile(lambda d: d.update({field: value}))) == "bad_field"


def test_wrong_field_type_is_bad_field():
    assert reason_of(hostile(lambda d: d.update(seq="seven"))) == "bad_field"


def test_missing_field_is_bad_field():
    assert reason_of(hostile(lambda d: d.pop("samples"))) == "bad_field"


# --- digests and keys ------------------------------------------------------------------------------------


def test_group_digest_names_the_payload():
    a, b = encode_group(make_group()), encode_group(make_group(seq=8))
    assert group_digest(a) == group_digest(encode_group(make_group())) == a[5:HEADER_SIZE].hex()
    assert group_digest(a) != group_digest(b)


def test_group_digest_rejects_corruption():
    data = bytearray(encode_group(make_group()))
    data[-1] ^= 0x10
    with pytest.raises(RecordRejected) as info:
        group_digest(bytes(data))
    assert info.value.reason == "digest_mismatch"


def test_rollout_key_round_trips_through_layout():
    group = make_group(seq=1234, policy_version=42, worker_id="gpu-node_7.a")
    key = rollout_key(group.policy_version, group.worker_id, group.seq, stamp_ms=1_700_000_000_123)
    assert key == "rollouts/v00000042/1700000000123~gpu-node_7.a-0000001234"
    assert parse_rollout_key(key) == (42, "gpu-node_7.a", 1234)
    assert rollout_stamp(key) == 1_700_000_000_123


def test_rollout_keys_sort_by_stamp_within_a_version_and_old_keys_still_parse():
    early = rollout_key(3, "zz", 9, stamp_ms=1000)
    late = rollout_key(3, "aa", 0, stamp_ms=2000)
    assert early < late  # the worker id does not decide the order: the upload stamp does
    assert rollouts_start_after(3, 1500) < late and not rollouts_start_after(3, 1500) < early
    assert rollout_key(3, "w", 1).split("/")[2][:13].isdigit()  # stamped with this machine's clock
    old = "rollouts/v00000003/worker-9-0000000012"  # the first layout, without a stamp
    assert parse_rollout_key(old) == (3, "worker-9", 12) and rollout_stamp(old) is None


def test_parse_rollout_key_rejects_foreign_keys():
    for junk in (
        "rollouts/v00000042/w-12",
        "rollouts/v42/w-0000000001",
        "rollouts/v00000042/-0000000001",
        "rollouts/v00000042/123~w-0000000001",  # a stamp is 13 digits
        "rollouts/v00000042/1700000000123~-0000000001",
        "rollouts/v00000042/1700000000123~w~x-0000000001",
        "x",
    ):
        assert parse_rollout_key(junk) is None


def test_group_without_an_engine_field_decodes_as_the_torch_engine():
    def drop_engine(d):
        del d["engine"]

    assert decode_group(hostile(drop_engine)).engine == "torch"
    assert decode_group(encode_group(make_group(engine="mlx"))).engine == "mlx"


def test_group_with_an_unusable_engine_name_is_rejected():
    with pytest.raises(RecordRejected) as e:
        decode_group(encode_group(make_group(engine="x" * 200)))
    assert e.value.reason == "bad_field"
