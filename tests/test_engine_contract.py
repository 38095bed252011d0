"""The engine contract: every worker engine (torch, mlx, vllm) passes the same tests on the shipped tiny model.

Each engine takes version 0 and then version 1 (a PULSE delta) in place and proves the chain digest; at
temperature 0 it gives the torch engine's tokens; sampled at temperature 1 and with top-k/top-p its behaviour
logprobs agree with the trainer's recompute (`completion_logprobs` on an fp32 copy of version 1), with the
mean and max |Δ| printed per engine; stop strings and the tool loop keep pnyx's semantics. A LoRA run's adapter
(`[trainer.lora]`) passes the same checks: each engine merges versions 0 and 1 of a published adapter into its
own base (a "derived" proof), gives the adapted model's greedy tokens and the trainer's logprobs, goes back to
the base at version 0, and refuses an adapter that does not fit the model. Engines that are not installed
here are skipped (vllm runs in its own environment: scripts/test_vllm_cpu.sh, marker `vllm`).
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
from pnyx.models.tokenizer import eos_token_ids
from pnyx.rollout.engines import WeightsProof, make_engine
from pnyx.rollout.sampling import SamplingParams
from pnyx.store import open_store
from pnyx.weights import Publisher, Syncer
from pnyx.weights.bits import BitState, make_bits
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


# -- a LoRA run: the published state is an adapter, merged into each engine's own base --------------------


class PublishedAdapter:
    """Versions 0 and 1 of a LoRA adapter on the tiny model (`[trainer.lora]`), published as the trainer does
    (`gather_published`: the adapter alone, under its published names, in bf16), both versions' states, and
    the fp32 references: the plain base, and the base with the adapter attached holding version 1's values
    (the trainer's recompute), with their greedy tokens."""

    def __init__(self) -> None:
        from pnyx.config import LoraConfig
        from pnyx.models.lora import attach
        from pnyx.train.distributed import gather_published

        torch.manual_seed(0)
        self.lc = LoraConfig(enabled=True, rank=8, alpha=16.0)
        self.tokenizer = load_tokenizer(TINY)
        model = load_model(TINY)
        self.names = attach(model, self.lc)  # {state-dict key: published name}; B = 0: the base
        self.store = open_store("memory://engine-contract-lora")
        pub = Publisher(self.store)

        def publish(version: int) -> None:
            pub.publish(
                version, gather_published(model, torch.bfloat16, set(self.names.values()), self.names)
            )

        publish(0)
        params = model.state_dict(keep_vars=True)
        with torch.no_grad():  # v1: every B, and A of the attention targets (the others' A stay: a delta)
            for key, name in self.names.items():
                if name.endswith("lora_B.weight"):
                    params[key].copy_(0.05 * torch.randn_like(params[key]))
                elif ".self_attn." in name:
                    params[key].add_(0.05 * torch.randn_like(params[key]))
        publish(1)
        self.changed = sum(n.endswith("lora_B.weight") or ".self_attn." in n for n in self.names.values())
        # One syncer following the chain, as a worker's: v1's state shares v0's arrays of the tensors the delta
        # left alone, so an engine re-merges only the targets whose A or B changed.
        syncer = Syncer(self.store)
        self.states: dict[int, BitState] = {}
        for v in (0, 1):
            syncer.sync(v)
            self.states[v] = syncer.state
        self.base = load_model(TINY)
        self.ref = load_model(TINY)
        attach(self.ref, self.lc)
        self.ref.eval()
        own = self.ref.state_dict(keep_vars=True)
        with torch.no_grad():
            for key, name in self.names.items():
                own[key].copy_(syncer.tensors[name].to(torch.float32))
        self.prompts = [
            list(render_prompt(self.tokenizer, [{"role": "user", "content": f"What is {a}+{b}?"}]))
            for a, b in [(1, 2), (13, 45), (7, 80), (99, 1), (5, 5), (62, 17)]
        ]
        self.max_new = 16
        self.want = {0: greedy(self.base, self.tokenizer, self.prompts, self.max_new)}
        self.want[1] = greedy(self.ref, self.tokenizer, self.prompts, self.max_new)
        self.first: dict[str, tuple[IntegrityError, WeightsProof]] = {}
        """Per engine: its refused first update and its first proof (version 0)."""

    def update(self, engine, version: int, state=None):
        state = self.states[version] if state is None else state
        return engine.update(version, state, read_manifest(self.store, version).weights)

    def misnamed(self):
        """Version 1 with layer 0's q_proj adapter renamed to a module the model lacks."""
        state = dict(self.states[1])
        for part in ("lora_A", "lora_B"):
            state[f"model.layers.0.self_attn.nope_proj.{part}.weight"] = state.pop(
                f"model.layers.0.self_attn.q_proj.{part}.weight"
            )
        return state

    def misshapen(self):
        """Version 1 with layer 0's q_proj lora_A one column short of the layer's input width."""
        state = dict(self.states[1])
        name = "model.layers.0.self_attn.q_proj.lora_A.weight"
        state[name] = make_bits("bfloat16", state[name].data[:, :-1])
        return state


def greedy(model, tokenizer, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Plain greedy decoding (a full forward per token, argmax, ending on an EOS id): the reference tokens."""
    eos = set(eos_token_ids(tokenizer, model))
    out = []
    with torch.no_grad():
        for p in prompts:
            ids, tokens = list(p), []
            for _ in range(max_new):
                t = int(model(torch.tensor([ids])).logits[0, -1].argmax())
                tokens.append(t)
                ids.append(t)
                if t in eos:
                    break
            out.append(tokens)
    return out


def refused(engine, adapter: PublishedAdapter, state, match: str) -> IntegrityError:
    with pytest.raises(IntegrityError, match=match) as e:
        adapter.update(engine, 1, state)
    assert engine.version is None and engine.digest == ""
    return e.value


@pytest.fixture(scope="module")
def adapter() -> PublishedAdapter:
    return PublishedAdapter()


@pytest.fixture(scope="module", params=ENGINES)
def adapter_engine(request, adapter):
    """An engine serving the adapter: its first update (an adapter naming a module the model lacks) refused,
    then versions 0 and 1."""
    device = DEVICE if request.param != "mlx" else "cpu"
    eng = make_engine(
        request.param, str(TINY), adapter.tokenizer, dtype="float32", device=device, lora=adapter.lc
    )
    first_refusal = refused(eng, adapter, adapter.misnamed(), "does not have")  # reads the base: `_base`
    adapter.first[request.param] = (first_refusal, adapter.update(eng, 0))
    adapter.update(eng, 1)
    yield eng
    eng.close()


def test_adapter_update_applies_a_delta_in_place_and_proves_the_chain_digest(adapter_engine, adapter):
    m0, m1 = read_manifest(adapter.store, 0), read_manifest(adapter.store, 1)
    first, proof = adapter.first[adapter_engine.name][1], adapter_engine.last_proof
    assert (first.version, first.chain_digest, first.kind) == (0, m0.weights.chain_digest, "derived")
    assert (proof.version, proof.chain_digest, proof.kind) == (1, m1.weights.chain_digest, "derived")
    assert m1.weights.has_delta and not m1.weights.anchor  # version 1 is published as a delta
    assert adapter_engine.digest == m1.digest == m1.weights.chain_digest
    assert proof.state_digest == m1.weights.state_digest
    assert first.tensors == proof.tensors == len(m1.weights.tensors) == len(adapter.names)
    assert first.changed == len(adapter.names) and proof.changed == adapter.changed < len(adapter.names)


def test_adapter_greedy_tokens_equal_the_trainer_reference(adapter_engine, adapter):
    params = SamplingParams(temperature=0.0, max_new_tokens=adapter.max_new)
    got = [c.tokens for c in adapter_engine.generate(adapter.prompts, params)]
    assert got == adapter.want[1]
    assert any(g != b for g, b in zip(got, adapter.want[0], strict=True))  # the adapter is not ignored


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_new_tokens=16, seed=3),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=16, seed=5),
    ],
    ids=["t1", "topk-topp"],
)
def test_adapter_behaviour_logprobs_equal_the_trainer_recompute(adapter_engine, adapter, params):
    outs = adapter_engine.generate(adapter.prompts, params)
    lp, _, _ = completion_logprobs(
        adapter.ref, adapter.prompts, [o.tokens for o in outs],
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
    )  # fmt: skip
    lp = lp.detach()
    d = [abs(x - float(lp[i, j])) for i, o in enumerate(outs) for j, x in enumerate(o.logprobs)]
    mean, worst = sum(d) / len(d), max(d)
    print(f"\nadapter logprob gap engine={adapter_engine.name} {params.temperature=} {params.top_k=} "
          f"{params.top_p=}: mean={mean:.2e} max={worst:.2e} tokens={len(d)}")  # fmt: skip
    assert mean <= MEAN_BOUND and worst <= MAX_BOUND


def test_adapter_back_to_version_0_proves_it_and_generates_the_base(adapter_engine, adapter):
    params = SamplingParams(temperature=0.0, max_new_tokens=adapter.max_new)
    try:
        proof = adapter.update(adapter_engine, 0)
        assert (proof.chain_digest, proof.kind) == (
            read_manifest(adapter.store, 0).weights.chain_digest,
            "derived",
        )
        assert proof.changed == adapter.changed
        assert [c.tokens for c in adapter_engine.generate(adapter.prompts, params)] == adapter.want[0]
    finally:
        adapter.update(adapter_engine, 1)
    assert [c.tokens for c in adapter_engine.generate(adapter.prompts, params)] == adapter.want[1]


def test_an_adapter_that_does_not_fit_is_refused(adapter_engine, adapter):
    assert "nope_proj" in str(adapter.first[adapter_engine.name][0])  # the first update: the engine's `_base`
    try:
        refused(adapter_engine, adapter, adapter.misnamed(), "does not have")
        refused(adapter_engine, adapter, adapter.misshapen(), "does not fit")
    finally:
        adapter.update(adapter_engine, 1)
    assert adapter_engine.version == 1
