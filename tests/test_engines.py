"""Engine selection, the MLX sampling distribution, change detection and the int8 plane on MLX.

The shared contract every engine passes is in test_engine_contract.py; these are the parts specific to
choosing an engine and to the MLX engine's own arithmetic.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from pnyx.errors import ConfigError, IntegrityError
from pnyx.models import load_model, load_tokenizer, render_prompt, sampling_logprobs
from pnyx.rollout.engines import check_engine, make_engine
from pnyx.rollout.engines.base import changed_names, prove
from pnyx.rollout.sampling import SamplingParams
from pnyx.store import open_store
from pnyx.weights import Publisher, Syncer
from pnyx.weights.bits import TensorBits
from pnyx.weights.manifest import read_manifest

TINY = Path(__file__).resolve().parents[1] / "pnyx" / "assets" / "tiny-base"
needs_mlx = pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None, reason="needs pnyx[mlx]")


def test_unknown_engine_is_a_config_error_naming_the_choices():
    with pytest.raises(ConfigError, match="torch, mlx, vllm"):
        check_engine("tensorrt")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_missing_vllm_says_what_to_install():
    with pytest.raises(ConfigError, match=r"vllm is not installed: pip install 'pnyx\[vllm\]'"):
        make_engine("vllm", str(TINY), None)


def test_changed_names_are_the_arrays_that_are_not_the_same_objects():
    import weakref

    a, b = np.zeros(3, np.uint16), np.ones(3, np.uint16)
    old = {"a": TensorBits("bfloat16", a), "b": TensorBits("bfloat16", b)}
    new = {"a": old["a"], "b": TensorBits("bfloat16", b.copy()), "c": TensorBits("bfloat16", a)}
    refs = {n: weakref.ref(tb.data) for n, tb in old.items()}
    assert changed_names(refs, new) == ["b", "c"]
    assert changed_names(None, new) == ["a", "b", "c"]


def test_torch_engine_updates_the_same_parameter_storage():
    tok = load_tokenizer(TINY)
    eng = make_engine("torch", str(TINY), tok)
    store = open_store("memory://engines-inplace")
    model = load_model(TINY)
    Publisher(store).publish(0, {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    syn = Syncer(store)
    syn.sync()
    ptrs = {n: p.data_ptr() for n, p in eng.model.named_parameters()}
    eng.update(0, syn.state, read_manifest(store, 0).weights)
    assert {n: p.data_ptr() for n, p in eng.model.named_parameters()} == ptrs


@needs_mlx
@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.8), (0.9, 7, 0.6), (1.3, 1, 0.3)],
)
def test_mlx_sampling_distribution_equals_pnyx_definition(temperature, top_k, top_p):
    import mlx.core as mx

    from pnyx.rollout.engines.mlx_decode import sampling_logprobs_mx

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    if top_p == 1.0:  # ties at the top: top-k keeps every tied value. (Exact ties straddling a top-p
        logits[0, :4] = logits[0].max() + 1  # boundary are broken by sort order, which differs by framework.)
    want = sampling_logprobs(logits, temperature, top_k, top_p).numpy()
    got = np.array(sampling_logprobs_mx(mx.array(logits.numpy()), temperature, top_k, top_p))
    assert np.array_equal(np.isinf(got), np.isinf(want))
    finite = np.isfinite(want)
    assert np.abs(got[finite] - want[finite]).max() <= 1e-5


@needs_mlx
def test_mlx_sampler_never_draws_a_truncated_token():
    import mlx.core as mx

    from pnyx.rollout.engines.mlx_decode import draw

    logits = mx.array(np.random.default_rng(0).standard_normal((256, 40)).astype(np.float32))
    params = SamplingParams(temperature=1.0, top_k=3, top_p=0.9)
    allowed = np.isfinite(sampling_logprobs(torch.tensor(np.array(logits)), 1.0, 3, 0.9).numpy())
    key = mx.random.key(0)
    for _ in range(5):
        key, sub = mx.random.split(key)
        tok, lp = draw(logits, params, sub)
        assert allowed[np.arange(256), np.array(tok)].all() and np.isfinite(np.array(lp)).all()


@needs_mlx
def test_mlx_runs_from_the_int8_plane_with_its_codes_read_back_in_the_proof():
    tok = load_tokenizer(TINY)
    model = load_model(TINY)
    store = open_store("memory://engines-int8")
    Publisher(store, int8_plane=True).publish(
        0, {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    )
    syn = Syncer(store, plane="int8")
    syn.sync()
    plane = read_manifest(store, 0).int8
    eng = make_engine("mlx", str(TINY), tok, plane="int8")
    proof = eng.update(0, syn.state, plane)
    assert (proof.kind, proof.chain_digest) == ("hashed", plane.chain_digest)
    # the model computes with the codes: quantized layers, and generation from them
    from mlx import nn

    assert isinstance(eng.model.model.layers[0].mlp.up_proj, nn.QuantizedLinear)
    prompt = list(render_prompt(tok, [{"role": "user", "content": "What is 3+4?"}]))
    (c,) = eng.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=12))
    assert c.tokens and all(np.isfinite(c.logprobs))
    # one code flipped inside the engine's packed weights is caught when its arrays are hashed back
    import mlx.core as mx

    layer = eng.model.model.layers[0].mlp.up_proj
    w = np.array(layer.weight)
    w[0, 0] ^= 1
    layer.weight = mx.array(w)
    with pytest.raises(IntegrityError, match="not the published ones"):
        prove(0, eng._digests(syn.state, []), plane, "hashed")
