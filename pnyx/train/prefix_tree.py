"""Many rows that share prefixes, forwarded as one tree: each distinct prefix token once, in one call.

The exact re-check of seeded draws (`pnyx.train.rejudge`) measures a handful of short rows per version,
under weights of their own. On a CPU such a forward costs mostly the read of every weight (SmolLM2-135M
with 2 threads: ~70 ms for one token, +1.4 ms per token), so what counts is the number of calls and then
the tokens. The rows' token sequences (prompt, then completion) are put in a trie: one node per distinct
prefix, so a chat template and system prompt shared by every prompt, a prompt shared by its group's rows,
and completions that start alike are each forwarded once. The nodes go in one sequence in creation order (a parent before its
children); a 4-D attention mask lets each node attend to exactly its ancestors and itself, and its position
id is its depth, so every node sees what it would see at the head of its own row forwarded alone.

This needs a model whose every layer is plain full attention over positions given by ids and masks
(`packs_prefixes`): a sliding window, a convolution or a recurrent state would see the tree's sequence
order, not the row's. Other models take `drawcheck.cached_prompt_logits` (prompts once, completions on their
KV cache). The structural checks rest on how today's transformers builds masks, so each model object is
also proven once, on two short rows that share a prefix, before its first tree: the tree's logits must
equal each row forwarded alone (another transformers release, a custom model that passes the checks but
not the mask: the model is then not packed, with a warning). Knows nothing about draws, uniforms or the
store (it takes the logits budget and the forward introspection `drawcheck` already has).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator

import numpy as np
import torch

from pnyx.train.drawcheck import MAX_LOGITS, forward_parameters

log = logging.getLogger("pnyx.trainer")

TREE_NODES = 1024
"""Nodes per forward call: the call's attention mask is nodes x nodes."""
ATTENTION = ("sdpa", "eager")
"""Attention implementations that take a 4-D additive mask as given."""


