"""The tiny base model shipped with pnyx: where it lives, its special tokens and its chat template.

`pnyx/assets/tiny-base/` is a ~1M-parameter Qwen2 model plus a byte-level BPE tokenizer, pretrained from
scratch by `scripts/make_base_model.py` on noisy procedural data of the built-in environments so that it
starts weak (held-out pass@1 about 0.2-0.3 on `arith` at temperature 1) yet has the right answer in its
distribution, which is what lets RL improve it within minutes on a CPU. It is sampled and evaluated like
any other model, through the engines of `pnyx.rollout.engines` and `pnyx.eval.runner.evaluate_model`.

Knows nothing about the store, the trainer, evaluation or the engine; imports nothing heavy.
"""

from __future__ import annotations

from pathlib import Path

ASSET_NAME = "tiny-base"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [EOS_TOKEN, PAD_TOKEN, *ROLE_TOKENS]
# Markup the environments use. Added as single (non-special) tokens, so a stop string is one token and
# decoding with skip_special_tokens=True still keeps them in the text the verifier sees.
TAG_TOKENS = ["<answer>", "</answer>", "<search>", "</search>", "<information>", "</information>"]

# Compact chat template: a system turn is `<|system|>{content}`, a user turn `<|user|>{content}`, an
# assistant turn ends with EOS, and the generation prompt opens `<|assistant|>`.
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
