"""Sampling checks, quarantine and per-key caps (issue #15 items 3-4): the step drops a hostile group with
its reason and takes its contribution out of the update; a key whose groups fail is quarantined, its later
groups are never downloaded, and the quarantine survives a restart; per-key caps bind. Real stores (tmp
folders), the real ingestor, real Ed25519 keys, the shipped tiny model for the step."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from ingest_support import ENV, RUN, make_group, put_signed, signed_ingestor

from pnyx.protocol import layout
from pnyx.protocol.codec import encode_group
from pnyx.security.checks import (
    CheckSettings,
    GroupEvidence,
    KeyEvidence,
    QuarantineSettings,
    judge,
    quarantine_reason,
)
from pnyx.security.signing import Signer
from pnyx.store import open_store
from pnyx.train.ingest import Cursor, Ingestor, IngestSettings

HONEST, OTHER, LIAR = (Signer(Ed25519PrivateKey.generate()) for _ in range(3))


class CountingStore:
    """A store that counts GETs per key (what the trainer downloads)."""

    def __init__(self, inner):
        self.inner = inner
        self.gets: list[str] = []

    def get(self, key, *a, **kw):
        self.gets.append(key)
        return self.inner.get(key, *a, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


_ingestor, _put = signed_ingestor, put_signed


# --- the statistics -----------------------------------------------------------------------------------


def test_judge_uses_a_bound_that_grows_with_staleness():
    s = CheckSettings(lp_gap_base=0.05, lp_gap_per_version=0.05, plausibility_z=4.0)
    assert s.gap_bound(0) == pytest.approx(0.05) and s.gap_bound(2) == pytest.approx(0.15)
    gap = GroupEvidence(staleness=0, tokens=100, gap_sum=8.0, dev_sum=0.0, var_sum=100.0)  # gap 0.08
    assert judge(gap, s) == "logprob_gap"
    assert judge(GroupEvidence(1, 100, 8.0, 0.0, 100.0), s) is None  # allowed one version behind
    assert judge(GroupEvidence(0, 100, 1.0, 45.0, 100.0), s) == "implausible"  # z = +4.5
    assert judge(GroupEvidence(0, 100, 1.0, -45.0, 100.0), s) == "implausible"  # z = -4.5
    assert judge(GroupEvidence(0, 100, 1.0, 35.0, 100.0), s) is None  # z = +3.5
    assert judge(GroupEvidence(0, 10, 0.0, -math.inf, 10.0), s) == "implausible"  # outside top-k/top-p
    off = CheckSettings(lp_gap_base=None, plausibility_z=None)
    assert judge(GroupEvidence(0, 100, 80.0, 450.0, 100.0), off) is None


def test_quarantine_rules_need_a_minimum_count_and_a_rate():
    q = QuarantineSettings(quarantine_rate=0.2, quarantine_min=5)
    assert quarantine_reason({"groups": 10, "implausible": 4}, None, q) is None  # under the minimum
    assert quarantine_reason({"groups": 100, "implausible": 5}, None, q) is None  # under the rate
    assert quarantine_reason({"groups": 20, "implausible": 5}, None, q) is not None
    assert quarantine_reason({"groups": 0, "bad_signature": 50, "stale": 50}, None, q) is None  # never blamed
    # a lying group is counted twice (its outcome and `reward_lie`) but judged once: 5 of 25, not 5 of 30
    assert "5 of 25 groups" in (quarantine_reason({"groups": 25, "reward_lie": 5}, None, q) or "")
    liar = KeyEvidence(n=16, z_sum=16 * 2.0)  # each group z=+2 passes alone; together key z = 8
    assert "implausible sampling" in (quarantine_reason({"groups": 16}, liar, q) or "")
    drift = KeyEvidence(n=10_000, z_sum=10_000 * 0.1)  # a small honest bias over a long run
    assert quarantine_reason({"groups": 10_000}, drift, q) is None


# --- quarantine in the ingestor -----------------------------------------------------------------------


def _reward_liar(store, ing: Ingestor, n: int, version: int = 0, start: int = 0) -> list[str]:
    keys = [
        _put(store, make_group(version, "liar", start + i, task_index=start + i, claimed=[0.0, 1.0]), LIAR)
        for i in range(n)
    ]
    ing.poll(version)
    ing.commit(keys)
    return keys


def test_reject_reward_lies_drops_every_lying_group_and_judges_it_once(tmp_path):
    """With `reject_reward_lies` (the trainer's default) a lying group is never selected: dropped as
    `reward_lie`, one fault and one judged group of its key; honest groups are untouched."""
    store = open_store(tmp_path / "s")
    ing = _ingestor(store, reject_reward_lies=True)
    honest = [_put(store, make_group(0, "w1", i, task_index=i), HONEST) for i in range(3)]
    lies = [_put(store, make_group(0, "liar", i, task_index=i, claimed=[0.0, 1.0]), LIAR) for i in range(4)]
    ing.poll(0)
    chosen = ing.select(0, 10)
    assert sorted(g.key for g in chosen) == sorted(honest)
    assert all(ing.cursor.rejected[k] == "reward_lie" for k in lies) and ing.cursor.drops["reward_lie"] == 4
    counts = ing.cursor.by_key[LIAR.fingerprint]
    assert counts["reward_lie"] == 4 and counts["lie_dropped"] == 4
    assert "4 of 4 groups" in (
        quarantine_reason(counts, None, QuarantineSettings(quarantine_rate=0.2, quarantine_min=4)) or ""
    )
    assert LIAR.fingerprint not in ing.cursor.quarantined  # default minimum: 5 faults
    _put(store, make_group(0, "liar", 4, task_index=4, claimed=[0.0, 1.0]), LIAR)
    ing.poll(0)
    assert LIAR.fingerprint in ing.cursor.quarantined


def test_a_key_whose_rewards_disagree_is_quarantined_and_its_later_groups_are_never_downloaded(tmp_path):
    inner = open_store(tmp_path / "s")
    store = CountingStore(inner)
    ing = _ingestor(store)
    honest = [_put(inner, make_group(0, "w1", i, task_index=i), HONEST) for i in range(3)]
    _reward_liar(inner, ing, 4)
    assert LIAR.fingerprint not in ing.cursor.quarantined  # 4 faults: under the minimum of 5
    _reward_liar(inner, ing, 1, start=4)
    assert LIAR.fingerprint in ing.cursor.quarantined
    assert ing.cursor.by_key[LIAR.fingerprint]["reward_lie"] == 5
    assert HONEST.fingerprint not in ing.cursor.quarantined
    # later groups under its bound name: counted from the listing, never fetched
    later = [_put(inner, make_group(1, "liar", 10 + i, task_index=i), LIAR) for i in range(3)]
    before = list(store.gets)
    ing.poll(1)
    assert all(ing.cursor.rejected.get(k) == "quarantined" for k in later)
    assert not set(later) & set(store.gets[len(before) :])
    assert ing.cursor.drops["quarantined"] == 3
    assert not set(honest) & set(ing.cursor.rejected)
    # under a fresh name: one GET (the signature names the key), then the name is bound to it
    fresh = _put(inner, make_group(1, "fresh", 0, task_index=5), LIAR)
    ing.poll(1)
    assert ing.cursor.rejected[fresh] == "quarantined" and ing.cursor.keys["fresh"] == LIAR.fingerprint
    again = _put(inner, make_group(1, "fresh", 1, task_index=6), LIAR)
    n = len(store.gets)
    ing.poll(1)
    assert ing.cursor.rejected[again] == "quarantined" and again not in store.gets[n:]
    report = ing.key_report()
    assert report[LIAR.fingerprint]["quarantined"] and report[LIAR.fingerprint]["names"] == ["fresh", "liar"]


def test_quarantine_survives_a_restart_in_the_cursor(tmp_path):
    inner = open_store(tmp_path / "s")
    ing = _ingestor(inner)
    _reward_liar(inner, ing, 5)
    assert LIAR.fingerprint in ing.cursor.quarantined
    saved = Cursor.from_json(ing.cursor_json())
    store = CountingStore(inner)
    resumed = _ingestor(store, cursor=saved)
    later = _put(inner, make_group(1, "liar", 20, task_index=1), LIAR)
    resumed.poll(1)
    assert resumed.cursor.rejected[later] == "quarantined" and later not in store.gets
    assert resumed.stats()["quarantined"] == saved.quarantined


def test_step_rejections_and_evidence_are_counted_per_key_at_commit(tmp_path):
    store = open_store(tmp_path / "s")
    ing = _ingestor(store)
    keys = [_put(store, make_group(0, "liar", i, task_index=i), LIAR) for i in range(6)]
    keys += [_put(store, make_group(0, "w1", i, task_index=i), HONEST) for i in range(6)]
    assert ing.poll(0) == 12
    ev = {k: GroupEvidence(0, 10, 0.1, 0.0, 10.0) for k in keys}
    rejected = {k: "implausible" for k in keys[:4]}
    ing.commit(keys[:6], rejected=rejected, evidence=ev)
    counts = ing.cursor.by_key[LIAR.fingerprint]
    assert counts["implausible"] == 4 and counts["groups"] == 2
    assert ing.cursor.drops["implausible"] == 4
    assert ing.cursor.evidence[LIAR.fingerprint].n == 6
    assert LIAR.fingerprint not in ing.cursor.quarantined  # 4 faults < 5
    liar_more = _put(store, make_group(0, "liar", 6, task_index=6), LIAR)
    ing.poll(0)
    ing.commit([liar_more], rejected={liar_more: "logprob_gap"})
    assert LIAR.fingerprint in ing.cursor.quarantined  # 5 of 7 judged groups failed
    # its fetched, unused groups went with it; the honest key's stay
    assert not any(g.signer == LIAR.fingerprint for g in ing.shared.ready.values())
    ing.commit(keys[6:], evidence=ev)
    assert HONEST.fingerprint not in ing.cursor.quarantined
    assert ing.cursor.evidence[HONEST.fingerprint].n == 6


def test_a_statistical_liar_is_quarantined_by_its_running_z(tmp_path):
    store = open_store(tmp_path / "s")
    ing = _ingestor(store)
    keys = [_put(store, make_group(0, "liar", i, task_index=i), LIAR) for i in range(12)]
    ing.poll(0)
    z2 = GroupEvidence(0, 100, 0.1, 20.0, 100.0)  # z = +2 per group: passes alone
    for i, k in enumerate(keys):
        ing.commit([k], evidence={k: z2})
        if i + 1 < 7:  # key z = 2·sqrt(n) > 5 needs n >= 7, and at least 8 groups are required
            assert LIAR.fingerprint not in ing.cursor.quarantined
    assert "implausible sampling" in ing.cursor.quarantined[LIAR.fingerprint]


def test_a_name_squatter_cannot_get_the_honest_owner_quarantined(tmp_path):
    """Names are first come, first bound: the squatter's key binds an honest worker's name first, so the
    honest worker's groups under it are `id_theft`. They are rejected, but never blamed on its key."""
    store = open_store(tmp_path / "s")
    ing = _ingestor(store)
    _put(store, make_group(0, "w1", 0, task_index=50), LIAR)  # the squatter takes the name
    ing.poll(0)
    victim = [_put(store, make_group(0, "w1", 1 + i, task_index=i), HONEST) for i in range(8)]
    own = _put(store, make_group(0, "w2", 0, task_index=20), HONEST)
    ing.poll(0)
    assert all(ing.cursor.rejected.get(k) == "id_theft" for k in victim)
    assert ing.cursor.by_key[HONEST.fingerprint]["id_theft"] == 8
    assert HONEST.fingerprint not in ing.cursor.quarantined
    assert own in ing.shared.ready  # its groups under its other name are still trained on


# --- per-key caps ---------------------------------------------------------------------------------------


def _two_keys(store, n_each: int) -> None:
    for i in range(n_each):
        _put(store, make_group(0, "a", i, task_index=i), HONEST)
        _put(store, make_group(0, "b", i, task_index=100 + i), OTHER)


def test_share_cap_binds_when_two_keys_can_fill_the_batch(tmp_path):
    store = open_store(tmp_path / "s")
    for i in range(8):
        _put(store, make_group(0, "a", i, task_index=i), HONEST)
    for i in range(3):
        _put(store, make_group(0, "b", i, task_index=100 + i), OTHER)
    for j in range(3):  # a Sybil-free flood under many names of one key
        for i in range(3):
            _put(store, make_group(0, f"a{j}", i, task_index=200 + 10 * j + i), HONEST)
    ing = _ingestor(store, max_key_share=0.5)
    ing.poll(0)
    chosen = ing.select(0, 6)
    assert chosen is not None and len(chosen) == 6
    by = {fp: sum(g.signer == fp for g in chosen) for fp in (HONEST.fingerprint, OTHER.fingerprint)}
    assert by == {HONEST.fingerprint: 3, OTHER.fingerprint: 3}
    # without the cap the round-robin of names gives the key with more names most places
    free = _ingestor(store)
    free.poll(0)
    assert sum(g.signer == HONEST.fingerprint for g in free.select(0, 6) or []) > 3


def test_a_lone_key_still_fills_a_batch_under_the_share_cap(tmp_path):
    store = open_store(tmp_path / "s")
    for i in range(10):
        _put(store, make_group(0, "a", i, task_index=i), HONEST)
    _put(store, make_group(0, "b", 0, task_index=50), OTHER)
    ing = _ingestor(store, max_key_share=0.5)
    ing.poll(0)
    chosen = ing.select(0, 8)
    assert chosen is not None and len(chosen) == 8
    assert sum(g.signer == OTHER.fingerprint for g in chosen) == 1  # the other key gave all it had


def test_hard_caps_per_step_and_per_version_bind(tmp_path):
    store = open_store(tmp_path / "s")
    _two_keys(store, 6)
    ing = _ingestor(store, max_groups_per_key_step=2)
    ing.poll(0)
    chosen = ing.select(0, 8) or []
    assert len(chosen) == 4 and {sum(g.signer == s.fingerprint for g in chosen) for s in (HONEST, OTHER)} == {
        2
    }
    ing = _ingestor(store, max_groups_per_key_version=3)
    ing.poll(0)
    first = ing.select(0, 4) or []
    ing.commit([g.key for g in first], first)
    second = ing.select(0, 8) or []
    total = first + second
    for s in (HONEST, OTHER):
        assert sum(g.signer == s.fingerprint for g in total) == 3


def test_trainer_config_feeds_the_checks_and_caps():
    from pnyx.config import load_config
    from pnyx.train.settings import check_settings, ingest_settings

    cfg = load_config(
        overrides={
            "security": {
                "lp_gap_base": 0.2,
                "plausibility_z": 5.0,
                "max_key_share": 0.25,
                "quarantine_min": 9,
            }
        }
    )
    s, c = ingest_settings(cfg), check_settings(cfg)
    assert (c.lp_gap_base, c.plausibility_z, s.max_key_share) == (0.2, 5.0, 0.25)
    assert s.quarantine is not None and s.quarantine.quarantine_min == 9 and s.checks == c


def test_status_shows_quarantined_keys():
    from pnyx.cli.live_view import quarantine_text

    fp = LIAR.fingerprint
    snap = SimpleNamespace(
        trainer={"quarantined": {fp: "5 of 7 groups faulty (implausible 5)"}, "keys": {fp: {"names": ["x"]}}},
        last={},
    )
    text = quarantine_text(snap)  # pyright: ignore[reportArgumentType]
    assert text is not None and fp[:8] in text and "implausible 5" in text and " x " in text
    assert quarantine_text(SimpleNamespace(trainer={}, last={})) is None  # pyright: ignore[reportArgumentType]


# --- the step: checks on the trainer's own forward, rejected before the optimizer step ----------------


@pytest.fixture(scope="module")
def shipped():
    import torch

    from pnyx.config import shipped_model_path
    from pnyx.models import load_model, load_tokenizer

    torch.set_num_threads(1)
    path = shipped_model_path()
    return load_model(path, dtype="float32"), load_tokenizer(path)


def _generated(model, tok, n: int, seed: int, temperature: float = 1.0, version: int = 0):
    """Honest arith groups from `model` at `temperature` (claimed T=1), re-scored by the trainer's code."""
    from pnyx.rollout.cohort import CohortSpec, generate_cohort
    from pnyx.rollout.engines import make_engine
    from pnyx.train.rescore import rescore

    spec = CohortSpec(RUN, "w", version, "d", 8, temperature, 1.0, 0, 48, seed)
    seq = iter(range(1 << 20))
    res = generate_cohort(
        make_engine("torch", None, tok, model=model),
        tok,
        ENV,
        ENV.sample("train", seed, n),
        spec,
        lambda: next(seq),
    )
    out = []
    for g in res.groups:
        g.temperature = 1.0
        key = layout.rollout_key(version, "w", g.seq)
        out.append(
            rescore(key, g, env=ENV, detokenize=lambda ids: tok.decode(ids, skip_special_tokens=True),
                    settings=IngestSettings())
        )  # fmt: skip
    return out


def _relabel(g, key: str):
    g = copy.deepcopy(g)
    g.key = key
    return g


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("budget", [4096, 120], ids=["whole-groups", "split-groups"])
def test_step_rejects_hostile_groups_before_the_optimizer_step(shipped, budget):
    """A logprob liar and a poisoner are dropped with their reasons; the update equals the update of the
    honest groups alone (their contribution was removed before the optimizer step): masked before the
    backward when a group fits one micro-batch, replayed with the opposite sign when it was split."""
    import torch

    from pnyx.models import completion_logprobs
    from pnyx.train.losses import LossSettings
    from pnyx.train.step import train_step

    model, tok = shipped
    honest = _generated(model, tok, 6, seed=1)[:3]
    liar = _relabel(honest[0], layout.rollout_key(0, "liar", 0))
    for s in liar.group.samples:
        s.logprobs = [x - 0.5 for x in s.logprobs]  # made-up behaviour logprobs
    poison = _relabel(honest[1], layout.rollout_key(0, "poison", 0))
    g = torch.Generator().manual_seed(0)
    for s in poison.group.samples:  # tokens the model would not sample, with the model's own logprobs
        s.tokens = torch.randint(2, 384, (40,), generator=g).tolist()
        s.loss_mask = [1] * 40
        with torch.no_grad():
            lp, _, _ = completion_logprobs(model, [list(poison.group.prompt_tokens)], [s.tokens])
        s.logprobs = lp[0].tolist()
    checks = CheckSettings()
    settings = LossSettings()

    def step(groups, checks_on: bool):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=1.0)  # the update is the gradient itself (Adam would
        # blow float noise in near-zero gradients up to a full step)
        stats = train_step(
            m, opt, groups, settings, micro_batch_tokens=budget, grad_clip=1e9, policy_version=0,
            checks=checks if checks_on else None,
        )  # fmt: skip
        return m, stats

    mixed, stats = step([honest[0], liar, honest[1], poison, honest[2]], True)
    assert stats.rejected == {liar.key: "logprob_gap", poison.key: "implausible"}
    assert (stats.undo_s > 0) == (budget < 1000)  # the replay runs only for split groups
    assert stats.evidence[poison.key].z < -10 and stats.evidence[liar.key].gap > 0.4
    for h in honest:
        assert judge(stats.evidence[h.key], checks) is None
    clean, clean_stats = step(honest, True)
    assert clean_stats.rejected == {}
    base = _params(model)

    def gap(m1, m2) -> float:  # the largest difference of the two updates, relative to the update
        num = max(
            float(((a - o) - (b - o)).abs().max())
            for a, b, o in zip(_params(m1), _params(m2), base, strict=True)
        )
        return num / max(float((b - o).abs().max()) for b, o in zip(_params(m2), base, strict=True))

    assert gap(mixed, clean) < 1e-5
    unchecked, _ = step([honest[0], liar, honest[1], poison, honest[2]], False)
    assert gap(unchecked, clean) > 1e-2


