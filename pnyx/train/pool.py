"""A bounded pool of daemon threads for store I/O that must never hold up a stopping process.

`concurrent.futures.ThreadPoolExecutor` joins its threads at interpreter exit, so one GET stuck in its
retry loop (up to the store's deadline) would hold a SIGTERMed trainer for that long. These threads are
daemons: `shutdown()` cancels what is queued and returns at once; a call in flight is abandoned with the
process. Results and exceptions travel in ordinary `Future`s, so callers wait with a timeout and re-raise
in their own thread. Knows nothing about what the tasks do.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class DaemonPool:
    """`workers` daemon threads running submitted calls in FIFO order."""

    def __init__(self, workers: int, name: str = "pnyx-io"):
        if workers < 1:
            raise ValueError(f"a pool needs at least one worker, got {workers}")
        self._queue: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., object], *args: object) -> Future:
        if self._closed:
            raise RuntimeError("submit on a pool that was shut down")
        fut: Future = Future()
        self._queue.put((fut, fn, args))
        return fut

    def shutdown(self) -> None:
        """Cancel queued calls and let the threads end; never waits for a call in flight."""
        self._closed = True
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in self._threads:
            self._queue.put(None)

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread, which re-raises
                fut.set_exception(e)
            else:
                fut.set_result(result)
