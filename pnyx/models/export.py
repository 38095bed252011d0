"""A model state written as a standard Hugging Face folder, or a LoRA adapter as a PEFT adapter folder.

`write_hf_folder` builds the architecture from the config dict the trainer recorded (run.json's
`hf_config`), loads the given state into it strictly (every tensor named, none missing, shapes equal),
saves it with `save_pretrained` (safetensors, sharded as transformers shards) in the requested dtype, and
copies the tokenizer files and the generation config byte for byte from the run's model source. The
folder is what `transformers.AutoModelForCausalLM.from_pretrained` and vLLM read as it is.

A LoRA run (`pnyx.models.lora`) publishes only its adapter. `write_adapter_folder` writes it as a PEFT
adapter folder (`adapter_config.json` + `adapter_model.safetensors`, by `lora.write_peft_adapter`) with the
base's tokenizer files, which `peft.PeftModel.from_pretrained(base, folder)` loads onto the run's base;
`merged_state` is instead the base's full state with the adapter merged into every target
(W0 + (alpha / r) · B @ A in float32, `lora.AdapterMerge`, exactly what the run's engines compute), for
`write_hf_folder`.

Invariant: `out` ends complete or not at all: everything is written into a temporary sibling that is
renamed into place last. Knows nothing about the store: the caller verifies the weights and hands them in.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pnyx.errors import ConfigError, IntegrityError
from pnyx.models.tokenizer import TOKENIZER_FILES

if TYPE_CHECKING:
    import torch

    from pnyx.config import LoraConfig

EXPORT_DTYPES = ("bfloat16", "float16", "float32")
PROVENANCE_FILE = "pnyx_export.json"
"""Written next to the model: which run, version and chain digest the weights are, and from what model."""
_DROP_CONFIG_KEYS = ("_name_or_path", "transformers_version", "quantization_config")


def check_out_folder(out: Path) -> None:
    """Refuse an `out` that exists and is not an empty folder (an export never overwrites anything)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} already exists and is not an empty folder: choose a new folder")


def check_dtype(dtype: str) -> None:
    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")


@contextmanager
def _staged(out: Path) -> Iterator[Path]:
    """A temporary sibling of `out` to write into, renamed to `out` when the block ends without error and
    removed when it raises (the module's invariant)."""
    check_out_folder(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        yield tmp
        if out.exists():
            out.rmdir()  # empty (checked above): rename needs the name free
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _copy_beside(
    source_folder: Path, tmp: Path, names: tuple[str, ...], provenance: Mapping[str, Any] | None
) -> None:
    """Copy `names` that `source_folder` has, byte for byte, and write the provenance file."""
    for name in names:
        if (source_folder / name).is_file():
            shutil.copyfile(source_folder / name, tmp / name)
    if provenance is not None:
        (tmp / PROVENANCE_FILE).write_text(json.dumps(dict(provenance), indent=2) + "\n")


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

    check_dtype(dtype)
    torch_dtype = getattr(torch, dtype)
    with _staged(out) as tmp:
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
        _copy_beside(source_folder, tmp, (*TOKENIZER_FILES, "generation_config.json"), provenance)
    return out


def check_adapter(adapter: Mapping[str, torch.Tensor], lc: LoraConfig) -> list[str]:
    """The base weight keys `adapter` (published names) adapts; IntegrityError unless every tensor is a
    lora_A (r x in) or lora_B (out x r) of the run's rank, each target with both."""
    from pnyx.models.lora import target_of, targets

    keys = targets(adapter)
    for name, t in adapter.items():
        part = target_of(name)[1]
        rank = t.shape[0 if part == "lora_A" else 1] if t.ndim == 2 else None
        if rank != lc.rank:
            raise IntegrityError(
                f"{name} has shape {list(t.shape)}: not a rank-{lc.rank} {part} (the run's rank)"
            )
    return keys


def write_adapter_folder(
    adapter: Mapping[str, torch.Tensor],
    lc: LoraConfig,
    base: str | None,
    source_folder: Path,
    out: Path,
    dtype: str,
    provenance: Mapping[str, Any] | None = None,
    base_revision: str | None = None,
) -> Path:
    """Write `adapter` (a LoRA run's published tensors) in `dtype` as a PEFT adapter folder at `out`, with
    `source_folder`'s tokenizer files. `base` (and `base_revision`, a hub commit) name the base model in
    adapter_config.json, where `peft.AutoPeftModelForCausalLM` looks for it. IntegrityError, and nothing
    written, unless `adapter` is a whole adapter of rank `lc.rank` (`check_adapter`)."""
    import torch

    from pnyx.models.lora import write_peft_adapter

    check_dtype(dtype)
    check_adapter(adapter, lc)
    torch_dtype = getattr(torch, dtype)
    with _staged(out) as tmp:
        adapter = {n: t.to(torch_dtype) for n, t in adapter.items()}
        write_peft_adapter(tmp, adapter, lc, base, base_revision)  # a hub base at the run's commit
        _copy_beside(source_folder, tmp, TOKENIZER_FILES, provenance)
    return out


def merged_state(
    adapter: Mapping[str, torch.Tensor], lc: LoraConfig, base_folder: Path
) -> dict[str, torch.Tensor]:
    """The full float32 state of the base model in `base_folder` with `adapter` merged into each target."""
    from pnyx.models.loading import load_model
    from pnyx.models.lora import AdapterMerge

    keys = check_adapter(adapter, lc)
    state = load_model(base_folder, dtype="float32").state_dict()
    missing = [k for k in keys if k not in state]
    if missing:
        raise IntegrityError(f"the adapter adapts {missing[:3]}, which the base model does not have")
    merge = AdapterMerge(lc, {k: state[k] for k in keys})
    state.update(merge.merged(adapter, adapter.keys()))
    return state
