"""`pnyx envs ...`: list the registered environments and show sample tasks with a scored ideal answer.

Knows nothing about models or the store and never imports torch. `pnyx/cli/__init__.py` mounts `app` as `pnyx envs`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pnyx.errors import ConfigError, EnvironmentNotFound

app = typer.Typer(
    help="Environments (tasks and verifiers): list them, show sample tasks.", no_args_is_help=True
)
console = Console()


def parse_kwargs(pairs: list[str]) -> dict[str, Any]:
    """`["digits=3", "ops=[\\"+\\"]"]` → {"digits": 3, "ops": ["+"]} (values are JSON, else strings)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


@app.command("list")
def list_command() -> None:
    """List every environment name (built-ins and those installed through the `pnyx.envs` entry point)."""
    from pnyx.envs.registry import BUILTINS, get_factory, list_envs

    table = Table("name", "source", "description")
    for name in list_envs():
        source = "built-in" if name in BUILTINS else "plugin"
        try:
            factory = get_factory(name)
            doc = (factory.__doc__ or "").strip().splitlines()
            description = doc[0] if doc else ""
        except ImportError as e:
            description = f"cannot import: {e}"
        table.add_row(name, source, escape(description))
    console.print(table)


@app.command("show")
def show_command(
    name: Annotated[str, typer.Argument(help="environment name, e.g. arith")],
    n: Annotated[int, typer.Option(help="how many sample tasks")] = 3,
    split: Annotated[str, typer.Option(help="train or test")] = "train",
    seed: Annotated[int, typer.Option(help="stream seed")] = 0,
    kw: Annotated[
        list[str] | None, typer.Option("--kw", help="environment option KEY=VALUE (repeatable)")
    ] = None,
) -> None:
    """Show a few sample tasks of NAME and how a correct answer scores."""
    from pnyx.envs.registry import get_env

    try:
        env = get_env(name, **parse_kwargs(kw or []))
        tasks = env.sample(split, seed, n)  # type: ignore[arg-type]
    except (EnvironmentNotFound, ConfigError) as e:
        console.print(f"[red]{escape(str(e))}[/red]")
        raise typer.Exit(2) from e
    console.print(f"[bold]{env.name}[/bold]: {escape(env.describe())}")
    console.print(
        f"stop_strings={env.stop_strings} tool_stops={env.tool_stops} max_turns={env.max_turns} "
        f"max_new_tokens={env.max_new_tokens}"
    )
    for task in tasks:
        console.rule(task.id)
        messages = [{"role": "user", "content": task.prompt}] if isinstance(task.prompt, str) else task.prompt
        for m in messages:
            _field("prompt" if m["role"] == "user" else m["role"], m["content"])
        _field("answer", repr(task.answer)[:300])
        if (level := env.level_of(task)) is not None:
            _field("level", str(level))
        try:
            ref = env.reference_completion(task)
        except NotImplementedError:
            continue
        text = ref if isinstance(ref, str) else "".join(t for _, t in ref)
        score = env.score(task, text)
        _field("ideal completion", text)
        _field("scores", f"reward={score.reward:g} parts={score.parts} reason={score.reason}")


def _field(label: str, value: str) -> None:
    console.print(f"[bold]{label}:[/bold] {escape(value)}")
