"""Self-calibrating sampling checks (issue #23): allowances derived from the run, trusted keys, starvation.

- the derived allowances never fall below the fixed floors, widen the gap bound with the drift the trainer
  measured itself, and correct z for it (`pnyx.security.calibration`);
- untrusted keys never widen an allowance; trusted keys calibrate their engine and are never quarantined
  (their faulty groups are still dropped); an untrusted key with the same evidence is;
- the step's drift probe measures its own update (0 at learning rate 0) on rows it did not train on;
- a starving trainer says which key is quarantined, for which check, and what to do.
Real stores (tmp folders), the real ingestor, real Ed25519 keys, the shipped tiny model for the step.
"""

from __future__ import annotations

import math

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from ingest_support import ENV, RUN, make_group, put_signed, signed_ingestor

from pnyx.protocol import layout
from pnyx.security.calibration import (
    BASE_MARGIN,
    GAP_MARGIN,
    MIN_ALL,
    MIN_TRUSTED,
    NOISE_PER_DRIFT,
    Z_CENTER_MAX,
    Z_DRIFT_MARGIN,
    Allowances,
    Calibration,
    Drift,
    ProbeRow,
    choose_probe,
    derive,
    evidence_summary,
)
from pnyx.security.checks import CheckSettings, GroupEvidence, QuarantineSettings, judge, quarantine_reason
from pnyx.security.signing import Signer
from pnyx.store import open_store
from pnyx.train.ingest import IngestSettings
from pnyx.train.progress import starving_note

MINE, STRANGER = (Signer(Ed25519PrivateKey.generate()) for _ in range(2))


_ingestor, _put = signed_ingestor, put_signed


def test_without_measurements_the_allowances_are_the_fixed_floors():
    floors = CheckSettings()
    a = derive(floors, Calibration(), version=5, max_staleness=3)
    for s in range(4):
        assert a.gap_bound(s, "torch") == pytest.approx(floors.lp_gap_base + floors.lp_gap_per_version * s)
    ev = GroupEvidence(1, 100, 1.0, -30.0, 100.0, engine="torch")
    assert a.z_adj(ev) == pytest.approx(ev.z) == pytest.approx(-3.0)
    assert derive(floors, None, 5, 3) == Allowances(floors)


def test_the_gap_bound_widens_with_the_drift_the_trainer_measured_and_never_narrows():
    floors = CheckSettings()
    calib = Calibration()
    for v, a in ((7, 0.30), (8, 0.20), (9, 0.10)):  # the probe of step v -> v+1
        calib.note_drift(v, (a, 64, True))
    allow = derive(floors, calib, version=10, max_staleness=3)
    # a group sampled at 9 and judged at 10 moved by step 9's drift; one from 7 by steps 7, 8 and 9; the
    # fresh base (rounding noise) is at least half the largest drift kept
    base = NOISE_PER_DRIFT * 0.30
    assert allow.gap_bound(1) == pytest.approx(base + GAP_MARGIN * 0.10)
    assert allow.gap_bound(3) == pytest.approx(base + GAP_MARGIN * 0.60)
    assert allow.gap_bound(0) == pytest.approx(base)
    calm = Calibration()
    for v in (7, 8, 9):
        calm.note_drift(v, (0.001, 64, True))
    still = derive(floors, calm, 10, 3)
    assert [still.gap_bound(s) for s in range(4)] == pytest.approx([0.03, 0.28, 0.53, 0.78])


def test_z_is_centred_on_what_honest_groups_of_its_engine_and_staleness_show():
    calib = Calibration()
    for i in range(MIN_ALL):  # the population one version behind sits near -1.2
        calib.note_group("torch", 1, 0.3, -1.2 + 0.01 * (i % 5), trusted=False)
    a = derive(CheckSettings(), calib, version=5, max_staleness=3)
    assert a.center("torch", 1) == pytest.approx(-1.18) and a.center("torch", 0) == 0.0
    ev = GroupEvidence(1, 400, 4.0, -1.18 * 20.0, 400.0, engine="torch")  # raw z -1.18
    assert a.z_adj(ev) == pytest.approx(0.0, abs=1e-9)
    poison = GroupEvidence(1, 400, 4.0, (-1.18 - 6.0) * 20.0, 400.0, engine="torch")
    assert judge(poison, a) == "implausible" and a.z_adj(poison) == pytest.approx(-6.0)
    # a crowd cannot move the population's centre above 0 or below -Z_CENTER_MAX
    liars = Calibration()
    for _ in range(MIN_ALL):
        liars.note_group("torch", 0, 0.0, +1.7, trusted=False)
        liars.note_group("torch", 1, 0.0, -40.0, trusted=False)
    crowd = derive(CheckSettings(), liars, 5, 3)
    assert crowd.center("torch", 0) == 0.0 and crowd.center("torch", 1) == -Z_CENTER_MAX
    # trusted groups set their own bucket, which wins over the population's
    for _ in range(MIN_TRUSTED):
        calib.note_group("mlx", 1, 0.3, -0.4, trusted=True)
    both = derive(CheckSettings(), calib, 5, 3)
    assert both.center("mlx", 1) == pytest.approx(-0.4) and both.center("torch", 1) != pytest.approx(-0.4)
    # a staleness not measured yet borrows the nearest lower one's centre for a single group's check, but
    # the key statistic counts only measured buckets
    assert both.center("mlx", 3) == pytest.approx(-0.4) and both.calibrated_center("mlx", 3) is None
    assert both.center("vllm", 0) == 0.0