def test_step_takes_no_optimizer_step_when_every_group_fails(shipped):
    import torch

    from pnyx.train.losses import LossSettings
    from pnyx.train.step import make_optimizer, train_step

    model, tok = shipped
    liar = _generated(model, tok, 1, seed=2)[0]
    for s in liar.group.samples:
        s.logprobs = [x - 1.0 for x in s.logprobs]
    m = copy.deepcopy(model)
    opt = make_optimizer(m, 1e-3, (0.9, 0.99), 0.0)
    stats = train_step(
        m, opt, [liar], LossSettings(), micro_batch_tokens=512, grad_clip=1.0, policy_version=0,
        checks=CheckSettings(),
    )  # fmt: skip
    assert stats.rejected == {liar.key: "logprob_gap"}
    assert all(torch.equal(a, b) for a, b in zip(_params(m), _params(model), strict=True))


@pytest.mark.parametrize("budget", [4096, 120], ids=["whole-groups", "split-groups"])
def test_measure_evidence_is_the_evidence_the_step_judges(shipped, budget):
    """`measure_evidence` (a forward alone) and `train_step(checks=...)` prepare their micro-batches alike:
    the same per-group sums, to the bit."""
    import torch

    from pnyx.train.forward import measure_evidence
    from pnyx.train.losses import LossSettings
    from pnyx.train.step import train_step

    model, tok = shipped
    groups = _generated(model, tok, 4, seed=5)[:3]
    liar = _relabel(groups[0], layout.rollout_key(0, "liar", 0))
    for s in liar.group.samples:
        s.logprobs = [x - 0.5 for x in s.logprobs]
    groups.append(liar)
    m = copy.deepcopy(model)
    stats = train_step(
        m, torch.optim.SGD(m.parameters(), lr=0.1), groups, LossSettings(), micro_batch_tokens=budget,
        grad_clip=1.0, policy_version=1, checks=CheckSettings(),
    )  # fmt: skip
    assert stats.rejected == {liar.key: "logprob_gap"}
    assert measure_evidence(model, groups, 1, micro_batch_tokens=budget) == stats.evidence


