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

This module holds what the rest shares: the reasons, the ingestion's policy for unseeded groups, the
step's per-row verdict (`row_draws`) and weight rounding (`rounded_weights`), and the exact re-check's
forward for models the prefix tree (`pnyx.train.prefix_tree`, one call per version) does not fit
(`cached_prompt_logits`: each prompt once, the completions on its KV cache).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import random
import time
from collections.abc import Callable, Collection, Iterator
from typing import TYPE_CHECKING

import torch

from pnyx.errors import ConfigError
from pnyx.protocol.draws import SCHEME
from pnyx.security.checks import DRAW_MISMATCH, DRAW_UNVERIFIABLE
from pnyx.train.rescore import ScoredGroup

if TYPE_CHECKING:
    from pnyx.train.microbatch import Row
    from pnyx.train.stepstats import DrawTally

MISMATCH = DRAW_MISMATCH
"""Reason of a group with a token its uniform did not draw (a fault of its key)."""
UNVERIFIABLE = DRAW_UNVERIFIABLE
"""Reason of a group whose version's published weights could not be obtained or verified (not a fault)."""
UNSEEDED = "unseeded"
"""Reason of a group without seeded draws in a run that requires them (a fault of its key)."""
MAX_LOGITS = 32 * 1024 * 1024
"""Rows x positions x vocabulary of one exact re-check call's logits (float32: 128 MB)."""
_AUDIT_RNG = random.SystemRandom()
"""Which passing stale rows are measured exactly: randomness no worker can predict."""
CHUNK_TOKENS = 1024
"""Rows x padded width per forward call of the exact re-check. Rows are sorted by length, so a call pads
little (on SmolLM2-135M, 256 to 4096 timed alike within noise)."""


def unseeded_policy(accept_unseeded: bool, trusted: Collection[str]) -> Callable[[ScoredGroup], str | None]:
    """The ingestor's check that a group is seeded (`Ingestor.check_draws`): a seeded group, or an unseeded
    one from a trusted key (your own vLLM worker) or with `accept_unseeded`, passes; else `unseeded`."""

    def check(g: ScoredGroup) -> str | None:
        if g.group.draws == SCHEME or accept_unseeded or g.signer in trusted:
            return None
        return UNSEEDED

    return check


def row_draws(
    draw: torch.Tensor,
    rows: list[Row],
    tolerance: float,
    staleness: list[int],
    exact: Callable[[list[Row]], list[float]] | None,
    tally: DrawTally,
    audit: float = 0.0,
    rng: random.Random = _AUDIT_RNG,
) -> list[float | None]:
    """Per row, its largest distance from its seeded draws (None: a row without uniforms): from the step's
    forward (`draw` [rows, T]), or, for a row with a token over `tolerance` there, from `exact`
    (`Rejudge.draws`: its version's published weights), which measures every token of the row cut after
    its last token over (`prefix`). A share `audit` of the stale rows that pass under the step's forward,
    chosen with `rng`, is measured by `exact` too, whole: only there does the distance stand. So a fresh
    row passes when all its tokens are their uniforms' draws under the weights it was sampled from (the
    step's forward runs on the published ones), and a stale one when they are under the trainer's newer
    weights, which a worker drawing honestly never saw, or under its own version's; the audit is what
    binds a worker that stamps an older version and draws under the newer weights, to choose between two
    samples (docs/security.md). Counted in `tally` by `staleness` (per row). Without `exact`, the step's
    distances stand."""
    worst: list[float] = draw.amax(1).tolist()
    seeded = [r.uniforms is not None for r in rows]
    flagged = [j for j, (d, s) in enumerate(zip(worst, seeded, strict=True)) if s and not d <= tolerance]
    for j in range(len(rows)):
        if seeded[j]:
            tally.count(staleness[j], worst[j], j in flagged)
    audited = [
        j
        for j in range(len(rows))
        if audit > 0 and seeded[j] and staleness[j] > 0 and j not in flagged and rng.random() < audit
    ]
    if (flagged or audited) and exact is not None:
        t0 = time.perf_counter()
        over = (~(draw <= tolerance)).float()  # NaN counts as over
        ends = (over.shape[1] - over.flip(1).argmax(1)).tolist()  # one past each row's last token over
        measured = exact([prefix(rows[j], ends[j]) for j in flagged] + [rows[j] for j in audited])
        tally.seconds += time.perf_counter() - t0
        tally.audited += len(audited)
        for j, d in zip(flagged + audited, measured, strict=True):
            worst[j] = d
            tally.exact(d, d <= tolerance, staleness[j])
    return [d if s else None for d, s in zip(worst, seeded, strict=True)]


def prefix(row: Row, n: int) -> Row:
    """`row` cut after its first `n` completion tokens: a causal model's distances there do not depend on
    what follows, so the exact re-check of a row forwards it only up to its last token over the tolerance."""
    return dataclasses.replace(
        row, completion=row.completion[:n], behaviour_logp=row.behaviour_logp[:n], loss_mask=row.loss_mask[:n],
        uniforms=None if row.uniforms is None else row.uniforms[:n],
    )  # fmt: skip


