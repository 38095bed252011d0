"""The run's live view, read from the store alone: shared by `pnyx run` (local fleet) and `pnyx status`.

`RunWatcher(store)` reads what a run leaves in its store — run.json, the newest weights version the
run's trainer key signed (`pnyx.weights.TrustedWeights`: manifests it did not sign, forged, unsigned or
junk, are ignored and listed in the view; an unsigned run's versions are shown unchecked, with a note),
the trainer's per-version metrics (`pnyx.train.read_metrics`, read incrementally), the trainer's
status (`trainer/status.json`: phase, backlog, drops), the worker heartbeats (read in parallel) — plus
held-out eval records, and condenses them into a `Snapshot`: among others the supply rate (groups uploaded
per second, from the heartbeats) against the consumption rate (groups trained per second, from the
metrics). `render(snapshot)` turns a snapshot into a rich renderable; `plain_line(snapshot)` into one dense
greppable line (for `--no-live`, CI and logs). A fleet larger than `FLEET_ROWS` workers is summarised:
totals by state, then the lost workers and the slowest ones, never one row per worker.

Knows nothing about processes: an operator on a laptop sees exactly what the orchestrator sees, given the
store URL. Never writes to the store. A store that is missing pieces (a run still starting, a trainer
that has not stepped yet) gives a snapshot with those fields empty, never an exception; a run.json whose
trainer key is not the one `trust` names is a ConfigError.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pnyx.errors import NotFoundError, RecordRejected
from pnyx.eval.runner import read_eval_file
from pnyx.protocol import layout
from pnyx.store import Store

if TYPE_CHECKING:
    from pnyx.weights.trusted import TrustedWeights

# A worker whose heartbeat is older than this many heartbeat intervals shows as "silent".
SILENT_AFTER_S = 30.0
EVALS_FILE = "evals.jsonl"
FLEET_ROWS = 12
"""Up to this many workers get one row each; a larger fleet is summarised (lost and slowest first)."""
READ_THREADS = 16
"""Heartbeats are read this many at a time (a fleet of hundreds is one GET each)."""
UNSIGNED_NOTE = "run.json names no trainer key: its weights are unsigned, versions are shown unchecked"


@dataclass
class WorkerRow:
    """One worker as its last heartbeat describes it."""

    worker_id: str
    status: str
    version: int | None
    digest: str | None
    age_s: float
    rollouts_per_s: float
    tokens_per_s: float
    groups: int
    detail: str = ""


@dataclass
class Snapshot:
    """Everything the live view shows, at one instant."""

    store_url: str
    run_id: str | None = None
    env: str | None = None
    model: str | None = None
    started_at: float | None = None
    version: int | None = None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    workers: list[WorkerRow] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    trainer: dict[str, Any] = field(default_factory=dict)
    """The trainer's `trainer/status.json` (phase, backlog, drops), {} if it has written none."""
    group_size: int | None = None
    ignored: dict[str, str] = field(default_factory=dict)
    """Manifest objects the trainer's key did not sign, never read (key -> why): forged, unsigned, junk."""
    taken_at: float = 0.0
    note: str = ""

    @property
    def last(self) -> dict[str, Any]:
        return self.metrics[-1] if self.metrics else {}

    @property
    def rollouts_per_s(self) -> float:
        """Fleet throughput: the sum over workers whose heartbeat is fresh."""
        return sum(
            w.rollouts_per_s for w in self.workers if w.age_s <= SILENT_AFTER_S and w.status != "stopped"
        )

    def live(self, w: WorkerRow) -> bool:
        return w.age_s <= SILENT_AFTER_S and w.status not in ("stopped", "error")

    def lost(self, w: WorkerRow) -> bool:
        """Silent without saying goodbye, or failed."""
        return w.status == "error" or (w.age_s > SILENT_AFTER_S and w.status != "stopped")

    @property
    def supply_groups_per_s(self) -> float | None:
        """Groups uploaded per second by the live workers (their rollouts/s over the run's group size)."""
        return self.rollouts_per_s / self.group_size if self.group_size else None

    @property
    def consumption_groups_per_s(self) -> float | None:
        """Groups trained per second over the last (up to) 10 steps."""
        rows = [m for m in self.metrics[-11:] if isinstance(m.get("time"), int | float) and m.get("groups")]
        if len(rows) < 2 or rows[-1]["time"] <= rows[0]["time"]:
            return None
        return sum(m["groups"] for m in rows[1:]) / (rows[-1]["time"] - rows[0]["time"])

    @property
    def elapsed_s(self) -> float | None:
        return None if self.started_at is None else max(0.0, self.taken_at - self.started_at)


