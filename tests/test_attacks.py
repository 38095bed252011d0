"""The attack suite, once per attack, against the real trainer (in process) of a real run in a tmp folder:
every hostile group must be rejected with the expected reason (read from the trainer's own cursor), every
honest group beside it kept, forged weights refused by a real pinned follower, and the trainer must keep
publishing through squatted versions. Hostile workers: `pnyx_harness.attacks`; the arena:
`pnyx_harness.arena`.

The checks of issue #15 items 3-4 (logprob gap, token plausibility, quarantine, per-key caps) caught all
but one: a Sybil temperature liar (a fresh key per group), whose short groups pass the statistical tests.
The per-token check of seeded draws (issue #25, `pnyx.train.drawcheck`) rejects it group by group: each of
its tokens must be the one its seeded uniform draws under the published weights.
"""

from __future__ import annotations

import threading

import pytest

from pnyx.protocol import layout
from pnyx.security.checks import FAULTS
from pnyx_harness import attacks as A
from pnyx_harness import weight_attacks as W
from pnyx_harness.arena import BENIGN, TRAINED, Arena
from pnyx_harness.producer import HonestWorker, Producer

WHOLE_GROUP_PICKER = (
    "a Sybil whole-group picker uploads only honest draws, each under a fresh key it abandons after a group it "
    "does not want: no key it keeps has an empty seq, so nothing is held back or counted. Nothing detects it; "
    "standing binds it (a name's first seqs never trained, on by default under committed draws, which this "
    "arena turns off: test_sybil_picker_with_a_fresh_key_per_group_gets_nothing_trained_under_standing)"
)

SEQ_REUSING_PICKER = (
    "a one-key whole-group picker that draws its next group under the seq of a group it dropped (with another "
    "task: a worker chooses its tasks, and the seed names the task) leaves no gap and no skip record; every "
    "group it uploads is an honest, contiguous, signed draw (issue #25: only a commitment to the task made "
    "before the draw's randomness is known binds it, `security.committed_draws`, on by default: "
    "test_seq_reusing_picker_is_refused_under_committed_draws)"
)

HONEST = [HonestWorker("honest-1"), HonestWorker("honest-2")]


@pytest.fixture(scope="module")
def arena(tmp_path_factory):
    # the defaults of the skip-record audit: every sample of a key's first `skip_audit_first` skip records is
    # checked, so the forged-skip test is deterministic for its fresh key
    # without committed draws (on by default; the committed arena below has them): each check on its own
    a = Arena(
        tmp_path_factory.mktemp("arena"),
        {"trainer": {"groups_per_step": 8}, "security": {"committed_draws": False}},
    )
    a.upload([u for h in HONEST for u in h.uploads(a, 3)])  # honest names are bound first
    a.poll()
    yield a
    a.close()


def honest_round(arena: Arena, per_worker: int = 3) -> None:
    arena.upload([u for h in HONEST for u in h.uploads(arena, per_worker)])


def rejected(arena: Arena, source: str) -> dict[str, int]:
    """Verdicts of `source`'s uploads other than trained or benign."""
    return {v: n for v, n in arena.tally(source).items() if v not in BENIGN and v not in (TRAINED, "waiting")}


def assert_all_rejected(arena: Arena, source: str, reasons: set[str] | None = None) -> None:
    """Every group `source` offered for training was rejected (for one of `reasons`). Its skip records are
    not counted: a protocol-following attacker uploads them for its zero-variance draws, and they are judged
    as skip records (`tests/test_skip_records.py`)."""
    tally = arena.tally(source, skips=False)
    bad = {v: n for v, n in tally.items() if v not in BENIGN and v not in (TRAINED, "waiting")}
    assert sum(tally.values()) > 0
    assert sum(bad.values()) == sum(tally.values()), f"{source}: {tally}"
    if reasons is not None:
        assert set(bad) <= reasons, f"{source}: {tally}"


def test_id_thief_is_rejected_as_id_theft(arena):
    arena.upload(A.IdThief("thief", source="id_thief", victim="honest-1").uploads(arena, 3))
    arena.poll()
    assert_all_rejected(arena, "id_thief", {"id_theft"})


def test_replayer_of_another_runs_groups_is_rejected(arena):
    foreign = A.foreign_groups(arena, 4)
    arena.upload(A.Replayer("replayer", source="replayer", foreign=foreign[:2]).uploads(arena, 2))
    relabel = A.Replayer("replayer-2", source="replayer_relabelled", foreign=foreign[2:], verbatim=False)
    arena.upload(relabel.uploads(arena, 2))
    arena.poll()
    assert_all_rejected(arena, "replayer", {"run_mismatch"})
    # re-signed with this run's id: its weights history is another run's
    assert_all_rejected(arena, "replayer_relabelled", {"weights_mismatch", "unknown_version"})


