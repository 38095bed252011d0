"""Nothing discarded unseen (issue #25): a worker with seeded draws uploads a skip record for each group it does
not offer for training, the trainer re-scores every skip record (a false one quarantines its key), and the
seqs a worker name never uploads are counted as gaps against its key when their version is swept."""

from __future__ import annotations

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from ingest_support import make_group, put_signed, signed_ingestor

from pnyx.protocol import encode_group, layout
from pnyx.protocol.draws import SCHEME
from pnyx.rollout.sealer import Sealer
from pnyx.security.signing import Signer
from pnyx.store import open_store
from pnyx.train import seq_books


@pytest.fixture
def store(tmp_path):
    return open_store(str(tmp_path / "run"))


def _signer() -> Signer:
    return Signer(Ed25519PrivateKey.generate())


def _seeded(group):
    return msgspec.structs.replace(group, draws=SCHEME)


def put_skip(store, group, signer) -> str:
    key = layout.rollout_key(group.policy_version, group.worker_id, group.seq, skip=True)
    store.put(key, encode_group(group, signer=signer), mode="create")
    return key


def test_a_skip_key_parses_as_its_group_and_is_told_apart():
    key = layout.rollout_key(4, "w.1", 17, skip=True)
    assert layout.parse_rollout_key(key) == (4, "w.1", 17)
    assert layout.is_skip_key(key) and not layout.is_skip_key(key.removesuffix(layout.SKIP_SUFFIX))
    assert layout.parse_rollout_key(key + "x") is None and not layout.is_skip_key("rollouts/v00000004/a.skip")


def test_the_sealer_seals_a_seeded_group_under_its_skip_key_and_refuses_an_unseeded_one():
    sealer = Sealer("w", _signer())
    key, _ = sealer.seal(_seeded(make_group(2, "w", seq=5)), skip=True)
    assert layout.is_skip_key(key) and layout.parse_rollout_key(key) == (2, "w", 5)
    with pytest.raises(ValueError, match="seeded draws"):
        sealer.seal(make_group(2, "w", seq=0), skip=True)


def test_seq_books_count_the_seqs_not_verified_below_the_highest_settled():
    books: dict[str, seq_books.SeqBook] = {}
    for seq in (0, 1, 3, 3, 6, 9):
        seq_books.verify(books, "w", seq, seeded=True)
    seq_books.note(books, "w", 4)  # listed, never read: not accounted for until it is
    assert seq_books.unverified(books, "w", 6) == ([4], [0, 1, 3, 6], 0)
    assert seq_books.unseen(books, "w", 0, 6) == 2  # 2 and 5
    assert seq_books.unseen(books, "w", 0, 10**12) == 10**12 + 1 - 6  # counted, not enumerated
    assert seq_books.settle(books, "w", 6, version=3) == 3  # 2, 4 and 5
    assert books["w"].low == 7 and books["w"].seen == [9] and books["w"].settled_version == 3
    seq_books.note(books, "w", 5)  # landed after its version was swept: counted already
    seq_books.verify(books, "w", 8, seeded=True)
    assert books["w"].seen == [8, 9]
    assert seq_books.settle(books, "w", 9, version=4) == 1  # 7
    for seq in (40, 41):  # a cursor older than the books starts a name at its lowest seq listed...
        seq_books.verify(books, "late", seq, seeded=True, start=None)
    assert seq_books.settle(books, "late", 41, version=4) == 0
    seq_books.verify(books, "new", 2, seeded=True)  # ...a current one at 0: seqs 0 and 1 are gaps
    assert seq_books.settle(books, "new", 2, version=4) == 2
    seq_books.note(books, "unseeded", 5)
    assert seq_books.settle(books, "nobody", 3, version=4) == 0
    seq_books.settle(books, "unseeded", 5, version=4)
    seq_books.prune(books, {"w": "fp", "late": "fp", "new": "fp"})  # nothing listed, no key: forgotten
    assert set(books) == {"w", "late", "new"}


