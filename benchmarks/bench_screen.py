"""Pre-rollout screening (`pnyx.rollout.screen`): how well the policy's probability of the reference answer
predicts a task's pass rate, how many zero-variance groups screening avoids, and what it costs.

For each model: draw `--tasks` train tasks of `arith` (2-digit + and -, the `pnyx run` default), score
each with the screen's forward (p = probability of `<answer>N</answer>` at temperature 1), then generate G
samples of every task with the worker's engine and grade them. Printed, side by side in one process:
- the correlation of p with the observed pass rate;
- the zero-variance share of groups without screening (the tasks as drawn) and with it (the screen's
  pick of n out of `--candidates` x n consecutive draws, the worker's rule), averaged over shuffles;
- the screening cost: seconds to score one candidate / seconds to generate one group, and the share of
  worker time it adds at `--candidates` candidates per task.

    python benchmarks/bench_screen.py                           # the shipped tiny model
    python benchmarks/bench_screen.py --model runs/<name>/export # a trained version (`pnyx export`)
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def measure(path: str, tasks_n: int, group: int, candidates: int, threads: int) -> dict:
    import torch

    from pnyx.envs.registry import get_env
    from pnyx.models import load_tokenizer, render_prompt
    from pnyx.rollout.engines import make_engine
    from pnyx.rollout.sampling import SamplingParams
    from pnyx.rollout.screen import choose

    torch.set_num_threads(threads)
    tok = load_tokenizer(path)
    engine = make_engine("torch", path, tok)
    env = get_env("arith")
    tasks = env.sample("train", seed=777, n=tasks_n)
    params = SamplingParams(
        temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=64, stop=list(env.stop_strings)
    )
    pool = 4 * candidates  # the worker's pool: prompts_per_cohort (4) x candidates, scored in one call
    t0 = time.perf_counter()
    ps = []
    for i in range(0, tasks_n, pool):  # the screen's own scoring (`WorkerEngine.reference_logprobs`)
        chunk = tasks[i : i + pool]
        prompts = [list(render_prompt(tok, t.prompt)) for t in chunk]
        refs = [tok.encode(env.reference_completion(t), add_special_tokens=False) for t in chunk]
        ps += [min(1.0, math.exp(lp)) for lp in engine.reference_logprobs(prompts, refs, params)]
    screen_s = time.perf_counter() - t0
    passed = []
    t1 = time.perf_counter()
    for i in range(0, tasks_n, 16):
        chunk = tasks[i : i + 16]
        batch = [list(render_prompt(tok, t.prompt)) for t in chunk for _ in range(group)]
        outs = engine.generate(batch, SamplingParams(**{**params.__dict__, "seed": i}))
        for j, t in enumerate(chunk):
            passed.append(sum(env.score(t, o.text).reward >= 1.0 for o in outs[j * group : (j + 1) * group]))
    gen_s = time.perf_counter() - t1
    zero = [k in (0, group) for k in passed]
    n, m = 4, 4 * candidates
    screened = {}
    for rule in ("informative", "mastered"):  # the same shuffles for both rules
        rng = random.Random(0)
        picked = fail = total = 0
        for _ in range(200):
            order = list(range(tasks_n))
            rng.shuffle(order)
            for s in range(0, tasks_n - m + 1, m):
                window = order[s : s + m]
                best = [window[j] for j in choose([ps[i] for i in window], n, rule, group)]
                picked += sum(zero[i] for i in best)
                fail += sum(passed[i] == 0 for i in best)
                total += n
        screened[rule] = (picked / total, fail / total)
    per_candidate = screen_s / tasks_n
    per_group = gen_s / tasks_n
    return {
        "model": path,
        "pass": sum(passed) / (tasks_n * group),
        "mean_p": statistics.mean(ps),
        "corr": statistics.correlation(ps, [k / group for k in passed]),
        "zero_var_unscreened": sum(zero) / tasks_n,
        "all_fail_unscreened": sum(k == 0 for k in passed) / tasks_n,
        "zero_var_screened": screened["informative"][0],
        "all_fail_screened": screened["informative"][1],
        "zero_var_mastered": screened["mastered"][0],
        "all_fail_mastered": screened["mastered"][1],
        "candidate_over_group": per_candidate / per_group,
        "added_share": candidates * per_candidate / (candidates * per_candidate + per_group),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", help="model folder(s) (default: the shipped tiny model)")
    ap.add_argument("--tasks", type=int, default=320)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--candidates", type=int, default=4, help="candidates per task (worker.screen)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from pnyx.config import shipped_model_path

    models = args.model or [str(shipped_model_path())]
    print(
        f"arith 2-digit, {args.tasks} train tasks x G={args.group_size}, {args.candidates} candidates per task"
    )
    print(
        "zero-var (all-fail part): as drawn | picked by `informative` | picked by `mastered`; "
        "cost: one candidate's score / one group's generation"
    )
    print(
        "model | pass | mean p | corr(p, pass) | as drawn | informative | mastered | candidate/group | added share"
    )
    for path in models:
        r = measure(path, args.tasks, args.group_size, args.candidates, args.threads)
        print(
            f"{Path(r['model']).name} | {r['pass']:.3f} | {r['mean_p']:.3f} | {r['corr']:.2f} | "
            f"{r['zero_var_unscreened']:.3f} ({r['all_fail_unscreened']:.3f}) | "
            f"{r['zero_var_screened']:.3f} ({r['all_fail_screened']:.3f}) | "
            f"{r['zero_var_mastered']:.3f} ({r['all_fail_mastered']:.3f}) | "
            f"{r['candidate_over_group']:.3f} | {100 * r['added_share']:.1f}%"
        )


if __name__ == "__main__":
    main()
