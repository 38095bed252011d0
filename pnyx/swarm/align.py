"""Character-level alignment of two tokenizations of one text, and the behaviour estimate it gives.

A node that receives text from a peer with another tokenizer cannot use the peer's per-token
logprobs directly: the tokens differ. Both tokenizations, however, cut the same text at character
offsets, and wherever both cut at the same offset the text between two shared cuts (a *segment*) has a
well-defined probability under each policy: the sum of the per-token logprobs of the tokens inside it
(up to the small difference of conditioning on the same text rendered as different token prefixes).

`aligned_behaviour` turns the sender's segment logprob into a per-token behaviour estimate for the
receiver's tokens: inside a segment of k receiver tokens with own logprobs π_t, each token gets
μ_t = π_t + (log μ_seg - log π_seg) / k, so the segment's importance ratio Π_t π_t/μ_t equals the
true segment ratio π_seg/μ_seg and is spread evenly (geometrically) over its tokens. Segments holding
any tool/env text (sender mask 0) are excluded from the loss.

Pure functions over lists; knows nothing about torch, models or the store (a tokenizer object is
only called for `decode`).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MAX_PREFIX_DECODE = 1024
"""Above this many tokens, `char_ends` sums per-token decodes instead of decoding every prefix (O(n²))."""


def char_ends(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> list[int]:
    """Character offset where each token's text ends in `tokenizer.decode(ids, skip_special_tokens=True)`.

    Offsets come from decoding each prefix, so multi-byte characters split across byte-level tokens land
    on the token that completes them. The result is clamped non-decreasing and within the full text;
    special tokens (skipped in decoding) get a zero-length span.
    """
    ids = [int(i) for i in ids]
    if not ids:
        return []
    full = len(tokenizer.decode(ids, skip_special_tokens=True))
    if len(ids) <= MAX_PREFIX_DECODE:
        lengths = [
            len(t)
            for t in tokenizer.batch_decode([ids[: i + 1] for i in range(len(ids))], skip_special_tokens=True)
        ]
    else:
        pieces = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=True)
        lengths, total = [], 0
        for p in pieces:
            total += len(p)
            lengths.append(total)
    out, prev = [], 0
    for n in lengths:
        prev = min(max(prev, n), full)
        out.append(prev)
    return out


def segment_ids(ends: Sequence[int], cuts: Sequence[int]) -> list[int]:
    """For each token end offset, the index of the first shared cut at or after it (its segment)."""
    return [bisect_left(cuts, e) for e in ends]


def aligned_behaviour(
    sender_ends: Sequence[int],
    sender_logprobs: Sequence[float],
    sender_mask: Sequence[int],
    own_ends: Sequence[int],
    own_logprobs: Sequence[float],
) -> tuple[list[float], list[int]]:
    """Per-token behaviour estimate μ and loss mask for the receiver's tokens of the same text.

    `sender_*` describe the sender's tokens of the text (EOS excluded), `own_*` the receiver's tokens
    (EOS excluded) with the receiver's own logprobs π (detached). Returns (μ, mask) aligned with the
    receiver's tokens: mask 0 (and μ 0.0) for tokens in segments that hold tool text or that one side
    does not cover; μ is clamped to <= 0.
    """
    if not (len(sender_ends) == len(sender_logprobs) == len(sender_mask)):
        raise ValueError("sender_ends, sender_logprobs and sender_mask must have equal lengths")
    if len(own_ends) != len(own_logprobs):
        raise ValueError("own_ends and own_logprobs must have equal lengths")
    cuts = sorted(set(sender_ends) & set(own_ends))
    s_seg = segment_ids(sender_ends, cuts)
    o_seg = segment_ids(own_ends, cuts)
    n_seg = len(cuts) + 1
    mu_sum = [0.0] * n_seg
    pi_sum = [0.0] * n_seg
    s_count = [0] * n_seg
    o_count = [0] * n_seg
    tool = [False] * n_seg
    for seg, lp, m in zip(s_seg, sender_logprobs, sender_mask, strict=True):
        mu_sum[seg] += float(lp)
        s_count[seg] += 1
        tool[seg] |= not m
    for seg, lp in zip(o_seg, own_logprobs, strict=True):
        pi_sum[seg] += float(lp)
        o_count[seg] += 1
    # Tokens past the last shared cut have no counterpart: the last segment index (len(cuts)) is only
    # usable when both sides reach it, which happens only if the texts' ends differ (never trained on).
    mu: list[float] = []
    mask: list[int] = []
    for seg, lp in zip(o_seg, own_logprobs, strict=True):
        usable = seg < len(cuts) and s_count[seg] > 0 and not tool[seg]
        if not usable:
            mu.append(0.0)
            mask.append(0)
            continue
        shift = (mu_sum[seg] - pi_sum[seg]) / o_count[seg]
        mu.append(min(0.0, float(lp) + shift))
        mask.append(1)
    return mu, mask
