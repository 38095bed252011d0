"""The run's live view, read from the store alone: shared by `pnyx run` (local fleet) and `pnyx status`.

`RunWatcher(store)` reads what a run leaves in its store — run.json, the newest published weights
version, the trainer's per-version metrics (`pnyx.train.read_metrics`, read incrementally), the worker
heartbeats — plus held-out eval records, and condenses them into a `Snapshot`. `render(snapshot)` turns a
snapshot into a rich renderable; `plain_line(snapshot)` into one dense greppable line (for `--no-live`,
CI and logs).

Knows nothing about processes: an operator on a laptop sees exactly what the orchestrator sees, given the
store URL. Never writes to the store. A store that is missing pieces (a run still starting, a trainer
that has not stepped yet) gives a snapshot with those fields empty, never an exception.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pnyx.errors import NotFoundError, RecordRejected
from pnyx.eval.runner import read_eval_file
from pnyx.protocol import layout

# A worker whose heartbeat is older than this many heartbeat intervals shows as "silent".
SILENT_AFTER_S = 30.0
EVALS_FILE = "evals.jsonl"


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
    taken_at: float = 0.0
    note: str = ""

    @property
    def last(self) -> dict[str, Any]:
        return self.metrics[-1] if self.metrics else {}

    @property
    def rollouts_per_s(self) -> float:
        """Fleet throughput: the sum over workers whose heartbeat is fresh."""
        return sum(w.rollouts_per_s for w in self.workers if w.age_s <= SILENT_AFTER_S and w.status != "stopped")

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

    def __init__(self, store: Any, evals_path: str | Path | None = None):
        self.store = store
        local = getattr(store, "local_path", None)
        self.evals_path = Path(evals_path) if evals_path else (Path(local) / EVALS_FILE if local else None)
        self._metrics: list[dict[str, Any]] = []
        self._manifest: dict[str, Any] | None = None

    def _read_manifest(self) -> dict[str, Any] | None:
        if self._manifest is None:
            try:
                self._manifest = json.loads(self.store.get(layout.RUN_MANIFEST))
            except NotFoundError:
                return None
        return self._manifest

    def _read_metrics(self) -> None:
        from pnyx.train.checkpoint import read_metrics

        since = None
        if self._metrics and self._metrics[-1].get("version") is not None:
            since = int(self._metrics[-1]["version"])
        rows = read_metrics(self.store, since_version=since)
        seen = {r.get("version") for r in self._metrics}
        self._metrics.extend(r for r in rows if r.get("version") not in seen)
        self._metrics.sort(key=lambda r: (r.get("version") is None, r.get("version") or 0))

    def _read_workers(self, now: float) -> list[WorkerRow]:
        from pnyx.protocol import Heartbeat, decode_json

        rows = []
        for meta in self.store.list(layout.WORKERS_PREFIX):
            try:
                hb = decode_json(self.store.get(meta.key), Heartbeat)
            except (NotFoundError, RecordRejected):
                continue  # deleted or being replaced: the next refresh sees the new one
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
        from pnyx.weights import latest_version

        now = time.time()
        snap = Snapshot(store_url=self.store.url, taken_at=now)
        manifest = self._read_manifest()
        if manifest is None:
            snap.note = "waiting for the trainer to create the run (no run.json yet)"
            return snap
        cfg = manifest.get("config") or {}
        snap.run_id = manifest.get("run_id")
        snap.started_at = manifest.get("created_at")
        snap.env = (cfg.get("env") or {}).get("name")
        snap.model = (manifest.get("model") or {}).get("name") or (cfg.get("model") or {}).get("path")
        snap.version = latest_version(self.store)
        self._read_metrics()
        snap.metrics = list(self._metrics)
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
    workers = ",".join(
        f"{w.worker_id}:{w.status}@v{w.version if w.version is not None else '-'}({_age(w.age_s)})"
        for w in snap.workers
    )
    return (
        f"run={snap.run_id} t={_fmt(snap.elapsed_s, '.0f')}s v={snap.version if snap.version is not None else '-'} "
        f"rollouts/s={snap.rollouts_per_s:.2f} reward={_fmt(reward_of(last))} "
        f"pass@1=[{eval_history(snap, 4)}] stale={_fmt(staleness_of(last), '.2f')} "
        f"masked={_fmt(None if masked is None else 100 * masked, '.2f')}% workers={workers or '-'}"
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
    summary = Table(title=f"{title} — run {snap.run_id} ({snap.env}, {snap.model})", show_header=False, expand=False)
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
    drops = last.get("drops")
    if isinstance(drops, dict) and drops:
        summary.add_row("dropped groups", ", ".join(f"{k}:{v}" for k, v in sorted(drops.items()) if v) or "0")
    if snap.note:
        summary.add_row("note", snap.note)
    workers = Table(title="workers", expand=False)
    for col in ("id", "status", "version", "heartbeat", "rollouts/s", "groups", "detail"):
        workers.add_column(col)
    for w in sorted(snap.workers, key=lambda w: w.worker_id):
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
