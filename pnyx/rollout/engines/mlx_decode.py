"""Sampling with MLX: pnyx's sampling distribution in MLX arrays, and a batched decode loop over mlx-lm models.

`sampling_logprobs_mx` is `pnyx.models.logprobs.sampling_logprobs` written in MLX, step for step: logits /
temperature, then top-k (ties at the k-th value kept), then top-p (the smallest set of most likely tokens
whose mass reaches top_p, the first always kept), renormalised, -inf for excluded tokens; greedy
(temperature 0) is the plain temperature-1 log-softmax. Tests compare the two on the same logits.

`decode` samples a left-padded batch with mlx-lm's `BatchKVCache`: its per-row offsets start at minus the
row's padding, so rotary positions count real tokens only and padded keys are masked, as in the trainer's
recompute. The prompt is prefilled in two calls (all but the last token, then the last), so MLX's lazy
evaluation never computes vocabulary logits for prompt positions. Tokens are drawn by inverse CDF with one
uniform per row per step from a key seeded by `params.seed`, or from the row's own stream of seeded draws
(`SamplingParams.draws`, `pnyx.protocol.draws`). Finished rows leave the batch once >= 25% of
it has finished. One host sync per step (the sampled tokens). Knows nothing about weights updates, the
store or the trainer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

# isort: off
import pnyx.rollout.engines.mlx_blas  # noqa: F401  before mlx.core: chooses the BLAS libmlx binds to
import mlx.core as mx
# isort: on

from pnyx.models.tokenizer import StopMatcher
from pnyx.rollout.sampling import COMPACT_FRACTION, Completion, FinishReason, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

NEG_INF = float("-inf")


def sampling_logprobs_mx(
    logits: mx.array, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> mx.array:
    """Log-probabilities [..., V] (float32) of the distribution sampled at these settings; -inf = excluded."""
    x = logits.astype(mx.float32)
    if temperature <= 0:
        return x - mx.logsumexp(x, axis=-1, keepdims=True)
    if temperature != 1.0:
        x = x / temperature
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        kth = mx.min(mx.topk(x, top_k, axis=-1), axis=-1, keepdims=True)
        x = mx.where(x < kth, NEG_INF, x)
    if top_p < 1.0:
        order = mx.argsort(-x, axis=-1)
        sorted_x = mx.take_along_axis(x, order, axis=-1)
        probs = mx.softmax(sorted_x, axis=-1)
        mass_before = mx.cumsum(probs, axis=-1) - probs
        drop_sorted = mass_before >= top_p
        drop = mx.put_along_axis(mx.zeros(drop_sorted.shape, dtype=mx.bool_), order, drop_sorted, axis=-1)
        x = mx.where(drop, NEG_INF, x)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def draw(
    logits: mx.array, params: SamplingParams, key: mx.array, u: mx.array | None = None
) -> tuple[mx.array, mx.array]:
    """(token [b], its logprob [b]) from last-position logits [b, V] under `params`; `u` [b]: the rows'
    seeded uniforms (`pnyx.protocol.draws`), else drawn from `key`."""
    logp = sampling_logprobs_mx(logits, params.temperature, params.top_k, params.top_p)
    if params.temperature <= 0:
        tok = mx.argmax(logp, axis=-1)
    else:
        # Inverse CDF, as the torch engine: the first index whose cumulative mass exceeds u; cummax keeps
        # the CDF flat across zero-probability (truncated) tokens, so one is never drawn.
        p = mx.exp(logp)
        cdf = mx.cummax(mx.cumsum(mx.where(p > 0, p, 0.0), axis=-1), axis=-1)
        if u is None:
            u = mx.random.uniform(shape=(cdf.shape[0],), key=key)
        u = u[:, None] * cdf[:, -1:]
        tok = mx.minimum(mx.sum(cdf <= u, axis=-1), cdf.shape[-1] - 1)
    return tok, mx.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]


def make_batch_cache(model: Any, left_padding: list[int]) -> list[Any]:
    """One `BatchKVCache` per layer (plain full attention: the only cache kind pnyx's MLX path supports)."""
    from mlx_lm.models.cache import BatchKVCache, KVCache

    if hasattr(model, "make_cache"):
        kinds = {type(c) for c in model.make_cache()}
        if kinds - {KVCache}:
            names = sorted(k.__name__ for k in kinds)
            raise NotImplementedError(
                f"MLX engine: cache kinds {names} (only full-attention KVCache is supported)"
            )
    return [BatchKVCache(list(left_padding)) for _ in model.layers]


def prefill(model: Any, prompts: list[list[int]], pad_id: int) -> tuple[mx.array, list[Any]]:
    """Left-pad `prompts`, run them through `model`; (last-position logits [B, V], the caches)."""
    width = max(len(p) for p in prompts)
    pads = [width - len(p) for p in prompts]
    ids = mx.array([[pad_id] * k + list(p) for k, p in zip(pads, prompts, strict=True)], dtype=mx.int32)
    caches = make_batch_cache(model, pads)
    if width > 1:
        model(ids[:, :-1], cache=caches)  # lazy: only the caches are ever evaluated from this call
    logits = model(ids[:, -1:], cache=caches)[:, -1, :]
    return logits, caches


def decode(
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    params: SamplingParams,
    eos_ids: list[int],
    pad_id: int,
) -> list[Completion]:
    """One completion per prompt, in order (see the module docstring)."""
    n, max_new = len(prompts), params.max_new_tokens
    params.check_rows(n)
    draws = params.draws
    logits, caches = prefill(model, prompts, pad_id)
    key = mx.random.key(params.seed)
    matcher = StopMatcher(tokenizer, params.stop)
    eos = frozenset() if params.ignore_eos else frozenset(eos_ids)
    tokens: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list[float]] = [[] for _ in range(n)]
    reasons: list[FinishReason] = ["length"] * n
    stop_of: list[str | None] = [None] * n
    done = [False] * n
    batch = list(range(n))  # the cache's rows
    for step in range(max_new):
        key, sub = mx.random.split(key)
        u = None if draws is None else mx.array([draws[i].peek() for i in batch], dtype=mx.float32)
        tok, lp = draw(logits, params, sub, u)
        mx.eval(tok, lp)
        toks, lps = cast(list[int], tok.tolist()), cast(list[float], lp.tolist())  # 1-d arrays: lists
        for i, t, p in zip(batch, toks, lps, strict=True):  # the one host sync per step
            if done[i]:
                continue
            tokens[i].append(t)
            logprobs[i].append(p)
            if draws is not None:
                draws[i].advance()
            if t in eos:
                done[i], reasons[i] = True, "stop"
            elif matcher.stops and (s := matcher.match(tokens[i])) is not None:
                done[i], reasons[i], stop_of[i] = True, "stop", s
        alive = sum(not done[i] for i in batch)
        if step == max_new - 1 or alive == 0:
            break
        if len(batch) - alive >= max(1, COMPACT_FRACTION * len(batch)):
            keep = [k for k, i in enumerate(batch) if not done[i]]
            index = mx.array(keep)
            for c in caches:
                c.filter(index)
            tok, batch = tok[index], [batch[k] for k in keep]
        logits = model(tok[:, None], cache=caches)[:, -1, :]
    return [
        Completion(t, lp, r, str(tokenizer.decode(t, skip_special_tokens=True)), s)
        for t, lp, r, s in zip(tokens, logprobs, reasons, stop_of, strict=True)
    ]
