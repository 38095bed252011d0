"""Swarm wire records and the cross-tokenizer behaviour estimate: pure functions, no model."""

from __future__ import annotations

import math

import pytest

from pnyx.errors import RecordRejected
from pnyx.swarm.align import aligned_behaviour, char_ends
from pnyx.swarm.records import SwarmGroup, SwarmSample, decode_swarm_group, encode_swarm_group


def _group(**over) -> SwarmGroup:
    sample = SwarmSample(
        text="<answer>12</answer>",
        tokens=[5, 6, 7],
        logprobs=[-0.5, -1.0, -0.1],
        loss_mask=[1, 1, 1],
        token_ends=[8, 10, 19],
        eos=False,
        reward=1.0,
    )
    fields = dict(
        node="alice",
        seq=3,
        policy_version=2,
        model_id="tiny:qwen2",
        tokenizer_digest="ab" * 16,
        env="arith",
        env_kwargs={"digits": 1},
        task_id="arith/train/0/1",
        samples=[sample],
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        created_at=1.0,
    )
    fields.update(over)
    return SwarmGroup(**fields)


def test_swarm_group_round_trips():
    g = _group()
    assert decode_swarm_group(encode_swarm_group(g)) == g


@pytest.mark.parametrize(
    ("sample_over", "reason"),
    [
        ({"token_ends": [8, 7, 19]}, "bad_text"),  # not non-decreasing
        ({"token_ends": [8, 10, 99]}, "bad_text"),  # past the end of the text
        ({"logprobs": [-0.5, 0.5, -0.1]}, "bad_logprob"),
        ({"logprobs": [-0.5, -1.0]}, "length_mismatch"),
        ({"loss_mask": [1, 2, 1]}, "bad_mask"),
        ({"reward": math.nan}, "bad_reward"),
    ],
)
def test_invalid_sample_is_rejected_with_reason(sample_over, reason):
    base = _group().samples[0]
    fields = {f: getattr(base, f) for f in base.__struct_fields__} | sample_over
    g = _group(samples=[SwarmSample(**fields)])
    with pytest.raises(RecordRejected) as err:
        decode_swarm_group(encode_swarm_group(g))
    assert err.value.reason == reason


def test_invalid_header_is_rejected():
    with pytest.raises(RecordRejected) as err:
        decode_swarm_group(encode_swarm_group(_group(node="../etc")))
    assert err.value.reason == "bad_field"
    with pytest.raises(RecordRejected) as err:
        decode_swarm_group(encode_swarm_group(_group(samples=[])))
    assert err.value.reason == "empty_group"


def test_identical_tokenizations_give_the_sender_logprobs():
    ends, lp, mask = [2, 5, 9], [-0.1, -0.7, -2.0], [1, 1, 1]
    mu, m = aligned_behaviour(ends, lp, mask, ends, [-5.0, -5.0, -5.0])
    assert mu == pytest.approx(lp) and m == [1, 1, 1]


def test_aligned_segment_ratio_equals_the_true_segment_ratio():
    # Sender cut the text at 3 and 6; we cut it at 1, 3 and 6 (two of our tokens cover its first token).
    s_ends, s_lp, s_mask = [3, 6], [-1.0, -0.5], [1, 1]
    o_ends, o_lp = [1, 3, 6], [-0.2, -0.4, -0.9]
    mu, mask = aligned_behaviour(s_ends, s_lp, s_mask, o_ends, o_lp)
    assert mask == [1, 1, 1]
    assert sum(mu[:2]) == pytest.approx(-1.0)  # segment (0, 3]: our two tokens carry the sender's mass
    assert mu[0] - o_lp[0] == pytest.approx(mu[1] - o_lp[1])  # the segment's log-ratio spread evenly
    assert mu[2] == pytest.approx(-0.5)


def test_segments_with_tool_text_are_not_trained():
    s_ends, s_lp, s_mask = [2, 4, 6], [-0.1, 0.0, -0.3], [1, 0, 1]  # the middle token is tool output
    o_ends, o_lp = [2, 6], [-0.2, -0.4]  # our second token spans tool and model text
    mu, mask = aligned_behaviour(s_ends, s_lp, s_mask, o_ends, o_lp)
    assert mask == [1, 0] and mu[1] == 0.0


def test_char_ends_cover_the_decoded_text(tmp_path):
    from pnyx_harness.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer(400)
    text = "<answer>größe 42 ✓</answer>"
    ids = tok.encode(text, add_special_tokens=False)
    ends = char_ends(tok, ids)
    assert len(ends) == len(ids) and ends[-1] == len(text)
    assert ends == sorted(ends)
