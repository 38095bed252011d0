"""Causal LMs and tokenizers from folders, hub ids or GGUF files, the sampling distribution, trainer logprobs.

Public surface (imported lazily, so `import pnyx.models` does not import torch or transformers):
`resolve_source`, `ModelSource`, `resolve_run_model`, `check_run_model`, `load_model`, `load_tokenizer`,
`model_from_config`, `resolve_device`, `resolve_dtype`, `render_prompt`, `eos_token_ids`,
`tokenizer_digest`, `completion_logprobs`, `sampling_logprobs`, `make_tiny_model_dir`.
Knows nothing about the store or RL.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "resolve_source": "pnyx.models.source",
    "ModelSource": "pnyx.models.source",
    "resolve_run_model": "pnyx.models.source",
    "check_run_model": "pnyx.models.source",
    "load_model": "pnyx.models.loading",
    "load_tokenizer": "pnyx.models.loading",
    "model_from_config": "pnyx.models.loading",
    "model_folder": "pnyx.models.loading",
    "resolve_device": "pnyx.models.loading",
    "resolve_dtype": "pnyx.models.loading",
    "render_prompt": "pnyx.models.tokenizer",
    "eos_token_ids": "pnyx.models.tokenizer",
    "tokenizer_digest": "pnyx.models.tokenizer",
    "completion_logprobs": "pnyx.models.logprobs",
    "sampling_logprobs": "pnyx.models.logprobs",
    "make_tiny_model_dir": "pnyx.models.testing",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pnyx.models' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