def test_weight_forger_is_never_served_by_a_pinned_follower(arena):
    before = arena.follow()
    forged_key = W.WeightForger().act(arena)
    assert arena.store.exists(forged_key)
    assert arena.follow() == before  # the forged next version is invisible
    honest_round(arena, 4)
    assert arena.step() is not None
    version, digest = arena.served[-1]
    assert version == before + 1 == arena.trainer.version
    assert digest == arena.trainer.parts.publishing.publisher._digest  # the trainer's v+1, not the forger's
    assert all(d != "" for _, d in arena.served)


def test_fork_squatter_cannot_block_the_trainer_or_feed_the_follower(arena):
    """Squatted next versions (unsigned name, a made-up signature name, junk at the trainer's payload
    names, a HEAD naming v99999999): the trainer publishes through them and the follower serves its bits."""
    start = arena.trainer.version
    squatter = W.ForkSquatter(ahead=2)
    squatter.act(arena)
    for _ in range(2):
        honest_round(arena, 4)
        assert arena.step() is not None
        assert arena.served[-1] == (arena.trainer.version, arena.trainer.parts.publishing.publisher._digest)
    assert arena.trainer.version == start + 2


def test_reward_liars_claims_never_reach_the_loss(arena):
    """The trainer re-scores every sample: a consumed liar's group carries the env's rewards, and every
    flipped sample is counted as a disagreement against its key."""
    liar = A.RewardLiar("liar", source="reward_liar")
    ups = liar.uploads(arena, 2)
    arena.upload(ups)
    honest_round(arena)
    arena.step()
    ing = arena.trainer.parts.ingestor
    assert ing is not None
    samples = 2 * arena.cfg.worker.group_size
    assert ing.cursor.by_key[liar.signer.fingerprint].get("disagreements", 0) == samples


def test_reward_liar_is_quarantined(arena):
    """Every group of the liar disagrees; after 3 steps (6 groups) its key has crossed any sensible fault
    rate, so the 2 groups it uploads after that must never be trained on."""
    liar = A.RewardLiar("liar-q", source="reward_liar_q")
    for _ in range(4):
        arena.upload(liar.uploads(arena, 2))
        honest_round(arena)
        arena.step()
    late = [
        u
        for u in arena.uploads
        if u.source == "reward_liar_q" and u.index > 6 and not layout.is_skip_key(u.key)
    ]
    assert late and all(arena.verdict(u.key) not in (TRAINED, "waiting", *BENIGN) for u in late)


def _hostile_step(arena: Arena, producer: Producer, n: int = 2) -> None:
    """Upload `n` of `producer`'s groups beside an honest round and step until none of them waits: the
    draws and the statistical checks judge a group in the step that would train on it."""
    arena.upload(producer.uploads(arena, n))
    honest_round(arena)
    arena.step()
    for _ in range(3):
        if not arena.tally(producer.source).get("waiting"):
            break
        honest_round(arena)
        arena.step()


def test_copier_with_made_up_logprobs_is_rejected(arena):
    _hostile_step(arena, A.CopierWorker("copier", source="copier"))
    assert_all_rejected(arena, "copier")


def test_temperature_liar_is_rejected_group_by_group_and_its_key_quarantined(arena):
    """A temperature liar that draws with its own seeded uniforms (its best try): every group holds a token
    its uniform does not draw at the claimed temperature, so each is `draw_mismatch`, and its key is
    quarantined once it has shown enough faulty groups (security.quarantine_min)."""
    liar = A.TemperatureLiar("t-liar", source="temperature_liar")
    for _ in range(3):
        _hostile_step(arena, liar, 3)
    assert_all_rejected(arena, "temperature_liar", {"draw_mismatch", "quarantined"})
    faults = {v: n for v, n in arena.tally("temperature_liar").items() if v in FAULTS}
    assert sum(faults.values()) >= 5, faults  # its groups' draws, and its skip records' sampling settings
    assert liar.signer.fingerprint in arena.trainer.parts.ingestor.cursor.quarantined


def test_sybil_copier_with_a_fresh_key_per_group_is_rejected(arena):
    """Identity-independent: each fabricated group is caught on its own (no seeded draws: `unseeded`;
    with `security.accept_unseeded`, the logprob gap)."""
    _hostile_step(arena, A.Sybil("sybil-c", source="sybil_copier", inner="copier"), 3)
    assert_all_rejected(arena, "sybil_copier")