def test_temperature_liar_is_implausible_and_honest_groups_are_not(shipped):
    """Sampled at T=0.3, claimed T=1 with the logprobs rewritten to the T=1 values of the same weights (so
    the logprob gap looks honest): only plausibility can tell, and does over the key's groups."""
    import torch

    from pnyx.models import completion_logprobs
    from pnyx.train.forward import measure_evidence

    model, tok = shipped
    honest = _generated(model, tok, 24, seed=3)
    liars = _generated(model, tok, 24, seed=4, temperature=0.3)
    for g in liars:
        for s in g.group.samples:
            with torch.no_grad():
                lp, _, _ = completion_logprobs(model, [list(g.group.prompt_tokens)], [s.tokens], 1.0)
            s.logprobs = lp[0].tolist()
    checks = CheckSettings()
    ev_h = measure_evidence(model, honest, 0)
    ev_l = measure_evidence(model, liars, 0)
    assert all(judge(e, checks) is None for e in ev_h.values())
    assert all(e.gap < 0.01 for e in ev_l.values())  # the logprob gap cannot see this liar
    mean_h = sum(e.z for e in ev_h.values()) / len(ev_h)
    mean_l = sum(e.z for e in ev_l.values()) / len(ev_l)
    assert abs(mean_h) < 0.7 and mean_l > 1.5
    key = KeyEvidence(n=len(ev_l), z_sum=sum(e.z for e in ev_l.values()))
    assert quarantine_reason({"groups": len(ev_l)}, key, QuarantineSettings()) is not None
    honest_key = KeyEvidence(n=len(ev_h), z_sum=sum(e.z for e in ev_h.values()))
    assert quarantine_reason({"groups": len(ev_h)}, honest_key, QuarantineSettings()) is None


