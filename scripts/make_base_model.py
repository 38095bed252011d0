"""Build pnyx's shipped tiny base model from scratch: tokenizer, noisy pretraining, evaluation, model card.

    python scripts/make_base_model.py --seed 0 --out pnyx/assets/tiny-base

What it does, in order:
1. Draws procedural training tasks from the built-in environments (`arith`, the default task, and
   `searchqa`), through their public API only (`sample`, `reference_completion`, `respond`, `score`).
   Phases 1-3 render prompts without a system message (`system_prompt=""`: the format the model was
   first built with); the adaptation phase renders them as the environments do today, with their
   system prompts.
2. Trains a byte-level BPE tokenizer (digits one per token; chat roles, EOS and the environments' tags
   as single tokens) and a small Qwen2 causal LM from a seeded initialization.
3. Pretrains in two phases, deliberately stopping at partial skill. Phase 1 uses clean labels (the
   first `--arith-first` steps on `arith` alone) and teaches the skill. Phase 2 uses *noisy* labels: for
   `arith` the reference answer is shown with probability `--p-correct` and otherwise a plausible wrong
   answer (off by a small amount, a swapped digit, a sign error) or a format error. The aim is a model
   whose correct answer is still the most likely one but carries only part of the mass, so pass@1 at
   temperature 1 starts near 0.2-0.4 while pass@8 is high: what GRPO can sharpen quickly.
   For `searchqa`, a fraction `--p-search` of transcripts searches for the entity and answers from the
   returned information; the rest answer directly with a guess of the right type.
   Phase 3 (on by default; `--no-phase3` skips it) continues from the phase-2 weights on clean `searchqa`
   copying episodes (search with the exact entity name, answer with the exact attribute of the reply)
   from worlds other than the default one, mixed with a replay of noisy `arith` batches.
   `--phase2-from DIR` skips phases 1-2 and loads a saved model to run (the rest of) phase 3 only.
   The adaptation phase (`--adapt-steps`, 0 skips it) continues on transcripts whose prompts carry the
   environments' system prompts, with the same noisy-label recipe (noisy `arith`, phase-3 `searchqa`
   episodes), so the model follows today's prompts and still starts weak. `--adapt-from DIR` skips
   phases 1-3 and adapts a saved model (how the shipped weights were updated when the prompts changed).
4. Evaluates on held-out tasks with `pnyx.eval.runner.evaluate_model` (the torch engine, sampling at
   temperature 1, top-k 0, top-p 1, each environment's generation budget) and writes the model,
   tokenizer, `evaluation.json` and a `README.md` model card.

Knows nothing about the store or the trainer. Reproducible from `--seed` on CPU (deterministic
algorithms, one fixed thread count).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a plain script from a checkout
    sys.path.insert(0, str(REPO))

from base_model_args import parse_args  # noqa: E402
from base_model_card import write_card  # noqa: E402
from base_model_data import (  # noqa: E402
    Example,
    answer_type,
    arith_example,
    decision_weight,
    guess_vocabulary,
    searchqa_copy_example,
    searchqa_example,
)

from pnyx.envs import Environment, Task, get_env  # noqa: E402
from pnyx.eval.runner import EvalReport, evaluate_model  # noqa: E402
from pnyx.models import tiny  # noqa: E402

LEGACY_SYSTEM_PROMPT = ""
"""Phases 1-3 render prompts without a system message: the format the shipped model was first built with."""

# --- training data --------------------------------------------------------------------------------


def build_tokenizer(texts: list[str], vocab_size: int) -> Any:
    """A byte-level BPE tokenizer trained on `texts`; digits are one per token; roles/tags are single tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(tiny.TAG_TOKENS),
        special_tokens=tiny.SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in tiny.TAG_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=tiny.EOS_TOKEN,
        pad_token=tiny.PAD_TOKEN,
        chat_template=tiny.CHAT_TEMPLATE,
        model_max_length=512,
    )