def test_a_skip_record_is_audited_never_trained_and_the_seq_a_worker_kept_back_is_a_gap(store):
    signer = _signer()
    keys = {}
    for seq in (0, 1, 3):  # seq 2 is kept back: never uploaded
        keys[seq] = put_signed(store, _seeded(make_group(0, "w", seq, task_index=seq)), signer)
    zero = _seeded(make_group(0, "w", 4, task_index=4, answers=["1", "1"]))  # both wrong: zero variance
    skip = put_skip(store, zero, signer)
    keys[5] = put_signed(store, _seeded(make_group(1, "w", 5, task_index=5)), signer)
    ing = signed_ingestor(store, max_staleness=1)
    ing.poll(1)
    assert ing.cursor.rejected[skip] == "skipped" and skip not in ing.shared.ready
    assert ing.cursor.by_key[signer.fingerprint]["skips"] == 1
    assert sorted(g.key for g in ing.select(1, 10)) == sorted(keys.values())
    ing.sweep(2)  # v0 leaves the window: its last listing settles seqs 0-4
    assert ing.cursor.gaps == 1 and ing.cursor.by_key[signer.fingerprint]["gap"] == 1
    assert ing.stats()["gaps"] == 1


def test_a_worker_that_keeps_groups_back_is_quarantined_by_its_gaps_and_its_later_groups_rejected(store):
    signer = _signer()
    honest = _signer()
    for seq in range(12):
        if seq % 2 == 0:  # every other group kept back
            put_signed(store, _seeded(make_group(0, "p", seq, task_index=seq)), signer)
        put_signed(store, _seeded(make_group(0, "h", seq, task_index=seq)), honest)
    later = put_signed(store, _seeded(make_group(1, "p", 12, task_index=12)), signer)
    ing = signed_ingestor(store, max_staleness=0)
    ing.poll(0)
    ing.sweep(1)
    assert ing.cursor.by_key[signer.fingerprint]["gap"] == 5  # 1, 3, 5, 7, 9 (11 is above its last seq at v0)
    assert signer.fingerprint in ing.cursor.quarantined
    assert honest.fingerprint not in ing.cursor.quarantined
    assert ing.cursor.by_key.get(honest.fingerprint, {}).get("gap", 0) == 0
    ing.poll(1)
    assert ing.cursor.rejected[later] == "quarantined"


def test_a_seq_filled_with_a_record_its_key_did_not_sign_is_a_gap_and_squatting_frames_no_one(store):
    """Anyone who may write under rollouts/ can list a key under any name: junk at a seq the worker kept back
    does not account for it, and junk at a seq the worker did upload does not make a gap of it."""
    signer = _signer()
    other = _signer()
    put_signed(store, _seeded(make_group(0, "w", 0)), signer)
    ing = signed_ingestor(store, max_staleness=0)
    ing.select(0, 10)  # binds the name to its key
    put_signed(store, _seeded(make_group(0, "w", 1, task_index=1)), other)  # a forged filler of seq 1
    squat = layout.rollout_key(0, "w", 2, stamp_ms=1)  # listed first: the worker's own seq 2 is a duplicate
    store.put(squat, b"junk", mode="create")
    put_signed(store, _seeded(make_group(0, "w", 2, task_index=2)), signer)
    store.put(layout.rollout_key(0, "w", 9_999_999), b"junk", mode="create")  # far ahead of the worker
    ing.poll(0)
    ing.sweep(1)
    assert ing.cursor.by_key[signer.fingerprint]["gap"] == 1  # seq 1 only


