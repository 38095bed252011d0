"""The fast path's float16 weight copies (CPU, fp32 model): used only for float16-exact weights, logprobs
still equal the trainer's fp32 recompute, and weights written in place are re-packed before the next batch."""

from __future__ import annotations

import pytest
import torch
from engine_support import logprob_gaps

from pnyx.errors import ConfigError
from pnyx.models import load_model, load_tokenizer
from pnyx.rollout.decoder import FastSession, half_weights_available
from pnyx.rollout.engine import Engine
from pnyx.rollout.sampling import SamplingParams

torch.set_num_threads(1)

PROMPTS = ["What is 12 + 7?", "hi", "<search>capital of France</search> The answer is", "Use 2, 3, 7, 9"]

pytestmark = pytest.mark.skipif(
    "fbgemm" not in torch.backends.quantized.supported_engines, reason="needs fbgemm's fp16 GEMM"
)


def bf16_round(model) -> None:
    """Round every weight to its bf16 value in place, as applying a published (bf16) version does."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


@pytest.fixture
def model(tiny_model_dir):
    m = load_model(tiny_model_dir)
    bf16_round(m)
    return m


def gap_mean_max(model, prompts, completions, params: SamplingParams) -> tuple[float, float]:
    """(mean, max) |recorded - recomputed| over real completion tokens, the recompute in plain fp32."""
    gap = logprob_gaps(model, prompts, completions, params)
    return float(gap.mean()), float(gap.max())


def test_half_copies_serve_bf16_weights_and_not_generic_fp32_ones(tiny_model_dir, model):
    assert half_weights_available(model)
    session = FastSession(model, 8, half_weights=True)
    assert session.head_packed is not None
    assert all(p is not None for layer in session.packed for p in layer)
    fp32 = load_model(tiny_model_dir)  # random fp32 weights: float16 would round them
    session = FastSession(fp32, 8, half_weights=True)
    assert session.head_packed is None
    assert all(p is None for layer in session.packed for p in layer)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_new_tokens=24, seed=3),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=24, seed=4),
        SamplingParams(temperature=0.0, max_new_tokens=24),
    ],
    ids=["t1", "truncated", "greedy"],
)
def test_half_copies_keep_logprobs_equal_to_the_fp32_recompute(model, tokenizer, prompts, params):
    completions = Engine(model, tokenizer, half_weights=True).generate(prompts, params)
    mean, largest = gap_mean_max(model, prompts, completions, params)
    assert mean <= 1e-5 and largest <= 1e-4  # the engine contract allows 1e-4 / 1e-3
    if params.temperature == 0:
        plain = Engine(model, tokenizer, half_weights=False).generate(prompts, params)
        assert [c.tokens for c in completions] == [c.tokens for c in plain]


def test_weights_written_in_place_are_repacked(tiny_model_dir, model, tokenizer, prompts, tmp_path):
    # A worker's update copies each published tensor into the parameters; the next batch must use them.
    from pnyx_harness.models import make_tiny_model_dir

    engine = Engine(model, tokenizer, half_weights=True)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    before = engine.generate(prompts, params)
    other = load_model(make_tiny_model_dir(tmp_path / "other", seed=1))
    bf16_round(other)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(other.get_parameter(name))
    after = engine.generate(prompts, params)
    expected = Engine(other, tokenizer, fast=False).generate(prompts, params)
    assert [c.tokens for c in after] == [c.tokens for c in expected] != [c.tokens for c in before]


def test_forcing_half_copies_on_a_bf16_model_is_refused(tiny_model_dir, tokenizer, prompts):
    model = load_model(tiny_model_dir, dtype="bfloat16")
    with pytest.raises(ConfigError, match="fp32 model on the CPU"):
        Engine(model, tokenizer, half_weights=True).generate(prompts, SamplingParams(max_new_tokens=2))


def test_by_default_copies_are_packed_in_the_background_and_never_serve_older_weights(
    tiny_model_dir, model, tokenizer, prompts, tmp_path
):
    # The default (half_weights=None): a session never waits for packing (fp32 until it is done), and a pack
    # of the weights before an update is never used after it.
    from pnyx.rollout import decoder
    from pnyx_harness.models import make_tiny_model_dir

    first = FastSession(model, 8)
    assert first.head_packed is None and all(p is None for layer in first.packed for p in layer)
    decoder._background().submit(
        lambda: None
    ).result()  # the packer works in order: everything before is done
    packed = FastSession(model, 8)
    assert packed.head_packed is not None and all(p is not None for layer in packed.packed for p in layer)

    engine = Engine(model, tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    other = load_model(make_tiny_model_dir(tmp_path / "other", seed=1))
    bf16_round(other)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(other.get_parameter(name))
    stale = FastSession(model, 8)  # the packs of the old weights are not served for the new ones
    assert stale.head_packed is None and all(p is None for layer in stale.packed for p in layer)
    expected = Engine(other, tokenizer, fast=False).generate(prompts, params)
    assert [c.tokens for c in engine.generate(prompts, params)] == [c.tokens for c in expected]
    decoder._background().submit(lambda: None).result()
    assert FastSession(model, 8).head_packed is not None
    assert [c.tokens for c in engine.generate(prompts, params)] == [c.tokens for c in expected]


def test_a_model_with_copies_packed_or_pending_can_still_be_deep_copied(model, tokenizer, prompts):
    # the trainer and the tests deepcopy models an engine has served (a pending pack holds a lock)
    import copy

    from pnyx.rollout import decoder

    Engine(model, tokenizer).generate(prompts, SamplingParams(max_new_tokens=4))  # schedules the packing
    copy.deepcopy(model)
    decoder._background().submit(lambda: None).result()
    Engine(model, tokenizer).generate(prompts, SamplingParams(max_new_tokens=4))  # packed copies in use
    twin = copy.deepcopy(model)
    assert FastSession(twin, 8, half_weights=True).head_packed is not None
