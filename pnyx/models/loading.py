"""Loading a causal LM from a local folder (Hugging Face layout), or building one from a config alone.

pnyx never downloads at run time: a path that is not an existing folder raises `ModelNotFoundError` with
the command that fetches it, and transformers is always called with `local_files_only=True` and
`HF_HUB_OFFLINE=1`. Dtype and device are explicit choices (`"float32" | "bfloat16" | "float16"`,
`"cpu" | "cuda" | "cuda:N" | "mps" | "auto"`); models come back in eval mode.

Knows nothing about the store, RL or the engine. torch and transformers are imported inside functions so
importing this module stays cheap.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pnyx.errors import ConfigError, ModelNotFoundError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DType = Literal["float32", "bfloat16", "float16"]
Device = Literal["cpu", "cuda", "mps", "auto"] | str

_DTYPES = ("float32", "bfloat16", "float16")


def _offline() -> None:
    # Set before transformers touches the hub code paths; harmless if already set.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


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


def model_folder(path: str | Path) -> Path:
    """The local model folder for `path`, or ModelNotFoundError telling how to get one."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        hint = (
            f"`huggingface-cli download {path} --local-dir ./models/{Path(str(path)).name}` "
            "on a machine with network access, then pass that folder"
        )
        raise ModelNotFoundError(
            f"model {str(path)!r} is not a local folder; pnyx never downloads at run time. "
            f"Fetch it first, e.g. {hint}."
        )
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(
            f"{folder} has no config.json: expected a Hugging Face model folder "
            "(config.json, *.safetensors, tokenizer files)"
        )
    return folder


def load_model(path: str | Path, dtype: DType = "float32", device: Device = "cpu") -> PreTrainedModel:
    """Load the causal LM in the local folder `path` in eval mode, on `device`, in `dtype`."""
    _offline()
    from transformers import AutoModelForCausalLM

    folder = model_folder(path)
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=resolve_dtype(dtype), local_files_only=True
    )
    return model.to(resolve_device(device)).eval()


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer in the local folder `path` (left padding, pad token falls back to EOS)."""
    _offline()
    from transformers import AutoTokenizer

    folder = Path(path).expanduser()
    if not folder.is_dir():
        model_folder(path)  # raises with the how-to-fetch message
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def model_from_config(
    config: Any, dtype: DType = "float32", device: Device = "cpu", seed: int = 0
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
        if model_type is None:
            raise ConfigError("a model config dict needs 'model_type' (e.g. 'qwen2')")
        config = AutoConfig.for_model(model_type, **cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.to(device=resolve_device(device), dtype=resolve_dtype(dtype)).eval()
