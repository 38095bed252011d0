"""KV-cache reuse: holes, ragged chunks on top of the cache, cache growth, and tool turns that only prefill
the reply (fast path and transformers forward, tiny Qwen2 model)."""

from __future__ import annotations

import pytest
import torch

from pnyx.models import completion_logprobs, load_model, load_tokenizer
from pnyx.rollout.decoder import left_pad, open_session
from pnyx.rollout.engine import Engine
from pnyx.rollout.episodes import run_episodes
from pnyx.rollout.sampling import SamplingParams

torch.set_num_threads(1)

PROMPTS = ["What is 12 + 7?", "hi", "<search>capital of France</search> The answer is", "Use 2, 3, 7, 9"]
CHUNKS = [" <information>Paris</information>", " 19", "", " ok then"]
SESSIONS = pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "hf-forward"])
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


def last_logits(model, seqs: list[list[int]]) -> torch.Tensor:
    """Next-token logits [B, V] of each sequence from one plain forward per sequence (no padding)."""
    with torch.no_grad():
        return torch.stack([model(torch.tensor([s])).logits[0, -1] for s in seqs])


@SESSIONS
def test_ragged_chunks_on_the_cache_equal_a_forward_of_the_concatenation(model, tokenizer, prompts, fast):
    chunks = [[7, *tokenizer.encode(c, add_special_tokens=False)] for c in CHUNKS]  # ragged, one is 1 token
    with torch.inference_mode():
        session = open_session(model, 8, fast)
        session.prefill(*left_pad(prompts, tokenizer.pad_token_id, CPU))
        got = session.extend(*left_pad(chunks, tokenizer.pad_token_id, CPU))
    want = last_logits(model, [p + c for p, c in zip(prompts, chunks, strict=True)])
    assert torch.allclose(got, want, atol=1e-4, rtol=0)


@SESSIONS
def test_a_row_waiting_on_holes_continues_as_if_it_never_waited(model, tokenizer, prompts, fast):
    # Row 1 waits (holes) for 3 steps while the others decode, then gets its tokens appended.
    seqs = [list(p) for p in prompts]
    with torch.inference_mode():
        session = open_session(model, 4, fast)  # smaller than needed: the cache must grow
        session.prefill(*left_pad(prompts, tokenizer.pad_token_id, CPU))
        live = torch.tensor([True, False, True, True])
        for t in (11, 12, 13):
            session.step(torch.full((4,), t), live)
            for i in (0, 2, 3):
                seqs[i].append(t)
        got = session.step(torch.full((4,), 14))
    for s in seqs:
        s.append(14)
    assert torch.allclose(got, last_logits(model, seqs), atol=1e-4, rtol=0)


@SESSIONS
def test_dropping_rows_after_holes_keeps_the_rest_exact(model, tokenizer, prompts, fast):
    with torch.inference_mode():
        session = open_session(model, 8, fast)
        session.prefill(*left_pad(prompts, tokenizer.pad_token_id, CPU))
        session.step(torch.full((4,), 9), torch.tensor([True, False, True, False]))
        session.keep(torch.tensor([1, 2]))
        got = session.extend(*left_pad([[5, 6, 7], [8]], tokenizer.pad_token_id, CPU))
    want = last_logits(model, [prompts[1] + [5, 6, 7], prompts[2] + [9, 8]])
    assert torch.allclose(got, want, atol=1e-4, rtol=0)


@SESSIONS
def test_a_row_set_aside_and_put_back_continues_exactly(model, tokenizer, prompts, fast):
    # Row 1 is taken out while the others decode two tokens, then merged back (after them) and extended.
    with torch.inference_mode():
        session = open_session(model, 8, fast)
        session.prefill(*left_pad(prompts, tokenizer.pad_token_id, CPU))
        parked = session.take(torch.tensor([1]))
        session.keep(torch.tensor([0, 2, 3]))
        for t in (11, 12):
            session.step(torch.full((3,), t))
        session.merge([parked])
        got = session.extend(*left_pad([[5], [6], [7], [8, 9]], tokenizer.pad_token_id, CPU))
    p0, p1, p2, p3 = prompts
    want = last_logits(model, [p0 + [11, 12, 5], p2 + [11, 12, 6], p3 + [11, 12, 7], p1 + [8, 9]])
    assert torch.allclose(got, want, atol=1e-4, rtol=0)


class CountingSession:
    """A real session that records how many tokens each call feeds it."""

    def __init__(self, inner, fed: list[tuple[str, int]]):
        self.inner, self.fed = inner, fed

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def prefill(self, ids, attn):
        self.fed.append(("prefill", int(attn.sum())))
        return self.inner.prefill(ids, attn)

    def extend(self, ids, attn):
        self.fed.append(("extend", int(attn.sum())))
        return self.inner.extend(ids, attn)


