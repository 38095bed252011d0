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
import math

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


def _scored(g, key: str, advantages: list[float] | None = None):
    """A group as the trainer holds it once ingested (signed by `key`)."""
    from pnyx.train.rescore import ScoredGroup

    n = len(g.samples)
    adv = advantages or [0.0] * n
    return ScoredGroup(f"rollouts/v{g.policy_version}/{g.worker_id}-{g.seq}-{g.task_id}", g.policy_version,
                       g.worker_id, g.task_id, g, [0.0] * n, adv, [0.0] * n, signer=key)  # fmt: skip


class _Exact:
    """The trainer's exact check of one group's draws, as a verdict: its rows measured by
    `Rejudge.draws` under exactly the published weights of the version they claim."""

    def __init__(self, run, tolerance: float = 1e-3):
        from pnyx.train.published import PublishedModel
        from pnyx.train.rejudge import Rejudge

        published = PublishedModel(run["store"], run["model_dir"])
        published.trust = run["trust"]
        self.rejudge = Rejudge(published)
        self.tolerance = tolerance
        self.worst = 0.0
        self.tokens = 0

    def check(self, g, key: str) -> str | None:
        from pnyx.train.microbatch import build_rows

        rows = build_rows([_scored(g, key)])
        assert all(r.uniforms is not None for r in rows)
        self.tokens += sum(sum(1 for u in r.uniforms or () if u == u) for r in rows)  # not NaN: model tokens
        worst = max(self.rejudge.draws(rows))
        if worst == math.inf:
            return "draw_unverifiable"
        if worst > self.tolerance:
            return "draw_mismatch"
        self.worst = max(self.worst, worst)
        return None


@pytest.mark.parametrize("name", ENGINES)
def test_honest_groups_pass_at_distance_zero_at_any_staleness_in_any_order(run, name):
    check = _Exact(run)
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
    assert check.worst == 0.0
    tokens = {v: sum(len(s.tokens) for g in groups[v] for s in g.samples) for v in (0, 1)}
    assert check.tokens == 2 * tokens[1] + tokens[0]  # every token of every group checked
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
    check = _Exact(run)
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


def test_a_version_the_store_cannot_verify_is_unverifiable_not_blamed(run):
    engine, digest = _engine(run, "torch", 0)
    g = _groups(run, engine, digest, 0, key="k1", n=1)[0]
    assert _Exact(run).check(msgspec.structs.replace(g, policy_version=7), "k1") == "draw_unverifiable"
    from pnyx.security.checks import FAULTS

    assert "draw_mismatch" in FAULTS and "unseeded" in FAULTS and "draw_unverifiable" not in FAULTS


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
    check = _Exact(run)
    assert check.check(group, key) is None
    assert check.tokens == sum(sum(e.loss_mask) for e in episodes)


def test_ingestion_drops_unseeded_groups_of_untrusted_keys_only():
    """Groups without seeded draws: taken from a trusted key (your own vLLM worker) or with
    `accept_unseeded`, else dropped at ingestion as `unseeded` (a fault), before any forward."""
    from types import SimpleNamespace

    from pnyx.train.drawcheck import unseeded_policy

    def group(signer: str, draws: str = SCHEME):
        return SimpleNamespace(signer=signer, group=SimpleNamespace(draws=draws))

    strict = unseeded_policy(False, {"mine"})
    assert strict(group("stranger")) is None and strict(group("mine")) is None  # type: ignore[arg-type]
    assert strict(group("mine", "")) is None  # type: ignore[arg-type]
    assert strict(group("stranger", "")) == "unseeded"  # type: ignore[arg-type]
    assert unseeded_policy(True, set())(group("stranger", "")) is None  # type: ignore[arg-type]


