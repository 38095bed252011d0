"""The synchronous GRPO baseline of `bench_async.py`, and the moving reward window both systems are timed by.

`run_sync` alternates generate → score → one optimizer step in one process with the pieces the fleet uses
(`generate_cohort` on the pnyx engine, the env's verifier, `train_step`), each simulated worker's share of a
step throttled to its speed, every step waiting for the slowest share (bench_async.py's docstring has the
rules). Imported by bench_async.py from this folder; not run on its own.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any


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


@dataclass
class SimWorker:
    """One simulated worker of the synchronous loop."""

    index: int
    speed: float
    leaves_at: float | None = None  # seconds after the first rollout (None: stays)
    gone: bool = False
    last_share_s: float = 0.0


def run_sync(
    cfg: Any,
    window: RewardWindow,
    budget_s: float,
    threads: int,
    speeds: list[float],
    slowdown: float,
    leaver: int | None,
    leave_after_s: float,
    timeout_x: float,
) -> dict[str, Any]:
    """The synchronous baseline: every step, each live worker generates its share of the batch with the
    current weights (throttled to its speed), the step waits for the last share, then trains."""
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
    n_batch = cfg.trainer.groups_per_step
    workers = [SimWorker(i, s) for i, s in enumerate(speeds)]
    steps = cohorts = seq = 0
    waited_s = gen_s = train_s = 0.0
    stream = env.stream("train", cfg.run.seed)

    def next_seq() -> int:
        nonlocal seq
        seq += 1
        return seq

    def now() -> float:
        return time.time() - t0

    while now() < budget_s and window.hit_s is None:
        phase0 = now()
        first = window.first_s
        if (
            leaver is not None
            and not workers[leaver].gone
            and first is not None
            and phase0 >= first + leave_after_s
        ):
            lost = workers[leaver]  # it left: this step waits the straggler timeout for it, then goes on
            timeout = timeout_x * lost.last_share_s
            time.sleep(timeout)
            waited_s += timeout
            lost.gone = True
            phase0 = now()
        live = sorted((x for x in workers if not x.gone), key=lambda x: x.speed)  # slowest first
        shares = {x.index: n_batch // len(live) for x in live}
        for x in sorted(live, key=lambda x: x.index)[: n_batch % len(live)]:
            shares[x.index] += 1
        batch: list[ScoredGroup] = []
        cpu_done = phase0  # the CPU is one: shares are generated one after another
        done_at: list[tuple[float, list[float]]] = []
        for x in live:
            have, sleep_s, rewards = 0, 0.0, []
            while have < shares[x.index] and now() < budget_s:
                tasks = [next(stream) for _ in range(shares[x.index] - have)]
                spec = CohortSpec(
                    run_id="sync", worker_id=f"sync-{x.index}", version=steps, digest="-",
                    group_size=w.group_size, temperature=w.temperature, top_p=w.top_p, top_k=w.top_k,
                    max_new_tokens=max_new, seed=cfg.run.seed * 1_000_003 + cohorts,
                )  # fmt: skip
                model.eval()
                g0 = time.time()
                result = generate_cohort(engine, tok, env, tasks, spec, next_seq)
                took = time.time() - g0
                sleep_s += (slowdown / x.speed - 1.0) * took
                cohorts += 1
                for g in result.groups:
                    r = [s.reward for s in g.samples]
                    rewards.extend(r)
                    if is_zero_variance(r):
                        continue
                    have += 1
                    batch.append(
                        ScoredGroup(
                            key=f"sync-{g.seq}", version=steps, worker_id=f"sync-{x.index}",
                            task_id=g.task_id, group=g, rewards=r,
                            advantages=group_advantages(r, cfg.algorithm.advantage), worker_rewards=r,
                        )
                    )  # fmt: skip
            cpu_done = now()
            x.last_share_s = cpu_done - phase0 + sleep_s
            done_at.append((cpu_done + sleep_s, rewards))
        end = max(t for t, _ in done_at)
        gen_s += end - phase0
        if end > now():
            time.sleep(end - now())  # the slow workers' shares are still being generated elsewhere
        for t, rewards in sorted(done_at, key=lambda d: d[0]):
            window.add(rewards, t)
        if len(batch) < n_batch or window.hit_s is not None:
            break
        s0 = time.time()
        train_step(
            model, opt, batch[:n_batch], settings, micro_batch_tokens=cfg.trainer.micro_batch_tokens,
            grad_clip=cfg.trainer.grad_clip, max_len=max_new,
        )  # fmt: skip
        train_s += time.time() - s0
        steps += 1
    return {
        "steps": steps,
        "seconds": round(now(), 1),
        "generate_s": round(gen_s, 1),
        "train_s": round(train_s, 1),
        "timeout_s": round(waited_s, 1),
    }
