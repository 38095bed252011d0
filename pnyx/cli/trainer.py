"""`pnyx trainer`: the body of the command (`pnyx/cli/__init__.py` mounts it).

Runs one run's trainer until the step budget, Ctrl-C/SIGTERM (clean stop: the current step finishes,
publishes and checkpoints) or no data for `trainer.max_wait_s`. Exit codes: 0 done, 2 bad config,
3 fenced (another trainer owns the run), 4 integrity problem in the run's store. Torch is imported inside
the function, so `pnyx --help` never imports it.

Under `torchrun --nproc-per-node N -m pnyx trainer ...` every rank runs this same command; each logs with
its rank in the role (`trainer.r1`), and ranks other than 0 log warnings only (rank 0 writes the step
lines). A rank that hits a pnyx error exits with the code above; torchrun then stops the others.
"""

from __future__ import annotations

import signal
from pathlib import Path

from pnyx.cli.common import fail, setup_logging
from pnyx.config import PnyxConfig
from pnyx.errors import ConfigError, FencedError, IntegrityError, ModelNotFoundError, PeerFailedError


def trainer_main(cfg: PnyxConfig, resume: bool = False, steps: int | None = None) -> int:
    """Run the trainer of the run at `cfg.store.url`; returns the last published version."""
    import logging
    import os

    from pnyx.train.distributed import launched_world

    rank = int(os.environ.get("RANK", "0")) if launched_world() > 1 else 0
    log = setup_logging(f"trainer.r{rank}" if launched_world() > 1 else "trainer")
    if rank > 0 and "PNYX_LOG_LEVEL" not in os.environ:
        log.setLevel(logging.WARNING)
    if not cfg.store.url:
        raise fail("pnyx trainer needs --store URL (a folder, s3://bucket/prefix?endpoint=..., gs://...)")
    from pnyx.store import RetryPolicy, open_store
    from pnyx.train.loop import Trainer
    from pnyx.train.sinks import open_sinks

    trainer = None
    try:
        store = open_store(cfg.store.url, RetryPolicy(deadline_s=cfg.store.retry_deadline_s))
        trainer = Trainer(cfg, store, resume=resume, steps=steps)
        previous = {s: signal.signal(s, trainer.request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            trainer.start()
            sinks = []
            if rank == 0:
                t = trainer.cfg.trainer
                sinks = open_sinks(
                    tensorboard=t.tensorboard,
                    wandb_project=t.wandb_project,
                    trackio_project=t.trackio_project,
                    logdir=Path("tensorboard") / trainer.run_id,
                    run_id=trainer.run_id,
                    config=trainer.cfg.model_dump(mode="json"),
                )
            version = trainer.run(sinks)
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            if getattr(trainer, "dist", None) is not None:
                trainer.parts.dist.close()
    except (ConfigError, ModelNotFoundError) as e:
        raise fail(str(e), 2) from None
    except FencedError as e:
        raise fail(f"fenced: {e}", 3) from None
    except (IntegrityError, PeerFailedError) as e:
        raise fail(f"integrity: {e}", 4) from None
    log.info("trainer stopped at v%d (checkpoint v%s)", version, trainer.last_checkpoint)
    return version


def trainer(
    store: str,
    config: Path | None = None,
    resume: bool = False,
    steps: int | None = None,
    overrides: list[str] | None = None,
) -> int:
    """Resolve the config (defaults → TOML → dotted overrides) and run `trainer_main`."""
    from pnyx.config import load_config, with_fields

    try:
        cfg = load_config(config, overrides or [])
    except ConfigError as e:
        raise fail(str(e)) from None
    cfg = with_fields(cfg, {"store.url": store})
    return trainer_main(cfg, resume=resume, steps=steps)
