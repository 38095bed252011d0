"""A fault-injecting HTTP proxy in front of an S3 API endpoint, for chaos tests and benchmarks.

Point a store URL's `endpoint=` at the proxy and every request of every process goes through it:

    proxy = FaultProxy("http://127.0.0.1:5000", Faults(error_rate=0.05, reset_rate=0.02,
                       lost_reply_rate=0.02, latency_s=(0.0, 0.05)))
    proxy.start()
    url = f"s3://bucket/run?endpoint={proxy.url}&region=us-east-1"
    proxy.faults = Faults(down=True)     # the store is unreachable (every connection reset) ...
    proxy.faults = Faults()              # ... and back
    proxy.inject("lost_reply", methods={"PUT"})   # exactly the next PUT: forwarded, its reply lost
    proxy.counts["PUT"], proxy.counts["fault:lost_reply"]
    proxy.stop()

Faults, drawn independently for each request (rates are probabilities; `methods` limits which HTTP
methods get error/reset/lost-reply faults, latency applies to every request):
- latency: sleep uniform(lo, hi) seconds first;
- down: reset the connection, every request (the store is unreachable);
- error: answer 503 with S3's `SlowDown` error, never forwarding (throttling);
- reset: reset the client connection (TCP RST) before forwarding: nothing reached the server;
- lost reply: forward the request, read the server's whole answer, then reset the client instead of
  answering: the write landed, the client cannot know (the case create-only retries must survive).

Counts (`counts`): requests by kind (LIST = a GET with `list-type`, GET, PUT, HEAD, DELETE, POST) and
faults by kind (`fault:<kind>`), so a benchmark can print store requests per consumed group.

Pure Python (`http.server` threads + `http.client`), no dependency; signatures pass through untouched
(the Host header is forwarded as the client sent it). Knows nothing about pnyx keys. Also a command:
`python -m pnyx_harness.proxy --upstream http://127.0.0.1:5000 --error-rate 0.05 ...` prints its URL and
serves until Ctrl-C.
"""

from __future__ import annotations

import argparse
import http.client
import random
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from pnyx.errors import ConfigError

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>pnyx-fault-proxy</RequestId></Error>"
)


