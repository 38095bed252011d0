"""The generation engine: recorded logprobs equal the trainer's recompute, seeding, padding, stop strings."""

from __future__ import annotations

import pytest
import torch
from engine_support import logprob_gaps

from pnyx.models import completion_logprobs, load_model, load_tokenizer
from pnyx.rollout.engine import Engine
from pnyx.rollout.sampling import SamplingParams

torch.set_num_threads(1)

PROMPTS = ["What is 12 + 7?", "hi", "<search>capital of France</search> The answer is", "Use 2, 3, 7, 9"]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    assert len({len(p) for p in ids}) > 1  # ragged on purpose
    return ids


def max_logprob_error(model, prompts, completions, params: SamplingParams) -> float:
    """Largest |recorded - recomputed| over real completion tokens."""
    return float(logprob_gaps(model, prompts, completions, params).max())


@pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "hf-forward"])
def test_sampled_logprobs_equal_trainer_recompute_on_ragged_prompts(model, tokenizer, prompts, fast):
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=3)
    completions = Engine(model, tokenizer, fast=fast).generate(prompts, params)
    assert max_logprob_error(model, prompts, completions, params) <= 1e-4


@pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "hf-forward"])
def test_truncated_sampling_logprobs_equal_recompute_with_same_truncation(model, tokenizer, prompts, fast):
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, max_new_tokens=24, seed=5)
    completions = Engine(model, tokenizer, fast=fast).generate(prompts, params)
    assert max_logprob_error(model, prompts, completions, params) <= 1e-4


def test_truncated_logprobs_differ_from_untruncated_recompute(model, tokenizer, prompts):
    # Guards the check above: if truncation were ignored on either side, recorded would equal this.
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.5, max_new_tokens=16, seed=5)
    completions = Engine(model, tokenizer).generate(prompts, params)
    plain = SamplingParams(temperature=0.7, max_new_tokens=16)
    assert max_logprob_error(model, prompts, completions, plain) > 1e-2


def test_greedy_records_temperature_one_logprob_reproduced_at_temperature_zero(model, tokenizer, prompts):
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    completions = Engine(model, tokenizer).generate(prompts, params)
    assert max_logprob_error(model, prompts, completions, params) <= 1e-4


def test_greedy_tokens_equal_transformers_generate_on_ragged_batch(model, tokenizer, prompts):
    completions = Engine(model, tokenizer).generate(
        prompts, SamplingParams(temperature=0.0, max_new_tokens=16)
    )
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        ref = model.generate(
            ids,
            attention_mask=attn,
            do_sample=False,
            max_new_tokens=16,
            min_new_tokens=16,
            pad_token_id=tokenizer.pad_token_id,
        )
    for i, c in enumerate(completions):
        assert c.tokens == ref[i, width : width + len(c.tokens)].tolist()


def test_completion_of_a_prompt_does_not_depend_on_padding_in_its_batch(model, tokenizer, prompts):
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    engine = Engine(model, tokenizer)
    alone = engine.generate([prompts[1]], params)[0]
    batched = engine.generate(prompts, params)[1]
    assert alone.tokens == batched.tokens


def test_same_seed_gives_same_tokens(model, tokenizer, prompts):
    engine = Engine(model, tokenizer)
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=24, seed=11)
    a = engine.generate(prompts, params)
    b = engine.generate(prompts, params)
    assert [c.tokens for c in a] == [c.tokens for c in b]


def test_different_seed_gives_different_tokens(model, tokenizer, prompts):
    engine = Engine(model, tokenizer)
    a = engine.generate(prompts, SamplingParams(max_new_tokens=24, seed=1))
    b = engine.generate(prompts, SamplingParams(max_new_tokens=24, seed=2))
    assert [c.tokens for c in a] != [c.tokens for c in b]


def spanning_stop(tokenizer, tokens: list[int]) -> tuple[str, int]:
    """A stop string made of the last char of one token and the first of the next, and the index of the
    token that first completes it."""
    for j in range(1, len(tokens)):
        left = tokenizer.decode(tokens[j - 1 : j])
        right = tokenizer.decode(tokens[j : j + 1])
        if not left or not right or "\ufffd" in left + right:
            continue
        stop = left[-1] + right[0]
        if stop.strip() != stop or not stop.isprintable():
            continue
        for k in range(1, len(tokens) + 1):  # first token whose prefix text contains the stop
            if stop in tokenizer.decode(tokens[:k]):
                if k - 1 == j:
                    return stop, j
                break
    raise AssertionError("no two-token stop string found in this completion")


def test_stop_string_spanning_two_tokens_ends_at_the_completing_token(model, tokenizer, prompts):
    engine = Engine(model, tokenizer)
    free = engine.generate([prompts[0]], SamplingParams(temperature=0.0, max_new_tokens=32))[0]
    stop, j = spanning_stop(tokenizer, free.tokens)
    params = SamplingParams(temperature=0.0, max_new_tokens=32, stop=[stop])
    stopped = engine.generate([prompts[0]], params)[0]
    assert stopped.tokens == free.tokens[: j + 1]
    assert (stopped.finish_reason, stopped.stop) == ("stop", stop)


