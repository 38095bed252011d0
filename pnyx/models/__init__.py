"""Causal LMs and tokenizers from folders, hub ids or GGUF files, the sampling distribution, trainer logprobs.

Public surface (imported lazily, so `import pnyx.models` does not import torch or transformers):
`resolve_source`, `ModelSource`, `resolve_run_model`, `check_run_model`, `load_model`, `load_tokenizer`,
`model_from_config`, `resolve_device`, `resolve_dtype`, `render_prompt`, `eos_token_ids`,
`tokenizer_digest`, `completion_logprobs`, `sampling_logprobs`. (Tiny test models: `pnyx_harness.models`.)
Knows nothing about the store or RL.
"""

from __future__ import annotations

from pnyx.lazy import export_names, lazy_exports

_EXPORTS = {
    "pnyx.models.source": ("resolve_source", "ModelSource", "resolve_run_model", "check_run_model"),
    "pnyx.models.loading": (
        "load_model",
        "load_tokenizer",
        "model_from_config",
        "model_folder",
        "resolve_device",
        "resolve_dtype",
    ),
    "pnyx.models.tokenizer": ("render_prompt", "eos_token_ids", "tokenizer_digest"),
    "pnyx.models.logprobs": ("completion_logprobs", "sampling_logprobs"),
}

__all__ = export_names(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
