"""`pnyx status --serve`: the live web page of a run shows the run's own numbers, read by `RunWatcher`.

The run is real and small: the arena's trainer (`pnyx_harness.arena.Arena`, in this process) trains three
signed versions on honest groups, its metrics and status are written as the trainer loop writes them,
held-out pass@1 is measured at v0 and v3 and appended to `evals.jsonl` as `pnyx run` does, and one worker
heartbeat sits in the store as a worker's courier writes it. The JSON endpoint is checked against what
the store holds; a real headless Chromium (Debian's `chromium`; skipped when absent) loads the page
from a real `pnyx status --serve` process and must show those numbers, which only the page's JS puts in
the DOM. Liveness bounds only, no speed assertions.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_status import make_run

from pnyx.cli.live import RunWatcher
from pnyx.cli.web import API_PATH, RunServer, SnapshotSource, page_data
from pnyx.protocol import Heartbeat, encode_json, layout
from pnyx.store import open_store

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = next((p for n in ("chromium", "chromium-browser") if (p := shutil.which(n))), None)
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium binary on PATH (CI installs Debian's: apt-get install chromium)"
)
STARTUP_S = 30.0
"""Liveness bound for `pnyx status --serve` to print its URL (a loaded 2-core machine)."""


def _eval_record(arena: Any, version: int) -> dict[str, Any]:
    return {**arena.evaluate(tasks=20, seed=0).to_dict(), "version": version}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Iterator[dict[str, Any]]:
    """A real run folder with 3 trained versions, 2 eval records and one worker heartbeat, plus what the
    page must show of it."""
    from pnyx.train.checkpoint import write_metrics
    from pnyx_harness.arena import Arena
    from pnyx_harness.producer import HonestWorker

    # the page is what is tested, not standing: the worker's first groups count (security.standing_groups)
    arena = Arena(
        tmp_path_factory.mktemp("web"),
        {"trainer": {"groups_per_step": 4}, "security": {"standing_groups": 0}},
    )
    try:
        folder = Path(arena.store.local_path or "")
        evals = [_eval_record(arena, 0)]
        worker = HonestWorker("honest-1")
        for _ in range(3):
            arena.upload(worker.produce(arena, 5))
            result = arena.step()
            assert result is not None, "the arena's trainer could not fill a batch"
            write_metrics(arena.store, result.version, arena.trainer.metrics(result))  # as Trainer.run does
        arena.trainer.progress.write_status()
        evals.append(_eval_record(arena, arena.trainer.version))
        (folder / "evals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
        hb = Heartbeat(
            worker_id="honest-1",
            version=arena.version,
            digest=arena.digest,
            updated_at=time.time() + 3600,
            groups=15,
            rollouts=120,
            rollouts_per_s=2.5,
            tokens_per_s=90.0,
            status="generating",
            engine="mlx",
        )  # fmt: skip  (an hour ahead: still fresh when the browser test runs)
        arena.store.put(layout.worker_heartbeat("honest-1"), encode_json(hb))
        yield {
            "url": str(folder),
            "folder": folder,
            "run_id": arena.run_id,
            "version": arena.trainer.version,
            "evals": [(r["version"], r["pass@1"]) for r in evals],
        }
    finally:
        arena.close()


def _serve(store_url: str, share_s: float = 0.0) -> RunServer:
    server = RunServer(SnapshotSource(RunWatcher(open_store(store_url)), share_s=share_s), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    return server


def _get(url: str, host: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_json_endpoint_returns_the_runs_numbers(run):
    from pnyx.train.checkpoint import read_metrics

    server = _serve(run["url"])
    try:
        status, body = _get(server.url.rstrip("/") + API_PATH)
    finally:
        server.shutdown()
        server.server_close()
    assert status == 200
    d = json.loads(body)
    assert d["run_id"] == run["run_id"] and d["version"] == run["version"] == 3
    rewards = {m["version"]: m["reward"] for m in read_metrics(open_store(run["url"]))}
    assert {p["version"]: p["reward"] for p in d["curve"]["versions"]} == pytest.approx(rewards)
    assert [(e["version"], e["pass@1"]) for e in d["curve"]["evals"]] == run["evals"]
    [w] = d["fleet"]["workers"]
    assert (w["id"], w["state"], w["version"], w["groups"]) == ("honest-1", "live", 3, 15)
    assert w["engine"] == "mlx"  # what the worker's heartbeat says it generates with
    assert w["lp_gap"] is not None  # the trainer's measured gap for this worker's groups, joined by name
    assert list(d["fleet"]["engines"]) == ["torch"]
    assert d["summary"]["supply_groups_per_s"] == pytest.approx(2.5 / 8, abs=1e-3)  # arena group_size 8
    assert d["drops"] == {} and d["quarantined"] == []  # honest groups only


def test_quarantined_keys_and_drops_by_reason_reach_the_page(tmp_path):
    from pnyx.train.progress import STATUS_KEY

    store = make_run(str(tmp_path / "run"), versions=2)
    fp = "443f13e36273ec6ac6f13b4faff0b2be"
    status = {
        "updated_at": time.time(),
        "drops": {"stale": 40, "implausible": 5, "zero_variance": 0},
        "quarantined": {fp: "5 of 9 groups faulty (implausible 5)"},
        "keys": {fp: {"names": ["liar-1", "liar-2"]}},
    }
    store.put(STATUS_KEY, json.dumps(status).encode())
    d = page_data(RunWatcher(store).snapshot())
    assert d["drops"] == {"implausible": 5, "stale": 40}
    assert d["quarantined"] == [
        {"key": fp, "names": ["liar-1", "liar-2"], "why": "5 of 9 groups faulty (implausible 5)"}
    ]


def test_a_non_finite_metric_is_sent_as_null_not_as_invalid_json(tmp_path):
    from pnyx.train.checkpoint import write_metrics

    store = make_run(str(tmp_path / "run"), versions=2)
    write_metrics(store, 2, {"version": 2, "reward": float("nan")})
    status, body = SnapshotSource(RunWatcher(store)).answer()
    assert status == 200
    assert [p["reward"] for p in json.loads(body)["curve"]["versions"]] == [0.25, None]


def test_non_finite_or_non_integer_counts_from_unsigned_records_are_dropped_not_a_500(tmp_path):
    """Eval records and the trainer's status are read as JSON, which Python lets hold NaN and Infinity."""
    from pnyx.train.progress import STATUS_KEY

    store = make_run(str(tmp_path / "run"), versions=2)
    (tmp_path / "run" / "evals.jsonl").write_text(
        '{"version": 0, "pass@1": 0.5, "tasks": NaN}\n'
        '{"version": 1, "pass@1": 0.6, "tasks": Infinity}\n'
        '{"version": 1, "pass@1": 0.7, "tasks": "20"}\n'
        '{"version": 1, "pass@1": 0.8, "tasks": 20}\n'
    )
    nan, inf = float("nan"), float("inf")
    status = {
        "updated_at": time.time(),
        "starving": nan,
        "backlog": {"queued": inf, "ready": 2},
        "drops": {"stale": inf, "junk": nan, "implausible": 3},
        "quarantined": {"fp": "faulty"},
        "keys": {"fp": {"names": ["liar-1", nan]}},
    }
    store.put(STATUS_KEY, json.dumps(status).encode())  # NaN and Infinity, as Python's json writes them
    code, body = SnapshotSource(RunWatcher(store)).answer()
    assert code == 200, body
    d = json.loads(body)
    assert [e["tasks"] for e in d["curve"]["evals"]] == [None, None, None, 20]
    assert d["drops"] == {"implausible": 3}
    assert d["trainer"]["starving"] is None and d["trainer"]["backlog"] == {"ready": 2}
    assert d["quarantined"] == [{"key": "fp", "names": ["liar-1"], "why": "faulty"}]


