"""Committed draws (`security.committed_draws`): commitments, the trainer's ticks, the worker's side, and the
check a committed group must pass. Real store (a local folder), real Ed25519 keys; the trainer's and the
workers' halves meet only in the store, as in a run. The attack they bind (a picker that draws a seq again
with another task) is in tests/test_attacks.py; a real `pnyx run` with them in tests/test_run_e2e.py."""

from __future__ import annotations

import threading
import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pnyx.errors import ConfigError, RecordRejected
from pnyx.protocol import commits, layout
from pnyx.protocol.draws import group_seeds
from pnyx.rollout.committer import Committer, Drawn, Refused
from pnyx.rollout.sealer import Sealer
from pnyx.security.signing import Signer
from pnyx.store import open_store
from pnyx.train.ticker import Ticker

RUN = "run-c"


def _signer() -> Signer:
    return Signer(Ed25519PrivateKey.generate())


@pytest.fixture
def parts(tmp_path):
    store = open_store(str(tmp_path / "run"))
    trainer = _signer().for_run(RUN)
    version = [3]
    ticker = Ticker(store, trainer, RUN, 0.01, lambda: version[0], max_staleness=2)
    return store, trainer, ticker, version


def _committer(store, trainer, name="w1", signer=None) -> Committer:
    return Committer(store, signer or _signer(), RUN, name, trainer.fingerprint)


def test_a_tick_includes_a_commitment_once_and_refuses_a_second_one_for_the_same_seqs(parts):
    store, trainer, ticker, _ = parts
    assert ticker.tick() is None  # nothing waits: no tick is written
    w = _committer(store, trainer)
    first = w.commit(3, [0, 1], ["t-a", "t-b"])
    tick = ticker.tick()
    assert tick is not None and tick.n == first.n == 0
    got = w.outcome(first, w.read_tick(0))
    assert isinstance(got, Drawn) and got.beacon == tick.beacon and len(bytes.fromhex(got.beacon)) == 32
    assert (
        tick.included[first.key].tasks == ["t-a", "t-b"]
        and tick.included[first.key].key == w.signer.fingerprint
    )

    # the same seqs again with other tasks (a picker that disliked the outcome): refused, with the next free seq
    again = w.commit(3, [1, 2], ["t-c", "t-d"])
    tick = ticker.tick()
    got = w.outcome(again, w.read_tick(tick.n))
    assert isinstance(got, Refused) and got.next_seq == 2, got
    # another name, or the same name under another key, has seqs of its own
    other = _committer(store, trainer, "w2").commit(3, [0], ["t-a"])
    thief = _committer(store, trainer, "w1").commit(3, [0], ["t-z"])
    tick = ticker.tick()
    assert other.key in tick.included and thief.key in tick.included
    assert layout.tick_key(tick.n) in {m.key for m in store.list(layout.TICKS_PREFIX)}
    assert store.get(layout.TICKS_LATEST) == str(tick.n).encode()


def test_a_commitment_whose_bytes_or_signature_do_not_hold_is_refused(parts):
    store, trainer, ticker, _ = parts
    w = _committer(store, trainer)
    good = w.commit(3, [0], ["t-a"])
    # overwritten with other bytes after it was listed under its hash: the hash no longer matches
    forged = commits.Commitment(run_id=RUN, worker_id="w1", version=3, first_seq=5, tasks=["t-b"])
    store.put(good.key, commits.encode_commitment(forged, w.signer))
    # another run's commitment; junk
    other_run = Committer(store, _signer(), "another-run", "w3", trainer.fingerprint)
    data = commits.encode_commitment(
        commits.Commitment(run_id="another-run", worker_id="w3", version=3, first_seq=0, tasks=["t"]),
        other_run.signer,
    )
    store.put(commits.commit_key(0, "w3", 0, data), data)
    junk = commits.commit_key(0, "w4", 0, b"junk")
    store.put(junk, b"junk")
    tick = ticker.tick()
    assert not tick.included
    assert set(tick.refused) == {good.key, commits.commit_key(0, "w3", 0, data), junk}
    assert "hash" in tick.refused[good.key] and "bad_magic" in tick.refused[junk]