# --- the trainer loop: checks, quarantine and resume together -------------------------------------------


def test_trainer_drops_a_logprob_liar_quarantines_its_key_and_keeps_it_across_a_resume(tmp_path):
    """Honest groups beside a worker whose behaviour logprobs are made up: every one of its groups that
    reaches a step is rejected there (`logprob_gap`), its key is quarantined after 5, the quarantine is in
    the checkpoint, and a resumed trainer never downloads that key's later groups."""
    from train_support import WORKER_SIGNER, make_trainer, write_groups

    from pnyx.protocol.codec import decode_group
    from pnyx.train import checkpoint
    from pnyx_harness.models import make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path / "model")
    url = str(tmp_path / "run")
    # The scripted "honest" worker writes reference answers, not samples of the model: plausibility would
    # (rightly) quarantine it too, so this test checks the logprob gap alone. The random tiny model moves
    # its logprobs of those answers by up to ~0.55 nats per step (measured here: honest gaps 0.36-0.54 one
    # version behind, 0.86 three behind), past the default per-version allowance (0.25, measured on the
    # shipped model), so the allowance is 1.0 and the liar is 5 nats off (its gap stays above 4).
    off = {
        "security__plausibility_z": None,
        "security__quarantine_key_z": None,
        "security__lp_gap_per_version": 1.0,
    }
    t = make_trainer(url, model_dir, run__steps=4, trainer__groups_per_step=4, **off)
    t.start()
    write_groups(t.store, model_dir, 0, 10)
    for key in write_groups(t.store, model_dir, 0, 8, worker="liar"):
        g = decode_group(t.store.get(key))
        for s in g.samples:
            s.logprobs = [x - 5.0 for x in s.logprobs]
        t.store.put(key, encode_group(g, signer=LIAR))  # same key, its own signature
    assert t.run() == 4
    cursor = t.parts.ingestor.cursor
    counts = cursor.by_key[LIAR.fingerprint]
    honest = cursor.by_key[WORKER_SIGNER.fingerprint]
    assert counts.get("logprob_gap", 0) >= 5 and counts.get("groups", 0) == 0
    assert honest["groups"] == 10 and not any(k in honest for k in ("logprob_gap", "implausible"))
    assert LIAR.fingerprint in cursor.quarantined
    rejected = [m.get("rejected", {}) for m in checkpoint.read_metrics(t.store)]
    assert sum(r.get("logprob_gap", 0) for r in rejected) == counts["logprob_gap"]
    again = make_trainer(url, model_dir, resume=True, run__steps=5, trainer__groups_per_step=4, **off)
    again.start()
    assert LIAR.fingerprint in again.parts.ingestor.cursor.quarantined
    counting = CountingStore(again.store)
    again.parts.ingestor.store = counting
    later = write_groups(again.store, model_dir, 4, 3, worker="liar")  # signed by the honest test key...
    for key in later:  # ...re-signed by the quarantined one
        t.store.put(key, encode_group(decode_group(t.store.get(key)), signer=LIAR))
    again.parts.ingestor.poll(4)
    assert all(again.parts.ingestor.cursor.rejected.get(k) == "quarantined" for k in later)
    assert not set(later) & set(counting.gets)