def _has_ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
def test_host_ipv6_loopback_binds_and_serves(tmp_path):
    make_run(str(tmp_path / "run"), versions=1)
    server = RunServer(SnapshotSource(RunWatcher(open_store(str(tmp_path / "run")))), "::1", 0)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    try:
        assert server.url.startswith("http://[::1]:")
        status, body = _get(server.url.rstrip("/") + API_PATH)
        assert status == 200 and json.loads(body)["run_id"] == "demo"
    finally:
        server.shutdown()
        server.server_close()


def test_a_failing_store_answers_an_error_and_the_next_poll_recovers(tmp_path):
    from pnyx.store.retry import RetryPolicy
    from pnyx_harness.faults import FaultyStore

    make_run(str(tmp_path / "run"), versions=2)
    store = FaultyStore(open_store(str(tmp_path / "run")), RetryPolicy(deadline_s=0.2, base_s=0.01))
    source = SnapshotSource(RunWatcher(store), share_s=0.0)
    store.fail_when(lambda op, key: op == "list")
    status, body = source.answer()
    assert status == 503 and "cannot read the run" in json.loads(body)["error"]
    store.clear()
    status, body = source.answer()
    assert status == 200 and json.loads(body)["version"] == 1


def test_bound_to_loopback_it_refuses_requests_for_other_host_names(tmp_path):

    make_run(str(tmp_path / "run"), versions=1)
    server = _serve(str(tmp_path / "run"))
    port = server.server_address[1]
    try:
        assert _get(server.url, host=f"attacker.example:{port}")[0] == 403  # DNS rebinding
        assert _get(server.url, host=f"localhost:{port + 1}")[0] == 200  # an SSH tunnel's local port
        assert _get(server.url + "nothing")[0] == 404
    finally:
        server.shutdown()
        server.server_close()


