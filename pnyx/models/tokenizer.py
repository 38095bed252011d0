"""Prompt rendering, end-of-sequence ids and the tokenizer digest recorded in run.json.

`render_prompt` turns an environment's prompt into token ids the same way on every worker: a string is
encoded as is (no special tokens added); a list of chat messages goes through the tokenizer's chat template
with the generation prompt; a tokenizer without a template joins the contents with newlines.
`tokenizer_digest` hashes the tokenizer files, so a worker with a different tokenizer is detected before it
produces a single rollout. Knows nothing about models, the store or RL; imports nothing heavy.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import xxhash

from pnyx.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Every file that can change how text maps to ids (or how chats render). Absent files are skipped.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


def render_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str | list[dict[str, Any]]) -> list[int]:
    """Token ids of `prompt`: a string is encoded as is; messages go through the chat template."""
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    if not isinstance(prompt, list) or not all(isinstance(m, dict) and "content" in m for m in prompt):
        raise ConfigError(
            f"a prompt must be a string or a list of {{'role', 'content'}} messages, got {type(prompt).__name__}"
        )
    if getattr(tokenizer, "chat_template", None):
        rendered = str(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False))
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    text = "\n".join(str(m["content"]) for m in prompt)
    return list(tokenizer.encode(text, add_special_tokens=False))


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, model: object = None) -> list[int]:
    """The ids that end a completion: the tokenizer's EOS plus the model's generation-config EOS list."""
    ids: set[int] = set()
    if isinstance(tokenizer.eos_token_id, int):
        ids.add(tokenizer.eos_token_id)
    gen = getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(extra, int):
        ids.add(extra)
    elif extra is not None:
        ids.update(int(i) for i in extra)
    return sorted(ids)


def tokenizer_digest(tokenizer_dir: str | Path) -> str:
    """xxh3-128 hex digest over the tokenizer files present in `tokenizer_dir` (names and contents)."""
    folder = Path(tokenizer_dir)
    h = xxhash.xxh3_128()
    found = 0
    for name in TOKENIZER_FILES:
        f = folder / name
        if f.is_file():
            data = f.read_bytes()
            h.update(name.encode() + b"\0" + len(data).to_bytes(8, "little"))
            h.update(data)
            found += 1
    if not found:
        raise ConfigError(f"{folder} holds no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)})")
    return h.hexdigest()


class StopMatcher:
    """Finds the first token whose text completes one of the stop strings, from a window of recent tokens."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = list(stops)
        # Every token decodes to at least one byte, so a stop of n bytes is covered by its last n tokens;
        # two more absorb a partial UTF-8 character at the window's start.
        self.window = max((len(s.encode("utf-8")) for s in self.stops), default=0) + 2
        self.last_chars = {s[-1] for s in self.stops}
        self.token_text: dict[int, str] = {}

    def could_end(self, token: int) -> bool:
        """False if `token` cannot be the one completing a stop: a newly completed stop ends inside the
        newest token's text, so that text must hold a stop's last character (unknown for tokens that
        decode to nothing or to part of a UTF-8 character; those are always checked)."""
        text = self.token_text.get(token)
        if text is None:
            text = self.token_text[token] = cast(
                str, self.tokenizer.decode([token], skip_special_tokens=False)
            )
        return not text or "\ufffd" in text or any(c in text for c in self.last_chars)

    def match(self, tokens: list[int]) -> str | None:
        """The stop string the text of `tokens` now contains, checked after every appended token."""
        if not self.stops or not self.could_end(tokens[-1]):
            return None
        tail = self.tokenizer.decode(tokens[-self.window :], skip_special_tokens=False)
        for s in self.stops:
            if s in tail:
                return s
        return None