def test_stopped_completions_keep_recompute_equal_logprobs(model, tokenizer, prompts):
    engine = Engine(model, tokenizer)
    free = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=32, seed=7))
    stop, _ = spanning_stop(tokenizer, free[0].tokens)
    params = SamplingParams(temperature=1.0, max_new_tokens=32, seed=7, stop=[stop])
    completions = engine.generate(prompts, params)
    assert completions[0].finish_reason == "stop"
    assert max_logprob_error(model, prompts, completions, params) <= 1e-4


def test_eos_token_ends_the_completion_and_is_kept(model, tokenizer, prompts):
    engine = Engine(model, tokenizer)
    free = engine.generate([prompts[2]], SamplingParams(temperature=0.0, max_new_tokens=16))[0]
    engine.eos_ids = [free.tokens[5]]  # pretend the 6th greedy token is EOS
    first = free.tokens.index(free.tokens[5])
    ended = engine.generate([prompts[2]], SamplingParams(temperature=0.0, max_new_tokens=16))[0]
    assert ended.tokens == free.tokens[: first + 1]
    assert ended.finish_reason == "stop" and ended.stop is None


def test_length_finish_when_no_stop(model, tokenizer, prompts):
    engine = Engine(model, tokenizer)
    engine.eos_ids = []
    out = engine.generate(prompts, SamplingParams(max_new_tokens=9))
    assert all(len(c.tokens) == 9 and c.finish_reason == "length" for c in out)


def test_finished_rows_leave_batch_without_changing_others(model, tokenizer, prompts):
    # Row 0 stops early (compaction happens); rows 1-3 must decode exactly as without the stop.
    engine = Engine(model, tokenizer)
    free = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=24))
    stop, j = spanning_stop(tokenizer, free[0].tokens)
    rest = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=24, stop=[stop]))
    assert rest[0].tokens == free[0].tokens[: j + 1]
    for i in range(1, len(prompts)):
        if stop not in tokenizer.decode(free[i].tokens):
            assert rest[i].tokens == free[i].tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_sampled_logprobs_equal_recompute(tiny_model_dir, tokenizer, prompts):
    model = load_model(tiny_model_dir, device="cuda")
    params = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=24, seed=3)
    completions = Engine(model, tokenizer).generate(prompts, params)
    assert max_logprob_error(model, prompts, completions, params) <= 1e-4


def test_weights_loaded_in_place_after_fusing_are_used(tiny_model_dir, tokenizer, prompts, tmp_path):
    # The fast path stacks q/k/v and gate/up; a worker swapping weights with load_state_dict must see them.
    from pnyx_harness.models import make_tiny_model_dir

    model = load_model(tiny_model_dir)
    engine = Engine(model, tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    before = engine.generate(prompts, params)
    other = load_model(make_tiny_model_dir(tmp_path / "other", seed=1))
    model.load_state_dict(other.state_dict(), strict=True)
    after = engine.generate(prompts, params)
    expected = Engine(other, tokenizer, fast=False).generate(prompts, params)
    assert [c.tokens for c in after] == [c.tokens for c in expected] != [c.tokens for c in before]


def test_replaced_parameter_is_used_not_a_stale_fused_copy(tiny_model_dir, tokenizer, prompts):
    model = load_model(tiny_model_dir)
    engine = Engine(model, tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    engine.generate(prompts, params)  # fuses
    q = model.model.layers[0].self_attn.q_proj
    q.weight = torch.nn.Parameter(torch.randn_like(q.weight))
    fast = engine.generate(prompts, params)
    slow = Engine(model, tokenizer, fast=False).generate(prompts, params)
    assert [c.tokens for c in fast] == [c.tokens for c in slow]


@pytest.mark.parametrize("stop", ["é a", "</answer>", "🙂"], ids=["accent", "tag", "emoji"])
def test_stop_matcher_fires_first_at_the_token_completing_a_multibyte_stop(tokenizer, stop):
    from pnyx.models.tokenizer import StopMatcher

    tokens = tokenizer.encode("un café au lait <answer>7</answer> 🙂 fin", add_special_tokens=False)
    first = next(k for k in range(1, len(tokens) + 1) if stop in tokenizer.decode(tokens[:k]))
    matcher = StopMatcher(tokenizer, [stop])
    fired = [k for k in range(1, len(tokens) + 1) if matcher.match(tokens[:k]) == stop]
    assert fired[0] == first


def test_model_used_by_engine_can_still_be_trained(tiny_model_dir, tokenizer, prompts):
    # The fast path restacks parameters inside inference mode; they must stay usable by autograd.
    model = load_model(tiny_model_dir)
    completions = Engine(model, tokenizer).generate(prompts, SamplingParams(max_new_tokens=8))
    logp, mask, _ = completion_logprobs(model, prompts, [c.tokens for c in completions])
    logp[mask].sum().backward()
    grad = model.model.layers[0].self_attn.q_proj.weight.grad
    assert grad is not None and grad.abs().sum() > 0