def test_the_check_of_a_committed_group_holds_every_part_of_its_identity(parts):
    store, trainer, ticker, _ = parts
    w = _committer(store, trainer)
    ticket = w.commit(3, [4, 5], ["t-a", "t-b"])
    tick = ticker.tick()
    fp = w.signer.fingerprint
    ok = dict(
        signer=fp, worker_id="w1", seq=5, task_id="t-b", version=3, beacon=tick.beacon, commit=ticket.key
    )
    assert commits.check_group(tick, **ok) is None
    for change, words in [
        ({"beacon": "00" * 32}, "beacon"),
        ({"task_id": "t-a"}, "committed to task"),
        ({"seq": 6}, "outside"),
        ({"version": 4}, "committed at v3"),
        ({"signer": "f" * 32}, "not this group's"),
        ({"worker_id": "w9"}, "not this group's"),
        ({"commit": "commits/t000000000000/w1-0000000004-" + "0" * 32}, "did not include"),
    ]:
        assert words in (commits.check_group(tick, **{**ok, **change}) or ""), change
    assert "never wrote" in commits.check_group(None, **ok)
    # the beacon is part of every seed: the same group under another tick draws other uniforms
    base = (RUN, fp, "w1", "t-b", 3, 5, 4)
    assert group_seeds(*base, tick.beacon) != group_seeds(*base, "11" * 32) != group_seeds(*base)


def test_a_tick_not_signed_by_the_trainer_is_refused_by_the_worker(parts):
    store, trainer, ticker, _ = parts
    w = _committer(store, trainer)
    w.commit(3, [0], ["t-a"])
    fake = commits.Tick(run_id=RUN, n=0, beacon=commits.new_beacon(), version=3)
    store.put(layout.tick_key(0), commits.encode_tick(fake, _signer().for_run(RUN)))
    with pytest.raises(RecordRejected, match="not the run's trainer key"):
        w.read_tick(0)


def test_a_worker_waits_for_its_tick_and_commits_again_when_a_tick_passed_it_by(parts):
    store, trainer, ticker, _ = parts
    late = _committer(store, trainer)
    ticket = late.commit(3, [0], ["t-a"], n=0)
    # tick 0 is written from commitments listed before this one landed: it does not know it
    store.delete(ticket.key)
    early = _committer(store, trainer, "w0")
    early.commit(3, [0], ["t-x"], n=0)
    assert ticker.tick().n == 0
    store.put(ticket.key, ticket.data)  # landed after the listing
    stop = threading.Event()
    ticker.start()
    try:
        got = late.wait(ticket, stop)
    finally:
        ticker.close()
    assert isinstance(got, Drawn) and got.n >= 1 and got.key != ticket.key, got
    assert got.key in ticker.get(got.n).included


def test_a_restarted_worker_moves_past_the_seqs_it_committed_before_its_crash(parts):
    store, trainer, ticker, _ = parts
    key = _signer()
    before = Committer(store, key, RUN, "w1", trainer.fingerprint)
    before.commit(3, [0, 1, 2, 3], ["a", "b", "c", "d"])
    ticker.tick()  # committed, then the worker died before uploading anything
    sealer = Sealer("w1", key)
    sealer.resume(0)  # nothing of it in the store: a restart resumes at 0
    after = Committer(store, key, RUN, "w1", trainer.fingerprint)
    ticker.start()
    try:
        ahead = after.ahead(3, ["e", "f"], sealer.reserve)
        assert ahead.seqs == [0, 1]  # the dead life's seqs: refused, then committed again past them
        got, seqs = after.draw(
            ahead, sealer.reserve, lambda s: sealer.resume(max(s, sealer.next_seq)), threading.Event()
        )
    finally:
        ticker.close()
    assert isinstance(got, Drawn) and seqs == [4, 5] and sealer.next_seq == 6


