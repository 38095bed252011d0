"""The torch engine: pnyx's own PyTorch decode loop (`pnyx.rollout.engine`) behind the engine interface.

Runs anywhere PyTorch runs (CPU, CUDA, MPS), on any transformers causal LM, with the fast path, KV reuse
across tool turns (`decoder()`: the decode loop) and exact behaviour logprobs described in docs/engine.md.
This module only adds loading and in-place weight updates: changed tensors are copied into the model's existing parameters
(`Tensor.copy_`, converting the published dtype to the model's and moving to its device), so the fast
path's stacked projections, which are views of the same storage, see them too.

Proof: on the weights plane "hashed": every parameter is read back from the model, cast to the published
dtype (exact, the published values are representable in the model's dtype) and hashed. On the int8 plane
"derived": the model holds dequantized floats, from which the codes are not read back; the digests are of
the verified plane bytes it dequantized. Knows nothing about the store or the trainer.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from pnyx.errors import ConfigError, IntegrityError
from pnyx.rollout.engine import Engine
from pnyx.rollout.engines.base import TensorDigest, WorkerEngine
from pnyx.rollout.sampling import Completion, SamplingParams
from pnyx.weights import int8 as q8
from pnyx.weights.bits import BitState, from_torch, to_torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


SCREEN_MAX_TOKENS = 16_384
"""Rows x padded length per screening forward without a shared prefix (bounds its memory)."""
SCREEN_ROWS = 64
"""Candidates per screening forward on top of the shared prefix's cache."""
SCREEN_MIN_SHARED = 8
"""Shared prompt tokens below which screening runs plain forwards (nothing worth caching)."""


def _common_prefix(prompts: list[list[int]]) -> int:
    """Length of the prefix every prompt shares, leaving each prompt at least one token of its own."""
    first = prompts[0]
    n = min(len(p) for p in prompts) - 1
    for p in prompts[1:]:
        k = 0
        while k < n and p[k] == first[k]:
            k += 1
        n = k
    return max(0, n)


def int8_base(name: str) -> str:
    """The model tensor an int8-plane tensor belongs to (`T@q`, `T@scale`, `T@zero` → `T`; others as is)."""
    return name.rsplit("@", 1)[0] if name.endswith((q8.Q, q8.SCALE, q8.ZERO)) else name


