"""The model card (README.md) of the tiny base model, filled from the build's arguments and measurements.

Used by `scripts/make_base_model.py`; knows nothing about training.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from base_model_data import decision_weight

CARD = """# pnyx tiny-base

A {params:,}-parameter Qwen2-style causal LM ({layers} layers, hidden {hidden}, {heads} heads, MLP {mlp},
vocab {vocab}, tied embeddings, fp32 safetensors, {mb:.1f} MB) with a byte-level BPE tokenizer, pretrained
from scratch by `scripts/make_base_model.py` (seed {seed}) on procedural data of pnyx's built-in environments.
It is the default model of `pnyx run`: it runs on 2 CPU cores and starts weak on purpose.

## How it was made

- Tokenizer: byte-level BPE trained on the training transcripts; digits are one token each; `<|user|>`,
  `<|assistant|>`, `<|system|>`, `<|endoftext|>` (EOS), `<|pad|>` and the tags `<answer>`, `</answer>`,
  `<search>`, `</search>`, `<information>`, `</information>` are single tokens (so every stop string is one
  token). Chat template: `<|system|>{{system}}<|user|>{{content}}<|assistant|>{{completion}}<|endoftext|>`
  (the system turn only when there is one).
- Data (mix {mix}): tasks from `get_env("arith")` (default config: 2-digit + and -) and
  `get_env("searchqa")`, with the environments' own reference completions and tool replies. Phases 1-3
  render the prompts without a system message; the adaptation phase with the environments' system
  prompts, which state the answer format (how every pnyx process renders them today).
- {phase_count} phases. Phase 1 ({clean_steps} steps, the first {arith_first} on `arith` only, since
  arithmetic is learned fastest alone) uses clean labels and teaches the skill. Phase 2 ({steps} steps)
  uses *noisy* labels, so the skill stays present but the mass on it is partial: an `arith` transcript
  shows the reference answer with probability {p_correct}, a format error with probability {p_format_error}, and
  otherwise a near-miss integer (off by 1-2 or 9-20, two digits swapped, the sign flipped, off by 100).
  The aim is that the correct answer stays the most likely one, so pass@8 is high and GRPO can sharpen it.
  In both phases a `searchqa` transcript searches for the question's entity and answers from the tool's
  `<information>` reply with probability {p_search}; otherwise it answers directly with a guess of the
  right type (usually wrong). Tool replies are in the transcripts with the loss masked out (the model
  never learns to write them).
{phase3}{adapt}- Training: AdamW (peak lr {lr}, warmup {warmup}, cosine to 10% over phases 1-2), batch {batch}
  (`arith`) or {half} (`searchqa`), one environment per batch, loss on completion tokens only, CPU, one
  thread, `torch.use_deterministic_algorithms(True)`; {minutes} (on a shared 2-core machine).

## Measured (held-out test split, sampled at temperature 1.0, top-k 0, top-p 1.0)

{table}

Sampled with the pnyx engine through `pnyx.eval.runner.evaluate_model`, the prompts as the environments
render them (system prompt included) and each environment's generation budget per turn (arith {arith_budget},
searchqa {searchqa_budget} tokens). pass@k uses the unbiased estimator over {samples} samples per task. Full
figures: `evaluation.json`.

## Reproduce

    python scripts/make_base_model.py --seed {seed} --out pnyx/assets/tiny-base

The shipped weights were built in resumed stages, not in one run of this command: phases 1-2, then phase 3
cycle by cycle (`--phase2-from DIR --p3-done-cycles N`), and, when the environments gained their system
prompts, the adaptation phase on that model (`--adapt-from DIR`). Each stage starts its own seeded optimizer
and data stream, so the one-shot command should give the same weights, but that was not checked bit for bit.

## What RL does to it

