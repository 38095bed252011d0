"""Benchmark: pnyx engine tokens/s against transformers `generate`, same model, batch, prompt and length.

Both sides sample at temperature 1 with no truncation and produce exactly `--new-tokens` tokens per row
(pnyx: `ignore_eos`; transformers: `min_new_tokens`), from random-init Qwen2 models so nothing is
downloaded. Each cell is the best of `--repeats` timed runs after one warm-up of each side, the two sides
alternating so a burst of load on a shared machine hits both; the ratio is pnyx / transformers measured
in the same process. `--clock cpu` times with the process CPU clock instead of wall time: on a machine
shared with other jobs it excludes time spent waiting for a core (meaningful with `--threads 1` only).
`--episodes` measures the multi-turn tool loop instead: `run_episodes` continuing on the KV cache after
each tool reply against re-prefilling the whole context every turn, on the shipped tiny model
(`pnyx/assets/tiny-base`), same prompts, seed and tool, in the same process. The tool call is a printable
character seen about once per quarter turn in a free sample (so rows call the tool at different steps), the reply a
fixed text of about `--reply-tokens` tokens; both loops must give identical episodes (checked).
Knows nothing about RL or the store.

    python benchmarks/bench_engine.py --threads 2 --models tiny,25m --batches 8,32,64
    python benchmarks/bench_engine.py --episodes --threads 1 --clock cpu --batches 32 --prompt-len 32,256
    python benchmarks/bench_engine.py --logprob-gaps   # max |recorded - recomputed| per architecture

`--logprob-gaps` is not a speed figure: for each tiny architecture of `pnyx_harness.models.TINY_ARCHS` (and
Qwen3 on the fast path) it prints the largest gap between the engine's recorded logprobs and the trainer's
`completion_logprobs` over 16 ragged prompts x 32 tokens, sampled (t=1; t=0.7, top-k 40, top-p 0.9) and
in tool episodes on the KV cache (or re-prefilled where the model's cache cannot hold holes).
"""

from __future__ import annotations

import argparse
import time

import torch

from pnyx.models import model_from_config
from pnyx.rollout.engine import Engine
from pnyx.rollout.episodes import run_episodes
from pnyx.rollout.sampling import SamplingParams
from pnyx_harness.models import build_tiny_tokenizer

CONFIGS: dict[str, dict] = {
    # The shape of `make_tiny_model_dir` (~0.16M parameters).
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    # ~25M parameters: 7 layers of width 512, GQA 8/4, vocab 8192, tied embeddings.
    "25m": dict(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=7,
        num_attention_heads=8,
        num_key_value_heads=4,
    ),
}


def build(name: str, device: str):
    cfg = {
        "model_type": "qwen2",
        "tie_word_embeddings": True,
        "max_position_embeddings": 4096,
        **CONFIGS[name],
    }
    return model_from_config(cfg, device=device, seed=0)


CLOCK = time.perf_counter


def time_hf(model, ids: torch.Tensor, new: int) -> float:
    attn = torch.ones_like(ids)
    start = CLOCK()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=attn,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=0,
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


def bench_episodes(args) -> None:
    """Tool turns on the KV cache against re-prefilling, on the shipped tiny model."""
    from collections import Counter

    from pnyx.models import load_model, load_tokenizer

    model, tokenizer = load_model("pnyx/assets/tiny-base"), load_tokenizer("pnyx/assets/tiny-base")
    engine = Engine(model, tokenizer)
    engine.eos_ids = []  # episodes end by turn limit or length, so both loops do the same amount of work
    print(
        f"device=cpu threads={args.threads} new_tokens/turn={args.new_tokens} turns<={args.turns} "
        f"reply~{args.reply_tokens} tok repeats={args.repeats} clock={args.clock} model=tiny-base"
    )
    print(
        f"{'batch':>5} {'prompt':>6} {'stop':>5} {'turns':>5} {'tokens':>7} {'re-prefill tok/s':>16} "
        f"{'reuse tok/s':>11} {'ratio':>6} same"
    )
    vocab = model.config.vocab_size
    for batch in (int(b) for b in args.batches.split(",")):
        for plen in (int(x) for x in str(args.prompt_len).split(",")):
            gen = torch.Generator().manual_seed(batch + plen)
            prompts = torch.randint(3, vocab, (batch, plen), generator=gen).tolist()
            params = SamplingParams(max_new_tokens=args.new_tokens, seed=0)
            free = engine.generate(prompts, params)
            counts = Counter(
                ch for c in free for ch in c.text if ch.isascii() and ch.isprintable() and ch.strip()
            )
            # The character seen about once per quarter turn: calls at varied steps, turns rarely cut.
            target = sum(len(c.tokens) for c in free) * 4 / args.new_tokens
            stop = min(counts, key=lambda ch: abs(counts[ch] - target))
            reply = " " + " ".join(["information"] * args.reply_tokens)
            reply_ids = tokenizer.encode(reply, add_special_tokens=False)
            reply = tokenizer.decode(reply_ids[: args.reply_tokens])
            cap = plen + args.turns * (args.new_tokens + args.reply_tokens + 1)

            def run(reuse: bool, prompts=prompts, params=params, stop=stop, reply=reply, cap=cap):
                start = CLOCK()
                eps = run_episodes(
                    engine,
                    prompts, params, lambda text: reply, [stop], args.turns, max_episode_tokens=cap,
                    reuse_cache=reuse,
                )  # fmt: skip
                return CLOCK() - start, eps

            run(True), run(False)  # warm-up
            old_t, new_t = [], []
            for _ in range(args.repeats):
                t, old = run(False)
                old_t.append(t)
                t, new = run(True)
                new_t.append(t)
            same = [e.tokens for e in old] == [e.tokens for e in new]
            tokens = sum(sum(e.loss_mask) for e in new)
            turns = sum(e.turns for e in new) / batch
            print(
                f"{batch:>5} {plen:>6} {stop!r:>5} {turns:>5.2f} {tokens:>7} {tokens / min(old_t):>16.0f} "
                f"{tokens / min(new_t):>11.0f} {min(old_t) / min(new_t):>5.2f}x {'yes' if same else 'NO'}",
                flush=True,
            )