def test_a_restarted_trainer_reads_its_ticks_back_and_still_refuses_reused_seqs(parts):
    store, trainer, ticker, version = parts
    w = _committer(store, trainer)
    w.commit(3, [0, 1], ["a", "b"])
    first = ticker.tick()
    restarted = Ticker(store, trainer, RUN, 0.01, lambda: version[0], max_staleness=2)
    restarted.restore()
    assert restarted.next_n == 1 and restarted.get(0).beacon == first.beacon
    reuse = w.commit(3, [1], ["c"])
    tick = restarted.tick()
    assert tick.n == 1 and reuse.key in tick.refused
    # ticks of versions far behind the window are forgotten (their groups would be stale anyway)
    version[0] = 20
    w.commit(20, [2], ["d"])
    restarted.tick()
    assert restarted.get(0) is None and restarted.get(2) is not None


def test_a_stopping_ticker_ticks_once_more_for_the_commitments_waiting(parts):
    """`close` ticks the commitments that wait (workers draw them, then swap to the newest weights, instead of
    holding the version they committed to until a trainer ticks again); a stopped ticker writes nothing."""
    store, trainer, ticker, _ = parts
    ticker.interval_s = 3600.0  # its thread ticks as it starts (nothing waits then), next only when stopped
    ticker.start()
    time.sleep(2.0)
    w = _committer(store, trainer)
    ticket = w.commit(3, [0], ["t-a"])
    time.sleep(0.2)
    assert not store.exists(layout.tick_key(ticket.n)), "the ticker's thread ticked after its first pass"
    ticker.close()
    tick = w.read_tick(ticket.n)
    assert tick is not None and ticket.key in tick.included
    assert isinstance(w.outcome(ticket, tick), Drawn)
    late = w.commit(3, [1], ["t-b"])
    time.sleep(0.1)
    assert not store.exists(layout.tick_key(late.n))  # stopped: no thread ticks any more


def test_committed_draws_need_seeded_draws_and_standing_needs_committed_draws():
    """Committed draws are on by default wherever seeded draws are, and standing wherever committed draws
    are: turning one off turns what needs it off too (and keeps it off through run.json), while setting
    both ways is refused."""
    from pnyx.config import check_worker_dtype, config_from_dict, load_config

    assert load_config().security.committed_draws  # the default
    cfg = load_config(None, {"security": {"seeded_draws": False}})
    assert not cfg.security.committed_draws
    check_worker_dtype(cfg)  # a consistent run
    assert not config_from_dict(cfg.model_dump(mode="json")).security.committed_draws  # as workers read it
    cfg = load_config(None, {"security": {"committed_draws": True, "seeded_draws": False}})
    with pytest.raises(ConfigError, match="committed_draws needs security.seeded_draws"):
        check_worker_dtype(cfg)
    cfg = load_config(None, {"security": {"standing_groups": 4, "committed_draws": False}})
    with pytest.raises(ConfigError, match="standing_groups needs security.committed_draws"):
        check_worker_dtype(cfg)
    check_worker_dtype(load_config(None, {"security": {"standing_groups": 4}}))  # on by default
    # standing: 8 by default under committed draws, 0 wherever they are off unless set
    assert load_config().security.standing_groups == 8
    for off in ({"committed_draws": False}, {"seeded_draws": False}):
        cfg = load_config(None, {"security": off})
        assert cfg.security.standing_groups == 0
        check_worker_dtype(cfg)
        assert config_from_dict(cfg.model_dump(mode="json")).security.standing_groups == 0


def test_a_tick_whose_put_landed_but_reported_a_failure_is_adopted_not_redrawn(parts, monkeypatch):
    """Workers may already draw with a tick whose put the store reported as failed (the reply was lost):
    the next tick finds it in place and keeps its beacon, so their groups still match."""
    from pnyx.errors import StoreUnavailableError

    store, trainer, ticker, _ = parts
    w = _committer(store, trainer)
    ticket = w.commit(3, [0], ["t-a"])
    real_put = store.put

    def lost_reply(key, data, mode="overwrite"):
        real_put(key, data, mode)
        if key == layout.tick_key(0):
            raise StoreUnavailableError("reply lost")
        return None

    monkeypatch.setattr(store, "put", lost_reply)
    with pytest.raises(StoreUnavailableError):
        ticker.tick()
    monkeypatch.setattr(store, "put", real_put)
    landed = w.read_tick(0)  # what a worker reads meanwhile
    again = ticker.tick()
    assert again is not None and again.n == 0 and again.beacon == landed.beacon
    assert ticker.get(0).beacon == landed.beacon and ticket.key in ticker.get(0).included
    assert ticker.next_n == 1


