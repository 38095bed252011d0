"""Ingestion against real stores: listing, ranking, validation, re-scoring, staleness, reuse, cursor, and a
cost that follows the step (what is fetched), not the backlog (what is listed)."""

from __future__ import annotations

import pytest
from ingest_support import ENV, make_group, make_ingestor, put

from pnyx.protocol import layout
from pnyx.protocol.codec import encode_group
from pnyx.store import open_store
from pnyx.train.ingest import Cursor


@pytest.fixture
def store(tmp_path):
    return open_store(str(tmp_path / "run"))


def test_valid_groups_in_window_are_admitted_on_every_backend(store_url):
    s = open_store(store_url)
    keys = [put(s, make_group(0, "w1", i, task_index=i)) for i in range(3)]
    ing = make_ingestor(s)
    assert ing.poll(0) == 3
    assert sorted(g.key for g in ing.select(0, 10)) == sorted(keys)


def test_forged_reward_is_overwritten_by_the_rescore_and_counted(store):
    # both completions are wrong (reward 0) but the worker claims 1.0 for the first
    g = make_group(0, "liar", 0, answers=["-12345", "777"], claimed=[1.0, 0.0])
    g.samples[1] = make_group(0, "liar", 0).samples[0]  # second sample right: the group has variance
    put(store, g)
    ing = make_ingestor(store)
    (scored,) = ing.select(0, 1)
    assert scored.rewards == [0.0, 1.0]
    assert scored.worker_rewards == [1.0, 1.0]
    assert ing.cursor.disagreements == {}  # counted when consumed, so a restart never counts it twice
    ing.commit([scored.key])
    assert ing.cursor.disagreements == {"liar": 1} and ing.cursor.scored == {"liar": 2}
    assert scored.advantages[0] < 0 < scored.advantages[1]


def test_staleness_boundary_keeps_exactly_max_staleness_and_drops_one_more(store):
    put(store, make_group(2, "w", 0, task_index=0))  # age 3 at trainer version 5: kept
    put(store, make_group(1, "w", 1, task_index=1))  # age 4: dropped as stale
    ing = make_ingestor(store, max_staleness=3)
    assert ing.poll(1) == 1  # at v1 only the v1 group is visible (v2 is in the future)
    assert ing.poll(5) == 1
    assert [g.version for g in ing.select(5, 10)] == [2]
    assert ing.cursor.drops == {"stale": 1}


def test_window_listing_never_reads_versions_outside_the_window(store):
    put(store, make_group(0, "w", 0))
    listed = []
    real_list = store.list

    def spy(prefix, *a, **k):
        listed.append(prefix)
        return real_list(prefix, *a, **k)

    store.list = spy
    ing = make_ingestor(store, max_staleness=2)
    ing.cursor.swept_below = 8  # versions below 8 already left the window earlier
    ing.poll(10)
    assert sorted(listed) == [layout.rollouts_dir(v) for v in (8, 9, 10)]


def test_group_is_used_at_most_max_reuse_times(store):
    key = put(store, make_group(0, "w", 0))
    ing = make_ingestor(store, max_reuse=2, max_staleness=10)
    uses = 0
    for v in range(5):
        ing.poll(v)
        batch = ing.select(v, 4)
        if batch:
            ing.commit([g.key for g in batch])
            uses += 1
    assert uses == 2 and ing.cursor.uses == {key: 2}


def test_a_batch_never_contains_the_same_group_twice(store):
    put(store, make_group(0, "w", 0))
    ing = make_ingestor(store, max_reuse=5)
    ing.poll(0)
    assert len(ing.select(0, 4)) == 1
    with pytest.raises(ValueError, match="twice"):
        ing.commit(["k", "k"])


def test_each_prompt_contributes_at_most_max_groups_per_prompt_per_step(store):
    for seq in range(3):
        put(store, make_group(0, "w", seq, task_index=0))
    put(store, make_group(0, "w", 9, task_index=1))
    ing = make_ingestor(store, max_groups_per_prompt=2)
    ing.poll(0)
    first = ing.select(0, 10)
    assert sorted(g.task_id for g in first) == ["arith/train/0/0", "arith/train/0/0", "arith/train/0/1"]
    ing.commit([g.key for g in first])
    assert [g.task_id for g in ing.select(0, 10)] == ["arith/train/0/0"]  # deferred, not dropped


def test_zero_variance_group_is_dropped_and_counted(store):
    task_answer = str(ENV.sample("train", 0, 1)[0].answer)
    put(store, make_group(0, "w", 0, answers=[task_answer, task_answer]))
    ing = make_ingestor(store)
    assert ing.poll(0) == 0
    assert ing.cursor.drops == {"zero_variance": 1}


