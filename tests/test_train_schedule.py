"""The learning-rate schedule: warm-up, then constant, linear or cosine decay to lr·min_lr_ratio."""

from __future__ import annotations

import math

import pytest

from pnyx.errors import ConfigError
from pnyx.train.schedule import Schedule


def test_warm_up_rises_linearly_to_the_peak():
    s = Schedule(1e-3, "constant", warmup_steps=4, total_steps=100)
    assert [s.at(v) for v in (1, 2, 3, 4, 5, 99)] == pytest.approx([2e-4, 4e-4, 6e-4, 8e-4, 1e-3, 1e-3])


def test_linear_and_cosine_decay_end_at_the_floor_and_stay_there():
    for kind in ("linear", "cosine"):
        s = Schedule(1e-3, kind, warmup_steps=2, total_steps=12, min_lr_ratio=0.1)
        rates = [s.at(v) for v in range(3, 13)]
        assert all(a > b for a, b in zip(rates, rates[1:], strict=False))
        assert s.at(12) == pytest.approx(1e-4) and s.at(40) == pytest.approx(1e-4)


def test_cosine_is_halfway_at_the_middle_of_the_decay():
    s = Schedule(1.0, "cosine", warmup_steps=0, total_steps=10, min_lr_ratio=0.0)
    assert s.at(5) == pytest.approx(0.5) and s.at(1) == pytest.approx((1 + math.cos(math.pi / 10)) / 2)


def test_a_bad_schedule_or_step_is_refused():
    with pytest.raises(ConfigError, match="min_lr_ratio"):
        Schedule(1e-3, "cosine", min_lr_ratio=2.0)
    with pytest.raises(ValueError, match="count from 1"):
        Schedule(1e-3).at(0)
