"""Where one exact check's time goes on a finished run: the exact-check model (`PublishedModel`, fp32)
moving between two versions it keeps, against a bare forward of 1 and of 8 rows at that version. A sampled
skip-record check is one such move at most and a forward of its rows (BENCHMARKS.md, "An untrusted worker,
measured directly").

    python benchmarks/bench_check_forward.py runs/<name> [--model PATH] [--tokens 40] [--threads 1]

`--model`: the run's model as the trainer named it, when it is a path relative to another folder (the
SmolLM2 recipe's `models/...gguf`: run from where `scripts/get_smollm2.py` put it, or pass the path).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def median_s(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="the run's store (a folder or URL)")
    p.add_argument("--model", default=None, help="the run's model path, if relative to another folder")
    p.add_argument("--tokens", type=int, default=40, help="tokens per row (prompt and completion)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    import torch

    from pnyx.models import resolve_run_model
    from pnyx.protocol.runfile import read_run
    from pnyx.store import open_store
    from pnyx.train.published import PublishedModel
    from pnyx.weights import latest_version
    from pnyx.weights.trust import run_verifier

    torch.set_num_threads(args.threads)
    store = open_store(args.run)
    run = read_run(store)
    if run is None:
        sys.exit(f"{args.run}: no run.json (not a run's store)")
    trust = run_verifier(run)
    newest = latest_version(store, trust)
    if newest is None or newest < 1:
        sys.exit(f"{args.run}: fewer than two versions signed by the run's trainer")
    model = PublishedModel(store, resolve_run_model(run.model, args.model, None).folder, keep=2)
    model.trust = trust
    with model.lock:
        for v in (newest - 1, newest):
            model.at(v)  # fetched, verified and kept
        switch = median_s(lambda: [model.at(v) for v in (newest - 1, newest)], 6) / 2
        net = model.at(newest)
        with torch.no_grad():
            one = torch.randint(0, 1000, (1, args.tokens))
            eight = torch.randint(0, 1000, (8, args.tokens))
            f1 = median_s(lambda: net(input_ids=one), 5)
            f8 = median_s(lambda: net(input_ids=eight), 3)
    print(
        f"{args.run} v{newest - 1}/v{newest}, {args.threads} thread(s): moving between two kept versions "
        f"{switch:.3f} s; a forward of 1 row x {args.tokens} tokens {f1:.3f} s, of 8 rows {f8:.3f} s"
    )


if __name__ == "__main__":
    main()
