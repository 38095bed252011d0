"""Opening a swarm node: the settings the swarm mode refuses (`SWARM_UNSUPPORTED`, `check_swarm_config`) and
`open_node`, which loads the node's model, tokenizer and environment and builds the `SwarmNode`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pnyx.config import PnyxConfig, resolve_env_kwargs
from pnyx.errors import ConfigError
from pnyx.store import Store
from pnyx.swarm.node import SwarmNode
from pnyx.swarm.share import check_node_name

log = logging.getLogger("pnyx.swarm")


SWARM_UNSUPPORTED = {
    "algorithm.kl_coef": (lambda c: c.algorithm.kl_coef > 0, "a swarm node keeps no reference model"),
    "trainer.lr_schedule": (lambda c: c.trainer.lr_schedule != "constant", "a node's rate is constant"),
    "trainer.warmup_steps": (lambda c: c.trainer.warmup_steps > 0, "a node's rate is constant"),
    "trainer.compute_dtype": (lambda c: c.trainer.compute_dtype != "auto", "a node steps in fp32"),
    "trainer.activation_checkpointing": (
        lambda c: c.trainer.activation_checkpointing,
        "a node runs one process without FSDP",
    ),
    "worker.engine": (
        lambda c: c.worker.engine != "torch",
        "swarm nodes generate with torch: a node samples from the torch model it trains in place every "
        "round, which another engine would have to reload each round",
    ),
    "security.committed_draws": (  # on by default for the trainer mode: refused only where set
        lambda c: c.security.committed_draws and "committed_draws" in c.security.model_fields_set,
        "swarm nodes share decoded text, not seeded draws, and no trainer ticks",
    ),
}
"""Settings of the central trainer and its workers a swarm node would silently ignore (or fail on): refused
up front."""


def check_swarm_config(cfg: PnyxConfig) -> None:
    """ConfigError naming every setting the swarm mode does not honour (`SWARM_UNSUPPORTED`)."""
    bad = [f"{name} ({why})" for name, (used, why) in SWARM_UNSUPPORTED.items() if used(cfg)]
    if bad:
        raise ConfigError(
            "swarm mode does not support "
            + "; ".join(bad)
            + ": leave these at their defaults for `pnyx swarm`"
        )


def open_node(
    store: Store, name: str, cfg: PnyxConfig, model_dir: str | Path | None = None, **kwargs: Any
) -> SwarmNode:
    """Load this node's model (fp32, for training), tokenizer and environment, and build the node."""
    from pnyx.envs import get_env
    from pnyx.models import load_model, load_tokenizer, model_folder
    from pnyx.models.source import resolve_model_path

    check_node_name(name)
    check_swarm_config(cfg)
    path = model_folder(model_dir) if model_dir is not None else resolve_model_path(cfg)
    model = load_model(path, dtype="float32", device=cfg.trainer.device)
    if cfg.trainer.lora.enabled:  # the node trains an adapter; it samples through peft's layers (unmerged)
        from pnyx.models.lora import attach, describe

        attach(model, cfg.trainer.lora)
        log.info("swarm node %s: %s", name, describe(cfg.trainer.lora))
    tokenizer = load_tokenizer(path)
    env = get_env(cfg.env.name, **resolve_env_kwargs(cfg))
    return SwarmNode(store, name, cfg, model, tokenizer, path, env, **kwargs)
