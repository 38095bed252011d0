"""`pnyx export --store URL --out DIR`: a published version of a run, as a Hugging Face folder.

`export_run` reads run.json, verifies the requested version (default: the newest the trainer signed)
through the run's `TrustedWeights` and their `Syncer` (every tensor, the state digest, the hash chain and
the trainer's signature, against the key run.json names or the `--trust` fingerprint; fail-closed: weights
that do not verify, a version the trainer did not sign, and the weights of an unsigned run, are never
written), resolves the run's model on this machine for its tokenizer and generation config (the run's
tokenizer digest must match), and writes the folder with `pnyx.models.export.write_hf_folder` in the run's
publish dtype or the one asked for. torch is imported inside the functions, so `pnyx --help` stays instant.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pnyx.store import Store


@dataclass
class ExportResult:
    out: Path
    version: int
    chain_digest: str
    dtype: str
    source: str


def export_run(
    store: Store,
    out: Path,
    version: int | None = None,
    dtype: str | None = None,
    model: str | None = None,
    trust: str | None = None,
) -> ExportResult:
    """Verify `version` of the run in `store` and write it to `out` (see the module docstring)."""
    from pnyx.config import config_from_dict
    from pnyx.errors import ConfigError
    from pnyx.models.export import EXPORT_DTYPES, check_out_folder, write_hf_folder
    from pnyx.models.source import resolve_run_model
    from pnyx.weights import TrustedWeights

    out = Path(out)
    check_out_folder(out)  # before any download or verification: fail fast on a typo
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")
    weights = TrustedWeights.open(store, trust)  # ConfigError: no run.json, an unsigned run, another key
    run = weights.run
    info, cfg = run.model or {}, config_from_dict(run.config)
    source = resolve_run_model(info, cfg.model.path, cfg.model.revision, override=model, check="tokenizer")
    target = weights.resolve(version)  # UntrustedWeightsError for a version the trainer did not sign
    if target is None:
        raise ConfigError(f"{store.url} has no published weights yet: nothing to export")
    syncer = weights.syncer()
    got, tensors = syncer.sync(to_version=target)  # IntegrityError if it does not verify: nothing written
    if got != target:
        raise ConfigError(f"asked to export version {target} but the store served version {got}")
    dtype = str(dtype or info.get("publish_dtype") or cfg.trainer.publish_dtype)
    hf_config = info.get("hf_config")
    if not hf_config:  # a run recorded before hf_config was: the source's own config
        import json

        hf_config = json.loads((source.folder / "config.json").read_text())
    identity = {k: v for k, v in (info.get("source") or {}).items() if k != "files"}
    provenance = {
        "run_id": run.run_id,
        "version": got,
        "chain_digest": syncer.digest,
        "dtype": dtype,
        "model": identity or {"name": info.get("name")},
        "tokenizer_digest": info.get("tokenizer_digest"),
    }
    write_hf_folder(tensors, hf_config, source.folder, out, dtype, provenance)
    return ExportResult(
        out=out, version=got, chain_digest=str(syncer.digest), dtype=dtype, source=source.name
    )


def export_main(
    store: str, out: Path, version: int | None, dtype: str | None, model: str | None, trust: str | None = None
) -> None:
    """The `pnyx export` command: export, then say what was written and how to load it."""
    from rich.console import Console

    from pnyx.cli.common import fail
    from pnyx.errors import ConfigError, IntegrityError, PnyxError
    from pnyx.store import open_store

    try:
        result = export_run(open_store(store), out, version, dtype, model, trust)
    except ConfigError as e:
        raise fail(str(e)) from None
    except IntegrityError as e:
        raise fail(f"version does not verify, nothing written: {e}", code=1) from None
    except PnyxError as e:
        raise fail(f"export failed: {e}", code=1) from None
    Console().print(
        f"exported v{result.version} (chain {result.chain_digest[:16]}, {result.dtype}, base {result.source}) "
        f"to {result.out}\nload it with: AutoModelForCausalLM.from_pretrained({str(result.out)!r}), "
        f"or `vllm serve {result.out}`",
        highlight=False,
    )