def test_fair_share_gives_each_of_three_keys_a_third_of_the_batch(tmp_path):
    store = open_store(tmp_path / "s")
    third = Signer(Ed25519PrivateKey.generate())
    for i in range(6):
        _put(store, make_group(0, "a", i, task_index=i), HONEST)
        _put(store, make_group(0, "b", i, task_index=100 + i), OTHER)
    for j in range(4):  # the eager key: 24 groups under 4 names
        for i in range(6):
            _put(store, make_group(0, f"x{j}", i, task_index=200 + 10 * j + i), third)
    ing = _ingestor(store, max_key_share="fair")
    ing.poll(0)
    ing.fetch([k for lst in ing.listing.versions.values() for ks in lst.pending.values() for k in ks])
    chosen = ing.select(0, 9)
    assert chosen is not None and len(chosen) == 9
    assert [sum(g.signer == s.fingerprint for g in chosen) for s in (HONEST, OTHER, third)] == [3, 3, 3]
    # under a fixed share of 0.5 the eager key takes ceil(0.5 * 9) = 5 places
    half = _ingestor(store, max_key_share=0.5)
    half.poll(0)
    half.fetch([k for lst in half.listing.versions.values() for ks in lst.pending.values() for k in ks])
    assert sum(g.signer == third.fingerprint for g in half.select(0, 9) or []) == 5


