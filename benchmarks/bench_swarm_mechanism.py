"""SAPO's mechanism, tested directly: does sharing carry what node A can do to node B, which cannot?

Node A starts able to solve a task family X; node B starts unable to. By default X is 1-digit + and -
(`pm1`), which the shipped tiny model was never trained on. Both start checkpoints are made from the
shipped model by a short supervised fine-tune on X (`pnyx_harness.swarm_experiment.mechanism_starts`, train split
only): A on the right answers (`--a-steps`), B on answers off by one (`--b-start off1`, `--b-steps`): a
deliberately damaged checkpoint with A's answer format and a wrong rule (held-out reward about 0.03).
`--b-start base` starts B from the shipped model itself instead (it answers 1-digit problems with 2-3 digit
numbers: another format than A's), `--b-start earlier` from an earlier checkpoint of A's fine-tune. Both
nodes generate and train on X. A trains on its own 8 groups per round in every arm, so A's run is the same
in all of them. B trains on 8 groups per round:

- `none`: 8 own groups (no sharing);
- `gated` / `onpolicy`: 4 own + 4 of A's (SAPO 4/4), with the foreign-text mode of that name;
- `late`: like `gated`, but B joins the swarm only at round `--late` (A has trained alone until then)
  and starts from its own checkpoint.

Every arm runs B for `--rounds` rounds at the same batch (8 groups of G = 8 per step). Measured: B's
held-out reward on X (test split, the same tasks in every arm) at its start and every `--eval-every`
rounds; the difference of B's final held-out reward from the `none` arm, paired by seed, with a 95%
t-interval and a 95% bootstrap interval over seeds; the DPPO-gate-masked fraction of B's tokens; the
foreign groups B trained on. Each (arm, seed) is saved as JSON in `--out-dir` when done (a rerun skips
it); one PNG of B's curves.

    python benchmarks/bench_swarm_mechanism.py --rounds 4 --seeds 1 --eval-every 2    # smoke
    nice -n 19 python benchmarks/bench_swarm_mechanism.py                              # the measurement
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
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pnyx_harness.swarm_experiment import Family, mechanism_starts, transfer_run  # noqa: E402

FAMILIES = {
    "add3": Family("add3", "arith", {"digits": 3, "ops": ["+"]}),
    "pm1": Family("pm1", "arith", {"digits": 1, "ops": ["+", "-"]}),
    "mul1": Family("mul1", "arith", {"digits": 1, "ops": ["*"]}),
}
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def arms(args: argparse.Namespace) -> list[str]:
    out = ["none", *args.modes.split(",")]
    return out + (["late"] if args.late else [])


def run_arm(args: argparse.Namespace, a: Path, b: Path, arm: str, seed: int) -> dict:
    from pnyx.store import open_store

    ov = {
        "worker": {"group_size": 8, "max_new_tokens": args.max_new_tokens},
        "trainer": {"lr": args.lr},
        "swarm": {"prefer": "variance", "max_per_peer": 8, "recent_per_peer": 8, "window_s": 1e6,
                  "peer_timeout_s": 1e6, "checkpoint_every": 0},
    }  # fmt: skip
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-mech-") as root:
        res = transfer_run(
            open_store(root), a, b, FAMILIES[args.family], rounds=args.rounds,
            b_external=0 if arm == "none" else 4, mode="gated" if arm in ("none", "late") else arm, seed=seed,
            overrides=ov, b_lr=args.b_lr, b_join=args.late if arm == "late" else 0, eval_every=args.eval_every,
            eval_tasks=args.eval_tasks, eval_samples=args.eval_samples,
        )  # fmt: skip
    return {"arm": arm, "seed": seed, "seconds": time.perf_counter() - t0, **asdict(res)}


def t_interval(xs: list[float]) -> tuple[float, float, float]:
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, float("nan"), float("nan")
    half = T_975.get(len(xs) - 1, 1.96) * statistics.stdev(xs) / math.sqrt(len(xs))
    return m, m - half, m + half


def bootstrap_mean(xs: list[float], n: int = 10_000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(xs, k=len(xs))) for _ in range(n))
    return means[int(0.025 * n)], means[int(0.975 * n) - 1]


def report(results: list[dict], args: argparse.Namespace) -> str:
    by = {(r["arm"], r["seed"]): r for r in results}
    seeds = sorted({r["seed"] for r in results})
    lines = [
        "| arm | seeds | B start | B end (mean, 95% t) | end − none, paired (mean, 95% t) | 95% bootstrap | "
        "B steps | foreign groups trained | gate-masked | clipped | A end |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for arm in arms(args):
        rs = [by[(arm, s)] for s in seeds if (arm, s) in by]
        if not rs:
            continue
        ends = [r["curve"][-1][1] for r in rs]
        m, lo, hi = t_interval(ends)
        diffs = [by[(arm, s)]["curve"][-1][1] - by[("none", s)]["curve"][-1][1] for s in seeds
                 if (arm, s) in by and ("none", s) in by]  # fmt: skip
        if arm != "none" and diffs:
            dm, dlo, dhi = t_interval(diffs)
            blo, bhi = bootstrap_mean(diffs)
            diff = f"{dm:+.3f} [{dlo:+.3f}, {dhi:+.3f}] | [{blo:+.3f}, {bhi:+.3f}]"
        else:
            diff = "- | -"
        lines.append(
            f"| {arm} | {len(rs)} | {statistics.fmean(r['curve'][0][1] for r in rs):.3f} | "
            f"{m:.3f} [{lo:.3f}, {hi:.3f}] | {diff} | {statistics.fmean(r['steps'] for r in rs):.0f} | "
            f"{statistics.fmean(r['external_trained'] for r in rs):.0f} | "
            f"{100 * statistics.fmean(r['masked_frac'] for r in rs):.2f}% | "
            f"{100 * statistics.fmean(r['clip_frac'] for r in rs):.2f}% | {statistics.fmean(r['a_end'] for r in rs):.3f} |"
        )
    return "\n".join(lines)


def plot(results: list[dict], args: argparse.Namespace, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for arm in arms(args):
        rs = [r for r in results if r["arm"] == arm]
        if not rs:
            continue
        xs = [x for x, _ in rs[0]["curve"]]
        ys = [statistics.fmean(r["curve"][k][1] for r in rs) for k in range(len(xs))]
        ax.plot(xs, ys, marker="o", ms=3, label=f"{arm} ({len(rs)} seeds)")
    ax.set(xlabel="rounds B has run", ylabel=f"B held-out reward on {args.family}",
           title=f"Does sharing carry A's skill to B? ({args.family}, mean over seeds)")  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="base model folder (default: the shipped tiny base model)")
    ap.add_argument("--family", choices=sorted(FAMILIES), default="pm1")
    ap.add_argument("--a-steps", type=int, default=100, help="fine-tuning steps of A's start checkpoint")
    ap.add_argument("--b-start", choices=("off1", "base", "earlier"), default="off1")
    ap.add_argument("--b-steps", type=int, default=300, help="fine-tuning steps of B's start (off1, earlier)")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--modes", default="gated,onpolicy", help="foreign-text modes of the sharing arms")
    ap.add_argument(
        "--late", type=int, default=20, help="the late arm: B joins at this swarm round (0 = no arm)"
    )
    ap.add_argument("--lr", type=float, default=2e-4, help="A's learning rate")
    ap.add_argument("--b-lr", type=float, default=3e-4, help="B's learning rate")
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-tasks", type=int, default=64)
    ap.add_argument("--eval-samples", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--shard", default="0/1", help="K/N: run every N-th (seed, arm) from the K-th")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "pnyx-bench-swarm")
    ap.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results" / "swarm_mechanism")
    args = ap.parse_args()

    import logging

    import torch

    from pnyx.config import shipped_model_path

    torch.set_num_threads(args.threads)
    logging.getLogger("pnyx").setLevel(logging.WARNING)
    args.model = args.model or str(shipped_model_path())
    args.out_dir.mkdir(parents=True, exist_ok=True)
    fam = FAMILIES[args.family]
    a, b = mechanism_starts(args.model, args.work, fam, args.a_steps, args.b_start, args.b_steps)
    t0 = time.perf_counter()
    k, n = (int(x) for x in args.shard.split("/"))
    for seed, arm in [(seed, arm) for seed in range(args.seeds) for arm in arms(args)][k::n]:
        out = args.out_dir / f"{arm}-s{seed}.json"
        if not out.exists():
            res = run_arm(args, a, b, arm, seed)
            res["settings"] = {key: str(v) for key, v in vars(args).items()}
            out.write_text(json.dumps(res))
            print(f"seed={seed} {arm}: B {res['curve'][0][1]:.3f} -> {res['curve'][-1][1]:.3f} steps={res['steps']} "
                  f"ext={res['external_trained']} masked={100 * res['masked_frac']:.2f}% ({res['seconds']:.0f}s)",
                  flush=True)  # fmt: skip
    results = [json.loads(p.read_text()) for p in sorted(args.out_dir.glob("*-s*.json"))]
    print(
        f"\nfamily={args.family} A=spec {args.a_steps} steps, B={args.b_start} ({args.b_steps} steps), "
        f"rounds={args.rounds}, lr A {args.lr} B {args.b_lr}; this invocation {time.perf_counter() - t0:.0f}s, all runs "
        f"{sum(r['seconds'] for r in results):.0f}s"
    )
    print(report(results, args))
    print(f"plot: {plot(results, args, args.out_dir.parent / f'swarm_mechanism_{args.family}.png')}")


if __name__ == "__main__":
    main()