def _step_on_fresh_stale_and_liars(run, device: str = "cpu", precheck: bool = False):
    """The trainer at v1 (its master: v1's published weights, on `device`) takes one step on 3 fresh v1
    groups, 3 stale v0 groups and 3 v0 temperature-liar groups (drawn at 0.3 with the honest uniforms,
    claiming 1.0), the draw check on (tolerance 1e-3), exact re-checks on the CPU (`precheck`: the stale and
    liar rows measured before the step, as the trainer does while it waits). Returns (exact, stats,
    {version: rows}, keys of the liar groups that differ from the honest draw, the stale groups)."""
    import copy

    import torch

    from pnyx.security.checks import CheckSettings
    from pnyx.train.losses import LossSettings
    from pnyx.train.step import make_optimizer, train_step

    exact = _Exact(run)
    with exact.rejudge.published.lock:
        master = copy.deepcopy(exact.rejudge.published.at(1)).train().to(device)
    for p in master.parameters():
        p.requires_grad_(True)
    adv = [1.0, -1.0] * 4
    fresh = _groups(run, *_engine(run, "torch", 1), 1, key="k1", n=3)
    engine, digest = _engine(run, "torch", 0)
    stale = _groups(run, engine, digest, 0, key="k1", n=3)
    honest0 = _groups(run, engine, digest, 0, key="k1", n=3, seq0=50)
    liars = [
        msgspec.structs.replace(x, temperature=1.0)
        for x in _groups(run, engine, digest, 0, "k1", n=3, temperature=0.3, seq0=50)
    ]
    differ = {
        _scored(x, "k1").key
        for x, h in zip(liars, honest0, strict=True)
        if any(a.tokens != b.tokens for a, b in zip(x.samples, h.samples, strict=True))
    }
    assert differ
    batch = [_scored(g, "k1", adv) for g in fresh + stale + liars]
    if precheck:
        from pnyx.train.microbatch import build_rows

        exact.rejudge.precheck(build_rows(batch[len(fresh) :]))
    stats = train_step(
        master, make_optimizer(master, 1e-4, (0.9, 0.99), 0.0), batch, LossSettings(), micro_batch_tokens=4096,
        grad_clip=1.0, policy_version=1, checks=CheckSettings(lp_gap_base=None, plausibility_z=None, draw_tolerance=1e-3),
        exact_draws=exact.rejudge.draws, forward_dtype=torch.bfloat16,
    )  # fmt: skip
    rows = {
        v: sum(1 for g in gs for s in g.samples if s.tokens) for v, gs in ((1, fresh), (0, stale + liars))
    }
    return exact, stats, rows, differ, stale


def test_the_step_measures_every_token_in_its_own_forward_and_rechecks_only_rows_over_the_tolerance(run):
    """The trainer at v1 (its master: v1's published weights) steps on fresh v1 groups, stale v0 groups and
    a v0 temperature liar. Fresh rows are measured in the step's own forward, and none goes further; stale
    rows over the tolerance there (v1's weights are not v0's) are measured again under v0's exact weights
    and kept; the liar's groups that differ from the honest draw are dropped as `draw_mismatch` before the
    optimizer step."""
    exact, stats, rows, differ, stale = _step_on_fresh_stale_and_liars(run)
    tally = stats.draws
    assert tally is not None
    assert tally.by_staleness["0"] == [rows[1], 0, 0]  # fresh rows: measured in the step's forward alone
    n1, flagged, failed = tally.by_staleness["1"]
    assert n1 == rows[0] and 0 < failed <= flagged < n1 and exact.rejudge.draw_rows == flagged
    assert stats.rejected == dict.fromkeys(sorted(differ), "draw_mismatch")
    # the stale honest rows are their draws under v0 (the largest kept distance may be a liar's row that
    # happens to lie within the tolerance, in a group another row condemns)
    from pnyx.train.microbatch import build_rows

    assert max(exact.rejudge.draws(build_rows([_scored(g, "k1") for g in stale]))) <= 1e-5


def test_stale_rows_measured_while_the_trainer_waits_give_the_step_the_same_verdicts_without_a_forward(run):
    """The same step, its stale and liar rows measured exactly beforehand (`Rejudge.precheck`, what the
    trainer does with the batch so far while it waits for the rest): the step's re-check of each flagged
    row (a prefix of a measured row) reads the measurement and runs no forward, and the verdicts are the
    same: the liars' groups that differ are dropped as `draw_mismatch`, the honest stale groups kept."""
    exact, stats, rows, differ, _ = _step_on_fresh_stale_and_liars(run, precheck=True)
    tally = stats.draws
    assert tally is not None
    n1, flagged, failed = tally.by_staleness["1"]
    assert exact.rejudge.prechecked_rows == rows[0] == n1  # every stale row, measured before the step
    assert exact.rejudge.draw_rows == rows[0]  # ... and none in the step
    assert exact.rejudge.known_rows == flagged > 0 and 0 < failed <= flagged
    assert stats.rejected == dict.fromkeys(sorted(differ), "draw_mismatch")


