"""The chaos suite: a trainer and two workers (real processes) through a fault-injecting proxy in front of the
loopback S3 server, a worker and then the trainer SIGKILLed and restarted, to the step budget. Nothing may be
lost or duplicated, the weight chain must verify, and the reward must rise.

The proxy injects what the issue measured on a real bucket's bad day: 5% 503 SlowDown, 2% connection resets
before forwarding, 2% replies lost after the write landed, 0-50 ms latency on every request.

Accounting, from the store alone:
- trainer side: every uploaded group is consumed (in exactly one batch record), dropped with a reason (the
  trainer's drop counters in its final checkpoint), still in the window at the end (unconsumed, not
  rejected), or in a version that left the window but that the trainer's lazy sweep has not reached yet
  (counted `stale` when it does): uploaded = consumed + dropped + waiting + unswept, nothing left over;
- worker side: every seq a worker ever gave a group is in the store (as a group, as the skip record of a
  zero-variance one, or uploaded late after the trainer had moved past its window) or still in its spool
  folder: no gap, so nothing was lost, and no two objects hold the same bytes, so nothing was uploaded
  twice; the trainer, which settles every worker's seqs at its sweep, counted no gap and no false skip.

One run holds both kills (a worker's, then the trainer's): run it with `pytest -m slow tests/test_chaos.py`
(about 2-3 minutes on 2 cores). It runs twice: as by default, under committed draws
(`security.committed_draws`), where the killed worker's last committed cohorts, if it had not drawn them, are
excused by the tick that refuses its next life's first commitment (`pnyx.train.ticker`): those seqs are
the only ones the store and spool may lack, and they count `lost`, never `gap`; and without them.
"""

from __future__ import annotations

import hashlib
import signal
import sys
from pathlib import Path

import pytest
from conftest import make_bucket
from worker_support import start, wait_for, worker_command

from pnyx.protocol import decode_group, layout
from pnyx.store import open_store
from pnyx_harness.proxy import FaultProxy, Faults

pytestmark = [pytest.mark.s3, pytest.mark.slow]

STEPS = 30
STALENESS = 3
STARTUP_S = 240
RUN_S = 600
WORKERS = ("chaos-a", "chaos-b")
CHAOS = Faults(error_rate=0.05, reset_rate=0.02, lost_reply_rate=0.02, latency_s=(0.0, 0.05))
SETTINGS = [
    f"--run.steps={STEPS}",
    f"--algorithm.max_staleness={STALENESS}",
    "--trainer.max_wait_s=300",
    "--worker.heartbeat_interval_s=1",
    "--trainer.checkpoint_every=5",  # fewer 13 MB writes through the proxy; a resume replays up to 4 steps
]


class Fleet:
    """The processes of one chaos run and their logs (every life of every process has its own log)."""

    def __init__(self, url: str, tmp: Path, extra: tuple[str, ...] = ()):
        self.url, self.tmp, self.extra = url, tmp, extra
        self.spool = tmp / "spool"
        self.lives: dict[str, int] = {}
        self.procs: dict[str, object] = {}

    def _log(self, name: str) -> Path:
        self.lives[name] = self.lives.get(name, 0) + 1
        return self.tmp / f"{name}-{self.lives[name]}.log"

    def trainer(self, *extra: str):
        cmd = [sys.executable, "-m", "pnyx", "trainer", "--store", self.url, *SETTINGS, *self.extra, *extra]
        self.procs["trainer"] = start(cmd, self._log("trainer"))
        return self.procs["trainer"]

    def worker(self, name: str):
        cmd = worker_command(self.url, name, "--spool-dir", str(self.spool), "--threads", "1")
        self.procs[name] = start(cmd, self._log(name))
        return self.procs[name]

    def logs(self, name: str) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.tmp.glob(f"{name}-*.log")))

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(30)