def packs_prefixes(model: torch.nn.Module) -> bool:
    """Whether `model` can be forwarded as a prefix tree: it takes position ids and an attention mask, every
    layer is full attention (no sliding window, convolution or recurrence), and its attention takes a 4-D
    additive mask as given (sdpa or eager)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) not in ATTENTION:
        return False
    if not {"position_ids", "attention_mask"} <= forward_parameters(type(model)):
        return False
    kinds = getattr(config, "layer_types", None)
    if kinds is not None and set(kinds) != {"full_attention"}:
        return False
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return False
    if getattr(config, "model_type", "") not in PLAIN_TYPES:
        return False
    proven = _PROVEN.get(model)
    if proven is None:
        proven = _PROVEN[model] = tree_equals_rows(model)
        if not proven:
            import transformers

            log.warning(
                "trainer: a prefix tree of %s does not reproduce its rows forwarded alone here (transformers "
                "%s): its rows are not packed", type(model).__name__, transformers.__version__,
            )  # fmt: skip
    return proven


_PROVEN: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()
"""Per model object, whether its tree reproduced its rows (`tree_equals_rows`): proven once."""
PROBE_ROWS = (([1, 2, 3], [4, 5]), ([1, 2, 6], [7]))
"""(prompt, completion) pairs that share a prefix, of token ids every vocabulary has."""


def tree_equals_rows(model: torch.nn.Module, atol: float = 1e-3) -> bool:
    """Whether the tree of `PROBE_ROWS` gives, at every completion position, the logits of each row forwarded
    alone (within `atol`, relative to the logits' scale), computed in eval mode (no dropout)."""
    prompts = [list(p) for p, _ in PROBE_ROWS]
    completions = [list(c) for _, c in PROBE_ROWS]
    wanted = [list(range(len(c))) for c in completions]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for part, logits in tree_logits(model, prompts, completions, wanted):
                for j, k in enumerate(part):
                    row = torch.tensor([prompts[k] + completions[k]], dtype=torch.long, device=device)
                    alone = model(row).logits[0, len(prompts[k]) - 1 : -1].float()
                    got = logits[j, : len(wanted[k])]
                    if not torch.allclose(got, alone, atol=atol * max(1.0, float(alone.abs().max())), rtol=0):
                        return False
    finally:
        model.train(was_training)
    return True


PLAIN_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral", "olmo", "olmo2", "phi3", "granite"})
"""Model types whose decoder builds its mask with transformers' `create_causal_mask` (which passes a 4-D
mask through) and applies RoPE from position ids, with nothing that mixes positions but attention."""


class Tree:
    """A trie of token sequences: node i holds `tokens[i]` at depth `depth[i]` under `parent[i]` (-1: a root)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parent: list[int] = []
        self.depth: list[int] = []
        self.child: dict[tuple[int, int], int] = {}

    def add(self, seq: list[int]) -> list[int]:
        """Insert `seq`; returns the node of each of its tokens."""
        path, at = [], -1
        for t in seq:
            node = self.child.get((at, t))
            if node is None:
                node = self.child[(at, t)] = len(self.tokens)
                self.tokens.append(t)
                self.parent.append(at)
                self.depth.append(len(path))
            path.append(node)
            at = node
        return path

    def missing(self, seq: list[int]) -> int:
        """How many nodes `add(seq)` would create."""
        at = -1
        for k, t in enumerate(seq):
            node = self.child.get((at, t))
            if node is None:
                return len(seq) - k
            at = node
        return 0

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        """[1, 1, n, n] additive mask: 0 where a node may attend (its ancestors and itself), else the
        dtype's lowest value."""
        n = len(self.tokens)
        sees = np.zeros((n, n), dtype=bool)
        for i, p in enumerate(self.parent):  # a parent precedes its children: its row is complete
            if p >= 0:
                sees[i] = sees[p]
            sees[i, i] = True
        out = torch.zeros((n, n), dtype=dtype)
        out.masked_fill_(torch.from_numpy(~sees), torch.finfo(dtype).min)
        return out[None, None]


def tree_logits(
    model: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]], wanted: list[list[int]]
) -> Iterator[tuple[list[int], torch.Tensor]]:
    """(row indices, logits [k, P, V] float32) per call, the contract of `drawcheck.cached_prompt_logits`:
    logits[j, p] predicts completion token `wanted[idx[j]][p]` of row idx[j] (each prompt non-empty; slots
    past a row's list are padding). Rows in prompt order; a call closes before its tree passes `TREE_NODES`
    nodes or its logits `MAX_LOGITS`; the vocabulary projection runs once per distinct predicting node."""
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 1)
    tree, part, at = Tree(), [], []  # at: per row of the call, the node predicting each wanted token
    width = 1  # the call's widest row of wanted tokens
    for i in sorted(range(len(prompts)), key=lambda i: (prompts[i], len(completions[i]))):
        seq = prompts[i] + completions[i]
        npos = max(width, len(wanted[i]))
        if part and (
            len(tree.tokens) + tree.missing(seq) > TREE_NODES or (len(part) + 1) * npos * vocab > MAX_LOGITS
        ):
            yield part, _forward(model, tree, at)
            tree, part, at, npos = Tree(), [], [], max(1, len(wanted[i]))
        path = tree.add(seq)
        part.append(i)
        at.append([path[len(prompts[i]) + t - 1] for t in wanted[i]])
        width = npos
    if part:
        yield part, _forward(model, tree, at)


def _forward(model: torch.nn.Module, tree: Tree, at: list[list[int]]) -> torch.Tensor:
    """Logits [rows, P, V] float32 at the nodes `at` names per row (padded with node 0's), from one forward
    of the tree."""
    from pnyx.models.logprobs import picked_forward

    param = next(model.parameters())
    picked = sorted({n for nodes in at for n in nodes}) or [0]
    slot = {n: j for j, n in enumerate(picked)}
    out = picked_forward(
        model, torch.tensor([picked], dtype=torch.long, device=param.device),
        input_ids=torch.tensor([tree.tokens], dtype=torch.long, device=param.device),
        attention_mask=tree.mask(param.dtype).to(param.device),
        position_ids=torch.tensor([tree.depth], dtype=torch.long, device=param.device), use_cache=False,
    )  # fmt: skip
    logits = out.logits[0].float()  # [distinct predicting nodes, V]
    index = torch.zeros((len(at), max(1, max(len(a) for a in at))), dtype=torch.long)
    for j, nodes in enumerate(at):
        index[j, : len(nodes)] = torch.tensor([slot[n] for n in nodes], dtype=torch.long)
    return logits[index.to(param.device)]
