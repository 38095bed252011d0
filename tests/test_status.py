"""`pnyx status` and the live view read a run's state from the store alone: versions, trainer metrics,
worker heartbeats (silent ones flagged), eval records; a run that is still starting is not an error."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from pnyx.cli.live import FLEET_ROWS, SILENT_AFTER_S, RunWatcher
from pnyx.cli.live_view import plain_line, render
from pnyx.protocol import Heartbeat, RunManifest, encode_json, layout
from pnyx.store import open_store


def _tiny_state():
    import torch

    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(8, 8, generator=g).to(torch.bfloat16)}


def make_run(url: str, versions: int = 2, heartbeats: dict[str, float] | None = None):
    """A run as the trainer and workers leave it: run.json, published versions, metrics, heartbeats."""
    from pnyx.train.checkpoint import write_metrics
    from pnyx.weights import Publisher

    store = open_store(url)
    manifest = RunManifest(
        run_id="demo",
        created_at=time.time() - 100,
        config={"env": {"name": "arith"}, "worker": {"group_size": 4}},
        model={"name": "tiny-base"},
    )
    store.put(layout.RUN_MANIFEST, encode_json(manifest), mode="create")
    pub = Publisher(store, anchor_every=20)
    state = _tiny_state()
    for v in range(versions):
        pub.publish(v, {k: (t.float() + v).to(t.dtype) for k, t in state.items()})
        if v > 0:
            write_metrics(store, v, {"version": v, "reward": 0.25 * v, "stale": 0.5, "masked": 0.003})
    for wid, age in (heartbeats or {}).items():
        hb = Heartbeat(
            worker_id=wid,
            version=versions - 1,
            updated_at=time.time() - age,
            groups=7,
            rollouts=56,
            rollouts_per_s=2.5,
            tokens_per_s=90.0,
            status="running",
        )
        store.put(layout.worker_heartbeat(wid), encode_json(hb))
    return store


def test_snapshot_reads_version_metrics_workers_and_evals(tmp_path):
    store = make_run(str(tmp_path / "run"), versions=3, heartbeats={"w1": 1.0})
    (tmp_path / "run" / "evals.jsonl").write_text(json.dumps({"version": 0, "pass@1": 0.3}) + "\n")
    snap = RunWatcher(store).snapshot()
    assert snap.run_id == "demo" and snap.env == "arith" and snap.version == 2
    assert [m["version"] for m in snap.metrics] == [1, 2]
    assert [w.worker_id for w in snap.workers] == ["w1"] and snap.workers[0].version == 2
    assert snap.rollouts_per_s == pytest.approx(2.5)
    assert snap.evals == [{"version": 0, "pass@1": 0.3}]
    line = plain_line(snap)
    assert "v=2" in line and "reward=0.500" in line and "w1:running@v2" in line and "v0 0.30" in line


def test_snapshot_reads_new_metrics_incrementally(tmp_path):
    from pnyx.train.checkpoint import write_metrics

    store = make_run(str(tmp_path / "run"), versions=2)
    watcher = RunWatcher(store)
    assert [m["version"] for m in watcher.snapshot().metrics] == [1]
    write_metrics(store, 2, {"version": 2, "reward": 0.9})
    assert [m["reward"] for m in watcher.snapshot().metrics] == [0.25, 0.9]


def test_silent_worker_is_flagged_and_left_out_of_throughput(tmp_path):
    from rich.console import Console

    store = make_run(str(tmp_path / "run"), heartbeats={"fresh": 1.0, "gone": SILENT_AFTER_S + 60})
    snap = RunWatcher(store).snapshot()
    assert snap.rollouts_per_s == pytest.approx(2.5)  # only the fresh worker counts
    console = Console(width=160, record=True)
    console.print(render(snap))
    text = console.export_text()
    assert "silent (running)" in text and "gone" in text and "fresh" in text


def test_a_run_that_has_not_started_is_a_note_not_an_error(tmp_path):
    snap = RunWatcher(open_store(tmp_path / "empty")).snapshot()
    assert snap.run_id is None and "run.json" in snap.note
    assert "no run.json" in plain_line(snap)


@pytest.mark.s3
def test_snapshot_works_on_a_remote_store(s3_url):
    make_run(s3_url, versions=2, heartbeats={"remote-1": 2.0})
    snap = RunWatcher(open_store(s3_url)).snapshot()
    assert snap.version == 1 and [w.worker_id for w in snap.workers] == ["remote-1"]


def test_status_command_prints_the_run(tmp_path):
    make_run(str(tmp_path / "run"), versions=2, heartbeats={"w7": 3.0})
    out = subprocess.run(
        [sys.executable, "-m", "pnyx", "status", "--store", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**_env(), "COLUMNS": "200"},
    )
    assert out.returncode == 0, out.stderr
    assert "demo" in out.stdout and "w7" in out.stdout and "running" in out.stdout


def test_status_command_on_a_missing_run_exits_cleanly(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pnyx", "status", "--store", str(tmp_path / "nothing")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**_env(), "COLUMNS": "200"},
    )
    assert out.returncode == 0, out.stderr
    assert "no run.json" in out.stdout


def _env():
    import os

    return dict(os.environ)


def _heartbeat(store, wid: str, age_s: float, rollouts_per_s: float, status: str = "generating") -> None:
    hb = Heartbeat(
        worker_id=wid,
        version=3,
        updated_at=time.time() - age_s,
        groups=10,
        rollouts=80,
        rollouts_per_s=rollouts_per_s,
        tokens_per_s=50.0,
        status=status,
    )
    store.put(layout.worker_heartbeat(wid), encode_json(hb))


def test_a_fleet_of_hundreds_of_workers_is_summarised_lost_and_slowest_first(tmp_path):
    from rich.console import Console

    store = make_run(str(tmp_path / "run"))
    for i in range(290):
        _heartbeat(store, f"w{i:03d}", age_s=2.0, rollouts_per_s=1.0 + i / 100)
    for i in range(7):
        _heartbeat(store, f"gone{i}", age_s=600.0 + i, rollouts_per_s=3.0)
    _heartbeat(store, "crashed", age_s=1.0, rollouts_per_s=0.0, status="error")
    _heartbeat(store, "done1", age_s=900.0, rollouts_per_s=0.0, status="stopped")
    _heartbeat(store, "done2", age_s=900.0, rollouts_per_s=0.0, status="stopped")
    snap = RunWatcher(store).snapshot()
    assert len(snap.workers) == 300
    console = Console(width=200, record=True)
    console.print(render(snap))
    text = console.export_text()
    assert "300 workers: 290 live, 8 lost, 2 stopped" in text
    rows = [
        line
        for line in text.splitlines()
        if line.strip().startswith(("│ w", "│ gone", "│ crashed", "│ done"))
    ]
    assert len(rows) <= FLEET_ROWS  # not one row per worker
    shown = [line.split("│")[1].strip() for line in rows]
    assert shown[:8] == [f"gone{i}" for i in range(6, -1, -1)] + [
        "crashed"
    ]  # the lost first, longest silent first
    assert shown[8:] == ["w000", "w001", "w002", "w003"]  # then the slowest live workers
    assert "and 288 more" in text
    line = plain_line(snap)
    assert "300 workers: 290 live, 8 lost, 2 stopped" in line and "w289" not in line


def test_backlog_and_supply_against_consumption_are_shown(tmp_path):
    from rich.console import Console

    from pnyx.train.checkpoint import write_metrics
    from pnyx.train.progress import STATUS_KEY

    store = make_run(str(tmp_path / "run"), versions=1)
    t0 = time.time() - 20
    for v in range(1, 6):  # 8 groups every 4 s: 2 groups/s consumed
        write_metrics(store, v, {"version": v, "time": t0 + 4 * v, "groups": 8, "reward": 0.5})
    for wid in ("a", "b"):
        _heartbeat(
            store, wid, age_s=1.0, rollouts_per_s=10.0
        )  # 2 x 10 rollouts/s / group size 4 = 5 groups/s
    status = {
        "phase": "waiting",
        "phase_s": 12.0,
        "have": 3,
        "need": 8,
        "updated_at": time.time(),
        "backlog": {"waiting": 1200, "fetched": 16},
        "drops": {"stale": 40, "zero_variance": 3},
        "zero_variance": {"frac": 0.87, "kind": "hard"},
    }
    store.put(STATUS_KEY, json.dumps(status).encode())
    snap = RunWatcher(store).snapshot()
    assert snap.supply_groups_per_s == pytest.approx(5.0)
    assert snap.consumption_groups_per_s == pytest.approx(2.0)
    console = Console(width=250, record=True)
    console.print(render(snap))
    text = console.export_text()
    assert "waiting 1200 · fetched 16 · dropped stale:40, zero_variance:3" in text
    assert "supply 5.00 groups/s vs consumption 2.00 groups/s" in text
    assert "waiting 12s (usable 3/8)" in text
    assert "87% of groups had the same reward for every sample" in text and "too hard" in text
    line = plain_line(snap)
    assert "supply=5.00g/s consume=2.00g/s backlog=waiting:1200,fetched:16 trainer=waiting" in line
    # under committed draws the trainer also reports the fetched groups its hold-back passes over
    status["backlog"]["held"] = 3
    store.put(STATUS_KEY, json.dumps(status).encode())
    snap = RunWatcher(store).snapshot()
    assert "backlog=waiting:1200,fetched:16,held:3 trainer=waiting" in plain_line(snap)
    console = Console(width=250, record=True)
    console.print(render(snap))
    assert "waiting 1200 · fetched 16 (3 held back) · dropped" in console.export_text()


def test_a_starving_trainer_says_why_in_its_status_pnyx_status_and_the_live_line(tmp_path):
    """The trainer's progress thread writes `starving` (which key, which check, what to do) into
    trainer/status.json once it has waited 30 s; `pnyx status` and `pnyx run`'s plain line show it."""
    from pnyx.train.progress import Progress

    url = str(tmp_path / "run")
    make_run(url, versions=2, heartbeats={"local-1": 3.0})
    store = open_store(url)
    fp = "443f13e36273ec6ac6f13b4faff0b2be"
    why = "implausible sampling over 32 groups (key z -5.6: mean z -0.99 where honest groups show +0.00)"
    progress = Progress(
        store,
        lambda: {
            "version": 8, "need": 4, "have": 0, "quarantined": {fp: why},
            "keys": {fp: {"names": ["local-1"], "quarantined": why}}, "backlog": {"waiting": 5},
        },
    )  # fmt: skip
    progress.phase("waiting", have=0)
    progress.phase_since = time.monotonic() - 45.0  # as if it had waited 45 s
    progress.write_status()
    status = json.loads(store.get("trainer/status.json"))
    assert fp in status["starving"] and "key z -5.6" in status["starving"]
    assert "security.trusted_keys" in status["starving"]
    line = plain_line(RunWatcher(store).snapshot())
    assert "starving: no full batch for 45s (usable 0/4)" in line and fp in line
    out = subprocess.run(
        [sys.executable, "-m", "pnyx", "status", "--store", url],
        capture_output=True, text=True, timeout=60, env={**_env(), "COLUMNS": "400"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "starving" in out.stdout and "local-1" in out.stdout and "trusted_keys" in out.stdout