def metric(row: dict[str, Any], *names: str) -> float | None:
    """The first of `names` present in a trainer metrics row, as a float (None if none is)."""
    for name in names:
        value = row.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return None


def reward_of(row: dict[str, Any]) -> float | None:
    return metric(row, "reward", "reward_mean")


def staleness_of(row: dict[str, Any]) -> float | None:
    return metric(row, "stale_mean", "stale", "staleness_mean")


def masked_of(row: dict[str, Any]) -> float | None:
    return metric(row, "masked", "masked_frac", "gate_masked_frac", "dppo_masked_frac")


class RunWatcher:
    """Reads a run's state from its store, incrementally (metrics are fetched once per version)."""

    def __init__(self, store: Store, evals_path: str | Path | None = None, trust: str | None = None):
        """`trust`: the fingerprint run.json's trainer key must have (ConfigError from `snapshot` if not)."""
        self.store = store
        self.trust = trust
        local = getattr(store, "local_path", None)
        self.evals_path = Path(evals_path) if evals_path else (Path(local) / EVALS_FILE if local else None)
        self._metrics: list[dict[str, Any]] = []
        self._weights: TrustedWeights | None = None

    def _open_run(self) -> TrustedWeights | None:
        """The run's trusted weights, once run.json exists (kept: run.json is written once)."""
        if self._weights is None:
            from pnyx.train.bootstrap import read_run
            from pnyx.weights.trusted import TrustedWeights

            run = read_run(self.store)
            if run is None:
                return None
            self._weights = TrustedWeights.for_run(self.store, run, self.trust, unsigned="unchecked")
        return self._weights

    def _read_metrics(self) -> None:
        from pnyx.train.checkpoint import read_metrics

        since = None
        if self._metrics and self._metrics[-1].get("version") is not None:
            since = int(self._metrics[-1]["version"])
        rows = read_metrics(self.store, since_version=since)
        seen = {r.get("version") for r in self._metrics}
        self._metrics.extend(r for r in rows if r.get("version") not in seen)
        self._metrics.sort(key=lambda r: (r.get("version") is None, r.get("version") or 0))

    def _read_status(self) -> dict[str, Any]:
        from pnyx.train.progress import STATUS_KEY

        try:
            status = json.loads(self.store.get(STATUS_KEY))
        except (NotFoundError, json.JSONDecodeError):
            return {}
        return status if isinstance(status, dict) else {}

    def _read_workers(self, now: float) -> list[WorkerRow]:
        from concurrent.futures import ThreadPoolExecutor

        from pnyx.protocol import Heartbeat, decode_json

        def read(key: str) -> Any:
            try:
                return decode_json(self.store.get(key), Heartbeat)
            except (NotFoundError, RecordRejected):
                return None  # deleted or being replaced: the next refresh sees the new one

        keys = [m.key for m in self.store.list(layout.WORKERS_PREFIX)]
        with ThreadPoolExecutor(min(READ_THREADS, max(1, len(keys)))) as pool:
            beats = list(pool.map(read, keys))
        rows = []
        for hb in beats:
            if hb is None:
                continue
            rows.append(
                WorkerRow(
                    worker_id=hb.worker_id,
                    status=hb.status,
                    version=hb.version if hb.version >= 0 else None,
                    digest=getattr(hb, "digest", None),
                    age_s=max(0.0, now - hb.updated_at),
                    rollouts_per_s=hb.rollouts_per_s,
                    tokens_per_s=hb.tokens_per_s,
                    groups=hb.groups,
                    detail=hb.detail or "",
                )
            )
        return rows

    def snapshot(self, evals: list[dict[str, Any]] | None = None) -> Snapshot:
        """The run's state now. `evals` overrides the eval records read from the run folder."""
        now = time.time()
        snap = Snapshot(store_url=self.store.url, taken_at=now)
        weights = self._open_run()
        if weights is None:
            snap.note = "waiting for the trainer to create the run (no run.json yet)"
            return snap
        run = weights.run
        cfg = run.config or {}
        snap.run_id = run.run_id
        snap.started_at = run.created_at
        snap.env = (cfg.get("env") or {}).get("name")
        snap.model = (run.model or {}).get("name") or (cfg.get("model") or {}).get("path")
        snap.group_size = (cfg.get("worker") or {}).get("group_size")
        snap.version = weights.latest()
        snap.ignored = weights.skipped
        if not weights.signed:
            snap.note = UNSIGNED_NOTE
        self._read_metrics()
        snap.metrics = list(self._metrics)
        snap.trainer = self._read_status()
        snap.workers = self._read_workers(now)
        if evals is not None:
            snap.evals = evals
        elif self.evals_path is not None and self.evals_path.is_file():
            snap.evals = read_eval_file(self.evals_path)
        else:
            snap.evals = self._read_store_evals()
        return snap

    def _read_store_evals(self) -> list[dict[str, Any]]:
        """Eval records published into the run (`evals/` prefix)."""
        rows = []
        for meta in self.store.list(layout.EVALS_PREFIX):
            try:
                rows.append(json.loads(self.store.get(meta.key)))
            except (NotFoundError, json.JSONDecodeError):
                continue
        return sorted(rows, key=lambda r: r.get("version", -1))


