"""The multi-turn tool loop: tool tokens masked, logprobs reproducible, failing tools contained."""

from __future__ import annotations

import pytest
import torch

from pnyx.models import completion_logprobs, load_model, load_tokenizer
from pnyx.rollout.engine import Engine
from pnyx.rollout.episodes import run_episodes
from pnyx.rollout.sampling import SamplingParams

torch.set_num_threads(1)

REPLY = " <information>Paris</information> "


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> Engine:
    return Engine(load_model(tiny_model_dir), load_tokenizer(tiny_model_dir))


@pytest.fixture(scope="module")
def prompt(engine) -> list[int]:
    return engine.tokenizer.encode(
        "<search>capital of France</search> The answer is", add_special_tokens=False
    )


def tool_stop_for(engine: Engine, prompt: list[int], params: SamplingParams) -> str:
    """A two-character string the model emits early under `params`, used as the tool-call stop."""
    free = engine.generate([prompt], params)[0]
    text = engine.tokenizer.decode(free.tokens[:12])
    for a in range(len(text) - 1):
        stop = text[a : a + 2]
        if stop.isprintable() and stop.strip() == stop and "\ufffd" not in stop:
            return stop
    raise AssertionError(f"no usable stop string in {text!r}")


def replay_error(engine: Engine, prompt: list[int], ep, params: SamplingParams) -> float:
    """Largest |recorded - recomputed| over the episode's model tokens (loss_mask 1)."""
    with torch.no_grad():
        logp, _, _ = completion_logprobs(
            engine.model, [prompt], [ep.tokens], params.temperature, params.top_k, params.top_p
        )
    model_tok = torch.tensor(ep.loss_mask, dtype=torch.bool)
    recorded = torch.tensor(ep.logprobs)
    return float((logp[0] - recorded).abs()[model_tok].max())


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_episode_logprobs_equal_recompute_with_tool_tokens_masked(engine, prompt, temperature):
    params = SamplingParams(temperature=temperature, max_new_tokens=24, seed=4)
    stop = tool_stop_for(engine, prompt, params)
    ep = run_episodes(engine, [prompt], params, lambda text: REPLY, [stop], max_turns=3)[0]
    assert ep.num_tool_calls >= 1
    assert 0 in ep.loss_mask and 1 in ep.loss_mask
    assert replay_error(engine, prompt, ep, params) <= 1e-4


def test_tool_reply_tokens_have_mask_zero_and_logprob_zero(engine, prompt):
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    stop = tool_stop_for(engine, prompt, params)
    ep = run_episodes(engine, [prompt], params, lambda text: REPLY, [stop], max_turns=2)[0]
    reply_ids = engine.tokenizer.encode(REPLY, add_special_tokens=False)
    start = ep.loss_mask.index(0)
    assert ep.tokens[start : start + len(reply_ids)] == reply_ids
    assert ep.loss_mask[start : start + len(reply_ids)] == [0] * len(reply_ids)
    assert ep.logprobs[start : start + len(reply_ids)] == [0.0] * len(reply_ids)


def test_tool_receives_the_completion_text_ending_with_the_call(engine, prompt):
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    stop = tool_stop_for(engine, prompt, params)
    seen: list[str] = []
    run_episodes(engine, [prompt], params, lambda text: seen.append(text) or None, [stop], max_turns=2)
    assert len(seen) == 1 and stop in seen[0][-len(stop) - 4 :]


def test_tool_call_with_no_turn_left_ends_with_turn_limit(engine, prompt):
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    stop = tool_stop_for(engine, prompt, params)
    ep = run_episodes(engine, [prompt], params, lambda text: REPLY, [stop], max_turns=1)[0]
    assert (ep.finish_reason, ep.num_tool_calls) == ("turn_limit", 1)


def test_tool_that_raises_gives_tool_error_with_reason_and_spares_other_episodes(engine, prompt):
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    stop = tool_stop_for(engine, prompt, params)

    def boom(text: str) -> str:
        raise RuntimeError("index offline")

    other = engine.tokenizer.encode("hi", add_special_tokens=False)
    eps = run_episodes(engine, [prompt, other], params, [boom, lambda t: REPLY], [stop], max_turns=2)
    assert eps[0].finish_reason == "tool_error"
    assert "RuntimeError" in eps[0].error and "index offline" in eps[0].error
    assert eps[1].finish_reason != "tool_error"


@pytest.mark.parametrize(
    "garbage, reason",
    [(12345, "returned int"), (b"bytes", "returned bytes"), ("x " * 100_000, "exceeds max_tool_tokens")],
    ids=["int", "bytes", "huge"],
)
def test_tool_returning_garbage_gives_tool_error_with_reason(engine, prompt, garbage, reason):
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    stop = tool_stop_for(engine, prompt, params)
    ep = run_episodes(engine, [prompt], params, lambda text: garbage, [stop], max_turns=3)[0]
    assert ep.finish_reason == "tool_error" and reason in ep.error
    assert all(m == 1 for m in ep.loss_mask)  # nothing of the garbage was appended


def test_tool_answering_none_ends_the_episode(engine, prompt):
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    stop = tool_stop_for(engine, prompt, params)
    ep = run_episodes(engine, [prompt], params, lambda text: None, [stop], max_turns=3)[0]
    assert (ep.finish_reason, ep.num_tool_calls, ep.error) == ("stop", 1, None)


def test_episode_tokens_never_exceed_the_cap(engine, prompt):
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    stop = tool_stop_for(engine, prompt, params)
    ep = run_episodes(
        engine, [prompt], params, lambda text: REPLY, [stop], max_turns=50, max_episode_tokens=40
    )[0]
    assert len(ep.tokens) <= 40 and ep.finish_reason == "length"