def test_an_uncommitted_group_quarantines_its_key_at_once():
    from pnyx.security.checks import UNCOMMITTED, QuarantineSettings, quarantine_reason

    q = QuarantineSettings(quarantine_rate=0.2, quarantine_min=5, quarantine_key_z=None)
    assert quarantine_reason({"groups": 40, UNCOMMITTED: 1}, None, q) is not None
    assert quarantine_reason({"groups": 40, "logprob_gap": 1}, None, q) is None


def test_a_group_is_held_while_a_seq_committed_below_it_is_not_delivered(parts):
    """The hold-back: the planner passes over a committed group while a seq its (name, key) committed
    below it has no verified record, so a worker that leaves a committed seq empty gets nothing after it
    trained until the seq is settled; released when the trainer has published nothing for a while."""
    from types import SimpleNamespace

    from pnyx.train.seq_books import SeqBook

    store, trainer, ticker, version = parts
    w = _committer(store, trainer)
    w.commit(3, [0, 1, 2], ["a", "b", "c"])
    ticker.tick()
    fp = w.signer.fingerprint

    def group(seq, signer=fp):
        return SimpleNamespace(group=SimpleNamespace(tick=0, worker_id="w1", seq=seq), signer=signer)

    assert ticker.held(group(0), None) is None  # nothing below it
    assert ticker.held(group(2), SeqBook(low=0, verified=[0])) == (3, 1)  # seq 1 (committed at v3) missing
    assert ticker.held(group(2), SeqBook(low=0, verified=[0, 1])) is None
    assert ticker.held(group(2), SeqBook(low=2, verified=[])) is None  # settled below 2
    assert ticker.held(group(2, signer="f" * 32), SeqBook(low=0)) is None  # another key's seqs are its own
    ticker.hold_release_s = 0.0  # the trainer published nothing for longer than this: released
    assert ticker.held(group(2), SeqBook(low=0, verified=[0])) is None

    # standing: the first 2 seqs a (name, key) committed are held for good, released or not; a trusted key's not
    ticker.standing = 2
    assert ticker.held(group(1), SeqBook(low=0, verified=[0])) == (-1, 1)
    assert ticker.held(group(2), SeqBook(low=0, verified=[0, 1])) is None
    assert [ticker.on_probation("w1", fp, s) for s in range(3)] == [True, True, False]  # the sweep's label
    ticker.trusted = frozenset({fp})
    assert ticker.held(group(1), SeqBook(low=0, verified=[0])) is None
    assert not ticker.on_probation("w1", fp, 0)