# --- rendering ---------------------------------------------------------------------------------------


def _fmt(x: float | None, spec: str = ".3f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def _age(s: float) -> str:
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m"


def backlog_text(snap: Snapshot) -> str:
    """`waiting 1200 · fetched 16 · dropped stale:40, zero_variance:3` from the trainer's newest report."""
    source = snap.trainer if snap.trainer.get("backlog") else snap.last
    b = source.get("backlog") or {}
    drops = source.get("drops") or snap.last.get("drops") or {}
    dropped = ", ".join(f"{k}:{v}" for k, v in sorted(drops.items()) if v) or "none"
    if not b:
        return f"dropped {dropped}"
    return f"waiting {b.get('waiting', 0)} · fetched {b.get('fetched', 0)} · dropped {dropped}"


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
    b = snap.trainer.get("backlog") or last.get("backlog") or {}
    return (
        f"run={snap.run_id} t={_fmt(snap.elapsed_s, '.0f')}s v={snap.version if snap.version is not None else '-'} "
        f"rollouts/s={snap.rollouts_per_s:.2f} reward={_fmt(reward_of(last))} "
        f"pass@1=[{eval_history(snap, 4)}] stale={_fmt(staleness_of(last), '.2f')} "
        f"masked={_fmt(None if masked is None else 100 * masked, '.2f')}% "
        f"supply={_fmt(snap.supply_groups_per_s, '.2f')}g/s consume={_fmt(snap.consumption_groups_per_s, '.2f')}g/s "
        f"backlog=waiting:{b.get('waiting', '-')},fetched:{b.get('fetched', '-')} "
        f"trainer={(snap.trainer.get('phase') or '-')} workers={workers or '-'}"
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


def render(snap: Snapshot, title: str = "pnyx") -> Any:
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
    quarantined = quarantine_text(snap)
    if quarantined:
        summary.add_row("quarantined", quarantined)
    ignored = ignored_text(snap)
    if ignored:
        summary.add_row("ignored weights", ignored)
    doing = trainer_text(snap)
    if doing:
        summary.add_row("trainer", doing)
    zero_variance = zero_variance_text(snap)
    if zero_variance:
        summary.add_row("warning", zero_variance)
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


def before_after_table(before: dict | None, after: dict | None, env: str) -> Any:
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
