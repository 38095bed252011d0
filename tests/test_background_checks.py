"""The trainer's background check of skip records' draws (`pnyx.train.wait_work.WaitWork.start`): records are
checked as soon as they are re-scored, with no step running, and a batch is never taken while a record the
thread has taken from the queue still waits for its verdict."""

from __future__ import annotations

import threading
import time

from pnyx.protocol import layout
from pnyx_harness import attacks as A
from pnyx_harness.arena import Arena
from pnyx_harness.producer import HonestWorker


def _forge(arena: Arena, picker: A.CherryPicker) -> list[str]:
    """Upload the picker's groups until one is hidden behind a forged skip record (its first records are
    checked whole); returns the keys of the groups it kept."""
    forged = 0
    while not forged:
        before = picker.true_skips
        ups = picker.uploads(arena, 1)
        forged += sum(layout.is_skip_key(u.key) for u in ups) - (picker.true_skips - before)
        arena.upload(ups)
    return [u.key for u in arena.uploads if u.source == picker.source and not layout.is_skip_key(u.key)]


def _report(arena: Arena, producer: A.CherryPicker | HonestWorker) -> dict:
    return arena.trainer.parts.ingestor.key_report()[producer.signer.fingerprint]


def test_a_forged_skip_record_is_caught_by_the_background_thread_with_no_step_running(tmp_path):
    """With the background check on (the default), a forged skip record is checked once ingestion has
    re-scored it, while no step runs: its key is quarantined at v0, and the next batch takes none of the
    forger's groups."""
    arena = Arena(tmp_path, {"trainer": {"groups_per_step": 8}, "security": {"committed_draws": False}})
    honest = [HonestWorker("honest-b1"), HonestWorker("honest-b2")]
    picker = A.CherryPicker("picker-b", source="cherry_bg", form="whole_forged")
    waiting = arena.trainer.waiting
    waiting.start(lambda: arena.trainer.version)
    try:
        kept = _forge(arena, picker)
        arena.poll()  # lists, fetches and re-scores: the skip records are queued for the check of their draws
        deadline = time.monotonic() + 10.0
        while waiting.background["false"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert waiting.background["false"] >= 1, waiting.background
        assert arena.trainer.version == 0
        assert "false skip" in (_report(arena, picker)["quarantined"] or "")
        arena.upload([u for h in honest for u in h.uploads(arena, 4)])
        result = arena.step()
        assert result is not None and not {g.key for g in result.groups} & set(kept)
        assert {arena.verdict(k) for k in kept} == {"quarantined"}
        assert _report(arena, honest[0])["quarantined"] is None
    finally:
        waiting.close()
        arena.close()


def test_a_batch_waits_for_the_background_threads_record_under_way(tmp_path):
    """The thread has taken the forged record from the queue and its forward is slow (held here for 1.5 s):
    `ready`, which lets a full batch be taken, waits for that verdict (on the step's path, counted as `s`)
    instead of finding the queue empty, so the forger is out before the batch."""
    arena = Arena(tmp_path, {"trainer": {"groups_per_step": 8}, "security": {"committed_draws": False}})
    picker = A.CherryPicker("picker-c", source="cherry_slow", form="whole_forged")
    waiting = arena.trainer.waiting
    rejudge = arena.trainer.parts.rejudge
    assert rejudge is not None
    measure = rejudge.draws
    taken = threading.Event()

    def slow(rows, background=False):
        if background:
            taken.set()
            time.sleep(1.5)
        return measure(rows, background=background)

    rejudge.draws = slow  # type: ignore[method-assign]
    try:
        _forge(arena, picker)
        arena.poll()
        waiting.start(lambda: arena.trainer.version)
        assert taken.wait(10.0)
        assert "false skip" not in (_report(arena, picker)["quarantined"] or "")  # not decided yet
        assert waiting.ready(0) is False  # a record was false: the ranking is read again
        assert "false skip" in (_report(arena, picker)["quarantined"] or "")
        assert (waiting.skip_audit or {}).get("s", 0.0) >= 0.5, waiting.skip_audit
    finally:
        waiting.close()
        arena.close()


def test_the_forecast_batchs_stale_rows_are_measured_on_the_background_thread_and_the_step_reads_them(
    tmp_path,
):
    """Groups drawn at v0 wait for the step from v2 (2 versions behind it, `BACKGROUND_STALENESS`): the
    background thread measures their rows under v0's weights from the prefetcher's forecast of the batch
    (`pre_rows` in `background`), and the step's exact re-check of every one of them (the forward flags
    some; `security.stale_draw_audit` at 1.0 audits the rest) reads that measurement: no exact forward of
    them on the step's path."""
    sec = {"committed_draws": False, "stale_draw_audit": 1.0}
    arena = Arena(tmp_path, {"trainer": {"groups_per_step": 8}, "security": sec})
    honest = [HonestWorker("honest-f1"), HonestWorker("honest-f2")]
    waiting = arena.trainer.waiting
    try:
        stale = [u for h in honest for u in h.uploads(arena, 2)]  # drawn at v0
        for _ in range(2):
            arena.upload([u for h in honest for u in h.uploads(arena, 4)])
            assert arena.step() is not None
        assert arena.trainer.version == 2
        arena.upload(stale + [u for h in honest for u in h.uploads(arena, 2)])
        arena.poll()
        ingestor = arena.trainer.parts.ingestor
        forecast = ingestor.plan(2, 8, extra=0).chosen
        old = [g for g in forecast if g.version == 0]
        stale_rows = sum(len(g.group.samples) for g in old)
        assert len(old) == 4, [g.version for g in forecast]
        waiting.start(lambda: arena.trainer.version, lambda: (2, forecast))
        deadline = time.monotonic() + 10.0
        while waiting.background["pre_rows"] < stale_rows and time.monotonic() < deadline:
            time.sleep(0.05)
        assert waiting.background["pre_groups"] == 4 and waiting.background["pre_rows"] == stale_rows
        waiting.close()  # nothing more in the background: what the step measures is on its path
        rejudge = arena.trainer.parts.rejudge
        assert rejudge is not None
        measured = rejudge.draw_rows
        result = arena.step()
        assert result is not None and {g.key for g in old} <= {g.key for g in result.groups}
        tally, pre = result.stats.draws, waiting.precheck
        assert tally is not None and pre is not None
        n2, flagged, _ = tally.by_staleness["2"]
        assert n2 == stale_rows and pre.get("known") == stale_rows, (tally.by_staleness, pre)
        skips = (waiting.skip_audit or {}).get("rows", 0)
        # on the path only skip records and rows 1 version behind (a leftover v1 group: measured ahead
        # only from 2 versions behind); none of the v0 groups' rows
        n1 = tally.by_staleness.get("1", [0])[0]
        assert rejudge.draw_rows - measured == skips + n1, (rejudge.draw_rows - measured, skips, n1)
    finally:
        waiting.close()
        arena.close()
