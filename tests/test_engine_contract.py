"""The engine contract: every worker engine (torch, mlx, vllm) passes the same tests on the shipped tiny model.

Each engine takes version 0 and then version 1 (a PULSE delta) in place and proves the chain digest; at
temperature 0 it gives the torch engine's tokens; sampled at temperature 1 and with top-k/top-p its behaviour
logprobs agree with the trainer's recompute (`completion_logprobs` on an fp32 copy of version 1), with the
mean and max |Δ| printed per engine; stop strings and the tool loop keep pnyx's semantics. Engines that are
not installed here are skipped (vllm runs in its own environment: scripts/test_vllm_cpu.sh, marker `vllm`).
PNYX_TEST_ENGINE_DEVICE=cuda runs the torch and vllm engines on a GPU (the references stay on the CPU).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from pnyx.errors import IntegrityError
from pnyx.models import completion_logprobs, load_model, load_tokenizer, render_prompt
from pnyx.rollout.engines import make_engine
from pnyx.rollout.sampling import SamplingParams
from pnyx.store import open_store
from pnyx.weights import Publisher, Syncer
from pnyx.weights.manifest import read_manifest

TINY = Path(__file__).resolve().parents[1] / "pnyx" / "assets" / "tiny-base"
NOISE = 0.02  # version 1 = version 0 + this much Gaussian noise per weight (tied tensors stay tied)
# Bounds on |recorded - recomputed| for an fp32 engine (measured ~1e-6; see docs/engine.md).
MEAN_BOUND, MAX_BOUND = 1e-4, 1e-3
DEVICE = os.environ.get("PNYX_TEST_ENGINE_DEVICE", "cpu")

ENGINES = [
    pytest.param("torch"),
    pytest.param(
        "mlx", marks=pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None, reason="needs pnyx[mlx]")
    ),
    pytest.param(
        "vllm",
        marks=[
            pytest.mark.vllm,
            pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm"),
        ],
    ),
]


class Published:
    """Versions 0 and 1 of the tiny model in a memory store, a syncer per version, and the fp32 references."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.tokenizer = load_tokenizer(TINY)
        model = load_model(TINY)
        self.store = open_store("memory://engine-contract")
        pub = Publisher(self.store)
        pub.publish(0, {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
        with torch.no_grad():
            for p in model.parameters():  # parameters() yields a tied tensor once: it stays tied
                p.add_(NOISE * torch.randn_like(p))
        pub.publish(1, {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
        self.syncers = {}
        self.refs = {}
        for v in (0, 1):
            s = Syncer(self.store)
            s.sync(v)
            self.syncers[v] = s
            ref = load_model(TINY)
            ref.load_state_dict(s.tensors)
            self.refs[v] = ref
        self.prompts = [
            list(render_prompt(self.tokenizer, [{"role": "user", "content": f"What is {a}+{b}?"}]))
            for a, b in [(1, 2), (13, 45), (7, 80), (99, 1), (5, 5), (62, 17)]
        ]

    def update(self, engine, version: int):
        s = self.syncers[version]
        return engine.update(version, s.state, read_manifest(self.store, version).weights)


@pytest.fixture(scope="module")
def published() -> Published:
    return Published()


@pytest.fixture(scope="module", params=ENGINES)
def engine(request, published):
    device = DEVICE if request.param != "mlx" else "cpu"
    eng = make_engine(request.param, str(TINY), published.tokenizer, dtype="float32", device=device)
    published.update(eng, 0)
    published.update(eng, 1)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def torch_engine(published):
    eng = make_engine("torch", str(TINY), published.tokenizer, dtype="float32", device=DEVICE)
    published.update(eng, 0)
    published.update(eng, 1)
    return eng


def gaps(published: Published, outs, params: SamplingParams) -> list[float]:
    lp, _, _ = completion_logprobs(
        published.refs[1], published.prompts, [o.tokens for o in outs],
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
    )  # fmt: skip
    lp = lp.detach()
    return [abs(x - float(lp[i, j])) for i, o in enumerate(outs) for j, x in enumerate(o.logprobs)]


def test_update_applies_a_delta_in_place_and_proves_the_chain_digest(engine, published):
    proof = engine.last_proof
    m1 = read_manifest(published.store, 1)
    assert (proof.version, proof.chain_digest, engine.digest) == (1, m1.digest, m1.digest)
    assert proof.state_digest == m1.weights.state_digest
    assert proof.tensors == len(m1.weights.tensors) and proof.changed >= 1


def test_update_back_to_an_older_version_proves_that_version(engine, published):
    try:
        assert published.update(engine, 0).chain_digest == read_manifest(published.store, 0).digest
    finally:
        published.update(engine, 1)


def test_an_update_that_does_not_land_fails_the_proof(engine, published, monkeypatch):
    if engine.proof_kind != "hashed":
        pytest.skip(f"{engine.name} proves by deriving digests from the bytes it loads (not read back)")
    real = engine._apply

    def drop_one(state, names, first):  # the engine "forgets" one changed tensor
        real(state, [n for n in names if n != "model.layers.0.mlp.up_proj.weight"], first)

    monkeypatch.setattr(engine, "_apply", drop_one)
    try:
        with pytest.raises(IntegrityError, match="not the published ones"):
            published.update(engine, 0)
        assert engine.version is None and engine.digest == ""
    finally:
        monkeypatch.undo()
        published.update(engine, 0)
        published.update(engine, 1)


def test_greedy_tokens_equal_the_torch_engine(engine, torch_engine, published):
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    got = [c.tokens for c in engine.generate(published.prompts, params)]
    want = [c.tokens for c in torch_engine.generate(published.prompts, params)]
    assert got == want


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_new_tokens=24),
        SamplingParams(temperature=1.0, max_new_tokens=24, seed=3),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=24, seed=5),
    ],
    ids=["greedy", "t1", "topk-topp"],
)
def test_behaviour_logprobs_equal_the_trainer_recompute(engine, published, params):
    outs = engine.generate(published.prompts, params)
    d = gaps(published, outs, params)
    mean, worst = sum(d) / len(d), max(d)
    print(f"\nlogprob gap engine={engine.name} {params.temperature=} {params.top_k=} {params.top_p=}: "
          f"mean={mean:.2e} max={worst:.2e} tokens={len(d)}")  # fmt: skip
    assert mean <= MEAN_BOUND and worst <= MAX_BOUND


