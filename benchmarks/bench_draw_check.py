"""The check of seeded draws (issue #25) in the trainer's step: honest rows flagged and rejected, liars
caught, and the check's cost against the step it rides in, per staleness.

Samples groups with the run's own engines (torch, MLX) from the published weights of chosen versions, with
seeded draws under a worker key (`pnyx.protocol.draws`), exactly as `pnyx worker` does. Then, for each
staleness s, steps a trainer whose master holds version v+s (the published weights: with the run's
publish dtype as `forward_dtype`, the step's forward is the published model's) on those groups, in batches
of the run's `groups_per_step`, twice from the same weights, alternating:

- **on**: `train_step` with the draw check (`checks.draw_tolerance`, `exact_draws` = `Rejudge.draws`):
  every token measured in the step's own forward, rows over the tolerance measured again under v's exact
  weights (kept in memory or rebuilt from the store);
- **off**: the same step without it.

Printed per row: rows flagged by the step's forward (their exact re-check is the cost), groups rejected
(honest: must be 0), the exact forwards' seconds, and the step's seconds on and off; the ratio
(on - off) / off is the check's whole cost (its share of the forward and its exact re-checks).

Beside it, the temperature liar (samples at half the run's temperature with the same seeded uniforms, its
best try at looking honest, and claims the run's) stepped on the same way, and the bytes a group carries
for the scheme. Needs a run that kept its versions (`--trainer.keep_anchors 1000`), e.g.

    pnyx run --run.name drawtiny --run.steps 40 --run.eval_every 0 --trainer.keep_anchors 1000
    python benchmarks/bench_draw_check.py --run runs/drawtiny --versions 10,30 --groups 32

`--device cuda --dtype bfloat16` samples on a GPU worker in bf16 (the trainer stays on the CPU in fp32): how
many honest tokens other kernels and another dtype put outside the tolerance.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument(
        "--run", required=True, help="the run's store (a local folder or URL) with its versions kept"
    )
    p.add_argument("--versions", default="10,30", help="versions sampled from")
    p.add_argument("--staleness", default="0,1,2,3")
    p.add_argument("--groups", type=int, default=32, help="groups per engine and version")
    p.add_argument("--engines", default="torch,mlx")
    p.add_argument(
        "--device", default="cpu", help="the engines' device (cuda: a GPU worker; MLX stays on the CPU)"
    )
    p.add_argument("--dtype", default="float32", help="the engines' compute dtype (bfloat16: a bf16 worker)")
    p.add_argument("--tolerance", type=float, default=None, help="default: the run's security.draw_tolerance")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the figures here")
    return p.parse_args()


def main() -> None:
    args = parse()
    import msgspec
    import torch
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from pnyx.config import PnyxConfig
    from pnyx.envs import get_env
    from pnyx.models import load_tokenizer
    from pnyx.models.source import resolve_run_model
    from pnyx.protocol.codec import encode_group
    from pnyx.protocol.runfile import read_run
    from pnyx.rollout.cohort import CohortSpec, generate_cohort
    from pnyx.rollout.engines import make_engine
    from pnyx.security.signing import Signer
    from pnyx.store import open_store
    from pnyx.train.published import PublishedModel
    from pnyx.train.rejudge import Rejudge
    from pnyx.weights import Syncer
    from pnyx.weights.manifest import latest_version
    from pnyx.weights.trust import run_verifier

    torch.set_num_threads(args.threads)
    store = open_store(args.run)
    run = read_run(store)
    if run is None:
        sys.exit(f"{args.run}: no run.json")
    cfg = PnyxConfig.model_validate(run.config)
    w, t = cfg.worker, cfg.trainer
    base = resolve_run_model(run.model).folder
    tok = load_tokenizer(base)
    env = get_env(cfg.env.name, **(cfg.env.kwargs or {}))
    trust = run_verifier(run)
    tolerance = cfg.security.draw_tolerance if args.tolerance is None else args.tolerance
    published = PublishedModel(store, base)
    published.trust = trust
    exact = Rejudge(published)
    key = Signer(Ed25519PrivateKey.generate()).fingerprint  # a worker's key: its draws are bound to it
    versions = [int(x) for x in args.versions.split(",")]
    stale = [int(x) for x in args.staleness.split(",")]
    newest = latest_version(store, trust) or 0
    stepper = _Stepper(published, exact, env, tok, t, tolerance, getattr(torch, t.publish_dtype), key)

    print(
        f"run {args.run} ({cfg.env.name}, T={w.temperature}, top_p={w.top_p}, top_k={w.top_k}, G={w.group_size}, "
        f"max_new_tokens={w.max_new_tokens}, lr={t.lr}, {t.groups_per_step} groups per step), base {base}, "
        f"tolerance {tolerance:g}, {args.groups} groups per engine and version, {args.threads} thread(s); "
        f"engines on {args.device} in {args.dtype}, the trainer's step and exact re-checks on the CPU in float32"
    )
    print(
        f"{'engine':>6} {'sampled':>7} {'stale':>5} {'groups':>6} {'rows':>5} {'flagged':>7} {'rejected':>8} "
        f"{'exact s':>8} {'step on':>8} {'step off':>8} {'cost':>7}"
    )
    results: dict = {"tolerance": tolerance, "rows": [], "liar": {}, "bytes": {}}
    seqs = itertools.count()
    for name in args.engines.split(","):
        try:
            device = "cpu" if name == "mlx" else args.device
            engine = make_engine(name, base, tok, dtype=args.dtype, device=device)
        except Exception as e:  # noqa: BLE001 - an engine this machine lacks is reported, not fatal
            print(f"{name:>6} unavailable: {e}")
            continue
        syncer = Syncer(store, trust=trust)
        liar = {"groups": 0, "differ": 0, "caught": 0, "caught_differ": 0}
        honest_all = []
        for v in versions:
            syncer.sync(v)
            engine.update(v, syncer.state, syncer.manifest)
            tasks = env.sample("train", seed=1000 + v, n=args.groups)
            first = next(seqs) * 10_000
            made = {}
            for label, temperature in (("honest", w.temperature), ("liar", w.temperature / 2)):
                spec = CohortSpec(
                    run_id=run.run_id, worker_id="bench", version=v, digest=syncer.digest or "",
                    group_size=w.group_size, temperature=temperature, top_p=w.top_p, top_k=w.top_k,
                    max_new_tokens=int(w.max_new_tokens or 64), seed=v, key=key,
                )  # fmt: skip
                numbering = itertools.count(first)  # the liar draws the honest groups' seqs
                made[label] = generate_cohort(engine, tok, env, tasks, spec, numbering.__next__).groups
            honest, liars = made["honest"], made["liar"]
            honest_all += honest
            for s in stale:
                if v + s > newest:
                    continue
                row = {"engine": name, "version": v, "staleness": s, **stepper.run(honest, v + s)}
                results["rows"].append(row)
                print(
                    f"{name:>6} {v:>7} {s:>5} {row['groups']:>6} {row['rows']:>5} {row['flagged']:>7} "
                    f"{row['rejected']:>8} {row['exact_s']:>8.3f} {row['step_on_s']:>8.3f} {row['step_off_s']:>8.3f} "
                    f"{100 * row['cost']:>6.1f}%",
                    flush=True,
                )
            claimed = [msgspec.structs.replace(x, temperature=w.temperature) for x in liars]
            out = stepper.run(claimed, v, off=False)
            for lg, hg in zip(claimed, honest, strict=True):
                same = all(a.tokens == b.tokens for a, b in zip(lg.samples, hg.samples, strict=True))
                caught = stepper.key_of(lg) in out["rejected_keys"]
                liar["groups"] += 1
                liar["differ"] += not same
                liar["caught"] += caught
                liar["caught_differ"] += caught and not same
        results["liar"][name] = liar
        print(
            f"{name:>6} temperature liar (T/2, same uniforms, claims T): {liar['caught']} of {liar['groups']} "
            f"rejected; among those that differ from the honest draw: {liar['caught_differ']}/{liar['differ']}"
        )
        engine.close()
        if not results["bytes"]:
            plain = [len(encode_group(msgspec.structs.replace(g, draws=""))) for g in honest_all]
            seeded = [len(encode_group(g)) for g in honest_all]
            results["bytes"] = {
                "mean_record": sum(seeded) / len(seeded),
                "added": (sum(seeded) - sum(plain)) / len(seeded),
            }
            print(
                f"bytes per group: {results['bytes']['added']:.1f} added to a {results['bytes']['mean_record']:.0f}-byte "
                "record (the `draws` field; the uniforms are derived, never sent)"
            )
    rows = results["rows"]
    if rows:
        on = sum(r["step_on_s"] for r in rows)
        off = sum(r["step_off_s"] for r in rows)
        ex = sum(r["exact_s"] for r in rows)
        results["summary"] = {"cost": (on - off) / off, "exact_share": ex / off}
        print(
            f"all rows: step with the check {on:.2f} s, without {off:.2f} s: cost {100 * (on - off) / off:.1f}% "
            f"of the step (exact re-checks {100 * ex / off:.1f}%); honest groups rejected "
            f"{sum(r['rejected'] for r in rows)} of {sum(r['groups'] for r in rows)}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


class _Stepper:
    """Steps a trainer at a chosen published version on groups, with and without the draw check."""

    def __init__(self, published, exact, env, tok, t, tolerance, publish_dtype, key):
        self.published, self.exact, self.env, self.tok, self.t = published, exact, env, tok, t
        self.tolerance, self.dtype, self.key = tolerance, publish_dtype, key

    def key_of(self, g) -> str:
        from pnyx.protocol import layout

        return layout.rollout_key(g.policy_version, g.worker_id, g.seq, stamp_ms=0)

    def run(self, groups, at: int, off: bool = True) -> dict:
        """Step on `groups` (batches of groups_per_step) from version `at`'s weights; figures summed."""
        from pnyx.security.checks import CheckSettings
        from pnyx.train.ingest_state import IngestSettings
        from pnyx.train.losses import LossSettings
        from pnyx.train.rescore import rescore
        from pnyx.train.step import make_optimizer, train_step

        def words(ids):
            return self.tok.decode(ids, skip_special_tokens=True)

        scored = [
            rescore(self.key_of(g), g, env=self.env, detokenize=words, settings=IngestSettings())
            for g in groups
        ]
        for s in scored:
            s.signer = self.key
        with self.published.lock:
            master = copy.deepcopy(self.published.at(at)).train()
        for p in master.parameters():
            p.requires_grad_(True)
        per = self.t.groups_per_step
        out = {"groups": len(groups), "rows": 0, "flagged": 0, "rejected": 0, "exact_s": 0.0, "step_on_s": 0.0,
               "step_off_s": 0.0, "rejected_keys": set()}  # fmt: skip
        arms = [("on", True), ("off", False)] if off else [("on", True)]
        for i, a in enumerate(range(0, len(scored), per)):
            batch = scored[a : a + per]
            for label, on in arms if i % 2 == 0 else arms[::-1]:  # alternate which arm goes first
                model = copy.deepcopy(master)
                opt = make_optimizer(model, self.t.lr, self.t.betas, self.t.weight_decay)
                checks = CheckSettings(
                    lp_gap_base=None, plausibility_z=None, draw_tolerance=self.tolerance if on else None
                )
                t0 = time.perf_counter()
                stats = train_step(
                    model, opt, batch, LossSettings(), micro_batch_tokens=self.t.micro_batch_tokens,
                    grad_clip=self.t.grad_clip, policy_version=at, checks=checks,
                    exact_draws=self.exact.draws if on else None, forward_dtype=self.dtype,
                )  # fmt: skip
                out[f"step_{label}_s"] += time.perf_counter() - t0
                if on and stats.draws is not None:
                    out["rows"] += stats.draws.rows
                    out["flagged"] += stats.draws.flagged
                    out["exact_s"] += stats.draws.seconds
                    out["rejected"] += len(stats.rejected)
                    out["rejected_keys"] |= set(stats.rejected)
        out["cost"] = (out["step_on_s"] - out["step_off_s"]) / max(1e-9, out["step_off_s"]) if off else 0.0
        if not off:
            return out
        out.pop("rejected_keys")
        return out


if __name__ == "__main__":
    main()