def test_corrupt_and_mismatched_records_are_dropped_by_reason(store):
    store.put(layout.rollout_key(0, "w", 0), b"not a group", mode="create")
    store.put(layout.rollout_key(0, "w", 1), encode_group(make_group(0, "w", 7)), mode="create")  # seq lies
    g = make_group(0, "w", 2)
    g.task_id = "arith/nonsense"
    put(store, g)
    ing = make_ingestor(store)
    assert ing.poll(0) == 0
    assert ing.cursor.drops == {"bad_magic": 1, "key_mismatch": 1, "unknown_task": 1}


def test_group_from_another_environment_is_rejected(store):
    g = make_group(0, "w", 0)
    g.env = "countdown"
    put(store, g)
    ing = make_ingestor(store)
    ing.poll(0)
    assert ing.cursor.drops == {"env_mismatch": 1}


def test_rejected_groups_are_not_fetched_again(store):
    store.put(layout.rollout_key(0, "w", 0), b"junk", mode="create")
    ing = make_ingestor(store)
    ing.poll(0)
    ing.poll(0)
    assert ing.cursor.drops == {"bad_magic": 1}


def test_prompt_that_does_not_render_from_the_task_is_rejected(store):
    put(store, make_group(0, "w", 0))
    ing = make_ingestor(store)
    ing.admission.render = lambda prompt: [9, 9, 9]
    ing.poll(0)
    assert ing.cursor.drops == {"prompt_mismatch": 1}


def test_group_from_a_foreign_weights_history_is_rejected(store):
    put(store, make_group(0, "w", 0))  # carries weights_digest "d"
    ing = make_ingestor(store)
    ing.admission.expected_digest = lambda v: frozenset({"the-real-digest", "the-int8-plane-digest"})
    ing.poll(0)
    assert ing.cursor.drops == {"weights_mismatch": 1}


def test_cursor_round_trip_prevents_reconsuming_after_restart(store):
    keys = [put(store, make_group(0, "w", i, task_index=i)) for i in range(4)]
    ing = make_ingestor(store)
    ing.poll(0)
    used = [g.key for g in ing.select(0, 2)]
    ing.commit(used)
    saved = ing.cursor.to_json()

    again = make_ingestor(store)
    again.cursor = Cursor.from_json(saved)
    again.poll(0)
    rest = [g.key for g in again.select(0, 10)]
    assert sorted(used + rest) == sorted(keys) and not set(used) & set(rest)


def test_cursor_forgets_keys_once_their_version_leaves_the_window(store):
    put(store, make_group(0, "w", 0))
    ing = make_ingestor(store, max_staleness=1)
    ing.poll(0)
    ing.commit([g.key for g in ing.select(0, 1)])
    ing.poll(2)
    assert ing.cursor.uses == {} and ing.cursor.swept_below == 1
    assert ing.cursor.drops == {}  # it was used: leaving the window is not a drop


def test_workers_take_turns_within_a_version(store):
    # "a" sorts before "b": with plain key order every batch would be a's alone.
    a_keys = [put(store, make_group(0, "a", seq, task_index=seq), stamp_ms=1000 + seq) for seq in range(4)]
    for seq in range(4):
        put(store, make_group(0, "b", seq, task_index=10 + seq), stamp_ms=2000 + seq)
    ing = make_ingestor(store, max_groups_per_prompt=1)
    batch = ing.select(0, 4)
    assert sorted(g.worker_id for g in batch) == ["a", "a", "b", "b"]
    assert {g.key for g in batch if g.worker_id == "a"} == set(a_keys[:2])  # each worker's oldest first


def test_groups_from_int8_plane_workers_match_a_published_digest():
    import torch

    from pnyx.train.trainer_setup import published_digests
    from pnyx.weights import Publisher, Syncer

    store = open_store("memory://")
    pub = Publisher(store, anchor_every=20, int8_plane=True)
    pub.publish(0, {"w": torch.randn(4, 64).to(torch.bfloat16)})
    digests = published_digests(store, 0)
    weights_syncer, int8_syncer = Syncer(store), Syncer(store, plane="int8")
    weights_syncer.sync()
    int8_syncer.sync()
    assert weights_syncer.digest != int8_syncer.digest
    assert digests == {weights_syncer.digest, int8_syncer.digest}
    assert published_digests(store, 1) is None


# --- cost follows the step, not the backlog -----------------------------------------------------------------


def counting(store):
    from pnyx_harness.faults import FaultyStore

    return FaultyStore(store)


