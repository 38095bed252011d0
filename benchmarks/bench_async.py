"""Time to a target training reward: the pnyx fleet against a synchronous GRPO loop with the same workers.

Two arms, each run by both systems in one invocation, on the same model, task, group size, batch (groups
per step), learning rate and algorithm settings (task screening and the curriculum off in both: the synchronous
loop samples the plain task stream, and a worker choosing harder tasks would lower its training reward):

- **equal** (`--arm equal`): one worker at full speed. sync = one process alternating generate → score →
  one optimizer step with the pieces the fleet uses (`generate_cohort` on the pnyx engine, the env's
  verifier, `train_step`), `--sync-threads` torch threads; fleet = `pnyx trainer` + one `pnyx worker`
  process meeting in a local-folder store (the 2 cores split as `pnyx run` splits them: one thread each).
- **hetero** (`--arm hetero`): the same workers of unequal speed in both systems (default `--speeds
  1,1,0.5,0.25,1`; the last, `--leaver`, leaves `--leave-after-s` after the first rollout).

How unequal speed is simulated (this machine has 2 cores, not 5 machines): a worker of speed s generates on
the real CPU, then sleeps `(slowdown / s - 1)` times the measured wall time of that generation, so its
cohort takes `slowdown / s` times what it took here (a sleep uses no CPU). `--slowdown` (K) makes every
worker K times slower than this machine, so that generation dominates a synchronous step as it does in LM
RL post-training (the tiny model generates a batch in a fraction of its train step); K=1 is no extra
slowdown. The fleet's workers run this throttle in their own processes (this script wraps the engine's
`generate_cohort` in `pnyx worker`: `--worker-proc`); the synchronous loop applies the same throttle to each
worker's share of every step:

- sync, per step: the live workers split the batch equally (the usual data-parallel rollout: each makes
  its share of non-zero-variance groups, the remainder to the first workers); the generating is done by this
  one process, worker after worker (slowest first), and each worker's share is done at (CPU time of the
  shares generated before it, its own included) + its sleeps; the step trains when the last share is done,
  so every step waits for the slowest worker. A worker that left makes the next step wait a straggler
  timeout of `--sync-timeout-x` times that worker's share time in its last step, after which its share is
  split among the others (the fairest reasonable sync baseline: it neither stalls nor waits the fleet's
  30 s liveness window).
- fleet: each worker generates as fast as its speed and supply control allow; the trainer takes the
  freshest groups; the leaver is SIGKILLed (no goodbye).

Training reward = mean reward of the last `--window` completions generated (every completion counts, also
those of zero-variance groups: the fleet's workers log every cohort's rewards to a side file, since they do
not upload zero-variance groups). Time to target is counted from each system's first rollout (process
start-up and model loading excluded: both systems pay it once, the fleet's processes in parallel) and,
also printed, from process start. Prints both, the ratio sync/fleet (> 1: the fleet is faster) and the load
average.

With `--seeds 1,2,3,4,5` both systems run once per seed (the seed decides the task stream and the
sampling) and the summary compares the medians: one seed's time to a noisy target says as much about its
luck as about the system (the fleet needed 38 versions in one run and 57 in the next, the loop 43 steps
in both).

    python benchmarks/bench_async.py --arm equal
    python benchmarks/bench_async.py --arm hetero --slowdown 3
    python benchmarks/bench_async.py --arm equal --seeds 1,2,3,4,5 --budget-s 120
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from sync_loop import RewardWindow, run_sync  # noqa: E402 - this folder's module (sys.path[0])

# --- the fleet ---------------------------------------------------------------------------------------------


def worker_proc(argv: list[str]) -> None:
    """`--worker-proc`: run `pnyx worker` with this process's generation throttled to `--speed` (see the
    module docstring), logging every cohort's rewards to `--rewards` (JSON lines)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--speed", type=float, required=True)
    ap.add_argument("--slowdown", type=float, default=1.0)
    ap.add_argument("--rewards", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--id", required=True)
    ap.add_argument("--spool-dir", required=True)
    args = ap.parse_args(argv)
    import pnyx.rollout.cohort as cohort

    real = cohort.generate_cohort
    out = open(args.rewards, "a")  # noqa: SIM115 - lives as long as the process

    def throttled(*a: Any, **k: Any) -> Any:
        t = time.time()
        result = real(*a, **k)
        time.sleep(max(0.0, (args.slowdown / args.speed - 1.0) * (time.time() - t)))
        rewards = [s.reward for g in result.groups for s in g.samples]
        out.write(json.dumps({"t": time.time(), "rewards": rewards}) + "\n")
        out.flush()
        return result

    cohort.generate_cohort = throttled  # the worker imports it from the module at each cohort
    from pnyx.cli.worker import worker_main

    worker_main(store=args.store, worker_id=args.id, threads=1, spool_dir=args.spool_dir)


def run_fleet(
    cfg: Any,
    window: RewardWindow,
    budget_s: float,
    speeds: list[float],
    slowdown: float,
    leaver: int | None,
    leave_after_s: float,
) -> dict[str, Any]:
    """`pnyx trainer` + one throttled `pnyx worker` per speed, all started at once on a local-folder store;
    stopped (SIGINT) as soon as the target is reached."""
    from pnyx.cli.run_fleet import thread_split
    from pnyx.cli.run_folder import trusted_with_local_workers
    from pnyx.config import to_toml, with_fields

    scratch = Path(tempfile.mkdtemp(prefix="pnyx-bench-async-"))
    store = scratch / "run"
    cfg = with_fields(
        cfg, {"store.url": str(store), "security.trusted_keys": trusted_with_local_workers(cfg)}
    )  # the user's own workers, as `pnyx run` trusts them
    (scratch / "config.toml").write_text(to_toml(cfg))
    trainer_threads, _ = thread_split(len(speeds))
    base_env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    base_env.update(TOKENIZERS_PARALLELISM="false")
    procs: list[subprocess.Popen] = []
    t0 = time.time()

    def spawn(args: list[str], threads: int, log: str) -> subprocess.Popen:
        env = dict(base_env, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        with open(scratch / log, "wb") as fh:
            p = subprocess.Popen(
                [sys.executable, *args], cwd=scratch, stdout=fh, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,
            )  # fmt: skip
        procs.append(p)
        return p

    trainer = spawn(
        ["-m", "pnyx", "trainer", "--store", str(store), "--config", str(scratch / "config.toml")],
        trainer_threads,
        "trainer.log",
    )
    files = []
    workers = []
    for i, s in enumerate(speeds):
        files.append(scratch / f"rewards-{i}.jsonl")
        workers.append(
            spawn(
                [
                    str(Path(__file__).resolve()), "--worker-proc", "--speed", str(s), "--slowdown",
                    str(slowdown), "--rewards", str(files[-1]), "--store", str(store), "--id", f"w{i}",
                    "--spool-dir", str(scratch / "spool"),
                ],
                1,
                f"worker-{i}.log",
            )
        )  # fmt: skip
    offsets = [0] * len(files)
    left = False
    try:
        while trainer.poll() is None and time.time() - t0 < budget_s:
            time.sleep(0.2)
            lines = []
            for i, f in enumerate(files):
                if not f.exists():
                    continue
                with open(f) as fh:
                    fh.seek(offsets[i])
                    data = fh.read()
                cut = data.rfind("\n") + 1  # whole lines only
                offsets[i] += len(data[:cut].encode())
                lines += [json.loads(x) for x in data[:cut].splitlines()]
            for rec in sorted(lines, key=lambda r: r["t"]):
                window.add(rec["rewards"], rec["t"] - t0)
            if window.hit_s is not None:
                break
            if all(p.poll() is not None for i, p in enumerate(workers) if i != leaver or not left):
                print(f"fleet: every worker exited; see {scratch}/worker-*.log", flush=True)
                break
            first = window.first_s
            if (
                leaver is not None
                and not left
                and first is not None
                and time.time() - t0 >= first + leave_after_s
            ):
                os.killpg(workers[leaver].pid, signal.SIGKILL)  # leaves without a goodbye
                left = True
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
    metrics = sorted((store / "trainer").glob("metrics-*.json"))
    last = json.loads(metrics[-1].read_text()) if metrics else {}
    steps = [json.loads(m.read_text()) for m in metrics]
    return {
        "versions": len(metrics),
        "seconds": round(time.time() - t0, 1),
        "folder": str(scratch),
        "drops": last.get("drops", {}),
        "step_s_median": _median([m.get("step_s", 0.0) for m in steps]),
        "publish_s_median": _median([m.get("publish_s", 0.0) for m in steps]),
        "ingest_wait_s_median": _median([m.get("ingest_wait_s", 0.0) for m in steps]),
        # versions whose step waited over 0.05 s for groups, and the seconds all steps waited
        "waits": sum(m.get("ingest_wait_s", 0.0) > 0.05 for m in steps),
        "wait_s": round(sum(m.get("ingest_wait_s", 0.0) for m in steps), 1),
    }


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


# --- main ----------------------------------------------------------------------------------------------


ARMS = {
    "equal": {"speeds": "1", "leaver": None, "slowdown": 1.0},
    "hetero": {"speeds": "1,1,0.5,0.25,1", "leaver": 4, "slowdown": 3.0},
}


def main() -> None:
    if "--worker-proc" in sys.argv:
        worker_proc([a for a in sys.argv[1:] if a != "--worker-proc"])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", choices=sorted(ARMS), default="equal")
    ap.add_argument("--speeds", default=None, help="comma-separated worker speeds (default: the arm's)")
    ap.add_argument("--slowdown", type=float, default=None, help="every worker K times slower than here")
    ap.add_argument("--leaver", type=int, default=None, help="index of the worker that leaves mid-run")
    ap.add_argument(
        "--leave-after-s", type=float, default=20.0, help="when it leaves, after the first rollout"
    )
    ap.add_argument("--sync-timeout-x", type=float, default=2.0, help="sync straggler timeout / share time")
    ap.add_argument("--target", type=float, default=0.5, help="training reward to reach")
    ap.add_argument("--window", type=int, default=256, help="completions in the moving mean")
    ap.add_argument("--budget-s", type=float, default=420.0, help="give up on a system after this long")
    ap.add_argument("--only", choices=["sync", "fleet"], default=None, help="run one system only")
    ap.add_argument("--sync-threads", type=int, default=1, help="torch threads of the synchronous loop")
    ap.add_argument(
        "--seeds", default=None, help="comma-separated run seeds: both systems once per seed, then medians"
    )
    ap.add_argument("overrides", nargs="*", help="dotted config overrides for both, e.g. --trainer.lr=3e-4")
    args, extra = ap.parse_known_args()
    arm = ARMS[args.arm]
    speeds = [float(s) for s in (args.speeds or arm["speeds"]).split(",")]
    leaver = args.leaver if args.leaver is not None else arm["leaver"]
    if leaver is not None and args.speeds is not None and leaver >= len(speeds):
        leaver = None
    slowdown = args.slowdown if args.slowdown is not None else arm["slowdown"]
    overrides = [
        "--worker.screen=1",
        "--worker.curriculum=false",  # the loop samples the plain stream; task choice would bias the reward
        "--run.time_budget_s=100000",
        "--run.steps=100000",
        *args.overrides,
        *extra,
    ]

    from pnyx.config import load_config

    cfg = load_config(None, overrides)
    print(
        f"bench_async arm={args.arm}: env={cfg.env.name} G={cfg.worker.group_size} "
        f"groups/step={cfg.trainer.groups_per_step} lr={cfg.trainer.lr} target={args.target} "
        f"window={args.window} cores={os.cpu_count()} speeds={speeds} slowdown={slowdown} leaver={leaver} "
        f"leave_after_s={args.leave_after_s} load={_load()}",
        flush=True,
    )
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [cfg.run.seed]
    runs: list[dict[str, Any]] = []
    for seed in seeds:
        if args.seeds:
            cfg = load_config(None, [*overrides, f"--run.seed={seed}"])
            print(f"-- seed {seed}", flush=True)
        results: dict[str, Any] = {}
        for system in ("sync", "fleet"):
            if args.only not in (None, system):
                continue
            w = RewardWindow(args.window, args.target)
            if system == "sync":
                info = run_sync(
                    cfg, w, args.budget_s, args.sync_threads, speeds, slowdown, leaver, args.leave_after_s,
                    args.sync_timeout_x,
                )  # fmt: skip
            else:
                info = run_fleet(cfg, w, args.budget_s, speeds, slowdown, leaver, args.leave_after_s)
            results[system] = {**_result(w), **info, "load_after": _load()}
            print(
                f"{system:5}: time to {args.target} from the first rollout {_s(w.after_first_s)}, from process "
                f"start {_s(w.hit_s)}  ({info}) load={_load()}",
                flush=True,
            )
        for key, label in (
            ("after_first_rollout_s", "from the first rollout"),
            ("time_to_target_s", "from process start"),
        ):
            s, f = (results.get(k, {}).get(key) for k in ("sync", "fleet"))
            if s and f:
                print(f"ratio sync/fleet {label} = {s / f:.2f}x (> 1: the fleet reaches the target sooner)")
        print(json.dumps({"seed": cfg.run.seed, **results}), flush=True)
        runs.append(results)
    if len(runs) > 1:
        _summary(runs, args.budget_s)


def _summary(runs: list[dict[str, Any]], budget_s: float) -> None:
    """Per system, the median over seeds of its time to target (a seed that never reached it counts as the
    budget) and of its versions or steps, and the ratio of the medians: each system's own luck averaged out
    (a seed decides the task stream and the sampling; the fleet's timing adds its own)."""
    med: dict[str, float] = {}
    for system in ("sync", "fleet"):
        times = [r[system]["after_first_rollout_s"] or budget_s for r in runs if system in r]
        counts = [r[system].get("steps") or r[system].get("versions") or 0 for r in runs if system in r]
        if times:
            med[system] = statistics.median(times)
            print(
                f"{system:5} over {len(times)} seeds: time to target from the first rollout "
                f"{' '.join(f'{t:.1f}' for t in times)} s, median {med[system]:.1f} s; steps/versions "
                f"{' '.join(str(c) for c in counts)}, median {statistics.median(counts):g}"
            )
    if len(med) == 2:
        print(
            f"ratio of the medians sync/fleet = {med['sync'] / med['fleet']:.2f}x (> 1: the fleet is faster)"
        )


def _result(w: RewardWindow) -> dict[str, Any]:
    return {
        "time_to_target_s": None if w.hit_s is None else round(w.hit_s, 1),
        "after_first_rollout_s": None if w.after_first_s is None else round(w.after_first_s, 1),
        "start_reward": w.curve[0][1] if w.curve else None,
        "curve": w.curve[:: max(1, len(w.curve) // 40)],
    }


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _s(x: float | None) -> str:
    return "not reached" if x is None else f"{x:.1f}s"


if __name__ == "__main__":
    main()
