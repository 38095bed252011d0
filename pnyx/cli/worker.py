"""`pnyx worker --store URL`: the body of the worker command (signals, threads, logging, exit codes).

Everything about the run comes from its run.json; this module only turns the command's flags into
`WorkerOptions`, installs SIGINT/SIGTERM handlers that ask the loop to stop at the next cohort boundary
(a second signal exits at once, which is still safe: puts are atomic), and maps errors to exit codes:
0 after a clean stop, 1 on a fatal error, 2 on a configuration error (an `--engine` whose package or
hardware is missing is one: checked at join, before any model loads). torch and the model stack are
imported only here, inside the function, so `pnyx --help` stays instant.

PNYX_SPOOL_DIR (keep an on-disk copy of the upload spool there) comes from the environment; so may the
model (PNYX_MODEL_PATH, the same as `--model`: this machine's copy of the run's model, checked at join).
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

import typer

from pnyx.cli.common import fail, setup_logging
from pnyx.errors import ConfigError, PnyxError


def worker_main(
    store: str,
    worker_id: str | None = None,
    device: str = "cpu",
    int8: bool = False,
    max_groups: int | None = None,
    threads: int | None = None,
    model: str | None = None,
    engine: str | None = None,
) -> None:
    """Run one worker until stopped (SIGINT/SIGTERM), `max_groups` uploaded, or a fatal error."""
    log = setup_logging("worker")
    import torch

    torch.set_num_threads(threads or 1)  # workers often share a box: one thread each unless told otherwise
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    from pnyx.rollout.worker import Worker, WorkerOptions
    from pnyx.store import open_store

    try:
        opts = WorkerOptions(
            worker_id=worker_id,
            device=device,
            engine=engine,
            int8=int8,
            max_groups=max_groups,
            spool_dir=os.environ.get("PNYX_SPOOL_DIR") or None,
            model_path=model or os.environ.get("PNYX_MODEL_PATH") or None,
        )
        worker = Worker(open_store(store), opts)
    except (ConfigError, ValueError) as e:
        raise fail(str(e)) from None

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if worker.stopping:  # second signal: leave now (every put is atomic, nothing partial remains)
            log.warning("second signal: exiting without the final flush")
            os._exit(130)
        log.info("signal %s: finishing the current cohort, then stopping", signal.Signals(signum).name)
        worker.request_stop(f"stopped by {signal.Signals(signum).name}")

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        summary = worker.run()
    except ConfigError as e:
        raise fail(str(e)) from None
    except PnyxError as e:
        raise fail(f"worker {worker.worker_id} stopped on an error: {e}", code=1) from None
    log.info(
        "worker %s %s: uploaded=%d pending=%d dropped=%d rollouts=%d versions=%s",
        summary.worker_id, summary.status, summary.groups_uploaded, summary.groups_pending,
        summary.groups_dropped, summary.rollouts, sorted(set(summary.versions)),
    )  # fmt: skip
    sys.stdout.flush()
    if summary.status == "error":
        raise typer.Exit(1)
