"""`pnyx trainer`: the body of the command (the lead's `pnyx/cli/__init__.py` mounts it).

Runs one run's trainer until the step budget, Ctrl-C/SIGTERM (clean stop: the current step finishes,
publishes and checkpoints) or no data for `trainer.max_wait_s`. Exit codes: 0 done, 2 bad config,
3 fenced (another trainer owns the run), 4 integrity problem in the run's store. Torch is imported inside
the function, so `pnyx --help` never imports it.
"""

from __future__ import annotations

import signal
from pathlib import Path

import typer

from pnyx.cli.common import fail, setup_logging
from pnyx.config import PnyxConfig
from pnyx.errors import ConfigError, FencedError, IntegrityError, ModelNotFoundError


def trainer_main(cfg: PnyxConfig, resume: bool = False, steps: int | None = None) -> int:
    """Run the trainer of the run at `cfg.store.url`; returns the last published version."""
    log = setup_logging("trainer")
    if not cfg.store.url:
        raise fail("pnyx trainer needs --store URL (a folder, s3://bucket/prefix?endpoint=..., gs://...)")
    from pnyx.store import RetryPolicy, open_store
    from pnyx.train.loop import Trainer
    from pnyx.train.sinks import open_sinks

    try:
        store = open_store(cfg.store.url, RetryPolicy(deadline_s=cfg.store.retry_deadline_s))
        trainer = Trainer(cfg, store, resume=resume, steps=steps)
        previous = {s: signal.signal(s, trainer.request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            trainer.start()
            sinks = open_sinks(
                trainer.cfg.trainer.tensorboard,
                trainer.cfg.trainer.wandb_project,
                Path("tensorboard") / trainer.manifest.run_id,
                trainer.manifest.run_id,
                trainer.cfg.model_dump(mode="json"),
            )
            version = trainer.run(sinks)
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
    except (ConfigError, ModelNotFoundError) as e:
        raise fail(str(e), 2) from None
    except FencedError as e:
        raise fail(f"fenced: {e}", 3) from None
    except IntegrityError as e:
        raise fail(f"integrity: {e}", 4) from None
    log.info("trainer stopped at v%d (checkpoint v%s)", version, trainer.last_checkpoint)
    return version


def trainer(
    store: str, config: Path | None = None, resume: bool = False, steps: int | None = None,
    overrides: list[str] | None = None,
) -> int:
    """Resolve the config (defaults → TOML → dotted overrides) and run `trainer_main`."""
    from pnyx.config import load_config

    try:
        cfg = load_config(config, overrides or [])
    except ConfigError as e:
        raise fail(str(e)) from None
    cfg.store.url = store
    return trainer_main(cfg, resume=resume, steps=steps)


def main(argv: list[str] | None = None) -> None:
    """`python -m pnyx.train --store URL [--config FILE] [--resume] [--steps N] [--section.field=value ...]`."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

    @app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def _cmd(
        ctx: typer.Context,
        store: str = typer.Option(..., "--store", "-s"),
        config: Path | None = typer.Option(None, "--config", "-c"),
        resume: bool = typer.Option(False, "--resume"),
        steps: int | None = typer.Option(None, "--steps", min=1),
    ) -> None:
        trainer(store, config, resume, steps, list(ctx.args))

    app(args=argv, prog_name="python -m pnyx.train")
