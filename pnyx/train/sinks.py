"""Optional metric sinks besides the store's per-step objects: TensorBoard and Weights & Biases.

Each sink has `write(metrics: dict)` and `close()`. Only flat numeric metrics are forwarded (nested
dicts are flattened with '/'). Knows nothing about training; the heavy imports happen only when a sink is
asked for, and a missing package raises ConfigError naming the extra to install.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pnyx.errors import ConfigError


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


class TensorBoardSink:
    def __init__(self, logdir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ConfigError(
                f"trainer.tensorboard is set but TensorBoard is not installed ({e}): pip install 'pnyx[tensorboard]'"
            ) from None
        self.writer = SummaryWriter(log_dir=str(logdir))

    def write(self, metrics: dict[str, Any]) -> None:
        step = int(metrics["version"])
        for k, v in flatten(metrics).items():
            if k not in ("version", "time"):
                self.writer.add_scalar(f"trainer/{k}", v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, project: str, run_id: str, config: dict[str, Any]):
        try:
            import wandb  # pyright: ignore[reportMissingImports]  (optional: pip install 'pnyx[wandb]')
        except ImportError as e:
            raise ConfigError(
                f"trainer.wandb_project is set but wandb is not installed ({e}): pip install 'pnyx[wandb]'"
            ) from None
        self.run = wandb.init(project=project, name=run_id, id=run_id, resume="allow", config=config)

    def write(self, metrics: dict[str, Any]) -> None:
        self.run.log({f"trainer/{k}": v for k, v in flatten(metrics).items()}, step=int(metrics["version"]))

    def close(self) -> None:
        self.run.finish()


def open_sinks(
    tensorboard: bool, wandb_project: str | None, logdir: Path, run_id: str, config: dict[str, Any]
) -> list[Any]:
    """The sinks the config asks for (possibly none)."""
    sinks: list[Any] = []
    if tensorboard:
        sinks.append(TensorBoardSink(logdir))
    if wandb_project:
        sinks.append(WandbSink(wandb_project, run_id, config))
    return sinks
