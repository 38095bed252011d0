"""The generic engine path on architectures beyond the Llama family, and the Qwen3 fast path.

Tiny random models (`pnyx_harness.models.tiny_arch_model`) of Qwen3, Gemma3, Gemma2, LFM2, SmolLM3 and
Phi3 with the real tiny tokenizer: greedy tokens equal `model.generate`, recorded logprobs equal the
trainer's recompute, rows leaving the batch do not change the others, and tool turns either reuse the
KV cache exactly or (sliding windows, conv layers) fall back to re-prefilling.
"""

from __future__ import annotations

import pytest
import torch
from engine_support import logprob_gaps

from pnyx.errors import ConfigError
from pnyx.models import completion_logprobs
from pnyx.rollout.decoder import fast_path_supported, left_pad, open_session
from pnyx.rollout.engine import Engine
from pnyx.rollout.episodes import run_episodes
from pnyx.rollout.sampling import SamplingParams
from pnyx_harness.models import TINY_ARCHS, build_tiny_tokenizer, tiny_arch_model

torch.set_num_threads(1)

ARCHS = sorted(TINY_ARCHS)
PROMPTS = ["What is 12 + 7?", "hi", "<search>capital of France</search> The answer is", "Use 2, 3, 7, 9"]
# Attention-only caches can hold holes; sliding windows count slots and conv states take in every slot.
HOLES_OK = {"qwen3", "smollm3", "phi3"}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer(512)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    assert len({len(p) for p in ids}) > 1  # ragged on purpose
    return ids


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request, tokenizer):
    return tiny_arch_model(request.param, tokenizer)


def generic(model, tokenizer, fast: bool = False) -> Engine:
    """The engine on the transformers forward (unless `fast`), EOS off so lengths are fixed."""
    engine = Engine(model, tokenizer, fast=fast)
    engine.eos_ids = []
    return engine


def logprob_gap(model, prompts, completions, params: SamplingParams) -> float:
    """Largest |recorded - recomputed| over real completion tokens."""
    return float(logprob_gaps(model, prompts, completions, params).max())


def test_greedy_tokens_equal_transformers_generate_on_ragged_batch(arch_model, tokenizer, prompts):
    completions = generic(arch_model, tokenizer).generate(
        prompts, SamplingParams(temperature=0.0, max_new_tokens=16)
    )
    ids, attn = left_pad(prompts, tokenizer.pad_token_id, torch.device("cpu"))
    with torch.inference_mode():
        ref = arch_model.generate(
            ids, attention_mask=attn.long(), do_sample=False, max_new_tokens=16, min_new_tokens=16,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=None,
        )  # fmt: skip
    for i, c in enumerate(completions):
        assert c.tokens == ref[i, ids.shape[1] :].tolist()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_new_tokens=20, seed=3),
        SamplingParams(temperature=0.7, top_k=40, top_p=0.9, max_new_tokens=20, seed=5),
    ],
    ids=["t1", "topk-topp"],
)
def test_sampled_logprobs_equal_trainer_recompute(arch_model, tokenizer, prompts, params):
    completions = generic(arch_model, tokenizer).generate(prompts, params)
    assert logprob_gap(arch_model, prompts, completions, params) <= 1e-4


