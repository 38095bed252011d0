"""Pre-rollout screening (`pnyx.rollout.screen`) with the real torch engine and the shipped tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from pnyx.envs import get_env
from pnyx.rollout.sampling import SamplingParams
from pnyx.rollout.screen import Screen, informative

PARAMS = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=16, stop=["</answer>"])


@pytest.fixture(scope="module")
def engine():
    from pnyx.config import shipped_model_path
    from pnyx.models import load_tokenizer
    from pnyx.rollout.engines import make_engine

    torch.set_num_threads(1)
    path = shipped_model_path()
    tok = load_tokenizer(path)
    return make_engine("torch", path, tok), tok


def test_informative_is_the_chance_of_a_mixed_group():
    assert informative(0.0, 8) == 0.0 and informative(1.0, 8) == 0.0
    assert informative(0.5, 8) == pytest.approx(1 - 2 * 0.5**8)
    assert informative(0.1, 8) == pytest.approx(1 - 0.1**8 - 0.9**8)
    assert informative(0.3, 8) > informative(0.1, 8) > informative(0.01, 8)


def test_reference_logprobs_equal_the_engines_own_sampling_logprobs(engine):
    """The screen's p is the probability of exactly the tokens the engine would sample: scoring a completion
    the engine generated gives the sum of the behaviour logprobs it recorded."""
    from pnyx.models import render_prompt

    eng, tok = engine
    env = get_env("arith")
    tasks = env.sample("train", seed=3, n=4)
    prompts = [list(render_prompt(tok, t.prompt)) for t in tasks]
    outs = eng.generate(prompts, SamplingParams(**{**PARAMS.__dict__, "seed": 5}))
    totals = eng.reference_logprobs(prompts, [list(o.tokens) for o in outs], PARAMS)
    for total, out in zip(totals, outs, strict=True):
        assert total == pytest.approx(sum(out.logprobs), abs=1e-3)


def test_pick_keeps_the_most_informative_tasks_of_the_pool_in_stream_order(engine):
    eng, tok = engine
    env = get_env("arith")
    screen = Screen(env, eng, tok, candidates=4, group_size=8)
    assert screen.enabled and screen.pool_size(4) == 16
    pool = env.sample("train", seed=11, n=16)
    picked = screen.pick(pool, 4, PARAMS)
    assert len(picked) == 4 and screen.scored == 16 and screen.seconds > 0
    ids = [t.id for t in pool]
    assert [ids.index(t.id) for t in picked] == sorted(ids.index(t.id) for t in picked)  # stream order
    # every picked task is at least as informative as every task left out, by the engine's own p
    from pnyx.models import render_prompt

    refs = [tok.encode(env.reference_completion(t), add_special_tokens=False) for t in pool]
    totals = eng.reference_logprobs([list(render_prompt(tok, t.prompt)) for t in pool], refs, PARAMS)
    u = {t.id: informative(math.exp(lp), 8) for t, lp in zip(pool, totals, strict=True)}
    chosen = {t.id for t in picked}
    assert min(u[i] for i in chosen) >= max(u[i] for i in ids if i not in chosen) - 1e-9
    assert sorted(screen.last_p) != []


def test_screening_is_off_where_the_reference_is_not_the_answer(engine):
    eng, tok = engine
    for env in (get_env("arith", answer="lenient"), get_env("countdown")):
        screen = Screen(env, eng, tok, candidates=4, group_size=8)
        pool = env.sample("train", seed=1, n=4)
        assert not screen.enabled and screen.pool_size(4) == 4
        assert [t.id for t in screen.pick(pool, 4, PARAMS)] == [t.id for t in pool]
    off = Screen(get_env("arith"), eng, tok, candidates=1, group_size=8)
    assert not off.enabled and off.pool_size(4) == 4


def test_an_engine_that_cannot_score_falls_back_to_the_stream(engine):
    _, tok = engine

    class NoScore:
        name = "noscore"

        def reference_logprobs(self, *a):
            return None

    env = get_env("arith")
    screen = Screen(env, NoScore(), tok, candidates=4, group_size=8)
    pool = env.sample("train", seed=2, n=16)
    assert [t.id for t in screen.pick(pool, 4, PARAMS)] == [t.id for t in pool[:4]]
    assert not screen.enabled and screen.pool_size(4) == 4


def test_shared_prefix_scoring_equals_plain_forwards(engine, monkeypatch):
    """The prefix-cached path (the system prompt computed once) gives the plain forward's numbers."""
    import pnyx.rollout.engines.torch as torch_engine
    from pnyx.models import render_prompt

    eng, tok = engine
    env = get_env("arith")
    pool = env.sample("train", seed=9, n=70)  # more than one chunk of SCREEN_ROWS
    prompts = [list(render_prompt(tok, t.prompt)) for t in pool]
    refs = [tok.encode(env.reference_completion(t), add_special_tokens=False) for t in pool]
    assert torch_engine._common_prefix(prompts) >= torch_engine.SCREEN_MIN_SHARED
    shared = eng.reference_logprobs(prompts, refs, PARAMS)
    monkeypatch.setattr(torch_engine, "SCREEN_MIN_SHARED", 10**9)
    plain = eng.reference_logprobs(prompts, refs, PARAMS)
    assert shared == pytest.approx(plain, abs=1e-4)