def spy_lists(store) -> list[tuple[str, str | None, int]]:
    """Record (prefix, start_after, keys returned) of every listing."""
    seen: list[tuple[str, str | None, int]] = []
    real = store.list

    def spy(prefix="", start_after=None, limit=None):
        out = real(prefix, start_after, limit)
        seen.append((prefix, start_after, len(out)))
        return out

    store.list = spy
    return seen


def test_incremental_listing_returns_only_what_arrived_since_the_last_listing(store):
    old = layout.now_ms() - 3_600_000
    for seq in range(50):  # uploaded 10 s apart, an hour ago
        put(store, make_group(0, "w", seq, task_index=seq % 20), stamp_ms=old + 10_000 * seq)
    ing = make_ingestor(store)
    lists = spy_lists(store)
    assert ing.refresh(0) == 50
    put(store, make_group(0, "w", 50), stamp_ms=layout.now_ms())
    put(store, make_group(0, "w", 51), stamp_ms=layout.now_ms())
    ing.list_version(0)
    assert ing.list_version(0) == 0  # nothing new: nothing added twice
    # the old 50 are never listed again, except the last one, within the slack below the highest stamp
    assert [n for _, _, n in lists] == [50, 3, 2]


def test_a_key_that_lands_late_widens_the_incremental_listings_slack(store):
    """A worker stamps a key when it seals the group; its courier may upload it seconds later. Such a key,
    stamped further below the newest listed than the slack, is missed by incremental listings and found by
    the next full one, which widens the slack to cover it: the next key as late is found at once."""
    from pnyx.train.version_listing import STAMP_SLACK_MS

    now = layout.now_ms()
    put(store, make_group(0, "w", 0), stamp_ms=now)
    ing = make_ingestor(store)
    assert ing.refresh(0) == 1 and ing.listing.slack_ms == STAMP_SLACK_MS
    put(store, make_group(0, "v", 0, task_index=1), stamp_ms=now - 10_000)  # sealed 10 s ago, uploaded now
    assert ing.list_version(0) == 0  # starts 2 s below the newest stamp: missed
    assert ing.list_version(0, full=True) == 1
    assert ing.listing.slack_ms == 10_000 + STAMP_SLACK_MS
    put(store, make_group(0, "u", 0, task_index=2), stamp_ms=now - 9_000)
    assert ing.list_version(0) == 1  # as late: found by the next incremental listing


def test_a_step_downloads_only_the_groups_it_trains_on_whatever_the_backlog(tmp_path):
    store = counting(open_store(str(tmp_path / "run")))
    for seq in range(300):
        put(store, make_group(0, f"w{seq % 10}", seq, task_index=seq))
    ing = make_ingestor(store)
    for step in range(3):
        gets = store.calls["get"]
        batch = ing.select(0, 4)
        assert len(batch) == 4 and store.calls["get"] - gets == 4, step
        ing.commit([g.key for g in batch])
    assert ing.backlog(0)["waiting"] == 300 - 12


def test_stale_groups_are_counted_from_the_listing_without_being_downloaded(tmp_path):
    store = counting(open_store(str(tmp_path / "run")))
    for seq in range(40):
        put(store, make_group(0, "w", seq, task_index=seq))
    put(store, make_group(5, "w", 99))
    ing = make_ingestor(store, max_staleness=3)
    gets = store.calls["get"]
    ing.sweep(5)
    assert ing.cursor.drops == {"stale": 40}
    assert store.calls["get"] == gets  # counted from one listing of v0, no record read


def test_a_version_leaving_the_window_is_swept_only_after_the_grace_period(store):
    put(store, make_group(0, "w", 0))
    ing = make_ingestor(store, grace_s=3600.0, max_staleness=0)
    ing.refresh(0)
    ing.sweep(1)
    assert ing.cursor.drops == {} and ing.cursor.swept_below == 0  # a late upload to v0 may still come
    ing.listing.sweep_grace_s = 0.0
    ing.sweep(1)
    assert ing.cursor.drops == {"stale": 1} and ing.cursor.swept_below == 1


def test_a_key_that_lands_behind_the_incremental_listing_is_still_accounted_for(store):
    put(store, make_group(0, "w", 0), stamp_ms=layout.now_ms())
    ing = make_ingestor(store, max_staleness=0)
    ing.refresh(0)
    put(store, make_group(0, "late", 0), stamp_ms=layout.now_ms() - 600_000)  # its clock runs 10 min behind
    ing.list_version(0)
    assert ing.backlog(0)["waiting"] == 1  # not seen by the incremental listing...
    ing.sweep(1)
    assert ing.cursor.drops == {"stale": 2}  # ...but counted by the sweep, never lost


