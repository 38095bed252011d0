"""Seeded draws (issue #25): workers draw every token from uniforms they cannot choose, the trainer checks
each one under the exact published weights of the group's version (`pnyx.protocol.draws`,
`pnyx.train.drawcheck`, `pnyx.train.published`).

On the shipped tiny model, with real engines (torch, and MLX where installed), a real signed store and real
published versions: honest groups pass at distance 0 at any staleness and in any order of versions; a
temperature liar, a tampered token, a re-rolled sample, swapped samples, another key's draws and an
unseeded group all fail; tool tokens take no uniform.
"""

from __future__ import annotations

import importlib.util
import itertools

import msgspec
import numpy as np
import pytest

from pnyx.protocol.draws import SCHEME, UniformStream, group_seeds, sample_seed, uniforms

ENGINES = [
    "torch",
    pytest.param(
        "mlx", marks=pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None, reason="needs pnyx[mlx]")
    ),
]


def test_uniforms_are_fixed_24_bit_values_and_a_stream_extends_its_prefix():
    u = uniforms(12345, 200)
    assert u.dtype == np.float32 and u.shape == (200,)
    assert ((u >= 0) & (u < 1)).all()
    assert np.array_equal(u * 2**24, np.floor(u * 2**24))  # multiples of 2^-24: exact in float32
    assert np.array_equal(uniforms(12345, 70), u[:70])  # Philox's raw stream: a prefix never changes
    # pinned: the derivation is part of the protocol (a change takes a new SCHEME)
    assert [round(float(x), 7) for x in uniforms(sample_seed("r", "k", "w", "t", 3, 7, 1), 3)] == PINNED
    s = UniformStream(12345)
    got = []
    for _ in range(150):
        got.append(s.peek())
        s.advance()
    assert np.array_equal(np.array(got, dtype=np.float32), u[:150])


PINNED = [0.7189121, 0.7000032, 0.2071123]


