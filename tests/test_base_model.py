"""The shipped tiny base model: loads offline, is small, documented, tokenizes as promised, starts weak.

The sampled evaluation uses a fixed seed and a band wide enough (0.1-0.55) that the test is not flaky,
yet fails for an untrained model (pass@1 ~0) or a fully trained one (pass@1 ~1).
"""

from __future__ import annotations

import json

import pytest

from pnyx.models import tiny

MODEL_DIR = tiny.default_model_path()
MAX_BYTES = 10 * 1024 * 1024


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)


@pytest.fixture(scope="module")
def model():
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    m = AutoModelForCausalLM.from_pretrained(MODEL_DIR, local_files_only=True, dtype=torch.float32)
    return m.eval()


def test_model_folder_is_at_most_10_mb():
    total = sum(f.stat().st_size for f in MODEL_DIR.rglob("*") if f.is_file())
    assert 0 < total <= MAX_BYTES, f"{MODEL_DIR} is {total / 1e6:.1f} MB"


def test_model_card_and_evaluation_are_shipped():
    card = (MODEL_DIR / "README.md").read_text()
    evaluation = json.loads((MODEL_DIR / "evaluation.json").read_text())
    assert "make_base_model.py" in card and "pass@1" in card
    assert 0.2 <= evaluation["arith"]["pass@1"] <= 0.4
    assert evaluation["arith"]["pass@8"] > evaluation["arith"]["pass@1"]


def test_model_loads_offline_as_a_small_causal_lm(model):
    params = sum(p.numel() for p in model.parameters())
    assert 100_000 < params < 5_000_000
    assert model.config.tie_word_embeddings


def test_chat_template_renders_user_turn_and_generation_prompt(tokenizer):
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Compute 1+2."}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|user|>Compute 1+2.<|assistant|>"


def test_special_tokens_and_tags_are_single_tokens(tokenizer):
    for token in [*tiny.SPECIAL_TOKENS, *tiny.TAG_TOKENS]:
        ids = tokenizer.encode(token, add_special_tokens=False)
        assert len(ids) == 1, f"{token!r} encodes to {ids}"
    assert tokenizer.eos_token == tiny.EOS_TOKEN


def test_tags_survive_decoding_without_special_tokens(tokenizer):
    ids = tokenizer.encode("<search>Zorvan Keel</search><answer>85</answer>", add_special_tokens=False)
    ids.append(tokenizer.eos_token_id)
    assert (
        tokenizer.decode(ids, skip_special_tokens=True) == "<search>Zorvan Keel</search><answer>85</answer>"
    )


def test_digits_are_one_token_each(tokenizer):
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode("Compute 1234+98.", add_special_tokens=False))
    digits = [t for t in tokens if any(c.isdigit() for c in t)]
    assert digits == ["1", "2", "3", "4", "9", "8"]


def test_sampled_arith_pass_at_1_is_partial(model, tokenizer):
    from pnyx.envs import get_env

    env = get_env("arith")
    tasks = env.sample("test", 12345, 64)
    result = tiny.evaluate(model, tokenizer, env, tasks, n=4, ks=(4,), seed=0)
    assert 0.1 <= result.pass_at_1 <= 0.55, f"pass@1={result.pass_at_1:.3f}"
    assert result.pass_at_k[4] > result.pass_at_1


def test_pass_at_k_estimator_matches_closed_forms():
    assert tiny.pass_at_k(8, 0, 1) == 0.0
    assert tiny.pass_at_k(8, 8, 8) == 1.0
    assert tiny.pass_at_k(8, 2, 1) == pytest.approx(0.25)
    assert tiny.pass_at_k(8, 1, 8) == 1.0
    assert tiny.pass_at_k(4, 1, 2) == pytest.approx(0.5)


def test_evaluation_shows_partial_searchqa_skill():
    """Searching is mostly right, not searching mostly wrong, and the search rate is partial."""
    sq = json.loads((MODEL_DIR / "evaluation.json").read_text())["searchqa"]
    assert 0.15 <= sq["search_rate"] <= 0.4
    assert sq["correct_when_searched"] >= 0.5
    assert sq["correct_without_search"] < 0.2


def test_sampled_searchqa_answers_right_more_often_when_it_searches(model, tokenizer):
    from pnyx.envs import get_env

    env = get_env("searchqa")
    tasks = env.sample("test", 12345, 48)
    result = tiny.evaluate(model, tokenizer, env, tasks, n=4, ks=(4,), seed=0)
    assert 0.05 <= result.search_rate <= 0.6, f"search_rate={result.search_rate:.3f}"
    assert result.correct_when_searched is not None and result.correct_without_search is not None
    assert result.correct_when_searched >= 0.3 > result.correct_without_search
