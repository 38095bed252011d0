"""What the engine tests share: the gap between the logprobs an engine recorded and the trainer's recompute."""

from __future__ import annotations

import torch

from pnyx.models import completion_logprobs
from pnyx.rollout.sampling import Completion, SamplingParams


def logprob_gaps(
    model, prompts: list[list[int]], completions: list[Completion], params: SamplingParams
) -> torch.Tensor:
    """|recorded - recomputed| for every real completion token (the recompute: `completion_logprobs`, the
    trainer's, on `model`); asserts every recorded logprob is finite."""
    with torch.no_grad():
        logp, mask, _ = completion_logprobs(
            model, prompts, [c.tokens for c in completions], params.temperature, params.top_k, params.top_p
        )
    recorded = torch.zeros_like(logp)
    for i, c in enumerate(completions):
        recorded[i, : len(c.tokens)] = torch.tensor(c.logprobs)
    assert torch.isfinite(recorded[mask]).all()
    return (logp - recorded).abs()[mask]
