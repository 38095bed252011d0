"""The sampling distribution, and per-token log-probabilities of completions under a model (trainer side).

`sampling_logprobs` is the single definition of the distribution pnyx samples from: logits / temperature,
then top-k, then top-p (nucleus) truncation, renormalised. The engine samples from it and records the
sampled token's log-probability; `completion_logprobs` recomputes the same quantity for whole completions
in one batched forward, so the trainer's recompute equals the worker's recorded behaviour logprob (up to
floating-point noise) by construction.

Definitions (the trainer must use the same):
- temperature > 0: logits / temperature; top_k > 0 keeps the k largest (ties at the k-th value kept);
  top_p < 1 keeps the smallest set of most likely tokens whose mass reaches top_p (the first always kept).
  A token outside the kept set gets -inf.
- temperature == 0 (greedy): the recorded logprob is the token's log-probability under the plain
  temperature-1 distribution with no truncation (top_k/top_p ignored); it is what `completion_logprobs`
  returns for temperature=0.

Knows nothing about generation loops, the store or RL. Imports torch at module level: only heavy code
imports this module.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F


def sampling_logprobs(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Log-probabilities [..., V] (float32) of the distribution sampled at these settings; -inf = excluded."""
    x = logits.float()
    if temperature <= 0:
        return F.log_softmax(x, dim=-1)
    if temperature != 1.0:
        x = x / temperature
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(x.detach(), top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x.detach() < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x.detach(), dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return F.log_softmax(x, dim=-1)


DRAW_CHUNK = 1 << 22
"""Positions x vocabulary per CDF in `draw_distance` (16 MB)."""


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    p = logp.exp()
    return -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)


