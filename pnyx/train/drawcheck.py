"""The check of seeded draws: every model token a worker sends must be the draw of its uniform.

A seeded group (`RolloutGroup.draws == pnyx.protocol.draws.SCHEME`) drew token t of sample i by inverse
CDF from uniform u_{i,t}, derived from the run, the signing key, the worker id, the task, the version, the
seq and i (`pnyx.protocol.draws`): the token is the one whose interval [F(y-1), F(y)) of the vocabulary-
order CDF of the sampling distribution (temperature, top-k, top-p: `sampling_logprobs`) holds u. A token's
**distance** is 0 when u lies in its interval, else how far outside (`logprobs.draw_distance`). A group
passes only if every distance is at most `security.draw_tolerance`, which absorbs the engines' rounding
(a worker's fp16-copy matmuls or MLX kernels against an fp32 forward move interval edges by ~1e-6). With
tolerance 0 a passing group is the honest draw token for token (by induction over positions): a
temperature liar, a cherry-picker of samples, or a worker that re-rolls a sample has no choice left but to
send the honest draw.

Where it runs, at no extra forward for most rows: the step's own forward (`pnyx.train.step`) gives every
token's distance beside its logprob. That forward computes with the trainer's weights, which are not the
weights a stale group was sampled from (drift moves interval edges), so a row with a token over the
tolerance there is measured once more under exactly the published weights of its version
(`pnyx.train.rejudge.Rejudge.draws`, `published.PublishedModel`), and only that exact distance can fail
its group (`draw_mismatch`, a fault of its key). Measured design and costs: docs/verifiable-sampling.md.

This module holds what the rest shares: the reasons, the ingestion's policy for unseeded groups, and
`distances` (one group under one model: benchmarks and tests).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

import numpy as np
import torch

from pnyx.protocol.draws import SCHEME
from pnyx.protocol.records import RolloutGroup
from pnyx.security.checks import DRAW_MISMATCH, DRAW_UNVERIFIABLE
from pnyx.train.rescore import ScoredGroup

log = logging.getLogger("pnyx.trainer")

TOLERANCE = 1e-3
"""Default largest distance of an honest token (`security.draw_tolerance`); see docs/security.md."""
MISMATCH = DRAW_MISMATCH
"""Reason of a group with a token its uniform did not draw (a fault of its key)."""
UNVERIFIABLE = DRAW_UNVERIFIABLE
"""Reason of a group whose version's published weights could not be obtained or verified (not a fault)."""
UNSEEDED = "unseeded"
"""Reason of a group without seeded draws in a run that requires them (a fault of its key)."""


def unseeded_policy(accept_unseeded: bool, trusted: Collection[str]) -> Callable[[ScoredGroup], str | None]:
    """The ingestor's check that a group is seeded (`Ingestor.check_draws`): a seeded group, or an unseeded
    one from a trusted key (your own vLLM worker) or with `accept_unseeded`, passes; else `unseeded`."""

    def check(g: ScoredGroup) -> str | None:
        if g.group.draws == SCHEME or accept_unseeded or g.signer in trusted:
            return None
        return UNSEEDED

    return check


def distances(model: torch.nn.Module, group: RolloutGroup, key: str) -> list[np.ndarray]:
    """Per sample, the distance of each model token from the draw of its uniform under `model` (its
    sampling distribution at the group's settings), as the step measures them."""
    from pnyx.models.logprobs import completion_stats
    from pnyx.train.microbatch import row_uniforms

    samples = list(group.samples)
    if group.draws != SCHEME or not samples:
        raise ValueError("the group has no seeded draws")
    prompt = list(group.prompt_tokens)
    with torch.no_grad():
        out = completion_stats(
            model, [prompt] * len(samples), [list(s.tokens) for s in samples], group.temperature, group.top_k,
            group.top_p, uniforms=[row_uniforms(group, key, i) for i in range(len(samples))],
        )  # fmt: skip
    assert out.draw is not None
    draw = out.draw.to("cpu").numpy()
    return [draw[i, : len(s.tokens)][np.asarray(s.loss_mask, dtype=bool)] for i, s in enumerate(samples)]