def test_fair_share_lets_a_lone_key_fill_the_batch(tmp_path):
    store = open_store(tmp_path / "s")
    for i in range(8):
        _put(store, make_group(0, "a", i, task_index=i), HONEST)
    ing = _ingestor(store, max_key_share="fair")
    ing.poll(0)
    assert len(ing.select(0, 8) or []) == 8


def test_a_key_over_the_flood_limit_is_quarantined_and_its_groups_never_downloaded(tmp_path):
    store = CountingStore(open_store(tmp_path / "s"))
    for i in range(4):
        _put(store, make_group(0, "a", i, task_index=i), HONEST)
    flood = [
        _put(store, make_group(0, f"f{j}", i, task_index=100 + 10 * j + i), LIAR)
        for j in range(3)
        for i in range(5)
    ]
    ing = _ingestor(store, flood_limit=10)
    ing.poll(0)  # lists 15 groups of 3 unbound names; one GET per name binds it to LIAR: 5, 10, 15 > 10
    assert LIAR.fingerprint in ing.cursor.quarantined
    assert "flooding: 15 groups at version 0" in ing.cursor.quarantined[LIAR.fingerprint]
    assert HONEST.fingerprint not in ing.cursor.quarantined
    assert all(ing.cursor.rejected.get(k) == "quarantined" for k in flood if k not in ing.cursor.uses)
    assert (
        sum(k in flood for k in store.gets) <= 3 + ing.admission.fetch_workers
    )  # a name is bound by one GET
    chosen = ing.select(0, 8) or []
    assert {g.signer for g in chosen} == {HONEST.fingerprint} and len(chosen) == 4
    # a later upload of the flooder under a name it already used is counted from the listing
    before = len(store.gets)
    late = _put(store, make_group(0, "f0", 99, task_index=199), LIAR)
    ing.poll(0)
    assert ing.cursor.rejected.get(late) == "quarantined" and late not in store.gets[before:]
    # the quarantine survives a restart (the cursor)
    again = _ingestor(store, Cursor.from_json(ing.cursor_json()), flood_limit=10)
    assert LIAR.fingerprint in again.cursor.quarantined


