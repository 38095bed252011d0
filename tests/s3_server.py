"""The tests' loopback S3 API server: moto's standalone server, each request handled under one lock.

Real S3, R2 and GCS make a conditional PUT (`If-None-Match: *`, `If-Match`) atomic, and pnyx's create-only
puts and fencing rely on it. moto checks the condition and then writes, without a lock, on a threaded
server: two racing create-only puts can both succeed (seen in this suite on a loaded machine: 2 winners of
16 in `test_create_only_race_has_exactly_one_winner[s3]`). Handling one request at a time gives the test
server the guarantee the real services give; connections stay concurrent (a thread each), and a moto
request takes about a millisecond, so the lock costs the suite nothing measurable.

    python tests/s3_server.py -H 127.0.0.1 -p 5055
"""

from __future__ import annotations

import argparse
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any


def serialized(app: Callable[..., Iterable[bytes]]) -> Callable[..., list[bytes]]:
    """A WSGI app that runs `app` (and reads its whole response) under one lock."""
    lock = threading.Lock()

    def handle(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        with lock:
            body = app(environ, start_response)
            try:
                return list(body)
            finally:
                close = getattr(body, "close", None)
                if close is not None:
                    close()

    return handle


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("-H", "--host", default="127.0.0.1")
    ap.add_argument("-p", "--port", type=int, default=5055)
    args = ap.parse_args()
    os.environ.setdefault("MOTO_PORT", str(args.port))  # as moto's own server does: its URLs name the port
    from moto.moto_server.threaded_moto_server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import run_simple

    run_simple(
        args.host, args.port, serialized(DomainDispatcherApplication(create_backend_app)), threaded=True
    )


if __name__ == "__main__":
    main()
