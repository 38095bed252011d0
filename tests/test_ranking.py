"""The ranking of a step's candidates (`pnyx.train.ranking.ranked`): newest first, workers taking turns, and
the groups in their last step of the window offered first up to `rescue` (the last-chance share)."""

from __future__ import annotations

import time

from pnyx.protocol import layout
from pnyx.train.ranking import ranked
from pnyx.train.version_listing import VersionListing


def window(per_version: dict[int, dict[str, int]]) -> dict[int, VersionListing]:
    """Listed versions holding `n` waiting keys per worker."""
    out = {}
    for v, workers in per_version.items():
        lst = VersionListing(v, listed_at=time.monotonic())
        for w, n in workers.items():
            for seq in range(n):
                lst.add_pending(layout.rollout_key(v, w, seq, stamp_ms=1_000 + seq), w)
        out[v] = lst
    return out


def versions_of(keys) -> list[int]:
    return [layout.parse_rollout_key(k)[0] for k in keys]


def test_newest_first_and_workers_take_turns_without_rescue():
    w = window({5: {"a": 2, "b": 1}, 4: {"a": 1}, 3: {"a": 3}})
    got = list(ranked(w, {}, 5, 3, 1, frozenset()))
    assert versions_of(got) == [5, 5, 5, 4, 3, 3, 3]
    assert [layout.parse_rollout_key(k)[1] for k in got[:3]] == ["a", "b", "a"]  # turns: a, b, then a again


def test_last_chance_groups_come_first_up_to_rescue_and_are_not_yielded_twice():
    w = window({5: {"a": 2}, 4: {"a": 1}, 3: {"a": 1}, 2: {"a": 3, "b": 1}})
    got = list(ranked(w, {}, 5, 2, 1, frozenset(), rescue=2))
    assert versions_of(got[:2]) == [2, 2]  # version 2 leaves the window after this step: 2 of its 4 first
    assert versions_of(got[2:]) == [5, 5, 4, 3, 2, 2]  # then newest first; the rescued ones are not repeated
    assert len(set(got)) == len(got) == 8


def test_rescue_takes_only_fresh_groups_and_nothing_when_the_window_is_one_version():
    w = window({5: {"a": 1}, 4: {"a": 2}})
    used = {k: 1 for k in w[4].pending["a"][:1]}  # one of version 4's groups was trained on already
    got = list(ranked(w, used, 5, 4, 2, frozenset(), rescue=4))
    assert versions_of(got[:1]) == [4] and got[0] not in used  # only the unused one is rescued
    assert versions_of(got) == [4, 5, 4]  # then the replay level: the used group last
    assert versions_of(list(ranked(window({5: {"a": 2}}), {}, 5, 5, 1, frozenset(), rescue=4))) == [5, 5]


def test_an_unlisted_last_version_is_asked_for_before_anything_is_rescued():
    w = window({5: {"a": 1}})
    w[3] = VersionListing(3)  # never listed
    assert list(ranked(w, {}, 5, 3, 1, frozenset(), rescue=2)) == [3]
