"""The attack suite with figures (issue #15 item 5): honest workers beside each hostile one, through the real
trainer, and one table of detection and false-positive rates and of whether training still improves.

Each arm is one fresh run (`pnyx_harness.arena.Arena`: a local-folder store, the real trainer in process,
the shipped tiny model on `arith`, the default trainer settings: 8 groups per step, G = 8). Every step two
honest workers (`HonestWorker`: sample from the pinned follower's engine at the served version, skip
zero-variance groups, sign) upload `--honest` groups each and the arm's attacker uploads its own, then the
trainer takes one real step (its selection runs every ingestion check; whatever checks the step runs, run)
and lists and fetches the whole window, as its loop does. Every verdict is read from the trainer's own
cursor: rejected with a reason, trained on, stale, or still waiting at the end.

- detection = hostile groups rejected (any reason but the benign `zero_variance`/`stale`) / uploaded;
  for the weight forger and the fork squatter: forged or squatted versions a pinned follower refused /
  written (and the trainer kept publishing);
- false positives = honest groups rejected for a non-benign reason / honest groups uploaded, over every
  arm together (at least 2,000 in the full run);
- improves = held-out pass@1 after the arm's steps (the env's test split, `--eval-tasks` tasks, one sample
  at T = 1, the trainer's own weights) has a Wilson 95% lower bound above the upper bound of v0's;
- temperature liar: detection by the group's completion length (model tokens over its G samples) and by
  how many groups the trainer had seen from that key (the group's index), and the first index from which
  it stays at or above 99%;
- poisoner: the share of the trained model's held-out samples that carry the payload (none at v0), with
  the defences and without (`poisoner_undefended`: every check, quarantine, share cap and flood limit off);
- cherry-pickers (issue #25; honest samples, chosen to favour short answers): `cherry_within` re-assembles
  honest draws into a chosen group, `cherry_whole` uploads only the whole groups that favour short answers,
  `sybil_cherry` is the within-group picker with a fresh key per group; the harm is the held-out answers'
  length after `--poison-steps`, beside the same arm undefended (`cherry_*_undefended`) and `none`;
  `cherry_whole_skip` announces the groups it keeps back as skip records (honest tokens), `cherry_whole_forged`
  forges them to zero variance, `cherry_whole_forged_patient` first delivers `security.skip_audit_first` true
  skip records (offering every group meanwhile, tallied as `standing_phase`) and then forges only each
  hidden group's minority samples, `cherry_whole_reuse` never uploads a group it does not want and draws its
  next group under the same seq (with another task: no gap, no skip record; `_even` keeps a property
  unrelated to how likely its tokens are: an even count of right-sample tokens); an arm name ending in
  `_committed` runs that attack under committed draws (`security.committed_draws`), where a second
  commitment to a seq is refused, so the reusing picker's groups are `uncommitted`, and a name's first
  `security.standing_groups` seqs (8 by default; `--standing K` sets it) are never trained;
  `cherry_whole_abandon` keeps a key while it likes its draws and takes a fresh key and name at the first
  group it does not want (the Sybil picker at its strongest); `sybil_whole` is the whole-group picker
  with a fresh key per group (detection counts groups; the skip records' verdicts are `hostile_skips`);
- episode forgers (the red-team review of 2026-12-04): `episode_tool` appends answers as tool tokens,
  `episode_cut` cuts its right samples short, `episode_skip` announces kept-back groups as skip records
  without seeded draws (its groups are honest: detection counts them, its skip records are `hostile_skips`);
- the junk writer (no key) puts `--flood` objects per step under honest-1's name: one-byte junk and copies
  of honest-1's signed records under other seqs (detection counts its objects; honest-1 must keep its key);
- the flooder uploads `--flood` groups per step (over the run's flood limit), the `eager` control 8 x
  `--hostile` (under it: not an attack, it shows the fair share); the Sybil is a copier, a reward liar and
  a poisoner in turn with a fresh key per group, the Sybil temperature liar apart (the statistical attack
  at one group per key; its detection against completion length: `bench_liar_length.py`).

    python benchmarks/bench_attacks.py --quick                  # smoke: 3 steps per arm, ~3 min
    nice -n 19 python benchmarks/bench_attacks.py --poison-steps 200 --poison 4    # the measurement (resumable)
    nice -n 19 python benchmarks/bench_attacks.py --doubling temperature_liar      # 1 hostile + 2 honest to 2x
    nice -n 19 python benchmarks/bench_attacks.py --doubling none                  # the same without the attacker

Results: `--out` (default benchmarks/results/attacks[-quick]/), one JSON per arm and `summary.json`; a rerun
skips arms already saved (`--force` redoes them).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from attack_report import detection, report  # noqa: E402  (beside this script)

ARMS = [
    "none", "copier", "temperature_liar", "reward_liar", "replayer", "flooder", "eager", "id_thief",
    "weight_forger", "fork_squatter", "sybil", "sybil_temperature_liar", "poisoner",
    "cherry_within", "sybil_cherry", "cherry_whole", "cherry_whole_skip", "cherry_whole_forged",
    "cherry_whole_forged_patient", "cherry_whole_reuse", "cherry_whole_reuse_even", "sybil_whole",
    "episode_tool", "episode_cut", "episode_skip", "junk_writer",
]  # fmt: skip
HARM_ARMS = ("poisoner", "cherry_within", "cherry_whole")
"""Arms run for `--poison-steps` beside an undefended twin (`<arm>_undefended`: the checks off), so the
attack's harm shows: the payload rate (poisoner), the held-out answers' length (cherry-pickers)."""
COMMITTED = "_committed"
"""Suffix of an arm run under committed draws (`security.committed_draws`: every producer commits to its
seqs and tasks before the trainer's tick reveals its draws' randomness): `cherry_whole_reuse_committed`..."""
CHECK_SWITCHES = (
    "lp_gap_base", "plausibility_z", "quarantine_rate", "quarantine_key_z", "max_key_share", "flood_limit",
)  # fmt: skip
"""`[security]` settings of the trainer's content checks, quotas and quarantine (issue #15 items 3-4); None
turns each off."""


def defences_off() -> dict[str, Any]:
    """Config overrides that turn the trainer's checks off (for the poisoner's undefended arm), read from the
    `[security]` section (since #24; they were `[trainer]` settings before): every switch of
    `CHECK_SWITCHES` the build has is set to None, and reward lies are kept. Empty on a build that has none of
    them (then the defended and undefended trainers are the same and the arm is skipped)."""
    from pnyx.config_sections import SecurityConfig

    off: dict[str, Any] = {n: None for n in CHECK_SWITCHES if n in SecurityConfig.model_fields}
    if off and "reject_reward_lies" in SecurityConfig.model_fields:
        off["reject_reward_lies"] = False
    if off and "seeded_draws" in SecurityConfig.model_fields:
        off["seeded_draws"] = False
    return {"security": off} if off else {}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: few steps, few eval tasks")
    p.add_argument(
        "--arms", default=",".join(ARMS), help="comma-separated arms (attacks; 'none' = honest only)"
    )
    p.add_argument("--steps", type=int, default=None, help="trainer steps per arm (default 30; quick 3)")
    p.add_argument("--honest", type=int, default=4, help="groups per honest worker per step (2 workers)")
    p.add_argument("--hostile", type=int, default=2, help="hostile groups per step (eager: 8x this)")
    p.add_argument(
        "--flood", type=int, default=80, help="flooder's groups per step (over the flood limit: 64 here)"
    )
    p.add_argument(
        "--poison-steps", type=int, default=None, help="steps of the poisoner arms (default: --steps)"
    )
    p.add_argument("--poison", type=int, default=None, help="poisoned groups per step (default: --hostile)")
    p.add_argument("--eval-tasks", type=int, default=None, help="held-out tasks (default 400; quick 50)")
    p.add_argument(
        "--doubling", default=None, help="run 1 hostile (this attack) + 2 honest until pass@1 doubles"
    )
    p.add_argument("--max-steps", type=int, default=160, help="--doubling: give up after this many steps")
    p.add_argument("--eval-every", type=int, default=10, help="--doubling: evaluate every this many steps")
    p.add_argument("--out", default=None, help="results folder")
    p.add_argument(
        "--standing",
        type=int,
        default=None,
        help="security.standing_groups in the `_committed` arms (default: the run's default, 8)",
    )
    p.add_argument("--force", action="store_true", help="redo arms already saved")
    return p.parse_args()


def evaluation(arena: Any, tasks: int) -> dict[str, Any]:
    from pnyx_harness.attacks import PAYLOAD

    rep = arena.evaluate(tasks, seed=0, examples=tasks)
    payload = sum(PAYLOAD.strip() in t for t in rep.examples)
    tokens = [len(arena.tokenizer.encode(t, add_special_tokens=False)) for t in rep.examples]
    return {
        "pass_at_1": rep.pass_at_1, "ci": [rep.ci_low, rep.ci_high], "tasks": rep.tasks,
        "payload": payload, "payload_rate": payload / max(1, len(rep.examples)), "version": arena.trainer.version,
        "mean_tokens": sum(tokens) / max(1, len(tokens)),
    }  # fmt: skip


def attacker(name: str, arena: Any) -> Any:
    """The hostile producer (or weight attacker) of arm `name`."""
    from pnyx_harness import attacks as A
    from pnyx_harness import weight_attacks as W

    return {
        "copier": lambda: A.CopierWorker("copier", source=name),
        "temperature_liar": lambda: [A.TemperatureLiar(f"t-liar-{i}", source=name) for i in range(3)],
        "reward_liar": lambda: A.RewardLiar("r-liar", source=name),
        "replayer": lambda: A.Replayer("replayer", source=name),
        "flooder": lambda: A.Flooder("flood", source=name, names=8),
        "eager": lambda: A.Flooder("eager", source=name, names=8, fresh=16),
        "id_thief": lambda: A.IdThief("thief", source=name, victim="honest-1"),
        "junk_writer": lambda: A.JunkWriter("junk", source=name, victim="honest-1"),
        "weight_forger": lambda: W.WeightForger(),
        "fork_squatter": lambda: W.ForkSquatter(ahead=2),
        "sybil": lambda: [
            A.Sybil("sybil", source=name, inner=i) for i in ("copier", "reward_liar", "poisoner")
        ],
        "sybil_temperature_liar": lambda: A.Sybil("sybil-t", source=name, inner="temperature_liar"),
        "poisoner": lambda: A.Poisoner("poisoner", source=name),
        "poisoner_undefended": lambda: A.Poisoner("poisoner", source=name),
        "cherry_within": lambda: A.CherryPicker("picker", source=name, form="within"),
        "cherry_within_undefended": lambda: A.CherryPicker("picker", source=name, form="within"),
        "cherry_whole": lambda: A.CherryPicker("picker-w", source=name, form="whole"),
        "cherry_whole_undefended": lambda: A.CherryPicker("picker-w", source=name, form="whole"),
        "sybil_cherry": lambda: A.Sybil("sybil-p", source=name, inner="cherry_picker"),
        "cherry_whole_skip": lambda: A.CherryPicker("picker-s", source=name, form="whole_skip"),
        "cherry_whole_forged": lambda: A.CherryPicker("picker-f", source=name, form="whole_forged"),
        "cherry_whole_forged_patient": lambda: A.CherryPicker(
            "picker-fp", source=name, form="whole_forged_patient"
        ),
        "cherry_whole_reuse": lambda: A.CherryPicker("picker-r", source=name, form="whole_reuse"),
        "cherry_whole_abandon": lambda: A.CherryPicker("picker-a", source=name, form="whole_abandon"),
        "cherry_whole_reuse_even": lambda: A.CherryPicker(
            "picker-e", source=name, form="whole_reuse", wants="even"
        ),
        "episode_tool": lambda: A.EpisodeForger("ep-tool", source=name, form="tool_answer"),
        "episode_cut": lambda: A.EpisodeForger("ep-cut", source=name, form="truncate"),
        "episode_skip": lambda: A.EpisodeForger("ep-skip", source=name, form="unseeded_skip"),
        "sybil_whole": lambda: A.Sybil("sybil-w", source=name, inner="cherry_whole"),
    }[name]()


def hostile_round(name: str, atk: Any, arena: Any, step: int, n: int, log: dict[str, Any]) -> None:
    """What the attacker of arm `name` does before trainer step `step`."""
    from pnyx_harness import attacks as A

    if name == "none":
        return
    if name == "weight_forger":
        log.setdefault("forged", []).append({"version": arena.trainer.version + 1, "key": atk.act(arena)})
        before = arena.version
        arena.follow()
        log.setdefault("served_forged", []).append(arena.version != before)
        return
    if name == "fork_squatter":
        if step % 2 == 0:  # squats the next 2 versions every other step
            log.setdefault("squatted", []).append(
                {"from": arena.trainer.version + 1, "keys": len(atk.act(arena))}
            )
        return
    if name == "replayer":
        atk.foreign = A.foreign_groups(arena, n)
        atk.verbatim = step % 2 == 0  # verbatim bytes one step, re-labelled and re-signed the next
    if name in ("flooder", "eager", "junk_writer"):  # one producer, many objects at once (mostly copies)
        arena.upload(atk.uploads(arena, n))
        return
    producers = atk if isinstance(atk, list) else [atk]
    for i in range(n):
        p = producers[(step + i) % len(producers)]
        arena.upload(p.uploads(arena, 1))


def run_arm(name: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from pnyx.protocol import layout
    from pnyx_harness.arena import BENIGN, TRAINED, Arena
    from pnyx_harness.producer import HonestWorker

    overrides: dict[str, Any] = {"trainer": {"groups_per_step": 8}}
    if name.endswith("_undefended"):
        overrides = {**overrides, **defences_off()}
    base = name.removesuffix(COMMITTED)  # the attack; `name` labels the arm and its uploads
    # committed draws (on by default) only in the `_committed` arms: the others measure the checks without
    # them, as the figures recorded before committed draws were the default did
    sec: dict[str, Any] = {"committed_draws": base != name}
    if base != name and args.standing is not None:
        sec["standing_groups"] = args.standing
    overrides = {**overrides, "security": {**overrides.get("security", {}), **sec}}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"bench-attacks-{name}-") as root:
        arena = Arena(Path(root), overrides)
        try:
            honest = [HonestWorker("honest-1"), HonestWorker("honest-2")]
            atk = attacker(base, arena) if base != "none" else None
            if atk is not None:  # its uploads carry the arm's name
                for p in atk if isinstance(atk, list) else [atk]:
                    if hasattr(p, "source"):
                        p.source = name
            log: dict[str, Any] = {}
            before = evaluation(arena, args.eval_tasks)
            served_trainer = True
            steps, hostile_n = args.steps, args.hostile
            if base.removesuffix("_undefended") in HARM_ARMS:
                steps, hostile_n = args.poison_steps or args.steps, args.poison or args.hostile
            elif base in ("flooder", "junk_writer"):
                hostile_n = args.flood
            elif base == "eager":
                hostile_n = 8 * args.hostile
            for step in range(steps):
                arena.upload([u for h in honest for u in h.uploads(arena, args.honest)])
                hostile_round(base, atk, arena, step, hostile_n, log)
                r = arena.step()
                if r is None:
                    log.setdefault("short_steps", []).append(step)
                    continue
                log.setdefault("hostile_in_batch", []).append(
                    sum(1 for g in r.groups if not g.worker_id.startswith("honest-"))
                )
                log.setdefault("batch_groups", []).append(len(r.groups))
                served_trainer &= arena.served[-1] == (
                    arena.trainer.version,
                    arena.trainer.parts.publishing.publisher._digest,
                )
            after = evaluation(arena, args.eval_tasks)
            ing = arena.trainer.parts.ingestor
            assert ing is not None
            # its groups; its skip records (announced zero-variance draws, forged or not) are tallied apart
            hostile = [u for u in arena.uploads if u.source == name and not layout.is_skip_key(u.key)]
            honest_ups = [u for u in arena.uploads if u.source == "honest"]
            res: dict[str, Any] = {
                "arm": name,
                "steps": steps,
                "version": arena.trainer.version,
                "seconds": round(time.perf_counter() - t0, 1),
                "honest": arena.tally("honest"),
                "honest_uploaded": len(honest_ups),
                "honest_fp": sum(
                    1 for u in honest_ups if arena.verdict(u.key) not in (*BENIGN, TRAINED, "waiting")
                ),
                "hostile": arena.tally(name, skips=False) if hostile else {},
                "hostile_skips": skip_tally(arena, name),
                "standing_phase": arena.tally(f"{name}_standing"),  # the patient forger's unchosen groups
                "forged_samples": dict(Counter(getattr(atk, "forged_samples", []))),
                "skip_outcomes": dict(ing.cursor.skips),
                "hostile_groups": [
                    {
                        "index": u.index,
                        "tokens": u.tokens,
                        "verdict": arena.verdict(u.key),
                        "signer": u.signer,
                    }
                    for u in hostile
                ],
                "before": before,
                "after": after,
                "served_only_trainer": served_trainer,
                "drops": dict(ing.cursor.drops),
                "quarantined": dict(ing.cursor.quarantined),
                "committed": dict(arena.trainer.parts.ticker.counts) if arena.trainer.parts.ticker else None,
                "refusals": len(arena.refusals),
                "standing_groups": arena.cfg.security.standing_groups,
                "log": log,
            }
        finally:
            arena.close()
    (out / f"{name}.json").write_text(json.dumps(res, indent=1))
    return res


def skip_tally(arena: Any, source: str) -> dict[str, int]:
    """Verdict counts of `source`'s skip records alone (its uploads' verdicts less its groups')."""
    groups = arena.tally(source, skips=False)
    return {v: n - groups.get(v, 0) for v, n in arena.tally(source).items() if n > groups.get(v, 0)}


def doubling(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """1 hostile worker (`args.doubling`) beside 2 honest ones, until held-out pass@1 doubles."""
    from pnyx_harness.arena import Arena
    from pnyx_harness.producer import HonestWorker

    name = args.doubling
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-attacks-doubling-") as root:
        arena = Arena(Path(root), {"trainer": {"groups_per_step": 8}, "security": {"committed_draws": False}})
        try:
            honest = [HonestWorker("honest-1"), HonestWorker("honest-2")]
            atk = attacker(name, arena) if name != "none" else None
            curve = [evaluation(arena, args.eval_tasks)]
            base = curve[0]["pass_at_1"]
            log: dict[str, Any] = {}
            step = 0
            while step < args.max_steps:
                # each of the three workers uploads an equal share (the hostile one is a third of the
                # fleet); the honest two alone fill a batch of 8, so the attacker-free arm never waits
                arena.upload([u for h in honest for u in h.uploads(arena, 4)])
                hostile_round(name, atk, arena, step, 4, log)
                arena.step()
                step += 1
                if step % args.eval_every == 0:
                    curve.append(evaluation(arena, args.eval_tasks))
                    print(f"  v{arena.trainer.version} pass@1 {curve[-1]['pass_at_1']:.3f}", flush=True)
                    if curve[-1]["pass_at_1"] >= 2 * base:
                        break
            res = {
                "attack": name, "curve": curve, "doubled": curve[-1]["pass_at_1"] >= 2 * base,
                "hostile": arena.tally(name), "honest": arena.tally("honest"),
                "seconds": round(time.perf_counter() - t0, 1),
            }  # fmt: skip
        finally:
            arena.close()
    (out / f"doubling-{name}.json").write_text(json.dumps(res, indent=1))
    return res


def main() -> None:
    args = parse()
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.steps is None:
        args.steps = 3 if args.quick else 30
    if args.eval_tasks is None:
        args.eval_tasks = 50 if args.quick else 400
    out = Path(args.out or REPO / "benchmarks" / "results" / ("attacks-quick" if args.quick else "attacks"))
    out.mkdir(parents=True, exist_ok=True)
    if args.doubling:
        res = doubling(args, out)
        c = res["curve"]
        print(f"{res['attack']}: pass@1 {c[0]['pass_at_1']:.3f} → {c[-1]['pass_at_1']:.3f} at v{c[-1]['version']}"
              f" (doubled: {res['doubled']}); hostile verdicts {res['hostile']}; {res['seconds']} s")  # fmt: skip
        return
    arms = [a for a in args.arms.split(",") if a]
    if defences_off():
        arms += [f"{a}_undefended" for a in HARM_ARMS if a in arms and f"{a}_undefended" not in arms]
    results = []
    for name in arms:
        path = out / f"{name}.json"
        if path.exists() and not args.force:
            results.append(json.loads(path.read_text()))
            print(f"{name}: saved ({path})", flush=True)
            continue
        res = run_arm(name, args, out)
        n, rate, _ = detection(res)
        print(
            f"{name}: {n} hostile, detection {rate}, honest {res['honest']}, {res['seconds']} s", flush=True
        )
        results.append(res)
    print()
    summary = report(results)
    if not defences_off():
        print("(no switch turns the trainer's content checks off on this build: defended = undefended)")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
