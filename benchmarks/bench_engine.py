"""Benchmark: pnyx engine tokens/s against transformers `generate`, same model, batch, prompt and length.

Both sides sample at temperature 1 with no truncation and produce exactly `--new-tokens` tokens per row
(pnyx: `ignore_eos`; transformers: `min_new_tokens`), from random-init Qwen2 models so nothing is
downloaded. Each cell is the best of `--repeats` timed runs after one warm-up of each side, the two sides
alternating so a burst of load on a shared machine hits both; the ratio is pnyx / transformers measured
in the same process. `--clock cpu` times with the process CPU clock instead of wall time: on a machine
shared with other jobs it excludes time spent waiting for a core (meaningful with `--threads 1` only).
Knows nothing about RL or the store.

    python benchmarks/bench_engine.py --threads 2 --models tiny,25m --batches 8,32,64
"""

from __future__ import annotations

import argparse
import time

import torch

from pnyx.models import model_from_config
from pnyx.models.testing import build_tiny_tokenizer
from pnyx.rollout.engine import Engine, SamplingParams

CONFIGS: dict[str, dict] = {
    # The shape of `make_tiny_model_dir` (~0.16M parameters).
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    # ~25M parameters: 7 layers of width 512, GQA 8/4, vocab 8192, tied embeddings.
    "25m": dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=7,
                num_attention_heads=8, num_key_value_heads=4),
}


def build(name: str, device: str):
    cfg = {"model_type": "qwen2", "tie_word_embeddings": True, "max_position_embeddings": 4096,
           **CONFIGS[name]}
    return model_from_config(cfg, device=device, seed=0)


CLOCK = time.perf_counter


def time_hf(model, ids: torch.Tensor, new: int) -> float:
    attn = torch.ones_like(ids)
    start = CLOCK()
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=attn, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
        )
    if ids.is_cuda:
        torch.cuda.synchronize()
    elapsed = CLOCK() - start
    if out.shape[1] != ids.shape[1] + new:
        raise RuntimeError(f"transformers produced {out.shape[1] - ids.shape[1]} tokens, expected {new}")
    return elapsed


def time_pnyx(engine: Engine, prompts: list[list[int]], new: int) -> float:
    start = CLOCK()
    out = engine.generate(prompts, SamplingParams(max_new_tokens=new, ignore_eos=True, seed=0))
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = CLOCK() - start
    if any(len(c.tokens) != new for c in out):
        raise RuntimeError("pnyx produced a completion of the wrong length")
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,25m", help="comma list of: " + ",".join(CONFIGS))
    ap.add_argument("--batches", default="8,32,64")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    tokenizer = build_tiny_tokenizer(512)

    print(f"device={args.device} threads={args.threads} prompt_len={args.prompt_len} "
          f"new_tokens={args.new_tokens} repeats={args.repeats} clock={args.clock} torch={torch.__version__}")
    print(f"{'model':>6} {'params':>8} {'batch':>5} {'hf tok/s':>10} {'pnyx tok/s':>11} {'ratio':>6}")
    for name in args.models.split(","):
        model = build(name, args.device)
        params = sum(p.numel() for p in model.parameters())
        engine = Engine(model, tokenizer)
        vocab = model.config.vocab_size
        for batch in (int(b) for b in args.batches.split(",")):
            gen = torch.Generator().manual_seed(batch)
            ids = torch.randint(3, min(vocab, 512), (batch, args.prompt_len), generator=gen)
            prompts = ids.tolist()
            ids = ids.to(args.device)
            time_hf(model, ids, 4)  # warm-up
            time_pnyx(engine, prompts, 4)
            hf_times, our_times = [], []
            for _ in range(args.repeats):
                hf_times.append(time_hf(model, ids, args.new_tokens))
                our_times.append(time_pnyx(engine, prompts, args.new_tokens))
            hf, ours = min(hf_times), min(our_times)
            tokens = batch * args.new_tokens
            print(f"{name:>6} {params / 1e6:>7.2f}M {batch:>5} {tokens / hf:>10.0f} {tokens / ours:>11.0f} "
                  f"{hf / ours:>5.2f}x", flush=True)


if __name__ == "__main__":
    main()
