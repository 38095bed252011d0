"""The MLX engine: mlx-lm's model implementations on Apple silicon (or mlx's CPU build on Linux).

Loads the run's model folder with `mlx_lm.utils.load_model` (any architecture mlx-lm implements whose
cache is plain full attention: Llama, Qwen2, Qwen3, Mistral, ...), casts it to the run's `model.dtype`,
and samples with `mlx_decode` (pnyx's sampling distribution, exact behaviour logprobs, stop strings).

Weights: a PULSE update replaces the changed arrays of the resident module (`Module.update`): no rebuild,
no reload from disk. On the weights plane the published bf16 bits become arrays of the compute dtype (bf16:
the very bits; fp32: exact widening). On the int8 plane the model runs quantized (group-64 affine int8,
as stoa's Macs): each quantizable Linear/Embedding becomes mlx's `QuantizedLinear`/`QuantizedEmbedding`
whose packed codes are pnyx's `T@q` bytes unchanged (four uint8 codes per uint32, little-endian), `scales`
are `T@scale` (float32) and `biases` are `-T@zero * T@scale`, so mlx computes `scale * q + bias` =
`(q - zero) * scale`, pnyx's dequantization.

Proof "hashed": after every update each published tensor is read back from the module's arrays and hashed
in the published dtype (weights plane: cast back to bf16, exact; int8 plane: the packed codes viewed as
uint8, the scales, and the zero points recovered exactly as `round(-bias / scale)`). A tied output head
(no `lm_head` in the module) is proved by the embedding it shares, and an update whose `lm_head.weight`
differs from `embed_tokens.weight` is refused. A LoRA run (`serve_adapter`): the base values of the targets
are read once from the module's arrays (`_base`), and each merged float32 target replaces its array in the
compute dtype (`_write`); the proof is then "derived" (an adapter on a tied head is refused). Tool turns
re-prefill the context (no KV reuse across turns here yet). Knows nothing about the store or the trainer.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

# isort: off
import pnyx.rollout.engines.mlx_blas  # noqa: F401  before mlx.core: chooses the BLAS libmlx binds to
import mlx.core as mx

# isort: on
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from pnyx.errors import ConfigError, IntegrityError
from pnyx.rollout.engines.base import TensorDigest, WorkerEngine
from pnyx.rollout.engines.mlx_decode import decode
from pnyx.rollout.sampling import Completion, SamplingParams
from pnyx.weights import int8 as q8
from pnyx.weights.bits import BitState, TensorBits, make_bits

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

MX_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
_VIEWS = {"bfloat16": mx.uint16, "float16": mx.uint16, "float32": mx.uint32}
TIED_HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"


def rope_config(folder: Path) -> dict[str, Any]:
    """Config overrides that tell mlx-lm the rotary settings of a transformers-5 config.

    transformers 5 writes `rope_parameters` ({"rope_theta": .., "rope_type": .., factor ...}) instead of
    top-level `rope_theta`/`rope_scaling`; mlx-lm's Llama/Qwen models read only the latter and would
    silently fall back to their default theta (a different model: measured logit gaps of 1.3 on the tiny
    model)."""
    import json

    cfg = json.loads((folder / "config.json").read_text())
    rope = cfg.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" in cfg:
        return {}
    out: dict[str, Any] = {"rope_theta": float(rope["rope_theta"])} if "rope_theta" in rope else {}
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") != "default":
        out["rope_scaling"] = {**scaling, "type": scaling["rope_type"]}
    return out


def bits_to_mx(tb: TensorBits, dtype: Any) -> mx.array:
    """An mx array of `dtype` holding the published tensor's values (exact for bf16 bits into bf16/fp32)."""
    if tb.dtype in _VIEWS:
        return mx.array(tb.data).view(MX_DTYPES[tb.dtype]).astype(dtype)
    return mx.array(tb.data.view(np.dtype(tb.dtype)))


def mx_digest(a: mx.array, dtype: str) -> TensorDigest:
    """(dtype, shape, xxh3-128) of `a` cast to published floating `dtype` (or its raw bits otherwise)."""
    if dtype in _VIEWS:
        a = a.astype(MX_DTYPES[dtype]).view(_VIEWS[dtype])
    mx.eval(a)
    tb = make_bits(dtype, np.array(a, copy=False))
    return tb.dtype, tb.shape, tb.digest()


