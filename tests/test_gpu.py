"""The engine on CUDA (skipped without a CUDA device): greedy tokens, bf16/fp16 logprobs, the tool loop.

Tolerances: in fp32 the engine's logprobs equal the recompute within 1e-4, as on CPU. In bf16/fp16 the
cached decode and the one-pass recompute round differently: on CPU in bf16 the gap measured max 0.016,
mean 0.003 (tiny model, 768 tokens; 0.008 / 0.0015 on a 4-layer width-256 model), so the test allows max
0.1 and mean 0.01. Greedy equality with `model.generate` is checked in fp32: in half precision two
different kernel orders can flip a near-tie, which says nothing about correctness.
"""

from __future__ import annotations

import pytest
import torch

from pnyx.models import completion_logprobs, load_model, load_tokenizer
from pnyx.rollout.decoder import left_pad
from pnyx.rollout.engine import Engine
from pnyx.rollout.episodes import run_episodes
from pnyx.rollout.sampling import SamplingParams

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
PROMPTS = ["What is 12 + 7?", "hi", "<search>capital of France</search> The answer is", "Use 2, 3, 7, 9"]
SESSIONS = pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "hf-forward"])


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS] * 8  # 32 rows


def gaps(model, prompts, completions, params: SamplingParams) -> torch.Tensor:
    """|recorded - recomputed| over every real completion token (float32, on the CPU)."""
    with torch.no_grad():
        logp, mask, _ = completion_logprobs(
            model, prompts, [c.tokens for c in completions], params.temperature, params.top_k, params.top_p
        )
    recorded = torch.zeros_like(logp)
    for i, c in enumerate(completions):
        recorded[i, : len(c.tokens)] = torch.tensor(c.logprobs, device=logp.device)
    return (logp.float() - recorded).abs()[mask].cpu()


@SESSIONS
def test_cuda_greedy_tokens_equal_transformers_generate(tiny_model_dir, tokenizer, prompts, fast):
    model = load_model(tiny_model_dir, device=DEVICE)
    engine = Engine(model, tokenizer, fast=fast)
    engine.eos_ids = []
    completions = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=24))
    ids, attn = left_pad(prompts, tokenizer.pad_token_id, torch.device(DEVICE))
    with torch.inference_mode():
        ref = model.generate(
            ids, attention_mask=attn.long(), do_sample=False, max_new_tokens=24, min_new_tokens=24,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=None,
        )  # fmt: skip
    for i, c in enumerate(completions):
        assert c.tokens == ref[i, ids.shape[1] :].tolist()


@SESSIONS
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_half_precision_logprobs_within_tolerance_of_recompute(
    tiny_model_dir, tokenizer, prompts, fast, dtype
):
    model = load_model(tiny_model_dir, dtype=dtype, device=DEVICE)
    params = SamplingParams(temperature=1.0, max_new_tokens=48, seed=1)
    completions = Engine(model, tokenizer, fast=fast).generate(prompts, params)
    gap = gaps(model, prompts, completions, params)
    assert torch.isfinite(gap).all()
    assert float(gap.max()) <= 0.1 and float(gap.mean()) <= 0.01


@SESSIONS
def test_cuda_fp32_sampled_logprobs_equal_recompute_with_truncation(tiny_model_dir, tokenizer, prompts, fast):
    model = load_model(tiny_model_dir, device=DEVICE)
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_new_tokens=32, seed=3)
    completions = Engine(model, tokenizer, fast=fast).generate(prompts, params)
    assert float(gaps(model, prompts, completions, params).max()) <= 1e-4


def test_cuda_same_seed_same_tokens(tiny_model_dir, tokenizer, prompts):
    engine = Engine(load_model(tiny_model_dir, dtype="bfloat16", device=DEVICE), tokenizer)
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=24, seed=11)
    assert [c.tokens for c in engine.generate(prompts, params)] == [
        c.tokens for c in engine.generate(prompts, params)
    ]


@SESSIONS
def test_cuda_tool_loop_on_the_cache_equals_re_prefill_and_recompute(
    tiny_model_dir, tokenizer, prompts, fast
):
    model = load_model(tiny_model_dir, device=DEVICE)
    engine = Engine(model, tokenizer, fast=fast)
    rows = prompts[:8]
    tools = [lambda text, i=i: " <information>Paris</information>"[: 4 + 3 * i] for i in range(len(rows))]
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=4)
    run = dict(tool_stops=["a", "e"], max_turns=4, max_episode_tokens=120)
    reused = run_episodes(engine, rows, params, tools, **run, reuse_cache=True)
    again = run_episodes(engine, rows, params, tools, **run, reuse_cache=False)
    assert sum(e.num_tool_calls for e in reused) >= len(rows)
    assert [e.tokens for e in reused] == [e.tokens for e in again]
    with torch.no_grad():
        logp, _, _ = completion_logprobs(model, rows, [e.tokens for e in reused])
    for i, e in enumerate(reused):
        model_tok = torch.tensor(e.loss_mask, dtype=torch.bool, device=logp.device)
        recorded = torch.tensor(e.logprobs, device=logp.device)
        assert float((logp[i, : len(e.tokens)] - recorded)[model_tok].abs().max()) <= 1e-4