def test_every_part_of_a_samples_identity_changes_its_seed():
    base = ("run", "key", "w1", "task-1", 4, 9, 2)
    seeds = {sample_seed(*base)}
    for i in range(len(base)):
        other = list(base)
        other[i] = other[i] + 1 if isinstance(other[i], int) else other[i] + "x"
        seeds.add(sample_seed(*other))
    assert len(seeds) == len(base) + 1
    assert group_seeds(*base[:6], 3) == [sample_seed(*base[:6], i) for i in range(3)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A signed run of the shipped tiny model with v0 and v1 published (v1 moved by a real optimizer step)."""
    import torch
    from worker_support import create_signed_run

    from pnyx.config import shipped_model_path
    from pnyx.envs import get_env
    from pnyx.models import load_model, load_tokenizer
    from pnyx.store import open_store
    from pnyx.weights import Publisher
    from pnyx.weights.trust import run_verifier

    torch.manual_seed(0)
    model_dir = shipped_model_path()
    store = open_store(tmp_path_factory.mktemp("draws") / "run")
    manifest, signer = create_signed_run(store, {"worker": {}, "env": {}}, {"vocab_size": 10})
    master = load_model(model_dir, dtype="float32")
    pub = Publisher(store, anchor_every=20, signer=signer)
    pub.publish(0, {k: v.detach().to(torch.bfloat16) for k, v in master.state_dict().items()})
    with torch.no_grad():  # v1: every weight moved, as a step at a high learning rate moves them
        for p in master.parameters():
            p.add_(0.02 * torch.randn_like(p))
    pub.publish(1, {k: v.detach().to(torch.bfloat16) for k, v in master.state_dict().items()})
    return {
        "store": store, "manifest": manifest, "trust": run_verifier(manifest), "model_dir": model_dir,
        "tok": load_tokenizer(model_dir), "env": get_env("arith"),
    }  # fmt: skip


def _engine(run, name: str, version: int):
    from pnyx.rollout.engines import make_engine
    from pnyx.weights import Syncer

    syncer = Syncer(run["store"], trust=run["trust"])
    syncer.sync(version)
    engine = make_engine(name, run["model_dir"], run["tok"])
    engine.update(version, syncer.state, syncer.manifest)
    return engine, syncer.digest or ""


def _groups(
    run, engine, digest: str, version: int, key: str, n: int = 4, temperature: float = 1.0, seq0: int = 0
):
    from pnyx.rollout.cohort import CohortSpec, generate_cohort

    spec = CohortSpec(
        run_id=run["manifest"].run_id, worker_id="w", version=version, digest=digest, group_size=8,
        temperature=temperature, top_p=1.0, top_k=0, max_new_tokens=16, seed=5, key=key,
    )  # fmt: skip
    tasks = run["env"].sample("train", seed=version, n=n)
    seqs = itertools.count(seq0)
    return generate_cohort(engine, run["tok"], run["env"], tasks, spec, lambda: next(seqs)).groups


def _checker(run, tolerance: float = 1e-3):
    from pnyx.train.drawcheck import DrawCheck
    from pnyx.train.published import PublishedModel

    published = PublishedModel(run["store"], run["model_dir"])
    published.trust = run["trust"]
    return DrawCheck({"weights": published}, tolerance)


@pytest.mark.parametrize("name", ENGINES)
def test_honest_groups_pass_at_distance_zero_at_any_staleness_in_any_order(run, name):
    check = _checker(run)
    groups = {}
    for v in (0, 1):
        engine, digest = _engine(run, name, v)
        groups[v] = _groups(run, engine, digest, v, key="k1")
        assert all(g.draws == SCHEME for g in groups[v])
    # v1, then v0 (older than the syncer: kept in memory), then v1 again: a stale group is judged under
    # the weights it was sampled from, whatever the trainer holds now
    for v in (1, 0, 1):
        for g in groups[v]:
            assert check.check(g, "k1") is None
    assert check.stats.failed == 0 and check.stats.max_passing == 0.0
    tokens = {v: sum(len(s.tokens) for g in groups[v] for s in g.samples) for v in (0, 1)}
    assert check.stats.tokens == 2 * tokens[1] + tokens[0]  # every token of every group checked
    # the same group claimed at the other version fails: the check is exact per version
    wrong = msgspec.structs.replace(groups[0][0], policy_version=1)
    assert check.check(wrong, "k1") == "draw_mismatch"


def test_a_rows_seeded_tokens_do_not_depend_on_its_batch(run):
    """With seeded draws a sample is a function of the weights, its prompt and its stream only."""
    from pnyx.protocol.draws import streams
    from pnyx.rollout.sampling import SamplingParams

    engine, _ = _engine(run, "torch", 0)
    prompts = [[1, 5, 9], [1, 7], [1, 5, 9, 11, 4]]
    seeds = [11, 22, 33]
    together = engine.generate(prompts, SamplingParams(max_new_tokens=12, draws=streams(seeds)))
    alone = [
        engine.generate([p], SamplingParams(max_new_tokens=12, draws=streams([s])))[0]
        for p, s in zip(prompts, seeds, strict=True)
    ]
    assert [c.tokens for c in together] == [c.tokens for c in alone]
    with pytest.raises(Exception, match="uniform streams"):
        engine.generate(prompts, SamplingParams(max_new_tokens=4, draws=streams(seeds[:2])))


def test_dishonest_groups_fail(run):
    engine, digest = _engine(run, "torch", 0)
    check = _checker(run)
    honest = _groups(run, engine, digest, 0, key="k1")
    g = honest[0]
    assert check.check(g, "k1") is None
    # a temperature liar with the same seeded uniforms (its best try), claiming the run's temperature
    liars = [
        msgspec.structs.replace(x, temperature=1.0)
        for x in _groups(run, engine, digest, 0, "k1", temperature=0.3)
    ]
    caught = [check.check(x, "k1") for x in liars]
    same = [
        all(a.tokens == b.tokens for a, b in zip(x.samples, h.samples, strict=True))
        for x, h in zip(liars, honest, strict=True)
    ]  # a liar's group that is the honest draw token for token carries no bias: it may pass
    assert all(c == "draw_mismatch" or s for c, s in zip(caught, same, strict=True))
    assert caught.count("draw_mismatch") >= 3
    # one token changed
    s0 = g.samples[0]
    flipped = msgspec.structs.replace(s0, tokens=[(s0.tokens[0] + 1) % 10, *s0.tokens[1:]])
    assert check.check(msgspec.structs.replace(g, samples=[flipped, *g.samples[1:]]), "k1") == "draw_mismatch"
    # a sample re-rolled: the same task drawn again under another seq, its first sample put in place of one
    rerolled = _groups(run, engine, digest, 0, key="k1", seq0=100)[0]
    assert rerolled.task_id == g.task_id
    if rerolled.samples[0].tokens != g.samples[3].tokens:
        mixed = msgspec.structs.replace(g, samples=[*g.samples[:3], rerolled.samples[0], *g.samples[4:]])
        assert check.check(mixed, "k1") == "draw_mismatch"
    # samples swapped (a chosen order) unless they happen to be equal
    if g.samples[0].tokens != g.samples[1].tokens:
        swapped = msgspec.structs.replace(g, samples=[g.samples[1], g.samples[0], *g.samples[2:]])
        assert check.check(swapped, "k1") == "draw_mismatch"
    # another key's draws: the uniforms are bound to the signing key
    assert check.check(g, "k2") == "draw_mismatch"
    # no seeded draws at all
    assert check.check(msgspec.structs.replace(g, draws=""), "k1") == "unseeded"
    assert check.stats.by_reason["unseeded"] == 1


def test_a_version_the_store_cannot_verify_is_unverifiable_not_blamed(run):
    engine, digest = _engine(run, "torch", 0)
    g = _groups(run, engine, digest, 0, key="k1", n=1)[0]
    assert _checker(run).check(msgspec.structs.replace(g, policy_version=7), "k1") == "unverifiable"
    from pnyx.security.checks import FAULTS

    assert "draw_mismatch" in FAULTS and "unseeded" in FAULTS and "unverifiable" not in FAULTS


@pytest.mark.parametrize("name", ENGINES)
def test_tool_tokens_take_no_uniform_and_turns_continue_the_stream(run, name):
    """A multi-turn episode (a tool answering after a frequent stop string): the model's tokens of every
    turn are the stream's draws in order; the tool's tokens (loss mask 0) take none."""
    from pnyx.protocol.draws import streams
    from pnyx.protocol.records import RolloutGroup, Sample
    from pnyx.rollout.sampling import SamplingParams

    engine, digest = _engine(run, name, 1)
    text = run["tok"].decode(list(range(3, 10)))
    stop = next(ch for ch in text if ch.strip())  # a character the tiny model writes often
    key, task, rid = "k1", "task-x", run["manifest"].run_id
    prompt = [1, 4, 6]
    seeds = group_seeds(rid, key, "w", task, 1, 0, 8)
    params = SamplingParams(max_new_tokens=6, draws=streams(seeds))
    episodes = engine.run_episodes(
        [prompt] * 8, params, lambda t: " ok", [stop], max_turns=3, max_episode_tokens=40
    )
    assert any(0 in e.loss_mask for e in episodes), "no tool turn happened"
    samples = [
        Sample(tokens=e.tokens, logprobs=e.logprobs, loss_mask=e.loss_mask, reward=0.0) for e in episodes
    ]
    group = RolloutGroup(
        run_id=rid, worker_id="w", seq=0, policy_version=1, weights_digest=digest, env="arith", task_id=task,
        prompt_tokens=prompt, samples=samples, temperature=1.0, top_p=1.0, top_k=0, created_at=0.0,
        gen_seconds=0.0, score_seconds=0.0, draws=SCHEME,
    )  # fmt: skip
    check = _checker(run)
    assert check.check(group, key) is None
    assert check.stats.tokens == sum(sum(e.loss_mask) for e in episodes)


def test_the_trainer_checks_every_untrusted_group_and_a_share_of_a_trusted_keys():
    """The ingestion hook: every seeded group of an untrusted key is checked; a trusted key's (your own
    workers) only `trusted_share` of them, chosen by the group key's hash; an unseeded group of a trusted key
    is taken, of an untrusted one checked (and dropped as `unseeded`) unless `accept_unseeded`."""
    from types import SimpleNamespace

    from pnyx.envs import get_env
    from pnyx.store import open_store
    from pnyx.train.drawcheck import DrawCheck
    from pnyx.train.ingest import Ingestor
    from pnyx.train.ingest_state import IngestSettings
    from pnyx.train.trainer_setup import _draw_hook

    class Recorded(DrawCheck):
        def __init__(self):
            super().__init__({})
            self.seen: list[str] = []

        def check(self, group, key, staleness=None):
            self.seen.append(group.task_id)
            return None if group.draws else "unseeded"

    ing = Ingestor(open_store("memory://"), get_env("arith"), detokenize=lambda ids: "",
                   settings=IngestSettings(trusted_keys=frozenset({"mine"})))  # fmt: skip

    def group(i: int, signer: str, draws: str = SCHEME):
        return SimpleNamespace(key=f"rollouts/v1/w-{i}", version=1, signer=signer,
                               group=SimpleNamespace(draws=draws, task_id=f"{signer}-{i}-{draws}"))  # fmt: skip

    check = Recorded()
    hook = _draw_hook(check, ing, accept_unseeded=False, trusted_share=1 / 32)
    assert all(hook(group(i, "stranger")) is None for i in range(200))
    assert len(check.seen) == 200  # every untrusted seeded group
    check.seen.clear()
    assert all(hook(group(i, "mine")) is None for i in range(3200))
    assert 50 <= len(check.seen) <= 150  # about 1/32 of 3,200, the same ones on every run (a hash)
    assert hook(group(0, "mine", draws="")) is None  # your own vLLM worker
    assert hook(group(0, "stranger", draws="")) == "unseeded"
    assert (
        _draw_hook(check, ing, accept_unseeded=True, trusted_share=1 / 32)(group(1, "stranger", "")) is None
    )
