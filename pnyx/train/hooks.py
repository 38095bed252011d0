"""The trainer's test hooks, set through the environment. Used by tests only.

`PNYX_TEST_CRASH_AT=<point>:N[@R]` SIGKILLs the trainer process (only rank R when given) at a named point
of the step that produces version N: `after_step` (optimizer step done), `before_manifest` (payload
uploaded, manifest not written), `after_publish` (published, before metrics and checkpoint) or
`during_checkpoint` (this rank's checkpoint shards uploaded, not committed); `crash_point` is called at
those points by the loop (`loop.py`), the publisher and the checkpointer. `PNYX_TEST_INGEST_DELAY_S=x`
makes every group fetch sleep x seconds first (`slow_decode`; the liveness tests use it to hold the
trainer in ingestion). Knows nothing about training.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

log = logging.getLogger("pnyx.train")

CRASH_ENV = "PNYX_TEST_CRASH_AT"
INGEST_DELAY_ENV = "PNYX_TEST_INGEST_DELAY_S"


def crash_point(name: str, version: int) -> None:
    """The kill-test hook (see module docstring): SIGKILL ourselves at a named point."""
    want = os.environ.get(CRASH_ENV)
    if want is None:
        return
    point, _, rank = want.partition("@")
    if point == f"{name}:{version}" and (not rank or rank == os.environ.get("RANK", "0")):
        log.warning("test hook %s=%s: SIGKILL", CRASH_ENV, want)
        os.kill(os.getpid(), signal.SIGKILL)


def slow_decode(delay_s: float) -> Any:
    """The decoder behind `PNYX_TEST_INGEST_DELAY_S`: sleep, then decode as usual."""
    from pnyx.protocol.codec import decode_group

    def decode(data: bytes, vocab_size: int | None) -> Any:
        time.sleep(delay_s)
        return decode_group(data, vocab_size=vocab_size)

    return decode
