"""A worker's settings, what it generates with, a cohort it committed ahead, its progress (what its heartbeat
reports), what it reports when it ends, and its throughput meter (`pnyx.rollout.worker`).

Plain data: knows nothing about the store, models or the worker loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from pnyx.envs import Environment, Task
    from pnyx.rollout.committer import Ahead
    from pnyx.rollout.curriculum import Curriculum
    from pnyx.rollout.engines.base import WorkerEngine
    from pnyx.rollout.screen import Screen

Status = Literal["starting", "syncing", "generating", "uploading", "waiting", "stopped", "error"]


@dataclass(frozen=True)
class CohortAhead:
    """A cohort committed and not drawn yet: the commitment (`RunLink.commit_ahead`; `pnyx.rollout.worker`
    commits the next cohort ahead) and its tasks."""

    commit: Ahead
    tasks: list[Task]


@dataclass
class Generation:
    """What a worker generates with, made at join from run.json and this machine's model folder."""

    env: Environment
    tokenizer: PreTrainedTokenizerBase
    engine: WorkerEngine
    """Holds the verified weights the worker loaded last (`pnyx.rollout.worker.Worker._load`)."""
    screen: Screen
    """Picks each cohort's tasks from a larger pool (off unless worker.screen > 1)."""
    curriculum: Curriculum | None
    """Picks each cohort's pool by what this worker measured (None: worker.curriculum off)."""
    max_new_tokens: int
    """The run's generation budget per turn."""


@dataclass
class WorkerOptions:
    """A worker's own settings: everything else comes from the run's run.json."""

    worker_id: str | None = None
    """Unique id of this worker in the run (default `<hostname>-<pid>`)."""
    device: str = "cpu"
    """Torch device for generation: cpu, cuda, cuda:N, mps or auto."""
    engine: str | None = None
    """Generation engine: torch, mlx or vllm (None: the run's worker.engine). Chosen once, at join."""
    int8: bool = False
    """Run from the int8 actor plane (also on when the run's worker.int8 is set)."""
    max_groups: int | None = None
    """Stop after this many groups are uploaded (None: run until stopped)."""
    spool_dir: str | None = None
    """Root of the on-disk spool; the worker's folder is `<root>/<run_id>/<worker_id>/` (None: $PNYX_SPOOL_DIR,
    else $XDG_CACHE_HOME/pnyx/spool, else ~/.cache/pnyx/spool)."""
    model_path: str | None = None
    """This machine's copy of the run's model (folder, .gguf or hub id) instead of what run.json names; its
    files must be the run's (checked at join)."""
    join_timeout_s: float = 600.0
    """How long to wait for run.json and the first verified weights before giving up."""
    flush_deadline_s: float = 30.0
    """How long one flush may keep uploading (also the final flush after `max_groups`)."""
    final_flush_s: float = 3.0
    """How long the final flush after a stop request may keep uploading; the rest stays on disk."""
    max_backoff_s: float = 30.0
    """Largest wait between retries while the store is unreachable."""
    trust: str | None = None
    """The trainer key fingerprint to require (`--trust`); None: trust run.json's key on first use and pin
    it (docs/security.md)."""
    keys_dir: str | None = None
    """Folder of this worker's key and its pinned trainer keys (None: $PNYX_KEYS_DIR, else
    $XDG_CACHE_HOME/pnyx/keys, else ~/.cache/pnyx/keys)."""


@dataclass
class WorkerSummary:
    """What a worker did, returned by `Worker.run` (and printed by the CLI)."""

    worker_id: str
    groups_uploaded: int
    groups_pending: int
    groups_dropped: int
    groups_skipped_zero_variance: int
    groups_expired: int
    rollouts: int
    tokens: int
    versions: list[int] = field(default_factory=list)
    status: Status = "stopped"
    spool_folder: str | None = None


class Throughput:
    """Rollouts/s and tokens/s since the previous measurement, smoothed (EMA 0.5), for the heartbeat."""

    def __init__(self) -> None:
        self.rates = (0.0, 0.0)
        """(rollouts/s, tokens/s)."""
        self._window = (time.monotonic(), 0, 0)  # (start, rollouts, tokens) of the current window

    def restart(self, rollouts: int, tokens: int) -> None:
        """Start a new window at these totals (after a wait that is not generation)."""
        self._window = (time.monotonic(), rollouts, tokens)

    def update(self, rollouts: int, tokens: int) -> None:
        """Close the window at these totals and fold its rates into the average."""
        now = time.monotonic()
        start, r0, t0 = self._window
        if now - start <= 0:
            return
        rates = ((rollouts - r0) / (now - start), (tokens - t0) / (now - start))
        old = self.rates
        self.rates = (
            rates if old == (0.0, 0.0) else tuple(0.5 * a + 0.5 * b for a, b in zip(old, rates, strict=True))
        )
        self._window = (now, rollouts, tokens)


@dataclass
class Progress:
    """What a worker reports: its status, the weights it holds, its counters. The `Worker` writes it (its
    `RunLink` sets the join's "syncing" and the end's "stopped"); the link reads it for the heartbeat (on the
    courier thread, so a field may be one update late) and for the `WorkerSummary`."""

    status: Status = "starting"
    detail: str = ""
    """One line on what the status means now (the heartbeat's `detail`)."""
    version: int | None = None
    """The policy version the engine holds (None before the cold join)."""
    digest: str = ""
    """That version's chain digest, as the engine proved it."""
    versions_used: list[int] = field(default_factory=list)
    """Every version loaded, in order."""
    rollouts: int = 0
    """Completions generated (skipped groups included)."""
    tokens: int = 0
    """Tokens generated."""
    skipped_zero_variance: int = 0
    """Groups not uploaded because all their samples got the same reward."""
    generate_s: float = 0.0
    """Seconds generating cohorts (the screening's cost is measured against it)."""
    screen_s: float = 0.0
    """Seconds scoring candidate tasks (`Screen.seconds`)."""
    tasks_screened: int = 0
    """Candidate tasks scored (`Screen.scored`)."""
    commit_wait_s: float = 0.0
    """Seconds waiting for the trainer's ticks (committed draws, `pnyx.rollout.committer`)."""
    started_at: float = field(default_factory=time.time)
    throughput: Throughput = field(default_factory=Throughput)

    def set(self, status: Status, detail: str = "") -> None:
        self.status = status
        self.detail = detail