def test_finished_rows_leave_the_batch_without_changing_the_others(arch_model, tokenizer, prompts):
    # Row 0 ends at its 4th token (its token made EOS); the cache then drops it (conv states included).
    engine = generic(arch_model, tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    free = engine.generate(prompts, params)
    engine.eos_ids = [free[0].tokens[3]]
    ended = engine.generate(prompts, params)
    assert len(ended[0].tokens) <= 4
    for a, b in zip(ended, free, strict=True):
        assert a.tokens == b.tokens[: len(a.tokens)]
    assert sum(len(c.tokens) for c in ended) < sum(len(c.tokens) for c in free)  # someone really ended


def test_session_says_whether_holes_are_exact(arch_model):
    session = open_session(arch_model, 16, fast=False)
    assert session.holes_ok == (arch_model.config.model_type in HOLES_OK)
    assert session.can_keep
    assert (session.holes_reason is None) == session.holes_ok


def tools(n: int):
    """One tool per row, replies of different lengths (so reply chunks are ragged)."""
    return [lambda text, i=i: " <information>Paris</information>"[: 4 + 7 * i] for i in range(n)]


def test_tool_turns_give_recompute_equal_logprobs_and_the_re_prefill_tokens(arch_model, tokenizer, prompts):
    # Common letters as tool stops, so every row makes several tool calls at different steps.
    engine = generic(arch_model, tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=4)
    run = dict(tool_stops=["a", "e"], max_turns=4, max_episode_tokens=100)
    eps = run_episodes(engine, prompts, params, tools(len(prompts)), **run)
    ref = run_episodes(engine, prompts, params, tools(len(prompts)), **run, reuse_cache=False)
    assert sum(e.num_tool_calls for e in eps) >= len(prompts)
    assert [e.tokens for e in eps] == [e.tokens for e in ref]
    with torch.no_grad():
        logp, _, _ = completion_logprobs(arch_model, prompts, [e.tokens for e in eps])
    for i, e in enumerate(eps):
        model_tok = torch.tensor(e.loss_mask, dtype=torch.bool)
        assert float((logp[i, : len(e.tokens)] - torch.tensor(e.logprobs))[model_tok].abs().max()) <= 1e-4


def test_requiring_cache_reuse_where_holes_are_inexact_raises(tokenizer, prompts):
    engine = generic(tiny_arch_model("gemma3_text", tokenizer), tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    with pytest.raises(ConfigError, match="sliding-window"):
        run_episodes(engine, prompts, params, tools(len(prompts)), ["a"], max_turns=2, reuse_cache=True)


def test_qwen3_uses_the_fast_path_and_matches_the_transformers_forward(tokenizer, prompts):
    model = tiny_arch_model("qwen3", tokenizer)
    for layer in model.model.layers:  # non-trivial per-head norms, so skipping them would show
        torch.nn.init.normal_(layer.self_attn.q_norm.weight, 1.0, 0.5)
        torch.nn.init.normal_(layer.self_attn.k_norm.weight, 1.0, 0.5)
    assert fast_path_supported(model)
    ids, attn = left_pad(prompts, tokenizer.pad_token_id, torch.device("cpu"))
    with torch.inference_mode():
        fast = open_session(model, 32, fast=True).prefill(ids, attn)
        hf = open_session(model, 32, fast=False).prefill(ids, attn)
    assert torch.allclose(fast, hf, atol=1e-5, rtol=0)
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    a = generic(model, tokenizer, fast=True).generate(prompts, params)
    b = generic(model, tokenizer).generate(prompts, params)
    assert [c.tokens for c in a] == [c.tokens for c in b]
    sampled = SamplingParams(temperature=1.0, max_new_tokens=20, seed=3)
    completions = generic(model, tokenizer, fast=True).generate(prompts, sampled)
    assert logprob_gap(model, prompts, completions, sampled) <= 1e-4


def test_recompute_applies_the_models_own_logit_softcap(tokenizer, prompts):
    # Gemma2 soft-caps logits after the output projection: a recompute from hidden states alone would not.
    model = tiny_arch_model("gemma2", tokenizer)
    assert model.config.final_logit_softcapping
    comp = [[5, 6, 7, 8]] * len(prompts)
    with torch.no_grad():
        logp, _, _ = completion_logprobs(model, prompts, comp)
        seqs = [p + c for p, c in zip(prompts, comp, strict=True)]
        for i, s in enumerate(seqs):
            full = torch.log_softmax(model(torch.tensor([s])).logits[0].float(), -1)
            expect = full[torch.arange(len(prompts[i]) - 1, len(s) - 1), torch.tensor(comp[i])]
            assert torch.allclose(logp[i], expect, atol=1e-5)
