"""Benchmark on CUDA: engine tokens/s against transformers `generate`, and trainer tokens/s and MFU.

The model is a random-init Qwen2 with the shape of Qwen2.5-0.5B (hidden 896, 24 layers, 14 heads / 2 KV
heads, MLP 4864, vocab 151936, tied embeddings; 494M parameters), so nothing is downloaded.

- Generation: bf16 weights; `Engine.generate` (fast path) and `model.generate` sample at temperature 1
  with no truncation and produce exactly `--new-tokens` tokens per row (pnyx: `ignore_eos`; transformers:
  `min_new_tokens`) from the same random prompts of `--prompt-len` tokens, at each batch of `--batches`.
  Best of `--repeats` after one warm-up each, the two sides alternating; prefill included in both.
- Training: `pnyx.train.step.train_step` (the public step; on CUDA it runs the forward under bf16
  autocast over fp32 master weights) on synthetic on-policy groups of `--train-groups` x `--group-size`
  rows of `--prompt-len` + `--completion-len` tokens. Trainer tokens/s counts every token through the
  model (prompt + completion); MFU = 6 * parameters * tokens/s / peak, the usual dense-transformer
  estimate (it ignores attention FLOPs and counts the LM head on prompt positions, where `train_step`
  skips it, so it is an approximation in both directions).

Without CUDA it refuses with a message, except `--smoke`: the same code on the CPU with a tiny config
and small sizes, to check that it runs. Knows nothing about the store or RL beyond `train_step`.

    python benchmarks/bench_gpu.py                  # on a CUDA machine
    python benchmarks/bench_gpu.py --smoke          # anywhere: a tiny run of the same code on the CPU
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

# Dense (no sparsity) bf16 Tensor Core peak of one NVIDIA H200 SXM: the datasheet lists 1,979 TFLOPS
# "with sparsity", i.e. 989.5 TFLOPS dense (https://www.nvidia.com/en-us/data-center/h200/, 2024).
H200_BF16_DENSE_PEAK_FLOPS = 989e12

QWEN2_05B = dict(
    model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1_000_000.0,
    tie_word_embeddings=True, rms_norm_eps=1e-6,
)  # fmt: skip
SMOKE = dict(
    model_type="qwen2", vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
)  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn, *args):
    """(seconds, result) of `fn(*args)`, the device synchronised before and after."""
    sync(device)
    start = time.perf_counter()
    result = fn(*args)
    sync(device)
    return time.perf_counter() - start, result


def run_hf(model, ids: torch.Tensor, n: int) -> None:
    """transformers `generate`: exactly `n` sampled tokens per row (t=1, no truncation)."""
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=n, min_new_tokens=n, pad_token_id=0,
        )  # fmt: skip
    if out.shape[1] != ids.shape[1] + n:
        raise RuntimeError(f"transformers produced {out.shape[1] - ids.shape[1]} tokens, expected {n}")


def run_pnyx(engine, prompts: list[list[int]], n: int) -> None:
    """The pnyx engine: exactly `n` sampled tokens per row (t=1, no truncation, EOS ignored)."""
    from pnyx.rollout.sampling import SamplingParams

    out = engine.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True, seed=0))
    if any(len(c.tokens) != n for c in out):
        raise RuntimeError("pnyx produced a completion of the wrong length")


def bench_generate(cfg: dict, args, device: torch.device, dtype: str) -> None:
    from pnyx.models import model_from_config
    from pnyx.rollout.decoder import fast_path_supported
    from pnyx.rollout.engine import Engine
    from pnyx_harness.models import build_tiny_tokenizer

    model = model_from_config(cfg, dtype=dtype, device=str(device), seed=0)
    engine = Engine(model, build_tiny_tokenizer(512))
    params = sum(p.numel() for p in model.parameters())
    new = args.new_tokens
    print(
        f"\ngeneration: {params / 1e6:.2f}M parameters, {dtype}, prompt {args.prompt_len}, new {new}, "
        f"fast path {fast_path_supported(model)}"
    )
    print(f"{'batch':>5} {'hf tok/s':>10} {'pnyx tok/s':>11} {'ratio':>6}")
    for batch in args.batches:
        gen = torch.Generator().manual_seed(batch)
        ids = torch.randint(3, cfg["vocab_size"], (batch, args.prompt_len), generator=gen)
        prompts, ids = ids.tolist(), ids.to(device)

        timed(device, run_hf, model, ids, 8), timed(device, run_pnyx, engine, prompts, 8)  # warm-up
        hf_t, our_t = [], []
        for _ in range(args.repeats):
            hf_t.append(timed(device, run_hf, model, ids, new)[0])
            our_t.append(timed(device, run_pnyx, engine, prompts, new)[0])
        tokens = batch * new
        print(
            f"{batch:>5} {tokens / min(hf_t):>10.0f} {tokens / min(our_t):>11.0f} "
            f"{min(hf_t) / min(our_t):>5.2f}x",
            flush=True,
        )


def synthetic_groups(model, args, vocab: int) -> list:
    """On-policy groups (behaviour logprobs = the model's own) of random tokens, rewards alternating 1/0."""
    from pnyx.models import completion_logprobs
    from pnyx.protocol.records import RolloutGroup, Sample
    from pnyx.train.ingest import ScoredGroup

    gen = torch.Generator().manual_seed(0)
    groups = []
    for gi in range(args.train_groups):
        prompt = torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist()
        comps = torch.randint(3, vocab, (args.group_size, args.completion_len), generator=gen).tolist()
        with (
            torch.no_grad(),
            torch.autocast(model.device.type, torch.bfloat16, enabled=model.device.type == "cuda"),
        ):
            logp, _, _ = completion_logprobs(model, [prompt] * args.group_size, comps)
        rewards = [float(k % 2 == 0) for k in range(args.group_size)]
        samples = [
            Sample(tokens=c, logprobs=logp[k].float().tolist(), loss_mask=[1] * len(c), reward=rewards[k])
            for k, c in enumerate(comps)
        ]
        rec = RolloutGroup(
            run_id="bench", worker_id="w", seq=gi, policy_version=0, weights_digest="d", env="bench",
            task_id=f"t{gi}", prompt_tokens=prompt, samples=samples, temperature=1.0, top_p=1.0, top_k=0,
            created_at=0.0, gen_seconds=0.0, score_seconds=0.0,
        )  # fmt: skip
        adv = [r - 0.5 for r in rewards]
        groups.append(ScoredGroup(f"k{gi}", 0, "w", f"t{gi}", rec, rewards, adv, rewards))
    return groups


def bench_train(cfg: dict, args, device: torch.device, peak: float | None) -> None:
    from pnyx.models import model_from_config
    from pnyx.train.losses import LossSettings
    from pnyx.train.step import make_optimizer, train_step

    model = model_from_config(cfg, dtype="float32", device=str(device), seed=0)
    params = sum(p.numel() for p in model.parameters())
    optimizer = make_optimizer(model, lr=1e-6, betas=(0.9, 0.999), weight_decay=0.0)
    groups = synthetic_groups(model, args, cfg["vocab_size"])
    total = sum(len(g.group.prompt_tokens) + len(s.tokens) for g in groups for s in g.group.samples)

    def step():
        return train_step(
            model,
            optimizer,
            groups,
            LossSettings(),
            micro_batch_tokens=args.micro_batch_tokens,
            grad_clip=1.0,
        )

    timed(device, step)  # warm-up (allocator, kernels)
    best, stats = min((timed(device, step) for _ in range(args.repeats)), key=lambda r: r[0])
    tok_s = total / best
    mfu = f"{6 * params * tok_s / peak:.1%}" if peak else "n/a (no peak for this device)"
    print(
        f"\ntraining: {params / 1e6:.2f}M parameters, fp32 master weights, train_step, "
        f"{len(groups)}x{args.group_size} rows of {args.prompt_len}+{args.completion_len} tokens, "
        f"micro_batch_tokens {args.micro_batch_tokens}, {stats.micro_batches} micro-batches"
    )
    print(
        f"step {best:.3f} s  tokens/s {tok_s:.0f} (all)  completion tokens/s {stats.tokens / best:.0f}  "
        f"MFU {mfu}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="run the same code on the CPU with a tiny config")
    ap.add_argument("--batches", default="32,128")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--completion-len", type=int, default=384)
    ap.add_argument("--train-groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--micro-batch-tokens", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-train", action="store_true")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]

    if args.smoke:
        device, cfg, dtype, peak = torch.device("cpu"), SMOKE, "float32", None
        args.batches = [2, 4]
        args.prompt_len, args.new_tokens, args.completion_len = 8, 8, 16
        args.train_groups, args.group_size, args.micro_batch_tokens, args.repeats = 2, 4, 256, 1
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            sys.exit(
                "bench_gpu.py needs a CUDA device and none is available (torch.cuda.is_available() is False). "
                "Run it on a GPU machine, or pass --smoke to run the same code on the CPU with a tiny config."
            )
        device, cfg, dtype = torch.device("cuda"), QWEN2_05B, "bfloat16"
        name = torch.cuda.get_device_name(device)
        peak = H200_BF16_DENSE_PEAK_FLOPS if "H200" in name else None
    print(
        f"device={device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}) "
        f"torch={torch.__version__} smoke={args.smoke}"
    )
    bench_generate(cfg, args, device, dtype)
    if not args.skip_train:
        bench_train(cfg, args, device, peak)


if __name__ == "__main__":
    main()