def test_new_weights_recompute_the_cached_prefix():
    """The shared prefix's cache belongs to one weights version: after `update` to other weights, scoring
    equals a fresh engine's on those weights (a stale cache would give the old numbers)."""
    from pnyx.config import shipped_model_path
    from pnyx.models import load_model, load_tokenizer, render_prompt
    from pnyx.rollout.engines import make_engine
    from pnyx.store import open_store
    from pnyx.weights import Publisher, Syncer
    from pnyx.weights.manifest import read_manifest

    path = shipped_model_path()
    tok = load_tokenizer(path)
    eng = make_engine("torch", path, tok)
    env = get_env("arith")
    pool = env.sample("train", seed=4, n=8)
    prompts = [list(render_prompt(tok, t.prompt)) for t in pool]
    refs = [tok.encode(env.reference_completion(t), add_special_tokens=False) for t in pool]
    before = eng.reference_logprobs(prompts, refs, PARAMS)  # caches the prefix at the shipped weights
    state = {k: v.to(torch.bfloat16) for k, v in load_model(path).state_dict().items()}
    torch.manual_seed(0)
    state = {k: v + 0.05 * torch.randn_like(v) if "layers" in k else v for k, v in state.items()}
    store = open_store("memory://screen-update")
    Publisher(store).publish(0, state)
    syncer = Syncer(store)
    syncer.sync()
    eng.update(0, syncer.state, read_manifest(store, 0).weights)
    after = eng.reference_logprobs(prompts, refs, PARAMS)
    fresh = make_engine("torch", path, tok)
    fresh.update(0, syncer.state, read_manifest(store, 0).weights)
    expected = fresh.reference_logprobs(prompts, refs, PARAMS)
    assert after == pytest.approx(expected, abs=1e-4)
    assert max(abs(a - b) for a, b in zip(after, before, strict=True)) > 1e-2


class FixedP:
    """An engine whose p for the i-th candidate of each pool is `ps[i]` (to test the rules exactly)."""

    name = "fixed"

    def __init__(self, ps: list[float]):
        self.ps = ps

    def reference_logprobs(self, prompts, refs, params):
        assert len(prompts) == len(self.ps)
        return [math.log(p) if p > 0 else -math.inf for p in self.ps]


def test_mastered_rule_passes_over_the_most_mastered_tasks(engine):
    """`mastered` drops the largest p^8; hard tasks (p near 0) are kept, unlike with `informative`."""
    _, tok = engine
    env = get_env("arith")
    pool = env.sample("train", seed=4, n=8)
    ps = [0.99, 0.01, 0.95, 0.5, 0.0, 0.93, 0.97, 0.2]
    screen = Screen(env, FixedP(ps), tok, candidates=2, group_size=8, rule="mastered")
    assert [t.id for t in screen.pick(pool, 4, PARAMS)] == [pool[i].id for i in (1, 3, 4, 7)]
    informative_pick = Screen(env, FixedP(ps), tok, candidates=2, group_size=8).pick(pool, 4, PARAMS)
    assert pool[4].id not in {t.id for t in informative_pick}  # p = 0 is never informative
    # the four smallest p^8 (0.01, 0.2, 0.93, 0.95), in stream order
    ps2 = [0.99, 0.01, 0.95, 0.97, 0.999, 0.93, 0.98, 0.2]
    picked = Screen(env, FixedP(ps2), tok, candidates=2, group_size=8, rule="mastered").pick(pool, 4, PARAMS)
    assert [t.id for t in picked] == [pool[i].id for i in (1, 2, 5, 7)]


def test_screening_starts_once_the_zero_variance_share_crosses_its_threshold_and_stays_on(engine):
    _, tok = engine
    env = get_env("arith")
    pool = env.sample("train", seed=4, n=8)
    screen = Screen(env, FixedP([0.99] * 4 + [0.5] * 4), tok, candidates=2, group_size=8, rule="mastered",
                    start_above=0.1)  # fmt: skip
    assert not screen.started and screen.pool_size(4) == 4
    assert [t.id for t in screen.pick(pool, 4, PARAMS)] == [t.id for t in pool[:4]] and screen.scored == 0
    for _ in range(20):
        screen.observe(0, 4)  # no zero-variance groups: stays off
    assert not screen.started
    for _ in range(3):
        screen.observe(4, 4)  # every group zero-variance: the EMA passes 0.1 within 3 cohorts
    assert screen.started and screen.pool_size(4) == 8
    assert [t.id for t in screen.pick(pool, 4, PARAMS)] == [t.id for t in pool[4:]]
    for _ in range(50):
        screen.observe(0, 4)
    assert screen.started  # stays on: mastery only grows over a run