def test_junk_and_copies_under_an_honest_name_never_quarantine_its_key(tmp_path):
    """Anyone who can write to the store can put objects under an honest worker's name: 30 one-byte objects
    and 10 copies of one of its signed records under other seqs, 44 listed seqs where the limit is 10. The
    listing counts them without a read (it once quarantined the honest key for flooding on that count);
    the flood audit reads each once, rejects it (`bad_magic`; `key_mismatch`, not blamed on the key that
    signed the copied record) and the key keeps its four groups."""
    from pnyx.security.checks import faults

    store = CountingStore(open_store(tmp_path / "s"))
    honest = [_put(store, make_group(0, "a", i, task_index=i), HONEST) for i in range(4)]
    ing = _ingestor(store, flood_limit=10)
    ing.poll(0)  # binds "a" to HONEST
    assert ing.cursor.keys["a"] == HONEST.fingerprint
    junk = [layout.rollout_key(0, "a", 100 + i) for i in range(30)]
    for key in junk:
        store.put(key, b"x", mode="create")
    record = store.inner.get(honest[0])
    copies = [layout.rollout_key(0, "a", 200 + i) for i in range(10)]
    for key in copies:
        store.put(key, record, mode="create")
    before = len(store.gets)
    ing.refresh(0)  # 44 seqs of "a" listed: a flood suspect, nothing read yet
    assert (HONEST.fingerprint, 0, "groups") in ing.ledger.suspects and len(store.gets) == before
    ing.audit_skips()
    # read in rounds of 11 - 4 proven = 7 until what is left is no flood: 35 reads, each key at most once,
    # leaving the 4 groups and 5 unread
    assert ing.cursor.quarantined == {} and not ing.ledger.suspects
    read = store.gets[before:]
    assert len(read) == len(set(read)) == ing.floods.reads == 35 and set(read) <= set(junk + copies)
    assert ing.listing.versions[0].by_key[HONEST.fingerprint, "groups"] == 9
    ing.poll(0)  # admission reads the last 5 as it would any listed key
    assert ing.cursor.quarantined == {}
    assert {ing.cursor.rejected[k] for k in junk} == {"bad_magic"}
    assert {ing.cursor.rejected[k] for k in copies} == {"key_mismatch"}
    assert ing.listing.versions[0].by_key[HONEST.fingerprint, "groups"] == 4
    assert faults(ing.cursor.by_key.get(HONEST.fingerprint, {})) == 0
    chosen = ing.select(0, 4) or []
    assert sorted(g.key for g in chosen) == sorted(honest)
    # admission blames no one for a copy either (it once counted it as a fault of the key that signed it)
    again = _ingestor(store, flood_limit=None)
    again.poll(0)
    assert again.cursor.drops.get("key_mismatch") == 10
    assert faults(again.cursor.by_key[HONEST.fingerprint]) == 0