def test_sybil_temperature_liar_with_a_fresh_key_per_group_is_rejected(arena):
    """One group per fresh key: no per-key statistic ever binds, and each group fails on its own tokens."""
    _hostile_step(arena, A.Sybil("sybil-t", source="sybil_liar", inner="temperature_liar"), 6)
    # each group a `draw_mismatch`, or its fresh key quarantined first by the false skip record of a
    # zero-variance draw it made at its own temperature
    assert_all_rejected(arena, "sybil_liar", {"draw_mismatch", "quarantined"})


def test_poisoner_is_rejected(arena):
    _hostile_step(arena, A.Poisoner("poisoner", source="poisoner"))
    assert_all_rejected(arena, "poisoner")


def test_an_eager_key_under_the_flood_limit_takes_at_most_a_fair_share(arena):
    """16 honest-looking groups per step beside 2 honest workers (3 keys waiting): ceil(8 / 3) places."""
    eager = A.Flooder("eager", source="eager", names=8, fresh=16)  # every group a fresh draw
    for _ in range(2):
        arena.upload(eager.uploads(arena, 16))
        honest_round(arena, 4)
        arena.poll()  # this round's groups listed before the step (each honest key has 4 >= its share)
        r = arena.step()
        assert r is not None
        assert sum(g.signer == eager.signer.fingerprint for g in r.groups) <= 3
    assert eager.signer.fingerprint not in arena.trainer.parts.ingestor.cursor.quarantined


def test_flooder_over_the_flood_limit_is_quarantined_from_the_listing(arena):
    """More groups at one version than the run's flood limit (2 x (max_staleness + 1) x groups_per_step =
    64 here): quarantined once its names are bound (one GET each), every group rejected. A group fetched
    to bind a name may be one of its copies, whose tokens are not its seq's draws (`draw_mismatch`)."""
    flooder = A.Flooder("flood", source="flooder", names=8)
    arena.upload(flooder.uploads(arena, 80))
    arena.poll()
    assert flooder.signer.fingerprint in arena.trainer.parts.ingestor.cursor.quarantined
    assert_all_rejected(arena, "flooder", {"quarantined", "draw_mismatch"})
    assert arena.tally("flooder").get("draw_mismatch", 0) <= 8  # at most one GET per name


def test_junk_and_copies_under_an_honest_name_neither_quarantine_nor_starve_it(arena):
    """80 objects under honest-1's name at one version (junk and copies of its own signed records under
    other seqs), over the run's flood limit of 64: the flood audit reads them before blaming the key, each
    is rejected (`bad_magic`, `key_mismatch`), and honest-1 keeps its key, its names and its places."""
    from pnyx.security.checks import faults

    victim = HONEST[0]
    junk = A.JunkWriter("junk", source="junk_writer", victim=victim.worker_id)
    arena.upload(junk.uploads(arena, 80))
    honest_round(arena, 4)
    r = arena.step()
    assert r is not None
    ing = arena.trainer.parts.ingestor
    assert victim.signer.fingerprint not in ing.cursor.quarantined, ing.cursor.quarantined
    assert faults(ing.cursor.by_key[victim.signer.fingerprint]) == 0
    arena.poll()
    tally = arena.tally("junk_writer")
    assert tally == {"bad_magic": 40, "key_mismatch": 40}, tally
    assert any(g.signer == victim.signer.fingerprint for g in r.groups)
    honest_round(arena, 4)
    arena.poll()
    assert arena.step() is not None and victim.signer.fingerprint not in ing.cursor.quarantined


@pytest.mark.parametrize("inner", ["reward_liar", "poisoner"])
def test_sybil_reward_liar_and_poisoner_with_a_fresh_key_per_group_are_rejected(arena, inner):
    """Identity-independent: the re-score catches each lying group, plausibility each poisoned one."""
    _hostile_step(arena, A.Sybil(f"sybil-{inner}", source=f"sybil_{inner}", inner=inner), 3)
    for _ in range(4):  # a poisoned group is judged by the step that selects it
        if "waiting" not in arena.tally(f"sybil_{inner}"):
            break
        arena.step()
    assert_all_rejected(arena, f"sybil_{inner}")


def test_hostile_groups_are_real_and_honest_groups_are_kept(arena):
    """Runs last: every honest group uploaded beside the attacks above was trained on or is waiting (or
    dropped for a benign reason), never rejected; and the hostile producers made what they claim."""
    honest = arena.tally("honest")
    assert honest.get(TRAINED, 0) > 0
    assert rejected(arena, "honest") == {}, honest
    poisoned = [u for u in arena.uploads if u.payload]
    assert all(u.source == "poisoner" for u in poisoned)


def test_within_group_cherry_picker_cannot_choose_its_samples(arena):
    """Honest draws re-assembled into a chosen group (the shortest right and longest wrong samples of 4
    groups of one task): sample i is not the draw of stream i, so every such group is `draw_mismatch`."""
    _hostile_step(arena, A.CherryPicker("picker", source="cherry_within", form="within"), 4)
    assert_all_rejected(arena, "cherry_within", {"draw_mismatch", "quarantined"})


