"""The live view's words and tables: the plain line, the rich table and the before/after table, from a
`Snapshot` (`pnyx.cli.live` reads it from the store). No store access here."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import RenderableType
    from rich.table import Table

from pnyx.cli.live import FLEET_ROWS, SILENT_AFTER_S, Snapshot, WorkerRow, masked_of, reward_of, staleness_of
from pnyx.protocol import layout


def _fmt(x: float | None, spec: str = ".3f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def _age(s: float) -> str:
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m"


def backlog_text(snap: Snapshot) -> str:
    """`waiting 1200 · fetched 16 · dropped stale:40, zero_variance:3` from the trainer's newest report
    (`fetched 16 (3 held back)` where committed draws hold some back)."""
    source = snap.trainer if snap.trainer.get("backlog") else snap.last
    b = source.get("backlog") or {}
    drops = source.get("drops") or snap.last.get("drops") or {}
    dropped = ", ".join(f"{k}:{v}" for k, v in sorted(drops.items()) if v) or "none"
    if not b:
        return f"dropped {dropped}"
    held = f" ({b['held']} held back)" if b.get("held") else ""
    return f"waiting {b.get('waiting', 0)} · fetched {b.get('fetched', 0)}{held} · dropped {dropped}"


def quarantine_text(snap: Snapshot) -> str | None:
    """`2 keys: 3f2a…91 (5 of 9 groups faulty (implausible 5)), ...` from the trainer's newest report."""
    q = snap.trainer.get("quarantined") or snap.last.get("quarantined") or {}
    if not isinstance(q, dict) or not q:
        return None
    keys = snap.trainer.get("keys") or {}
    parts = []
    for fp, why in sorted(q.items())[:4]:
        names = ",".join((keys.get(fp) or {}).get("names") or [])
        parts.append(f"{fp[:8]}…{(' ' + names) if names else ''} ({why})")
    more = f", +{len(q) - 4} more" if len(q) > 4 else ""
    return f"{len(q)} key{'s' if len(q) != 1 else ''}: " + "; ".join(parts) + more


def ignored_versions(snap: Snapshot) -> list[int]:
    """Versions of the manifest objects the trainer's key did not sign (ascending, each once)."""
    return sorted({p[0] for key in snap.ignored if (p := layout.parse_any_weights_manifest(key))})


def ignored_text(snap: Snapshot) -> str | None:
    """`2 manifests not signed by the trainer key, never read: v201, v99999999` (None if there are none)."""
    if not snap.ignored:
        return None
    versions = ignored_versions(snap)
    shown = ", ".join(f"v{v}" for v in versions[:6]) + (
        f", +{len(versions) - 6} more" if len(versions) > 6 else ""
    )
    n = len(snap.ignored)
    return f"{n} manifest{'s' if n != 1 else ''} not signed by the trainer key, never read: {shown}"


def rates_text(snap: Snapshot) -> str:
    """`supply 12.0 groups/s vs consumption 8.1 groups/s`."""
    return (
        f"supply {_fmt(snap.supply_groups_per_s, '.2f')} groups/s vs "
        f"consumption {_fmt(snap.consumption_groups_per_s, '.2f')} groups/s"
    )


def trainer_text(snap: Snapshot) -> str | None:
    """`waiting 23s (usable 3/8)`: what the trainer says it is doing, if it has said so recently."""
    t = snap.trainer
    if not t.get("phase"):
        return None
    age = max(0.0, snap.taken_at - float(t.get("updated_at") or 0.0))
    text = f"{t['phase']} {float(t.get('phase_s') or 0):.0f}s"
    if t.get("phase") in ("ingesting", "waiting"):
        text += f" (usable {t.get('have', 0)}/{t.get('need', '?')})"
    return text + (f", last report {_age(age)} ago" if age > 30 else "")


def trainer_fresh(snap: Snapshot) -> bool:
    """The trainer's report is recent (a stopped trainer's last "starving" is not news)."""
    return snap.taken_at - float(snap.trainer.get("updated_at") or 0.0) <= 60.0


def zero_variance_text(snap: Snapshot) -> str | None:
    from pnyx.train.progress import zero_variance_note

    zv = snap.trainer.get("zero_variance") or snap.last.get("zero_variance") or {}
    return zero_variance_note(zv.get("frac"), zv.get("kind")) if isinstance(zv, dict) else None