def test_trusted_groups_calibrate_their_engine_and_untrusted_ones_never_do(tmp_path):
    store = open_store(tmp_path / "s")
    ing = _ingestor(store, trusted_keys=frozenset({MINE.fingerprint}))
    mine = [_put(store, make_group(0, "mine", i, task_index=i), MINE) for i in range(MIN_TRUSTED)]
    theirs = [_put(store, make_group(0, "them", i, task_index=i), STRANGER) for i in range(MIN_TRUSTED)]
    assert ing.poll(0) == 2 * MIN_TRUSTED
    # a noisy engine: the stranger's gap is huge, the user's own is 0.05 (above the 0.03 floor)
    ev = {k: GroupEvidence(0, 10, 0.5, 0.0, 10.0, engine="mlx") for k in mine}
    ev |= {k: GroupEvidence(0, 10, 9.0, -5.0, 10.0, engine="evil") for k in theirs}
    ing.commit(mine + theirs, evidence=ev, version=0)
    calib = ing.cursor.calibration
    assert set(calib.gap0) == {"mlx"} and set(calib.zt) == {"mlx/0"}
    a = ing.allowances(1)
    assert a.gap_bound(0, "mlx") == pytest.approx(BASE_MARGIN * 0.05)  # x the trusted max
    assert a.gap_bound(0, "evil") == pytest.approx(0.03)  # the floor: a stranger cannot buy room
    assert a.gap_bound(0, "torch") == pytest.approx(0.03)


def test_a_trusted_key_is_never_quarantined_but_its_faulty_groups_are_still_dropped(tmp_path):
    store = open_store(tmp_path / "s")
    ing = _ingestor(store, trusted_keys=frozenset({MINE.fingerprint}))
    mine = [_put(store, make_group(0, "mine", i, task_index=i), MINE) for i in range(12)]
    theirs = [_put(store, make_group(0, "them", i, task_index=i), STRANGER) for i in range(12)]
    ing.poll(0)
    drifted = GroupEvidence(0, 100, 0.01, -20.0, 100.0, engine="torch")  # z = -2 on every group
    faulty = {k: "logprob_gap" for k in mine[:6] + theirs[:6]}
    ing.commit(mine + theirs, rejected=faulty, evidence={k: drifted for k in mine + theirs})
    assert STRANGER.fingerprint in ing.cursor.quarantined
    assert MINE.fingerprint not in ing.cursor.quarantined
    assert ing.cursor.by_key[MINE.fingerprint]["logprob_gap"] == 6  # dropped and counted all the same
    assert ing.cursor.drops["logprob_gap"] == 12
    report = ing.key_report()
    assert report[MINE.fingerprint]["trusted"] and not report[STRANGER.fingerprint]["trusted"]


