"""Honest distributions of the trainer's sampling checks: logprob gap and token plausibility (issue #15).

Runs what an honest fleet does, in one process on the CPU: the shipped tiny model, env arith, the default
algorithm and learning rate. Per version v, an honest worker generates groups from the **bf16 cast** of
the trainer's weights (as published), through pnyx's own engine and cohort code; the trainer re-scores
them and takes a real `train_step` (fp32 master weights) on some of them to reach v+1. Then every group
of version v is measured (`pnyx.train.forward.measure_evidence`: the same per-group sums `train_step`
computes with `checks`) under the trainer's fp32 masters of versions v, v+1, ..., v+S, i.e. at staleness
0..S. It prints, per staleness, the distribution of the group logprob gap (mean |claimed − trainer|
logprob over the group's model tokens) and of the plausibility z, and the share of honest groups the
default bounds (`pnyx.security.checks`) would reject.

With `--liars N` it also measures N groups of two hostile workers at the newest version: a temperature
liar (samples at 0.3, claims 1.0, records its logprobs at 0.3) and a careful one (samples at 0.3 and
rewrites its logprobs to the temperature-1 values of its own weights, so its logprob gap looks honest).

    nice -n 10 python benchmarks/bench_lp_gap.py --versions 32 --groups 80 --staleness 3 --liars 200

Knows nothing about the store: no worker process, no ingestion.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _bf16(state: dict[str, Any]) -> dict[str, Any]:
    import torch

    return {k: v.to(torch.bfloat16).to(torch.float32) for k, v in state.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", type=int, default=32, help="versions generated from (one step each)")
    ap.add_argument("--groups", type=int, default=80, help="honest groups generated per version")
    ap.add_argument("--staleness", type=int, default=3, help="measure at staleness 0..S")
    ap.add_argument("--batch", type=int, default=8, help="groups per training step")
    ap.add_argument("--liars", type=int, default=0, help="hostile groups per liar kind (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch

    from pnyx.config import PnyxConfig, shipped_model_path, with_fields
    from pnyx.envs import get_env
    from pnyx.models import load_model, load_tokenizer
    from pnyx.models.logprobs import completion_logprobs
    from pnyx.protocol import layout
    from pnyx.protocol.rules import is_zero_variance
    from pnyx.rollout.cohort import CohortSpec, generate_cohort
    from pnyx.rollout.engines import make_engine
    from pnyx.security.checks import (
        CheckSettings,
        GroupEvidence,
        KeyEvidence,
        QuarantineSettings,
        add_evidence,
        judge,
        quarantine_reason,
    )
    from pnyx.train.forward import measure_evidence
    from pnyx.train.rescore import rescore
    from pnyx.train.settings import ingest_settings, loss_settings
    from pnyx.train.step import make_optimizer, train_step

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cfg = PnyxConfig()
    path = shipped_model_path()
    tok = load_tokenizer(path)
    env = get_env("arith")
    budget = int(env.max_new_tokens)
    cfg = with_fields(cfg, {"worker.max_new_tokens": budget})
    trainer = load_model(path, dtype="float32")
    worker = load_model(path, dtype="float32")
    engine = make_engine("torch", None, tok, model=worker)
    t = cfg.trainer
    opt = make_optimizer(trainer, t.lr, t.betas, t.weight_decay)
    settings = ingest_settings(cfg)
    w = cfg.worker

    def detok(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    def cohort(version: int, n: int, seed: int, temperature: float) -> list[Any]:
        tasks = env.sample("train", seed, n)
        spec = CohortSpec(
            "bench", "w", version, "d", w.group_size, temperature, w.top_p, w.top_k, budget, seed
        )
        seq = iter(range(1 << 30))
        res = generate_cohort(engine, tok, env, tasks, spec, lambda: next(seq))
        out = []
        for g in res.groups:
            key = layout.rollout_key(version, "w", g.seq)
            out.append(rescore(key, g, env=env, detokenize=detok, settings=settings))
        return out

    masters: list[dict[str, Any]] = []
    groups: list[list[Any]] = []
    t0 = time.perf_counter()
    last = args.versions + args.staleness
    for v in range(last + 1):
        masters.append({k: x.detach().clone() for k, x in trainer.state_dict().items()})
        worker.load_state_dict(_bf16(masters[-1]))
        n = args.groups if v < args.versions else args.batch * 2
        gs = cohort(v, n, args.seed * 100_000 + v, w.temperature)
        if v < args.versions:
            groups.append(gs)
        if v == last:
            break
        batch = [g for g in gs if not is_zero_variance(g.rewards)][: args.batch] or gs[: args.batch]
        train_step(
            trainer, opt, batch, loss_settings(cfg), micro_batch_tokens=t.micro_batch_tokens,
            grad_clip=t.grad_clip, max_len=budget, policy_version=v,
        )  # fmt: skip
        print(f"v{v}: {len(gs)} groups, {time.perf_counter() - t0:.0f}s", flush=True)

    checks = CheckSettings()
    evaluator = load_model(path, dtype="float32")
    per_s: dict[int, list[GroupEvidence]] = {s: [] for s in range(args.staleness + 1)}
    for v, gs in enumerate(groups):
        for s in range(args.staleness + 1):
            evaluator.load_state_dict(masters[v + s])
            per_s[s].extend(measure_evidence(evaluator, gs, v + s).values())

    print(
        f"\nhonest groups: {len(groups) * args.groups} per staleness ({args.versions} versions x {args.groups});"
    )
    print(
        f"group size {w.group_size}, T={w.temperature}, budget {budget} tokens, lr {t.lr}, {time.perf_counter() - t0:.0f}s"
    )
    print(
        f"bounds: lp_gap <= {checks.lp_gap_base} + {checks.lp_gap_per_version}*s, |z| <= {checks.plausibility_z}"
    )
    hdr = "staleness  groups  gap_mean  gap_p99.9  gap_max  bound   z_mean  z_sd   z_p0.1  z_p99.9  |z|max  rejected"
    print(hdr)
    all_z: list[float] = []
    for s, evs in per_s.items():
        gaps = [e.gap for e in evs if e.tokens]
        zs = [e.z for e in evs if e.tokens]
        all_z.extend(zs)
        mean_z = sum(zs) / len(zs)
        sd_z = math.sqrt(sum((z - mean_z) ** 2 for z in zs) / max(1, len(zs) - 1))
        rej = sum(judge(e, checks) is not None for e in evs)
        print(
            f"{s:9d}  {len(evs):6d}  {sum(gaps) / len(gaps):8.4f}  {_pct(gaps, 0.999):9.4f}  {max(gaps):7.4f}"
            f"  {checks.gap_bound(s):5.3f}  {mean_z:+6.3f}  {sd_z:5.3f}  {_pct(zs, 0.001):+6.2f}"
            f"  {_pct(zs, 0.999):+7.2f}  {max(abs(z) for z in zs):6.2f}  {rej}/{len(evs)} ({100 * rej / len(evs):.2f}%)"
        )
    for lim in (3.0, 3.5, 4.0, 4.5, 5.0):
        out = sum(abs(z) > lim for z in all_z)
        print(f"|z| > {lim}: {out}/{len(all_z)} honest group measurements ({100 * out / len(all_z):.3f}%)")
    # Per-key evidence: each version's honest groups as one key, at each staleness (what quarantine sees).
    q = QuarantineSettings()
    flagged = 0
    keys = 0
    for s in per_s:
        evs = per_s[s]
        for i in range(0, len(evs), args.groups):
            k = KeyEvidence()
            for e in evs[i : i + args.groups]:
                add_evidence(k, e, checks)
                if quarantine_reason({"groups": k.n}, k, q) is not None:
                    flagged += 1
                    break
            keys += 1
    print(f"honest keys quarantined by their running z: {flagged}/{keys} (keys of {args.groups} groups)")

    if args.liars:
        v = last
        worker.load_state_dict(_bf16(masters[v]))
        evaluator.load_state_dict(masters[v])
        loud = cohort(v, args.liars, 999_000, 0.3)
        for g in loud:
            g.group.temperature = w.temperature  # the lie: sampled at 0.3, claims the run's
        careful = cohort(v, args.liars, 998_000, 0.3)
        for g in careful:
            g.group.temperature = w.temperature
            for smp in g.group.samples:
                with torch.no_grad():
                    lp, _, _ = completion_logprobs(
                        worker, [list(g.group.prompt_tokens)], [list(smp.tokens)], 1.0
                    )
                smp.logprobs = [float(x) for x in lp[0]]
        for name, gs in (
            ("temperature liar (T=0.3 logprobs)", loud),
            ("careful liar (T=1 logprobs)", careful),
        ):
            evs = list(measure_evidence(evaluator, gs, v).values())
            reasons = [judge(e, checks) for e in evs]
            zs = sorted(e.z for e in evs)
            k = KeyEvidence()
            caught = None
            for i, e in enumerate(evs):
                add_evidence(k, e, checks)
                if caught is None and quarantine_reason({"groups": k.n}, k, QuarantineSettings()) is not None:
                    caught = i + 1
            print(
                f"{name}: {len(evs)} groups, rejected {sum(r is not None for r in reasons)} "
                f"(logprob_gap {reasons.count('logprob_gap')}, implausible {reasons.count('implausible')}); "
                f"z median {zs[len(zs) // 2]:+.2f}, min {zs[0]:+.2f}; gap median "
                f"{sorted(e.gap for e in evs)[len(evs) // 2]:.3f}; tokens/group median "
                f"{sorted(e.tokens for e in evs)[len(evs) // 2]}; its key quarantined by its running z after "
                f"{caught} groups"
            )


if __name__ == "__main__":
    main()
