"""`pnyx status --serve`: a small web page of one run that refreshes itself, served from this machine.

Two paths on one port, standard library only (`http.server`): `/` is the page (`pnyx/assets/live_page.html`:
plain JS drawing inline SVG, no external script or font, so it works with no network) and `/api/run` is
the run as JSON (`page_data`), which the page polls every ~2 s. Every number comes from one
`pnyx.cli.live.RunWatcher` (`snapshot()`): versions the run's trainer key signed, the trainer's metrics and
status, worker heartbeats, eval records. Nothing here reads the store another way, and nothing writes to it.

Binds 127.0.0.1 unless told otherwise; bound to loopback it answers only requests addressed to a loopback
name (a page on another site cannot read the run through DNS rebinding), and an SSH tunnel reaches it
from elsewhere (docs/live-page.md). A snapshot that fails (a store unreachable for a while) answers 503
with `{"error": ...}`: the page shows the error and keeps polling; the server keeps serving.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import socket
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any, cast

from pnyx.cli.live import RunWatcher, Snapshot, masked_of, reward_of, staleness_of
from pnyx.cli.live_view import (
    fleet_rows,
    fleet_totals,
    ignored_text,
    ignored_versions,
    trainer_fresh,
    trainer_text,
    zero_variance_text,
)
from pnyx.errors import PnyxError

log = logging.getLogger("pnyx.web")

API_PATH = "/api/run"
PAGE_ASSET = "live_page.html"
CURVE_POINTS = 1000
"""At most this many per-version points go to the page (a long run is thinned evenly, the newest kept)."""
SHARE_S = 1.0
"""A snapshot at most this old answers every poller (several open tabs cost the store one read)."""
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def _num(x: Any, digits: int = 6) -> float | None:
    """A JSON-safe number: None for missing, booleans and non-finite values (JSON has no NaN)."""
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
        return None
    return round(float(x), digits)


def _int(x: Any) -> int | None:
    """An int as itself; None for anything else (a bool, a float, NaN or infinity, text, a list)."""
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _thin(rows: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """Every k-th row so at most `limit` remain, always including the newest."""
    if len(rows) <= limit:
        return rows
    step = math.ceil(len(rows) / limit)
    kept = rows[::step]
    return kept if kept[-1] is rows[-1] else [*kept, rows[-1]]


def _drops(snap: Snapshot) -> dict[str, int]:
    """Groups the trainer dropped, by reason, from its newest report (status.json, else the last metrics)."""
    drops = snap.reported("drops") or {}
    if not isinstance(drops, dict):
        return {}
    counts = {str(k): _num(v, 0) for k, v in sorted(drops.items())}
    return {k: int(v) for k, v in counts.items() if v}  # NaN and infinity (no count) are left out


def _quarantined(snap: Snapshot) -> list[dict[str, Any]]:
    """Keys under quarantine: fingerprint, the worker names that signed with it, and why."""
    q = snap.reported("quarantined") or {}
    if not isinstance(q, dict):
        return []
    keys = snap.trainer.get("keys")
    keys = keys if isinstance(keys, dict) else {}

    def names(fp: Any) -> list[str]:
        entry = keys.get(fp)
        found = entry.get("names") if isinstance(entry, dict) else None
        return [n for n in found if isinstance(n, str)] if isinstance(found, list) else []

    return [{"key": str(fp), "names": names(fp), "why": str(why)} for fp, why in sorted(q.items())]


def _engines(snap: Snapshot) -> dict[str, float | None]:
    """The engines that generated the newest step's groups and their mean logprob gap to the trainer."""
    gaps = snap.last.get("lp_gap_engine") or {}
    return {str(k): _num(v) for k, v in sorted(gaps.items())} if isinstance(gaps, dict) else {}


def page_data(snap: Snapshot) -> dict[str, Any]:
    """What the page shows, as plain JSON: the run, its curve (reward per version, held-out pass@1 per
    evaluated version), the fleet, drops by reason, quarantined keys, ignored manifests, notes."""
    last = snap.last
    gaps = last.get("lp_gap") if isinstance(last.get("lp_gap"), dict) else {}
    shown, hidden = fleet_rows(snap)
    workers = [
        {
            "id": w.worker_id,
            "state": "live" if snap.live(w) else "lost" if snap.lost(w) else "stopped",
            "status": w.status,
            "engine": w.engine,
            "version": w.version,
            "digest": (w.digest or "")[:12],
            "age_s": _num(w.age_s, 1),
            "rollouts_per_s": _num(w.rollouts_per_s, 3),
            "tokens_per_s": _num(w.tokens_per_s, 1),
            "groups": w.groups,
            "lp_gap": _num((gaps or {}).get(w.worker_id)),
            "detail": w.detail,
        }
        for w in shown
    ]
    versions = [
        {"version": int(m["version"]), "reward": _num(reward_of(m))}
        for m in snap.metrics
        if isinstance(m.get("version"), int)
    ]
    evals = [
        {
            "version": e.get("version"),
            "pass@1": _num(e.get("pass@1")),
            "ci_low": _num(e.get("ci_low")),
            "ci_high": _num(e.get("ci_high")),
            "tasks": _int(e.get("tasks")),  # eval records are unsigned: NaN here must not break the page
        }
        for e in snap.evals
        if _int(e.get("version")) is not None
    ]
    backlog = snap.trainer.get("backlog") or last.get("backlog") or {}
    masked = masked_of(last)
    return {
        "taken_at": _num(snap.taken_at, 3),
        "store": snap.store_url,
        "run_id": snap.run_id,
        "env": snap.env,
        "model": snap.model,
        "version": snap.version,
        "elapsed_s": _num(snap.elapsed_s, 1),
        "note": snap.note,
        "summary": {
            "rollouts_per_s": _num(snap.rollouts_per_s, 3),
            "reward": _num(reward_of(last)),
            "stale": _num(staleness_of(last), 3),
            "masked_pct": None if masked is None else _num(100 * masked, 3),
            "supply_groups_per_s": _num(snap.supply_groups_per_s, 3),
            "consumption_groups_per_s": _num(snap.consumption_groups_per_s, 3),
        },
        "curve": {"versions": _thin(versions, CURVE_POINTS), "evals": evals},
        "fleet": {
            "totals": fleet_totals(snap),
            "workers": workers,
            "hidden": hidden,
            "engines": _engines(snap),
        },
        "trainer": {
            "phase": trainer_text(snap),
            "starving": starving
            if isinstance(starving := snap.trainer.get("starving"), bool) and trainer_fresh(snap)
            else None,
            "backlog": {str(k): v for k, v in backlog.items() if _int(v) is not None}
            if isinstance(backlog, dict)
            else {},
        },
        "drops": _drops(snap),
        "quarantined": _quarantined(snap),
        "ignored": {"text": ignored_text(snap), "versions": ignored_versions(snap)},
        "warning": zero_variance_text(snap),
    }


