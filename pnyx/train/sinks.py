"""Optional metric trackers besides the store's per-step objects: TensorBoard, Weights & Biases, trackio.

Each sink has `write(metrics)` and `close()` and logs the same scalars (`scalars`): every number of the
trainer's per-step metrics dict, nested dicts flattened with '/', named `trainer/<name>`, at step =
`metrics["version"]`; strings, lists and None are not logged. Knows nothing about training; the heavy
imports happen only when a sink is asked for, and a missing package raises ConfigError naming the extra to
install (docs/trackers.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from pnyx.errors import ConfigError

NOT_LOGGED = ("version", "time")
"""Top-level metrics no tracker gets as a scalar: the version is each tracker's step, and every tracker
stamps its own wall-clock time."""


class Sink(Protocol):
    def write(self, metrics: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def flatten(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """{'a': 1, 'b': {'c': 2}} -> {'a': 1.0, 'b/c': 2.0}; non-numeric values are skipped."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, name + "/"))
        elif isinstance(v, int | float):  # bool is an int
            out[name] = float(v)
    return out


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """What every sink logs for one step: `trainer/<flattened name>` -> value, without NOT_LOGGED."""
    return {f"trainer/{k}": v for k, v in flatten(metrics).items() if k not in NOT_LOGGED}


def _missing(field: str, extra: str, e: ImportError) -> ConfigError:
    return ConfigError(
        f"trainer.{field} is set but {extra} is not installed ({e}): pip install 'pnyx[{extra}]'"
    )


class TensorBoardSink:
    """Event files under `logdir` (`tensorboard --logdir DIR`)."""

    def __init__(self, logdir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise _missing("tensorboard", "tensorboard", e) from None
        self.writer = SummaryWriter(log_dir=str(logdir))

    def write(self, metrics: dict[str, Any]) -> None:
        step = int(metrics["version"])
        for k, v in scalars(metrics).items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()  # a crashed trainer still leaves every step it published on disk

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """One W&B run per pnyx run (id = run id, so a resumed trainer continues it). W&B's own settings apply:
    `WANDB_MODE=offline`, `WANDB_DIR`, `WANDB_ENTITY`, ..."""

    def __init__(self, project: str, run_id: str, config: dict[str, Any]):
        try:
            import wandb  # pyright: ignore[reportMissingImports]  (optional: pip install 'pnyx[wandb]')
        except ImportError as e:
            raise _missing("wandb_project", "wandb", e) from None
        self.run = wandb.init(project=project, name=run_id, id=run_id, resume="allow", config=config)

    def write(self, metrics: dict[str, Any]) -> None:
        self.run.log(scalars(metrics), step=int(metrics["version"]))

    def close(self) -> None:
        self.run.finish()


class TrackioSink:
    """One trackio run per pnyx run (name = run id, resumed by a resumed trainer), in trackio's local
    SQLite database (`TRACKIO_DIR`, default `~/.cache/huggingface/trackio`; `trackio show`), or a Space or
    server when `TRACKIO_SPACE_ID` / `TRACKIO_SERVER_URL` is set."""

    def __init__(self, project: str, run_id: str, config: dict[str, Any]):
        try:
            import trackio  # pyright: ignore[reportMissingImports]  (optional: pip install 'pnyx[trackio]')
        except ImportError as e:
            raise _missing("trackio_project", "trackio", e) from None
        try:
            self.run = trackio.init(project=project, name=run_id, config=config, resume="allow")
        except ValueError as e:  # a reserved project name, a server URL without its write token
            raise ConfigError(f"trainer.trackio_project={project!r}: trackio refused it: {e}") from None

    def write(self, metrics: dict[str, Any]) -> None:
        self.run.log(scalars(metrics), step=int(metrics["version"]))

    def close(self) -> None:
        self.run.finish()


def open_sinks(
    *,
    tensorboard: bool,
    wandb_project: str | None,
    trackio_project: str | None,
    logdir: Path,
    run_id: str,
    config: dict[str, Any],
) -> list[Sink]:
    """The sinks the config asks for (possibly none); `logdir` is TensorBoard's, `config` the resolved
    config the W&B and trackio runs record."""
    sinks: list[Sink] = []
    try:
        if tensorboard:
            sinks.append(TensorBoardSink(logdir))
        if wandb_project:
            sinks.append(WandbSink(wandb_project, run_id, config))
        if trackio_project:
            sinks.append(TrackioSink(trackio_project, run_id, config))
    except Exception:  # a missing extra, or wandb.init / trackio.init failing in its own way
        for s in sinks:  # those already open end cleanly (no leaked writer); the trainer stops on the error
            s.close()
        raise
    return sinks