def test_the_newest_version_comes_first(store):
    put(store, make_group(0, "w", 0, task_index=0))
    fresh = put(store, make_group(2, "w", 1, task_index=1))
    ing = make_ingestor(store)
    assert [g.key for g in ing.select(2, 1)] == [fresh]


def test_a_share_of_the_batch_goes_first_to_groups_in_their_last_step_of_the_window(store):
    old = [put(store, make_group(2, "w", seq, task_index=seq)) for seq in range(3)]  # trainer v5: last chance
    fresh = [put(store, make_group(5, "w", seq, task_index=seq)) for seq in range(3, 9)]
    rescued = [g.key for g in make_ingestor(store).select(5, 4)]  # last_chance_share 0.5: 2 places of 4
    assert sorted(rescued) == sorted([*old[:2], *fresh[:2]])
    quarter = [g.key for g in make_ingestor(store, last_chance_share=0.25).select(5, 4)]  # 1 place of 4
    assert sorted(quarter) == sorted([old[0], *fresh[:3]])
    newest = [g.key for g in make_ingestor(store, last_chance_share=0.0).select(5, 4)]
    assert sorted(newest) == sorted(fresh[:4])


def test_the_backlog_counts_the_fetched_groups_the_hold_back_passes_over(store):
    """Under committed draws the planner passes over a group while a seq its name committed below it is
    unread (`Ticker.held`); the trainer's backlog says how many it holds, so a trainer waiting on them says
    why (`starving_note`)."""
    from pnyx.train.progress import starving_note

    for seq in range(4):
        put(store, make_group(0, "w", seq, task_index=seq))
    ing = make_ingestor(store)
    assert "held" not in ing.backlog(0)  # no hold-back (committed draws off): nothing counted
    ing.planner.held = lambda g: (0, 0) if g.group.seq >= 2 else None  # seqs 2 and 3 wait for a lower one
    chosen = ing.select(0, 4)
    assert sorted(g.group.seq for g in chosen) == [0, 1]
    assert ing.backlog(0)["held"] == 2 and ing.backlog(0)["fetched"] == 4
    d = {"phase": "waiting", "phase_s": 40.0, "have": 2, "need": 4, "backlog": ing.backlog(0)}
    note = starving_note(d)
    assert note is not None and "2 of them held back until a seq their worker committed below them" in note
    assert "standing_groups" not in note
    # standing (`Ticker.held` answers (-1, seq)): seq 3 is on probation for good, seq 2 waits on a lower seq
    ing.planner.held = lambda g: (
        (-1, g.group.seq) if g.group.seq == 3 else (0, 0) if g.group.seq == 2 else None
    )
    b = ing.backlog(0)
    assert b["held"] == 2 and b["probation"] == 1
    note = starving_note({**d, "backlog": b})
    assert note is not None and "1 of them held back until a seq" in note
    assert "1 of them a new worker's first groups under an untrusted key" in note
    assert "security.standing_groups" in note and "security.trusted_keys" in note


def test_groups_standing_held_are_counted_probation_at_the_sweep_not_stale(store):
    """Unconsumed groups of a version that leaves the window are `stale`, except a new name's first seqs
    that standing holds for good (`Listing.probation`, `Ticker.on_probation` in the trainer): `probation`,
    so a supply report does not read them as supply the trainer was too slow for."""
    for seq in range(4):
        put(store, make_group(0, "w", seq, task_index=seq))
    ing = make_ingestor(store, max_staleness=1)
    ing.listing.probation = lambda worker, seq: worker == "w" and seq < 3
    ing.refresh(0)
    ing.sweep(5)
    assert ing.cursor.swept_below > 0
    assert ing.cursor.drops == {"probation": 3, "stale": 1}


def test_per_prompt_cap_is_kept_when_only_the_top_is_fetched(store):
    for seq in range(3):
        put(store, make_group(0, "w", seq, task_index=0), stamp_ms=1000 + seq)
    put(store, make_group(0, "w", 3, task_index=1), stamp_ms=2000)
    ing = make_ingestor(store, max_groups_per_prompt=2)
    batch = ing.select(0, 3)
    assert sorted(g.task_id for g in batch) == ["arith/train/0/0", "arith/train/0/0", "arith/train/0/1"]