@contextlib.contextmanager
def rounded_weights(model: torch.nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """Within: every trained fp32 parameter holds its value rounded to `dtype`, the publish dtype (None or
    fp32: unchanged), so the step's forward is the published model's and a fresh row is measured under the
    very weights it was sampled from; after: the fp32 master values again (their gradients stay). Not for
    sharded parameters."""
    if dtype is None or dtype == torch.float32:
        yield
        return
    masters: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and p.dtype == torch.float32:
                masters.append((p, p.data))
                p.data = p.data.to(dtype).to(torch.float32)
    try:
        yield
    finally:
        for p, master in masters:
            p.data = master


def chunks(lengths: list[int], vocab: int) -> Iterator[list[int]]:
    """Indices of `lengths` per forward call of the exact re-check: sorted by length, at most
    `CHUNK_TOKENS` rows x padded width and `MAX_LOGITS` logits per call."""
    chunk: list[int] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        k, width = len(chunk) + 1, lengths[i]  # sorted: the newest row is the longest
        if chunk and (k * width > CHUNK_TOKENS or k * width * vocab > MAX_LOGITS):
            yield chunk
            chunk = []
        chunk.append(i)
    if chunk:
        yield chunk


def caches_prompts(model: torch.nn.Module) -> bool:
    """Whether `model`'s forward takes a KV cache and position ids (`cached_prompt_logits` needs both)."""
    accepted = forward_parameters(type(model))
    return "position_ids" in accepted and bool({"cache", "past_key_values"} & accepted)


def cached_prompt_logits(
    model: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]], wanted: list[list[int]]
) -> Iterator[tuple[list[int], torch.Tensor]]:
    """(row indices, logits [k, P, V] float32) per call over the rows (`prompts[i]`, `completions[i]`, each
    completion non-empty): logits[j, p] predicts completion token `wanted[idx[j]][p]` (sorted positions;
    slots past a row's list are padding). Every distinct prompt is forwarded once, all of them in one call
    (right-padded; logits at its last position only), then the completions on their prompts' KV cache,
    rows sorted by length and chunked (`chunks`), the vocabulary projection only at the wanted positions.
    On SmolLM2's short chat prompts this forwards ~3x fewer positions than each row whole."""
    from pnyx.models.logprobs import picked_forward

    dev = next(model.parameters()).device
    distinct: dict[tuple[int, ...], int] = {}
    which = torch.tensor([distinct.setdefault(tuple(p), len(distinct)) for p in prompts])
    plens = torch.tensor([len(p) for p in distinct])
    pwidth = int(plens.max())
    ids = torch.zeros((len(distinct), pwidth), dtype=torch.long)
    for i, p in enumerate(distinct):
        ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    pmask = (torch.arange(pwidth)[None, :] < plens[:, None]).long()
    cache_arg = "cache" if "cache" in forward_parameters(type(model)) else "past_key_values"
    first = picked_forward(
        model, (plens - 1)[:, None].to(dev), input_ids=ids.to(dev), attention_mask=pmask.to(dev), use_cache=True
    )  # fmt: skip
    cache = getattr(first, "cache", None) or getattr(first, "past_key_values", None)
    if cache is None:
        raise ConfigError(f"{type(model).__name__} returned no KV cache: its prompts cannot be shared")
    last = first.logits[:, 0].float()  # [prompts, V]: predicts each row's first completion token
    for chunk in chunks([len(c) for c in completions], last.shape[-1]):
        k, width = len(chunk), max(len(completions[i]) for i in chunk)
        npos = max(1, max(len(wanted[i]) for i in chunk))
        sel = which[chunk]
        ids = torch.zeros((k, width), dtype=torch.long)
        attn = torch.cat([pmask[sel], torch.zeros((k, width), dtype=torch.long)], dim=1)
        at = torch.zeros((k, npos), dtype=torch.long)  # completion position of each wanted token
        for j, i in enumerate(chunk):
            c = completions[i]
            ids[j, : len(c)] = torch.tensor(c, dtype=torch.long)
            attn[j, pwidth : pwidth + len(c)] = 1
            at[j, : len(wanted[i])] = torch.tensor(wanted[i], dtype=torch.long)
        positions = plens[sel][:, None] + torch.arange(width)[None, :]  # a prompt's padding is skipped
        kv = copy.deepcopy(cache)
        kv.batch_select_indices(sel.to(dev))
        logits = picked_forward(
            model, (at - 1).clamp(min=0).to(dev), input_ids=ids.to(dev), attention_mask=attn.to(dev),
            position_ids=positions.to(dev), use_cache=True, **{cache_arg: kv},
        ).logits.float()  # fmt: skip
        # token 0 is predicted by the prompt's last position, token t > 0 by completion position t - 1
        yield chunk, torch.where((at == 0)[..., None].to(dev), last[sel.to(dev)][:, None], logits)


@functools.cache
def forward_parameters(model_class: type) -> frozenset[str]:
    """The keyword names a model class's `forward` takes (read once per class, not per group; also
    `prefix_tree.packs_prefixes`)."""
    return frozenset(inspect.signature(model_class.forward).parameters)