def _surprise_var(logp: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    """Var[log p(X)] for X ~ p, per position: E[(log p)^2] - H^2 (no gradient; excluded tokens weigh 0).

    Two full-vocabulary temporaries (p and (log p)^2), not four: log p is clamped at -1e4 instead of
    masked (exp(-1e4) is 0 in every float format, so an excluded token still weighs exactly 0)."""
    with torch.no_grad():
        lp = logp.detach().float().clamp(min=-1e4)  # a copy: logp itself is left alone
        p = lp.exp()
        second = torch.linalg.vecdot(p, lp.square_())
        return (second - entropy.detach().float() ** 2).clamp(min=0.0)


def _split_rows(lengths: list[int], max_tokens: int | None) -> list[tuple[int, int]]:
    """Contiguous row ranges whose padded size (rows x longest row) stays within max_tokens."""
    if not max_tokens:
        return [(0, len(lengths))]
    chunks: list[tuple[int, int]] = []
    start, longest = 0, 0
    for i, n in enumerate(lengths):
        longest_with = max(longest, n)
        if i > start and longest_with * (i - start + 1) > max_tokens:
            chunks.append((start, i))
            start, longest_with = i, n
        longest = longest_with
    chunks.append((start, len(lengths)))
    return chunks


def _picked_logits(
    model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor, gather_pos: torch.Tensor
) -> torch.Tensor:
    """Logits [B, W, V] at positions `gather_pos` [B, W], exactly as the model's own forward computes them
    (`picked_forward`)."""
    return picked_forward(model, gather_pos, input_ids=ids, attention_mask=attn, use_cache=False).logits


def picked_forward(model: torch.nn.Module, gather_pos: torch.Tensor, **inputs: Any) -> Any:
    """The model's output for `inputs` (`input_ids` [B, T] among them), its logits [B, W, V] only at
    positions `gather_pos` [B, W].

    The model's forward runs unchanged (so a final logit soft-cap, a logit scale or any other step after the
    output projection is applied), but a pre-hook on the output projection narrows its input from every
    position to the gathered ones, so the vocabulary-sized logits exist only there. A model whose forward
    does not call its output-embedding module on [B, T, H] hidden states (the hook does not fire) gives full
    logits, which are gathered afterwards: same values, more memory.
    """
    shape = inputs["input_ids"].shape
    get_head: Any = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    fired = False

    def narrow(module: torch.nn.Module, args: tuple) -> tuple | None:
        nonlocal fired
        hidden = args[0] if args else None
        if fired or not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or hidden.shape[:2] != shape:
            return None
        fired = True
        picked = hidden.gather(1, gather_pos[..., None].expand(-1, -1, hidden.shape[-1]))
        return (picked, *args[1:])

    handle = head.register_forward_pre_hook(narrow) if isinstance(head, torch.nn.Module) else None
    try:
        out = model(**inputs)
    finally:
        if handle is not None:
            handle.remove()
    if not fired:
        out.logits = out.logits.gather(1, gather_pos[..., None].expand(-1, -1, out.logits.shape[-1]))
    return out


def _chunk_logprobs(
    model: torch.nn.Module,
    prompts: list[list[int]],
    completions: list[list[int]],
    temperature: float,
    top_k: int,
    top_p: float,
    with_entropy: bool,
    width: int,
    with_var: bool = False,
    u: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, float]:
    device = next(model.parameters()).device
    seqs = [p + c for p, c in zip(prompts, completions, strict=True)]
    seq_len = max(len(s) for s in seqs)
    rows = len(seqs)
    ids = torch.zeros(rows, seq_len, dtype=torch.long)
    attn = torch.zeros(rows, seq_len, dtype=torch.long)
    # Hidden state at position j predicts token j+1: completion token t of row i sits at len(prompt)+t,
    # so it is predicted from position len(prompt)+t-1. Padded slots point at position 0 and are masked.
    gather_pos = torch.zeros(rows, width, dtype=torch.long)
    targets = torch.zeros(rows, width, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c, dtype=torch.long)
        attn[i, : len(p) + len(c)] = 1
        if c:
            gather_pos[i, : len(c)] = torch.arange(len(p) - 1, len(p) + len(c) - 1)
            targets[i, : len(c)] = torch.tensor(c, dtype=torch.long)
    ids, attn, gather_pos, targets = (t.to(device) for t in (ids, attn, gather_pos, targets))

    logits = _picked_logits(model, ids, attn, gather_pos)
    logp_all = sampling_logprobs(logits, temperature, top_k, top_p)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    ent = _entropy(logp_all) if with_entropy or with_var else None
    var = _surprise_var(logp_all, ent) if with_var and ent is not None else None
    dist, draw_s = None, 0.0
    if u is not None:
        t0 = time.perf_counter()
        dist = draw_distance(logp_all, targets, u)
        if dist.is_cuda:
            torch.cuda.synchronize(dist.device)
        draw_s = time.perf_counter() - t0
    return logp, ent, var, dist, draw_s


class CompletionStats(NamedTuple):
    """What one forward gives about completions (see `completion_stats`)."""

    logp: torch.Tensor
    """[B, T] float32 log-probability of each completion token under the sampling distribution."""
    mask: torch.Tensor
    """[B, T] bool, True on real completion tokens."""
    entropy: torch.Tensor | None
    """[B, T] entropy H_t of the sampling distribution at each position (with_entropy or with_var)."""
    var: torch.Tensor | None
    """[B, T] Var[log p(X_t)] under that distribution (with_var): with H_t, the mean and variance of the
    sampled token's log-probability under honest sampling (the plausibility test, `pnyx.security.checks`)."""
    draw: torch.Tensor | None = None
    """[B, T] each token's distance from the draw of its seeded uniform (with `uniforms`; `draw_distance`)."""
    draw_s: float = 0.0
    """Seconds spent computing `draw` (the draw check's share of this forward)."""


def completion_logprobs(
    model: torch.nn.Module,
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    with_entropy: bool = False,
    max_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-token log-probabilities of each completion given its prompt, under the sampling distribution.

    Returns `(logp [B, T] float32, mask [B, T] bool, entropy [B, T] float32 | None)` with T the longest
    completion; `mask` is True on real completion tokens (padding slots hold 0.0). The language-model head
    and the softmax run only on completion positions. Differentiable when grad is enabled. `max_tokens`
    bounds rows x padded length per forward; rows are then processed in chunks (results are identical).
    Every prompt needs at least one token.
    """
    out = completion_stats(
        model, prompt_ids, completion_ids, temperature, top_k, top_p, with_entropy, max_tokens
    )
    return out.logp, out.mask, out.entropy


def completion_stats(
    model: torch.nn.Module,
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    with_entropy: bool = False,
    max_tokens: int | None = None,
    with_var: bool = False,
    uniforms: list[list[float] | None] | None = None,
) -> CompletionStats:
    """`completion_logprobs`, plus (with_var) the variance of log p under the sampling distribution at
    every position, from the same forward (no gradient flows through the entropy's second moment), and
    (with `uniforms`: per completion, its seeded uniform at each position, NaN where none; None for a
    completion without) each token's distance from the draw of its uniform (`draw_distance`)."""
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError(
            "every prompt needs at least one token (the first completion token is predicted from it)"
        )
    device = next(model.parameters()).device
    width = max((len(c) for c in completion_ids), default=0)
    rows = len(prompt_ids)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    for i, c in enumerate(completion_ids):
        mask[i, : len(c)] = True
    mask = mask.to(device)
    u = uniform_matrix(uniforms, rows, width) if uniforms is not None else None
    if rows == 0 or width == 0:
        empty = torch.zeros(rows, width, dtype=torch.float32, device=device)
        ent0 = empty.clone() if with_entropy or with_var else None
        return CompletionStats(
            empty, mask, ent0, empty.clone() if with_var else None, None if u is None else empty.clone()
        )

    lengths = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids, strict=True)]
    parts, ents, vars_, draws, draw_s = [], [], [], [], 0.0
    for a, b in _split_rows(lengths, max_tokens):
        lp, ent, var, dist, seconds = _chunk_logprobs(
            model, prompt_ids[a:b], completion_ids[a:b], temperature, top_k, top_p, with_entropy, width,
            with_var, None if u is None else u[a:b],
        )  # fmt: skip
        parts.append(lp)
        ents.append(ent)
        vars_.append(var)
        draws.append(dist)
        draw_s += seconds
    logp = torch.cat(parts, 0) if len(parts) > 1 else parts[0]
    logp = logp.masked_fill(~mask, 0.0)
    entropy = var_out = None
    if with_entropy or with_var:
        entropy = torch.cat(ents, 0) if len(ents) > 1 else ents[0]
        entropy = entropy.masked_fill(~mask, 0.0)
    if with_var:
        var_out = torch.cat(vars_, 0) if len(vars_) > 1 else vars_[0]
        var_out = var_out.masked_fill(~mask, 0.0)
    draw = None
    if u is not None:
        draw = torch.cat(draws, 0) if len(draws) > 1 else draws[0]
        draw = draw.masked_fill(~mask, 0.0)
    return CompletionStats(logp, mask, entropy, var_out, draw, draw_s)


def uniform_matrix(uniforms: list[list[float] | None], rows: int, width: int) -> torch.Tensor:
    """[rows, width] float64 of the completions' uniforms, NaN where a position has none."""
    if len(uniforms) != rows:
        raise ValueError(f"{rows} completions but {len(uniforms)} uniform rows")
    u = torch.full((rows, width), float("nan"), dtype=torch.float64)
    for i, row in enumerate(uniforms):
        if row:
            u[i, : len(row)] = torch.tensor(row, dtype=torch.float64)
    return u


def draw_distance(logp: torch.Tensor, tokens: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per position, how far uniform `u` lies outside its token's interval [F(y-1), F(y)) of the
    vocabulary-order CDF of the sampling distribution `logp` [..., V] (`sampling_logprobs`): 0 when the
    token is the draw of its uniform (inverse-CDF sampling, `pnyx.protocol.draws`), and 0 where `u` is NaN
    (a position without a uniform: a tool token, padding). `tokens` and `u` are [...]. Computed over
    `DRAW_CHUNK` positions at a time, only where there is a uniform, the CDF in float32 (CPU's cumulative
    sum accumulates in float64: edges within 6e-8 of the float64 sum at V = 49152, 3x faster); the
    comparison with u in float64. No gradient."""
    with torch.no_grad():
        out = torch.zeros(u.shape, dtype=torch.float32, device=logp.device)
        uu = u.to(device=logp.device, dtype=torch.float64)
        at = ~torch.isnan(uu)
        if not bool(at.any()):
            return out
        rows, ys, us = logp.detach()[at], tokens[at][:, None], uu[at]
        step = max(1, DRAW_CHUNK // max(1, rows.shape[-1]))
        parts = []
        for a in range(0, rows.shape[0], step):
            p = rows[a : a + step].float().exp()
            y = ys[a : a + step]
            py = p.gather(-1, y)[:, 0]
            cdf = p.cumsum_(-1)
            total, hi = cdf[:, -1], cdf.gather(-1, y)[:, 0]
            lo, hi = ((hi - py) / total).double(), (hi / total).double()
            x = us[a : a + step]
            parts.append(torch.clamp(torch.maximum(lo - x, x - hi), min=0.0))
        out[at] = torch.cat(parts).float()
        return out