def test_selection_does_not_depend_on_what_was_prefetched(store):
    answer = str(ENV.sample("train", 0, 1)[0].answer)
    for seq in range(12):
        # every third group has zero variance: the selection must skip them the same way each time
        answers = [answer, answer] if seq % 3 == 0 else None
        put(store, make_group(0, f"w{seq % 3}", seq, task_index=seq, answers=answers), stamp_ms=1000 + seq)
    plain = make_ingestor(store)
    expected = [g.key for g in plain.select(0, 5)]
    warmed = make_ingestor(store)
    warmed.refresh(0)
    everything = [k for ks in warmed.listing.versions[0].pending.values() for k in ks]
    warmed.fetch(everything[::-1][:7])  # a prefetch of the bottom of the ranking
    assert [g.key for g in warmed.select(0, 5)] == expected


def test_a_second_key_for_the_same_group_is_a_duplicate_never_a_second_use(store):
    g = make_group(0, "w", 0)
    first = put(store, g, stamp_ms=1000)
    put(store, g, stamp_ms=5000)  # the same (worker, seq) re-uploaded under another stamp
    put(store, make_group(0, "w", 1, task_index=1), stamp_ms=6000)
    ing = make_ingestor(store)
    batch = ing.select(0, 10)
    assert [b.key for b in batch].count(first) == 1 and len(batch) == 2
    assert ing.cursor.drops == {"duplicate": 1}


def test_keys_of_the_first_layout_are_still_ingested(store):
    g = make_group(3, "old-worker", 7)
    legacy = "rollouts/v00000003/old-worker-0000000007"
    store.put(legacy, encode_group(g), mode="create")
    assert layout.parse_rollout_key(legacy) == (3, "old-worker", 7) and layout.rollout_stamp(legacy) is None
    ing = make_ingestor(store)
    assert [b.key for b in ing.select(3, 4)] == [legacy]


def test_cursor_and_memory_stay_bounded_over_thousands_of_groups_across_many_versions():
    store = open_store("memory://")
    settings = dict(max_staleness=3, max_groups_per_prompt=50)
    ing = make_ingestor(store, **settings)
    per_version, per_step, versions = 30, 4, 120
    answer = str(ENV.sample("train", 0, 1)[0].answer)
    seq = 0
    for v in range(versions):
        for i in range(per_version):  # 3,600 groups in all, a third with zero variance
            answers = [answer, answer] if i % 3 == 0 else None
            put(store, make_group(v, f"w{i % 6}", seq, task_index=0, answers=answers))
            seq += 1
        ing.sweep(v)  # the prefetcher's job in the trainer
        batch = ing.select(v, per_step)
        ing.commit([g.key for g in batch])
    held = len(ing.cursor.uses) + len(ing.cursor.rejected)
    window = settings["max_staleness"] + 1
    # Bound: the window's versions (+1 not yet swept) times what one step uses and rejects (<= 3x its size).
    assert held <= (window + 1) * 3 * per_step, held
    assert len(ing.cursor.to_json()) < 12_000
    assert len(ing.listing.versions) <= window + 1
    assert ing.cursor.drops["stale"] > 2_000  # the unused ones were counted, then forgotten
    assert ing.cursor.consumed == per_step * versions


def test_reward_parts_and_zero_variance_share_are_reported(store):
    answer = str(ENV.sample("train", 0, 1)[0].answer)
    for seq in range(20):
        put(store, make_group(0, "w", seq, task_index=0, answers=["-1", "-2"] if seq < 18 else None))
    ing = make_ingestor(store, max_groups_per_prompt=20)
    (g, *_) = ing.select(0, 2)
    assert set(g.parts[0]) == {"correct", "format"}
    zv = ing.zero_variance()
    assert zv["frac"] == 18 / 20 and zv["kind"] == "hard"
    from pnyx.train.progress import zero_variance_note

    note = zero_variance_note(zv["frac"], zv["kind"])
    assert "90% of groups had the same reward" in note and "too hard" in note
    assert zero_variance_note(0.3, "hard") is None
    assert answer  # the task exists


def test_the_two_newest_versions_share_one_listing_on_a_store_that_lists_in_order():
    store = open_store("memory://")
    assert store.sorted_listing
    for v in (4, 5):
        put(store, make_group(v, "w", v, task_index=v))
    ing = make_ingestor(store)
    ing.refresh(5)  # first contact: each version from its start
    put(store, make_group(4, "w", 14, task_index=1))
    put(store, make_group(5, "w", 15, task_index=2))
    lists = spy_lists(store)
    assert ing.refresh(5, depth=2) == 2
    assert [prefix for prefix, _, _ in lists] == [layout.ROLLOUTS_PREFIX]  # one listing across v4 and v5
    assert ing.backlog(5)["waiting"] == 4
