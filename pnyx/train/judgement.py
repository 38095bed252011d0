"""Stage 2 of a step: which groups the sampling checks reject, from the evidence of the step's forward.

`judge_whole` judges the groups that lie wholly in one micro-batch (before its backward), `judge_rest` the
rest on the evidence merged over every micro-batch and rank; `keep_rejudged` gives each failing group its
exact re-check (`Rejudge`, implemented by `pnyx.train.rejudge`) before the verdict takes effect. Pure but
for the re-check's forward: knows nothing about torch, the model or the optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from pnyx.security.checks import DRAW_MISMATCH, DRAW_UNVERIFIABLE, GroupEvidence, Limits, judge
from pnyx.train.microbatch import Row
from pnyx.train.stepstats import PartialStats

Rejudge = Callable[[list[Row], int], Mapping[str, GroupEvidence]]
"""(one group's rows, the version they claim) -> that group's evidence from a forward under exactly the
published weights of that version (`pnyx.train.rejudge.Rejudge`): a check with no drift in it."""

ExactDraws = Callable[[list[Row]], list[float]]
"""(rows with seeded uniforms, of any versions) -> per row, its largest distance from its draws under exactly
the published weights of its version (inf where they cannot be obtained; `pnyx.train.rejudge.Rejudge.draws`)."""


def judge_whole(
    here: Mapping[str, GroupEvidence], rows_of: Mapping[str, int], checks: Limits
) -> dict[str, str]:
    """Group key -> drop reason, for the failing groups of one micro-batch that lie wholly in it (their
    evidence there is complete, so they are judged before its backward)."""
    out: dict[str, str] = {}
    for key, ev in here.items():
        if ev.rows == rows_of[key] and (reason := judge(ev, checks)) is not None:
            out[key] = reason
    return out


def judge_rest(
    evidence: Mapping[str, GroupEvidence], judged: Mapping[str, str], checks: Limits
) -> dict[str, str]:
    """Group key -> drop reason, for the groups not judged yet (`judged`: rejected, or kept by the exact
    re-check), from their evidence merged over every micro-batch and rank, in key order. Only a group split
    across micro-batches can fail here: a whole group that passed in its micro-batch is judged again on the
    same sums."""
    rest = sorted(k for k in evidence if k not in judged)
    return {k: r for k in rest if (r := judge(evidence[k], checks)) is not None}


def keep_rejudged(
    rejudge: Rejudge | None,
    checks: Limits | None,
    rows: list[Row],
    failing: Mapping[str, str],
    part: PartialStats,
) -> dict[str, str]:
    """The groups of `failing` that stay rejected once judged again under the exact published weights they
    claim (all of them without `rejudge`); those that pass there go to `part.rejudged` (with the reason
    they were failing for) and their exact evidence to `part.exact`. `rows`: the batch's rows."""
    if rejudge is None or checks is None or not failing:
        return dict(failing)
    out: dict[str, str] = {}
    for key, reason in failing.items():
        if reason in (DRAW_MISMATCH, DRAW_UNVERIFIABLE):  # measured under the exact weights already
            out[key] = reason
            continue
        mine = [r for r in rows if r.key == key]
        exact = rejudge(mine, mine[0].version).get(key)
        if exact is not None and judge(exact, checks) is None:
            part.rejudged[key] = reason
            part.exact[key] = exact
        else:
            out[key] = reason
    return out
