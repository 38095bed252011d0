"""A GGUF file, dequantized once into a plain safetensors folder in the pnyx cache.

`transformers` loads a GGUF file (`from_pretrained(folder, gguf_file=...)`) by dequantizing every tensor,
which takes tens of seconds even for a 135M model on a small CPU, and the model it returns refuses
`save_pretrained` while it carries a `quantization_config`. pnyx pays that cost once per file per machine:
`dequantized_folder` writes the dequantized fp32 weights, the config (without the quantization config),
the generation config and the tokenizer into `<pnyx cache>/gguf/<file digest>/`, and every later load (the
trainer, each worker, every evaluation) is an ordinary folder load. The values are exactly the ones
transformers' GGUF loader produces; fp32 keeps them bit for bit.

Invariant: a folder under `gguf/` is complete or absent. It is built in a temporary sibling and renamed
into place, under a file lock, so processes started together (a trainer and its workers) convert once
and never read half a folder. Knows nothing about the store or RL; needs `pnyx[gguf]` (gguf, accelerate).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from pnyx.errors import ConfigError, ModelNotFoundError
from pnyx.models.fingerprint import cache_dir

log = logging.getLogger("pnyx.models")

LOCK_TIMEOUT_S = 3600.0
"""Longest wait for another process converting the same file (a 70B GGUF takes minutes, not an hour)."""
MARKER = "pnyx-gguf.json"
"""Written into each converted folder: which file (name, digest) it came from."""


def dequantized_folder(gguf_file: Path, digest: str) -> Path:
    """The safetensors folder for `gguf_file` (content digest `digest`), converting it on first use."""
    from filelock import FileLock, Timeout

    root = cache_dir() / "gguf"
    folder = root / digest
    if (folder / MARKER).is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    try:
        with FileLock(str(root / f"{digest}.lock"), timeout=LOCK_TIMEOUT_S):
            if (folder / MARKER).is_file():  # another process converted it while we waited
                return folder
            if folder.exists():  # not ours to trust: only a complete conversion carries the marker
                shutil.rmtree(folder)
            _convert(gguf_file, digest, folder)
    except Timeout as e:
        raise ModelNotFoundError(
            f"waited {LOCK_TIMEOUT_S:.0f}s for another process converting {gguf_file.name}; if none is running, "
            f"delete {root / (digest + '.lock')} and retry"
        ) from e
    return folder


def _convert(gguf_file: Path, digest: str, folder: Path) -> None:
    """Dequantize `gguf_file` with transformers into `folder` (written to a temp sibling, then renamed)."""
    _require_gguf()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("dequantizing %s into %s (once per file; later loads read the folder)", gguf_file, folder)
    where, name = str(gguf_file.parent), gguf_file.name
    try:
        quantized = AutoModelForCausalLM.from_pretrained(
            where, gguf_file=name, dtype=torch.float32, local_files_only=True
        )
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name, local_files_only=True)
    except (ValueError, KeyError, NotImplementedError) as e:
        raise ModelNotFoundError(
            f"transformers cannot load {gguf_file} ({type(e).__name__}: {e}). It reads GGUF files of the "
            "architectures it lists in transformers.modeling_gguf_pytorch_utils.GGUF_SUPPORTED_ARCHITECTURES; "
            "use the model's Hugging Face folder or hub id instead."
        ) from e
    config = quantized.config
    # A GGUF-loaded model refuses save_pretrained while it carries its quantization config: copy the
    # dequantized state into a plain model built from the same config without it.
    config.__dict__.pop("quantization_config", None)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict(), strict=True, assign=True)
    plain.tie_weights()
    plain.generation_config = quantized.generation_config
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{digest}-"))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        marker = {"gguf_file": gguf_file.name, "digest": digest, "dtype": "float32"}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _require_gguf() -> None:
    import importlib.util

    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(
            f"loading a .gguf model needs the {' and '.join(missing)} package(s): pip install 'pnyx[gguf]'"
        )
