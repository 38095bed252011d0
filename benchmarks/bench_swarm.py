"""SAPO sweep: 8 heterogeneous swarm nodes, I/J in {8/0, 6/2, 4/4, 2/6}, 100+ rounds, 3+ seeds.

Nodes know different things, so sharing has something to carry. Start checkpoints: the shipped tiny base
model (2-digit + and -), and two "specialists" made from it by a short supervised fine-tune
(`pnyx_harness.swarm_experiment.specialize`, train split only) on 1-digit +/- (`pm1`) and on 1-digit * (`mul1`);
a specialist learns its family and forgets 2-digit arithmetic. Eight nodes pair start checkpoints with
local task families (`PLAN`): each family has a node that can solve it and a node that cannot.

Every node trains on I + J = 8 groups of G = 8 completions per round (I generated locally and shared,
J drawn from peers; `prefer=variance`, at most `--max-per-peer` per peer). Nodes run round-robin in
this one process (`RoundRobin`; see `--measure-layouts` for why), meeting through a real local-folder
store. Metrics:
- cumulative reward (SAPO's metric): Σ over rounds and nodes of the mean reward (own verifier) of the
  completions the node generated that round; its ratio to 8/0 with a 95% bootstrap interval (seeds
  resampled within each configuration);
- held-out pass@1 per node after the last round, on the union of all nodes' families (test split, fixed
  tasks, `--eval-tasks` x `--eval-samples` completions at temperature 1 per family);
- one PNG of per-round rewards per configuration.

Each (configuration, seed) is written to `--out-dir` as JSON when it finishes; a rerun skips what is
there, so an interrupted sweep resumes. `--report` only aggregates what is there.

    python benchmarks/bench_swarm.py --rounds 2 --seeds 1 --eval-tasks 8      # smoke run
    nice -n 19 python benchmarks/bench_swarm.py                                # the full sweep (hours)
    python benchmarks/bench_swarm.py --measure-layouts 6                        # round-robin vs one process per node
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pnyx_harness.swarm_experiment import Family, NodeSpec, RoundRobin, heldout_reward, specialize  # noqa: E402

FAMILIES = {
    "add2": Family("add2", "arith", {"digits": 2, "ops": ["+"]}),
    "sub2": Family("sub2", "arith", {"digits": 2, "ops": ["-"]}),
    "pm1": Family("pm1", "arith", {"digits": 1, "ops": ["+", "-"]}),
    "mul1": Family("mul1", "arith", {"digits": 1, "ops": ["*"]}),
}
SPECIALISTS = ("pm1", "mul1")
# (start checkpoint, local family) per node: for every family one node that starts able and one that cannot.
PLAN = [
    ("base", "add2"),
    ("base", "sub2"),
    ("base", "pm1"),
    ("base", "mul1"),
    ("pm1", "pm1"),
    ("mul1", "mul1"),
    ("pm1", "add2"),
    ("mul1", "sub2"),
]
DEFAULT_CONFIGS = "8/0:gated,6/2:gated,4/4:gated,2/6:gated"
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def parse_configs(text: str, batch: int) -> list[tuple[int, int, str]]:
    out = []
    for item in text.split(","):
        mix, _, mode = item.partition(":")
        i, j = (int(x) for x in mix.split("/"))
        if i + j != batch or mode not in ("gated", "onpolicy"):
            raise SystemExit(
                f"config {item}: need I/J:mode with I + J = --batch {batch}, mode gated|onpolicy"
            )
        out.append((i, j, mode))
    return out


def starts(args: argparse.Namespace) -> dict[str, Path]:
    """Start checkpoints by name (specialists are built once and cached under --work)."""
    out = {"base": Path(args.model)}
    for name in SPECIALISTS:
        folder = args.work / f"spec-{name}-s{args.spec_steps}"
        out[name] = specialize(args.model, folder, FAMILIES[name], steps=args.spec_steps, lr=args.spec_lr)
    return out


def overrides(args: argparse.Namespace, mode: str, seed: int) -> dict:
    return {
        "run": {"seed": seed},
        "worker": {"group_size": args.group_size, "max_new_tokens": args.max_new_tokens},
        "trainer": {"lr": args.lr},
        "swarm": {
            "foreign": mode,
            "prefer": "variance",
            "max_per_peer": args.max_per_peer,
            "recent_per_peer": 8,
            "window_s": 1e6,
            "peer_timeout_s": 1e6,
            "checkpoint_every": 0,
        },
    }


def union_heldout(node, args: argparse.Namespace) -> dict[str, float]:
    return {
        label: heldout_reward(
            node.engine, node.tokenizer, fam.build(), tasks=args.eval_tasks, samples=args.eval_samples,
            max_new_tokens=args.max_new_tokens, seed=k,
        )
        for k, (label, fam) in enumerate(FAMILIES.items())
    }  # fmt: skip


def run_once(args: argparse.Namespace, paths: dict[str, Path], i: int, j: int, mode: str, seed: int) -> dict:
    from pnyx.store import open_store

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-swarm-") as root:
        specs = [
            NodeSpec(f"node{k}", paths[start], FAMILIES[fam], i, j)
            for k, (start, fam) in enumerate(PLAN[: args.nodes])
        ]
        rr = RoundRobin(open_store(root), specs, overrides(args, mode, seed))

        def progress(r: int, rr: RoundRobin) -> None:
            if (r + 1) % 20 == 0:
                mean = statistics.fmean(st.local_reward for st in rr.stats[-1].values())
                print(f"  {i}/{j} {mode} s{seed}: round {r + 1} reward {mean:.3f} ({time.perf_counter() - t0:.0f}s)",
                      flush=True)  # fmt: skip

        rr.run(args.rounds, progress)
        names = [s.name for s in specs]
        rewards = [[rr.stats[r][n].local_reward for n in names] for r in range(args.rounds)]
        steps = [st.step for rs in rr.stats for st in rs.values() if st.step is not None]
        heldout = {n: union_heldout(rr.nodes[n], args) for n in names} if args.eval_tasks else {}
        drops: dict[str, int] = {}
        for node in rr.nodes.values():
            for reason, c in node.drops.items():
                drops[reason] = drops.get(reason, 0) + c
        ext = {n: rr.nodes[n].external_trained for n in names}
    return {
        "i": i, "j": j, "mode": mode, "seed": seed, "nodes": names, "plan": PLAN[: args.nodes],
        "rewards": rewards, "cumulative": sum(map(sum, rewards)), "steps": len(steps),
        "masked_frac": statistics.fmean(s.masked_frac for s in steps) if steps else 0.0,
        "external_trained": ext, "drops": drops, "heldout": heldout, "seconds": time.perf_counter() - t0,
    }  # fmt: skip


def start_heldout(args: argparse.Namespace, paths: dict[str, Path]) -> dict[str, dict[str, float]]:
    from pnyx.models import load_tokenizer
    from pnyx.rollout.engines import make_engine

    out = {}
    for name, path in paths.items():
        tok = load_tokenizer(path)
        node = argparse.Namespace(engine=make_engine("torch", path, tok), tokenizer=tok)
        out[name] = union_heldout(node, args)
    return out


# --- statistics, tables, plots --------------------------------------------------------------------------


def t_interval(xs: list[float]) -> tuple[float, float]:
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, float("nan")
    return m, T_975.get(len(xs) - 1, 1.96) * statistics.stdev(xs) / math.sqrt(len(xs))


def bootstrap_ratio(
    xs: list[float], base: list[float], n: int = 10_000, seed: int = 0
) -> tuple[float, float]:
    rng = random.Random(seed)
    ratios = sorted(
        statistics.fmean(rng.choices(xs, k=len(xs))) / b
        for _ in range(n)
        if (b := statistics.fmean(rng.choices(base, k=len(base)))) > 0
    )
    if not ratios:
        return float("nan"), float("nan")
    return ratios[int(0.025 * len(ratios))], ratios[int(0.975 * len(ratios)) - 1]


def by_config(results: list[dict]) -> dict[tuple[int, int, str], list[dict]]:
    out: dict[tuple[int, int, str], list[dict]] = {}
    for res in sorted(results, key=lambda r: (-r["i"], r["mode"], r["seed"])):
        out.setdefault((res["i"], res["j"], res["mode"]), []).append(res)
    return out


def node_union(res: dict, name: str) -> float:
    return statistics.fmean(res["heldout"][name].values())


def tables(results: list[dict], before: dict[str, dict[str, float]] | None) -> str:
    groups = by_config(results)
    base_key = next((k for k in groups if k[1] == 0), None)
    base = [r["cumulative"] for r in groups[base_key]] if base_key else []
    names = results[0]["nodes"]
    plan = results[0]["plan"]
    lines = [
        "| I/J | foreign | seeds | cumulative reward (mean ± 95% t) | per seed | ratio to 8/0 [95% bootstrap] "
        "| held-out pass@1, union, mean of nodes (± 95% t) | DPPO-masked | foreign groups trained per node |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (i, j, mode), rs in groups.items():
        cums = [r["cumulative"] for r in rs]
        m, half = t_interval(cums)
        lo, hi = bootstrap_ratio(cums, base) if base else (float("nan"), float("nan"))
        ratio = m / statistics.fmean(base) if base else float("nan")
        ho = [statistics.fmean(node_union(r, n) for n in names) for r in rs if r["heldout"]]
        ho_m, ho_h = t_interval(ho) if ho else (float("nan"), float("nan"))
        ext = statistics.fmean(statistics.fmean(r["external_trained"].values()) for r in rs)
        lines.append(
            f"| {i}/{j} | {mode if j else '-'} | {len(rs)} | {m:.1f} ± {half:.1f} | "
            f"{', '.join(f'{c:.1f}' for c in cums)} | {ratio:.3f} [{lo:.3f}, {hi:.3f}] | {ho_m:.3f} ± {ho_h:.3f} | "
            f"{100 * statistics.fmean(r['masked_frac'] for r in rs):.2f}% | {ext:.0f} |"
        )
    lines += ["", "Held-out pass@1 per node after the last round (union of families, mean over seeds):", ""]
    header = "| I/J | " + " | ".join(f"{n} ({s}→{f})" for n, (s, f) in zip(names, plan, strict=True)) + " |"
    lines += [header, "|" + " --- |" * (len(names) + 1)]
    if before:
        lines.append(
            "| start | " + " | ".join(f"{statistics.fmean(before[s].values()):.3f}" for s, _ in plan) + " |"
        )
    for (i, j, mode), rs in groups.items():
        if rs[0]["heldout"]:
            cells = [statistics.fmean(node_union(r, n) for r in rs) for n in names]
            lines.append(f"| {i}/{j} {mode if j else ''} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    lines += ["", "Held-out pass@1 per family (mean over nodes and seeds):", ""]
    fams = list(FAMILIES)
    lines += ["| I/J | " + " | ".join(fams) + " |", "|" + " --- |" * (len(fams) + 1)]
    if before:
        lines.append("| start (mean of the 8 nodes) | " + " | ".join(
            f"{statistics.fmean(before[s][f] for s, _ in plan):.3f}" for f in fams) + " |")  # fmt: skip
    for (i, j, mode), rs in groups.items():
        if rs[0]["heldout"]:
            cells = [statistics.fmean(r["heldout"][n][f] for r in rs for n in names) for f in fams]
            lines.append(f"| {i}/{j} {mode if j else ''} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    return "\n".join(lines)


def plot(results: list[dict], out_dir: Path, smooth: int = 5) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for (i, j, mode), rs in by_config(results).items():
        names, plan = rs[0]["nodes"], rs[0]["plan"]
        rounds = len(rs[0]["rewards"])
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for k, name in enumerate(names):
            ys = [statistics.fmean(r["rewards"][t][k] for r in rs) for t in range(rounds)]
            ax.plot(_smooth(ys, smooth), lw=1, label=f"{name} ({plan[k][0]}→{plan[k][1]})")
        mean = [statistics.fmean(statistics.fmean(r["rewards"][t]) for r in rs) for t in range(rounds)]
        ax.plot(_smooth(mean, smooth), lw=3, color="black", label="swarm mean")
        ax.set(xlabel="round", ylabel=f"local reward ({smooth}-round mean)", ylim=(0, 1),
               title=f"SAPO {i}/{j} {mode if j else ''}: {len(rs)} seeds, mean over seeds")  # fmt: skip
        ax.legend(fontsize=7, ncol=2, loc="upper left")
        fig.tight_layout()
        path = out_dir / f"swarm_sweep_{i}-{j}{'_' + mode if j else ''}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _smooth(ys: list[float], k: int) -> list[float]:
    return [statistics.fmean(ys[max(0, t - k + 1) : t + 1]) for t in range(len(ys))]


# --- layouts: one process, or one process per node ------------------------------------------------------


def measure_layouts(args: argparse.Namespace, paths: dict[str, Path], rounds: int) -> None:
    """Node-rounds per second of 8 nodes as round-robin in one process vs one `pnyx swarm` process each."""
    from pnyx.store import open_store

    with tempfile.TemporaryDirectory(prefix="bench-swarm-rr-") as root:
        specs = [
            NodeSpec(f"node{k}", paths[s], FAMILIES[f], 4, 4) for k, (s, f) in enumerate(PLAN[: args.nodes])
        ]
        rr = RoundRobin(open_store(root), specs, overrides(args, "gated", 0))
        rr.run(1)  # model loading and the first round are not what a long run is made of
        t = time.perf_counter()
        rr.run(1 + rounds)
        rr_rate = args.nodes * rounds / (time.perf_counter() - t)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(REPO))
    accept = json.dumps(
        [{"name": FAMILIES[f].env, "kwargs": FAMILIES[f].kwargs} for _, f in PLAN[: args.nodes]]
    )
    with tempfile.TemporaryDirectory(prefix="bench-swarm-proc-") as root:
        procs = []
        t = time.perf_counter()
        for k, (s, f) in enumerate(PLAN[: args.nodes]):
            fam = FAMILIES[f]
            cmd = [
                sys.executable, "-m", "pnyx", "swarm", "--store", root, "--node", f"node{k}",
                f"--run.steps={1 + rounds}", f"--model.path={paths[s]}", f"--env.name={fam.env}",
                f"--env.kwargs={json.dumps(fam.kwargs)}", f"--worker.group_size={args.group_size}",
                f"--worker.max_new_tokens={args.max_new_tokens}", f"--trainer.lr={args.lr}",
                "--swarm.local_groups=4", "--swarm.external_groups=4", f"--swarm.accept_envs={accept}",
                f"--swarm.wait_peers={args.nodes - 1}", "--swarm.peer_timeout_s=600", "--swarm.checkpoint_every=0",
                f"--swarm.max_per_peer={args.max_per_peer}",
            ]  # fmt: skip
            procs.append(
                subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            )
        outs = [p.communicate(timeout=3600)[0] for p in procs]
        wall = time.perf_counter() - t
        if any(p.returncode for p in procs):
            raise SystemExit("a node process failed:\n" + "\n".join(o[-2000:] for o in outs))
        # Per process: the time from its first round's end to its last round's end, from its log lines.
        spans = [_round_span(o) for o in outs]
    proc_rate = args.nodes * rounds / max(spans)
    print(
        f"layouts ({args.nodes} nodes, I/J 4/4, {rounds} rounds after the first, threads: 1 per process): "
        f"round-robin in one process {rr_rate:.2f} node-rounds/s; one process per node {proc_rate:.2f} "
        f"node-rounds/s (slowest node's rounds; whole command {wall:.0f}s incl. start-up); "
        f"ratio per-process / round-robin = {proc_rate / rr_rate:.2f}"
    )


def _round_span(log: str) -> float:
    """Seconds between the first and the last round line of a node's log (HH:MM:SS stamps)."""
    stamps = [line.split()[0] for line in log.splitlines() if " round=" in line]
    secs = [int(h) * 3600 + int(m) * 60 + int(s) for h, m, s in (x.split(":") for x in stamps)]
    return max(1.0, (secs[-1] - secs[0]) % 86400)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="base model folder (default: the shipped tiny base model)")
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--shard", default="0/1", help="K/N: run every N-th (seed, config) from the K-th")
    ap.add_argument("--batch", type=int, default=8, help="I + J groups per step")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma list of I/J:foreign")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--max-per-peer", type=int, default=4)
    ap.add_argument("--spec-steps", type=int, default=100, help="fine-tuning steps of each specialist")
    ap.add_argument("--spec-lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval-tasks", type=int, default=32, help="held-out tasks per family (0 = skip)")
    ap.add_argument("--eval-samples", type=int, default=4)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "pnyx-bench-swarm")
    ap.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results" / "swarm_sweep")
    ap.add_argument("--report", action="store_true", help="only aggregate the results in --out-dir")
    ap.add_argument("--measure-layouts", type=int, default=0, metavar="ROUNDS")
    args = ap.parse_args()

    import logging

    import torch

    from pnyx.config import shipped_model_path

    torch.set_num_threads(args.threads)
    logging.getLogger("pnyx").setLevel(logging.WARNING)
    args.model = args.model or str(shipped_model_path())
    args.work.mkdir(parents=True, exist_ok=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    paths = starts(args)
    if args.measure_layouts:
        measure_layouts(args, paths, args.measure_layouts)
        return
    before_file = args.out_dir / "start_heldout.json"
    if args.eval_tasks and not before_file.exists() and not args.report:
        before_file.write_text(json.dumps(start_heldout(args, paths), indent=1))
    t0 = time.perf_counter()
    k, n = (int(x) for x in args.shard.split("/"))
    todo = [(seed, cfg) for seed in range(args.seeds) for cfg in parse_configs(args.configs, args.batch)]
    for seed, (i, j, mode) in todo[k::n]:
        if not args.report:
            out = args.out_dir / f"{i}-{j}-{mode}-s{seed}.json"
            if out.exists():
                continue
            res = run_once(args, paths, i, j, mode, seed)
            res["settings"] = {key: str(v) for key, v in vars(args).items()}
            out.write_text(json.dumps(res))
            print(
                f"seed={seed} {i}/{j} {mode}: cumulative={res['cumulative']:.1f} steps={res['steps']} "
                f"masked={100 * res['masked_frac']:.2f}% ({res['seconds']:.0f}s)",
                flush=True,
            )
    results = [json.loads(p.read_text()) for p in sorted(args.out_dir.glob("*-s*.json"))]
    if not results:
        return
    before = json.loads(before_file.read_text()) if before_file.exists() else None
    r0 = results[0]
    print(
        f"\nmodel={Path(args.model).name} nodes={len(r0['nodes'])} rounds={len(r0['rewards'])} "
        f"runs={len(results)} G={args.group_size} max_new_tokens={args.max_new_tokens} lr={args.lr} "
        f"this invocation {time.perf_counter() - t0:.0f}s; all runs {sum(r['seconds'] for r in results):.0f}s "
        f"of run time"
    )
    print(tables(results, before))
    for p in plot(results, args.out_dir.parent):
        print(f"plot: {p.relative_to(REPO) if p.is_relative_to(REPO) else p}")


if __name__ == "__main__":
    main()
