"""The one pause sequence every wait and retry loop uses (pnyx/store/retry.py): growth, cap, reset, jitter,
and `wait_for`'s deadline and stop."""

from __future__ import annotations

import threading
import time

import pytest

from pnyx.errors import ConfigError
from pnyx.store.retry import POLL_BASE_S, Backoff, wait_for


def test_pauses_grow_by_the_factor_up_to_the_cap_and_reset_starts_over():
    b = Backoff(0.5, 3.0)
    assert [b.next() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    b.reset()
    assert b.next() == 0.5
    polling = Backoff.polling(cap_s=1.0)
    assert [round(polling.next(), 3) for _ in range(5)] == [POLL_BASE_S, 0.3, 0.45, 0.675, 1.0]


def test_a_zero_base_never_pauses_and_bad_settings_are_refused():
    b = Backoff(0.0, 30.0)
    assert [b.next() for _ in range(3)] == [0.0, 0.0, 0.0]
    with pytest.raises(ConfigError):
        Backoff(0.1, 1.0, factor=0.5)
    with pytest.raises(ConfigError):
        Backoff(-1.0, 1.0)


def test_jitter_draws_from_the_upper_half_of_each_pause():
    draws = iter([0.0, 1.0, 0.5])
    b = Backoff(1.0, 8.0, jitter=True, rand=lambda: next(draws))
    assert [b.next() for _ in range(3)] == [0.5, 2.0, 3.0]


def test_wait_for_returns_the_first_answer_or_none_at_the_deadline():
    calls = []

    def third_time():
        calls.append(time.monotonic())
        return "there" if len(calls) == 3 else None

    assert wait_for(third_time, 5.0, Backoff(0.01, 0.01)) == "there" and len(calls) == 3
    t0 = time.monotonic()
    assert wait_for(lambda: None, 0.3, Backoff(0.05, 0.05)) is None
    assert 0.3 <= time.monotonic() - t0 < 5.0  # it waits the whole deadline (the upper bound: liveness only)


def test_wait_for_stops_at_once_on_its_stop_event():
    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()
    t0 = time.monotonic()
    with pytest.raises(InterruptedError, match="run.json"):
        wait_for(lambda: None, 60.0, Backoff(5.0, 5.0), stop, what="run.json")
    assert time.monotonic() - t0 < 5.0  # not the 60 s deadline nor the 5 s pause