def test_a_group_uploaded_after_its_version_was_swept_is_found_by_the_settlement(store):
    signer = _signer()
    put_signed(store, _seeded(make_group(0, "w", 0)), signer)
    ing = signed_ingestor(store, max_staleness=0)
    ing.poll(0)
    ing.sweep(1)  # v0 swept: seq 0 settled
    put_signed(store, _seeded(make_group(1, "w", 1, task_index=1)), signer)  # expired in its spool...
    put_signed(store, _seeded(make_group(3, "w", 2, task_index=2)), signer)
    ing.poll(3)
    ing.sweep(2)
    ing.sweep(4)  # ...uploaded late into swept v1: found when seq 2 is settled
    assert ing.cursor.gaps == 0 and "gap" not in ing.cursor.by_key.get(signer.fingerprint, {})


def test_a_skip_record_with_mixed_rewards_is_a_false_skip_and_quarantines_its_key(store):
    signer = _signer()
    liked = put_signed(store, _seeded(make_group(0, "p", 0, task_index=0)), signer)
    false = put_skip(store, _seeded(make_group(0, "p", 1, task_index=1)), signer)  # one right, one wrong
    later = put_signed(store, _seeded(make_group(0, "p", 2, task_index=2)), signer)
    ing = signed_ingestor(store)
    assert ing.select(0, 10) == []  # the skip records are re-scored first: the key is out before any choice
    assert ing.cursor.rejected[false] == "false_skip"
    assert "false skip" in ing.cursor.quarantined[signer.fingerprint]
    assert {ing.cursor.rejected.get(k) for k in (liked, later)} == {"quarantined"}
    assert ing.cursor.by_key[signer.fingerprint]["false_skip"] == 1


def test_a_skip_record_passes_to_the_exact_check_of_its_draws_and_a_forged_one_is_a_false_skip(store):
    signer = _signer()
    honest = put_skip(store, _seeded(make_group(0, "h", 0, answers=["1", "1"])), signer)
    other = _signer()
    forged = put_skip(store, _seeded(make_group(0, "f", 0, task_index=1, answers=["1", "1"])), other)
    ing = signed_ingestor(store)
    ing.poll(0)
    queued = {a.group.key: a for a in ing.take_draw_audits()}
    assert set(queued) == {honest, forged} and ing.take_draw_audits() == []
    assert {a.samples for a in queued.values()} == {None}  # the ingestor's default: every sample
    # what the trainer's exact forward measured: the honest tokens are their draws, the forged ones are not
    assert ing.draws_audited([queued[honest], queued[forged]], [0.0, 0.3], tolerance=1e-3) == 1
    assert ing.cursor.rejected[honest] == "skipped" and ing.cursor.rejected[forged] == "false_skip"
    assert list(ing.cursor.quarantined) == [other.fingerprint]
    assert (
        ing.draws_audited([queued[honest]], [float("inf")], tolerance=1e-3) == 0
    )  # unverifiable: not blamed
    assert ing.cursor.skips == {"audited": 2, "false": 1, "draws_checked": 1, "unverifiable": 1}
    assert signer.fingerprint not in ing.cursor.quarantined and "skipped" not in ing.cursor.drops


