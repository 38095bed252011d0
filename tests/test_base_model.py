"""The shipped tiny base model: loads offline, is small, documented, tokenizes as promised, starts weak.

Its skills are measured here, not read back from the committed `evaluation.json`: a small sample of the
same held-out tasks is re-evaluated through the one evaluation path (`evaluate_model`, the torch engine,
the prompts as the environments render them today). Bands are wide enough not to be flaky at a fixed
seed, yet fail for an untrained model (pass@1 ~0), a fully trained one (pass@1 ~1), a model that does not
follow the system prompt's format, or a committed card that no longer matches the weights.
"""

from __future__ import annotations

import json

import pytest

from pnyx.envs import get_env
from pnyx.eval.runner import evaluate_model
from pnyx.models import tiny
from pnyx.rollout.engines import make_engine

MODEL_DIR = tiny.default_model_path()
MAX_BYTES = 10 * 1024 * 1024
EVAL_SEED = 1000  # the build's final evaluation: test split, stream seed 1000 + build seed 0


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


def test_model_loads_offline_as_a_small_causal_lm(model):
    params = sum(p.numel() for p in model.parameters())
    assert 100_000 < params < 5_000_000
    assert model.config.tie_word_embeddings


def test_chat_template_renders_system_and_user_turns_and_generation_prompt(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Compute 1+2."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|system|>Be brief.<|user|>Compute 1+2.<|assistant|>"


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


@pytest.fixture(scope="module")
def arith_report(model, tokenizer):
    env = get_env("arith")
    engine = make_engine("torch", None, tokenizer, model=model)
    return evaluate_model(engine, env, env.sample("test", EVAL_SEED, 64), samples=4, ks=(4,), seed=EVAL_SEED)


@pytest.fixture(scope="module")
def searchqa_report(model, tokenizer):
    env = get_env("searchqa")
    engine = make_engine("torch", None, tokenizer, model=model)
    return evaluate_model(engine, env, env.sample("test", EVAL_SEED, 48), samples=4, seed=EVAL_SEED)


def test_arith_with_todays_prompts_is_partial_at_pass_1_and_high_at_pass_4(arith_report):
    assert 0.1 <= arith_report.pass_at_1 <= 0.45, f"pass@1={arith_report.pass_at_1:.3f}"
    assert arith_report.pass_at_k[4] >= arith_report.pass_at_1 + 0.2, arith_report.pass_at_k
    assert arith_report.format_rate >= 0.8  # it follows the format the system prompt asks for


def test_searchqa_search_rate_is_partial_and_searching_answers_right_more_often(searchqa_report):
    r = searchqa_report
    assert 0.05 <= r.search_rate <= 0.6, f"search_rate={r.search_rate:.3f}"
    assert r.correct_when_searched is not None and r.correct_without_search is not None
    assert r.correct_when_searched >= 0.3 > r.correct_without_search


def test_committed_model_card_figures_match_a_fresh_evaluation(arith_report, searchqa_report):
    """The card's numbers come from these weights: a re-evaluation on the first tasks of the same held-out
    stream lands near them (a stale card, or weights swapped without re-measuring, fails here)."""
    card = (MODEL_DIR / "README.md").read_text()
    evaluation = json.loads((MODEL_DIR / "evaluation.json").read_text())
    assert "make_base_model.py" in card and str(evaluation["arith"]["pass@1"]) in card
    for fresh, name in ((arith_report, "arith"), (searchqa_report, "searchqa")):
        committed = evaluation[name]
        assert abs(fresh.pass_at_1 - committed["pass@1"]) <= 0.1, (name, fresh.pass_at_1, committed["pass@1"])
        assert abs(fresh.format_rate - committed["format_rate"]) <= 0.1, name
        assert committed["max_new_tokens"] == fresh.max_new_tokens, name
    assert abs(searchqa_report.search_rate - evaluation["searchqa"]["search_rate"]) <= 0.12