def test_stop_string_ends_on_the_token_that_completes_it(engine, published):
    params = SamplingParams(temperature=0.0, max_new_tokens=32, stop=["</answer>"])
    for c in engine.generate(published.prompts, params):
        if c.stop is not None:
            assert c.finish_reason == "stop" and c.text.endswith("</answer>")
            assert "</answer>" not in published.tokenizer.decode(c.tokens[:-1])
    assert any(c.stop == "</answer>" for c in engine.generate(published.prompts, params))


def test_max_new_tokens_ends_with_length(engine, published):
    outs = engine.generate(published.prompts, SamplingParams(temperature=1.0, max_new_tokens=3, seed=1))
    assert all(len(c.tokens) <= 3 for c in outs)
    assert all(c.finish_reason == "length" for c in outs if len(c.tokens) == 3 and c.tokens[-1] != 0)


def test_tool_loop_masks_tool_tokens_and_model_logprobs_match_the_recompute(engine, published):
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=7)
    eps = engine.run_episodes(published.prompts, params, lambda text: " 7 ", ["<answer>"], max_turns=3)
    assert any(e.num_tool_calls >= 1 for e in eps)
    lp, _, _ = completion_logprobs(published.refs[1], published.prompts, [e.tokens for e in eps])
    lp = lp.detach()
    for i, e in enumerate(eps):
        for j, (x, m) in enumerate(zip(e.logprobs, e.loss_mask, strict=True)):
            if m == 0:
                assert x == 0.0
            else:
                assert abs(x - float(lp[i, j])) <= MAX_BOUND
        reply = published.tokenizer.encode(" 7 ", add_special_tokens=False)
        if e.num_tool_calls:
            masked = [t for t, m in zip(e.tokens, e.loss_mask, strict=True) if m == 0]
            assert masked[: len(reply)] == reply
