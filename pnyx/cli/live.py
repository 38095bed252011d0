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
    engine: str = ""
    """The engine the worker reports ("" from a worker older than the field)."""


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

    def reported(self, name: str) -> Any:
        """The trainer's newest report of `name` (`drops`, `quarantined`): its status.json, else the last
        step's metrics, else None."""
        return self.trainer.get(name) or self.last.get(name)

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
            from pnyx.protocol.runfile import read_run
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

        def read(key: str) -> Heartbeat | None:
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
                    engine=hb.engine,
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