def tools(n: int):
    """One tool per row; replies of different lengths per row and per call."""

    def make(i: int):
        calls = [0]

        def tool(text: str) -> str:
            calls[0] += 1
            return " <information>Paris</information>"[: 3 + 5 * i + 2 * calls[0]]

        return tool

    return [make(i) for i in range(n)]


RUN = dict(tool_stops=["a", "e"], max_turns=4, max_episode_tokens=120)


@SESSIONS
def test_tool_turns_prefill_the_prompt_once_then_only_the_replies(model, tokenizer, prompts, fast):
    engine = Engine(model, tokenizer, fast=fast)
    fed: list[tuple[str, int]] = []
    real = engine.session
    engine.session = lambda max_len: CountingSession(real(max_len), fed)
    eps = run_episodes(
        engine, prompts, SamplingParams(temperature=1.0, max_new_tokens=12, seed=4), tools(4), **RUN
    )
    assert fed[0] == ("prefill", sum(len(p) for p in prompts))
    assert [kind for kind, _ in fed[1:]] == ["extend"] * (len(fed) - 1)
    reply_tokens = sum(e.loss_mask.count(0) for e in eps)
    replies = sum(
        m == 0 and (k == 0 or e.loss_mask[k - 1] == 1) for e in eps for k, m in enumerate(e.loss_mask)
    )
    assert replies >= 4
    assert (
        sum(n for _, n in fed[1:]) == reply_tokens + replies
    )  # per reply: the call's last token + the reply


@SESSIONS
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_tool_turns_on_the_cache_equal_re_prefilling(model, tokenizer, prompts, fast, temperature):
    engine = Engine(model, tokenizer, fast=fast)
    params = SamplingParams(temperature=temperature, top_p=0.95, max_new_tokens=12, seed=4)
    reused = run_episodes(engine, prompts, params, tools(4), **RUN, reuse_cache=True)
    again = run_episodes(engine, prompts, params, tools(4), **RUN, reuse_cache=False)
    assert sum(e.num_tool_calls for e in reused) >= 4
    for a, b in zip(reused, again, strict=True):
        assert (a.tokens, a.loss_mask, a.finish_reason, a.turns) == (
            b.tokens,
            b.loss_mask,
            b.finish_reason,
            b.turns,
        )
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= 1e-4


@SESSIONS
def test_tool_turn_logprobs_equal_recompute_on_the_concatenated_sequence(model, tokenizer, prompts, fast):
    engine = Engine(model, tokenizer, fast=fast)
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_new_tokens=12, seed=9)
    eps = run_episodes(engine, prompts, params, tools(4), **RUN, reuse_cache=True)
    assert all(0 in e.loss_mask for e in eps)  # every row got at least one reply
    with torch.no_grad():
        logp, _, _ = completion_logprobs(model, prompts, [e.tokens for e in eps], 0.8, 50, 0.9)
    for i, e in enumerate(eps):
        model_tok = torch.tensor(e.loss_mask, dtype=torch.bool)
        assert float((logp[i, : len(e.tokens)] - torch.tensor(e.logprobs))[model_tok].abs().max()) <= 1e-4


def test_searchqa_episodes_on_the_cache_equal_re_prefilling_and_the_recompute():
    # The shipped tiny model searches on some searchqa prompts; the environment's own tool answers.
    from pnyx.envs import get_env
    from pnyx.models import render_prompt
    from pnyx.rollout.cohort import sample_env
    from pnyx.rollout.engines import make_engine

    env = get_env("searchqa")
    model, tokenizer = load_model("pnyx/assets/tiny-base"), load_tokenizer("pnyx/assets/tiny-base")
    tasks = [t for t in env.sample("train", 0, 8) for _ in range(4)]
    prompts = [list(render_prompt(tokenizer, t.prompt)) for t in tasks]
    params = SamplingParams(temperature=1.0, max_new_tokens=48, stop=list(env.stop_strings), seed=1)
    engine = make_engine("torch", None, tokenizer, model=model)
    assert engine.decoder() is not None  # the torch engine's tool turns continue on its decode loop's cache
    reused = sample_env(engine, env, prompts, tasks, params)
    tools = [lambda text, task=task: env.respond(task, text) for task in tasks]
    again = run_episodes(
        Engine(model, tokenizer), prompts, params, tools, list(env.tool_stops), int(env.max_turns),
        reuse_cache=False,
    )  # fmt: skip
    assert sum(e.num_tool_calls > 0 and 0 in e.loss_mask for e in reused) >= 2
    assert [e.tokens for e in reused] == [e.tokens for e in again]
    with torch.no_grad():
        logp, _, _ = completion_logprobs(model, prompts, [e.tokens for e in reused])
    for i, e in enumerate(reused):
        model_tok = torch.tensor(e.loss_mask, dtype=torch.bool)
        assert float((logp[i, : len(e.tokens)] - torch.tensor(e.logprobs))[model_tok].abs().max()) <= 1e-4