def test_a_measurement_answers_only_for_the_same_row_or_its_prefix(run):
    """`Rejudge.draws` reads an earlier measurement only for the very row (or a prefix of it): a record
    that changed a token, its prompt, its sampling or its uniforms under the same key, index and version
    is measured again, and a tampered token is found."""
    import dataclasses

    from pnyx.train.drawcheck import prefix
    from pnyx.train.microbatch import build_rows

    exact = _Exact(run)
    engine, digest = _engine(run, "torch", 0)
    rows = build_rows([_scored(g, "k1") for g in _groups(run, engine, digest, 0, key="k1", n=2)])
    assert exact.rejudge.precheck(rows) == len(rows) and exact.rejudge.precheck(rows) == 0  # once
    measured = exact.rejudge.draw_rows
    r = next(r for r in rows if len(r.completion) >= 3)
    assert exact.rejudge.draws([r, prefix(r, 2)]) == [0.0, 0.0]
    assert exact.rejudge.draw_rows == measured and exact.rejudge.known_rows == 2  # no forward
    flipped = dataclasses.replace(r, completion=[(r.completion[0] + 1) % 10, *r.completion[1:]])
    others = [
        flipped,
        dataclasses.replace(r, prompt=r.prompt[1:]),
        dataclasses.replace(r, sampling=(0.5, *r.sampling[1:])),
        dataclasses.replace(r, uniforms=[1.0 - u for u in r.uniforms or ()]),
    ]
    found = exact.rejudge.draws(others)
    assert exact.rejudge.draw_rows == measured + len(others) and exact.rejudge.known_rows == 2
    assert found[0] > 1e-3  # another token than its uniform's draw: measured, and found


@pytest.mark.parametrize("audit", [0.0, 1.0])
def test_a_stale_stamp_on_samples_drawn_under_the_newer_weights_is_caught_only_by_the_stale_audit(run, audit):
    """A worker holding v0 and v1 draws with v0's uniforms under v1's weights and stamps v0 (the red-team
    review of 2026-12-04): the trainer at v1 measures those rows under v1's published weights, where each
    token is its uniform's draw, so without the audit of passing stale rows they pass, and drawing both
    ways would let the worker choose between two samples per uniform stream. With
    `security.stale_draw_audit` at 1.0 every passing stale row is measured again under v0's exact weights:
    every group whose tokens differ from the honest v0 draw is dropped, honest stale groups are kept."""
    import copy

    import torch

    from pnyx.security.checks import CheckSettings
    from pnyx.train.losses import LossSettings
    from pnyx.train.step import make_optimizer, train_step

    exact = _Exact(run)
    with exact.rejudge.published.lock:
        master = copy.deepcopy(exact.rejudge.published.at(1)).train()
    for p in master.parameters():
        p.requires_grad_(True)
    v0_engine, v0_digest = _engine(run, "torch", 0)
    v1_engine, _ = _engine(run, "torch", 1)
    honest = _groups(run, v0_engine, v0_digest, 0, key="k1", n=4)
    forged = _groups(run, v1_engine, v0_digest, 0, key="k1", n=4, seq0=100)  # v0's stamp and uniforms
    truth = _groups(run, v0_engine, v0_digest, 0, key="k1", n=4, seq0=100)  # what v0 draws with them
    differ = {
        _scored(f, "k1").key
        for f, t in zip(forged, truth, strict=True)
        if any(a.tokens != b.tokens for a, b in zip(f.samples, t.samples, strict=True))
    }
    assert differ  # v1 moved every weight: most of its draws are not v0's
    adv = [1.0, -1.0] * 4
    checks = CheckSettings(lp_gap_base=None, plausibility_z=None, draw_tolerance=1e-3, stale_draw_audit=audit)
    stats = train_step(
        master, make_optimizer(master, 1e-4, (0.9, 0.99), 0.0), [_scored(g, "k1", adv) for g in honest + forged],
        LossSettings(), micro_batch_tokens=4096, grad_clip=1.0, policy_version=1, checks=checks,
        exact_draws=exact.rejudge.draws, forward_dtype=torch.bfloat16,
    )  # fmt: skip
    tally = stats.draws
    assert tally is not None
    if audit == 0.0:
        assert not any(k in stats.rejected for k in differ) and tally.audited == 0  # the hole, measured
    else:
        assert stats.rejected == dict.fromkeys(sorted(differ), "draw_mismatch")
        assert tally.audited + tally.flagged == tally.rows  # every stale row measured exactly


