"""Helpers shared by the CLI commands: config resolution, clean error exits, logging setup.

Knows nothing about torch; every command body imports its heavy dependencies itself.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import typer

from pnyx.config import PnyxConfig, load_config, to_toml, with_fields
from pnyx.errors import ConfigError

EXTRA_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True}


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print an actionable error to stderr and return the Exit to raise."""
    typer.secho(f"pnyx: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(code)


def config_command(
    path: Path | None, extra: list[str], dry_run: bool, store: str | None = None
) -> PnyxConfig:
    """Resolve the config of a command; print it and exit on --dry-run; exit 2 on a bad config."""
    try:
        cfg = load_config(path, extra)
    except ConfigError as e:
        raise fail(str(e)) from None
    if store is not None:
        cfg = with_fields(cfg, {"store.url": store})
    if dry_run:
        typer.echo(to_toml(cfg), nl=False)
        raise typer.Exit(0)
    return cfg


def setup_logging(role: str, level: int = logging.INFO) -> logging.Logger:
    """One logger per process, with the role in every line (greppable across a fleet's logs)."""
    log = logging.getLogger("pnyx")
    if not log.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter(f"%(asctime)s {role} %(levelname).1s %(message)s", "%H:%M:%S"))
        log.addHandler(h)
    log.setLevel(os.environ.get("PNYX_LOG_LEVEL", logging.getLevelName(level)))
    return log