def test_a_whole_run_that_drifts_is_not_quarantined_even_for_groups_judged_before_calibration(tmp_path):
    """The SmolLM2 failure: every honest group's raw z sat near -1 because the policy moved between
    sampling and training, and the key's running z crossed -5 at 32 groups. Now the key is judged against
    the run's measured centre, and the groups it had before the centre existed are re-centred too."""
    store = open_store(tmp_path / "s")
    keys = [_put(store, make_group(0, "w", i, task_index=i), STRANGER) for i in range(48)]
    calibrated = _ingestor(store)
    assert calibrated.poll(0) == 48
    ev = GroupEvidence(1, 200, 2.0, -1.0 * math.sqrt(200.0), 200.0, engine="torch")  # raw z -1.0
    for k in keys:
        calibrated.commit([k], evidence={k: ev}, version=1)
    assert STRANGER.fingerprint not in calibrated.cursor.quarantined
    # the old rule (centre 0 for everyone) would have quarantined it
    old = quarantine_reason(
        {"groups": 48}, calibrated.cursor.evidence[STRANGER.fingerprint], QuarantineSettings()
    )
    assert old is not None and "implausible sampling over 48 groups (key z -6.9" in old
    assert calibrated.key_report()[STRANGER.fingerprint]["key_z"] == pytest.approx(0.0, abs=1e-6)
    # a liar among them, 1.5 below the honest centre, stands apart and is quarantined
    liar = [_put(store, make_group(0, "liar", i, task_index=i), MINE) for i in range(20)]
    calibrated.poll(0)
    low = GroupEvidence(1, 200, 2.0, -2.5 * math.sqrt(200.0), 200.0, engine="torch")
    for k in liar:
        calibrated.commit([k], evidence={k: low}, version=1)
    assert "where honest groups show -1.00" in calibrated.cursor.quarantined[MINE.fingerprint]


def test_a_crowd_that_pulls_the_population_centre_down_cannot_frame_an_honest_key(tmp_path):
    """The population's centre (no trusted keys) is the median of every checked group, so a crowd of keys
    with low z pulls it down, and an honest key at z 0 stood above it: quarantined on the upper side (the
    attack suite's arena, key z +6.6 over 170 groups). The upper side is judged against the trusted keys'
    centres, else 0, which no upload moves: the honest key stays, a key above 0 is still quarantined, and
    the crowd's own bucket is still judged low against its centre on the lower side."""
    store = open_store(tmp_path / "s")
    honest, liar = (Signer(Ed25519PrivateKey.generate()) for _ in range(2))
    ing = _ingestor(store)

    def checked(signer: Signer, name: str, n: int, raw: float) -> None:
        """`n` groups of `signer`'s checked with raw z `raw` at staleness 1."""
        keys = [_put(store, make_group(0, name, i, task_index=i), signer) for i in range(n)]
        assert ing.poll(0) == n
        ev = GroupEvidence(1, 200, 2.0, raw * math.sqrt(200.0), 200.0, engine="torch")
        for k in keys:
            ing.commit([k], evidence={k: ev}, version=1)

    checked(STRANGER, "crowd", 40, -1.5)
    checked(honest, "honest", 24, 0.0)
    centre = ing.allowances(2).calibrated_center
    assert centre("torch", 1) == pytest.approx(-1.5)  # the crowd's median
    assert honest.fingerprint not in ing.cursor.quarantined, ing.cursor.quarantined
    framed = quarantine_reason(
        {"groups": 24}, ing.cursor.evidence[honest.fingerprint], QuarantineSettings(), centre
    )
    assert framed is not None and "where honest groups show -1.50" in framed  # the old rule's upper side
    checked(liar, "liar", 24, 1.5)
    assert "where honest groups show +0.00" in ing.cursor.quarantined[liar.fingerprint]
    assert STRANGER.fingerprint not in ing.cursor.quarantined  # the crowd is the centre it made


def test_the_probe_is_held_out_from_the_step_and_prefers_trusted_keys(tmp_path):
    store = open_store(tmp_path / "s")
    ing = _ingestor(store, trusted_keys=frozenset({MINE.fingerprint}))
    mine = _put(store, make_group(0, "mine", 0, task_index=0), MINE)
    theirs = [_put(store, make_group(0, "them", i, task_index=i + 1), STRANGER) for i in range(3)]
    ing.poll(0)
    groups = ing.select(0, 4)
    probe = choose_probe(groups, {theirs[0]: "implausible"}, frozenset({MINE.fingerprint}))
    mine_group = next(g for g in groups if g.key == mine)
    assert probe[0].prompt == list(mine_group.group.prompt_tokens)  # the trusted key's first
    rejected_group = next(g for g in groups if g.key == theirs[0])
    assert all(p.completion not in [s.tokens for s in rejected_group.group.samples] for p in probe)
    ing.commit([g.key for g in groups], groups, {theirs[0]: "implausible"}, version=0)
    assert ing.probe() == probe


