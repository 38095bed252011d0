"""SAPO experiment: cumulative reward of a 4-node swarm for I/J mixes 8/0, 6/2, 4/4, 2/6, and onpolicy vs gated.

Every configuration runs `--nodes` SAPO nodes (pnyx `SwarmNode`s) round-robin in this one process (one
torch runtime instead of four), meeting through a real local-folder store (a fresh temporary folder per
run). Each node starts from the same model (default: the shipped tiny base model) and has its own task
distribution (an `arith` variant per node: other operators and digit counts, all inside what the
shipped model was pretrained on), so sharing carries
knowledge a node's own stream does not. Every node trains on I + J = `--batch` groups of `--group-size`
completions per round; I is also how many groups it generates and shares.

Metric (as in SAPO): cumulative reward = Σ over rounds and nodes of the mean reward (the node's own
verifier) of the completions that node generated in that round. Per configuration: mean over seeds, a
95% t-interval over seeds, and the ratio to 8/0 with a 95% bootstrap interval (seeds resampled within
each configuration, 10,000 resamples). Whatever it shows is printed as a markdown table.

    python benchmarks/bench_swarm.py                       # the default experiment (~15 min on 2 loaded cores)
    python benchmarks/bench_swarm.py --rounds 20 --seeds 5 --configs 8/0:gated,4/4:gated,4/4:onpolicy
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# One task distribution per node (cycled if there are more nodes): same verifier family, other problems.
NODE_TASKS = [
    {"digits": 2, "ops": ["+"]},
    {"digits": 2, "ops": ["-"]},
    {"digits": 1, "ops": ["+", "-"]},
    {"digits": [1, 2], "ops": ["+", "-"]},
]
DEFAULT_CONFIGS = "8/0:gated,6/2:gated,4/4:gated,2/6:gated,4/4:onpolicy"
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def parse_configs(text: str, batch: int) -> list[tuple[int, int, str]]:
    out = []
    for item in text.split(","):
        mix, _, mode = item.partition(":")
        i, j = (int(x) for x in mix.split("/"))
        if i + j != batch:
            raise SystemExit(f"config {item}: I + J must equal --batch {batch}")
        if mode not in ("gated", "onpolicy"):
            raise SystemExit(f"config {item}: foreign mode must be gated or onpolicy")
        out.append((i, j, mode))
    return out


def evaluate(node, n_tasks: int, samples: int, node_index: int) -> float:
    """Mean reward of `samples` completions per held-out task of this node's own distribution (pass@1).

    The tasks are the same for every configuration and seed (test split, fixed seed), so this compares
    policies on equal terms, unlike the cumulative metric whose tasks depend on I.
    """
    from pnyx.models import render_prompt
    from pnyx.rollout.engine import SamplingParams

    tasks = node.env.sample("test", 10_000 + node_index, n_tasks)
    prompts = [render_prompt(node.tokenizer, t.prompt) for t in tasks for _ in range(samples)]
    w = node.cfg.worker
    params = SamplingParams(temperature=w.temperature, max_new_tokens=node.max_new_tokens, stop=list(node.env.stop_strings), seed=123)
    node.model.eval()
    outs = node.engine.generate(prompts, params)
    rewards = [node.env.score(tasks[i // samples], o.text).reward for i, o in enumerate(outs)]
    return statistics.fmean(rewards)


def run_once(args: argparse.Namespace, i: int, j: int, mode: str, seed: int) -> dict:
    """One swarm run; returns per-round, per-node local rewards and step statistics."""
    from pnyx.config import load_config
    from pnyx.store import open_store
    from pnyx.swarm.node import open_node

    with tempfile.TemporaryDirectory(prefix="bench-swarm-") as root:
        store = open_store(root)
        nodes = []
        for k in range(args.nodes):
            cfg = load_config(
                overrides={
                    "run": {"seed": seed},
                    "env": {"name": "arith", "kwargs": NODE_TASKS[k % len(NODE_TASKS)]},
                    "worker": {"group_size": args.group_size, "max_new_tokens": args.max_new_tokens},
                    "trainer": {"lr": args.lr},
                    "swarm": {
                        "local_groups": i,
                        "external_groups": j,
                        "foreign": mode,
                        "prefer": args.prefer,
                        "max_per_peer": args.max_per_peer,
                        "window_s": 3600.0,
                        "peer_timeout_s": 3600.0,
                    },
                }
            )
            nodes.append(open_node(store, f"node{k}", cfg, args.model, accept_envs={"arith"}))
        rewards = [[0.0] * args.nodes for _ in range(args.rounds)]
        masked, ext_used, paths, steps = [], 0, {}, 0
        for r in range(args.rounds):
            for k, node in enumerate(nodes):
                st = node.round()
                rewards[r][k] = st.local_reward
                ext_used += st.trained_external
                for p, c in st.paths.items():
                    paths[p] = paths.get(p, 0) + c
                if st.step is not None:
                    steps += 1
                    masked.append(st.step.masked_frac)
        held_out = [evaluate(node, args.eval_tasks, args.eval_samples, k) for k, node in enumerate(nodes)] if args.eval_tasks else []
        drops: dict[str, int] = {}
        for node in nodes:
            for reason, c in node.drops.items():
                drops[reason] = drops.get(reason, 0) + c
    return {
        "i": i,
        "j": j,
        "mode": mode,
        "seed": seed,
        "rewards": rewards,
        "cumulative": sum(map(sum, rewards)),
        "steps": steps,
        "external_trained": ext_used,
        "paths": paths,
        "masked_frac": statistics.fmean(masked) if masked else 0.0,
        "drops": drops,
        "held_out": held_out,
    }


def base_held_out(args: argparse.Namespace) -> float:
    """The held-out metric of the untrained model (every node), the reference for the column 'after'."""
    from pnyx.config import load_config
    from pnyx.store import open_store
    from pnyx.swarm.node import open_node

    vals = []
    store = open_store("memory://bench-swarm-base")
    for k in range(args.nodes):
        cfg = load_config(
            overrides={
                "env": {"name": "arith", "kwargs": NODE_TASKS[k % len(NODE_TASKS)]},
                "worker": {"group_size": args.group_size, "max_new_tokens": args.max_new_tokens},
            }
        )
        vals.append(evaluate(open_node(store, f"base{k}", cfg, args.model), args.eval_tasks, args.eval_samples, k))
    return statistics.fmean(vals)


def t_interval(xs: list[float]) -> tuple[float, float]:
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, float("nan")
    half = T_975.get(len(xs) - 1, 1.96) * statistics.stdev(xs) / math.sqrt(len(xs))
    return m, half


def bootstrap_ratio(xs: list[float], base: list[float], n: int = 10_000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    ratios = []
    for _ in range(n):
        a = statistics.fmean(rng.choices(xs, k=len(xs)))
        b = statistics.fmean(rng.choices(base, k=len(base)))
        if b > 0:
            ratios.append(a / b)
    ratios.sort()
    if not ratios:
        return float("nan"), float("nan")
    return ratios[int(0.025 * len(ratios))], ratios[int(0.975 * len(ratios)) - 1]


def table(results: list[dict], args: argparse.Namespace) -> str:
    by_cfg: dict[tuple[int, int, str], list[dict]] = {}
    for res in results:
        by_cfg.setdefault((res["i"], res["j"], res["mode"]), []).append(res)
    base_key = next((k for k in by_cfg if k[1] == 0), None)
    base = [r["cumulative"] for r in by_cfg[base_key]] if base_key else []
    base_mean = statistics.fmean(base) if base else float("nan")
    lines = [
        f"| I/J | foreign | seeds | cumulative reward (mean ± 95% t) | per seed | ratio to {args.batch}/0 [95% bootstrap] "
        "| held-out reward after (mean ± 95% t) | last-round reward | masked | foreign groups trained |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (i, j, mode), rs in by_cfg.items():
        cums = [r["cumulative"] for r in rs]
        m, half = t_interval(cums)
        lo, hi = bootstrap_ratio(cums, base) if base else (float("nan"), float("nan"))
        last = statistics.fmean(statistics.fmean(r["rewards"][-1]) for r in rs)
        masked = statistics.fmean(r["masked_frac"] for r in rs)
        ext = statistics.fmean(r["external_trained"] for r in rs)
        per_seed = ", ".join(f"{c:.2f}" for c in cums)
        ratio = m / base_mean if base_mean > 0 else float("nan")
        ho = [statistics.fmean(r["held_out"]) for r in rs if r["held_out"]]
        ho_m, ho_half = t_interval(ho) if ho else (float("nan"), float("nan"))
        lines.append(
            f"| {i}/{j} | {mode if j else '-'} | {len(rs)} | {m:.2f} ± {half:.2f} | {per_seed} | "
            f"{ratio:.3f} [{lo:.3f}, {hi:.3f}] | {ho_m:.3f} ± {ho_half:.3f} | {last:.3f} | {100 * masked:.2f}% | {ext:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: the shipped tiny base model)")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="I + J groups per step")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma list of I/J:foreign")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--prefer", choices=("uniform", "variance"), default="variance")
    ap.add_argument("--max-per-peer", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-tasks", type=int, default=32, help="held-out tasks per node at the end (0 = skip)")
    ap.add_argument("--eval-samples", type=int, default=4, help="samples per held-out task")
    ap.add_argument("--out", type=Path, default=None, help="write all per-run results here as JSON")
    args = ap.parse_args()

    import logging

    import torch

    from pnyx.config import shipped_model_path

    torch.set_num_threads(args.threads)
    logging.getLogger("pnyx").setLevel(logging.WARNING)
    args.model = args.model or str(shipped_model_path())
    configs = parse_configs(args.configs, args.batch)
    if args.eval_tasks:
        print(f"held-out reward of the base model: {base_held_out(args):.3f}", flush=True)
    results = []
    t0 = time.perf_counter()
    for seed in range(args.seeds):
        for i, j, mode in configs:
            t = time.perf_counter()
            res = run_once(args, i, j, mode, seed)
            results.append(res)
            print(
                f"seed={seed} {i}/{j} {mode}: cumulative={res['cumulative']:.2f} steps={res['steps']} "
                f"ext={res['external_trained']} paths={res['paths']} masked={100 * res['masked_frac']:.2f}% "
                f"({time.perf_counter() - t:.0f}s)",
                flush=True,
            )
    print()
    print(
        f"model={Path(args.model).name} nodes={args.nodes} rounds={args.rounds} seeds={args.seeds} "
        f"G={args.group_size} max_new_tokens={args.max_new_tokens} lr={args.lr} prefer={args.prefer} "
        f"threads={args.threads} wall={time.perf_counter() - t0:.0f}s"
    )
    print(table(results, args))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