def test_a_restarted_workers_undrawn_cohort_is_excused_within_a_budget_and_not_held_for(parts):
    """A worker killed after its commitment's tick, before it drew: its next life commits from the first
    seq its store and spool lack, the tick refuses it as a reuse and excuses the rest of the earlier
    cohort (`Lost`, in the signed tick): the settlement counts those seqs `lost`, not `gap`, and the
    hold-back does not wait for them. One excuse per (name, key) and one more per 100 seqs committed:
    a picker claiming restarts after draws it did not want gets no more."""
    from types import SimpleNamespace

    from pnyx.train.seq_books import SeqBook

    store, trainer, ticker, version = parts
    key = _signer()
    fp = key.for_run(RUN).fingerprint
    before = Committer(store, key, RUN, "w1", trainer.fingerprint)
    before.commit(3, [0, 1, 2, 3], ["a", "b", "c", "d"])
    ticker.tick()  # drew 0 and 1, uploaded them, died before 2 and 3
    after = Committer(store, key, RUN, "w1", trainer.fingerprint)
    refused = after.commit(3, [2, 3], ["e", "f"])
    tick = ticker.tick()
    assert refused.key in tick.refused
    assert [(x.worker_id, x.key, x.first_seq, x.last_seq) for x in tick.lost] == [("w1", fp, 2, 3)]
    assert ticker.excused("w1", fp) == [(2, 3)] and ticker.counts["excused"] == 2
    assert commits.decode_tick(store.get(layout.tick_key(tick.n)), RUN, trainer.fingerprint).lost == tick.lost
    nxt = after.commit(3, [4], ["g"])
    assert nxt.key in ticker.tick().included
    g4 = SimpleNamespace(group=SimpleNamespace(tick=0, worker_id="w1", seq=4), signer=fp)
    assert ticker.held(g4, SeqBook(low=0, verified=[0, 1])) is None  # 2 and 3 excused: not waited for

    # a second "restart" of the same pair with fewer than 100 seqs committed: refused, nothing excused
    tick = ticker.tick() if after.commit(3, [4], ["h"]) else None
    assert tick is not None and tick.lost == [] and ticker.excused("w1", fp) == [(2, 3)]
    # a restarted trainer reads the excuse back from its ticks
    restarted = Ticker(store, trainer, RUN, 0.01, lambda: version[0], max_staleness=2)
    restarted.restore()
    assert restarted.excused("w1", fp) == [(2, 3)]
    # one resumed further on (the chaos suite's trainer killed after the worker): the excusing tick's
    # version left the window, but its checkpoint's cursor has not swept v3 yet, where seqs 2 and 3 are
    # settled after the restart: the tick is read back, or they would count as gaps
    version[0] = 12
    far = Ticker(store, trainer, RUN, 0.01, lambda: version[0], max_staleness=2)
    far.restore()
    assert far.excused("w1", fp) == []  # only the window's ticks: the excuse is gone
    far = Ticker(store, trainer, RUN, 0.01, lambda: version[0], max_staleness=2)
    far.restore(unswept=3)
    assert far.excused("w1", fp) == [(2, 3)]


def test_a_restart_excuses_the_cohort_being_drawn_and_the_one_committed_ahead(parts):
    """Under `security.commit_ahead` a worker killed while drawing cohort k has cohort k+1 committed too: the
    excuse covers the pair's last two included commitments from the refused one's first seq on, no more."""
    store, trainer, ticker, _ = parts
    key = _signer()
    fp = key.for_run(RUN).fingerprint
    before = Committer(store, key, RUN, "w1", trainer.fingerprint)
    before.commit(3, [0, 1], ["a", "b"])
    ticker.tick()
    before.commit(3, [2, 3], ["c", "d"])  # drawn and uploaded
    ticker.tick()
    before.commit(3, [4, 5], ["e", "f"])  # being drawn at the kill
    before.commit(3, [6, 7], ["g", "h"])  # committed ahead
    ticker.tick()
    after = Committer(store, key, RUN, "w1", trainer.fingerprint)
    refused = after.commit(3, [4, 5], ["i", "j"])  # the store and spool hold seqs up to 3
    tick = ticker.tick()
    assert refused.key in tick.refused and "next free seq 8" in tick.refused[refused.key]
    assert [(x.first_seq, x.last_seq) for x in tick.lost] == [(4, 7)]
    # a claim from further back excuses no seq before the last two commitments
    other = _signer()
    w2 = Committer(store, other, RUN, "w2", trainer.fingerprint)
    for first in (0, 2, 4):
        w2.commit(3, [first, first + 1], ["x", "y"])
        ticker.tick()
    w2.commit(3, [0, 1], ["z", "z"])
    tick = ticker.tick()
    assert [(x.worker_id, x.first_seq, x.last_seq) for x in tick.lost] == [("w2", 2, 5)]
    assert ticker.excused("w1", fp) == [(4, 7)]


def test_excused_seqs_settle_as_lost_not_gaps():
    from pnyx.train import seq_books
    from pnyx.train.seq_books import SeqBook

    books = {"w": SeqBook(seen=[0, 1, 5], verified=[0, 1, 5], seeded=True)}
    assert seq_books.excuse(books, "w", 5, [(2, 3), (9, 12)]) == 2
    assert seq_books.settle(books, "w", 5, version=4) == 1  # seq 4: a gap; 2 and 3 excused