def test_a_probe_measures_probe_steps_steps_before_new_rows_are_chosen(tmp_path):
    """A probe's rows are re-forwarded for `PROBE_STEPS` steps (the forward after one step is the forward
    before the next, so a kept probe costs one forward a step); a step that measured nothing, or replay,
    chooses new rows at once."""
    from pnyx.security.calibration import PROBE_STEPS

    store = open_store(tmp_path / "s")
    ing = _ingestor(store)
    for i in range(PROBE_STEPS + 2):
        _put(store, make_group(0, "w", i, task_index=i), MINE)
    ing.poll(0)
    groups = ing.select(0, PROBE_STEPS + 2)
    ing.commit([groups[0].key], groups[:1], version=0)  # the first step: nothing measured, rows chosen
    first = ing.probe()
    assert first
    seen = []
    for v in range(1, PROBE_STEPS + 1):
        ing.commit([groups[v].key], groups[v : v + 1], drift=Drift(0.01, 10, True), version=v)
        seen.append(ing.probe())
    assert seen[: PROBE_STEPS - 1] == [first] * (PROBE_STEPS - 1)  # PROBE_STEPS steps measured them
    assert seen[-1] and seen[-1] != first  # then rows of the newest step
    g = groups[PROBE_STEPS + 1]
    ing.commit([g.key], [g], drift=None, version=PROBE_STEPS + 1)  # no update measured: new rows at once
    assert ing.probe() != seen[-1]