def test_sybil_within_group_cherry_picker_is_rejected_group_by_group(arena):
    _hostile_step(arena, A.Sybil("sybil-p", source="sybil_cherry", inner="cherry_picker"), 4)
    # each fresh key's group is a `draw_mismatch`, or its key is quarantined first by the false skip record
    # of a draw it did not use
    assert_all_rejected(arena, "sybil_cherry", {"draw_mismatch", "quarantined"})


def test_whole_group_cherry_picker_is_quarantined_by_its_gaps(arena):
    """Uploads only the honest groups that already favour short answers and leaves the others' seqs empty:
    once the versions of its gaps are swept (`SWEEP_MAX_LAG` versions later here) each empty seq is a `gap`
    fault of its key, which is quarantined; what it uploads afterwards is never trained on. (The groups it
    uploaded before that were trained: the gaps are judged at the sweep, not when the groups arrive.)"""
    from pnyx.train.listing import SWEEP_MAX_LAG

    picker = A.CherryPicker("picker-w", source="cherry_whole", form="whole")
    ups: list = []
    for _ in range(8):  # until it has kept back at least 5 groups between the ones it uploaded
        ups += picker.uploads(arena, 4)
        uploaded = {layout.parse_rollout_key(u.key)[2] for u in ups}
        kept_back = set(range(max(uploaded))) - uploaded
        if len(kept_back) >= 5:
            break
    assert len(kept_back) >= 5, (sorted(uploaded), picker.seq)
    arena.upload(ups)
    fp = picker.signer.fingerprint
    for _ in range(SWEEP_MAX_LAG + 8):
        honest_round(arena, 4)  # a full step of honest groups: the version advances every step
        arena.step()
        if fp in arena.trainer.parts.ingestor.cursor.quarantined:
            break
    report = _picker_report(arena, picker)
    cursor = arena.trainer.parts.ingestor.cursor
    where = (arena.trainer.version, cursor.swept_below, {layout.parse_rollout_key(u.key)[0] for u in ups})
    assert report["quarantined"] and report["counts"]["gap"] >= 5, (report, where)
    picker.discard_spares()  # groups drawn now, at a version in the window (not spares of swept versions)
    late = picker.uploads(arena, 2)
    arena.upload(late)
    honest_round(arena)
    arena.step()
    assert {arena.verdict(u.key) for u in late} == {"quarantined"}, [
        (u.key, arena.verdict(u.key), cursor.swept_below) for u in late
    ]


@pytest.mark.xfail(strict=True, reason=WHOLE_GROUP_PICKER)
def test_sybil_whole_group_cherry_picker_is_detected(arena):
    """A fresh key per group, abandoned after a group it does not want: no seq of a key it keeps is empty."""
    _hostile_step(arena, A.Sybil("sybil-w", source="sybil_whole", inner="cherry_whole"), 4)
    assert_all_rejected(arena, "sybil_whole")


def test_seq_reusing_picker_drops_draws_without_a_trace(arena):
    """What the store shows of a picker that never uploads a group it does not want and draws the next one
    under the same seq: contiguous seqs from 0, every group favouring short answers, no skip record, while
    it drew more groups than it uploaded. (Whether the trainer rejects its groups: the strict xfail below.)"""
    picker = A.CherryPicker("picker-r", source="cherry_reuse_probe", form="whole_reuse")
    drawn = 0
    draw = picker.draw

    def counting(*a, **k):
        nonlocal drawn
        groups = draw(*a, **k)
        drawn += len(groups)
        return groups

    picker.draw = counting  # type: ignore[method-assign]
    ups = picker.uploads(arena, 6)
    seqs = sorted(layout.parse_rollout_key(u.key)[2] for u in ups)
    assert seqs == list(range(len(ups))) and len(ups) == 6, seqs
    assert not any(layout.is_skip_key(u.key) for u in ups)
    assert drawn > len(ups), (drawn, len(ups))


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=SEQ_REUSING_PICKER)
def test_seq_reusing_whole_group_picker_is_detected(arena):
    _hostile_step(arena, A.CherryPicker("picker-r", source="cherry_reuse", form="whole_reuse"), 4)
    assert_all_rejected(arena, "cherry_reuse")


STANDING = 3
"""`security.standing_groups` in the committed arena: each name's first 3 seqs are never trained."""