def test_a_taken_port_is_a_clear_error(tmp_path):
    import typer

    from pnyx.cli.status import status_main

    make_run(str(tmp_path / "run"), versions=1)
    server = _serve(str(tmp_path / "run"))
    try:
        with pytest.raises(typer.Exit) as exc:
            status_main(str(tmp_path / "run"), watch=False, serve=True, port=server.server_address[1])
        assert exc.value.exit_code == 2
    finally:
        server.shutdown()
        server.server_close()


# --- the page in a real browser -------------------------------------------------------------------------


def _start_serving(store: str, *extra: str) -> tuple[subprocess.Popen[str], str]:
    """`pnyx status --store URL --serve --port 0` as a real process; returns it and the URL it printed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pnyx", "status", "--store", store, "--serve", "--port", "0", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        # Ctrl-C as an operator's terminal delivers it, even when this suite runs as a background job (whose
        # children inherit SIGINT ignored, and Python then never turns it into KeyboardInterrupt)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline() if proc.stdout else ""))
    reader.start()
    reader.join(STARTUP_S)
    line = lines[0] if lines else ""
    if "http://" not in line:
        proc.kill()
        _, err = proc.communicate(timeout=10)
        pytest.fail(f"pnyx status --serve printed no URL within {STARTUP_S:.0f} s: {line!r} {err[-2000:]}")
    return proc, line.split(" at ", 1)[1].split()[0]


def _stop(proc: subprocess.Popen[str]) -> int:
    """Ctrl-C, as an operator would; the exit status (killed after 10 s: a hang is a failure)."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
        return -999


def _chromium(url: str, *args: str) -> str:
    out = subprocess.run(
        [CHROMIUM or "chromium", "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
         *args, url],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@needs_chromium
def test_headless_chromium_renders_the_runs_numbers(run, tmp_path):
    proc, url = _start_serving(run["url"])
    try:
        dom = _chromium(url, "--dump-dom")
        shot = tmp_path / "page.png"
        _chromium(url, f"--screenshot={shot}", "--window-size=1280,1000")
    finally:
        code = _stop(proc)
    assert f'id="version">v{run["version"]}<' in dom  # the HTML says "-" until the JS renders a snapshot
    assert f'id="run-id">{run["run_id"]}<' in dom
    assert "<td>honest-1</td>" in dom and "<td>generating</td>" in dom and "<td>mlx</td>" in dom
    final_version, final_pass = run["evals"][-1]
    assert f'id="pass1">{final_pass:.3f}<' in dom
    assert all(f"<td>v{v}</td><td>{p:.3f}</td>" in dom for v, p in run["evals"])  # the evals table
    assert dom.count("<polyline") == 2  # the reward curve and the pass@1 curve were drawn
    assert 'id="error" class="error" hidden=""' in dom
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert code == 0, "Ctrl-C did not stop the server cleanly"


@needs_chromium
def test_the_page_shows_a_failing_snapshot_and_the_server_keeps_serving(run, tmp_path):
    """run.json appears naming another trainer key than --trust: every snapshot fails; the page says so."""
    folder = tmp_path / "other"
    folder.mkdir()
    proc, url = _start_serving(str(folder), "--trust", "0" * 32)
    try:
        shutil.copy(run["folder"] / layout.RUN_MANIFEST, folder / layout.RUN_MANIFEST)
        dom = _chromium(url, "--dump-dom")
        assert proc.poll() is None, "the server died on a failing snapshot"
        status, _ = _get(url)
    finally:
        code = _stop(proc)
    assert 'id="error" class="error">cannot read the run:' in dom and "still polling" in dom
    assert status == 200 and code == 0