def test_the_exact_recheck_shares_prefixes_with_the_same_distances_as_whole_rows(run):
    """`Rejudge.draws` forwards the rows' prefix tree (each distinct prefix once, one call), or each distinct
    prompt once and every completion on its prompt's KV cache (rows of several groups, prompts of different
    lengths, rows cut at different lengths, positions without a uniform, as a tool's tokens): the same
    distances as forwarding each row whole, and a tampered token is found every way."""
    import dataclasses

    import torch

    from pnyx.train import prefix_tree
    from pnyx.train.drawcheck import cached_prompt_logits, prefix
    from pnyx.train.forward import Forward
    from pnyx.train.microbatch import build_rows
    from pnyx.train.prefix_tree import Tree, tree_logits
    from pnyx.train.rejudge import _distances, sharing_of

    engine, digest = _engine(run, "torch", 0)
    groups = _groups(run, engine, digest, 0, key="k1", n=8)
    assert len(groups) >= 3
    s0 = groups[0].samples[0]
    flipped = msgspec.structs.replace(s0, tokens=[(s0.tokens[0] + 1) % 10, *s0.tokens[1:]])
    groups[0] = msgspec.structs.replace(groups[0], samples=[flipped, *groups[0].samples[1:]])
    rows = build_rows([_scored(g, "k1") for g in groups])
    # cut at different lengths; in every other row the even positions after the first take no uniform
    rows = [prefix(r, len(r.completion) - i % 3) for i, r in enumerate(rows)]
    rows = [
        r
        if i % 2 == 0
        else dataclasses.replace(
            r, uniforms=[u if t == 0 or t % 2 else math.nan for t, u in enumerate(r.uniforms or ())]
        )
        for i, r in enumerate(rows)
    ]
    honest = len(rows)
    # and a group's rows under a shorter prompt (its distances are whatever they are, the same both ways)
    rows += [dataclasses.replace(r, prompt=r.prompt[3:]) for r in rows if r.key == rows[-1].key]
    published = _Exact(run).rejudge.published
    with published.lock:
        model = published.at(0)
    assert sharing_of(model) == "tree"  # the tiny model is a plain Qwen2
    whole = _distances(model, rows, sharing="none")
    assert whole[0] > 1e-3 and max(whole[1:honest]) == 0.0
    for sharing in ("tree", "prompts"):
        shared = _distances(model, rows, sharing=sharing)
        assert shared[0] > 1e-3  # the tampered row
        assert max(shared[1:honest]) <= 1e-5 and np.allclose(shared, whole, atol=1e-5), sharing
    # the logits themselves, at the wanted positions, against the row forwarded whole, in calls of a few
    # rows (the tree's node budget) and of all rows
    wanted = [[t for t, x in enumerate(r.uniforms or ()) if x == x] for r in rows]
    assert any(len(w) < len(r.completion) for w, r in zip(wanted, rows, strict=True))
    tree = Tree()
    for r in rows:
        tree.add(r.prompt + r.completion)
    assert len(tree.tokens) < sum(len(r.prompt) + len(r.completion) for r in rows) // 2  # shared prefixes
    with torch.no_grad():
        for logits_of, budget in ((cached_prompt_logits, None), (tree_logits, 1024), (tree_logits, 64)):
            prompts, completions = [r.prompt for r in rows], [r.completion for r in rows]
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(prefix_tree, "TREE_NODES", budget or prefix_tree.TREE_NODES)
                calls = list(logits_of(model, prompts, completions, wanted))
            assert sorted(k for part, _ in calls for k in part) == list(range(len(rows)))
            assert (len(calls) > 2) == (budget == 64), (logits_of, len(calls))
            for part, logits in calls:
                for j, k in enumerate(part):
                    r = rows[k]
                    alone = model(torch.tensor([r.prompt + r.completion])).logits[0, len(r.prompt) - 1 : -1]
                    assert torch.allclose(logits[j, : len(wanted[k])], alone[wanted[k]], atol=1e-4), k
    # the drift probe's log π as a tree (`Forward.logp`) against the padded forward of the same rows
    fwd = Forward(model, torch.device("cpu"), torch.float32, False)
    with torch.no_grad():
        tree_mb, padded = fwd.logp(rows), fwd.run(rows, entropy=False, var=False)
    assert torch.equal(tree_mb.lmask, padded.lmask) and bool(padded.lmask.any())
    assert torch.allclose(tree_mb.logp, padded.logp, atol=1e-5)


