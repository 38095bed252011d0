"""Trainer benchmark: tokens/s and MFU of a training step, checkpoint blocking time, publish time.

On CUDA (the default mode; it refuses to run without a GPU) a Qwen2-shaped 0.5B model (hidden 896, 24
layers, 14 heads, 2 KV heads, intermediate 4864, vocab 151936, tied embeddings: Qwen2.5-0.5B's shape, random
weights) trains at 1 rank with fp32 master weights and bf16 autocast, through pnyx's own `train_step`, on
synthetic GRPO groups. It prints:

- trainer tokens/s (prompt + completion tokens through forward and backward) and MFU against the H200's
  dense bf16 peak (H200_BF16_FLOPS), with FLOPs counted as 6·N_layers·T + 12·L·d·s·T (attention, PaLM's
  convention) + 6·d·V per completion token (the head runs only where completions are);
- the checkpoint time: how long the loop is blocked by a synchronous DCP checkpoint (write + upload to a
  local-folder store) against an asynchronous one (staging only), and how long the asynchronous one takes
  to commit;
- the publish time of the bf16 cast (an anchor, then a delta after one step).

`--cpu-ratios` runs a small model on the CPU and prints only what this machine can measure honestly, as
ratios measured in the same process: asynchronous vs synchronous checkpoint blocking time, and a 2-rank
parallel publish (two gloo processes, each encoding and uploading its own windows) against one process.

    python benchmarks/bench_trainer.py                     # on a CUDA machine (the H200 plan in BENCHMARKS.md)
    nice -n 19 python benchmarks/bench_trainer.py --cpu-ratios

Knows nothing about the fleet: no worker, no ingestion; the groups are random tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

H200_BF16_FLOPS = 989e12
"""NVIDIA H200 SXM dense BF16 tensor-core peak (989.4 TFLOP/s without sparsity; NVIDIA H200 datasheet)."""

QWEN2_05B = {"hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2, "intermediate": 4864, "vocab": 151936}
SMALL = {"hidden": 512, "layers": 6, "heads": 8, "kv_heads": 2, "intermediate": 1536, "vocab": 16384}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu-ratios", action="store_true", help="small model on CPU, ratios only")
    p.add_argument("--groups", type=int, default=8, help="groups per step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per group")
    p.add_argument("--completion", type=int, default=384, help="completion tokens per sample")
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--steps", type=int, default=5, help="timed steps (after 2 warm-up steps)")
    p.add_argument("--repeats", type=int, default=3, help="checkpoint/publish measurements (median)")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument(
        "--publish-chunk-mb", type=float, default=None,
        help="payload object size, the unit split between ranks (default: 64 on GPU, 8 with --cpu-ratios)",
    )  # fmt: skip
    p.add_argument("--workdir", type=str, default=None, help="local folder for the store and shards")
    return p.parse_args()


def make_model(shape: dict[str, int], device: str) -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        hidden_size=shape["hidden"], num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], intermediate_size=shape["intermediate"],
        vocab_size=shape["vocab"], tie_word_embeddings=True, max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).to(device=device, dtype=torch.float32)


def make_groups(n: int, g: int, prompt: int, completion: int, vocab: int, seed: int = 0) -> list[Any]:
    """Synthetic scored groups: random tokens, half the samples right, behaviour logprobs of -3."""
    import random

    from pnyx.protocol.records import RolloutGroup, Sample
    from pnyx.train.ingest import ScoredGroup

    rng = random.Random(seed)
    out = []
    for i in range(n):
        samples = [
            Sample(
                tokens=[rng.randrange(vocab) for _ in range(completion)],
                logprobs=[-3.0] * completion,
                loss_mask=[1] * completion,
                reward=float(j % 2),
            )  # fmt: skip
            for j in range(g)
        ]
        rec = RolloutGroup(
            run_id="bench", worker_id="w", seq=i, policy_version=0, weights_digest="-", env="bench",
            task_id=f"t{i}", prompt_tokens=[rng.randrange(vocab) for _ in range(prompt)], samples=samples,
            temperature=1.0, top_p=1.0, top_k=0, created_at=0.0, gen_seconds=0.0, score_seconds=0.0,
        )  # fmt: skip
        rewards = [s.reward for s in samples]
        out.append(ScoredGroup(f"k{i}", 0, "w", f"t{i}", rec, rewards, [2 * r - 1 for r in rewards], rewards))
    return out


def step_flops(shape: dict[str, int], n_layer_params: int, groups: list[Any]) -> float:
    d, L, V = shape["hidden"], shape["layers"], shape["vocab"]
    total = 0.0
    for g in groups:
        for s in g.group.samples:
            seq = len(g.group.prompt_tokens) + len(s.tokens)
            total += 6 * n_layer_params * seq + 12 * L * d * seq * seq + 6 * d * V * len(s.tokens)
    return total


def time_steps(model: Any, groups: list[Any], args: argparse.Namespace, dtype: Any, warmup: int = 2) -> float:
    """Median seconds of one `train_step` over the timed steps (after `warmup` untimed ones)."""
    import torch

    from pnyx.train.losses import LossSettings
    from pnyx.train.step import make_optimizer, train_step

    opt = make_optimizer(model, 1e-6, (0.9, 0.99), 0.0)
    times = []
    for i in range(warmup + args.steps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        train_step(
            model, opt, groups, LossSettings(), micro_batch_tokens=args.micro_batch_tokens, grad_clip=1.0,
            compute_dtype=dtype,
        )  # fmt: skip
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    model._bench_opt = opt  # the checkpoints below hold a real AdamW state
    return statistics.median(times)


def checkpoint_times(model: Any, work: Path, repeats: int) -> dict[str, float]:
    """Loop-blocking seconds of a sync vs an async checkpoint (median of `repeats`), and async commit time."""
    from pnyx.store import open_store
    from pnyx.train.checkpointer import Checkpointer
    from pnyx.train.distributed import Dist

    store = open_store(str(work / "ckpt-store"))
    sync = Checkpointer(store, Dist.single(), work / "shards", keep=2, asynchronous=False)
    asyn = Checkpointer(store, Dist.single(), work / "shards", keep=2, asynchronous=True)
    opt = model._bench_opt
    out: dict[str, list[float]] = {"sync_block_s": [], "async_block_s": [], "async_commit_s": []}
    v = 0
    for _ in range(repeats):  # alternate, so both see the same machine load
        v += 1
        out["sync_block_s"].append(sync.save(v, model, opt, "{}", "bench"))
        v += 1
        t = time.perf_counter()
        out["async_block_s"].append(asyn.save(v, model, opt, "{}", "bench"))
        asyn.wait()
        out["async_commit_s"].append(time.perf_counter() - t)
    return {k: statistics.median(x) for k, x in out.items()}


def publish_times(model: Any, work: Path, chunk_bytes: int) -> dict[str, float]:
    """Seconds to publish the bf16 cast as an anchor, then (after a perturbation of ~2% of values) a delta."""
    import torch

    from pnyx.store import open_store
    from pnyx.weights import Publisher

    warm_codec()
    pub = Publisher(open_store(str(work / "pub-store")), anchor_every=1000, chunk_bytes=chunk_bytes)
    state = {k: v.detach().to("cpu", torch.bfloat16) for k, v in model.state_dict().items()}
    t = time.perf_counter()
    pub.publish(0, state, force_anchor=True)
    anchor = time.perf_counter() - t
    nxt = perturbed(state)
    t = time.perf_counter()
    pub.publish(1, nxt)
    return {
        "anchor_s": anchor,
        "delta_s": time.perf_counter() - t,
        "state_mb": pub.last_stats.full_bytes / 1e6,
    }


def warm_codec() -> None:
    """Run the PULSE kernels once on a small state, so that numba's first compile (about 1.1 s on a machine
    without its on-disk cache) is not timed as part of the first delta."""
    import numpy as np

    from pnyx.weights import kernels

    a = np.zeros(kernels.MIN_ELEMS, np.uint16)
    b = a.copy()
    b[::50] += 1
    gaps, codes = kernels.diff_codes(a, b)
    kernels.patch_codes(np.empty_like(a), a, gaps, codes)
    kernels.add_codes(a.copy(), gaps, codes)


def perturbed(state: dict[str, Any], frac: float = 0.02, seed: int = 1) -> dict[str, Any]:
    """The state with ~`frac` of the values moved by one bf16 ulp (a typical RL step's delta)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in state.items():
        bits = t.view(torch.int16).clone()
        hit = torch.rand(bits.shape, generator=g) < frac
        bits[hit] += 1
        out[k] = bits.view(torch.bfloat16)
    return out


def _publish_rank(rank: int, shape: dict[str, int], work: str, port: int, out: str, chunk_bytes: int) -> None:
    """One rank of the parallel publish: its share of the same two states, timed around the publish."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import json

    import torch

    from pnyx.store import open_store
    from pnyx.train.distributed import init_distributed
    from pnyx.weights import Publisher
    from pnyx.weights.bits import from_torch
    from pnyx.weights.parallel import layout_of

    torch.set_num_threads(1)
    d = init_distributed("cpu")
    model = make_model(shape, "cpu")
    state = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    nxt = perturbed(state)
    full_layout = layout_of(from_torch(state))
    pub = Publisher(
        open_store(os.path.join(work, "par-store")), anchor_every=1000, chunk_bytes=chunk_bytes, comm=d
    )
    need = pub.needs(full_layout)
    pub.publish(0, {k: v for k, v in state.items() if k in need}, True, full_layout)
    d.barrier()
    t = time.perf_counter()
    pub.publish(1, {k: v for k, v in nxt.items() if k in need}, False, full_layout)
    d.barrier()
    took = time.perf_counter() - t
    if rank == 0:
        Path(out).write_text(json.dumps({"delta_s": took, "held": len(need), "tensors": len(full_layout)}))
    d.close()


def parallel_publish(shape: dict[str, int], work: Path, chunk_bytes: int) -> dict[str, float]:
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = work / "parallel.json"
    args = (shape, str(work), port, str(out), chunk_bytes)
    mp.start_processes(_publish_rank, args=args, nprocs=2, start_method="spawn")
    return json.loads(out.read_text())


def cpu_ratios(args: argparse.Namespace, work: Path) -> None:
    import torch

    torch.set_num_threads(2)
    model = make_model(SMALL, "cpu")
    n = sum(p.numel() for p in model.parameters())
    groups = make_groups(2, 4, 32, 64, SMALL["vocab"])
    args.steps = 1
    step_s = time_steps(model, groups, args, torch.float32, warmup=0)  # for a real AdamW state, not a speed
    print(
        f"model: Qwen2-shaped {n / 1e6:.1f}M params {SMALL}; fp32 on CPU, {torch.get_num_threads()} threads"
    )
    print(f"one train_step (2 groups x 4 x 96 tokens): {step_s:.2f}s (absolute times here mean little)")
    ck = checkpoint_times(model, work, args.repeats)
    print(
        f"checkpoint (fp32 weights + AdamW, {args.repeats} alternating repeats, medians): loop blocked "
        f"sync {ck['sync_block_s']:.2f}s, async {ck['async_block_s']:.2f}s -> async/sync = "
        f"{ck['async_block_s'] / ck['sync_block_s']:.3f}; async until committed {ck['async_commit_s']:.2f}s"
    )
    chunk = int((args.publish_chunk_mb or 8) * 2**20)
    single = [publish_times(model, work / f"single-{i}", chunk)["delta_s"] for i in range(args.repeats)]
    par = [parallel_publish(SMALL, work / f"par-{i}", chunk) for i in range(args.repeats)]
    ps = statistics.median(p["delta_s"] for p in par)
    print(
        f"publish one delta (~2% of values changed, bf16 {n * 2 / 1e6:.0f} MB): 1 process "
        f"{statistics.median(single):.2f}s, 2 ranks {ps:.2f}s -> 2 ranks / 1 process = "
        f"{ps / statistics.median(single):.3f}; payload objects of {chunk / 2**20:.0f} MiB; rank 0 held "
        f"{par[0]['held']} of {par[0]['tensors']} tensors"
    )


def gpu(args: argparse.Namespace, work: Path) -> None:
    import torch

    from pnyx.train.distributed import decoder_layers

    model = make_model(QWEN2_05B, "cuda")
    if args.activation_checkpointing:
        from pnyx.train.distributed import Dist, prepare_model

        prepare_model(model, Dist.single("cuda"), torch.bfloat16, activation_checkpointing=True)
    n = sum(p.numel() for p in model.parameters())
    n_layer = sum(p.numel() for layer in decoder_layers(model) for p in layer.parameters())
    groups = make_groups(args.groups, args.group_size, args.prompt, args.completion, QWEN2_05B["vocab"])
    step_s = time_steps(model, groups, args, torch.bfloat16)
    tokens = sum(len(g.group.prompt_tokens) + len(s.tokens) for g in groups for s in g.group.samples)
    flops = step_flops(QWEN2_05B, n_layer, groups)
    print(f"device: {torch.cuda.get_device_name()}; model: Qwen2-shaped {n / 1e6:.1f}M params {QWEN2_05B}")
    print(
        f"train_step: {len(groups)} groups x {args.group_size} x ({args.prompt}+{args.completion}) tokens, "
        f"micro-batch {args.micro_batch_tokens} tokens, fp32 master + bf16 autocast: {step_s:.3f}s/step, "
        f"{tokens / step_s:.0f} tokens/s, {flops / step_s / 1e12:.1f} TFLOP/s, "
        f"MFU {flops / step_s / H200_BF16_FLOPS:.1%} of {H200_BF16_FLOPS / 1e12:.0f} TFLOP/s; "
        f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
    )
    ck = checkpoint_times(model, work, args.repeats)
    print(
        f"checkpoint ({n * 12 / 1e9:.1f} GB fp32 weights + AdamW to local disk, then the store): loop blocked "
        f"sync {ck['sync_block_s']:.2f}s, async {ck['async_block_s']:.2f}s ({ck['async_block_s'] / ck['sync_block_s']:.3f}x); "
        f"async committed after {ck['async_commit_s']:.2f}s"
    )
    pub = publish_times(model, work, int((args.publish_chunk_mb or 64) * 2**20))
    print(
        f"publish bf16 ({pub['state_mb']:.0f} MB): anchor {pub['anchor_s']:.2f}s, delta {pub['delta_s']:.2f}s"
    )


def main() -> None:
    args = parse()
    import torch

    if not args.cpu_ratios and not torch.cuda.is_available():
        raise SystemExit(
            "bench_trainer: no CUDA device. Tokens/s and MFU are GPU figures; run this on a GPU machine, or "
            "use --cpu-ratios for the ratios this CPU can measure."
        )
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        (cpu_ratios if args.cpu_ratios else gpu)(args, Path(tmp))


if __name__ == "__main__":
    main()
