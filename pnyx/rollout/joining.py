"""Joining a run, the worker's first minute: read run.json, check the local model, cold-join the weights,
find where this worker id's seq numbers resume.

Every wait here has a deadline and a backoff and returns early on the caller's stop event. Knows nothing
about generation or uploads (`worker.py` owns the loop).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
from typing import Any

from pnyx.errors import ConfigError, IntegrityError, NotFoundError, StoreUnavailableError
from pnyx.protocol import layout
from pnyx.protocol.records import RunManifest
from pnyx.store import Store
from pnyx.store.retry import Backoff, wait_for
from pnyx.weights.syncer import Syncer

log = logging.getLogger("pnyx.worker")

SEQ_LOOKBACK_VERSIONS = 4
"""How many versions below the newest a starting worker scans for its own highest seq."""


def default_worker_id() -> str:
    """`<hostname>-<pid>`, reduced to the characters a key allows (letters, digits, `_.-`, ≤64)."""
    host = socket.gethostname().split(".")[0]
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{host}-{os.getpid()}").strip("-._") or f"worker-{os.getpid()}"
    if not name[0].isalnum():
        name = "w" + name
    return layout.check_name(name[-64:].lstrip("-._") or f"w{os.getpid()}", "worker id")


def resume_seq(
    store: Store, worker_id: str, newest_version: int, lookback: int = SEQ_LOOKBACK_VERSIONS
) -> int:
    """The first unused seq for `worker_id`: one past the highest it wrote in the newest few versions."""
    highest = -1
    for v in range(max(0, newest_version - lookback), newest_version + 1):
        for meta in store.list(layout.rollouts_dir(v)):
            parsed = layout.parse_rollout_key(meta.key)
            if parsed is not None and parsed[1] == worker_id:
                highest = max(highest, parsed[2])
    return highest + 1


def read_run_manifest(store: Store, deadline_s: float, stop: threading.Event) -> RunManifest:
    """The run's RunManifest, waiting (with backoff) for a trainer that has not created the run yet."""
    from pnyx.protocol import decode_json

    last: list[BaseException] = []

    def attempt() -> RunManifest | None:
        try:
            return decode_json(store.get(layout.RUN_MANIFEST), RunManifest)
        except (NotFoundError, StoreUnavailableError) as e:
            last[:] = [e]
            log.info("waiting for %s in %s", layout.RUN_MANIFEST, store.url)
            return None

    run = wait_for(attempt, deadline_s, Backoff.polling(cap_s=5.0), stop, what="run.json")
    if run is None:
        raise ConfigError(
            f"{store.url} has no readable {layout.RUN_MANIFEST} after {deadline_s:g}s ({last[0]}). Start the "
            "trainer on this store first (`pnyx trainer --store ...`) or check the URL."
        ) from last[0]
    return run


def cold_join(
    syncer: Syncer, deadline_s: float, poll_s: float, stop: threading.Event
) -> tuple[int, dict[str, Any]]:
    """(version, tensors) of the newest verified version, waiting with backoff for the first publish.

    Fail-closed: a version that does not verify is never returned; after `deadline_s` without one this
    raises StoreUnavailableError (the trainer is not publishing, or the store is unreachable).
    """
    last: list[BaseException] = []

    def attempt() -> tuple[int, dict[str, Any]] | None:
        try:
            return syncer.sync()
        except (NotFoundError, IntegrityError, StoreUnavailableError) as e:
            last[:] = [e]
            log.info("cold join: %s; retrying", e)
            return None

    pause = Backoff.polling(cap_s=10.0, base_s=min(poll_s, 0.5), jitter=True)
    got = wait_for(attempt, deadline_s, pause, stop, what="the first weights")
    if got is None:
        raise StoreUnavailableError(
            f"no verified weights within {deadline_s:g}s (last error: {last[0] if last else None}). Is the "
            "trainer running and publishing to this store URL?"
        )
    return got
