"""How far choosing tasks can cut zero-variance groups (issue #27): the spread of a policy's pass rates over
an environment's train problems, and what a worker that knew them would consume.

A GRPO group of G samples is informative only when its rewards differ. A worker that picks tasks
(`pnyx/rollout/curriculum.py`) can only be as good as the problems the policy leaves between solved and
hopeless. This loads one published version of a finished run, samples `--groups` groups of `--group-size`
on each of `--tasks` distinct train problems (the same engine and tool loop as a worker), and prints:

- the histogram of passes in the first group of each problem, and the zero-variance share when problems
  come as drawn (no choice);
- the **selection bound**: rank the problems by their first `k` groups (what a memory of `k` visits knows:
  passes over samples, a Beta(1/2, 1/2) posterior's chance that a group is mixed), take the best 10%-100%,
  and count how many of their *last* group (not used to rank: no selection bias) came out mixed. That is
  the consumed share an ideal worker reaches with that much knowledge, if it trained on only that
  fraction of the problems. The same with the last two groups taken as one group of 2G: what a larger
  group would buy (it also changes learning: twice the samples per problem).

    python benchmarks/bench_pass_spread.py --run runs/<a default searchqa run> --version 200

Figures in BENCHMARKS.md ("Generated groups the trainer consumes").
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

FRACTIONS = (0.1, 0.2, 0.33, 0.5, 1.0)


def mixed_chance(passes: int, samples: int, g: int) -> float:
    """The chance that a group of `g` is mixed, under the Beta(1/2 + passes, 1/2 + fails) posterior of the
    problem's pass rate (by the posterior mean, which is enough to rank)."""
    p = (passes + 0.5) / (samples + 1.0)
    return 1.0 - p**g - (1.0 - p) ** g


def open_version(run: str, version: int, threads: int):
    """(the run's evaluator with `version` loaded and proved, the run's worker sampling settings): the engine,
    env and tool loop a worker of that run would sample with."""
    import torch

    from pnyx.config import config_from_dict, resolve_env_kwargs, resolve_max_new_tokens
    from pnyx.eval.runner import VersionEvaluator
    from pnyx.models.source import resolve_run_model
    from pnyx.store import open_store
    from pnyx.weights import TrustedWeights

    torch.set_num_threads(threads)
    weights = TrustedWeights.open(open_store(run), None)
    cfg = config_from_dict(weights.run.config or {}, source="run.json")
    source = resolve_run_model(weights.run.model or {}, cfg.model.path, cfg.model.revision, check="tokenizer")
    ev = VersionEvaluator(weights, source.folder, cfg.env.name, resolve_env_kwargs(cfg), tasks=1)
    ev.load(version)
    w = cfg.worker
    sampling = {
        "temperature": w.temperature, "top_p": w.top_p, "top_k": w.top_k,
        "max_new_tokens": resolve_max_new_tokens(w.max_new_tokens, ev.env),
    }  # fmt: skip
    return ev, sampling


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--run", required=True, help="a finished run's store")
    p.add_argument("--version", type=int, required=True)
    p.add_argument("--tasks", type=int, default=300, help="distinct train problems")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--groups", type=int, default=4, help="groups per problem (the last one is the test)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if args.groups < 2:
        sys.exit("--groups must be at least 2: one or more to rank by, the last one to test")
    from pnyx.eval.runner import is_correct, scored_samples

    ev, sampling = open_version(args.run, args.version, args.threads)
    env = ev.env
    seen: set = set()
    tasks = []
    for t in env.sample("train", 20261204, args.tasks * 8):
        key = env.problem_key(t)
        if key not in seen:
            seen.add(key)
            tasks.append(t)
        if len(tasks) == args.tasks:
            break
    g = args.group_size
    passed = [[0] * args.groups for _ in tasks]  # per problem, per group: passes
    done = collections.Counter()
    total = len(tasks) * g * args.groups
    for k, (i, _, score) in enumerate(
        scored_samples(ev.engine, env, tasks, g * args.groups, sampling, seed=1)
    ):
        passed[i][done[i] // g] += is_correct(score)
        done[i] += 1
        if (k + 1) % 640 == 0 or k + 1 == total:
            print(f"  {k + 1}/{total} samples", file=sys.stderr, flush=True)

    first = collections.Counter(row[0] for row in passed)
    zv = sum(1 for row in passed if row[0] in (0, g)) / len(tasks)
    print(
        f"{args.run} v{args.version}: {len(tasks)} train problems of {env.name}, {args.groups} groups of {g} each"
    )
    print(f"passes in a problem's first group -> problems: {dict(sorted(first.items()))}")
    print(f"as drawn (no choice): {zv:.1%} zero-variance, {1 - zv:.1%} consumed")
    print(
        "selection bound: the best fraction of problems by their first k groups, share of their last group mixed"
    )
    print("  group  k  " + "".join(f"{f:>8.0%}" for f in FRACTIONS))
    for test in (1, 2):  # the last group alone (size G), or the last two as one group of 2G
        for k in range(1, args.groups - test + 1):
            ranked = sorted(passed, key=lambda row: -mixed_chance(sum(row[:k]), k * g, test * g))
            cells = []
            for f in FRACTIONS:
                top = ranked[: max(1, round(len(ranked) * f))]
                cells.append(sum(1 for row in top if 0 < sum(row[-test:]) < test * g) / len(top))
            print(f"  {test * g:>5}  {k}  " + "".join(f"{c:>8.1%}" for c in cells))


if __name__ == "__main__":
    main()
