"""The learning-curve PNG of a run: training reward per version and held-out pass@1 against wall time.

Input is plain data (lists of dicts as `pnyx run` collects them: trainer metrics rows and eval records),
output one PNG file drawn with matplotlib's Agg backend (no display needed, safe in CI and over ssh).
Knows nothing about the store, models or processes. matplotlib is imported inside `plot_learning_curve`,
so importing this module is cheap.

Invariant: the figure only shows what the inputs hold; a run with no metrics yet still gets a valid PNG
(an empty axis with a note), never an exception.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _points(rows: Sequence[dict[str, Any]], x: str, y: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for row in rows:
        if row.get(x) is not None and row.get(y) is not None:
            xs.append(float(row[x]))
            ys.append(float(row[y]))
    return xs, ys


def plot_learning_curve(
    train_points: Sequence[dict[str, Any]],
    eval_points: Sequence[dict[str, Any]],
    out: str | Path,
    title: str = "pnyx run",
) -> Path:
    """Draw the run's learning curve to `out` (PNG) and return the path.

    `train_points`: rows with `elapsed_s` (seconds since the run started) and `reward` (mean training
    reward of that version's batch). `eval_points`: rows with `elapsed_s`, `pass@1` and optionally
    `ci_low`/`ci_high` (drawn as error bars) and `version` (annotated).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    try:
        tx, ty = _points(train_points, "elapsed_s", "reward")
        if tx:
            ax.plot(tx, ty, color="tab:blue", alpha=0.6, linewidth=1, label="training reward (per version)")
        evals = [r for r in eval_points if r.get("elapsed_s") is not None and r.get("pass@1") is not None]
        ex = [float(r["elapsed_s"]) for r in evals]
        ey = [float(r["pass@1"]) for r in evals]
        if evals:
            lo = [max(0.0, y - float(r.get("ci_low", y))) for r, y in zip(evals, ey, strict=True)]
            hi = [max(0.0, float(r.get("ci_high", y)) - y) for r, y in zip(evals, ey, strict=True)]
            ax.errorbar(
                ex,
                ey,
                yerr=[lo, hi],
                color="tab:red",
                marker="o",
                linestyle="-",
                capsize=3,
                label="held-out pass@1 (95% CI)",
            )
            # Label at most ~8 points (first, last, evenly between) so labels never pile up.
            step = max(1, math.ceil(len(evals) / 8))
            for i, (r, x, y) in enumerate(zip(evals, ex, ey, strict=True)):
                if r.get("version") is not None and (i % step == 0 or i == len(evals) - 1):
                    ax.annotate(
                        f"v{r['version']}",
                        (x, y),
                        textcoords="offset points",
                        xytext=(0, 6),
                        ha="center",
                        fontsize=7,
                        color="tab:red",
                    )
        if not tx and not ex:
            ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel("reward / pass@1")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if tx or ex:
            ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        fig.savefig(out, format="png")
    finally:
        plt.close(fig)
    return out