@dataclass(frozen=True)
class Faults:
    """What the proxy does to requests (see the module docstring). The default forwards everything."""

    error_rate: float = 0.0
    reset_rate: float = 0.0
    lost_reply_rate: float = 0.0
    latency_s: tuple[float, float] = (0.0, 0.0)
    down: bool = False
    methods: frozenset[str] | None = None
    """HTTP methods that get error/reset/lost-reply faults (None: all)."""

    def __post_init__(self) -> None:
        for name in ("error_rate", "reset_rate", "lost_reply_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"Faults.{name} must be a probability in [0, 1], got {value}")
        lo, hi = self.latency_s
        if not 0.0 <= lo <= hi:
            raise ConfigError(f"Faults.latency_s must be (lo, hi) with 0 <= lo <= hi, got {self.latency_s}")


def request_kind(method: str, path: str) -> str:
    """LIST for an S3 list request, else the HTTP method."""
    query = urlsplit(path).query
    if method == "GET" and "list-type=" in query:
        return "LIST"
    return method


class FaultProxy:
    """The proxy server; `start()` serves from a background thread on 127.0.0.1."""

    def __init__(
        self, upstream: str, faults: Faults | None = None, *, port: int = 0, seed: int | None = None
    ):
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ConfigError(f"upstream must be an http://host:port URL, got {upstream!r}")
        self.upstream = (parts.hostname, parts.port or 80)
        self.faults = faults or Faults()
        self.counts: Counter[str] = Counter()
        self._rng = random.Random(seed)
        self._queued: list[tuple[str, frozenset[str] | None, str]] = []
        self._lock = threading.Lock()
        self._local = threading.local()
        self._server = _Server(("127.0.0.1", port), _Handler)
        self._server.daemon_threads = True
        self._server.proxy = self  # type: ignore[attr-defined]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FaultProxy:
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="pnyx-fault-proxy", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def inject(self, kind: str, count: int = 1, methods: set[str] | None = None, where: str = "") -> None:
        """Give exactly the next `count` requests of `methods` (None: any) whose path contains `where` the
        fault `kind`: "error", "reset" or "lost_reply". Deterministic, for tests; before the random faults."""
        if kind not in ("error", "reset", "lost_reply"):
            raise ConfigError(f"unknown fault {kind!r}: use 'error', 'reset' or 'lost_reply'")
        with self._lock:
            self._queued.extend([(kind, frozenset(methods) if methods else None, where)] * count)

    # -- used by the handler threads --

    def plan(self, method: str, path: str) -> tuple[str | None, float]:
        """(fault to inject or None, latency in seconds) for one request; counts it."""
        kind = request_kind(method, path)
        f = self.faults
        with self._lock:
            self.counts["requests"] += 1
            self.counts[kind] += 1
            latency = self._rng.uniform(*f.latency_s) if f.latency_s[1] > 0 else 0.0
            fault = None
            queued = next(
                (i for i, (_, m, w) in enumerate(self._queued) if (m is None or method in m) and w in path),
                None,
            )
            if f.down:
                fault = "down"
            elif queued is not None:
                fault = self._queued.pop(queued)[0]
            elif f.methods is None or method in f.methods:
                roll = self._rng.random()
                for name, rate in (
                    ("error", f.error_rate),
                    ("reset", f.reset_rate),
                    ("lost_reply", f.lost_reply_rate),
                ):
                    if roll < rate:
                        fault = name
                        break
                    roll -= rate
            if fault is not None:
                self.counts[f"fault:{fault}"] += 1
        return fault, latency

    def forward(
        self, method: str, path: str, headers: list[tuple[str, str]], body: bytes
    ) -> tuple[int, str, list[tuple[str, str]], bytes]:
        """Send one request upstream on this thread's keep-alive connection (reconnecting once)."""
        for attempt in (0, 1):
            conn = getattr(self._local, "conn", None)
            if conn is None:
                conn = self._local.conn = http.client.HTTPConnection(*self.upstream, timeout=60)
            try:
                conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
                for name, value in headers:
                    conn.putheader(name, value)
                if body or method in ("PUT", "POST"):
                    conn.putheader("Content-Length", str(len(body)))
                conn.endheaders(body if body else None)
                resp = conn.getresponse()
                data = resp.read()
                return resp.status, resp.reason, resp.getheaders(), data
            except (http.client.HTTPException, OSError):
                conn.close()
                self._local.conn = None
                if attempt == 1:
                    raise
        raise AssertionError("unreachable")


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up (killed, timed out) is part of the weather here, not an error to print."""
        import sys

        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "pnyx-fault-proxy"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass  # one line per request would drown a test's output

    def do_GET(self) -> None:
        self._handle()

    do_PUT = do_HEAD = do_POST = do_DELETE = do_GET

    def _handle(self) -> None:
        proxy: FaultProxy = self.server.proxy  # type: ignore[attr-defined]
        body = self._read_body()
        fault, latency = proxy.plan(self.command, self.path)
        if latency:
            time.sleep(latency)
        if fault in ("down", "reset"):
            self._reset()
            return
        if fault == "error":
            self._reply(503, "Slow Down", [("Content-Type", "application/xml")], SLOW_DOWN)
            return
        headers = [
            (k, v) for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP | {"content-length"}
        ]
        try:
            status, reason, resp_headers, data = proxy.forward(self.command, self.path, headers, body)
        except (http.client.HTTPException, OSError):
            self._reply(502, "Bad Gateway", [], b"")
            return
        if fault == "lost_reply":
            self._reset()  # the server has it; the client never hears
            return
        self._reply(status, reason, resp_headers, data)

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _reply(self, status: int, reason: str, headers: list[tuple[str, str]], data: bytes) -> None:
        self.send_response_only(status, reason)
        length_sent = False
        for name, value in headers:
            low = name.lower()
            if low in HOP_BY_HOP:
                continue
            if low == "content-length":
                if self.command != "HEAD":
                    continue  # ours below
                length_sent = True
            self.send_header(name, value)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(data)))
        elif not length_sent:
            self.send_header("Content-Length", "0")
        self.end_headers()
        if self.command != "HEAD" and data:
            self.wfile.write(data)

    def _reset(self) -> None:
        """Close the client connection with a TCP RST (SO_LINGER 0), as a crashed or cut link would."""
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        except OSError:
            pass  # already gone


def main(argv: list[str] | None = None) -> None:
    """`python -m pnyx_harness.proxy --upstream URL [...]`: serve until Ctrl-C."""
    ap = argparse.ArgumentParser(
        prog="python -m pnyx_harness.proxy", description=(__doc__ or "").split("\n\n")[0]
    )
    ap.add_argument("--upstream", required=True, help="the S3 API endpoint, http://host:port")
    ap.add_argument("--port", type=int, default=0, help="port to listen on (0: any free port)")
    ap.add_argument("--error-rate", type=float, default=0.0, help="503 SlowDown probability per request")
    ap.add_argument("--reset-rate", type=float, default=0.0, help="reset-before-forwarding probability")
    ap.add_argument("--lost-reply-rate", type=float, default=0.0, help="forward-then-reset probability")
    ap.add_argument(
        "--latency", type=float, nargs=2, default=(0.0, 0.0), metavar=("LO", "HI"), help="seconds"
    )
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    faults = Faults(args.error_rate, args.reset_rate, args.lost_reply_rate, tuple(args.latency))
    proxy = FaultProxy(args.upstream, faults, port=args.port, seed=args.seed).start()
    print(f"pnyx fault proxy {proxy.url} -> {args.upstream} ({faults})", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        proxy.stop()
        print(dict(proxy.counts))


if __name__ == "__main__":
    main()
