"""The `pnyx` command line: run, trainer, worker, swarm, eval, export, status, weights, envs, config.

This module only wires commands; each command's body lives in `pnyx/cli/<noun>.py` and imports torch and
friends inside the function, so `pnyx --help` never imports torch. Config overrides are dotted flags
(`--trainer.lr=1e-4`) collected from the extra arguments of each command.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import typer

from pnyx.cli.common import EXTRA_ARGS, config_command

app = typer.Typer(
    name="pnyx",
    help="Decentralized RL post-training: workers generate rollouts, a trainer learns; they meet in an object store.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _lazy(module: str, func: str):
    """Resolve a command body at call time, so importing the CLI stays cheap."""

    def call(*args, **kwargs):
        return getattr(importlib.import_module(module), func)(*args, **kwargs)

    return call


@app.command(context_settings=EXTRA_ARGS)
def run(
    ctx: typer.Context,
    config: Path | None = typer.Option(None, "--config", "-c", help="TOML config file."),
    workers: int = typer.Option(1, "--workers", "-w", min=0, max=64, help="Local worker processes."),
    resume: bool = typer.Option(False, "--resume", help="Continue the newest run (or --run.name) in ./runs."),
    live: bool = typer.Option(True, "--live/--no-live", help="Show the live terminal view."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved config and exit."),
):
    """The main job: a trainer and N workers on this machine, with a live view and a before/after table.

    With no arguments: the shipped tiny model on the `arith` task, a local-folder store under ./runs/<name>.
    Add dotted overrides such as --env.name=searchqa --run.steps=50 --trainer.lr=1e-4.
    """
    cfg = config_command(config, ctx.args, dry_run)
    _lazy("pnyx.cli.run", "run_main")(cfg, workers=workers, resume=resume, live=live)


@app.command(context_settings=EXTRA_ARGS)
def trainer(
    ctx: typer.Context,
    store: str = typer.Option(..., "--store", "-s", help="Run root URL (folder, s3://, gs://, memory://)."),
    config: Path | None = typer.Option(None, "--config", "-c", help="TOML config file."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the run's last checkpoint."),
    steps: int | None = typer.Option(
        None, "--steps", min=1, help="Stop after this many steps (overrides run.steps)."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved config and exit."),
):
    """Run the trainer of a run: ingest rollouts, take GRPO steps, publish weights."""
    cfg = config_command(config, ctx.args, dry_run, store=store)
    _lazy("pnyx.cli.trainer", "trainer_main")(cfg, resume=resume, steps=steps)


@app.command()
def worker(
    store: str = typer.Option(..., "--store", "-s", help="Run root URL (folder, s3://, gs://)."),
    worker_id: str | None = typer.Option(None, "--id", help="Worker id (default: host-pid)."),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda, mps or auto."),
    engine: str | None = typer.Option(
        None, "--engine", help="torch, mlx (Apple silicon) or vllm (GPUs). Default: the run's worker.engine."
    ),
    int8: bool = typer.Option(False, "--int8", help="Run the model from the int8 actor plane."),
    max_groups: int | None = typer.Option(
        None, "--max-groups", min=1, help="Stop after uploading this many groups."
    ),
    threads: int | None = typer.Option(None, "--threads", min=1, help="Torch CPU threads."),
    model: str | None = typer.Option(
        None,
        "--model",
        help="This machine's copy of the run's model (folder, .gguf, hub id); checked at join.",
    ),
    spool_dir: str | None = typer.Option(
        None,
        "--spool-dir",
        help="Spool root (default $PNYX_SPOOL_DIR, else ~/.cache/pnyx/spool); per run and worker.",
    ),
    trust: str | None = typer.Option(
        None,
        "--trust",
        help="Trainer key fingerprint to require (default: trust run.json's key on first use and pin it).",
    ),
):
    """Join a run from its run.json alone: follow the weights, generate, score and upload rollout groups."""
    _lazy("pnyx.cli.worker", "worker_main")(
        store=store, worker_id=worker_id, device=device, int8=int8, max_groups=max_groups, threads=threads,
        model=model, engine=engine, spool_dir=spool_dir, trust=trust,
    )  # fmt: skip


@app.command(context_settings=EXTRA_ARGS)
def swarm(
    ctx: typer.Context,
    store: str = typer.Option(..., "--store", "-s", help="Swarm root URL shared by all nodes."),
    node: str = typer.Option(..., "--node", "-n", help="This node's name."),
    config: Path | None = typer.Option(None, "--config", "-c", help="TOML config file."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved config and exit."),
):
    """Swarm mode (SAPO): train this node's own policy on I local + J shared groups per step."""
    cfg = config_command(config, ctx.args, dry_run, store=store)
    _lazy("pnyx.cli.swarm", "swarm_main")(cfg, node=node)


