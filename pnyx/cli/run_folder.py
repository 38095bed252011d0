"""The run folder of `pnyx run`: `./runs/<name>/` with its `config.toml` (what the trainer reads), `logs/`,
`evals.jsonl`, `learning_curve.png` and `summary.json`; naming a new run, finding the newest one to resume.

Knows nothing about processes, evaluation or the store beyond defaulting its URL to the folder. Before it
makes a folder it builds the run's environment once (`check_env`), so a bad environment name or option is
refused at the prompt, not in the trainer's and workers' logs after they started.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from pnyx.config import PnyxConfig, check_worker_dtype, load_config, overlay_changed, to_toml, with_fields
from pnyx.errors import ConfigError

RUNS_ROOT = Path("runs")
CONFIG_FILE = "config.toml"
SUMMARY_FILE = "summary.json"
CURVE_FILE = "learning_curve.png"


@dataclass
class RunPlan:
    """Where a run lives and how it is configured."""

    name: str
    folder: Path
    store_url: str
    cfg: PnyxConfig
    resumed: bool

    @property
    def logs(self) -> Path:
        return self.folder / "logs"

    @property
    def evals_path(self) -> Path:
        return self.folder / "evals.jsonl"


def newest_run(root: Path) -> str | None:
    """The name of the most recently modified run folder under `root` that has a saved config."""
    runs = [p for p in root.glob(f"*/{CONFIG_FILE}") if p.is_file()]
    if not runs:
        return None
    return max(runs, key=lambda p: p.stat().st_mtime).parent.name


def plan_run(cfg: PnyxConfig, resume: bool, root: Path = RUNS_ROOT) -> RunPlan:
    """Resolve the run's name, folder, store URL and config; write `config.toml` for the trainer."""
    if resume:
        name = cfg.run.name or newest_run(root)
        if name is None:
            raise ConfigError(f"--resume found no run under {root}/: start one with `pnyx run` first")
        saved = root / name / CONFIG_FILE
        if not saved.is_file():
            raise ConfigError(f"--resume: {saved} does not exist; runs available: {_names(root)}")
        cfg = overlay_changed(load_config(saved), cfg)
    else:
        name = cfg.run.name or time.strftime("run-%Y%m%d-%H%M%S", time.gmtime())
        if (root / name / CONFIG_FILE).exists():
            raise ConfigError(
                f"run {name!r} already exists in {root}/: continue it with `pnyx run --resume --run.name={name}` "
                "or pick another --run.name"
            )
    check_worker_dtype(cfg)  # before any folder is made: the trainer would refuse it anyway
    check_env(cfg)
    folder = (root / name).resolve()
    store_url = cfg.store.url if cfg.store.url is not None else str(folder)
    cfg = with_fields(
        cfg,
        {"run.name": name, "security.trusted_keys": trusted_with_local_workers(cfg), "store.url": store_url},
    )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "logs").mkdir(exist_ok=True)
    (folder / CONFIG_FILE).write_text(to_toml(cfg))
    return RunPlan(name=name, folder=folder, store_url=store_url, cfg=cfg, resumed=resume)


def check_env(cfg: PnyxConfig) -> None:
    """Build the run's environment and drop it: ConfigError (naming the options it takes) unless every
    process of the run could build it. A recipe's `env.kwargs` belong to its environment, so switching
    `--env.name` alone keeps options the new one refuses: the error then says how to clear them."""
    from pnyx.config import resolve_env_kwargs
    from pnyx.envs.registry import get_env
    from pnyx.errors import EnvironmentNotFound, EnvOptionsError

    try:
        get_env(cfg.env.name, **resolve_env_kwargs(cfg))
    except EnvironmentNotFound as e:
        raise ConfigError(e.args[0] if e.args else str(e)) from None
    except ImportError as e:
        raise ConfigError(f"environment {cfg.env.name!r} could not be imported: {e}") from None
    except EnvOptionsError as e:
        raise ConfigError(
            f"{e}. env.kwargs {dict(cfg.env.kwargs)} came from the config or the command line: after "
            f"switching --env.name, pass --env.kwargs '{{}}' or options that {cfg.env.name!r} takes"
        ) from None


def trusted_with_local_workers(cfg: PnyxConfig) -> list[str]:
    """`security.trusted_keys` with this machine's worker key added (the one `pnyx run`'s local workers sign
    with; created if missing): the user's own processes are never quarantined, and their groups calibrate
    the sampling checks."""
    from pnyx.security.keys import fingerprint, load_or_create_key, normalize_fingerprint, worker_key_path

    key, _ = load_or_create_key(worker_key_path())
    fp = fingerprint(key)
    keys = list(cfg.security.trusted_keys)
    if fp not in {normalize_fingerprint(k) for k in keys}:
        keys.append(fp)
    return keys


def _names(root: Path) -> str:
    return ", ".join(sorted(p.parent.name for p in root.glob(f"*/{CONFIG_FILE}"))) or "none"