class SnapshotSource:
    """The one watcher behind the server (it reads incrementally, so it is not shared without a lock); a
    snapshot younger than `share_s` answers every request that comes in meanwhile."""

    def __init__(self, watcher: RunWatcher, share_s: float = SHARE_S):
        self.watcher = watcher
        self.share_s = share_s
        self._lock = threading.Lock()
        self._body: bytes | None = None
        self._at = -math.inf

    def answer(self) -> tuple[int, bytes]:
        """(HTTP status, JSON body): the run's data, or 503/500 and `{"error": ...}` when reading it failed."""
        with self._lock:
            now = time.monotonic()
            if self._body is not None and now - self._at < self.share_s:
                return HTTPStatus.OK, self._body
            try:
                body = json.dumps(page_data(self.watcher.snapshot()), allow_nan=False).encode()
            except PnyxError as e:  # the store unreachable, or a run.json naming another key than --trust
                return HTTPStatus.SERVICE_UNAVAILABLE, _error(f"cannot read the run: {e}")
            except Exception as e:  # a bug in this module must show on the page, not end the server
                log.exception("web: building the run's data failed")
                return HTTPStatus.INTERNAL_SERVER_ERROR, _error(f"{type(e).__name__}: {e}")
            self._body, self._at = body, now
            return HTTPStatus.OK, body


def _error(message: str) -> bytes:
    return json.dumps({"error": message, "taken_at": time.time()}).encode()


def page_html() -> bytes:
    """The page (a package asset: HTML, CSS and JS in one file)."""
    return (resources.files("pnyx") / "assets" / PAGE_ASSET).read_bytes()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _host_name(header: str) -> str:
    """The name part of a Host header: `localhost:8765` -> localhost, `[::1]:8765` -> ::1."""
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class RunServer(ThreadingHTTPServer):
    """The HTTP server: the page, the JSON of `source`, 404 for anything else. Binds at construction
    (OSError if the port is taken); `port` 0 picks a free one (`url` says which). A host with a ':' is an
    IPv6 address (`::1`, `[::1]`, `::`) and is bound over IPv6."""

    daemon_threads = True  # a browser's open connection never holds up Ctrl-C

    def __init__(self, source: SnapshotSource, host: str, port: int):
        self.source = source
        self.page = page_html()
        self.loopback_only = _is_loopback(host)
        if ":" in host:  # the base class binds IPv4 only
            self.address_family = socket.AF_INET6
            host = host.strip("[]")
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        shown = f"[{host}]" if ":" in str(host) else str(host)
        return f"http://{shown}:{port}/"


class _Handler(BaseHTTPRequestHandler):
    server_version = "pnyx"

    @property
    def run(self) -> RunServer:
        return cast(RunServer, self.server)

    def do_GET(self) -> None:
        if self.run.loopback_only and _host_name(self.headers.get("Host", "")) not in LOOPBACK_NAMES:
            self._send(HTTPStatus.FORBIDDEN, b"loopback only: open http://127.0.0.1:<port>/\n", "text/plain")
            return
        path = self.path.split("?", 1)[0]
        if path in ("/", "/index.html"):
            self._send(HTTPStatus.OK, self.run.page, "text/html; charset=utf-8")
        elif path == API_PATH:
            status, body = self.run.source.answer()
            self._send(status, body, "application/json")
        else:
            self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")

    def _send(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        log.debug("web: %s " + format, self.address_string(), *args)


def serve_run(server: RunServer) -> None:
    """Serve until Ctrl-C. Prints the URL first (flushed: a script reading this process's output learns
    the port `--port 0` picked)."""
    try:
        print(
            f"pnyx status: serving {server.source.watcher.store.url} at {server.url} (Ctrl-C to stop)",
            flush=True,
        )
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
