"""Time to a target training reward: the pnyx fleet (`pnyx run`) against a synchronous GRPO loop.

Both systems run on this machine in one invocation, on the same model, task, group size, batch (groups
per step), learning rate and algorithm settings:

- **sync**: one process alternates generate → score → one optimizer step, with the same pieces the fleet
  uses (the worker's `generate_cohort` on the pnyx engine, the environment's verifier, the trainer's
  `train_step` and loss settings), with `--sync-threads` torch threads (default 1: for the tiny model,
  two threads on a shared 2-core box were measured 10-50x slower per cohort than one).
- **fleet**: `pnyx run --no-live` (one trainer process + N worker processes meeting in a local-folder store),
  started as a subprocess; this script watches the rollout groups the workers upload.

Training reward = mean reward of the last `--window` completions generated (every completion counts, also
those in zero-variance groups the trainer drops), by generation time since the system started (process
start and model loading included). The time to target is the first time that moving mean reaches
`--target`. Prints both times and the ratio sync/fleet (> 1: the fleet is faster).

    python benchmarks/bench_async.py --target 0.5 --budget-s 420 --workers 1
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


class RewardWindow:
    """Moving mean over the last `size` completions; remembers when it first reached the target."""

    def __init__(self, size: int, target: float):
        self.values: deque[float] = deque(maxlen=size)
        self.target = target
        self.hit_s: float | None = None
        self.first_s: float | None = None
        self.curve: list[tuple[float, float]] = []

    @property
    def after_first_s(self) -> float | None:
        """Time to target counted from the first scored completion (process start-up excluded)."""
        return None if self.hit_s is None or self.first_s is None else self.hit_s - self.first_s

    def add(self, rewards: list[float], t: float) -> None:
        if self.first_s is None:
            self.first_s = t
        self.values.extend(rewards)
        if len(self.values) == self.values.maxlen:
            mean = sum(self.values) / len(self.values)
            self.curve.append((round(t, 2), round(mean, 4)))
            if self.hit_s is None and mean >= self.target:
                self.hit_s = t


def run_sync(cfg: Any, window: RewardWindow, budget_s: float, threads: int) -> dict[str, Any]:
    """The synchronous baseline: generate a batch with the current weights, then train on it, repeat."""
    import torch

    from pnyx.config import resolve_env_kwargs, resolve_max_new_tokens
    from pnyx.envs import get_env
    from pnyx.models import load_model, load_tokenizer
    from pnyx.models.source import resolve_model_path
    from pnyx.protocol.rules import is_zero_variance
    from pnyx.rollout.cohort import CohortSpec, generate_cohort
    from pnyx.rollout.engines import make_engine
    from pnyx.train.advantages import group_advantages
    from pnyx.train.ingest import ScoredGroup
    from pnyx.train.loop import loss_settings
    from pnyx.train.step import make_optimizer, train_step

    t0 = time.time()
    torch.set_num_threads(threads)
    torch.manual_seed(cfg.run.seed)
    path = resolve_model_path(cfg)
    model = load_model(path, dtype="float32")
    tok = load_tokenizer(path)
    env = get_env(cfg.env.name, **resolve_env_kwargs(cfg))
    max_new = resolve_max_new_tokens(cfg.worker.max_new_tokens, env)
    opt = make_optimizer(model, cfg.trainer.lr, tuple(cfg.trainer.betas), cfg.trainer.weight_decay)
    engine = make_engine("torch", None, tok, model=model)
    settings = loss_settings(cfg)
    w = cfg.worker
    steps = cohorts = seq = 0
    stream = env.stream("train", cfg.run.seed)
    while time.time() - t0 < budget_s and window.hit_s is None:
        batch: list[ScoredGroup] = []
        while len(batch) < cfg.trainer.groups_per_step and time.time() - t0 < budget_s:
            tasks = [next(stream) for _ in range(w.prompts_per_cohort)]
            spec = CohortSpec(
                run_id="sync",
                worker_id="sync",
                version=steps,
                digest="-",
                group_size=w.group_size,
                temperature=w.temperature,
                top_p=w.top_p,
                top_k=w.top_k,
                max_new_tokens=max_new,
                seed=cfg.run.seed * 1_000_003 + cohorts,
            )
            model.eval()

            def next_seq() -> int:
                nonlocal seq
                seq += 1
                return seq

            result = generate_cohort(engine, tok, env, tasks, spec, next_seq)
            cohorts += 1
            for g in result.groups:
                rewards = [s.reward for s in g.samples]
                window.add(rewards, time.time() - t0)
                if is_zero_variance(rewards):
                    continue
                batch.append(
                    ScoredGroup(
                        key=f"sync-{g.seq}",
                        version=steps,
                        worker_id="sync",
                        task_id=g.task_id,
                        group=g,
                        rewards=rewards,
                        advantages=group_advantages(rewards, cfg.algorithm.advantage),
                        worker_rewards=rewards,
                    )
                )
        if len(batch) < cfg.trainer.groups_per_step:
            break
        train_step(
            model,
            opt,
            batch[: cfg.trainer.groups_per_step],
            settings,
            micro_batch_tokens=cfg.trainer.micro_batch_tokens,
            grad_clip=cfg.trainer.grad_clip,
            max_len=max_new,
        )
        steps += 1
    return {"steps": steps, "seconds": round(time.time() - t0, 1)}


def _new_groups(store: Any, seen: set[str]) -> list[Any]:
    from pnyx.errors import NotFoundError, RecordRejected
    from pnyx.protocol import decode_group, layout

    out = []
    for meta in store.list(layout.ROLLOUTS_PREFIX):
        if meta.key in seen or layout.parse_rollout_key(meta.key) is None:
            continue
        seen.add(meta.key)
        try:
            out.append(decode_group(store.get(meta.key)))
        except (NotFoundError, RecordRejected):
            continue
    return out


def run_fleet(overrides: list[str], window: RewardWindow, budget_s: float, workers: int) -> dict[str, Any]:
    """`pnyx run --no-live` in a scratch folder, stopped (Ctrl-C) as soon as the target is reached."""
    from pnyx.store import open_store

    scratch = Path(tempfile.mkdtemp(prefix="pnyx-bench-async-"))
    name = "bench"
    cmd = [
        sys.executable,
        "-m",
        "pnyx",
        "run",
        "--no-live",
        "--workers",
        str(workers),
        f"--run.name={name}",
        f"--run.time_budget_s={budget_s}",
        "--run.eval_every=0",
        "--run.eval_tasks=50",
        *overrides,
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.time()
    store_dir = scratch / "runs" / name
    seen: set[str] = set()
    with open(scratch / "orchestrator.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=scratch, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        while proc.poll() is None:
            time.sleep(1.0)
            if not (store_dir / "run.json").exists():
                continue
            groups = sorted(_new_groups(open_store(store_dir), seen), key=lambda g: g.created_at)
            for g in groups:
                window.add([s.reward for s in g.samples], g.created_at - t0)
            if window.hit_s is not None:
                proc.send_signal(signal.SIGINT)
                break
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    versions = len(list((store_dir / "weights").glob("v*/manifest*.json"))) if store_dir.exists() else 0
    return {
        "versions": max(0, versions - 1),
        "seconds": round(time.time() - t0, 1),
        "folder": str(scratch),
        "exit_code": proc.returncode,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=float, default=0.5, help="training reward to reach")
    ap.add_argument("--window", type=int, default=256, help="completions in the moving mean")
    ap.add_argument("--budget-s", type=float, default=420.0, help="give up on a system after this long")
    ap.add_argument("--workers", type=int, default=1, help="fleet worker processes")
    ap.add_argument("--only", choices=["sync", "fleet"], default=None, help="run one system only")
    ap.add_argument(
        "--sync-threads",
        type=int,
        default=1,
        help="torch threads of the synchronous loop (1 is fastest for the tiny model on a shared box)",
    )
    ap.add_argument("overrides", nargs="*", help="dotted config overrides for both, e.g. --trainer.lr=3e-4")
    args, extra = ap.parse_known_args()
    overrides = [*args.overrides, *extra]

    from pnyx.config import load_config

    cfg = load_config(None, overrides)
    print(
        f"bench_async: env={cfg.env.name} G={cfg.worker.group_size} groups/step={cfg.trainer.groups_per_step} "
        f"lr={cfg.trainer.lr} target={args.target} window={args.window} cores={os.cpu_count()} "
        f"sync_threads={args.sync_threads} fleet_workers={args.workers}",
        flush=True,
    )
    results: dict[str, Any] = {}
    if args.only in (None, "sync"):
        w = RewardWindow(args.window, args.target)
        info = run_sync(cfg, w, args.budget_s, args.sync_threads)
        results["sync"] = _result(w, info)
        print(
            f"sync : time to {args.target} = {_s(w.hit_s)}, after the first rollout {_s(w.after_first_s)}  ({info})",
            flush=True,
        )
    if args.only in (None, "fleet"):
        w = RewardWindow(args.window, args.target)
        info = run_fleet(overrides, w, args.budget_s, args.workers)
        results["fleet"] = _result(w, info)
        print(
            f"fleet: time to {args.target} = {_s(w.hit_s)}, after the first rollout {_s(w.after_first_s)}  ({info})",
            flush=True,
        )
    for key, label in (
        ("time_to_target_s", "from process start"),
        ("after_first_rollout_s", "from the first rollout"),
    ):
        s, f = (results.get(k, {}).get(key) for k in ("sync", "fleet"))
        if s and f:
            print(f"ratio sync/fleet {label} = {s / f:.2f}x (> 1: the fleet reaches the target sooner)")
    print(json.dumps(results))


def _result(w: RewardWindow, info: dict[str, Any]) -> dict[str, Any]:
    return {
        "time_to_target_s": None if w.hit_s is None else round(w.hit_s, 1),
        "after_first_rollout_s": None if w.after_first_s is None else round(w.after_first_s, 1),
        "start_reward": w.curve[0][1] if w.curve else None,
        "curve": w.curve[:: max(1, len(w.curve) // 40)],
        **info,
    }


def _s(x: float | None) -> str:
    return "not reached" if x is None else f"{x:.1f}s"


if __name__ == "__main__":
    main()