def bench_gaps() -> None:
    """Largest |recorded - recomputed| logprob per tiny architecture, plain sampling and tool episodes."""
    from pnyx.models import completion_logprobs
    from pnyx_harness.models import TINY_ARCHS, tiny_arch_model

    tokenizer = build_tiny_tokenizer(512)
    texts = ["What is 12 + 7?", "hi", "<search>capital of France</search> The answer is", "Use 2, 3, 7, 9"]
    prompts = [tokenizer.encode(t * (1 + k % 3), add_special_tokens=False) for k in range(4) for t in texts]
    settings = [SamplingParams(max_new_tokens=32, seed=1), SamplingParams(0.7, 0.9, 40, 32, seed=2)]
    tools = [lambda text, i=i: " <information>Paris</information>"[: 4 + 2 * i] for i in range(len(prompts))]

    def gap(model, rows, params) -> float:
        with torch.no_grad():
            logp, _, _ = completion_logprobs(
                model, prompts, [r.tokens for r in rows], params.temperature, params.top_k, params.top_p
            )
        out = 0.0
        for i, r in enumerate(rows):
            m = torch.tensor(getattr(r, "loss_mask", [1] * len(r.tokens)), dtype=torch.bool)
            out = max(out, float((logp[i, : len(r.tokens)] - torch.tensor(r.logprobs))[m].abs().max()))
        return out

    print(f"{'arch':>12} {'path':>6} {'t=1':>8} {'top-k/p':>8} {'episodes':>8} kv-reuse")
    for arch in [*sorted(TINY_ARCHS), "qwen3-fast"]:
        model = tiny_arch_model(arch.removesuffix("-fast"), tokenizer)
        engine = Engine(model, tokenizer, fast=arch.endswith("-fast"))
        engine.eos_ids = []
        gaps = [gap(model, engine.generate(prompts, p), p) for p in settings]
        eps = run_episodes(
            engine, prompts, settings[0], tools, ["a", "e"], max_turns=4, max_episode_tokens=160
        )
        reuse = engine.session(1).holes_ok
        print(
            f"{arch:>12} {'fast' if engine.fast else 'hf':>6} {gaps[0]:>8.1e} {gaps[1]:>8.1e} "
            f"{gap(model, eps, settings[0]):>8.1e} {'yes' if reuse else 'no (re-prefill)'}",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,25m", help="comma list of: " + ",".join(CONFIGS))
    ap.add_argument("--batches", default="8,32,64")
    ap.add_argument("--prompt-len", default="32", help="with --episodes: a comma list")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    ap.add_argument("--episodes", action="store_true", help="tool turns: KV-cache reuse vs re-prefill")
    ap.add_argument("--turns", type=int, default=4, help="with --episodes: max model turns per episode")
    ap.add_argument("--reply-tokens", type=int, default=32, help="with --episodes: tokens per tool reply")
    ap.add_argument("--logprob-gaps", action="store_true", help="recorded vs recomputed logprobs per arch")
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    if args.episodes:
        bench_episodes(args)
        return
    if args.logprob_gaps:
        bench_gaps()
        return
    args.prompt_len = int(args.prompt_len)
    tokenizer = build_tiny_tokenizer(512)

    print(
        f"device={args.device} threads={args.threads} prompt_len={args.prompt_len} "
        f"new_tokens={args.new_tokens} repeats={args.repeats} clock={args.clock} torch={torch.__version__}"
    )
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
            print(
                f"{name:>6} {params / 1e6:>7.2f}M {batch:>5} {tokens / hf:>10.0f} {tokens / ours:>11.0f} "
                f"{hf / ours:>5.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
