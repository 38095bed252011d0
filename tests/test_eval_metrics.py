"""Pure metrics: pass@k against brute-force enumeration, cover-EM, search rate, mean of parts."""

from __future__ import annotations

import itertools
import math

import pytest

from pnyx.envs import Score
from pnyx.eval.metrics import cover_em, mean_parts, pass_at_k, pass_at_k_groups, search_rate


def _brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """The fraction of k-subsets of n samples (c correct) that contain at least one correct sample."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_brute_force_enumeration_on_small_cases():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert math.isclose(pass_at_k(n, c, k), _brute_force_pass_at_k(n, c, k), abs_tol=1e-12), (
                    n,
                    c,
                    k,
                )


def test_pass_at_1_is_the_fraction_correct():
    assert math.isclose(pass_at_k(10, 3, 1), 0.3)


def test_pass_at_k_is_stable_for_large_n():
    value = pass_at_k(10_000, 1, 100)
    assert math.isclose(value, 100 / 10_000, rel_tol=1e-9)


def test_pass_at_k_rejects_impossible_counts():
    for n, c, k in [(0, 0, 1), (4, 5, 1), (4, 1, 5), (4, 1, 0), (4, -1, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_pass_at_k_groups_averages_over_problems():
    groups = [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [True, True, False, True]]
    expected = (pass_at_k(4, 1, 2) + 0.0 + pass_at_k(4, 3, 2)) / 3
    assert math.isclose(pass_at_k_groups(groups, 2), expected)


def test_cover_em_normalizes_and_matches_whole_words():
    assert cover_em("The city of Tamsk!", "tamsk")
    assert cover_em("It was in  TAMSK", ["Orvik", "Tamsk"])
    assert not cover_em("Tamskville", "Tamsk")
    assert not cover_em("", "Tamsk")
    assert not cover_em("anything", ["", "  "])


def test_search_rate_is_the_fraction_of_episodes_that_searched():
    assert search_rate([0, 1, 3, 0]) == 0.5
    assert search_rate([]) == 0.0


def test_mean_parts_averages_reward_and_each_part():
    scores = [Score(1.0, {"correct": 1.0, "searched": 1.0}), Score(0.0, {"correct": 0.0, "searched": 1.0})]
    assert mean_parts(scores) == {"reward": 0.5, "correct": 0.5, "searched": 1.0, "n": 2}
