"""What one trainer step works on and what it leaves: `Batch` (rank 0 sends it to every rank) and
`StepResult` (the step's stats, for the metrics and the progress line). Plain records."""

from __future__ import annotations

from dataclasses import dataclass

from pnyx.security.calibration import Allowances
from pnyx.train.ingest import ScoredGroup
from pnyx.train.microbatch import Row
from pnyx.train.stepstats import StepStats


@dataclass
class Batch:
    """What rank 0 sends every rank for one step: the groups, their reference logprobs, the rate."""

    keys: list[str]
    groups: list[ScoredGroup]
    lr: float
    ref: dict[tuple[str, int], list[float]] | None = None
    checks: Allowances | None = None
    """The sampling checks' allowances for this step (derived from the run on rank 0; None: off)."""
    probe: list[Row] | None = None
    """The drift probe's rows (from the previous step's batch; None: none)."""
    rounded: str | None = None
    """`BatchRecord.rounded`: the dtype the step's forward rounds the trained weights to (None: none)."""


@dataclass
class StepResult:
    version: int
    stats: StepStats
    groups: list[ScoredGroup]
    publish_s: float
    publish_kind: str
    lr: float = 0.0
    checks: Allowances | None = None
    """The allowances the step judged its groups with."""
