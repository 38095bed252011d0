"""Model and tokenizer loading (offline), prompt rendering, tokenizer digest, trainer-side logprobs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from pnyx.errors import ConfigError, ModelNotFoundError
from pnyx.models import (
    completion_logprobs,
    load_model,
    load_tokenizer,
    model_from_config,
    render_prompt,
    resolve_device,
    sampling_logprobs,
    tokenizer_digest,
)

torch.set_num_threads(1)

ASSET = Path(__file__).resolve().parent.parent / "pnyx" / "assets" / "tiny-base"


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def test_hub_name_missing_offline_fails_with_how_to_fetch(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE.*hf download Qwen/Qwen2.5-0.5B-Instruct"):
        load_model("Qwen/Qwen2.5-0.5B-Instruct")


def test_tokenizer_for_missing_folder_fails_with_model_not_found(tmp_path):
    with pytest.raises(ModelNotFoundError):
        load_tokenizer(tmp_path / "nope")


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_model_loads_in_requested_dtype_in_eval_mode(tiny_model_dir):
    m = load_model(tiny_model_dir, dtype="bfloat16")
    assert next(m.parameters()).dtype == torch.bfloat16 and not m.training


def test_unavailable_device_is_a_config_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ConfigError, match="CUDA is not available"):
        resolve_device("cuda")


def test_model_from_config_is_seeded():
    cfg = {
        "model_type": "qwen2",
        "vocab_size": 64,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    }
    a, b, c = model_from_config(cfg, seed=1), model_from_config(cfg, seed=1), model_from_config(cfg, seed=2)
    wa, wb, wc = (m.model.embed_tokens.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_make_tiny_model_dir_is_deterministic(tiny_model_dir, tmp_path):
    from pnyx_harness.models import make_tiny_model_dir

    again = make_tiny_model_dir(tmp_path / "again")
    assert (again / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()
    assert tokenizer_digest(again) == tokenizer_digest(tiny_model_dir)


def test_render_string_prompt_encodes_as_is(tokenizer):
    assert render_prompt(tokenizer, "What is 2+2?") == tokenizer.encode(
        "What is 2+2?", add_special_tokens=False
    )


def test_render_messages_uses_chat_template_with_generation_prompt(tokenizer):
    ids = render_prompt(tokenizer, [{"role": "user", "content": "hi"}])
    assert tokenizer.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_render_messages_without_template_joins_contents(tokenizer):
    plain = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    plain.chat_template = None
    ids = render_prompt(plain, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert plain.decode(ids) == "be brief\nhi"


def test_tokenizer_digest_changes_when_a_tokenizer_file_changes(tiny_model_dir, tmp_path):
    copy = tmp_path / "tok"
    shutil.copytree(tiny_model_dir, copy)
    before = tokenizer_digest(copy)
    (copy / "chat_template.jinja").write_text("{{ messages }}")
    assert tokenizer_digest(copy) != before


def test_top_k_keeps_exactly_k_tokens():
    logits = torch.randn(3, 50)
    logp = sampling_logprobs(logits, temperature=1.0, top_k=7)
    assert (torch.isfinite(logp).sum(-1) == 7).all()


def test_top_p_keeps_smallest_set_reaching_the_mass():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(sampling_logprobs(logits, temperature=1.0, top_p=0.8))
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 < 0.8 <= 0.5 + 0.3


def test_chunked_logprobs_equal_unchunked(model):
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]
    completions = [[20, 21], [22, 23, 24, 25], [26]]
    with torch.no_grad():
        whole, mask, ent = completion_logprobs(model, prompts, completions, with_entropy=True)
        parts, mask2, ent2 = completion_logprobs(model, prompts, completions, with_entropy=True, max_tokens=6)
    assert torch.equal(mask, mask2)
    assert torch.allclose(whole, parts, atol=1e-5) and torch.allclose(ent, ent2, atol=1e-5)
    assert (whole[~mask] == 0).all()


def test_logprobs_equal_full_forward_log_softmax(model):
    prompt, completion = [5, 6, 7], [20, 21, 22]
    with torch.no_grad():
        logp, _, _ = completion_logprobs(model, [prompt], [completion], temperature=0.5)
        full = model(torch.tensor([prompt + completion])).logits[0].float() / 0.5
    ref = torch.log_softmax(full, -1)[2:5].gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
    assert torch.allclose(logp[0], ref, atol=1e-5)


def test_logprobs_are_differentiable(model):
    logp, mask, _ = completion_logprobs(model, [[5, 6]], [[7, 8, 9]])
    logp[mask].sum().backward()
    grad = model.model.embed_tokens.weight.grad
    assert grad is not None and grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)


def test_shipped_tiny_base_model_loads_offline(monkeypatch):
    if not (ASSET / "config.json").is_file():
        pytest.skip(f"{ASSET} does not exist yet (the base-model engineer ships it)")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tok = load_model(ASSET), load_tokenizer(ASSET)
    ids = render_prompt(tok, "1 + 1 =")
    with torch.no_grad():
        logp, mask, _ = completion_logprobs(model, [ids], [ids[:2]])
    assert mask.all() and torch.isfinite(logp).all()
