"""The worker's pause per version on a real model: what it costs to go from one verified version to the next.

A trainer side takes real AdamW steps on the model (fp32 masters, random-token batches, the recipe's
learning rate) and publishes every version's bf16 cast with pnyx's Publisher to a local-folder store
(anchor at v0, then PULSE deltas). A worker side follows each version as a worker does:
1. in the background (the prefetch thread, overlapped with generation in a real worker): fetch the delta,
   apply it onto a private copy, verify every tensor's digest and the hash chain (`Syncer`);
2. at the cohort boundary, the **pause**, when the worker does not generate: install the staged state
   (`swap`), write the changed tensors into the resident engine in place and prove them against the
   manifest (`engine.update`: apply + proof), then the first decode step from the new weights.
The two sides alternate in one process (a step, a publish, then the worker's sync and pause), so the
worker's figures never overlap the trainer's work. The baseline in the same run is a worker without in-place updates: a fresh engine built from the model
folder plus the same update (what a reload costs per version).

    python benchmarks/bench_worker_pause.py                      # SmolLM2-135M-Instruct, torch engine
    python benchmarks/bench_worker_pause.py --engine mlx
    python benchmarks/bench_worker_pause.py --model tiny --versions 5

Prints a row per version and the medians. Wall-clock on a shared machine: read the medians and the ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 | tiny | a folder, .gguf or hub id")
    ap.add_argument("--engine", default="torch", choices=["torch", "mlx"])
    ap.add_argument("--versions", type=int, default=20, help="deltas after the anchor")
    ap.add_argument("--lr", type=float, default=4e-5, help="AdamW learning rate (the SmolLM2 recipe's)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a worker's default on 2 cores)")
    args = ap.parse_args()

    import torch

    from benchmarks.bench_engines import model_path
    from pnyx.models import load_model, load_tokenizer
    from pnyx.rollout.engines import make_engine
    from pnyx.rollout.sampling import SamplingParams
    from pnyx.store import open_store
    from pnyx.weights import Publisher, Syncer, kernels

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    path = model_path(args.model)
    tok = load_tokenizer(path)
    store = open_store(tempfile.mkdtemp(prefix="bench-pause-"))
    pub = Publisher(store, anchor_every=10**6)
    master = load_model(path, dtype="float32")
    opt = torch.optim.AdamW(master.parameters(), lr=args.lr)
    vocab = len(tok)

    def cast() -> dict:
        return {k: v.detach().to(torch.bfloat16) for k, v in master.state_dict().items()}

    def train_and_publish(v: int) -> float:
        t = time.perf_counter()
        ids = torch.randint(10, vocab - 10, (1, 32))
        master(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        pub.publish(v, cast())
        return time.perf_counter() - t

    pub.publish(0, cast())
    print(
        f"model={args.model} ({path.name}) engine={args.engine} versions=1+{args.versions} lr={args.lr:g} "
        f"torch_threads={args.threads} pulse_kernels={kernels.KERNELS} load={os.getloadavg()[0]:.1f}",
        flush=True,
    )

    syncer = Syncer(store)
    syncer.sync(0)
    engine = make_engine(args.engine, path, tok, dtype="float32")
    engine.update(0, syncer.state, syncer.manifest)
    prompt = [tok("What is 3 + 4?")["input_ids"]]
    one = SamplingParams(temperature=0.7, max_new_tokens=1, seed=0)
    engine.generate(prompt, one)  # warm-up

    print(
        f"{'v':>3} {'tensors':>8} {'delta KB':>9} {'bg sync s':>9} {'swap s':>7} {'apply s':>8} "
        f"{'proof s':>8} {'1st tok s':>9} {'pause s':>8}"
    )
    rows = []
    for v in range(1, args.versions + 1):
        train_and_publish(v)  # the trainer's step and publish (not timed: the worker's side is)
        t = time.perf_counter()
        syncer.prefetch_once()  # the background part (the prefetch thread in a worker)
        bg = time.perf_counter() - t
        t = time.perf_counter()
        fresh = syncer.swap()
        swap = time.perf_counter() - t
        assert fresh is not None and fresh[0] == v
        proof = engine.update(v, syncer.state, syncer.manifest)
        assert proof.chain_digest == syncer.digest
        t = time.perf_counter()
        engine.generate(prompt, one)
        first = time.perf_counter() - t
        plane = syncer.manifest
        assert plane is not None
        pause = swap + proof.apply_s + proof.prove_s
        rows.append((bg, swap, proof.apply_s, proof.prove_s, first, pause))
        route = syncer.last_route
        kb = (route.nbytes / 1e3) if route else 0.0
        print(
            f"{v:>3} {proof.changed:>8} {kb:9.0f} {bg:9.3f} {swap:7.4f} {proof.apply_s:8.3f} "
            f"{proof.prove_s:8.3f} {first:9.3f} {pause:8.3f}",
            flush=True,
        )

    t = time.perf_counter()
    reload = make_engine(args.engine, path, tok, dtype="float32")
    built = time.perf_counter() - t
    again = reload.update(args.versions, syncer.state, syncer.manifest)
    reload_s = built + again.apply_s + again.prove_s
    med = [statistics.median(col) for col in zip(*rows, strict=True)]
    print(
        f"median over {len(rows)} versions: background sync {med[0]:.3f}s (overlapped with generation); "
        f"pause {med[5]:.3f}s = swap {med[1]:.4f} + apply {med[2]:.3f} + proof {med[3]:.3f}; "
        f"first decode step after it {med[4]:.3f}s"
    )
    print(
        f"reload baseline (fresh engine + the same update): {reload_s:.2f}s = {reload_s / med[5]:.1f}x the "
        f"in-place pause; load={os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