def fleet_rows(snap: Snapshot) -> tuple[list[WorkerRow], int]:
    """The workers to show one row each (all of a small fleet; of a large one the lost, then the slowest
    live ones) and how many are left out."""
    if len(snap.workers) <= FLEET_ROWS:
        return sorted(snap.workers, key=lambda w: w.worker_id), 0
    lost = sorted((w for w in snap.workers if snap.lost(w)), key=lambda w: (-w.age_s, w.worker_id))
    live = sorted((w for w in snap.workers if snap.live(w)), key=lambda w: (w.rollouts_per_s, w.worker_id))
    shown = (lost + live)[:FLEET_ROWS]
    return shown, len(snap.workers) - len(shown)


def fleet_totals(snap: Snapshot) -> str:
    """`300 workers: 287 live, 9 lost, 4 stopped`."""
    live = sum(snap.live(w) for w in snap.workers)
    lost = sum(snap.lost(w) for w in snap.workers)
    stopped = len(snap.workers) - live - lost
    return f"{len(snap.workers)} workers: {live} live, {lost} lost, {stopped} stopped"


def eval_history(snap: Snapshot, limit: int = 6) -> str:
    """`v0 0.31 → v10 0.45 → ...`: the held-out pass@1 history, newest last."""
    items = [f"v{e.get('version', '?')} {_fmt(e.get('pass@1'), '.2f')}" for e in snap.evals[-limit:]]
    return " → ".join(items) if items else "-"


def plain_line(snap: Snapshot) -> str:
    """One dense line: `run=x v=12 rollouts/s=3.1 reward=0.54 pass@1=v0 0.31 → v10 0.45 stale=0.8 ...`."""
    if snap.note and snap.run_id is None:
        return f"store={snap.store_url} {snap.note}"
    last = snap.last
    masked = masked_of(last)
    shown, hidden = fleet_rows(snap)
    workers = ",".join(
        f"{w.worker_id}:{w.status}@v{w.version if w.version is not None else '-'}({_age(w.age_s)})"
        for w in shown
    )
    if hidden:  # a large fleet: its totals, then only the first few (lost, slowest) by name
        workers = ",".join(workers.split(",")[:5])
        workers = f"[{fleet_totals(snap)}] {workers},+{hidden + len(shown) - min(5, len(shown))} more"
    from pnyx.train.progress import held_part

    b = snap.trainer.get("backlog") or last.get("backlog") or {}
    return (
        f"run={snap.run_id} t={_fmt(snap.elapsed_s, '.0f')}s v={snap.version if snap.version is not None else '-'} "
        f"rollouts/s={snap.rollouts_per_s:.2f} reward={_fmt(reward_of(last))} "
        f"pass@1=[{eval_history(snap, 4)}] stale={_fmt(staleness_of(last), '.2f')} "
        f"masked={_fmt(None if masked is None else 100 * masked, '.2f')}% "
        f"supply={_fmt(snap.supply_groups_per_s, '.2f')}g/s consume={_fmt(snap.consumption_groups_per_s, '.2f')}g/s "
        f"backlog=waiting:{b.get('waiting', '-')},fetched:{b.get('fetched', '-')}"
        + held_part(b, ",held:")
        + f" trainer={(snap.trainer.get('phase') or '-')} workers={workers or '-'}"
        + (
            f" quarantined={len(q)}"
            if (q := snap.trainer.get("quarantined") or snap.last.get("quarantined"))
            else ""
        )
        + (f" ignored={','.join(f'v{v}' for v in ignored_versions(snap))}" if snap.ignored else "")
        + (
            f" starving: {snap.trainer['starving']}"
            if snap.trainer.get("starving") and trainer_fresh(snap)
            else ""
        )
    )