@pytest.fixture(params=[True, False], ids=["default", "uncommitted"])
def chaos(request, s3_endpoint, tmp_path):
    """(direct store for the checks, the fleet talking through the proxy, the proxy); the trainer's run
    with committed draws (the default) or without them (`uncommitted`; the workers follow the run's config)."""
    bucket = make_bucket(s3_endpoint)
    extra = () if request.param else ("--security.committed_draws=false",)
    with FaultProxy(s3_endpoint, CHAOS, seed=1) as proxy:
        fleet = Fleet(f"s3://{bucket}/run?endpoint={proxy.url}&region=us-east-1", tmp_path, extra)
        try:
            yield open_store(f"s3://{bucket}/run?endpoint={s3_endpoint}&region=us-east-1"), fleet, proxy
        finally:
            fleet.kill_all()


def _version(store) -> int:
    from pnyx.weights.manifest import latest_version

    v = latest_version(store)
    return -1 if v is None else v


def _finish(store, fleet: Fleet, trainer) -> None:
    """Wait for the trainer's step budget, then stop the workers cleanly (SIGTERM)."""
    code = trainer.wait(RUN_S)
    assert code == 0, fleet.logs("trainer")[-4000:]
    assert _version(store) == STEPS
    for name in WORKERS:
        fleet.procs[name].send_signal(signal.SIGTERM)
    for name in WORKERS:
        assert fleet.procs[name].wait(60) == 0, fleet.logs(name)[-3000:]


def _account(store, fleet: Fleet, proxy) -> dict[str, int]:
    from pnyx.train import checkpointer
    from pnyx.train.checkpoint import read_batch_record, read_metrics
    from pnyx.train.ingest_state import Cursor
    from pnyx.weights.chain import verify_chain

    # the faults really happened, of every kind
    assert all(proxy.counts[f"fault:{k}"] > 0 for k in ("error", "reset", "lost_reply")), dict(proxy.counts)

    # trainer side: uploaded = consumed + dropped (by reason) + still waiting in the window
    stored = {m.key for m in store.list(layout.ROLLOUTS_PREFIX)}
    uploaded = {k for k in stored if not layout.is_skip_key(k)}  # skip records are never trained on
    consumed = [k for v in range(1, STEPS + 1) for k in read_batch_record(store, v).keys]
    assert len(consumed) == len(set(consumed)), "a group was consumed twice"
    assert set(consumed) <= uploaded
    cursor = Cursor.from_json(checkpointer.read_commit(store, STEPS).cursor.encode())
    # the last metrics line and the checkpoint's cursor are taken moments apart: the prefetcher's sweep may
    # count a group of a version that just left the window `stale` (or, a new name's first seqs under
    # standing, `probation`) in between, nothing else
    last = read_metrics(store)[-1]["drops"]
    swept = ("stale", "probation")
    assert {k: v for k, v in cursor.drops.items() if k not in swept} == {
        k: v for k, v in last.items() if k not in swept
    }
    assert all(last.get(k, 0) <= cursor.drops.get(k, 0) for k in swept)
    # a group the step's checks removed from the update (`implausible`, `logprob_gap`) is consumed (in its
    # batch record) and dropped (in `drops`, by reason): count it once
    in_steps = sum(sum(m.get("rejected", {}).values()) for m in read_metrics(store))
    dropped = sum(cursor.drops.values()) - in_steps
    window = range(STEPS - STALENESS, STEPS + 1)
    unused = {k for k in uploaded - set(consumed) if k not in cursor.rejected}
    waiting = {k for k in unused if layout.parse_rollout_key(k)[0] in window}
    # versions that left the window but are not swept yet (the sweep batches its listings: see
    # pnyx/train/listing.py); their unused groups are counted `stale` when it reaches them
    unswept = {k for k in unused if cursor.swept_below <= layout.parse_rollout_key(k)[0] < window.start}
    unaccounted = len(uploaded) - len(consumed) - dropped - len(waiting) - len(unswept)
    assert unaccounted == 0, (
        f"{unaccounted} uploaded group(s) neither consumed, dropped, waiting nor awaiting the sweep: "
        f"uploaded={len(uploaded)} consumed={len(consumed)} dropped={cursor.drops} waiting={len(waiting)} "
        f"unswept={len(unswept)} (versions >= {cursor.swept_below})"
    )

    excused = _excused(store)  # none without committed draws (no ticks)
    # worker side: every seq is in the store, expired or skipped (logged) or still spooled, or excused (a
    # killed life's undrawn committed cohort); no bytes twice
    digests = set()
    for key in stored:
        data = store.get(key)
        decode_group(data)  # whole and valid
        digests.add(hashlib.sha256(data).hexdigest())
    assert len(digests) == len(stored), "the same group was uploaded under two keys"
    for name in WORKERS:
        logs = fleet.logs(name)
        assert "key collision" not in logs
        mine = {layout.parse_rollout_key(k)[2] for k in stored if layout.parse_rollout_key(k)[1] == name}
        spooled = {
            int(p.name.split("~")[-1].split("-")[-1].split(".")[0]) for p in fleet.spool.glob(f"*/{name}/*.grp")
        }  # fmt: skip
        seen = mine | spooled | excused.get(name, set())
        # (a killed life's reserved, never spooled seqs are reused by the next life, which resumes after the
        # highest seq it finds in the store and its spool)
        assert mine and seen == set(range(max(seen) + 1)), (
            f"{name}: seqs missing: {sorted(set(range(max(seen) + 1)) - seen)}"
        )
    assert cursor.gaps == 0 and not cursor.skips.get("false"), (cursor.gaps, cursor.skips)

    # the weight chain verifies end to end, and the policy learned
    assert verify_chain(store, "weights").ok
    rewards = [m["reward"] for m in read_metrics(store)]
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    assert last > first + 0.02, f"reward did not rise: {first:.3f} -> {last:.3f}"
    return {
        "uploaded": len(uploaded), "consumed": len(consumed), "dropped": dropped, "waiting": len(waiting),
        "unswept": len(unswept),
    }  # fmt: skip


