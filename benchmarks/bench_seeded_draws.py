"""Design measurement for verifiable sampling (issue #25): can a trainer check a seeded draw, and against what?

A worker draws token t of sample i by inverse CDF at a uniform u it cannot choose (a hash of run, key, task,
version, group, i and t), over the sampling distribution in vocabulary order. A checker recomputes the
distribution and measures how far u lies outside the drawn token's CDF interval (0: the token is exactly
the one u selects). This script samples groups with the published weights of version v (as a worker does)
and measures that distance under:

- the same published weights (`--check 0`: what a trainer holding the sampled version's weights sees);
- the published weights of v+1, v+2, v+3 (`--check 1,2,3`: what a trainer checking a stale group with its
  own newer weights sees);
- `m`: the published weights plus noise within half a bf16 ulp (a trainer's fp32 masters, which round to
  the published bf16 state), i.e. checking with the masters instead of the published weights.

Beside the honest worker: a temperature liar sampling at half the temperature with the same seeded uniforms
(the best it can do to look honest), and one with its own randomness. For each tolerance it prints the share
of honest tokens and groups flagged and the share of liar groups caught (a group is flagged if any token is
further than the tolerance outside its interval). With the exact distribution and tolerance 0 a group
passes only if every token is the one u selects, i.e. only if it is the honest draw.

Needs a run that kept consecutive versions (the default retention prunes them), e.g.

    pnyx run --run.name seeded --run.steps 60 --run.eval_every 0 --trainer.keep_anchors 1000
    python benchmarks/bench_seeded_draws.py --run runs/seeded --versions 30,55 --check m,0,1,2,3

and for SmolLM2-135M-Instruct a run of examples/smollm2-135m.toml (its base folder is the dequantized GGUF
that `pnyx run` cached; `--base` names it):

    python benchmarks/bench_seeded_draws.py --run runs/smollm2 --base ~/.cache/pnyx/gguf/<id> \\
        --temperature 0.7 --versions 3,9 --groups 12 --check 0,1 \\
        --env-kwargs '{"digits": 1, "ops": ["+"], "answer": "lenient", "test_fraction": 0.5}' \\
        --system-prompt "Answer with only the number."

A measurement, not a part of pnyx: nothing here is used by a worker or the trainer yet.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TOLERANCES = (0.0, 1e-3, 1e-2, 3e-2, 0.1)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--run", required=True, help="a run's store (local folder) with consecutive versions kept")
    p.add_argument("--base", default=str(REPO / "pnyx" / "assets" / "tiny-base"), help="the run's base model")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--versions", default="30,55", help="versions sampled from")
    p.add_argument("--check", default="m,0,1,2,3", help="checked under: staleness 0..3, m = fp32 masters")
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--env", default="arith")
    p.add_argument("--env-kwargs", default="{}", help="JSON")
    p.add_argument("--system-prompt", default=None)
    return p.parse_args()


def uniforms(material: str, n: int) -> np.ndarray:
    """n uniforms in [0, 1) from a hash of `material` and the position: nothing the worker can choose."""
    out = np.empty(n)
    for t in range(n):
        h = hashlib.blake2b(f"{material}/{t}".encode(), digest_size=8).digest()
        out[t] = (int.from_bytes(h, "big") >> 11) / 2.0**53
    return out


def main() -> None:
    args = parse()
    import torch
    from transformers import AutoModelForCausalLM

    from pnyx.envs import get_env
    from pnyx.models import load_tokenizer
    from pnyx.models.tokenizer import eos_token_ids, render_prompt
    from pnyx.store import open_store
    from pnyx.weights.trusted import TrustedWeights

    torch.set_num_threads(1)
    tok = load_tokenizer(args.base)
    eos = set(eos_token_ids(tok))
    syncer = TrustedWeights.open(open_store(args.run), None).syncer()
    model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32).eval()
    G, T = args.group_size, args.temperature

    def load(v: int) -> None:
        syncer.sync(to_version=v)
        _, unexpected = model.load_state_dict({k: t.float() for k, t in syncer.tensors.items()}, strict=False)
        assert not unexpected, unexpected

    def as_masters(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                ulp = p.data.to(torch.bfloat16).float().abs() * 2.0**-7
                p.data.add_((torch.rand(p.shape, generator=g) - 0.5) * ulp)

    def probs(logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits.double() / T, -1)

    @torch.no_grad()
    def sample(prompt: list[int], us: list[np.ndarray], temp: float, rng=None) -> list[list[int]]:
        seqs = []
        for i in range(G):
            ids, out = list(prompt), []
            r = model(torch.tensor([ids]), use_cache=True)
            for t in range(args.max_new_tokens):
                if t:
                    r = model(torch.tensor([[ids[-1]]]), past_key_values=r.past_key_values, use_cache=True)
                cdf = torch.cumsum(torch.softmax(r.logits[0, -1].double() / temp, -1), 0)
                u = us[i][t] if rng is None else rng.random()
                y = min(int(torch.searchsorted(cdf, cdf[-1] * u, right=True)), cdf.numel() - 1)
                ids.append(y)
                out.append(y)
                if y in eos:
                    break
            seqs.append(out)
        return seqs

    @torch.no_grad()
    def distances(prompt: list[int], seqs: list[list[int]], us: list[np.ndarray]) -> list[float]:
        d: list[float] = []
        for i, out in enumerate(seqs):
            logits = model(torch.tensor([prompt + out])).logits[
                0, len(prompt) - 1 : len(prompt) - 1 + len(out)
            ]
            p = probs(logits)
            cdf = torch.cumsum(p, -1)
            cdf = cdf / cdf[:, -1:]
            y = torch.tensor(out)[:, None]
            hi = cdf.gather(1, y)[:, 0]
            lo = hi - p.gather(1, y)[:, 0] / p.sum(-1)
            u = torch.tensor(us[i][: len(out)], dtype=hi.dtype)
            d += torch.clamp(torch.maximum(lo - u, u - hi), min=0).tolist()
        return d

    env = get_env(args.env, **json.loads(args.env_kwargs))
    tasks = env.sample("train", 7, args.groups)
    print(
        f"run {args.run}, base {args.base}, T={T}, {args.groups} groups x {G}, versions {args.versions}, "
        f"checked under {args.check}"
    )
    print(
        f"{'sampled':>7} {'checked':>8} {'tol':>6} {'honest tok':>10} {'honest grp':>10} {'liar(u) caught':>14} {'liar(own) caught':>16}"
    )
    t0 = time.time()
    for v in (int(x) for x in args.versions.split(",")):
        load(v)
        groups = []
        for gi, task in enumerate(tasks):
            msgs = task.prompt
            if args.system_prompt is not None and isinstance(msgs, list):
                msgs = [{"role": "system", "content": args.system_prompt}] + [
                    m for m in msgs if m["role"] != "system"
                ]
            prompt = render_prompt(tok, msgs)
            us = [uniforms(f"run/key/{task.id}/v{v}/g{gi}/s{i}", args.max_new_tokens) for i in range(G)]
            groups.append(
                (prompt, us, {
                    "honest": sample(prompt, us, T),
                    "liar_u": sample(prompt, us, T / 2),
                    "liar_own": sample(prompt, us, T / 2, np.random.default_rng(gi)),
                })
            )  # fmt: skip
        for mode in args.check.split(","):
            load(v if mode == "m" else v + int(mode))
            if mode == "m":
                as_masters(v)
            dist = {name: [distances(p, seqs[name], us) for p, us, seqs in groups] for name in groups[0][2]}
            label = "masters" if mode == "m" else f"v+{mode}"
            for tol in TOLERANCES:
                flagged = {n: [any(x > tol for x in g) for g in dist[n]] for n in dist}
                toks = [x for g in dist["honest"] for x in g]
                print(
                    f"{'v' + str(v):>7} {label:>8} {tol:>6g} {sum(x > tol for x in toks) / len(toks):>10.4f} "
                    f"{np.mean(flagged['honest']):>10.3f} {np.mean(flagged['liar_u']):>14.2f} "
                    f"{np.mean(flagged['liar_own']):>16.2f}"
                )
            toks = np.array([x for g in dist["honest"] for x in g])
            print(
                f"{'':>7} {label:>8} honest distance 99%/99.9%/max {np.quantile(toks, 0.99):.1e} / "
                f"{np.quantile(toks, 0.999):.1e} / {toks.max():.1e} over {len(toks)} tokens",
                flush=True,
            )
    print(f"{time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
