"""Would a harder searchqa level give the curriculum headroom? Per-question pass counts of candidate levels,
built from the synthetic world, at one published version of a finished searchqa run (issue #27).

A level helps the consumed share only if the policy's pass rate on its questions sits between 0 and 1
*for each question*: a group of 8 is mixed with probability 1 - p^8 - (1 - p)^8, so a level whose
questions each pass ~8/8 or ~0/8 makes as many zero-variance groups as the solved easy level. This samples
`--groups-of` completions (the worker's engine, tool loop and sampling settings) on `--questions` questions
of each candidate and prints the pass rate, the share of questions whose group was mixed (what a worker
drawing only that level would consume, at best), and the histogram of passes per question:

- `asked`: the shipped question, "Where was {name} born?" (the comparison);
- `namesake`: the same question about a person who shares a last name, not the one a search for the last
  name alone returns (so a query with a miscopied first name finds a namesake);
- `job`: "Where was the {job} {last} born?" for a last name several people share (the job tells them
  apart; the query must carry it);
- `both`: "Where and when was {name} born?", correct only if the answer holds the city and the year;
- `plus10`: "In which year did {name} turn 10?", the birth year plus ten.

    python benchmarks/bench_searchqa_levels.py --run runs/<a default searchqa run> --version 200

Figures in BENCHMARKS.md ("Generated groups the trainer consumes"). Scratch levels only: none ships.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # pnyx, and bench_pass_spread beside this file


LEVELS = ("asked", "namesake", "job", "both", "plus10")


def levels(env, n: int) -> dict[str, list[tuple[str, list[str]]]]:
    """Candidate level -> up to `n` (question, golds that must all be in the answer)."""
    people = env.world.people
    by_last = collections.defaultdict(list)
    for p in people:
        by_last[p.name.split()[1]].append(p)
    families = [group for group in by_last.values() if len(group) > 1]
    namesake, job = [], []
    for group in families:
        first = env.retrieve(group[0].name.split()[1], 1)[0].title
        namesake += [(f"Where was {p.name} born?", [p.city]) for p in group if p.name != first]
        jobs = collections.Counter(p.job for p in group)
        last = group[0].name.split()[1]
        job += [(f"Where was the {p.job} {last} born?", [p.city]) for p in group if jobs[p.job] == 1]
    return {
        "asked": [(f"Where was {p.name} born?", [p.city]) for p in people[:n]],
        "namesake": namesake[:n],
        "job": job[:n],
        "both": [(f"Where and when was {p.name} born?", [p.city, str(p.year)]) for p in people[:n]],
        "plus10": [(f"In which year did {p.name} turn 10?", [str(p.year + 10)]) for p in people[:n]],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--run", required=True, help="a finished searchqa run's store")
    p.add_argument("--version", type=int, required=True)
    p.add_argument("--questions", type=int, default=40, help="questions per candidate level")
    p.add_argument("--groups-of", type=int, default=8, help="samples per question (one group)")
    p.add_argument("--levels", nargs="+", default=list(LEVELS), choices=LEVELS, help="which candidates")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    from bench_pass_spread import open_version

    from pnyx.envs.base import Task
    from pnyx.envs.parsing import cover_em, last_answer, strip_spans
    from pnyx.envs.searchqa import SearchQAEnv
    from pnyx.eval.runner import scored_samples

    ev, sampling = open_version(args.run, args.version, args.threads)
    env = ev.env
    if not isinstance(env, SearchQAEnv) or env.world is None:
        sys.exit(f"{args.run} is not a searchqa run on the synthetic world")
    g = args.groups_of
    print(f"{args.run} v{args.version}: groups of {g}, sampling {sampling}")
    print(f"{'level':>9} {'questions':>9} {'pass rate':>9} {'mixed':>6}  passes per question -> questions")
    for name, qs in levels(env, args.questions).items():
        if name not in args.levels:
            continue
        tasks = [
            Task(id=f"searchqa/train/0/{i}", prompt=env.chat(f"Question: {q}"), answer=golds, meta={})
            for i, (q, golds) in enumerate(qs)
        ]
        passes = [0] * len(tasks)
        for i, out, _ in scored_samples(ev.engine, env, tasks, g, sampling, seed=3):
            ans = last_answer(strip_spans(out.text, "information"))  # the model's own words only
            ok = ans.text is not None and len(ans.text) <= env.max_answer_chars
            passes[i] += ok and all(cover_em(ans.text or "", [gold]) for gold in qs[i][1])
        mixed = sum(1 for x in passes if 0 < x < g) / len(passes)
        hist = dict(sorted(collections.Counter(passes).items()))
        print(f"{name:>9} {len(qs):>9} {sum(passes) / (g * len(qs)):>9.3f} {mixed:>6.0%}  {hist}", flush=True)


if __name__ == "__main__":
    main()