class MLXEngine(WorkerEngine):
    """An mlx-lm model behind the engine interface."""

    name = "mlx"
    seeded_draws = True
    proof_kind = "hashed"

    def __init__(
        self,
        path: str | Path,
        tokenizer: PreTrainedTokenizerBase,
        dtype: str = "float32",
        plane: Literal["weights", "int8"] = "weights",
    ):
        from mlx_lm.utils import load_model
        from transformers import GenerationConfig

        from pnyx.models.loading import model_folder
        from pnyx.models.tokenizer import eos_token_ids

        super().__init__()
        folder = Path(model_folder(path))
        try:
            self.model, self.config = load_model(
                folder, lazy=False, strict=True, model_config=rope_config(folder)
            )
        except ValueError as e:
            raise ConfigError(f"mlx-lm cannot build the model in {folder}: {e}") from None
        self.dtype = MX_DTYPES[dtype]
        self.model.set_dtype(self.dtype)
        self.tokenizer = tokenizer
        self.plane = plane
        self.tied = TIED_HEAD not in dict(tree_flatten(self.model.parameters()))
        gen = (
            GenerationConfig.from_pretrained(folder)
            if (folder / "generation_config.json").is_file()
            else None
        )
        self.eos_ids = eos_token_ids(tokenizer, types.SimpleNamespace(generation_config=gen))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad) if isinstance(pad, int) else 0
        self._quantized = False

    # -- weights --

    def _params(self) -> dict[str, mx.array]:
        return dict(tree_flatten(self.model.parameters()))

    def _apply(self, state: BitState, names: list[str], first: bool) -> None:
        if self.plane == "int8":
            if not self._quantized:
                self._quantize_layers(state)
            arrays = self._int8_arrays(state, names)
        else:
            arrays = {
                n: bits_to_mx(state[n], self.dtype) for n in names if not (self.tied and n == TIED_HEAD)
            }
            if (
                self.tied
                and TIED_HEAD in state
                and not np.array_equal(state[TIED_HEAD].data, state[EMBED].data)
            ):
                raise IntegrityError(
                    f"{TIED_HEAD} differs from {EMBED}, but this model ties them (tie_word_embeddings)"
                )
        params = self._params()
        if first:
            missing = sorted(set(params) - set(arrays))
            unknown = sorted(set(arrays) - set(params))
            if missing or unknown:
                raise IntegrityError(
                    f"the published state does not fit the MLX model: missing {missing[:5]}, unexpected "
                    f"{unknown[:5]} (is this worker's model the run's model, and does mlx-lm name its "
                    "weights as transformers does?)"
                )
        for n, a in arrays.items():
            if n not in params or params[n].shape != a.shape:
                raise IntegrityError(f"published {n} {a.shape} does not fit the MLX model's {params.get(n)}")
        self.model.update(tree_unflatten(list(arrays.items())))
        mx.eval(self.model.parameters())

    def _base(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """The resident module's values of the weights `keys` (a LoRA run's targets), as float32 torch tensors
        (exact: float32 widens the compute dtype)."""
        import torch

        if self._quantized:
            raise ConfigError("a LoRA adapter is merged into float weights, not into the int8 plane's codes")
        if self.tied and TIED_HEAD in keys:
            raise ConfigError(
                f"the adapter adapts {TIED_HEAD}, which this model ties to {EMBED} (tie_word_embeddings): the "
                "MLX model has one array for both, so a merged head would change the embedding too"
            )
        params = self._params()
        missing = [k for k in keys if k not in params]
        if missing:
            raise IntegrityError(
                f"the adapter adapts {missing[:3]}, which the MLX model does not have (is it the run's base "
                "model, and does mlx-lm name its weights as transformers does?)"
            )
        return {k: torch.from_numpy(np.array(params[k].astype(mx.float32))) for k in keys}

    def _write(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Replace the arrays of whole weights (float32 torch tensors, transformers names) with arrays of the
        compute dtype; every name and shape is checked before anything is written."""
        import torch

        params = self._params()
        arrays: dict[str, mx.array] = {}
        for n, t in tensors.items():
            own = params.get(n)
            if own is None or tuple(own.shape) != tuple(t.shape):
                found = "no such weight" if own is None else f"shape {tuple(own.shape)}"
                raise IntegrityError(
                    f"merged {n} {tuple(t.shape)} does not fit the MLX model ({found}): is it the run's base model?"
                )
            host = t.detach().to("cpu", torch.float32).contiguous().numpy()
            arrays[n] = mx.array(host).astype(self.dtype)
        if not arrays:
            return
        self.model.update(tree_unflatten(list(arrays.items())))
        mx.eval(self.model.parameters())

    def _quantize_layers(self, state: BitState) -> None:
        """Turn every Linear/Embedding whose weight the plane quantizes into its group-64 int8 version."""
        quantized = {n[: -len(q8.Q)] for n in state if n.endswith(q8.Q)}

        def pick(path: str, module: nn.Module) -> bool:
            return f"{path}.weight" in quantized and hasattr(module, "to_quantized")

        nn.quantize(self.model, group_size=q8.GROUP, bits=8, class_predicate=pick)
        self._quantized = True

    def _int8_arrays(self, state: BitState, names: list[str]) -> dict[str, mx.array]:
        """mlx arrays (module parameter names) for the plane tensors in `names`."""
        out: dict[str, mx.array] = {}
        for name in names:
            base = name.rsplit("@", 1)[0]
            if not name.endswith((q8.Q, q8.SCALE, q8.ZERO)):
                if not (self.tied and name == TIED_HEAD):
                    out[name] = bits_to_mx(state[name], self.dtype)
                continue
            if self.tied and base == TIED_HEAD:
                continue
            layer = base[: -len(".weight")]
            q = state[base + q8.Q].data
            scale = state[base + q8.SCALE].data.view(np.float32)
            zero = state[base + q8.ZERO].data.astype(np.float32)
            out[f"{layer}.weight"] = mx.array(np.ascontiguousarray(q).view(np.uint32))
            out[f"{layer}.scales"] = mx.array(scale)
            out[f"{layer}.biases"] = mx.array(-(zero * scale))
        return out

    def _digests(self, state: BitState, changed: list[str]) -> dict[str, TensorDigest]:
        params = self._params()
        out: dict[str, TensorDigest] = {}
        for name, tb in state.items():
            base = name.rsplit("@", 1)[0] if self.plane == "int8" else name
            own = EMBED if self.tied and base == TIED_HEAD else base
            if self.plane == "int8" and name.endswith((q8.Q, q8.SCALE, q8.ZERO)):
                out[name] = self._int8_digest(params, own, name[len(base) :], tb)
            else:
                out[name] = mx_digest(params[own], tb.dtype)
        return out

    @staticmethod
    def _int8_digest(params: dict[str, mx.array], weight: str, part: str, tb: TensorBits) -> TensorDigest:
        layer = weight[: -len(".weight")]
        if part == q8.Q:
            codes = np.array(params[f"{layer}.weight"], copy=False).view(np.uint8).reshape(tb.shape)
            got = make_bits("uint8", codes)
        elif part == q8.SCALE:
            got = make_bits("float32", np.array(params[f"{layer}.scales"].astype(mx.float32)).view(np.uint32))
        else:
            scales = np.array(params[f"{layer}.scales"].astype(mx.float32))
            biases = np.array(params[f"{layer}.biases"].astype(mx.float32))
            zero = np.rint(-biases / np.where(scales != 0, scales, 1.0))
            got = make_bits("uint8", np.clip(zero, 0, 255).astype(np.uint8))
        return got.dtype, got.shape, got.digest()

    # -- sampling --

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[Completion]:
        if not prompt_ids:
            return []
        if any(len(p) == 0 for p in prompt_ids):
            raise ConfigError("every prompt needs at least one token")
        return decode(self.model, self.tokenizer, prompt_ids, params, self.eos_ids, self.pad_id)