def _excused(store) -> dict[str, set[int]]:
    """Per worker name, the seqs the trainer's ticks excused (a restarted worker's undrawn cohort)."""
    import json

    from pnyx.protocol.commits import decode_tick

    run = json.loads(store.get(layout.RUN_MANIFEST))
    out: dict[str, set[int]] = {}
    for meta in store.list(layout.TICKS_PREFIX):
        if layout.parse_tick_key(meta.key) is None:
            continue
        tick = decode_tick(store.get(meta.key), run["run_id"], run["trainer_key"]["fingerprint"])
        for x in tick.lost:
            out.setdefault(x.worker_id, set()).update(range(x.first_seq, x.last_seq + 1))
    return out


def test_chaos_worker_then_trainer_sigkilled_and_restarted_lose_and_duplicate_nothing(chaos):
    """One run, both kills: a worker at v8 (restarted with the same id and spool), the trainer at v16
    (resumed). Each kill lands wherever the process is: generating, mid-put, mid-retry, mid-step,
    mid-publish or mid-checkpoint."""
    store, fleet, proxy = chaos
    trainer = fleet.trainer()
    wait_for(lambda: _version(store) >= 0, STARTUP_S, "the trainer's v0")
    for name in WORKERS:
        fleet.worker(name)
    wait_for(lambda: _version(store) >= 8, RUN_S, "v8")
    fleet.procs["chaos-a"].send_signal(signal.SIGKILL)
    fleet.procs["chaos-a"].wait(30)
    fleet.worker("chaos-a")  # same id, same spool folder: it uploads what the killed life left
    wait_for(lambda: _version(store) >= 16, RUN_S, "v16")
    trainer.send_signal(signal.SIGKILL)
    trainer.wait(30)
    trainer = fleet.trainer("--resume")
    _finish(store, fleet, trainer)
    assert "resumed at v" in fleet.logs("trainer")
    assert fleet.lives == {"trainer": 2, "chaos-a": 2, "chaos-b": 1}
    _account(store, fleet, proxy)