@app.command(name="eval", context_settings=EXTRA_ARGS)
def eval_(
    ctx: typer.Context,
    model: str | None = typer.Option(
        None, "--model", help="Model folder, .gguf file or hub id (default: the shipped tiny model)."
    ),
    store: str | None = typer.Option(
        None, "--store", help="Evaluate a published version of this run instead."
    ),
    version: int | None = typer.Option(None, "--version", help="Version to evaluate (default: newest)."),
    env: str | None = typer.Option(
        None,
        "--env",
        help="Environment (default: the run's or config's, else arith; another drops their env options).",
    ),
    tasks: int = typer.Option(200, "--tasks", min=1, help="Held-out tasks."),
    samples: int = typer.Option(1, "--samples", "-n", min=1, help="Samples per task (pass@k for k<=n)."),
    out: Path | None = typer.Option(None, "--out", help="Write the results as JSON here."),
    config: Path | None = typer.Option(
        None, "--config", "-c", help="TOML config (model, env, worker sections)."
    ),
    max_new_tokens: int | None = typer.Option(
        None, "--max-new-tokens", min=1, max=32768, help="Generation budget per turn (default: the env's)."
    ),
    temperature: float | None = typer.Option(None, "--temperature", min=0.0, max=4.0, help="0 = greedy."),
    top_p: float | None = typer.Option(
        None, "--top-p", min=0.0, max=1.0, help="Nucleus truncation (1 = off)."
    ),
    top_k: int | None = typer.Option(None, "--top-k", min=0, help="Top-k truncation (0 = off)."),
    trust: str | None = typer.Option(
        None,
        "--trust",
        help="With --store: trainer key fingerprint run.json must name (default: run.json's).",
    ),
    engine: str = typer.Option(
        "torch", "--engine", help="Generation engine: torch, mlx (Apple silicon; mlx[cpu] on Linux) or vllm."
    ),
    device: str | None = typer.Option(
        None,
        "--device",
        help="cpu, cuda, mps or auto (default: the config's model.device; cpu with --store).",
    ),
):
    """Evaluate a model folder or a published version on the held-out split: pass@k and env metrics."""
    _lazy("pnyx.cli.eval", "eval_main")(
        model=model,
        store=store,
        version=version,
        env=env,
        tasks=tasks,
        samples=samples,
        out=out,
        extra=ctx.args,
        config=config,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        trust=trust,
        engine=engine,
        device=device,
    )


@app.command()
def export(
    store: str = typer.Option(..., "--store", "-s", help="Run root URL."),
    out: Path = typer.Option(..., "--out", "-o", help="Folder to write (must not exist, or be empty)."),
    version: int | None = typer.Option(None, "--version", min=0, help="Version to export (default: newest)."),
    dtype: str | None = typer.Option(None, "--dtype", help="bfloat16, float16 or float32 (default: run's)."),
    model: str | None = typer.Option(
        None, "--model", help="This machine's copy of the run's model, if needed."
    ),
    trust: str | None = typer.Option(
        None, "--trust", help="Trainer key fingerprint run.json must name (default: run.json's)."
    ),
    merged: bool = typer.Option(
        False, "--merged", help="LoRA run: write the base with the adapter merged, not the PEFT adapter."
    ),
):
    """Verify a published version and write it as a Hugging Face folder (transformers, vLLM load it as is).

    A LoRA run's version is written as a PEFT adapter folder of the run's base (--merged: the base with the
    adapter merged, float32 unless --dtype)."""
    _lazy("pnyx.cli.export", "export_main")(
        store=store, out=out, version=version, dtype=dtype, model=model, trust=trust, merged=merged
    )


@app.command()
def status(
    store: str = typer.Option(..., "--store", "-s", help="Run root URL."),
    watch: bool = typer.Option(False, "--watch", help="Keep refreshing (Ctrl-C to stop)."),
    trust: str | None = typer.Option(
        None, "--trust", help="Trainer key fingerprint run.json must name (default: run.json's)."
    ),
    serve: bool = typer.Option(
        False, "--serve", help="Serve a live web page of the run (learning curve, fleet, drops) until Ctrl-C."
    ),
    port: int = typer.Option(8765, "--port", min=0, max=65535, help="--serve: port (0: any free one)."),
    host: str = typer.Option(
        "127.0.0.1", "--host", help="--serve: address to bind (loopback by default; use an SSH tunnel)."
    ),
):
    """Show a run's state from the store alone: versions, trainer metrics, workers and their heartbeats."""
    _lazy("pnyx.cli.status", "status_main")(
        store=store, watch=watch, trust=trust, serve=serve, host=host, port=port
    )


@app.command(name="config", context_settings=EXTRA_ARGS)
def config_(
    ctx: typer.Context,
    config: Path | None = typer.Option(None, "--config", "-c", help="TOML config file."),
):
    """Print the resolved configuration (defaults → TOML file → dotted overrides) as TOML."""
    config_command(config, ctx.args, dry_run=True)


def _mount(name: str, module: str) -> None:
    app.add_typer(importlib.import_module(module).app, name=name)


for _name, _module in (("weights", "pnyx.cli.weights"), ("envs", "pnyx.cli.envs")):
    if importlib.util.find_spec(_module) is not None:
        _mount(_name, _module)


def main() -> None:
    app()