def test_a_bound_key_that_floods_is_quarantined_after_limit_plus_one_records(tmp_path):
    """A key whose name is bound floods later: the audit reads only what proves more than the limit
    (11 records signed by the key, the 4 groups already fetched among them), then rejects the rest
    without a read."""
    store = CountingStore(open_store(tmp_path / "s"))
    for i in range(4):
        _put(store, make_group(0, "f", i, task_index=i), LIAR)
    ing = _ingestor(store, flood_limit=10)
    ing.poll(0)
    flood = [_put(store, make_group(0, "f", i, task_index=i), LIAR) for i in range(4, 44)]
    before = len(store.gets)
    ing.refresh(0)
    ing.audit_skips()
    assert (
        "flooding: 44 groups at version 0 (11 of them signed by this key)"
        in ing.cursor.quarantined[LIAR.fingerprint]
    )
    assert len(store.gets) - before == 7 and ing.floods.reads == 7
    assert all(ing.cursor.rejected.get(k) == "quarantined" for k in flood)


def test_keys_under_the_flood_limit_are_not_quarantined(tmp_path):
    store = open_store(tmp_path / "s")
    _two_keys(store, 10)
    ing = _ingestor(store, flood_limit=10)
    ing.poll(0)
    ing.fetch([k for lst in ing.listing.versions.values() for ks in lst.pending.values() for k in ks])
    assert ing.cursor.quarantined == {}
    assert ing.listing.versions[0].by_key == {
        (HONEST.fingerprint, "groups"): 10,
        (OTHER.fingerprint, "groups"): 10,
    }


def test_flood_limit_defaults_to_twice_what_a_version_can_feed_and_workers_stop_at_half():
    from pnyx.config import load_config
    from pnyx.protocol.rules import flood_limit, worker_version_cap
    from pnyx.train.settings import ingest_settings

    cfg = load_config(overrides={"trainer": {"groups_per_step": 8}, "algorithm": {"max_staleness": 3}})
    assert flood_limit(cfg) == 64 and ingest_settings(cfg).flood_limit == 64
    assert worker_version_cap(cfg) == 32
    assert worker_version_cap(load_config(overrides={"worker": {"max_groups_per_version": 5}})) == 5
    off = load_config(overrides={"security": {"flood_limit": None}})
    assert flood_limit(off) is None and worker_version_cap(off) is None
    assert ingest_settings(load_config()).max_key_share == "fair"