@pytest.fixture(scope="module")
def committed_arena(tmp_path_factory):
    """The arena under committed draws (`security.committed_draws`): every producer commits to its seqs and
    tasks, and the trainer ticks, before each draw (`Arena.commit_and_tick`); with standing
    (`security.standing_groups`)."""
    a = Arena(
        tmp_path_factory.mktemp("committed-arena"),
        {
            "trainer": {"groups_per_step": 8},
            "security": {"committed_draws": True, "standing_groups": STANDING},
        },
    )
    honest = [HonestWorker("honest-c1"), HonestWorker("honest-c2")]
    a.upload([u for h in honest for u in h.uploads(a, 3)])
    a.poll()
    a.honest = honest  # type: ignore[attr-defined]
    yield a
    a.close()


def _committed_rounds(arena: Arena, picker: Producer, rounds: int, honest_per_worker: int) -> None:
    """`rounds` steps of the committed arena: the picker's 4 groups, then the honest workers' round."""
    for _ in range(rounds):
        arena.upload(picker.uploads(arena, 4))
        arena.upload([u for h in arena.honest for u in h.uploads(arena, honest_per_worker)])
        arena.step()


def test_seq_reusing_picker_is_refused_under_committed_draws(committed_arena):
    """The picker above, under committed draws: its second commitment to a seq is refused by the tick, so a
    group it draws under it anyway is `uncommitted`, which quarantines its key at once (an honest worker
    never draws one). The groups of seqs it liked at the first draw, uploaded before, are honest draws that
    nothing can tell from any other worker's. Honest workers beside it commit the same way and lose nothing
    but the seqs standing holds."""
    arena = committed_arena
    picker = A.CherryPicker("picker-c", source="cherry_reuse_c", form="whole_reuse")
    _committed_rounds(arena, picker, 3, 3)
    refused = {seq for name, seq, *_ in arena.refusals if name == "picker-c"}
    assert refused, "the picker never tried to reuse a seq"
    ups = [u for u in arena.uploads if u.source == "cherry_reuse_c"]
    after = [u for u in ups if layout.parse_rollout_key(u.key)[2] in refused]
    verdicts = {arena.verdict(u.key) for u in after}
    assert after and verdicts <= {"uncommitted", "quarantined"}, verdicts
    assert picker.signer.fingerprint in arena.trainer.parts.ingestor.cursor.quarantined
    # what was trained are first draws of seqs it never committed twice (honest draws it happened to like),
    # uploaded before its key was quarantined
    trained = [layout.parse_rollout_key(u.key)[2] for u in ups if arena.verdict(u.key) == TRAINED]
    assert not set(trained) & refused and len(trained) < len(ups) / 2, (trained, refused)
    honest = arena.tally("honest")
    assert not {v for v in honest if v not in BENIGN and v not in (TRAINED, "waiting")}, honest
    assert honest.get(TRAINED, 0) >= 12 - 2 * STANDING, honest
    print(f"\ncommitted seq-reusing picker: {arena.tally('cherry_reuse_c')}; honest {honest}")


def test_gap_leaving_picker_gets_nothing_trained_after_its_first_gap_under_committed_draws(committed_arena):
    """The whole-group picker that leaves the committed seqs of groups it does not want empty: its groups
    behind an empty seq are held (`Ticker.held`) until the seq is settled as a gap at the sweep, when they
    are stale or its key is quarantined. Without committed draws the same picker had 44 of 400 groups
    trained in `bench_attacks` (BENCHMARKS.md)."""
    from pnyx.protocol.commits import decode_tick

    arena = committed_arena
    picker = A.CherryPicker("picker-cg", source="cherry_gap_c", form="whole")
    _committed_rounds(arena, picker, 25, 4)
    fp = picker.signer.fingerprint
    assert fp in arena.trainer.parts.ingestor.cursor.quarantined
    committed = set()
    for meta in arena.store.list(layout.TICKS_PREFIX):
        if layout.parse_tick_key(meta.key) is not None:
            tick = decode_tick(arena.store.get(meta.key), arena.run_id, arena.trust.fingerprint)
            for inc in tick.included.values():
                if inc.worker_id == "picker-cg":
                    committed.update(range(inc.first_seq, inc.first_seq + len(inc.tasks)))
    ups = [u for u in arena.uploads if u.source == "cherry_gap_c"]
    gaps = committed - {layout.parse_rollout_key(u.key)[2] for u in ups}
    assert gaps, "the picker left no committed seq empty"
    trained = [layout.parse_rollout_key(u.key)[2] for u in ups if arena.verdict(u.key) == TRAINED]
    assert all(seq < min(gaps) for seq in trained), (sorted(trained), sorted(gaps)[:5])
    honest = arena.tally("honest")
    assert not {v for v in honest if v not in BENIGN and v not in (TRAINED, "waiting")}, honest
    print(f"\ncommitted gap picker: {arena.tally('cherry_gap_c', skips=False)}; first gap {min(gaps)}")


