"""The exact re-check (`pnyx.train.rejudge`): a group the step's own forward would drop is judged again
under the published weights of the version it claims.

The scene is the one measured on SmolLM2 with a fast worker: an honest group sampled at v0 on a prompt the
step v0 -> v1 trained on hard, judged at v1. The master forward sees its logprobs moved far and rejects it;
under the exact v0 weights it is as plausible as a fresh group, so it is kept. A temperature liar on the
same prompt fails both ways.
"""

from __future__ import annotations

import pytest

from pnyx.protocol import layout
from pnyx.security.checks import CheckSettings
from pnyx.train.ingest import IngestSettings


@pytest.fixture
def scene(tmp_path):
    import torch
    from worker_support import create_signed_run

    from pnyx.config import shipped_model_path
    from pnyx.envs import get_env
    from pnyx.models import load_model, load_tokenizer
    from pnyx.rollout.cohort import CohortSpec, generate_cohort
    from pnyx.rollout.engines import make_engine
    from pnyx.rollout.sampling import SamplingParams
    from pnyx.store import open_store
    from pnyx.train.losses import LossSettings
    from pnyx.train.rescore import rescore
    from pnyx.train.step import make_optimizer, train_step
    from pnyx.weights import Publisher, Syncer
    from pnyx.weights.trust import run_verifier

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model_dir = shipped_model_path()
    env = get_env("arith")
    store = open_store(tmp_path / "run")
    manifest, signer = create_signed_run(store, {"worker": {}, "env": {}}, {"vocab_size": 10})
    master, tok = load_model(model_dir, dtype="float32"), load_tokenizer(model_dir)
    pub = Publisher(store, anchor_every=20, signer=signer)

    def cast() -> dict:
        return {k: v.detach().to(torch.bfloat16) for k, v in master.state_dict().items()}

    pub.publish(0, cast())
    syncer = Syncer(store, trust=run_verifier(manifest))
    syncer.sync(0)
    engine = make_engine("torch", model_dir, tok)
    engine.update(0, syncer.state, syncer.manifest)  # a worker: the published bf16 weights of v0

    def words(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    task = env.sample("train", 5, 1)[0]
    seq = iter(range(1 << 20))
    spec = CohortSpec(manifest.run_id, "w", 0, syncer.digest or "", 8, 1.0, 1.0, 0, 16, 3)

    def honest():
        for _ in range(40):  # a group with signal (zero-variance ones are not kept)
            res = generate_cohort(engine, tok, env, [task], spec, lambda: next(seq))
            if res.groups:
                g = res.groups[0]
                return rescore(layout.rollout_key(0, "w", g.seq), g, env=env, detokenize=words,
                               settings=IngestSettings())  # fmt: skip
        raise AssertionError("no group with signal in 40 cohorts")

    trained, stale = honest(), honest()
    # the liar: samples at temperature 0.3, records those logprobs and claims the run's 1.0
    cold = engine.generate(
        [list(stale.group.prompt_tokens)] * 8, SamplingParams(0.3, max_new_tokens=16, seed=3)
    )
    liar = stale.group.__class__(**{f: getattr(stale.group, f) for f in stale.group.__struct_fields__})
    liar.seq, liar.worker_id = 999, "liar"
    liar.samples = [
        s.__class__(tokens=c.tokens, logprobs=c.logprobs, loss_mask=[1] * len(c.tokens), reward=s.reward)
        for s, c in zip(stale.group.samples, cold, strict=True)
    ]
    liar_scored = rescore(layout.rollout_key(0, "liar", 999), liar, env=env, detokenize=words,
                          settings=IngestSettings())  # fmt: skip
    opt = make_optimizer(master, 3e-3, (0.9, 0.999), 0.0)
    for _ in range(3):  # the step v0 -> v1 trains hard on `trained`, the same prompt as `stale`
        train_step(master, opt, [trained], LossSettings(), micro_batch_tokens=4096, grad_clip=1.0)
    pub.publish(1, cast())
    return store, manifest, model_dir, master, stale, liar_scored


def judge_at_v1(scene, rejudge):
    import torch

    from pnyx.train.losses import LossSettings
    from pnyx.train.step import train_step

    _, _, _, master, stale, liar = scene
    opt = torch.optim.SGD(master.parameters(), lr=0.0)
    return train_step(
        master, opt, [stale, liar], LossSettings(), micro_batch_tokens=4096, grad_clip=1.0,
        policy_version=1, checks=CheckSettings(), rejudge=rejudge,
    )  # fmt: skip


def test_the_exact_recheck_keeps_the_honest_stale_group_and_still_rejects_the_liar(scene):
    from pnyx.train.published import PublishedModel
    from pnyx.train.rejudge import Rejudge
    from pnyx.weights.trust import run_verifier

    store, manifest, model_dir, _, stale, liar = scene
    without = judge_at_v1(scene, None)
    assert without.rejected.get(stale.key) is not None  # the master forward's verdict: drifted too far
    assert without.rejected.get(liar.key) is not None

    rejudge = Rejudge(PublishedModel(store, model_dir))
    rejudge.published.trust = run_verifier(manifest)
    stats = judge_at_v1(scene, rejudge)
    assert stale.key not in stats.rejected
    assert stats.rejudged == {stale.key: without.rejected[stale.key]}
    exact = stats.exact[stale.key]
    assert exact.staleness == 0 and exact.gap < 0.01  # under its own version: bf16 rounding only
    assert abs(exact.z) < 4.5
    assert stats.rejected.get(liar.key) is not None  # a liar fails under the exact weights too
    assert stats.verdict_evidence[stale.key] is exact
    assert rejudge.calls == 2


def test_without_the_run_key_nothing_is_rejudged(scene):
    from pnyx.train.published import PublishedModel
    from pnyx.train.rejudge import Rejudge

    store, _, model_dir, _, stale, _ = scene
    rejudge = Rejudge(PublishedModel(store, model_dir))  # trust not set: the exact weights cannot be verified
    stats = judge_at_v1(scene, rejudge)
    assert stats.rejected.get(stale.key) is not None and not stats.rejudged


def test_an_older_version_after_a_newer_one_is_rebuilt_exactly_without_failed_attempts(scene):
    from dataclasses import replace

    from pnyx.train.microbatch import build_rows
    from pnyx.train.published import PublishedModel
    from pnyx.train.rejudge import Rejudge
    from pnyx.weights.trust import run_verifier

    store, manifest, model_dir, _, stale, _ = scene
    rejudge = Rejudge(PublishedModel(store, model_dir))
    rejudge.published.trust = run_verifier(manifest)
    rows = build_rows([stale])
    first = rejudge(rows, 0)[stale.key]
    newer = rejudge([replace(r, version=1) for r in rows], 1)[stale.key]
    again = rejudge(rows, 0)[stale.key]
    assert newer.gap > 10 * max(first.gap, 1e-4)  # v1's weights are not v0's: the rows' own logprobs moved
    assert (again.gap, again.dev_sum, again.var_sum) == (first.gap, first.dev_sum, first.var_sum)
    assert rejudge.published._syncer is not None and not rejudge.published._syncer.failures


def test_prepare_does_the_first_checks_start_up_work_before_any_step_and_fetches_nothing(tmp_path):
    """`Rejudge.prepare` (called as the trainer starts): the model holds the newest version it keeps and its
    prefix tree is proven, so the first step's check pays neither; a plane that keeps nothing is left alone."""
    import torch
    from worker_support import create_signed_run

    from pnyx.config import shipped_model_path
    from pnyx.models import load_model
    from pnyx.store import open_store
    from pnyx.train import prefix_tree
    from pnyx.train.published import PublishedModel
    from pnyx.train.rejudge import Rejudge
    from pnyx.weights.trust import run_verifier

    store = open_store(tmp_path / "run")
    manifest, _ = create_signed_run(store, {"worker": {}, "env": {}}, {"vocab_size": 10})
    model_dir = shipped_model_path()
    empty = PublishedModel(store, model_dir)
    empty.trust = run_verifier(manifest)
    assert Rejudge(empty).prepare() >= 0 and empty.version is None and empty._model is None  # nothing fetched

    pm = PublishedModel(store, model_dir)
    pm.trust = run_verifier(manifest)
    state = {
        k: v.detach().to(torch.bfloat16)
        for k, v in load_model(model_dir, dtype="float32").state_dict().items()
    }
    pm.remember(0, "d0", state)
    pm.remember(1, "d1", {k: v + 1 if v.is_floating_point() else v for k, v in state.items()})
    assert pm.version is None  # remembered, not yet loaded
    Rejudge(pm).prepare()
    assert (pm.version, pm.digest) == (1, "d1")
    assert prefix_tree._PROVEN.get(pm._model) is True  # proven once, here: the first check reuses it
    name, param = next(iter(pm._params.items()))
    assert torch.equal(param.detach(), (state[name] + 1).float())


def test_the_trainer_measures_the_stale_groups_of_its_batch_while_it_waits_and_the_step_reads_them(tmp_path):
    """A trainer at v1 holds 4 of its 8 groups, stale v0 ones, and the rest lands 3 s into its wait: it
    measures the stale groups' rows exactly in that wait (`precheck` in the step's metrics: time that was
    waiting), and the step's exact re-check of every stale row its forward flags reads that measurement
    (`known`; here every stale row is measured exactly in the step, `security.stale_draw_audit` at 1.0:
    those the step's forward flags, and the rest as the audit) instead of running a forward on the step's
    path."""
    import threading

    from pnyx_harness.arena import Arena
    from pnyx_harness.producer import HonestWorker

    sec = {"committed_draws": False, "stale_draw_audit": 1.0}  # every stale row measured exactly in the step
    arena = Arena(tmp_path, {"trainer": {"groups_per_step": 8}, "security": sec})
    honest = [HonestWorker("honest-w1"), HonestWorker("honest-w2")]
    try:
        stale = [u for h in honest for u in h.uploads(arena, 2)]  # drawn at v0, uploaded after v1
        arena.upload([u for h in honest for u in h.uploads(arena, 4)])
        assert arena.step() is not None and arena.trainer.version == 1
        arena.upload(stale)
        rest = threading.Timer(3.0, lambda: arena.upload([u for h in honest for u in h.uploads(arena, 3)]))
        rest.start()
        rejudge = arena.trainer.parts.rejudge
        assert rejudge is not None
        measured = rejudge.draw_rows
        result = arena.step()
        rest.join()
        assert result is not None
        pre, tally = arena.trainer.waiting.precheck, result.stats.draws
        assert pre is not None and tally is not None
        kept = {g.key for g in result.groups if g.version == 0}
        stale_rows = sum(len(g.group.samples) for g in result.groups if g.version == 0)
        assert kept and pre["groups"] >= len(kept) and pre["rows"] >= stale_rows and pre["s"] > 0, pre
        n1, flagged, _ = tally.by_staleness["1"]
        assert n1 == stale_rows and flagged + tally.audited == n1, (tally.by_staleness, tally.audited)
        # every stale row, flagged (1-3 of 16-24 here) or audited, read from the wait's measurement
        assert pre.get("known") == n1, pre
        skips = (arena.trainer.waiting.skip_audit or {}).get(
            "rows", 0
        )  # honest skip records, checked in the wait
        assert rejudge.draw_rows - measured == pre["rows"] + skips  # no exact forward on the step's path
    finally:
        arena.close()
