"""What committed draws cost a fleet whose generation is the bottleneck, with and without committing ahead
(`security.committed_draws`, `security.commit_ahead`; issue #25).

Each arm is a real fleet: `pnyx trainer` and `pnyx worker` processes on a local-folder store, the workers
throttled as in `bench_async.py` (a worker of speed s sleeps `(slowdown / s - 1)` times its measured generate
time after each cohort: slower hardware, simulated without using CPU), so the trainer waits for rollouts. Arms
alternate (off, ahead, wait, off, ...) for `--reps` rounds, each for `--seconds` after its first rollout.
Per run, from the run's own records: versions published per minute between the first and the last
(`trainer/metrics-*.json`'s `time`: start-up excluded), the trainer's wait for groups, and per worker its
generation time and its wait for ticks (heartbeats' `generate_seconds`, `commit_wait_seconds`), and the
mean staleness of the rows trained on. Prints a row
per run and, per arm, the median rate and its ratio to `off` measured in the same process.

    python benchmarks/bench_commit_ahead.py                       # one worker 3x slower, 3 rounds x 60 s
    python benchmarks/bench_commit_ahead.py --speeds 1,1 --slowdown 4 --reps 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_async import run_fleet  # noqa: E402 - this folder's module
from sync_loop import RewardWindow  # noqa: E402

ARMS = {
    "off": ["--security.committed_draws=false"],
    "ahead": ["--security.committed_draws=true", "--security.commit_ahead=true"],
    "wait": ["--security.committed_draws=true", "--security.commit_ahead=false"],
}


def one(arm: str, args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    from pnyx.config import load_config

    cfg = load_config(None, ["--run.time_budget_s=100000", "--run.steps=100000", *ARMS[arm], *extra])
    window = RewardWindow(64, 2.0)  # never reached: the run lasts its budget
    speeds = [float(s) for s in args.speeds.split(",")]
    budget = args.seconds + args.startup_s
    info = run_fleet(cfg, window, budget, speeds, args.slowdown, None, 0.0)
    run = Path(info["folder"]) / "run"
    metrics = [json.loads(p.read_text()) for p in sorted((run / "trainer").glob("metrics-*.json"))]
    times = [m["time"] for m in metrics]
    rate = 60.0 * (len(times) - 1) / (times[-1] - times[0]) if len(times) > 2 else 0.0
    beats = [json.loads(p.read_text()) for p in sorted((run / "workers").glob("*.json"))]
    gen = sum(b.get("generate_seconds", 0.0) for b in beats)
    wait = sum(b.get("commit_wait_seconds", 0.0) for b in beats)
    status = (
        json.loads((run / "trainer" / "status.json").read_text())
        if (run / "trainer" / "status.json").exists()
        else {}
    )
    return {
        "arm": arm,
        "versions": len(metrics),
        "versions_per_min": round(rate, 2),
        # mean staleness of the rows trained on: committing ahead draws a cohort at the version staged when
        # it was committed
        "stale_mean": round(statistics.mean(m.get("stale_mean", 0.0) for m in metrics), 3)
        if metrics
        else None,
        "trainer_wait_s": info["wait_s"],
        "worker_generate_s": round(gen, 1),
        "worker_tick_wait_s": round(wait, 1),
        "groups": sum(b.get("groups", 0) for b in beats),
        "drops": info["drops"],
        "ticks": status.get("ticks"),
        "quarantined": status.get("quarantined"),
        "folder": info["folder"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--speeds", default="1", help="comma-separated worker speeds")
    p.add_argument(
        "--slowdown", type=float, default=3.0, help="every worker this many times slower than here"
    )
    p.add_argument("--seconds", type=float, default=60.0, help="seconds per run after start-up")
    p.add_argument("--startup-s", type=float, default=15.0, help="added to each run's budget for start-up")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--arms", default="off,ahead,wait")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    arms = args.arms.split(",")
    print(f"bench_commit_ahead: speeds={args.speeds} slowdown={args.slowdown} seconds={args.seconds} "
          f"reps={args.reps} arms={arms} extra={extra}", flush=True)  # fmt: skip
    rows: list[dict[str, Any]] = []
    for rep in range(args.reps):
        for arm in arms:
            t0 = time.time()
            row = one(arm, args, extra)
            row["rep"] = rep
            rows.append(row)
            print(json.dumps(row), f"({time.time() - t0:.0f} s)", flush=True)
    base = statistics.median(r["versions_per_min"] for r in rows if r["arm"] == arms[0])
    for arm in arms:
        mine = [r for r in rows if r["arm"] == arm]
        rate = statistics.median(r["versions_per_min"] for r in mine)
        print(
            f"{arm:6} versions/min {' '.join(str(r['versions_per_min']) for r in mine)} (median {rate:.2f}, "
            f"{rate / base:.2f}x {arms[0]}); worker tick wait "
            f"{' '.join(str(r['worker_tick_wait_s']) for r in mine)} s of generate "
            f"{' '.join(str(r['worker_generate_s']) for r in mine)} s; trainer wait "
            f"{' '.join(str(r['trainer_wait_s']) for r in mine)} s; staleness "
            f"{' '.join(str(r['stale_mean']) for r in mine)}",
            flush=True,
        )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
