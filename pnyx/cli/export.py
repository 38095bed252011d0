"""`pnyx export --store URL --out DIR`: a published version of a run, as a Hugging Face folder.

`export_run` reads run.json, verifies the requested version (default: the newest the trainer signed)
through the run's `TrustedWeights` and their `Syncer` (every tensor, the state digest, the hash chain and
the trainer's signature, against the key run.json names or the `--trust` fingerprint; fail-closed: weights
that do not verify, a version the trainer did not sign, and the weights of an unsigned run, are never
written), resolves the run's model on this machine for its tokenizer and generation config (the run's
tokenizer digest must match), and writes the folder with `pnyx.models.export.write_hf_folder` in the run's
publish dtype or the one asked for. torch is imported inside the functions, so `pnyx --help` stays instant.

A LoRA run (`trainer.lora`, `pnyx.models.lora`) publishes only its adapter, and its versions are adapters of
the run's base model. Its export is a PEFT adapter folder (`write_adapter_folder`: the verified adapter in the
publish dtype or the one asked for, the base's tokenizer, adapter_config.json naming the base), or with
`merged=True` (`--merged`) a plain Hugging Face folder of the base with the adapter merged into every target
(`merged_state`, float32 unless a dtype is asked for). Either way the base resolved here must be exactly the
run's (its model files, not only its tokenizer). `--merged` on a run that trains full weights is a
ConfigError: that export is already a plain folder.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pnyx.store import Store

if TYPE_CHECKING:
    import torch

ExportKind = Literal["full", "adapter", "merged"]
"""What `out` holds: a full-weights run's model, a LoRA run's PEFT adapter, or its base with it merged."""


@dataclass
class ExportResult:
    out: Path
    version: int
    chain_digest: str
    dtype: str
    source: str
    kind: ExportKind = "full"
    base: str | None = None
    """A LoRA run: where the run's base model is on this machine (what the adapter loads onto)."""


def export_run(
    store: Store,
    out: Path,
    version: int | None = None,
    dtype: str | None = None,
    model: str | None = None,
    trust: str | None = None,
    merged: bool = False,
) -> ExportResult:
    """Verify `version` of the run in `store` and write it to `out` (see the module docstring)."""
    from pnyx.config import config_from_dict
    from pnyx.errors import ConfigError
    from pnyx.models.export import check_dtype, check_out_folder
    from pnyx.models.lora import lora_from_run
    from pnyx.models.source import resolve_run_model
    from pnyx.weights import TrustedWeights

    out = Path(out)
    check_out_folder(out)  # before any download or verification: fail fast on a typo
    if dtype is not None:
        check_dtype(dtype)
    weights = TrustedWeights.open(store, trust)  # ConfigError: no run.json, an unsigned run, another key
    run = weights.run
    lora = lora_from_run(run.config)
    if merged and lora is None:
        raise ConfigError(
            "--merged is for a LoRA run: this run trains full weights; its export is already a plain folder "
            "(drop --merged)"
        )
    info, cfg = run.model or {}, config_from_dict(run.config)
    # An adapter is only what was trained on exactly the run's base: check the base's files, not the tokenizer.
    check = "tokenizer" if lora is None else "model"
    source = resolve_run_model(info, cfg.model.path, cfg.model.revision, override=model, check=check)
    target = weights.resolve(version)  # UntrustedWeightsError for a version the trainer did not sign
    if target is None:
        raise ConfigError(f"{store.url} has no published weights yet: nothing to export")
    syncer = weights.syncer()
    got, tensors = syncer.sync(to_version=target)  # IntegrityError if it does not verify: nothing written
    if got != target:
        raise ConfigError(f"asked to export version {target} but the store served version {got}")
    published_dtype = str(info.get("publish_dtype") or cfg.trainer.publish_dtype)
    dtype = str(dtype or ("float32" if merged else published_dtype))
    identity = {k: v for k, v in (info.get("source") or {}).items() if k != "files"}
    provenance = {
        "run_id": run.run_id,
        "version": got,
        "chain_digest": syncer.digest,
        "dtype": dtype,
        "model": identity or {"name": info.get("name")},
        "tokenizer_digest": info.get("tokenizer_digest"),
    }
    result = ExportResult(
        out=out, version=got, chain_digest=str(syncer.digest), dtype=dtype, source=source.name
    )
    if lora is None:
        _write_full(tensors, info, source.folder, out, dtype, provenance)
        return result
    provenance["lora"] = {
        **lora.model_dump(mode="json", exclude={"enabled"}),
        "published_dtype": published_dtype,
        "merged": merged,
    }
    result.base = str(source.folder)
    if merged:
        from pnyx.models.export import merged_state

        _write_full(merged_state(tensors, lora, source.folder), info, source.folder, out, dtype, provenance)
        result.kind = "merged"
        return result
    from pnyx.models.export import write_adapter_folder

    hub = source.kind == "hub"
    write_adapter_folder(
        tensors, lora, source.repo_id if hub else str(source.folder), source.folder, out, dtype, provenance,
        base_revision=source.commit if hub else None,
    )  # fmt: skip
    result.kind = "adapter"
    return result


def _write_full(
    tensors: Mapping[str, torch.Tensor],
    info: Mapping[str, Any],
    source_folder: Path,
    out: Path,
    dtype: str,
    provenance: Mapping[str, Any],
) -> None:
    """A full model state as a Hugging Face folder, with the architecture run.json records."""
    from pnyx.models.export import write_hf_folder

    hf_config = info.get("hf_config")
    if not hf_config:  # a run recorded before hf_config was: the source's own config
        import json

        hf_config = json.loads((source_folder / "config.json").read_text())
    write_hf_folder(tensors, hf_config, source_folder, out, dtype, provenance)


def how_to_load(result: ExportResult) -> str:
    """The closing line of `pnyx export`: how to load what it wrote."""
    out = str(result.out)
    if result.kind == "adapter":
        return (
            f"a LoRA adapter of base {result.source} ({result.base}); load it with: "
            f"PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({result.base!r}), {out!r}), "
            f"or export it merged into the base with --merged"
        )
    load = f"load it with: AutoModelForCausalLM.from_pretrained({out!r}), or `vllm serve {out}`"
    if result.kind == "merged":
        return f"base {result.source} with the LoRA adapter merged; {load}"
    return load


def export_main(
    store: str,
    out: Path,
    version: int | None,
    dtype: str | None,
    model: str | None,
    trust: str | None = None,
    merged: bool = False,
) -> None:
    """The `pnyx export` command: export, then say what was written and how to load it."""
    from rich.console import Console

    from pnyx.cli.common import fail
    from pnyx.errors import ConfigError, IntegrityError, PnyxError
    from pnyx.store import open_store

    try:
        result = export_run(open_store(store), out, version, dtype, model, trust, merged)
    except ConfigError as e:
        raise fail(str(e)) from None
    except IntegrityError as e:
        raise fail(f"version does not verify, nothing written: {e}", code=1) from None
    except PnyxError as e:
        raise fail(f"export failed: {e}", code=1) from None
    Console().print(
        f"exported v{result.version} (chain {result.chain_digest[:16]}, {result.dtype}, base {result.source}) "
        f"to {result.out}\n{how_to_load(result)}",
        highlight=False,
    )
