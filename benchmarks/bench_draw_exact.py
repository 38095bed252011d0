"""The exact re-check of seeded draws (issue #25), replayed on a finished run: what a flagged row costs.

Loads the groups a run's worker sampled at version v and measures every row under version v+s's published
weights, as the step's forward would (the rows over the draw tolerance there are the flagged ones). Then
times the exact re-check of those rows under v's weights, alternating, in one process:

- **whole rows**: every flagged row forwarded whole (prompt and completion, cut after its last flagged
  token), rows sorted by length in calls of `drawcheck.CHUNK_TOKENS`;
- **cached prompts** (the build before the prefix tree; still what `Rejudge.draws` does for models the tree
  does not fit): each distinct prompt forwarded once, every completion on its prompt's KV cache, two calls
  (`drawcheck.cached_prompt_logits`);
- **prefix tree** (what `Rejudge.draws` does for plain full-attention models): the rows' token sequences in a
  trie, each distinct prefix forwarded once (template and system prompt, prompts, completions' common
  starts), one call (`prefix_tree.tree_logits`).

Then the drift probe's forward of 4 rows, padded against the prefix tree (`Forward.logp`), and what one
forward of the model costs by its token count (1, 16, 64). Beside it, what moving the exact model one
version forward costs: syncing the version from the store
(download, decode, verify the hash chain; what every step paid before the trainer handed its own published
states over) against copying in the state the trainer remembered (`PublishedModel.remember`). And what a
skip record's audit costs (the exact check of its draws, `Rejudge.draws` on its rows, the model already at
its version), for each skip record sampled at the version.

    python benchmarks/bench_draw_exact.py --run runs/<smollm2 recipe run> --version 1 --staleness 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--run", required=True, help="a finished run's store (its weights and rollouts)")
    p.add_argument("--version", type=int, default=1, help="the version the groups were sampled from")
    p.add_argument("--staleness", type=int, default=1, help="the trainer's version is version + staleness")
    p.add_argument("--tolerance", type=float, default=1e-3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    import torch

    from pnyx.models.source import resolve_run_model
    from pnyx.protocol.codec import decode_group, frame_signer
    from pnyx.protocol.runfile import read_run
    from pnyx.security.signing import fingerprint
    from pnyx.store import open_store
    from pnyx.train.drawcheck import prefix
    from pnyx.train.forward import Forward
    from pnyx.train.microbatch import build_rows, plan_micro_batches
    from pnyx.train.prefix_tree import Tree
    from pnyx.train.published import PublishedModel
    from pnyx.train.rejudge import _distances, sharing_of
    from pnyx.train.rescore import ScoredGroup
    from pnyx.weights import Syncer
    from pnyx.weights.trust import run_verifier

    torch.set_num_threads(args.threads)
    store = open_store(args.run)
    run = read_run(store)
    if run is None:
        sys.exit(f"{args.run}: no run.json")
    trust = run_verifier(run)
    v, newer = args.version, args.version + args.staleness
    groups = []
    for key in [m.key for m in store.list(f"rollouts/v{v:08d}/")]:
        data = store.get(key)
        g = decode_group(data)
        rewards = [s.reward for s in g.samples]
        groups.append(
            ScoredGroup(
                key, g.policy_version, g.worker_id, g.task_id, g, rewards, [1.0] * len(rewards), rewards,
                signer=fingerprint(frame_signer(data)),
            )
        )  # fmt: skip
    rows = [r for r in build_rows(groups) if r.uniforms is not None]
    if not rows:
        sys.exit(f"no seeded rows at v{v}")

    published = PublishedModel(store, resolve_run_model(run.model).folder, keep=4)
    published.trust = trust
    switch: dict[str, list[float]] = {"synced from the store": [], "remembered": []}
    for _ in range(args.repeats):
        syncer = Syncer(store, trust=trust)
        syncer.sync(to_version=v)
        published.remember(v, syncer.digest or "", {k: t.clone() for k, t in syncer.tensors.items()})
        t0 = time.perf_counter()  # what the trainer paid per version before it remembered its own states
        syncer.sync(to_version=newer)
        tensors = {k: t.clone() for k, t in syncer.tensors.items()}
        switch["synced from the store"].append(time.perf_counter() - t0)
        published.remember(newer, syncer.digest or "", tensors)
        published.at(v)
        t0 = time.perf_counter()
        published.at(newer)
        switch["remembered"].append(time.perf_counter() - t0)

    from pnyx.protocol import layout
    from pnyx.train.rejudge import Rejudge

    audits: list[tuple[float, int, int]] = []  # a skip record's audit: (seconds, rows, completion tokens)
    rejudge = Rejudge(published)
    with published.lock:
        published.at(v)  # as in a run: the model already at the version (moving it is timed above)
        for g in (g for g in groups if layout.is_skip_key(g.key)):
            audit_rows = build_rows([g])
            t0 = time.perf_counter()
            rejudge.draws(audit_rows)  # what `WaitWork.audit_skip_draws` runs per skip record
            audits.append(
                (time.perf_counter() - t0, len(audit_rows), sum(len(r.completion) for r in audit_rows))
            )

    with published.lock:
        trainer = published.at(newer)
        fwd = Forward(trainer, torch.device("cpu"), torch.float32, False)
        flagged, positions = [], 0
        with torch.no_grad():
            for idx in plan_micro_batches(rows, 4096):
                mb = fwd.run([rows[i] for i in idx], entropy=False, var=False, draws=True)
                assert mb.draw is not None
                over = mb.draw > args.tolerance
                for j, i in enumerate(idx):
                    if over[j].any():
                        positions += int(over[j].sum())
                        flagged.append(prefix(rows[i], int(over.shape[1] - over[j].flip(0).float().argmax())))
        model = published.at(v)
        arms = {"whole rows": "none", "cached prompts": "prompts", "prefix tree": "tree"}
        if sharing_of(model) != "tree":
            del arms["prefix tree"]
        times: dict[str, list[float]] = {label: [] for label in arms}
        found = {}
        for _ in range(args.repeats):
            for label, sharing in arms.items():
                t0 = time.perf_counter()
                found[label] = _distances(model, flagged, sharing=sharing)  # type: ignore[arg-type]
                times[label].append(time.perf_counter() - t0)
        tree = Tree()
        for r in flagged:
            tree.add(r.prompt + r.completion)
        # the drift probe's forward (one row of each of the first 4 groups, as the step holds out): padded
        # (`Forward.run`) against the prefix tree (`Forward.logp`), under the same weights, alternating
        probe = [next(r for r in rows if r.key == g.key) for g in groups[:4]]
        exact_fwd = Forward(model, torch.device("cpu"), torch.float32, False)
        probe_t: dict[str, list[float]] = {"padded": [], "prefix tree": []}
        with torch.no_grad():
            for _ in range(args.repeats):
                for label in probe_t:
                    t0 = time.perf_counter()
                    if label == "padded":
                        exact_fwd.run(probe, entropy=False, var=False)
                    else:
                        exact_fwd.logp(probe)
                    probe_t[label].append(time.perf_counter() - t0)
            gap = float(
                (exact_fwd.run(probe, entropy=False, var=False).logp - exact_fwd.logp(probe).logp).abs().max()
            )
            # what one forward costs by its token count: mostly the read of every weight
            per_tokens = {}
            seq = (rows[0].prompt + rows[0].completion) * 64
            for n in (1, 16, 64):
                ids = torch.tensor([seq[:n]])
                model(ids, logits_to_keep=1)
                best = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    model(ids, logits_to_keep=1)
                    best.append(time.perf_counter() - t0)
                per_tokens[n] = min(best)

    print(
        f"run {args.run}: {len(groups)} groups sampled at v{v}, {len(rows)} rows (prompts of "
        f"{min(len(r.prompt) for r in rows)}-{max(len(r.prompt) for r in rows)} tokens, completions "
        f"{statistics.mean(len(r.completion) for r in rows):.1f} on average); under v{newer}'s weights "
        f"{len(flagged)} rows flagged ({positions} positions over {args.tolerance:g}), cut to "
        f"{sum(len(r.completion) for r in flagged)} completion tokens; {args.threads} thread(s), median of "
        f"{args.repeats}"
    )
    med = {label: statistics.median(t) for label, t in times.items()}
    for label, t in med.items():
        print(
            f"  exact re-check, {label:>14}: {t:.3f} s = {t / max(1, len(flagged)):.4f} s per flagged row, "
            f"largest distance {max(found[label]):.2e}"
        )
    for label in ("cached prompts", "prefix tree"):
        if label in med:
            print(f"  {label} / whole rows: {med[label] / med['whole rows']:.2f}x the time")
    print(
        f"  tokens forwarded: whole rows {sum(len(r.prompt) + len(r.completion) for r in flagged)}, cached "
        f"prompts {sum(len(p) for p in {tuple(r.prompt) for r in flagged})}+"
        f"{sum(len(r.completion) for r in flagged)}, prefix tree {len(tree.tokens)}"
    )
    padded, treed = (statistics.median(probe_t[k]) for k in ("padded", "prefix tree"))
    print(
        f"  the drift probe's forward ({len(probe)} rows): padded {padded:.3f} s, prefix tree {treed:.3f} s = "
        f"{treed / padded:.2f}x, log q apart by at most {gap:.1e}"
    )
    print(
        "  one forward of the exact model by its tokens (best of the repeats): "
        + ", ".join(f"{n} token(s) {1000 * t:.0f} ms" for n, t in per_tokens.items())
    )
    synced, kept = (statistics.median(switch[k]) for k in ("synced from the store", "remembered"))
    print(
        f"  the exact model from v{v} to v{newer}: {synced:.3f} s synced from the store (one delta, verified) "
        f"and copied in, {kept:.3f} s from the state the trainer remembered"
    )
    if audits:
        print(
            f"  a skip record's audit at v{v} ({len(audits)} records): median "
            f"{statistics.median(a[0] for a in audits):.3f} s per group of "
            f"{statistics.median(a[1] for a in audits):.0f} rows, "
            f"{statistics.median(a[2] for a in audits):.0f} completion tokens"
        )


if __name__ == "__main__":
    main()
