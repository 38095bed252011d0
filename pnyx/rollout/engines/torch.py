"""The torch engine: pnyx's own PyTorch decode loop (`pnyx.rollout.engine`) behind the engine interface.

Runs anywhere PyTorch runs (CPU, CUDA, MPS), on any transformers causal LM, with the fast path, KV reuse
across tool turns and exact behaviour logprobs described in docs/engine.md. This module only adds loading
and in-place weight updates: changed tensors are copied into the model's existing parameters
(`Tensor.copy_`, converting the published dtype to the model's and moving to its device), so the fast
path's stacked projections, which are views of the same storage, see them too.

Proof: on the weights plane "hashed": every parameter is read back from the model, cast to the published
dtype (exact, the published values are representable in the model's dtype) and hashed. On the int8 plane
"derived": the model holds dequantized floats, from which the codes are not read back; the digests are of
the verified plane bytes it dequantized. Knows nothing about the store or the trainer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from pnyx.errors import IntegrityError
from pnyx.rollout.engine import Completion, Engine, SamplingParams
from pnyx.rollout.engines.base import TensorDigest, WorkerEngine
from pnyx.weights import int8 as q8
from pnyx.weights.bits import BitState, from_torch, to_torch

if TYPE_CHECKING:
    from pnyx.rollout.episodes import Episode, ToolFn


def int8_base(name: str) -> str:
    """The model tensor an int8-plane tensor belongs to (`T@q`, `T@scale`, `T@zero` → `T`; others as is)."""
    return name.rsplit("@", 1)[0] if name.endswith((q8.Q, q8.SCALE, q8.ZERO)) else name


class TorchEngine(WorkerEngine):
    """pnyx's PyTorch engine over a transformers model loaded from a local folder."""

    name = "torch"

    def __init__(
        self,
        path: Any,
        tokenizer: Any,
        dtype: str = "float32",
        device: str = "cpu",
        plane: Literal["weights", "int8"] = "weights",
        model: Any = None,
    ):
        from pnyx.models import load_model

        super().__init__()
        self.tokenizer = tokenizer
        self.model = model if model is not None else load_model(path, dtype=dtype, device=device)
        self.engine = Engine(self.model, tokenizer)
        self.plane = plane
        self.proof_kind = "hashed" if plane == "weights" else "derived"

    def _apply(self, state: BitState, names: list[str], first: bool) -> None:
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

    def run_episodes(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        tool: ToolFn | Sequence[ToolFn],
        tool_stops: list[str],
        max_turns: int,
        max_episode_tokens: int = 1024,
        max_tool_tokens: int = 512,
    ) -> list[Episode]:
        """The tool loop on the KV cache where the model allows it (docs/engine.md)."""
        return self.engine.run_episodes(
            prompt_ids, params, tool, tool_stops, max_turns, max_episode_tokens, max_tool_tokens
        )