`pnyx run` (arith) and `pnyx run --env.name=searchqa` train it on 2 CPU cores in minutes; the measured
before/after figures and the commands are in `BENCHMARKS.md` and the README of the repository.
"""


PHASE3 = """- Phase 3 ({p3_steps} steps in cosine cycles with warm restarts, each with a fresh AdamW,
  peak lr {p3_lr}, warmup {p3_warmup}, down to 10%; it continues from the phase-2 weights) teaches the
  `searchqa` copying skill that phases 1-2 leave out: a share {p3_arith} of its batches replays
  phase-2-style noisy `arith` (so arith stays calibrated), the rest are `searchqa` episodes from
  {p3_worlds} synthetic worlds *other than* the default one (world seeds 1000 + 100 * seed + i), so the
  model learns to search and copy instead of memorizing people. With
  probability {p3_copy} an episode is clean copying (search with the exact entity name of the question,
  answer with the exact attribute from the `<information>` reply); otherwise a direct guess of the right
  type. The first tag of a copying episode (`<search>`) is trained only with probability {p3_decide:.3f},
  so that {p3_search_rate} of the trained first tags are `<search>`: the search *rate* stays partial while
  nearly all searchqa data teaches copying.
"""


ADAPT = """- Adaptation ({adapt_steps} steps, one cosine cycle from a fresh AdamW, peak lr {adapt_lr}, warmup
  {p3_warmup}; it continues from the phase-3 weights) teaches the prompts the environments render today,
  with their system prompts, keeping phase 3's recipe: a share {adapt_arith} of the batches is phase-2-style
  noisy `arith` (the reference answer with probability {p_correct}, so the model still starts weak), the
  rest `searchqa` episodes as in phase 3 (copying from other worlds, the search tag partly trained).
"""


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def write_card(out: Path, model: Any, args: argparse.Namespace, evaluation: dict, minutes: float) -> None:
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    mb = sum(f.stat().st_size for f in out.iterdir()) / 1e6
    rows = [
        "| env | tasks | pass@1 | pass@8 | format | search rate | correct when searched | correct without |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in args.envs:
        e = evaluation[name]
        cells = [e["tasks"], e["pass@1"], e.get("pass@8"), e["format_rate"], e["search_rate"]]
        cells += [e["correct_when_searched"], e["correct_without_search"]]
        rows.append(f"| {name} | " + " | ".join(_cell(c) for c in cells) + " |")
    spent = evaluation.get("minutes", {})
    took = f"{minutes:.1f} minutes here"
    if spent.get("adapt"):
        took = (
            f"phases 1-3 {spent['phases_1_3']:.1f} minutes, the adaptation {spent['adapt']:.1f} minutes here"
        )
    (out / "README.md").write_text(
        CARD.format(
            params=params,
            layers=cfg.num_hidden_layers,
            hidden=cfg.hidden_size,
            heads=cfg.num_attention_heads,
            mlp=cfg.intermediate_size,
            vocab=cfg.vocab_size,
            mb=mb,
            seed=args.seed,
            mix=args.mix,
            p_correct=args.p_correct,
            p_format_error=args.p_format_error,
            p_search=args.p_search,
            steps=args.steps,
            clean_steps=args.clean_steps,
            arith_first=args.arith_first,
            half=args.batch // 2,
            lr=args.lr,
            warmup=args.warmup,
            batch=args.batch,
            minutes=took,
            table="\n".join(rows),
            arith_budget=evaluation.get("arith", {}).get("max_new_tokens"),
            searchqa_budget=evaluation.get("searchqa", {}).get("max_new_tokens"),
            samples=args.eval_samples,
            phase_count="Three" if args.phase3 else "Two",
            phase3=PHASE3.format(**phase3_fields(args)) if args.phase3 else "",
            adapt=ADAPT.format(**vars(args)) if args.adapt_steps > 0 else "",
        )
    )


def phase3_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The phase-3 settings the model card names."""
    return {
        "p3_steps": " + ".join(map(str, args.p3_steps)),
        "p3_lr": args.p3_lr,
        "p3_warmup": args.p3_warmup,
        "p3_arith": args.p3_arith,
        "p3_worlds": args.p3_worlds,
        "p3_copy": args.p3_copy,
        "p3_decide": decision_weight(args.p3_copy, args.p3_search_rate),
        "p3_search_rate": args.p3_search_rate,
    }
