"""Run bootstrap: `run.json` (create-only) and version 0, so a worker can join from the store alone.

`init_run` writes the run manifest (resolved config, model identity incl. vocab size and tokenizer
digest, and the public key that signs the run's weights) with create-only semantics and refuses to join an existing run whose run-defining fields differ.
Publishing version 0 (an anchor of the initial weights) is the caller's first publish, which is also the
fence: a second trainer on the same run fails there.

Knows nothing about training; imports no torch.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from pnyx.errors import AlreadyExistsError, ConfigError
from pnyx.protocol import layout
from pnyx.protocol.records import RunManifest, TrainerKey
from pnyx.protocol.runfile import read_run
from pnyx.store import Store

# Fields that define what workers do and what a group means: two trainers (or a resumed trainer) with
# different values here would train on rollouts that do not mean what they think.
RUN_DEFINING_WORKER = ("group_size", "temperature", "top_p", "top_k", "max_new_tokens")
RUN_DEFINING_MODEL = ("vocab_size", "tokenizer_digest", "model_type")


def new_run_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"


def run_defining(config: dict[str, Any], model: dict[str, Any]) -> dict[str, Any]:
    """The subset of (config, model info) that must match for two processes to share a run."""
    worker = config.get("worker", {})
    env = config.get("env", {})
    return {
        "env.name": env.get("name"),
        "env.kwargs": env.get("kwargs", {}),
        "env.system_prompt": env.get("system_prompt"),
        **{f"worker.{k}": worker.get(k) for k in RUN_DEFINING_WORKER},
        **{f"model.{k}": model.get(k) for k in RUN_DEFINING_MODEL},
        # what workers run is the base plus this adapter: its shape and scale define the run (off: None, as a
        # run created before the setting existed records it)
        "trainer.lora": lora
        if isinstance(lora := config.get("trainer", {}).get("lora"), dict) and lora.get("enabled")
        else None,
    }


def config_diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Human-readable differences between two `run_defining` dicts."""
    return [
        f"{k}: run has {a.get(k)!r}, this config has {b.get(k)!r}"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    ]


def init_run(
    store: Store, config: dict[str, Any], model: dict[str, Any], trainer_key: TrainerKey | None = None
) -> RunManifest:
    """Create `run.json` (create-only) or join the existing one if its run-defining fields match.

    `trainer_key`: the `TrainerKey` (public half) that will sign the run's weights. Returns the run's
    `RunManifest` (the existing one when joining). Raises ConfigError on a mismatch.
    """
    from pnyx.protocol.codec import encode_json
    from pnyx.protocol.records import RunManifest

    manifest = RunManifest(
        run_id=new_run_id(), created_at=time.time(), config=config, model=model, trainer_key=trainer_key
    )
    try:
        store.put(layout.RUN_MANIFEST, encode_json(manifest), mode="create")
        return manifest
    except AlreadyExistsError:
        pass
    existing = read_run(store)
    if existing is None:
        raise ConfigError(f"{store.url}/run.json exists but cannot be read; inspect it by hand")
    check_compatible(existing, config, model, store.url)
    return existing


def check_compatible(
    existing: RunManifest, config: dict[str, Any], model: dict[str, Any], where: str
) -> None:
    """Raise ConfigError if `config`/`model` differ from the run's in run-defining fields."""
    diffs = config_diff(run_defining(existing.config, existing.model), run_defining(config, model))
    if diffs:
        raise ConfigError(
            f"the run at {where} was created with a different configuration:\n  "
            + "\n  ".join(diffs)
            + "\nUse the run's settings (pnyx trainer --resume reads them from run.json) or start a new run "
            "with another --store."
        )
