"""`pnyx worker --store URL`: the body of the worker command (signals, threads, logging, exit codes).

Everything about the run comes from its run.json; this module only turns the command's flags into
`WorkerOptions`, runs the worker in a background thread and keeps the main thread free for signals, so
a stop never waits for the store:

- the first SIGINT/SIGTERM asks the worker to stop: its courier makes one final flush bounded by
  `final_flush_s`, writes the final heartbeat, and the process exits 0; if the store hangs (or a cohort
  is still being generated) the process exits anyway `HARD_STOP_S` seconds after the signal, abandoning
  what is left: every group not uploaded is in the spool folder, and the next start of this worker id
  uploads it;
- a second signal exits at once (code 130), which is still safe: every put is atomic.

Exit codes: 0 after a stop or a finished quota, 1 on a fatal error, 2 on a configuration error (an
`--engine` whose package or hardware is missing is one: checked at join, before any model loads). torch
and the model stack are imported only here, inside the function, so `pnyx --help` stays instant.
PNYX_MODEL_PATH (the same as `--model`: this machine's copy of the run's model, checked at join) and
PNYX_SPOOL_DIR (the spool root, when --spool-dir is not given) come from the environment.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from types import FrameType

from pnyx.cli.common import fail, setup_logging
from pnyx.errors import ConfigError, PnyxError

HARD_STOP_S = 3.0
"""Seconds after the final flush's own bound (`final_flush_s`) at which a stopping worker exits regardless."""


def worker_main(
    store: str,
    worker_id: str | None = None,
    device: str = "cpu",
    int8: bool = False,
    max_groups: int | None = None,
    threads: int | None = None,
    model: str | None = None,
    engine: str | None = None,
    spool_dir: str | None = None,
    trust: str | None = None,
) -> None:
    """Run one worker until stopped (SIGINT/SIGTERM), `max_groups` uploaded, or a fatal error."""
    log = setup_logging("worker")
    import torch

    torch.set_num_threads(threads or 1)  # workers often share a box: one thread each unless told otherwise
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    from pnyx.rollout.worker import Worker, WorkerOptions, WorkerSummary
    from pnyx.store import open_store

    try:
        opts = WorkerOptions(
            worker_id=worker_id,
            device=device,
            engine=engine,
            int8=int8,
            max_groups=max_groups,
            spool_dir=spool_dir,
            trust=trust,
            model_path=model or os.environ.get("PNYX_MODEL_PATH") or None,
        )
        worker = Worker(open_store(store), opts)
    except (ConfigError, ValueError) as e:
        raise fail(str(e)) from None

    summaries: list[WorkerSummary] = []  # what the worker thread returned, or
    errors: list[BaseException] = []  # what it raised
    finished = threading.Event()
    stop_by: list[float] = []  # the hard deadline, once a stop was asked for

    def body() -> None:
        try:
            summaries.append(worker.run())
        except BaseException as e:  # noqa: BLE001 - reported by the main thread below
            errors.append(e)
        finally:
            finished.set()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if worker.stopping:  # second signal: leave now (every put is atomic, nothing partial remains)
            log.warning("second signal (%s): exiting now; unsent groups stay in the spool folder", name)
            _exit(130)
        log.info("signal %s: stopping (final flush of at most %.0fs)", name, opts.final_flush_s)
        worker.request_stop(f"stopped by {name}")
        stop_by.append(time.monotonic() + opts.final_flush_s + HARD_STOP_S)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    threading.Thread(target=body, name="pnyx-worker", daemon=True).start()
    while not finished.wait(0.2):  # short waits: signal handlers run in this thread between them
        if stop_by and time.monotonic() > stop_by[0]:
            spool = worker.link.spool
            pending = len(spool) if spool is not None else 0
            where = spool.folder if spool is not None else "(not joined yet)"
            log.warning(
                "worker %s: the store did not answer in time; exiting with %d group(s) kept in %s for the next start",
                worker.worker_id, pending, where,
            )  # fmt: skip
            _exit(0)
    error = errors[0] if errors else None
    if isinstance(error, ConfigError):
        fail(str(error))
        _exit(2)
    if isinstance(error, PnyxError):
        fail(f"worker {worker.worker_id} stopped on an error: {error}")
        _exit(1)
    if error is not None:
        raise error
    summary = summaries[0]
    log.info(
        "worker %s %s: uploaded=%d pending=%d skipped_zero_variance=%d expired=%d dropped=%d rollouts=%d versions=%s",
        summary.worker_id, summary.status, summary.groups_uploaded, summary.groups_pending,
        summary.groups_skipped_zero_variance, summary.groups_expired, summary.groups_dropped, summary.rollouts,
        _ranges(sorted(set(summary.versions))),
    )  # fmt: skip
    # Exit now: a store thread still stuck in a retry (the store is down) must not hold the process up.
    _exit(1 if summary.status == "error" else 0)


def _exit(code: int) -> None:
    """Leave the process now, after flushing the logs (threads stuck in a store call are abandoned)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _ranges(versions: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8' (a long run uses hundreds of versions)."""
    out: list[str] = []
    for v in versions:
        if out and v == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        else:
            out.append(str(v))
    return ",".join(out) or "none"