def test_a_keys_first_skip_records_are_checked_whole_then_a_sample_of_each(store):
    """`security.skip_audit_first`: an untrusted key's skip records are checked whole until that many have
    been queued (`skips_whole`), so a fresh key, a Sybil's too, cannot hide a group behind a forged one first;
    after that each gets `skip_draw_samples` random samples checked (and the whole of a random share,
    `skip_draw_audit`, 0 here). A trusted key's are sampled from the start."""
    signer, trusted = _signer(), _signer()
    ing = signed_ingestor(store, trusted_keys=frozenset({trusted.fingerprint}))
    ing.skips.skip_draw_audit, ing.skips.skip_draw_samples, ing.skips.skip_audit_first = 0.0, 1, 2
    answers = ["1", "1"]
    for seq in range(2):
        put_skip(store, _seeded(make_group(0, "w", seq, task_index=seq, answers=answers)), signer)
    put_skip(store, _seeded(make_group(0, "t", 0, answers=answers)), trusted)
    ing.poll(0)
    first = {a.group.key: a for a in ing.take_draw_audits()}
    assert len(first) == 3
    by_signer = {a.group.signer: a.samples for a in first.values() if a.group.signer != signer.fingerprint}
    assert by_signer == {trusted.fingerprint: by_signer[trusted.fingerprint]}
    assert len(by_signer[trusted.fingerprint]) == 1 and by_signer[trusted.fingerprint] <= {0, 1}
    mine = [a for a in first.values() if a.group.signer == signer.fingerprint]
    assert [a.samples for a in mine] == [None, None]  # its first two: whole
    assert ing.draws_audited(list(first.values()), [0.0, 0.0, 0.0], tolerance=1e-3) == 0
    assert ing.cursor.by_key[signer.fingerprint]["skips_whole"] == 2
    assert "skips_whole" not in ing.cursor.by_key[trusted.fingerprint]  # a trusted key's are sampled
    assert ing.cursor.skips == {"audited": 3, "draws_checked": 2, "samples_checked": 1}
    later = put_skip(store, _seeded(make_group(0, "w", 2, task_index=2, answers=answers)), signer)
    ing.poll(0)
    (audit,) = ing.take_draw_audits()
    assert audit.group.key == later and audit.samples is not None and len(audit.samples) == 1
    assert audit.checks(next(iter(audit.samples))) and not audit.checks(2)
    # a forged sample among those checked: a false skip, the key quarantined at once
    assert ing.draws_audited([audit], [0.4], tolerance=1e-3) == 1
    assert ing.cursor.rejected[later] == "false_skip" and signer.fingerprint in ing.cursor.quarantined


def test_a_trusted_keys_skip_records_are_checked_at_their_versions_last_step_in_the_window(store):
    """A trusted key is never quarantined: its skip records' check is a measurement, made once per version
    when the version is about to leave the window (one forward for all of them) instead of at every step;
    an untrusted key's are checked at the next step."""
    signer, trusted = _signer(), _signer()
    ing = signed_ingestor(store, trusted_keys=frozenset({trusted.fingerprint}), max_staleness=2)
    ing.skips.skip_draw_samples = 1
    mine = put_skip(store, _seeded(make_group(0, "w", 0, answers=["1", "1"])), signer)
    theirs = put_skip(store, _seeded(make_group(0, "t", 0, answers=["1", "1"])), trusted)
    ing.poll(0)
    assert [a.group.key for a in ing.take_draw_audits(0)] == [mine]
    assert ing.take_draw_audits(1) == []  # v0 is still in the window at v1 with staleness 2
    assert [a.group.key for a in ing.take_draw_audits(2)] == [theirs]  # v0's last step in the window
    assert ing.take_draw_audits(3) == []


def test_only_a_share_of_a_trusted_keys_skip_records_is_checked_and_every_untrusted_ones(store):
    """`security.skip_audit_trusted`: a trusted key's skip record is queued for the check of its draws only
    with that chance (the check measures: the key is never quarantined); an untrusted key's always. Both
    are re-scored and filed as audited."""
    signer, trusted = _signer(), _signer()
    ing = signed_ingestor(store, trusted_keys=frozenset({trusted.fingerprint}))
    ing.skips.skip_draw_samples, ing.skips.skip_audit_first, ing.skips.skip_audit_trusted = 1, 0, 0.0
    mine = put_skip(store, _seeded(make_group(0, "w", 0, answers=["1", "1"])), signer)
    for seq in range(3):
        put_skip(store, _seeded(make_group(0, "t", seq, task_index=seq, answers=["1", "1"])), trusted)
    ing.poll(0)
    assert [a.group.key for a in ing.take_draw_audits()] == [mine]
    assert ing.cursor.skips == {"audited": 4} and ing.cursor.by_key[trusted.fingerprint]["skips"] == 3
    ing.skips.skip_audit_trusted = 1.0
    put_skip(store, _seeded(make_group(0, "t", 3, task_index=3, answers=["1", "1"])), trusted)
    ing.poll(0)
    assert [a.group.signer for a in ing.take_draw_audits()] == [trusted.fingerprint]


