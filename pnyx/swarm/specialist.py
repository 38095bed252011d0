"""Start checkpoints for swarm experiments: a model briefly fine-tuned on one task family (a "specialist").

SAPO's claim is that sharing spreads what one node knows to nodes that do not know it. Testing that needs
nodes that start knowing different things. `specialize` makes such a start checkpoint from any base model:
a short supervised fine-tune on an environment's reference completions (train split only, so held-out
evaluation on the test split stays held out), saved as an ordinary model folder that `open_node` loads.

Knows nothing about the store, peers or RL. Deterministic for a given base, family, seed and thread count.
Imports torch inside functions.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pnyx.envs.base import stable_hash
from pnyx.errors import ConfigError


@dataclass(frozen=True)
class Family:
    """One task family: an environment name and its constructor kwargs (what a node trains on)."""

    label: str
    """Short name for tables and plots, e.g. "add3"."""
    env: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def build(self) -> Any:
        from pnyx.envs import get_env

        return get_env(self.env, **self.kwargs)


def _examples(tokenizer: Any, env: Any, seed: int, n: int, eos_id: int | None) -> list[tuple[list[int], list[int]]]:
    from pnyx.models import render_prompt

    out = []
    for task in env.sample("train", seed, n):
        ref = env.reference_completion(task)
        if not isinstance(ref, str):
            raise ConfigError(f"environment {env.name!r} has a multi-turn reference; specialize needs single-turn")
        comp = list(tokenizer(ref, add_special_tokens=False)["input_ids"])
        if eos_id is not None:
            comp.append(eos_id)
        out.append((list(render_prompt(tokenizer, task.prompt)), comp))
    return out


def specialize(
    base: str | Path,
    out: str | Path,
    family: Family,
    *,
    steps: int = 200,
    batch: int = 32,
    lr: float = 1e-3,
    seed: int = 0,
) -> Path:
    """Fine-tune `base` for `steps` AdamW steps on reference completions of `family` and save it to `out`.

    The loss is the mean negative log-likelihood of the completion tokens (EOS included) at temperature 1.
    Returns `out`. An existing `out` holding a model is returned as is (the caller names it by its inputs).
    """
    import torch

    from pnyx.models import load_model, load_tokenizer
    from pnyx.models.logprobs import completion_logprobs
    from pnyx.models.tokenizer import TOKENIZER_FILES

    out = Path(out)
    if (out / "config.json").is_file():
        return out
    if steps < 1 or batch < 1 or not lr > 0:
        raise ConfigError(f"specialize needs steps >= 1, batch >= 1 and lr > 0 (got {steps}, {batch}, {lr})")
    tokenizer = load_tokenizer(base)
    model = load_model(base, dtype="float32")
    env = family.build()
    data = _examples(tokenizer, env, stable_hash("specialize", family.label, seed) % (2**31), steps * batch, tokenizer.eos_token_id)
    rng = random.Random(seed)
    rng.shuffle(data)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    torch.manual_seed(seed)
    model.train()
    for s in range(steps):
        chunk = data[s * batch : (s + 1) * batch]
        logp, mask, _ = completion_logprobs(model, [p for p, _ in chunk], [c for _, c in chunk], temperature=1.0)
        loss = -logp[mask].mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    model.eval()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for name in TOKENIZER_FILES:  # copied byte for byte: same tokenizer digest, so peers take the exact path
        if (Path(base) / name).is_file():
            shutil.copyfile(Path(base) / name, tmp / name)
    tmp.rename(out)  # the folder appears whole or not at all
    return out