class TorchEngine(WorkerEngine):
    """pnyx's PyTorch engine over a transformers model: loaded from a local folder, or one already in memory
    (`model`: its owner's, whose in-place changes it generates with)."""

    name = "torch"
    seeded_draws = True

    def __init__(
        self,
        path: str | Path | None,
        tokenizer: PreTrainedTokenizerBase,
        dtype: str = "float32",
        device: str = "cpu",
        plane: Literal["weights", "int8"] = "weights",
        model: PreTrainedModel | None = None,
    ):
        from pnyx.models import load_model

        super().__init__()
        if model is not None:
            self.model = model
        elif path is not None:
            self.model = load_model(path, dtype=dtype, device=device)
        else:
            raise ConfigError("the torch engine needs a model folder or a model already in memory")
        self.tokenizer = tokenizer
        self.engine = Engine(self.model, tokenizer)
        self._shared_prefix: tuple[tuple[int, ...], Any, Any] | None = None
        """Screening: (prefix ids, last logits, KV cache) of the prompts' shared prefix at these weights."""
        self.plane = plane
        self.proof_kind = "hashed" if plane == "weights" else "derived"

    def _apply(self, state: BitState, names: list[str], first: bool) -> None:
        self._shared_prefix = None  # computed with the old weights
        params = self.model.state_dict(keep_vars=True)
        if self.plane == "int8":
            touched = {int8_base(n) for n in names}
            wanted = {int8_base(n) for n in state}
            tensors = q8.dequantize_torch({n: tb for n, tb in state.items() if int8_base(n) in touched})
        else:
            wanted = set(state)
            tensors = to_torch({n: state[n] for n in names})
        if first and wanted != set(params):
            missing, extra = sorted(set(params) - wanted), sorted(wanted - set(params))
            raise IntegrityError(
                f"the published state does not fit this model: missing {missing[:5]}, unexpected {extra[:5]} "
                "(is this worker's model the run's model?)"
            )
        with torch.no_grad():
            for n, t in tensors.items():
                params[n].copy_(t)

    def _base(self, keys: list[str]) -> dict[str, torch.Tensor]:
        params = self.model.state_dict()
        missing = [k for k in keys if k not in params]
        if missing:
            raise IntegrityError(
                f"the adapter adapts {missing[:3]}, which this model does not have (is it the run's base model?)"
            )
        shared = {p.data_ptr() for k, p in params.items() if k not in keys}
        tied = [k for k in keys if params[k].data_ptr() in shared]
        if tied:  # merging into a tied head would change the input embedding too
            raise ConfigError(
                f"an adapter on {tied[:3]}, which this model ties to another tensor, is not served"
            )
        return {k: params[k].detach().to(torch.float32, copy=True) for k in keys}

    def _write(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._shared_prefix = None  # computed with the old weights
        params = self.model.state_dict(keep_vars=True)
        with torch.no_grad():
            for n, t in tensors.items():
                params[n].copy_(t)

    def _digests(self, state: BitState, changed: list[str]) -> dict[str, TensorDigest]:
        if self.plane == "int8":
            return {n: (tb.dtype, tb.shape, tb.digest()) for n, tb in state.items()}
        params = self.model.state_dict()
        out: dict[str, TensorDigest] = {}
        for n, tb in state.items():
            own = from_torch({n: params[n].detach().to(getattr(torch, tb.dtype))}, copy=False)[n]
            out[n] = (own.dtype, own.shape, own.digest())
        return out

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[Completion]:
        return self.engine.generate(prompt_ids, params)

    def decoder(self) -> Engine:
        """The decode loop itself: tool turns continue on its KV cache where the model allows it
        (docs/engine.md)."""
        return self.engine

    def reference_logprobs(
        self, prompt_ids: list[list[int]], completion_ids: list[list[int]], params: SamplingParams
    ) -> list[float]:
        """Forward passes (no grad) over prompt + completion under the sampling distribution. The prefix all
        prompts share (the system prompt and chat template) is computed once per weights version and its KV
        cache repeated over the rows, so each candidate costs only its own suffix."""
        from pnyx.models.logprobs import completion_logprobs, sampling_logprobs

        common = _common_prefix(prompt_ids)
        rows = len(prompt_ids)
        if common < SCREEN_MIN_SHARED or rows < 2:
            with torch.no_grad():
                logp, _, _ = completion_logprobs(
                    self.model, prompt_ids, completion_ids, params.temperature, params.top_k, params.top_p,
                    max_tokens=SCREEN_MAX_TOKENS,
                )  # fmt: skip
            return logp.sum(-1).tolist()
        device = next(self.model.parameters()).device
        totals: list[float] = []
        with torch.no_grad():
            key = tuple(prompt_ids[0][:common])
            if self._shared_prefix is None or self._shared_prefix[0] != key:  # once per version and prompt
                shared = self.model(torch.tensor([list(key)], device=device), use_cache=True)
                cached = getattr(shared, "past_key_values", None) or getattr(shared, "cache", None)
                self._shared_prefix = (key, shared.logits[:, -1:], cached)
            _, shared_last, shared_cache = self._shared_prefix
            # transformers 5 renamed the argument `past_key_values` -> `cache` (as in hf_session.py)
            cache_arg = (
                "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
            )
            for a in range(0, rows, SCREEN_ROWS):
                b = min(rows, a + SCREEN_ROWS)
                cache = copy.deepcopy(shared_cache)
                cache.batch_repeat_interleave(b - a)
                tails = [p[common:] + c for p, c in zip(prompt_ids[a:b], completion_ids[a:b], strict=True)]
                width = max(len(t) for t in tails)
                ids = torch.full((b - a, width), self.engine.pad_id, dtype=torch.long)
                attn = torch.zeros((b - a, common + width), dtype=torch.long)
                attn[:, :common] = 1
                # right-padded: real tokens keep positions common, common + 1, ...
                for i, t in enumerate(tails):
                    ids[i, : len(t)] = torch.tensor(t, dtype=torch.long)
                    attn[i, common : common + len(t)] = 1
                logits = self.model(
                    ids.to(device), attention_mask=attn.to(device), use_cache=True, **{cache_arg: cache}
                ).logits
                # logits at tail position j predict tail token j + 1; tail position -1 is the prefix's last
                full = torch.cat([shared_last.expand(b - a, 1, -1), logits], dim=1)
                logp = sampling_logprobs(full, params.temperature, params.top_k, params.top_p)
                for i, (p, c) in enumerate(zip(prompt_ids[a:b], completion_ids[a:b], strict=True)):
                    start = len(p) - common  # index in `full` of the position predicting completion token 0
                    picked = logp[i, start : start + len(c)].gather(
                        -1, torch.tensor(c, device=device)[:, None]
                    )
                    totals.append(float(picked.sum()))
        return totals
