"""A model state written as a standard Hugging Face folder: config, generation config, tokenizer, safetensors.

`write_hf_folder` builds the architecture from the config dict the trainer recorded (run.json's
`hf_config`), loads the given state into it strictly (every tensor named, none missing, shapes equal),
saves it with `save_pretrained` (safetensors, sharded as transformers shards) in the requested dtype, and
copies the tokenizer files and the generation config byte for byte from the run's model source. The
folder is what `transformers.AutoModelForCausalLM.from_pretrained` and vLLM read as it is.

Invariant: `out` ends complete or not at all: everything is written into a temporary sibling that is
renamed into place last. Knows nothing about the store: the caller verifies the weights and hands them in.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pnyx.errors import ConfigError
from pnyx.models.tokenizer import TOKENIZER_FILES

if TYPE_CHECKING:
    import torch

EXPORT_DTYPES = ("bfloat16", "float16", "float32")
PROVENANCE_FILE = "pnyx_export.json"
"""Written next to the model: which run, version and chain digest the weights are, and from what model."""
_DROP_CONFIG_KEYS = ("_name_or_path", "transformers_version", "quantization_config")


def check_out_folder(out: Path) -> None:
    """Refuse an `out` that exists and is not an empty folder (an export never overwrites anything)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} already exists and is not an empty folder: choose a new folder")


def write_hf_folder(
    tensors: Mapping[str, torch.Tensor],
    hf_config: Mapping[str, Any],
    source_folder: Path,
    out: Path,
    dtype: str,
    provenance: Mapping[str, Any] | None = None,
) -> Path:
    """Write `tensors` (a full model state) with `hf_config` and `source_folder`'s tokenizer to `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")
    check_out_folder(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch_dtype = getattr(torch, dtype)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        config_dict = {k: v for k, v in hf_config.items() if k not in _DROP_CONFIG_KEYS}
        config_dict["dtype"] = dtype
        (tmp / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
        config = AutoConfig.from_pretrained(tmp, local_files_only=True)  # exactly how a user will read it
        with torch.device("meta"):  # no random init, no second copy: the state is assigned as it is
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        state = {k: v.to(torch_dtype) if v.is_floating_point() else v for k, v in tensors.items()}
        model.load_state_dict(state, strict=True, assign=True)
        model.tie_weights()
        model.save_pretrained(tmp)
        for name in (*TOKENIZER_FILES, "generation_config.json"):
            if (source_folder / name).is_file():
                shutil.copyfile(source_folder / name, tmp / name)
        if provenance is not None:
            (tmp / PROVENANCE_FILE).write_text(json.dumps(dict(provenance), indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty (checked above): rename needs the name free
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