def test_sybil_picker_that_keeps_a_key_while_it_likes_its_draws_needs_standing_to_train(committed_arena):
    """The Sybil picker at its strongest: one key while it likes what it draws, a fresh key and name at the
    first group it does not want (that seq stays empty at the end of the key's life, where no later group
    waits on it). Nothing detects it; standing binds it: a name's first `STANDING` seqs are never trained,
    so only groups after a run of that many it chose to keep count (p^STANDING of its runs)."""
    arena = committed_arena
    picker = A.CherryPicker("picker-a", source="cherry_abandon_c", form="whole_abandon")
    _committed_rounds(arena, picker, 6, 4)
    ups = [u for u in arena.uploads if u.source == "cherry_abandon_c" and not layout.is_skip_key(u.key)]
    names = {layout.parse_rollout_key(u.key)[1] for u in ups}
    assert len(names) > 1, "the picker never abandoned a key"
    trained = [layout.parse_rollout_key(u.key)[2] for u in ups if arena.verdict(u.key) == TRAINED]
    assert all(seq >= STANDING for seq in trained), trained
    print(f"\ncommitted Sybil picker: {len(ups)} groups under {len(names)} keys, {len(trained)} trained")


def test_sybil_picker_with_a_fresh_key_per_group_gets_nothing_trained_under_standing(committed_arena):
    """The whole-group picker with a fresh key and name per group (the strict xfail above, in the arena
    without committed draws): each of its groups is the first seq of its name, so under standing none is
    ever trained, while the honest workers beside it keep being trained."""
    arena = committed_arena
    before = arena.tally("honest").get(TRAINED, 0)
    sybil = A.Sybil("sybil-c", source="sybil_whole_c", inner="cherry_whole")
    ups: list = []
    # how many of its draws it wants follows the arena's policy by now: 1 group in 4 rounds once (2026-12-05)
    for _ in range(4):
        _committed_rounds(arena, sybil, 4, 4)
        ups = [u for u in arena.uploads if u.source == "sybil_whole_c" and not layout.is_skip_key(u.key)]
        if len(ups) >= 2:
            break
    assert len({layout.parse_rollout_key(u.key)[1] for u in ups}) == len(ups) >= 2  # a name per group
    verdicts = {arena.verdict(u.key) for u in ups}
    assert TRAINED not in verdicts, verdicts
    assert arena.tally("honest").get(TRAINED, 0) > before
    print(f"\ncommitted Sybil, a key per group: {len(ups)} groups, verdicts {sorted(verdicts)}")


def test_a_restarted_honest_workers_undrawn_cohort_is_excused_not_counted_as_gaps(committed_arena):
    """An honest worker killed after its commitment's tick and before it drew: its next life resumes at the
    first seq the store lacks, its commitment is refused as a reuse, and it moves to the next free seq.
    The refusing tick excuses the undrawn seqs: at the sweep they count `lost` on its key, no `gap`, its
    key stays in good standing and its later groups are trained, not held behind the missing seqs."""
    arena = committed_arena
    worker = HonestWorker("restart-c")
    fp = worker.signer.fingerprint
    arena.upload(worker.uploads(arena, 4))  # its first life's groups
    seqs = list(range(worker.seq, worker.seq + 4))
    arena.commit_and_tick(worker.signer, "restart-c", seqs, [t.id for t in worker.tasks(arena, 4)])
    # SIGKILL: nothing of that cohort drawn; the next life resumes where its store ends (worker.seq)
    for _ in range(20):
        arena.upload(worker.uploads(arena, 2))
        arena.upload([u for h in arena.honest for u in h.uploads(arena, 3)])
        arena.step()
    ledger = arena.trainer.parts.ingestor.key_report()[fp]
    assert any(name == "restart-c" and first == seqs[0] for name, first, *_ in arena.refusals), arena.refusals
    assert arena.trainer.parts.ticker.excused("restart-c", fp) == [(seqs[0], seqs[-1])]
    assert ledger["counts"].get("lost") == 4 and not ledger["counts"].get("gap"), ledger
    assert ledger["quarantined"] is None, ledger
    late = [u for u in arena.uploads if u.source == "honest" and "restart-c" in u.key]
    after = [u for u in late if layout.parse_rollout_key(u.key)[2] > seqs[-1]]
    assert after and any(arena.verdict(u.key) == TRAINED for u in after), arena.tally("honest")


def _picker_report(arena: Arena, picker: Producer) -> dict:
    return arena.trainer.parts.ingestor.key_report()[picker.signer.fingerprint]


