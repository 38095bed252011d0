"""`pnyx weights inspect|verify|prune --store URL`: look at, re-verify, and prune a run's published weights.

`inspect` reads manifests only (cheap, safe on a live run); `verify` downloads every payload and rebuilds
every version from its anchor and deltas, checking all digests and every signature against the trainer
key named in run.json (or `--trust <fingerprint>`; exit 1 on any problem, an unsigned run included);
`prune` applies the retention policy, keeping only manifests the trainer signed. Knows nothing about training; heavy imports stay inside the commands.
"""

from __future__ import annotations

from typing import Literal

import typer

app = typer.Typer(help="Inspect, verify and prune a run's published weights (PULSE).", no_args_is_help=True)

STORE = typer.Option(..., "--store", "-s", help="Run root URL (folder, s3://, gs://, memory://).")
TRUST = typer.Option(
    None, "--trust", help="Trainer key fingerprint run.json must name (default: run.json's)."
)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _open(store: str):
    from pnyx.cli.common import fail
    from pnyx.errors import ConfigError, StoreError
    from pnyx.store import open_store

    try:
        return open_store(store)
    except (ConfigError, StoreError, ValueError) as e:
        raise fail(f"cannot open {store}: {e}") from None


def _trust(store, trust: str | None, required: bool):
    """The run's trainer key verifier (`pnyx.weights.TrustedWeights`, the policy every reader shares). None
    (with a warning) for a store without run.json (bare PULSE weights: digests only), and for an unsigned
    run unless `required` (then exit 1: refused)."""
    from rich.console import Console

    from pnyx.cli.common import fail
    from pnyx.errors import ConfigError
    from pnyx.protocol.runfile import read_run
    from pnyx.weights import TrustedWeights

    run = read_run(store)
    if run is None and trust is None:
        Console().print("[yellow]no run.json: checking digests and chain only, not who signed them[/yellow]")
        return None
    if run is None:
        raise fail(f"{store.url} holds no run.json, so no trainer key to check --trust against", code=1)
    try:
        weights = TrustedWeights.for_run(store, run, trust, unsigned="refuse" if required else "unchecked")
    except ConfigError as e:
        raise fail(str(e), code=1) from None
    if weights.verifier is None:
        Console().print("[yellow]run.json names no trainer key: these weights are unsigned[/yellow]")
        return None
    Console().print(f"trainer key: {weights.verifier.fingerprint}", highlight=False)
    return weights.verifier


def _print(report, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("version", "kind", "parent", "anchor", "delta", "anchor bytes", "changed", "int8", "status"):
        table.add_column(col, justify="right" if col not in ("kind", "status") else "left")
    for v in report.versions:
        table.add_row(
            str(v.version),
            v.kind,
            "-" if v.parent_version is None else str(v.parent_version),
            str(v.anchor_version),
            _size(v.delta_bytes),
            _size(v.anchor_bytes) if v.anchor_bytes else "-",
            f"{100 * v.changed_fraction:.2f}%",
            _size(v.int8_bytes) if v.int8_bytes else "-",
            v.status,
        )
    console = Console()
    console.print(table)
    head = f"v{report.head.version}" if report.head else "absent"
    console.print(
        f"newest manifest: v{report.latest}  HEAD: {head}  chain: {'OK' if report.ok else 'PROBLEMS'}"
    )
    for p in report.problems:
        console.print(f"[red]problem:[/red] {p}")


@app.command()
def inspect(store: str = STORE, trust: str | None = TRUST) -> None:
    """Versions, kinds, sizes and chain links, from manifests alone."""
    from pnyx.weights.chain import inspect_chain

    opened = _open(store)
    report = inspect_chain(opened, _trust(opened, trust, required=False))
    _print(report, f"weights in {store}")
    if not report.ok:
        raise typer.Exit(1)


@app.command()
def verify(
    store: str = STORE,
    plane: str = typer.Option("weights", "--plane", help="weights or int8"),
    trust: str | None = TRUST,
) -> None:
    """Re-verify the whole chain end to end: download, rebuild and check every version."""
    from pnyx.cli.common import fail
    from pnyx.weights.chain import verify_chain

    if plane not in ("weights", "int8"):
        raise fail(f"--plane must be 'weights' or 'int8', got {plane!r}")
    chosen: Literal["weights", "int8"] = "weights" if plane == "weights" else "int8"
    opened = _open(store)
    report = verify_chain(opened, chosen, _trust(opened, trust, required=True))
    _print(report, f"verified {plane} in {store}")
    if not report.ok:
        raise typer.Exit(1)


@app.command()
def prune(
    store: str = STORE,
    keep_anchors: int = typer.Option(2, "--keep-anchors", min=1, help="Newest anchors to keep."),
    window: int = typer.Option(
        20, "--window", min=0, help="Never delete versions within this many of the head."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="List what would be deleted."),
    trust: str | None = TRUST,
) -> None:
    """Delete versions no retained anchor or recent follower can need (see docs/pulse.md)."""
    from pnyx.weights.retention import apply_retention

    opened = _open(store)
    verifier = _trust(opened, trust, required=False)
    keys = apply_retention(opened, keep_anchors=keep_anchors, window=window, dry_run=dry_run, trust=verifier)
    typer.echo(f"{'would delete' if dry_run else 'deleted'} {len(keys)} objects")
