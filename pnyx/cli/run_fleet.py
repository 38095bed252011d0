"""The fleet of `pnyx run`: the trainer and worker processes of one run, each `python -m pnyx ...` in its
own process group with its own log, the machine's cores split among them, and stopping them (SIGINT to
each group, a deadline, then SIGKILL).

Knows nothing about what the processes do: they meet only in the store.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pnyx.cli.run_folder import CONFIG_FILE, RunPlan

STOP_DEADLINE_S = 60.0


@dataclass
class Child:
    """One fleet process: its role, Popen handle and log file."""

    role: str
    proc: subprocess.Popen
    log: Path
    stopped_by_us: bool = False

    @property
    def rc(self) -> int | None:
        return self.proc.poll()


def thread_split(workers: int, cores: int | None = None) -> tuple[int, int]:
    """(trainer threads, threads per worker): the trainer gets an equal share, the workers split the rest,
    so the fleet does not oversubscribe the machine's cores (beyond one thread per process)."""
    cores = cores or os.cpu_count() or 1
    trainer = max(1, cores // (workers + 1))
    per_worker = max(1, (cores - trainer) // workers) if workers else 1
    return trainer, per_worker


class Fleet:
    """The trainer and worker processes of one run, each in its own process group with its own log."""

    def __init__(self, plan: RunPlan, workers: int):
        self.plan = plan
        self.n_workers = workers
        self.trainer: Child | None = None
        self.workers: list[Child] = []
        self.trainer_threads, self.worker_threads = thread_split(workers)

    @property
    def started_trainer(self) -> Child:
        """The trainer process, which exists from `start_trainer()` on."""
        if self.trainer is None:
            raise RuntimeError("the fleet's trainer was not started")
        return self.trainer

    def _spawn(self, role: str, args: list[str], threads: int) -> Child:
        log = self.plan.logs / f"{role}.log"
        env = dict(
            os.environ,
            OMP_NUM_THREADS=str(threads),
            MKL_NUM_THREADS=str(threads),
            TOKENIZERS_PARALLELISM="false",
        )
        with open(log, "ab") as fh:
            fh.write(
                f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} start {role}: pnyx {' '.join(args)}\n".encode()
            )
            fh.flush()
            proc = subprocess.Popen(
                [sys.executable, "-m", "pnyx", *args],
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # own process group: the terminal's Ctrl-C reaches only us
            )
        return Child(role, proc, log)

    def start_trainer(self) -> None:
        args = ["trainer", "--store", self.plan.store_url, "--config", str(self.plan.folder / CONFIG_FILE)]
        if self.plan.resumed:
            args.append("--resume")
        self.trainer = self._spawn("trainer", args, self.trainer_threads)

    def start_workers(self) -> None:
        for i in range(1, self.n_workers + 1):
            args = [
                "worker",
                "--store",
                self.plan.store_url,
                "--id",
                f"local-{i}",
                "--threads",
                str(self.worker_threads),
            ]
            self.workers.append(self._spawn(f"worker-{i}", args, self.worker_threads))

    @property
    def children(self) -> list[Child]:
        return ([self.trainer] if self.trainer else []) + self.workers

    def stop(self, deadline_s: float = STOP_DEADLINE_S) -> list[str]:
        """SIGINT every live child's group, wait up to `deadline_s`, SIGKILL what is left; returns notes."""
        notes = []
        for c in self.children:
            if c.rc is None:
                c.stopped_by_us = True
                _signal_group(c.proc, signal.SIGINT)
        end = time.monotonic() + deadline_s
        for c in self.children:
            try:
                c.proc.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(c.proc, signal.SIGKILL)
                c.proc.wait()
                notes.append(f"{c.role} did not stop within {deadline_s:.0f}s and was killed (log: {c.log})")
        return notes


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(proc.pid, sig)