def render(snap: Snapshot, title: str = "pnyx") -> RenderableType:
    """A rich renderable: a summary table (version, throughput, reward, pass@1, staleness, masked) and a
    worker table (id, status, version, last heartbeat age, rollouts/s)."""
    from rich.console import Group
    from rich.table import Table

    if snap.run_id is None:
        t = Table(title=title, show_header=False)
        t.add_row("store", snap.store_url)
        t.add_row("state", snap.note or "starting")
        return t
    last = snap.last
    summary = Table(
        title=f"{title} — run {snap.run_id} ({snap.env}, {snap.model})", show_header=False, expand=False
    )
    summary.add_column(style="bold")
    summary.add_column()
    masked = masked_of(last)
    rewards = [reward_of(m) for m in snap.metrics[-8:]]
    summary.add_row("elapsed", f"{_fmt(snap.elapsed_s, '.0f')} s")
    summary.add_row("version", str(snap.version) if snap.version is not None else "-")
    summary.add_row("rollouts/s", f"{snap.rollouts_per_s:.2f}")
    summary.add_row("reward (last versions)", " ".join(_fmt(r, ".2f") for r in rewards) or "-")
    summary.add_row("held-out pass@1", eval_history(snap))
    summary.add_row("staleness (mean)", _fmt(staleness_of(last), ".2f"))
    summary.add_row("gate-masked", "-" if masked is None else f"{100 * masked:.2f}%")
    summary.add_row("groups", rates_text(snap))
    summary.add_row("backlog", backlog_text(snap))
    ticks = snap.trainer.get("ticks")
    for label, text in (
        ("quarantined", quarantine_text(snap)),
        (
            "committed draws",
            f"{ticks['ticks']} ticks, {ticks['included']} commitments included, {ticks['refused']} refused"
            if isinstance(ticks, dict) and {"ticks", "included", "refused"} <= set(ticks)
            else "",
        ),
        ("ignored weights", ignored_text(snap)),
        ("trainer", trainer_text(snap)),
        ("warning", zero_variance_text(snap)),
    ):
        if text:
            summary.add_row(label, text)
    starving = snap.trainer.get("starving")
    if starving and trainer_fresh(snap):
        summary.add_row("starving", str(starving))
    if snap.note:
        summary.add_row("note", snap.note)
    shown, hidden = fleet_rows(snap)
    title = "workers" if not hidden else f"{fleet_totals(snap)} (lost first, then the slowest)"
    workers = Table(title=title, expand=False, caption=f"... and {hidden} more" if hidden else None)
    for col in ("id", "status", "version", "heartbeat", "rollouts/s", "groups", "detail"):
        workers.add_column(col)
    for w in shown:
        status = w.status if w.age_s <= SILENT_AFTER_S or w.status == "stopped" else f"silent ({w.status})"
        workers.add_row(
            w.worker_id,
            status,
            "-" if w.version is None else str(w.version),
            f"{_age(w.age_s)} ago",
            f"{w.rollouts_per_s:.2f}",
            str(w.groups),
            w.detail[:40],
        )
    return Group(summary, workers)


def pass_ratio(before: dict | None, after: dict | None) -> float | None:
    """after pass@1 / before pass@1 (None when either is missing or before is 0)."""
    if not before or not after or not before.get("pass@1"):
        return None
    return round(after["pass@1"] / before["pass@1"], 3)


def before_after_table(before: dict | None, after: dict | None, env: str) -> Table:
    """The closing table: pass@1 (95% CI), search rate for tool envs, tasks, version — before and after."""
    from rich.table import Table

    def cell(r: dict | None, key: str) -> str:
        if r is None or r.get(key) is None:
            return "-"
        if key == "pass@1":
            return f"{r['pass@1']:.3f}  [{r.get('ci_low', 0):.3f}, {r.get('ci_high', 1):.3f}]"
        if key in ("version", "tasks"):
            return str(r[key])
        return f"{r[key]:.3f}"

    t = Table(title=f"held-out evaluation ({env}, one sample per task at the run's temperature)")
    t.add_column("")
    t.add_column("before")
    t.add_column("after")
    for label, key in (("version", "version"), ("tasks", "tasks"), ("pass@1 (95% CI)", "pass@1")):
        t.add_row(label, cell(before, key), cell(after, key))
    if (before and before.get("search_rate") is not None) or (after and after.get("search_rate") is not None):
        t.add_row("search rate", cell(before, "search_rate"), cell(after, "search_rate"))
    t.add_row("format rate", cell(before, "format_rate"), cell(after, "format_rate"))
    ratio = pass_ratio(before, after)
    if ratio is not None:
        t.add_row("after / before", "", f"{ratio:.2f}x")
    return t
