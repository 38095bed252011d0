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


def test_seq_books_count_the_seqs_never_listed_below_the_highest_swept():
    books: dict[str, seq_books.SeqBook] = {}
    for seq in (0, 1, 3, 3, 6, 9):
        seq_books.note(books, "w", seq)
    assert seq_books.settle(books, "w", 6) == 3  # 2, 4 and 5
    assert books["w"].low == 7 and books["w"].seen == [9]
    seq_books.note(books, "w", 5)  # landed after its version was swept: counted already
    seq_books.note(books, "w", 8)
    assert books["w"].seen == [8, 9] and seq_books.settle(books, "w", 9) == 1  # 7
    seq_books.note(books, "late", 40)  # a name first met mid-run starts at its lowest seq listed
    seq_books.note(books, "late", 41)
    assert seq_books.settle(books, "late", 41) == 0
    assert seq_books.settle(books, "nobody", 3) == 0
    seq_books.prune(books, {"w": "fp"})
    assert set(books) == {"w"}


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
    assert ing.cursor.gaps == 0
    ing.sweep(2)  # v0 leaves the window: its last listing settles seqs 0-4
    assert ing.cursor.gaps == 1 and ing.cursor.by_key[signer.fingerprint]["gaps"] == 1
    assert ing.cursor.quarantined == {}  # a gap is counted, not a fault (docs/security.md)
    assert ing.stats()["gaps"] == 1


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
    queued = {g.key: g for g in ing.take_draw_audits()}
    assert set(queued) == {honest, forged} and ing.take_draw_audits() == []
    # what the trainer's exact forward measured: the honest tokens are their draws, the forged ones are not
    assert ing.draws_audited([queued[honest], queued[forged]], [0.0, 0.3], tolerance=1e-3) == 1
    assert ing.cursor.rejected[honest] == "skipped" and ing.cursor.rejected[forged] == "false_skip"
    assert list(ing.cursor.quarantined) == [other.fingerprint]
    assert (
        ing.draws_audited([queued[honest]], [float("inf")], tolerance=1e-3) == 0
    )  # unverifiable: not blamed
    assert ing.cursor.skips == {"audited": 2, "false": 1, "draws_checked": 1, "unverifiable": 1}
    assert signer.fingerprint not in ing.cursor.quarantined and "skipped" not in ing.cursor.drops


def test_skip_records_do_not_count_against_the_flood_limit(store):
    signer = _signer()
    put_signed(store, _seeded(make_group(0, "w", 0)), signer)
    for seq in range(1, 6):
        put_skip(store, _seeded(make_group(0, "w", seq, task_index=seq, answers=["1", "1"])), signer)
    ing = signed_ingestor(store, flood_limit=2)
    ing.poll(0)
    assert ing.cursor.quarantined == {} and ing.cursor.by_key[signer.fingerprint]["skips"] == 5
