"""The per-token check of seeded draws (issue #25) on a real run: honest groups rejected, liars caught, cost.

Samples groups with the run's own engines (torch, MLX) from the published weights of chosen versions, with
seeded draws under a worker key (`pnyx.protocol.draws`), exactly as `pnyx worker` does, and checks every
group with the trainer's `DrawCheck` (`pnyx.train.drawcheck`) while the trainer is `s` versions ahead
(staleness 0-3: the check model is first moved to v+s, as a trainer that just checked a fresher group; the
group is then judged under v's weights, kept in memory or rebuilt from the store). Beside it:

- the temperature liar: samples at half the run's temperature with the same seeded uniforms (its best try
  at looking honest) and claims the run's; caught, or token for token the honest draw;
- the cost: seconds of the check per group against seconds of the trainer's own `train_step` (fp32
  masters, AdamW, the run's groups per step) on the same groups, in the same process;
- bytes a group carries for it: the signed record with and without the `draws` field.

Needs a run that kept its versions (`--trainer.keep_anchors 1000`), e.g.

    pnyx run --run.name drawtiny --run.steps 40 --run.eval_every 0 --trainer.keep_anchors 1000
    python benchmarks/bench_draw_check.py --run runs/drawtiny --versions 10,30 --groups 64

    python benchmarks/bench_draw_check.py --run <a run of examples/smollm2-135m.toml> --versions 2,8 --groups 24

Prints one table row per (engine, sampled version, staleness) and a summary per engine.
"""

from __future__ import annotations

import argparse
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
    p.add_argument("--groups", type=int, default=64, help="groups per engine and version")
    p.add_argument("--engines", default="torch,mlx")
    p.add_argument("--tolerance", type=float, default=None, help="default: the run's security.draw_tolerance")
    p.add_argument("--threads", type=int, default=1)
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
    from pnyx.train.drawcheck import DrawCheck
    from pnyx.train.published import PublishedModel
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
    check = DrawCheck({"weights": published}, tolerance, tok.pad_token_id or 0)
    key = Signer(Ed25519PrivateKey.generate()).fingerprint  # a worker's key: its draws are bound to it
    versions = [int(x) for x in args.versions.split(",")]
    stale = [int(x) for x in args.staleness.split(",")]
    newest = latest_version(store, trust) or 0

    def words(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    print(
        f"run {args.run} ({cfg.env.name}, T={w.temperature}, top_p={w.top_p}, top_k={w.top_k}, G={w.group_size}, "
        f"max_new_tokens={w.max_new_tokens}), base {base}, tolerance {tolerance:g}, {args.groups} groups per "
        f"engine and version, {args.threads} thread(s)"
    )
    print(
        f"{'engine':>6} {'sampled':>7} {'stale':>5} {'groups':>6} {'tokens':>7} {'rejected':>8} {'max dist':>9} "
        f"{'check s/group':>13}"
    )
    results: dict = {"tolerance": tolerance, "rows": [], "liar": {}, "cost": {}, "bytes": {}}
    seqs = itertools.count()
    for name in args.engines.split(","):
        try:
            engine = make_engine(name, base, tok)
        except Exception as e:  # noqa: BLE001 - an engine this machine lacks is reported, not fatal
            print(f"{name:>6} unavailable: {e}")
            continue
        syncer = Syncer(store, trust=trust)
        liar_caught = liar_same = liar_n = 0
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
                rejected = tokens = 0
                worst = seconds = 0.0
                for g in honest:
                    with published.lock:
                        published.at(v + s)  # the trainer just checked a group of v + s
                    t0 = time.perf_counter()
                    before = check.stats.max_passing
                    check.stats.max_passing = 0.0
                    reason = check.check(g, key, staleness=s)
                    seconds += time.perf_counter() - t0
                    worst = max(worst, check.stats.max_passing)
                    check.stats.max_passing = max(before, check.stats.max_passing)
                    rejected += reason is not None
                    tokens += sum(sum(x.loss_mask) for x in g.samples)
                row = {
                    "engine": name, "version": v, "staleness": s, "groups": len(honest), "tokens": tokens,
                    "rejected": rejected, "max_distance": worst, "check_s_per_group": seconds / len(honest),
                }  # fmt: skip
                results["rows"].append(row)
                print(
                    f"{name:>6} {v:>7} {s:>5} {len(honest):>6} {tokens:>7} {rejected:>8} {worst:>9.1e} "
                    f"{seconds / len(honest):>13.4f}",
                    flush=True,
                )
            for lg, hg in zip(liars, honest, strict=True):
                lg = msgspec.structs.replace(lg, temperature=w.temperature)
                same = all(a.tokens == b.tokens for a, b in zip(lg.samples, hg.samples, strict=True))
                liar_n += 1
                liar_same += same
                liar_caught += check.check(lg, key) is not None
        differ = liar_n - liar_same
        results["liar"][name] = {"groups": liar_n, "caught": liar_caught, "identical_to_honest": liar_same}
        print(
            f"{name:>6} temperature liar (T/2, same uniforms): {liar_caught} of {liar_n} caught, {liar_same} "
            f"token for token the honest draw; caught among those that differ: {liar_caught}/{differ}"
        )
        engine.close()
        if name == args.engines.split(",")[0]:  # cost and bytes: once, on the first engine's groups
            results["cost"] = _cost(honest_all, key, check, published, env, words, t)
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
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def _cost(groups, key, check, published, env, words, t) -> dict:
    """Check seconds per group against the trainer's `train_step` seconds per group, same groups."""
    import copy

    from pnyx.protocol import layout
    from pnyx.train.ingest_state import IngestSettings
    from pnyx.train.losses import LossSettings
    from pnyx.train.rescore import rescore
    from pnyx.train.step import make_optimizer, train_step

    v = groups[0].policy_version
    same = [g for g in groups if g.policy_version == v]
    with published.lock:
        model = published.at(v)
    master = copy.deepcopy(model).train()  # the trainer's fp32 master, at v's weights
    for p in master.parameters():
        p.requires_grad_(True)
    opt = make_optimizer(master, t.lr, t.betas, t.weight_decay)
    scored = [
        rescore(
            layout.rollout_key(g.policy_version, "bench", g.seq),
            g,
            env=env,
            detokenize=words,
            settings=IngestSettings(),
        )  # fmt: skip
        for g in same
    ]
    per = t.groups_per_step
    batches = [scored[i : i + per] for i in range(0, len(scored) - per + 1, per)]
    check_s = step_s = 0.0
    n_check = n_step = 0
    for batch in batches:
        t0 = time.perf_counter()
        for g in batch:
            check.check(g.group, key)
        check_s += time.perf_counter() - t0
        n_check += len(batch)
        t0 = time.perf_counter()
        train_step(
            master, opt, batch, LossSettings(), micro_batch_tokens=t.micro_batch_tokens, grad_clip=t.grad_clip
        )
        step_s += time.perf_counter() - t0
        n_step += len(batch)
    out = {
        "check_s_per_group": check_s / max(1, n_check),
        "train_step_s_per_group": step_s / max(1, n_step),
        "groups_per_step": per,
        "batches": len(batches),
    }
    out["ratio"] = out["check_s_per_group"] / max(1e-9, out["train_step_s_per_group"])
    print(
        f"cost: check {out['check_s_per_group']:.4f} s/group, train_step {out['train_step_s_per_group']:.4f} s/group "
        f"({per} groups per step, {len(batches)} steps): check / train_step = {out['ratio']:.3f}"
    )
    return out


if __name__ == "__main__":
    main()
