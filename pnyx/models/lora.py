"""LoRA adapters (`[trainer.lora]`): attaching one to the trainer's model, naming its tensors on the wire, merging
a published adapter into a base, and writing it as a PEFT adapter folder.

The trainer injects peft's LoRA layers into its model in place (`attach`: `peft.inject_adapter_in_model`, the
base frozen), so the model keeps its class and every caller of it (logprobs, FSDP2, checkpoints) is unchanged.
What it publishes is the adapter alone, under **published names**: the state-dict key without peft's adapter
name, `model.layers.0.self_attn.q_proj.lora_A.weight` (A, r x in) and `...lora_B.weight` (B, out x r), as a
PEFT adapter file names them under `base_model.model.`. A worker holds the run's base model (the same source,
checked as for every run) and computes with the merged weight of each target,

    W = W0 + (alpha / r) · B @ A,

in float32 (`AdapterMerge`), which is what peft's unmerged forward `x W0ᵀ + (alpha / r) · (x Aᵀ) Bᵀ` computes up
to float rounding. Knows nothing about the store, engines or the trainer's loop.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pnyx.errors import ConfigError, IntegrityError

if TYPE_CHECKING:
    from pnyx.config import LoraConfig

ADAPTER = "default"
"""peft's name of the one adapter in the trainer's module tree (`...q_proj.lora_A.default.weight`)."""
PARTS = ("lora_A", "lora_B")
PEFT_PREFIX = "base_model.model."
"""What a PEFT adapter file puts before a module path (PeftModel wraps the base as `base_model.model`)."""
ADAPTER_FILE = "adapter_model.safetensors"


def scaling(lc: LoraConfig) -> float:
    """The factor of B @ A in the merged weight: alpha / r (peft's `scaling`, without rsLoRA)."""
    return lc.alpha / lc.rank


def peft_config(lc: LoraConfig, base: str | None = None, revision: str | None = None) -> Any:
    """`peft.LoraConfig` of the run's settings; `base` and `revision` (a hub commit) name the base model in an
    adapter folder, where `peft.AutoPeftModelForCausalLM` loads it from."""
    try:
        import peft
    except ImportError:
        raise ConfigError("trainer.lora needs peft: pip install 'pnyx[lora]'") from None
    return peft.LoraConfig(
        r=lc.rank,
        lora_alpha=lc.alpha,  # pyright: ignore[reportArgumentType]  (typed int in peft; a float scales as well)
        lora_dropout=lc.dropout,
        target_modules=lc.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base,
        revision=revision,
    )


def attach(model: torch.nn.Module, lc: LoraConfig) -> dict[str, str]:
    """Inject the adapter into `model` in place (its base frozen, the adapter trainable; B starts at 0, so the
    model computes exactly the base) and return {state-dict key: published name} of the adapter's tensors."""
    config = peft_config(lc)  # ConfigError if peft is not installed
    from peft import inject_adapter_in_model

    try:
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as e:  # peft: no module matched target_modules, or a module it cannot wrap
        raise ConfigError(f"trainer.lora.target_modules={lc.target_modules!r}: {e}") from None
    names = published_names(model)
    if not names:
        raise ConfigError(f"trainer.lora.target_modules={lc.target_modules!r} matched no layer of the model")
    return names


def published_names(model: torch.nn.Module) -> dict[str, str]:
    """{state-dict key: published name} of the adapter tensors in `model`'s state dict (in its order)."""
    out: dict[str, str] = {}
    for key in model.state_dict():
        for part in PARTS:
            infix = f".{part}.{ADAPTER}."
            if infix in key:
                out[key] = key.replace(infix, f".{part}.")
    return out


def target_of(name: str) -> tuple[str, str]:
    """(the base weight's key, "lora_A" | "lora_B") of a published adapter tensor name."""
    for part in PARTS:
        suffix = f".{part}.weight"
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".weight", part
    raise IntegrityError(
        f"{name!r} is not a LoRA adapter tensor (expected '<module>.lora_A.weight' or lora_B)"
    )


def targets(names: Iterable[str]) -> list[str]:
    """The base weight keys a set of published adapter names adapts, in first-seen order; IntegrityError
    unless each has both its A and its B."""
    seen: dict[str, set[str]] = {}
    for n in names:
        key, part = target_of(n)
        seen.setdefault(key, set()).add(part)
    partial = [k for k, parts in seen.items() if len(parts) != 2]
    if partial:
        raise IntegrityError(f"the adapter names only one of lora_A / lora_B for {partial[:3]}")
    return list(seen)


class AdapterMerge:
    """The merged target weights of a published adapter over a fixed base: `merged(adapter, changed)` returns
    W0 + (alpha / r) · B @ A (float32) for each target whose A or B is among `changed`.

    `base` holds W0 of every target (float32, on the device the merged weights should live on); the merge
    never writes it, so any later version is merged from the same base, exactly as the trainer computes."""

    def __init__(self, lc: LoraConfig, base: Mapping[str, torch.Tensor]):
        self.scale, self.rank = scaling(lc), lc.rank
        self.base = {k: v.detach().to(torch.float32) for k, v in base.items()}

    def merged(self, adapter: Mapping[str, torch.Tensor], changed: Iterable[str]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name in changed:  # a delta may change only one of a target's A and B
            key = target_of(name)[0]
            if key not in out:
                out[key] = self.weight(key, adapter)
        return out

    def weight(self, key: str, adapter: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """W0 + scale · B @ A of the base weight `key`."""
        stem = key.removesuffix(".weight")
        base = self.base.get(key)
        if base is None:
            raise IntegrityError(
                f"the adapter adapts {key!r}, which this model does not have or the run's first version did not adapt"
            )
        a = adapter[f"{stem}.lora_A.weight"].to(base.device, torch.float32)
        b = adapter[f"{stem}.lora_B.weight"].to(base.device, torch.float32)
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != self.rank or b.shape[1] != self.rank:
            raise IntegrityError(
                f"{stem}: lora_A {list(a.shape)} / lora_B {list(b.shape)} are not of the run's rank {self.rank}"
            )
        if (b.shape[0], a.shape[1]) != base.shape:
            raise IntegrityError(
                f"{stem}: lora_B {list(b.shape)} @ lora_A {list(a.shape)} does not fit the base weight {list(base.shape)}"
            )
        return torch.addmm(base, b, a, alpha=self.scale)


def write_peft_adapter(
    folder: str | Path,
    adapter: Mapping[str, torch.Tensor],
    lc: LoraConfig,
    base: str | None,
    revision: str | None = None,
) -> Path:
    """Write `adapter` (published names) as a PEFT adapter folder (`adapter_config.json` +
    `adapter_model.safetensors`) that `peft.PeftModel.from_pretrained(base_model, folder)` loads."""
    from safetensors.torch import save_file

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    peft_config(lc, base, revision).save_pretrained(str(out))
    tensors = {PEFT_PREFIX + n: t.detach().to("cpu").contiguous() for n, t in adapter.items()}
    save_file(tensors, str(out / ADAPTER_FILE), metadata={"format": "pt"})
    return out


def lora_from_run(config: Mapping[str, Any]) -> LoraConfig | None:
    """The run's `trainer.lora` from a run.json config dict, or None when the run trains full weights."""
    from pnyx.config import LoraConfig

    raw = (config.get("trainer") or {}).get("lora")
    if not raw:
        return None
    lc = LoraConfig.model_validate(raw)
    return lc if lc.enabled else None


def describe(lc: LoraConfig) -> str:
    """One line for logs: rank, alpha, targets."""
    return f"LoRA r={lc.rank} alpha={lc.alpha:g} targets={json.dumps(lc.target_modules)}"
