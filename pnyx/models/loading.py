"""Loading a causal LM and its tokenizer from any model source, or building a model from a config alone.

`load_model` and `load_tokenizer` take what a user names a model (a folder, a .gguf file, a hub id) or an
already resolved `ModelSource`; `source.py` turns names into a local folder (downloading only when online,
as `transformers` does), and transformers then always reads that folder with `local_files_only=True`.
Dtype and device are explicit choices (`"float32" | "bfloat16" | "float16"`,
`"cpu" | "cuda" | "cuda:N" | "mps" | "auto"`); models come back in eval mode.

Knows nothing about the store, RL or the engine. torch and transformers are imported inside functions so
importing this module stays cheap.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pnyx.errors import ConfigError
from pnyx.models.source import ModelSource, resolve_source

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

DType = Literal["float32", "bfloat16", "float16"]
Device = Literal["cpu", "cuda", "mps", "auto"] | str

_DTYPES = ("float32", "bfloat16", "float16")


def resolve_dtype(dtype: DType | str) -> torch.dtype:
    """The torch dtype for a dtype name; raises ConfigError for anything else."""
    import torch

    if dtype not in _DTYPES:
        raise ConfigError(f"model dtype must be one of {_DTYPES}, got {dtype!r}")
    return getattr(torch, dtype)


def resolve_device(device: Device) -> torch.device:
    """`"auto"` picks cuda, then mps, then cpu; an explicit device that is not available raises ConfigError."""
    import torch

    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ConfigError(f"unknown device {device!r}: use cpu, cuda, cuda:N, mps or auto") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but CUDA is not available; use --device cpu")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device {device!r} requested but MPS is not available; use --device cpu")
    return dev


ModelRef = str | Path | ModelSource
"""A model as callers name it: a folder, a .gguf file, a hub id, or a resolved source."""


def model_folder(path: ModelRef, revision: str | None = None) -> Path:
    """The local Hugging Face folder for `path` (resolved by `resolve_source`), or ModelNotFoundError."""
    if isinstance(path, ModelSource):
        return path.folder
    return resolve_source(path, revision).folder


def load_model(path: ModelRef, dtype: DType = "float32", device: Device = "cpu") -> PreTrainedModel:
    """Load the causal LM `path` names in eval mode, on `device`, in `dtype`."""
    from transformers import AutoModelForCausalLM

    folder = model_folder(path)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=resolve_dtype(dtype), local_files_only=True)
    # (transformers types from_pretrained's result as a generate-mixin whose .to() pyright cannot bind)
    return model.to(resolve_device(device)).eval()  # pyright: ignore[reportArgumentType]


def load_tokenizer(path: ModelRef) -> PreTrainedTokenizerBase:
    """Load the tokenizer of the model `path` names (left padding, pad token falls back to EOS)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_folder(path), local_files_only=True)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def model_from_config(
    config: PretrainedConfig | dict[str, object],
    dtype: DType = "float32",
    device: Device = "cpu",
    seed: int = 0,
) -> PreTrainedModel:
    """A randomly initialised causal LM from a transformers config object or a config dict (for tests).

    A dict needs `model_type` (e.g. `{"model_type": "qwen2", "hidden_size": 64, ...}`). Seeded: the same
    config and seed give bit-identical weights. The global RNG state is left untouched.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(config, dict):
        cfg = dict(config)
        model_type = cfg.pop("model_type", None)
        if not isinstance(model_type, str):
            raise ConfigError("a model config dict needs 'model_type' (e.g. 'qwen2')")
        config = AutoConfig.for_model(model_type, **cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.to(device=resolve_device(device), dtype=resolve_dtype(dtype)).eval()
