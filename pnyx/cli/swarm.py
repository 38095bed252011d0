"""`pnyx swarm --store URL --node NAME`: run one SAPO node until `run.steps` rounds or `run.time_budget_s`.

Only wiring: resolves the store, loads this node's model and environment (`pnyx.swarm.open_node`, which
resumes from the node's checkpoint in the store when it has one), runs the loop until the node has done
`run.steps` rounds in all (restored rounds count) and prints a one-line summary. Heavy imports (torch)
happen inside `swarm_main`, so `pnyx --help` stays instant.
"""

from __future__ import annotations

from pnyx.cli.common import fail, setup_logging
from pnyx.config import PnyxConfig
from pnyx.errors import ConfigError, IntegrityError, ModelNotFoundError


def swarm_main(cfg: PnyxConfig, node: str) -> None:
    """Run node `node` of the swarm at `cfg.store.url` for `cfg.run.steps` rounds."""
    from pnyx.swarm.share import check_node_name

    try:
        check_node_name(node)
    except ConfigError as e:
        raise fail(str(e)) from None
    log = setup_logging(f"node:{node}")
    from pnyx.store import open_store, redact_url
    from pnyx.swarm.opening import open_node

    if not cfg.store.url:
        raise fail("swarm needs --store URL (the shared swarm root)")
    try:
        store = open_store(cfg.store.url)
        swarm_node = open_node(store, node, cfg)
    except (ConfigError, IntegrityError, ModelNotFoundError) as e:
        raise fail(str(e)) from None
    sw = cfg.swarm
    log.info(
        "swarm %s node=%s I=%d J=%d foreign=%s prefer=%s model=%s",
        redact_url(store.url),
        node,
        sw.local_groups,
        sw.external_groups,
        sw.foreign,
        sw.prefer,
        swarm_node.model_id,
    )
    rounds = swarm_node.run(cfg.run.steps, time_budget_s=cfg.run.time_budget_s)
    reward = sum(r.local_reward for r in rounds) / max(1, len(rounds))
    log.info(
        "done node=%s rounds=%d (this run %d) version=%d mean_local_reward=%.3f drops=%s",
        node,
        swarm_node.rounds,
        len(rounds),
        swarm_node.version,
        reward,
        dict(swarm_node.drops),
    )
