"""`pnyx status --store URL`: the live view of any run, local or remote, read from the store alone.

An operator watches a fleet from a laptop with nothing but the store URL (and read credentials): versions,
trainer metrics, held-out pass@1 when the run folder holds eval records, and every worker's heartbeat.
The version shown is the newest one run.json's trainer key (or `--trust`) signed; manifests it did not
sign are listed as ignored, never shown as the run's version (`pnyx.cli.live.RunWatcher`). Knows nothing
about the processes of the run; never writes to the store. `--watch` refreshes until Ctrl-C; without it,
one snapshot is printed and the command exits. `--serve` serves the same watcher's snapshots as a live
web page instead (`pnyx.cli.web`, docs/live-page.md), on loopback unless `--host` says otherwise.
"""

from __future__ import annotations

import time

REFRESH_S = 2.0


def status_main(
    store: str,
    watch: bool,
    trust: str | None = None,
    serve: bool = False,
    host: str = "127.0.0.1",
    port: int = 8765,
) -> None:
    """Print the run's state once, keep a live view refreshing every ~2 s until Ctrl-C (`watch`), or serve
    it as a web page on `host`:`port` until Ctrl-C (`serve`)."""
    from rich.console import Console
    from rich.live import Live

    from pnyx.cli.common import fail
    from pnyx.cli.live import RunWatcher
    from pnyx.cli.live_view import render as render_run
    from pnyx.cli.status_swarm import with_swarm
    from pnyx.errors import PnyxError, StoreError
    from pnyx.store import open_store

    console = Console()

    def render(snap, title):  # the run view, plus swarm nodes when the store has any
        return with_swarm(render_run(snap, title=title), watcher.store, snap)

    try:
        watcher = RunWatcher(open_store(store), trust=trust)
        snap = watcher.snapshot()
    except PnyxError as e:  # a store we cannot read, a broken run.json, or a key other than --trust
        raise fail(f"cannot read the run at {store}: {e}") from None
    if serve:
        from pnyx.cli.web import RunServer, SnapshotSource, serve_run

        try:
            server = RunServer(SnapshotSource(watcher), host, port)
        except OSError as e:  # the port is taken, or the address is not this machine's
            raise fail(
                f"cannot serve on {host}:{port}: {e} (pick another --port, or 0 for any free one)"
            ) from None
        serve_run(server)
        return
    if not watch:
        console.print(render(snap, title="pnyx status"))
        return
    try:
        with Live(render(snap, title="pnyx status"), console=console, refresh_per_second=2) as live:
            while True:
                time.sleep(REFRESH_S)
                try:
                    snap = watcher.snapshot()
                except StoreError as e:
                    # A flaky connection is not the run's fault: keep the last view, say why, retry.
                    snap.note = f"store unreachable, retrying: {e}"
                except PnyxError as e:  # run.json appeared since, naming a key other than --trust
                    raise fail(f"cannot read the run at {store}: {e}") from None
                live.update(render(snap, title="pnyx status"))
    except KeyboardInterrupt:
        return
