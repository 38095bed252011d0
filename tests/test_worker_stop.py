"""Real `pnyx worker` processes stop promptly whatever the store does, and lose nothing they spooled.

The worker talks to the loopback S3 server through the fault proxy, so "the store is down" is what a
worker would really see: every connection reset, its puts retrying under their deadline.
"""

from __future__ import annotations

import signal
import time

import pytest
from conftest import make_bucket
from worker_support import make_run, start, wait_for, worker_command

from pnyx.protocol import RunManifest, decode_json, layout
from pnyx_harness.proxy import FaultProxy, Faults

pytestmark = [pytest.mark.s3, pytest.mark.slow]

STARTUP_S = 180  # importing torch + transformers in a fresh process is slow on a shared 2-core box


def _keys(store) -> set[str]:
    return {m.key for m in store.list(layout.ROLLOUTS_PREFIX)}


def _spooled(folder) -> set[str]:
    return {p.name[: -len(".grp")].replace("__", "/") for p in folder.glob("*.grp")}


@pytest.fixture
def proxied_run(s3_endpoint, tiny_model_dir, tmp_path):
    """(run written directly to S3, the same run's URL through the fault proxy, the proxy)."""
    bucket = make_bucket(s3_endpoint)
    with FaultProxy(s3_endpoint, seed=0) as proxy:
        run = make_run(
            f"s3://{bucket}/run?endpoint={s3_endpoint}&region=us-east-1", tiny_model_dir, supply_control=False
        )
        yield run, f"s3://{bucket}/run?endpoint={proxy.url}&region=us-east-1", proxy


def test_worker_sigtermed_while_the_store_is_down_exits_fast_and_its_next_start_uploads_the_spool(
    proxied_run, tmp_path
):
    run, url, proxy = proxied_run
    run_id = decode_json(run.store.get(layout.RUN_MANIFEST), RunManifest).run_id
    folder = tmp_path / "spool" / run_id / "w1"
    cmd = worker_command(url, "w1", "--spool-dir", str(tmp_path / "spool"))
    first = start(cmd, tmp_path / "life1.log")
    try:
        wait_for(lambda: len(_keys(run.store)) >= 2, STARTUP_S, "the first uploads")
        proxy.faults = Faults(down=True)
        wait_for(lambda: len(_spooled(folder)) >= 3, 120, "groups spooled while the store is down")
        time.sleep(1.0)  # the courier is now inside a failing put's retries
        t0 = time.monotonic()
        first.send_signal(signal.SIGTERM)
        code = first.wait(60)
        took = time.monotonic() - t0
    finally:
        if first.poll() is None:
            first.kill()
    log = (tmp_path / "life1.log").read_text(errors="replace")
    assert code == 0, log[-3000:]
    assert took < 10, f"SIGTERM took {took:.1f}s with the store down"
    left = _spooled(folder)
    assert left and not left & _keys(run.store)  # on disk, not in the store

    proxy.faults = Faults()
    second = start(cmd, tmp_path / "life2.log")
    try:
        wait_for(lambda: left <= _keys(run.store), STARTUP_S, "the next start to upload the spool")
        second.send_signal(signal.SIGTERM)
        assert second.wait(60) == 0
    finally:
        if second.poll() is None:
            second.kill()
    assert "key collision" not in (tmp_path / "life2.log").read_text(errors="replace")
    seqs = [layout.parse_rollout_key(k)[2] for k in _keys(run.store)]
    assert sorted(seqs) == list(range(len(seqs)))  # every seq once: nothing lost, nothing duplicated


def test_a_second_sigint_exits_at_once_while_the_store_hangs(proxied_run, tmp_path):
    run, url, proxy = proxied_run
    proc = start(worker_command(url, "w1", "--spool-dir", str(tmp_path / "spool")), tmp_path / "worker.log")
    try:
        wait_for(lambda: len(_keys(run.store)) >= 2, STARTUP_S, "the first uploads")
        proxy.faults = Faults(latency_s=(120.0, 120.0))  # every request now hangs for two minutes
        time.sleep(1.5)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 130, (tmp_path / "worker.log").read_text(errors="replace")[-3000:]
    assert took < 3, f"the second SIGINT took {took:.1f}s"