def test_whole_group_picker_that_announces_its_dropped_groups_as_skips_is_quarantined(arena):
    """It keeps back the groups that do not favour short answers and announces each as a skip record (its
    honest tokens, as if zero variance): the trainer re-scores every skip record, finds mixed rewards, and
    quarantines the key before any of its groups is chosen."""
    picker = A.CherryPicker("picker-s", source="cherry_skip", form="whole_skip")
    _hostile_step(arena, picker, 6)
    report = _picker_report(arena, picker)
    assert "false skip" in (report["quarantined"] or ""), report
    assert report["counts"]["false_skip"] >= 1
    groups = [u.key for u in arena.uploads if u.source == "cherry_skip" and not layout.is_skip_key(u.key)]
    assert groups and {arena.verdict(k) for k in groups} == {"quarantined"}, arena.tally("cherry_skip")
    assert arena.tally("cherry_skip").get("false_skip", 0) >= 1


def test_whole_group_picker_with_forged_skip_records_is_quarantined_by_their_draws(arena):
    """Its skip records are forged to zero variance (every sample a copy of the first), so they pass the
    re-score; the exact check of their seeded draws at the next step (every sample: the key's first skip
    records, `security.skip_audit_first`) finds tokens its uniforms did not draw, and the key is
    quarantined: nothing it uploads after that is trained on."""
    picker = A.CherryPicker("picker-f", source="cherry_forged", form="whole_forged")
    _hostile_step(arena, picker, 4)
    honest_round(arena)
    arena.step()  # the step checks the draws of the skip records re-scored since the last one
    report = _picker_report(arena, picker)
    assert "false skip" in (report["quarantined"] or ""), report
    arena.upload(picker.uploads(arena, 4))
    late = {u.key for u in arena.uploads[-4:]}
    honest_round(arena)
    arena.step()
    assert all(arena.verdict(k) not in (TRAINED, "waiting") for k in late), [arena.verdict(k) for k in late]


def test_a_forged_skip_record_is_checked_while_the_trainer_waits_and_its_key_is_out_before_the_batch(
    tmp_path,
):
    """The trainer checks skip records in the time it waits for a full batch (`idle_s` of the step's
    `skip_audit`, off the step's path): a forged one listed while it waits quarantines its key before the
    batch is taken, so the forger's kept groups, listed beside it, are not trained."""
    arena = Arena(tmp_path, {"trainer": {"groups_per_step": 8}, "security": {"committed_draws": False}})
    honest = [HonestWorker("honest-i1"), HonestWorker("honest-i2")]
    picker = A.CherryPicker("picker-i", source="cherry_idle", form="whole_forged")
    try:
        arena.upload([u for h in honest for u in h.uploads(arena, 2)])  # 4 of the 8 groups a step needs
        forged = 0
        while (
            not forged
        ):  # until the picker hid a group behind a forged skip record (its first: checked whole)
            before = picker.true_skips
            ups = picker.uploads(arena, 1)
            forged += sum(layout.is_skip_key(u.key) for u in ups) - (picker.true_skips - before)
            arena.upload(ups)
        kept = [u.key for u in arena.uploads if u.source == "cherry_idle" and not layout.is_skip_key(u.key)]
        assert 0 < len(kept) < 4
        rest = threading.Timer(3.0, lambda: arena.upload([u for h in honest for u in h.uploads(arena, 3)]))
        rest.start()  # the batch fills 3 s into the step's wait
        result = arena.step()
        rest.join()
        audit = arena.trainer.waiting.skip_audit
        assert result is not None and audit is not None
        assert audit["false"] >= 1 and audit["idle_groups"] >= 1 and audit["idle_s"] > 0, audit
        assert "false skip" in (_picker_report(arena, picker)["quarantined"] or "")
        assert not {g.key for g in result.groups} & set(kept)
        assert {arena.verdict(k) for k in kept} == {"quarantined"}, arena.tally("cherry_idle")
    finally:
        arena.close()