def test_the_drift_probe_measures_the_step_it_did_not_train_on():
    import torch

    from pnyx.config import PnyxConfig, shipped_model_path
    from pnyx.models import load_model, load_tokenizer
    from pnyx.rollout.cohort import CohortSpec, generate_cohort
    from pnyx.rollout.engines import make_engine
    from pnyx.train.losses import LossSettings
    from pnyx.train.microbatch import Row
    from pnyx.train.rescore import rescore
    from pnyx.train.step import make_optimizer, train_step

    torch.manual_seed(0)
    torch.set_num_threads(1)
    path = shipped_model_path()
    model, tok = load_model(path, dtype="float32"), load_tokenizer(path)
    spec = CohortSpec(RUN, "w", 0, "d", 8, 1.0, 1.0, 0, 16, 3)
    seq = iter(range(1 << 20))
    res = generate_cohort(
        make_engine("torch", None, tok, model=model),
        tok,
        ENV,
        ENV.sample("train", 3, 6),
        spec,
        lambda: next(seq),
    )

    def words(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    groups = [
        rescore(layout.rollout_key(0, "w", g.seq), g, env=ENV, detokenize=words, settings=IngestSettings())
        for g in res.groups
    ]
    trained = [g for g in groups if len(set(g.rewards)) > 1][:2] or groups[:2]
    held = [g for g in groups if g not in trained]
    probe = [
        Row(p.prompt, p.completion, [0.0] * len(p.completion), p.mask, 0.0, p.sampling)
        for p in choose_probe(held, {}, frozenset())
    ]
    assert probe and all(isinstance(p, Row) for p in probe)
    cfg = PnyxConfig()
    drifts = {}
    for lr in (0.0, 1e-3):
        m = load_model(path, dtype="float32")
        opt = make_optimizer(m, lr, cfg.trainer.betas, 0.0)
        stats = train_step(
            m, opt, trained, LossSettings(), micro_batch_tokens=4096, grad_clip=1.0, policy_version=0,
            lr=lr, checks=Allowances(CheckSettings()), probe=probe,
        )  # fmt: skip
        assert stats.drift is not None and stats.drift[1] == sum(sum(p.loss_mask) for p in probe)
        assert stats.drift[2] is True  # held out
        drifts[lr] = stats.drift
    assert drifts[0.0][0] == pytest.approx(0.0, abs=1e-6)
    assert drifts[1e-3][0] > 1e-3  # the update moved the held-out rows' logprobs

    # The same rows at the next step: the forward after this step is exactly the forward before the next
    # (`train_step(probe_before=)`, how the trainer spares it), so the second step measures the same drift
    # whether it forwards them again or not.
    lenient = CheckSettings(lp_gap_base=None, plausibility_z=None)  # the second step trains on stale rows

    def two_steps(reuse: bool):
        m = load_model(path, dtype="float32")
        opt = make_optimizer(m, 1e-3, cfg.trainer.betas, 0.0)
        kw = dict(micro_batch_tokens=4096, grad_clip=1.0, lr=1e-3, checks=Allowances(lenient), probe=probe)
        first = train_step(m, opt, trained, LossSettings(), policy_version=0, **kw)
        assert first.probe_after is not None
        before = first.probe_after if reuse else None
        second = train_step(m, opt, trained, LossSettings(), policy_version=1, probe_before=before, **kw)
        return second

    kept, fresh = two_steps(True), two_steps(False)
    assert kept.drift == fresh.drift and kept.drift is not None and kept.drift[0] > 1e-3
    assert isinstance(
        ProbeRow(probe[0].prompt, probe[0].completion, probe[0].loss_mask, probe[0].sampling), ProbeRow
    )


def test_until_a_staleness_is_calibrated_its_lower_z_limit_widens_by_the_drift_the_probe_measured():
    """mlx on SmolLM2, v1-v4: groups one version behind showed raw z down to -4.8 before 8 trusted groups
    had calibrated that bucket, and were judged against the fresh bucket's centre (+0.2)."""
    calib = Calibration()
    for _ in range(MIN_TRUSTED):
        calib.note_group("mlx", 0, 0.01, 0.2, trusted=True)  # the fresh bucket is calibrated: centre 0.2
    calib.note_drift(3, Drift(0.05, 64, True))  # the step 3 -> 4 moved log q by 0.05 a token
    a = derive(CheckSettings(), calib, version=4, max_staleness=3)
    one_behind = GroupEvidence(1, 100, 100 * 0.2, -48.0, 100.0, engine="mlx")  # z -4.8, 100 tokens
    low, high = a.z_range(one_behind)
    assert low == pytest.approx(0.2 - 4.5 - Z_DRIFT_MARGIN * 0.05 * 100 / 10)  # centre, limit, drift
    assert high == pytest.approx(0.2 + 4.5)  # the upper side is not widened
    assert judge(one_behind, a) is None
    assert judge(one_behind, derive(CheckSettings(), Calibration(), 4, 3)) == "implausible"  # no probe: -4.5
    assert judge(GroupEvidence(1, 100, 20.0, 48.0, 100.0, engine="mlx"), a) == "implausible"  # z +4.8
    assert (
        judge(GroupEvidence(0, 100, 1.0, -48.0, 100.0, engine="mlx"), a) == "implausible"
    )  # fresh: no drift
    assert judge(GroupEvidence(1, 100, 20.0, -60.0, 100.0, engine="mlx"), a) == "implausible"  # beyond it
    # once the bucket has its own centre, that decides, and the drift is no longer added
    for _ in range(MIN_TRUSTED):
        calib.note_group("mlx", 1, 0.2, -1.0, trusted=True)
    b = derive(CheckSettings(), calib, 4, 3)
    assert b.z_range(one_behind) == pytest.approx((-1.0 - 4.5, -1.0 + 4.5))
    assert judge(one_behind, b) is None
    assert judge(GroupEvidence(1, 100, 20.0, -56.0, 100.0, engine="mlx"), b) == "implausible"


def test_evidence_summary_counts_what_the_floors_alone_would_have_rejected():
    calib = Calibration()
    calib.note_drift(0, (0.2, 64, True))  # a big model step: the derived bound at s=1 is 0.03 + 3 * 0.2
    a = derive(CheckSettings(), calib, 1, 2)
    honest_drift = GroupEvidence(1, 50, 50 * 0.4, 0.0, 50.0, engine="torch")  # gap 0.4 > floor 0.28
    out = evidence_summary({"k": honest_drift}, a, {})
    assert (
        out["torch/1"]["n"] == 1 and out["torch/1"]["fixed_rejects"] == 1 and out["torch/1"]["rejects"] == 0
    )
    assert judge(honest_drift, a) is None and judge(honest_drift, CheckSettings()) == "logprob_gap"


def test_a_starving_trainer_names_the_quarantined_key_the_check_and_what_to_do():
    fp = MINE.fingerprint
    d = {
        "phase": "waiting", "phase_s": 45.0, "have": 0, "need": 4,
        "quarantined": {fp: "implausible sampling over 32 groups (key z -5.6, mean z -0.99)"},
        "keys": {fp: {"names": ["local-1"]}}, "backlog": {"waiting": 12, "fetched": 0},
    }  # fmt: skip
    note = starving_note(d)
    assert note is not None
    assert fp in note and "local-1" in note and "key z -5.6" in note and "security.trusted_keys" in note
    assert "usable 0/4" in note
    assert starving_note({**d, "phase_s": 5.0}) is None  # not yet
    assert starving_note({**d, "phase": "training"}) is None
    idle = starving_note({"phase": "waiting", "phase_s": 40.0, "have": 1, "need": 4, "backlog": {}})
    assert idle is not None and "no groups are waiting" in idle and "start one" in idle