def encode_example(tokenizer: Any, ex: Example) -> tuple[list[int], list[int]]:
    """(ids, loss mask): prompt through the chat template (not trained), segments, then EOS (trained).

    Segments are encoded one by one, the way the engine assembles an episode (tool text is tokenized on
    its own, never merged with the model's tokens).
    """
    prompt = tokenizer.apply_chat_template(ex.prompt, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    mask = [0] * len(ids)
    for text, trained in ex.segments:
        seg = tokenizer.encode(text, add_special_tokens=False)
        ids += seg
        mask += [int(trained)] * len(seg)
    ids.append(tokenizer.eos_token_id)
    mask.append(1)
    return ids, mask


# --- model and training ------------------------------------------------------------------------------


def build_model(vocab_size: int, hidden: int, layers: int, heads: int, seed: int) -> Any:
    """A Qwen2 causal LM with tied embeddings and a seeded initialization (fp32)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def collate(batch: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[Any, Any, Any]:
    """Right-padded (input ids, attention mask, labels with -100 where not trained)."""
    import torch

    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad_id)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    labels = torch.full((len(batch), width), -100)
    for i, (seq, mask) in enumerate(batch):
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        labels[i, : len(seq)] = torch.tensor([t if m else -100 for t, m in zip(seq, mask, strict=True)])
    return ids, attn, labels


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


@dataclass
class Noise:
    """The label-noise levels of the stream; `train` switches them from clean to noisy between phases."""

    p_correct: float
    p_format_error: float
    p_search: float


def make_streams(
    envs: dict[str, Environment], args: argparse.Namespace, noise: Noise, rng: random.Random
) -> dict[str, Any]:
    """Per environment, an endless iterator of examples drawn from a pool of training tasks at `noise`."""
    return {name: _stream(name, env, args, noise, rng) for name, env in envs.items()}


def _stream(name: str, env: Environment, args: argparse.Namespace, noise: Noise, rng: random.Random) -> Any:
    pool = env.sample("train", args.seed, args.pool)
    guesses = guess_vocabulary(pool) if name == "searchqa" else {}
    while True:
        task = rng.choice(pool)
        if name == "arith":
            yield arith_example(env, task, noise.p_correct, noise.p_format_error, rng)
        elif name == "searchqa":
            yield searchqa_example(env, task, noise.p_search, guesses[answer_type(task)], rng)
        else:
            raise ValueError(f"no noisy recipe for environment {name!r}")


def make_envs(names: list[str], system_prompt: str | None) -> dict[str, Environment]:
    """The environments by name, rendering prompts with `system_prompt` (None: each env's own)."""
    return {name: get_env(name, system_prompt=system_prompt) for name in names}


def quick_eval(
    model: Any, tokenizer: Any, env: Environment, tasks: list[Task], n: int, seed: int, examples: int = 0
) -> EvalReport:
    """pass@1 and pass@n over `n` samples per task at temperature 1, with the env's generation budget."""
    from pnyx.rollout.engines import make_engine

    model.eval()
    try:
        engine = make_engine("torch", None, tokenizer, model=model)
        return evaluate_model(engine, env, tasks, samples=n, ks=(n,), seed=seed, examples=examples)
    finally:
        model.train()


def train(model: Any, tokenizer: Any, envs: dict[str, Environment], args: argparse.Namespace) -> list[dict]:
    """Pretrain on the noisy stream; print one line per log interval; return the eval curve."""
    import torch

    rng = random.Random(args.seed)
    # Phase 1 (clean labels) teaches the skill fast; phase 2 (noisy labels) spreads the mass.
    noise = Noise(1.0, 0.0, args.p_search)
    streams = make_streams(envs, args, noise, rng)
    names = list(envs)
    weights = [args.mix[n] for n in names]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    probe = envs["arith"].sample("test", args.seed + 1, args.probe_tasks)
    sq_probe = envs["searchqa"].sample("test", args.seed + 1, 64) if "searchqa" in envs else []
    curve: list[dict] = []
    model.train()
    t0 = time.time()
    total = args.clean_steps + args.steps
    for step in range(total):
        if step == args.clean_steps:
            noise.p_correct, noise.p_format_error = args.p_correct, args.p_format_error
        # One environment per batch: sequences of a batch have similar lengths, so padding stays small.
        # The default task first: arithmetic is learned fastest without the other tasks' gradients.
        name = "arith" if step < args.arith_first else rng.choices(names, weights)[0]
        size = args.batch if name == "arith" else args.batch // 2
        batch = [encode_example(tokenizer, next(streams[name])) for _ in range(size)]
        ids, attn, labels = collate(batch, tokenizer.pad_token_id)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, args.lr, args.warmup)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % args.eval_every == 0 or step + 1 in (args.clean_steps, total):
            res = quick_eval(model, tokenizer, envs["arith"], probe, 4, args.seed)
            point = {
                "step": step + 1,
                "loss": round(loss.item(), 4),
                "arith_pass@1": round(res.pass_at_1, 4),
                "arith_pass@4": round(res.pass_at_k[4], 4),
            }
            if "searchqa" in envs and step >= args.arith_first:
                sq = quick_eval(model, tokenizer, envs["searchqa"], sq_probe, 2, args.seed)
                point |= {
                    "searchqa_pass@1": round(sq.pass_at_1, 4),
                    "search_rate": round(sq.search_rate, 4),
                    "correct_when_searched": sq.correct_when_searched,
                }
            point["seconds"] = round(time.time() - t0, 1)
            curve.append(point)
            print(" ".join(f"{k}={v}" for k, v in point.items()), flush=True)
    return curve


# --- phase 3 and the adaptation phase: searchqa copying mixed with noisy arith -----------------------------


def _copy_stream(args: argparse.Namespace, rng: random.Random, system_prompt: str | None) -> Any:
    """Endless phase-3 `searchqa` examples from worlds other than the default one (`--p3-worlds`), so
    the model learns to search and copy rather than memorize the default world's people."""
    worlds = [
        get_env("searchqa", world_seed=1000 + 100 * args.seed + i, system_prompt=system_prompt)
        for i in range(args.p3_worlds)
    ]
    pools = [(w, w.sample("train", args.seed, args.pool // args.p3_worlds)) for w in worlds]
    guesses = guess_vocabulary([t for _, pool in pools for t in pool])
    p_decide = decision_weight(args.p3_copy, args.p3_search_rate)
    while True:
        env, pool = rng.choice(pools)
        task = rng.choice(pool)
        yield searchqa_copy_example(env, task, args.p3_copy, p_decide, guesses[answer_type(task)], rng)


@dataclass
class Cycle:
    """One cosine cycle of mixed training: noisy `arith` batches (share `arith`) and phase-3 `searchqa`."""

    phase: int | str
    steps: int
    lr: float
    warmup: int
    arith: float
    seed: int
    step_offset: int
    system_prompt: str | None


def train_phase3(
    model: Any, tokenizer: Any, envs: dict[str, Environment], args: argparse.Namespace
) -> list[dict]:
    """Phase 3: continue from the phase-2 weights on clean searchqa copying episodes, mixed with a replay of
    phase-2-style noisy `arith` batches (so arith stays calibrated). One cosine cycle per `--p3-steps`
    entry (warm restarts: a fresh AdamW and warmup each); `--p3-done-cycles` skips cycles already run."""
    curve: list[dict] = []
    for cycle in range(args.p3_done_cycles, len(args.p3_steps)):
        offset = args.clean_steps + args.steps + sum(args.p3_steps[:cycle])
        spec = Cycle(3, args.p3_steps[cycle], args.p3_lr, args.p3_warmup, args.p3_arith,
                     args.seed + 3 + 1000 * cycle, offset, LEGACY_SYSTEM_PROMPT)  # fmt: skip
        curve += mixed_cycle(model, tokenizer, envs, args, spec)
    return curve


def adapt(
    model: Any, tokenizer: Any, envs: dict[str, Environment], args: argparse.Namespace, offset: int
) -> list[dict]:
    """The adaptation phase: one cycle like phase 3's, on prompts with the environments' system prompts."""
    spec = Cycle("adapt", args.adapt_steps, args.adapt_lr, args.p3_warmup, args.adapt_arith,
                 args.seed + 7, offset, None)  # fmt: skip
    return mixed_cycle(model, tokenizer, envs, args, spec)


def mixed_cycle(
    model: Any, tokenizer: Any, envs: dict[str, Environment], args: argparse.Namespace, spec: Cycle
) -> list[dict]:
    """Train one cosine cycle (fresh AdamW, warmup, cosine to 10%) and return its probe curve. `envs` render
    prompts the way this cycle trains on them."""
    import torch

    rng = random.Random(spec.seed)
    arith = _stream("arith", envs["arith"], args, Noise(args.p_correct, args.p_format_error, 0.0), rng)
    copy = _copy_stream(args, rng, spec.system_prompt)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.98), weight_decay=0.01)
    probe = envs["arith"].sample("test", args.seed + 1, args.probe_tasks)
    sq_probe = envs["searchqa"].sample("test", args.seed + 1, 64)
    curve: list[dict] = []
    model.train()
    t0 = time.time()
    for step in range(spec.steps):
        name = "arith" if rng.random() < spec.arith else "searchqa"
        source, size = (arith, args.batch) if name == "arith" else (copy, args.batch // 2)
        batch = [encode_example(tokenizer, next(source)) for _ in range(size)]
        ids, attn, labels = collate(batch, tokenizer.pad_token_id)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, spec.steps, spec.lr, spec.warmup)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % args.p3_eval_every == 0 or step + 1 == spec.steps:
            res = quick_eval(model, tokenizer, envs["arith"], probe, 4, args.seed)
            sq = quick_eval(model, tokenizer, envs["searchqa"], sq_probe, 2, args.seed)
            point = {
                "step": spec.step_offset + step + 1,
                "phase": spec.phase,
                "loss": round(loss.item(), 4),
                "arith_pass@1": round(res.pass_at_1, 4),
                "arith_pass@4": round(res.pass_at_k[4], 4),
                "searchqa_pass@1": round(sq.pass_at_1, 4),
                "search_rate": _round4(sq.search_rate),
                "correct_when_searched": _round4(sq.correct_when_searched),
                "seconds": round(time.time() - t0, 1),
            }
            curve.append(point)
            print(" ".join(f"{k}={v}" for k, v in point.items()), flush=True)
    return curve


def _round4(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


# --- evaluation, saving, the model card ----------------------------------------------------------------


def figures(report: EvalReport) -> dict[str, Any]:
    """The model card's figures of one evaluation (what `evaluation.json` records per environment)."""
    out = {
        "env": report.env,
        "tasks": report.tasks,
        "samples_per_task": report.samples,
        "pass@1": round(report.pass_at_1, 4),
        "pass@1_ci95": [round(report.ci_low, 4), round(report.ci_high, 4)],
        **{f"pass@{k}": round(v, 4) for k, v in sorted(report.pass_at_k.items())},
        "format_rate": round(report.format_rate, 4),
        "search_rate": _round4(report.search_rate),
        "correct_when_searched": _round4(report.correct_when_searched),
        "correct_without_search": _round4(report.correct_without_search),
        "mean_completion_tokens": round(report.mean_completion_tokens, 2),
        "max_new_tokens": report.max_new_tokens,
    }
    return out | {"examples": report.examples}


def final_eval(model: Any, tokenizer: Any, names: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Held-out figures per environment (test split, a seed the training never used), with the prompts
    the environments render today (their system prompts), which is how `pnyx run` uses the model."""
    out: dict[str, Any] = {"sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0}, "seed": args.seed}
    for name, env in make_envs(names, None).items():
        n_tasks = args.eval_tasks if name == "arith" else args.eval_tasks // 2
        tasks = env.sample("test", 1000 + args.seed, n_tasks)
        res = quick_eval(model, tokenizer, env, tasks, args.eval_samples, 1000 + args.seed, examples=6)
        out[name] = figures(res)
        shown = {k: v for k, v in out[name].items() if k not in ("env", "examples")}
        print(f"eval {name}: " + " ".join(f"{k}={v}" for k, v in shown.items()), flush=True)
    return out


def load_phase2(folder: Path) -> tuple[Any, Any, list[dict]]:
    """A saved phase-2 model, its tokenizer and its phase 1-2 curve (from `evaluation.json` if present)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    card = folder / "evaluation.json"
    curve = json.loads(card.read_text()).get("pretraining_curve", []) if card.is_file() else []
    return model, tokenizer, curve


def main(argv: list[str] | None = None) -> None:
    import numpy as np
    import torch

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    t0 = time.time()
    envs = make_envs(args.envs, LEGACY_SYSTEM_PROMPT)
    args.mix = {n: args.mix.get(n, 0.0) for n in args.envs}
    source_minutes = 0.0

    if args.adapt_from is not None:
        model, tokenizer, curve = load_phase2(args.adapt_from)
        curve = [p for p in curve if p.get("phase") != "adapt"]
        source = json.loads((args.adapt_from / "evaluation.json").read_text())
        source_minutes = source.get("minutes", {}).get("phases_1_3") or args.source_minutes or 0.0
        print(f"model to adapt loaded from {args.adapt_from}", flush=True)
    elif args.phase2_from is None:
        # The tokenizer sees every kind of text the model will read or write: prompts, completions, replies.
        rng = random.Random(args.seed)
        streams = make_streams(envs, args, Noise(args.p_correct, args.p_format_error, args.p_search), rng)
        corpus = []
        for name in envs:
            for _ in range(2000):
                ex = next(streams[name])
                content = (
                    ex.prompt if isinstance(ex.prompt, str) else " ".join(m["content"] for m in ex.prompt)
                )
                corpus.append(content + "".join(text for text, _ in ex.segments))
        tokenizer = build_tokenizer(corpus, args.vocab)
        model = build_model(len(tokenizer), args.hidden, args.layers, args.heads, args.seed)
        params = sum(p.numel() for p in model.parameters())
        print(f"tokenizer vocab={len(tokenizer)} model params={params:,} envs={args.envs}", flush=True)
        curve = train(model, tokenizer, envs, args)
    else:
        model, tokenizer, curve = load_phase2(args.phase2_from)
        done = args.clean_steps + args.steps + sum(args.p3_steps[: args.p3_done_cycles])
        curve = [p for p in curve if p["step"] <= done]
        print(f"phase 2 model loaded from {args.phase2_from}", flush=True)
    if args.adapt_from is None and args.phase3 and "searchqa" in envs:
        curve += train_phase3(model, tokenizer, envs, args)
    phases_minutes = source_minutes + (0.0 if args.adapt_from else (time.time() - t0) / 60)
    t1 = time.time()
    if args.adapt_steps > 0 and {"arith", "searchqa"} <= set(envs):
        offset = curve[-1]["step"] if curve else 0
        curve += adapt(model, tokenizer, make_envs(args.envs, None), args, offset)
    adapt_minutes = (time.time() - t1) / 60
    evaluation = final_eval(model, tokenizer, args.envs, args)
    evaluation["minutes"] = {"phases_1_3": round(phases_minutes, 1), "adapt": round(adapt_minutes, 1)}
    evaluation["pretraining_curve"] = curve
    minutes = phases_minutes + adapt_minutes

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "evaluation.json").write_text(json.dumps(evaluation, indent=2) + "\n")
    write_card(out, model, args, evaluation, minutes)
    print(f"wrote {out} in {minutes:.1f} min", flush=True)


if __name__ == "__main__":
    main()