def test_patient_forger_is_caught_by_the_samples_checked_of_each_skip_record(tmp_path):
    """The forger that knows the defence: it delivers true skip records until its key's first ones (checked
    whole, `security.skip_audit_first`, 2 here) are behind it, offering every group meanwhile, then hides
    each unwanted group behind a skip record with only its minority samples forged. Each skip record gets
    `skip_draw_samples` random samples checked (7 of 8 here, so a record with one forged sample is found
    with chance 7/8 and the test cannot miss by luck; the default checks 1): the key is quarantined for a
    `false_skip` found by a sampled check, nothing it uploads afterwards is trained on, and nothing it
    offered in its standing phase was a false reject. The groups it chose beside forged records the sampled
    checks missed are trained (bench_attacks.py counts them); those listed with the record that is found are
    not, since skip records are checked before a batch is taken."""
    sec = {"skip_audit_first": 2, "skip_draw_samples": 7, "skip_draw_audit": 0.0, "committed_draws": False}
    arena = Arena(tmp_path, {"trainer": {"groups_per_step": 8}, "security": sec})
    honest = [HonestWorker("honest-p1"), HonestWorker("honest-p2")]
    try:
        arena.upload([u for h in honest for u in h.uploads(arena, 3)])
        picker = A.CherryPicker("picker-fp", source="patient", form="whole_forged_patient")
        # until quarantined: the forger forges only once its first skip records are behind it, and how soon it
        # draws zero-variance groups varies with the run (one in 24 rounds in a CI-like run, 2026-12-05)
        for _ in range(80):
            round_ = picker.uploads(arena, 2)
            arena.upload(round_)
            arena.upload([u for h in honest for u in h.uploads(arena, 3)])
            arena.step()
            if picker.signer.fingerprint in arena.trainer.parts.ingestor.cursor.quarantined:
                break
        chosen = [u.key for u in round_ if not layout.is_skip_key(u.key)]  # listed with the record found
        assert chosen and all(arena.verdict(k) != TRAINED for k in chosen), [arena.verdict(k) for k in chosen]
        report = _picker_report(arena, picker)
        assert "false skip" in (report["quarantined"] or ""), (report, picker.forged_samples)
        assert picker.forged_samples and min(picker.forged_samples) >= 1, picker.forged_samples
        arena.upload(picker.uploads(arena, 4))
        late = {u.key for u in arena.uploads[-4:]}
        arena.upload([u for h in honest for u in h.uploads(arena, 3)])
        arena.step()
        assert all(arena.verdict(k) not in (TRAINED, "waiting") for k in late), [
            arena.verdict(k) for k in late
        ]
        skips = arena.trainer.parts.ingestor.cursor.skips
        # its first `skip_audit_first` records were checked whole and passed (its standing tally below holds
        # no false_skip), so its false ones were found by the sampled checks of later records (which count
        # `false`, not `samples_checked`: that counts sampled checks that passed, honest keys' ones included,
        # which a run that quarantines the forger within a few steps may not have reached: CI, 2026-12-05)
        assert skips.get("false", 0) >= 1 and skips.get("draws_checked", 0) >= 2, skips
        standing = arena.tally("patient_standing")
        assert standing and set(standing) <= {TRAINED, "waiting", "quarantined", *BENIGN}, standing
        assert "false_skip" not in arena.tally("honest"), arena.tally("honest")
    finally:
        arena.close()


def test_honest_skip_records_pass_their_audit(arena):
    """The honest workers' zero-variance groups, uploaded as skip records all along, were re-scored and
    their draws checked: none was a `false_skip`. (Their names' gap counts are not asserted here: the id
    thief and the replayer upload under honest names, and the listing counts any key under a name.)"""
    honest_round(arena)
    arena.step()
    arena.step()
    verdicts = arena.tally("honest")
    assert verdicts.get("skipped", 0) > 0, verdicts
    assert "false_skip" not in verdicts
    for h in HONEST:
        report = _picker_report(arena, h)
        assert report["counts"].get("false_skip", 0) == 0 and report["quarantined"] is None, report


def test_answers_appended_as_tool_tokens_are_rejected(arena):
    """Tool tokens (loss mask 0) take no uniform, so the draw check passes them; arith has no tool, and a
    worker that appends a right or wrong answer as tool tokens would set every sample's reward. Each group
    is `forged_episode` (`pnyx.train.episode_check`)."""
    _hostile_step(arena, A.EpisodeForger("ep-tool", source="episode_tool", form="tool_answer"), 4)
    assert_all_rejected(arena, "episode_tool", {"forged_episode", "quarantined"})


def test_right_samples_cut_short_are_rejected(arena):
    """A prefix of an honest draw is a run of honest draws: a worker cutting its right samples short would
    choose which answers count. The engine stops only at EOS, a stop string or the budget; a sample that
    ends anywhere else is `forged_episode`."""
    forger = A.EpisodeForger("ep-cut", source="episode_cut", form="truncate")
    _hostile_step(arena, forger, 4)
    assert_all_rejected(arena, "episode_cut", {"forged_episode", "quarantined"})


def test_a_skip_record_without_seeded_draws_is_a_false_skip(arena):
    """A skip record with no seeded draws and made-up all-wrong samples re-scores as zero variance, and no
    draw check reads it; under seeded draws such a record is a `false_skip`, and its key is quarantined."""
    forger = A.EpisodeForger("ep-skip", source="episode_skip", form="unseeded_skip")
    _hostile_step(arena, forger, 3)
    report = _picker_report(arena, forger)
    assert "false skip" in (report["quarantined"] or ""), report
    assert arena.tally("episode_skip").get("false_skip", 0) >= 1, arena.tally("episode_skip")