def test_the_prefix_tree_holds_each_distinct_prefix_once_and_fits_only_plain_attention_models():
    """`prefix_tree.Tree`: one node per distinct prefix, a node attends to its ancestors and itself only,
    positions are depths; `packs_prefixes` admits plain full-attention decoders and refuses a sliding
    window, mixed layer kinds, an unknown architecture, an attention that does not take the mask, and a
    model whose tree does not reproduce its rows on a first probe."""
    import torch
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    from pnyx.train.prefix_tree import Tree, packs_prefixes

    tree = Tree()
    assert tree.add([7, 8, 9]) == [0, 1, 2]
    assert tree.add([7, 8, 5]) == [0, 1, 3]  # shares 7, 8
    assert tree.missing([7, 8, 9, 6]) == 1 and tree.missing([7, 8, 9]) == 0 and tree.missing([5, 8]) == 2
    assert tree.add([7, 8, 9, 6]) == [0, 1, 2, 4]
    assert tree.tokens == [7, 8, 9, 5, 6] and tree.depth == [0, 1, 2, 2, 3]
    sees = tree.mask(torch.float32)[0, 0] == 0
    assert sees.tolist() == [
        [True, False, False, False, False],
        [True, True, False, False, False],
        [True, True, True, False, False],
        [True, True, False, True, False],  # 5 does not see its sibling 9
        [True, True, True, False, True],
    ]

    small = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, vocab_size=32)  # fmt: skip
    assert packs_prefixes(LlamaForCausalLM(LlamaConfig(**small)))
    assert packs_prefixes(Qwen2ForCausalLM(Qwen2Config(**small)))
    assert not packs_prefixes(
        Qwen2ForCausalLM(Qwen2Config(**small, use_sliding_window=True, sliding_window=4))
    )
    mixed = Qwen2Config(**small, layer_types=["full_attention", "sliding_attention"], sliding_window=4)
    assert not packs_prefixes(Qwen2ForCausalLM(mixed))
    assert not packs_prefixes(GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=32)))
    model = LlamaForCausalLM(LlamaConfig(**small))
    model.config._attn_implementation = "flash_attention_2"
    assert not packs_prefixes(model)
    # a model that passes every structural check but ignores the tree's mask (causal over the tree's order,
    # as another transformers release could) fails the proof on its first use: its rows are not packed
    from pnyx.train import prefix_tree

    unmasked = LlamaForCausalLM(LlamaConfig(**small))
    forward = unmasked.forward

    def causal_only(*args, attention_mask=None, **kwargs):
        mask = attention_mask if attention_mask is None or attention_mask.dim() == 2 else None
        return forward(*args, attention_mask=mask, **kwargs)

    unmasked.forward = causal_only  # type: ignore[method-assign]
    assert prefix_tree.tree_equals_rows(LlamaForCausalLM(LlamaConfig(**small)))
    assert not prefix_tree.tree_equals_rows(unmasked)
    assert not packs_prefixes(unmasked) and prefix_tree._PROVEN[unmasked] is False
