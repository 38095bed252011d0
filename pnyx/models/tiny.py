"""The tiny base model shipped with pnyx: where it lives, its tokens, and a sampled evaluation of it.

`pnyx/assets/tiny-base/` is a ~1M-parameter Qwen2 model plus a byte-level BPE tokenizer, pretrained from
scratch by `scripts/make_base_model.py` on noisy procedural data of the built-in environments so that it
starts weak (held-out pass@1 about 0.3 on `arith` at temperature 1) yet has the right answer in its
distribution, which is what lets RL improve it within minutes on a CPU.

The evaluation here samples with plain Hugging Face `generate` (temperature 1, no top-k/top-p), runs the
multi-turn tool loop of an environment when it has one, and scores with the environment's own verifier.
It knows nothing about the store, the trainer or the pnyx engine. Heavy imports (torch, transformers)
happen inside functions, so importing this module is cheap.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pnyx.eval.metrics import pass_at_k  # the one unbiased estimator; re-exported for the build script

ASSET_NAME = "tiny-base"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [EOS_TOKEN, PAD_TOKEN, *ROLE_TOKENS]
# Markup the environments use. Added as single (non-special) tokens, so a stop string is one token and
# decoding with skip_special_tokens=True still keeps them in the text the verifier sees.
TAG_TOKENS = ["<answer>", "</answer>", "<search>", "</search>", "<information>", "</information>"]

# Compact chat template: a user turn is `<|user|>{content}`, an assistant turn ends with EOS, and the
# generation prompt opens `<|assistant|>`.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|system|>{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% else %}<|assistant|>{{ m['content'] }}<|endoftext|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def default_model_path() -> Path:
    """The folder of the shipped tiny base model (inside the installed package)."""
    return Path(__file__).resolve().parent.parent / "assets" / ASSET_NAME


@dataclass
class EvalResult:
    """Figures of one sampled evaluation of one environment."""

    env: str
    tasks: int
    samples_per_task: int
    pass_at_1: float
    pass_at_k: dict[int, float]
    format_rate: float
    search_rate: float
    correct_when_searched: float | None
    correct_without_search: float | None
    mean_completion_tokens: float
    examples: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "env": self.env,
            "tasks": self.tasks,
            "samples_per_task": self.samples_per_task,
            "pass@1": round(self.pass_at_1, 4),
            **{f"pass@{k}": round(v, 4) for k, v in self.pass_at_k.items()},
            "format_rate": round(self.format_rate, 4),
            "search_rate": round(self.search_rate, 4),
            "correct_when_searched": _round(self.correct_when_searched),
            "correct_without_search": _round(self.correct_without_search),
            "mean_completion_tokens": round(self.mean_completion_tokens, 2),
        }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


@dataclass
class Episode:
    """One sampled completion: its text, tool calls, and token ids with a loss mask (0 = tool tokens)."""

    text: str
    num_tool_calls: int
    ids: list[int]
    loss_mask: list[int]


def sample_episodes(
    model: Any,
    tokenizer: Any,
    env: Any,
    tasks: Sequence[Any],
    n: int,
    max_new_tokens: int = 48,
    batch_size: int = 256,
    seed: int = 0,
) -> list[list[Episode]]:
    """Sample `n` episodes per task at temperature 1 (top-k 0, top-p 1); return them per task.

    Single-turn environments stop at their stop strings or EOS. Multi-turn ones stop at a tool call
    (`env.tool_stops`), get the tool's reply from `env.respond` appended as tokens (loss mask 0), and
    continue, up to `env.max_turns` model turns. Every stop string must be a single token of `tokenizer`
    (true of the shipped model), so stopping is by token id.
    """
    import torch

    stop_ids = {tokenizer.eos_token_id}
    stop_ids |= {_single_token(tokenizer, s) for s in env.stop_strings}
    tool_ids = {_single_token(tokenizer, s) for s in env.tool_stops}
    prompts = [_render(tokenizer, t.prompt) for t in tasks]
    eps = [_Live(i, prompts[i]) for i in range(len(tasks)) for _ in range(n)]
    gen = torch.Generator().manual_seed(seed)
    max_turns = max(1, int(getattr(env, "max_turns", 1)))
    for turn in range(max_turns):
        live = [e for e in eps if not e.done]
        for start in range(0, len(live), batch_size):
            chunk = live[start : start + batch_size]
            seqs = [e.prompt + e.ids for e in chunk]
            outs = _generate(model, tokenizer, seqs, stop_ids | tool_ids, max_new_tokens, gen)
            for e, out in zip(chunk, outs, strict=True):
                e.ids += out
                e.mask += [1] * len(out)
                e.done = True
                if out and out[-1] in tool_ids and turn + 1 < max_turns:
                    reply = env.respond(tasks[e.task], tokenizer.decode(e.ids, skip_special_tokens=True))
                    if reply is not None:
                        reply_ids = tokenizer.encode(reply, add_special_tokens=False)
                        e.ids += reply_ids
                        e.mask += [0] * len(reply_ids)
                        e.calls += 1
                        e.done = False
        if all(e.done for e in eps):
            break
    result: list[list[Episode]] = [[] for _ in tasks]
    for e in eps:
        text = tokenizer.decode(e.ids, skip_special_tokens=True)
        result[e.task].append(Episode(text, e.calls, e.ids, e.mask))
    return result


@dataclass
class _Live:
    task: int
    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    calls: int = 0
    done: bool = False


def evaluate(
    model: Any,
    tokenizer: Any,
    env: Any,
    tasks: Sequence[Any],
    n: int = 8,
    ks: Sequence[int] = (8,),
    max_new_tokens: int = 48,
    seed: int = 0,
) -> EvalResult:
    """Sampled evaluation (temperature 1): pass@1 and pass@k (unbiased), format, search behaviour.

    A sample is correct when the environment's reward is 1.0 (full marks); "format" means the verifier
    found a parsable answer (its `format` part is 1 when it reports one, else reward > 0).
    """
    episodes = sample_episodes(model, tokenizer, env, tasks, n, max_new_tokens=max_new_tokens, seed=seed)
    p1, pk = [], {k: [] for k in ks}
    fmt = searched = ok_s = ok_ns = n_s = n_ns = toks = 0
    examples = []
    for task, eps in zip(tasks, episodes, strict=True):
        correct = 0
        for ep in eps:
            score = env.score(task, ep.text)
            ok = score.reward >= 1.0 - 1e-9
            correct += ok
            fmt += score.parts.get("format", float(score.reward > 0)) > 0
            toks += len(ep.ids)
            if ep.num_tool_calls > 0:
                searched += 1
                n_s += 1
                ok_s += ok
            else:
                n_ns += 1
                ok_ns += ok
            if len(examples) < 6:
                examples.append(ep.text)
        p1.append(correct / n)
        for k in ks:
            pk[k].append(pass_at_k(n, correct, k))
    total = len(tasks) * n
    return EvalResult(
        env=env.name,
        tasks=len(tasks),
        samples_per_task=n,
        pass_at_1=sum(p1) / len(p1),
        pass_at_k={k: sum(v) / len(v) for k, v in pk.items()},
        format_rate=fmt / total,
        search_rate=searched / total,
        correct_when_searched=ok_s / n_s if n_s else None,
        correct_without_search=ok_ns / n_ns if n_ns else None,
        mean_completion_tokens=toks / total,
        examples=examples,
    )


def _render(tokenizer: Any, prompt: Any) -> list[int]:
    """Prompt ids: chat messages through the chat template with the generation prompt; a string as a user turn."""
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def _single_token(tokenizer: Any, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"stop string {text!r} is {len(ids)} tokens in this tokenizer; expected exactly one")
    return ids[0]


def _generate(
    model: Any, tokenizer: Any, seqs: list[list[int]], stop_ids: set[int], max_new: int, gen: Any
) -> list[list[int]]:
    """Sample continuations of left-padded `seqs` until a stop id (kept) or `max_new` tokens."""
    import torch

    pad = tokenizer.pad_token_id
    width = max(len(s) for s in seqs)
    ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    done = torch.zeros(len(seqs), dtype=torch.bool)
    stops = torch.tensor(sorted(stop_ids))
    outs = torch.full((len(seqs), max_new), pad)
    past = None
    # transformers 5.x renamed `past_key_values` to `cache` (argument and output field)
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    step_ids, step_pos = ids, pos
    with torch.no_grad():
        for t in range(max_new):
            out = model(
                input_ids=step_ids,
                attention_mask=mask,
                position_ids=step_pos,
                use_cache=True,
                logits_to_keep=1,
                **{cache_arg: past},
            )
            past = getattr(out, cache_arg)
            probs = torch.softmax(out.logits[:, -1].float(), dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            outs[:, t] = nxt
            done = done | torch.isin(nxt, stops)
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones(len(seqs), 1, dtype=mask.dtype)], dim=1)
            step_ids = nxt.unsqueeze(1)
            step_pos = step_pos[:, -1:] + 1
    result = []
    for row in outs.tolist():
        seq = []
        for tok in row[: t + 1]:
            seq.append(tok)
            if tok in stop_ids:
                break
        result.append(seq)
    return result
