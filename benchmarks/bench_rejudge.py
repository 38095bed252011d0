"""Re-judge, offline, every group of the steps of a finished run that rejected a group (`pnyx.train.rejudge`).

For each such step (its batch record names the groups) and each of its groups: the version it was sampled
at, its exact evidence under the published weights of that version (gap, z, the verdict of the fixed
floors at staleness 0), and its z under the published weights of the version that judged it. A group
whose exact verdict is `None` was honest and would be kept by the exact re-check; the fall of z between
the two versions is the drift the master forward judged it through.

    python benchmarks/bench_rejudge.py runs/<name>        # the run's model folder is read from run.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("run", type=Path, help="a run folder (local store)")
    args = ap.parse_args()

    from pnyx.envs import get_env
    from pnyx.models import load_tokenizer, resolve_run_model
    from pnyx.protocol.codec import decode_group
    from pnyx.protocol.runfile import read_run
    from pnyx.security.checks import CheckSettings, judge
    from pnyx.store import open_store
    from pnyx.train.checkpoint import read_metrics
    from pnyx.train.ingest import IngestSettings
    from pnyx.train.microbatch import build_rows
    from pnyx.train.published import PublishedModel
    from pnyx.train.rejudge import Rejudge
    from pnyx.train.rescore import rescore
    from pnyx.weights.trust import run_verifier

    store = open_store(str(args.run))
    run = read_run(store)
    if run is None:
        sys.exit(f"{args.run}: no run.json")
    folder = resolve_run_model(run.model, None, None).folder
    tok = load_tokenizer(folder)
    env_cfg = run.config["env"]
    env = get_env(env_cfg["name"], **(env_cfg.get("kwargs") or {}))
    rejudge = Rejudge(PublishedModel(store, folder))
    rejudge.published.trust = run_verifier(run)

    def words(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    kept = total = 0
    print(
        f"{'step':>6} {'group':>28} {'sampled':>7} {'exact gap':>9} {'exact z':>8} {'verdict':>12} {'z judged':>8}"
    )
    for m in read_metrics(store):
        if not m.get("rejected"):
            continue
        v = int(m["version"])
        rec = json.loads((args.run / "trainer" / f"batch-{v:08d}.json").read_text())
        for key in rec["keys"]:
            g = decode_group(store.get(key))
            scored = rescore(key, g, env=env, detokenize=words, settings=IngestSettings())
            rows = build_rows([scored])
            exact = rejudge(rows, g.policy_version)[key]
            at_judge = rejudge([replace(r, version=v - 1) for r in rows], v - 1)[key]
            verdict = judge(exact, CheckSettings())
            kept += verdict is None
            total += 1
            print(
                f"v{v - 1}->v{v} {key.rsplit('/', 1)[-1][-28:]:>28} {g.policy_version:>7} {exact.gap:9.4f} "
                f"{exact.z:+8.2f} {str(verdict):>12} {at_judge.z:+8.2f}"
            )
    print(f"{kept} of {total} groups of the rejecting steps pass the exact check at their own version")


if __name__ == "__main__":
    main()
