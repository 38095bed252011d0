"""What committed draws cost (`security.committed_draws`, issue #25): the same `pnyx run` with and without them,
alternated in one process so both arms see the same machine.

Each arm is a real `pnyx run --no-live` (a trainer and its workers as processes, a local-folder store) for
`--steps` versions; arms alternate off, on, off, on, ... for `--reps` pairs. Per run it reads the run's own
records: the time the trainer took to publish its last version (`summary.json`'s `train`), held-out pass@1
before and after, the share of generated groups the trainer consumed, the workers' generation time and their
wait for ticks (heartbeats' `generate_seconds`, `commit_wait_seconds`), the trainer's ticks
(`trainer/status.json`), and the bytes committed draws add (`store_bytes`). Prints one row per run and the ratio on/off of the medians.

    python benchmarks/bench_committed.py                                   # tiny default (arith), 30 steps x 2 pairs
    cd /tmp/sr && python /work/main/benchmarks/bench_committed.py --reps 1 --steps 14 \\
        -- --config /work/main/examples/smollm2-135m.toml --run.eval_tasks 64      # SmolLM2-135M recipe
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def parse() -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--reps", type=int, default=2, help="pairs of runs (off, on)")
    p.add_argument("--tag", default=time.strftime("cm%H%M%S"), help="run name prefix")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args, extra = p.parse_known_args()
    return args, [a for a in extra if a != "--"]


def one_run(name: str, steps: int, on: bool, extra: list[str]) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "pnyx",
        "run",
        "--no-live",
        f"--run.steps={steps}",
        f"--run.name={name}",
        *extra,
    ]
    if on:
        cmd.append("--security.committed_draws=true")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(
            f"{name}: pnyx run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    folder = Path("runs") / name
    summary = json.loads((folder / "summary.json").read_text())
    status = json.loads((folder / "trainer" / "status.json").read_text())
    beats = [json.loads(p.read_text()) for p in sorted((folder / "workers").glob("*.json"))]
    supply = summary.get("supply") or {}
    return {
        **(store_bytes(folder) if on else {}),
        "name": name,
        "committed": on,
        "wall_s": round(wall, 1),
        "to_last_version_s": round(summary["train"][-1]["elapsed_s"], 1),
        "final_version": summary["final_version"],
        "pass_before": summary["before"]["pass@1"],
        "pass_after": (summary.get("after") or {}).get("pass@1"),
        "consumed_of_generated": supply.get("consumed_of_generated"),
        "generate_s": round(sum(b.get("generate_seconds", 0.0) for b in beats), 2),
        "commit_wait_s": round(sum(b.get("commit_wait_seconds", 0.0) for b in beats), 2),
        "ticks": status.get("ticks"),
        "drops": status.get("drops"),
    }


def store_bytes(folder: Path) -> dict[str, Any]:
    """What committed draws add to the store of a run: the median commitment object, tick bytes per
    commitment a tick judged, and the median growth of an encoded group for its tick, beacon and commitment
    fields (each group encoded again without them)."""
    import msgspec

    from pnyx.protocol import decode_group, encode_group, layout
    from pnyx.store import open_store

    store = open_store(str(folder))
    commits = [m.size for m in store.list(layout.COMMITS_PREFIX)]
    ticks = [m.size for m in store.list(layout.TICKS_PREFIX) if layout.parse_tick_key(m.key) is not None]
    counts = json.loads((folder / "trainer" / "status.json").read_text()).get("ticks") or {}
    judged = counts.get("included", 0) + counts.get("refused", 0)
    growth = []
    for m in store.list(layout.ROLLOUTS_PREFIX)[:200]:
        g = decode_group(store.get(m.key))
        bare = msgspec.structs.replace(g, tick=-1, beacon="", commit="")
        growth.append(len(encode_group(g)) - len(encode_group(bare)))
    return {
        "commit_bytes": statistics.median(commits) if commits else None,
        "tick_bytes_per_commitment": round(sum(ticks) / max(1, judged), 1),
        "group_bytes_added": statistics.median(growth) if growth else None,
    }


def main() -> None:
    args, extra = parse()
    rows: list[dict[str, Any]] = []
    for rep in range(args.reps):
        for on in (False, True):
            r = one_run(f"{args.tag}-{'on' if on else 'off'}{rep}", args.steps, on, extra)
            rows.append(r)
            print(
                f"{r['name']:>16}  committed={str(on):5}  to v{r['final_version']}: {r['to_last_version_s']:6.1f}s  "
                f"pass@1 {r['pass_before']:.3f} -> {r['pass_after']}  consumed/generated {r['consumed_of_generated']}  "
                f"generate {r['generate_s']}s  tick wait {r['commit_wait_s']}s  ticks {r['ticks']}  drops {r['drops']}",
                flush=True,
            )
    med = {
        on: statistics.median(r["to_last_version_s"] for r in rows if r["committed"] == on)
        for on in (False, True)
    }
    for r in rows:
        if r["committed"] and r.get("commit_bytes") is not None:
            print(
                f"{r['name']}: a commitment {r['commit_bytes']:.0f} bytes, ticks {r['tick_bytes_per_commitment']} "
                f"bytes per commitment, a group {r['group_bytes_added']:.0f} bytes more (encoded, compressed)"
            )
    waits = [
        r["commit_wait_s"] / max(1e-9, r["generate_s"] + r["commit_wait_s"]) for r in rows if r["committed"]
    ]
    print(
        f"median time to the last version: off {med[False]:.1f}s, on {med[True]:.1f}s: on/off {med[True] / med[False]:.2f}x; "
        f"workers' tick wait / (generate + wait) under committed draws: {statistics.median(waits):.1%}"
    )
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "extra": extra, "steps": args.steps}, indent=1))


if __name__ == "__main__":
    main()