def test_skip_records_do_not_count_against_the_flood_limit(store):
    """A trainer short of a batch publishes no new version, so an honest worker whose draws keep coming out
    zero-variance announces any number of skip records at one version: they are counted apart from groups
    (`version_listing.SKIPS`) and never make a flood (a per-version limit on them stopped such a run)."""
    signer = _signer()
    put_signed(store, _seeded(make_group(0, "w", 0)), signer)
    for seq in range(1, 6):
        put_skip(store, _seeded(make_group(0, "w", seq, task_index=seq, answers=["1", "1"])), signer)
    ing = signed_ingestor(store, flood_limit=2)
    ing.poll(0)
    assert ing.cursor.quarantined == {} and ing.cursor.by_key[signer.fingerprint]["skips"] == 5
    assert ing.listing.versions[0].by_key[signer.fingerprint, "skip records"] == 5 and not ing.ledger.suspects


def test_a_seq_far_above_a_names_others_is_settled_in_bounded_time_and_memory(store):
    """One signed, seeded record at the highest seq a key can name (10^10 - 1) under a worker's own name (what the attack suite's id thief's
    skip records did: its seqs start at 10^9): the settlement counts the seqs below it that were never
    listed instead of walking them (it once built a list of every one of them, and the xdist worker running
    the attack suite was killed by the kernel's OOM killer at 23.8 GB), and the key is quarantined."""
    signer = _signer()
    put_signed(store, _seeded(make_group(0, "far", 0)), signer)
    top = 9_999_999_999  # `layout.rollout_key`'s largest seq
    far = put_signed(store, _seeded(make_group(0, "far", top, task_index=1)), signer)
    ing = signed_ingestor(store, max_staleness=0)
    ing.poll(0)
    assert ing.cursor.uses.get(far, 0) == 0 and far not in ing.cursor.rejected  # a valid group, listed
    ing.sweep(1)
    assert ing.cursor.gaps == top - 1
    assert ing.cursor.by_key[signer.fingerprint]["gap"] == top - 1
    assert signer.fingerprint in ing.cursor.quarantined


@pytest.mark.parametrize("fetched_first", [False, True])
@pytest.mark.parametrize("content", ["junk", "copy"])
def test_junk_squatting_a_seq_does_not_drop_the_names_own_record(store, fetched_first, content):
    """Junk under a worker's name at the seq it is about to upload, listed first (a lower stamp), made the
    worker's own record the `duplicate`: its group was lost and no one was blamed (the red-team review of
    2026-12-04). The junk proves to be no record of the name (`bad_magic`; a copy of the worker's own
    signed seq 0: `key_mismatch`, blamed on no one) and the seq goes back to the worker's record, whether
    the junk was fetched before the record was listed or after."""
    from pnyx.security.checks import faults

    signer = _signer()
    first = put_signed(store, _seeded(make_group(0, "w", 0)), signer)
    ing = signed_ingestor(store, max_staleness=0)
    ing.poll(0)  # binds the name to its key
    squat = layout.rollout_key(0, "w", 1, stamp_ms=1)  # listed before the worker's own seq 1
    store.put(squat, b"junk" if content == "junk" else store.get(first), mode="create")
    reason = "bad_magic" if content == "junk" else "key_mismatch"
    if fetched_first:
        ing.poll(0)
        assert ing.cursor.rejected[squat] == reason
    own = put_signed(store, _seeded(make_group(0, "w", 1, task_index=1)), signer)
    ing.poll(0)
    assert ing.cursor.rejected[squat] == reason
    assert faults(ing.cursor.by_key.get(signer.fingerprint, {})) == 0
    assert own not in ing.cursor.rejected, ing.cursor.rejected
    assert own in {g.key for g in ing.select(0, 10)}
