"""Real `pnyx swarm` processes on a local folder: a 3-node swarm trains on each other's groups, and a node
killed with SIGKILL resumes from its checkpoint.

(The same swarm on the S3 server is `test_swarm_process_s3.py`; helpers are shared from here.)

The nodes run a tiny random Qwen2 model. A random model never solves arithmetic, so the processes get the
`swarm_len` test environment (`swarm_support.SITECUSTOMIZE`) through a `sitecustomize.py` on their
PYTHONPATH; everything else is the shipped command line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from swarm_support import REPO, check_swarm, make_swarm_env, node_cmd, run_swarm

from pnyx.protocol import layout
from pnyx.protocol.codec import decode_json
from pnyx.store import open_store
from pnyx.swarm.records import NodeHeartbeat


@pytest.fixture(scope="module")
def swarm_env(tmp_path_factory):
    return make_swarm_env(tmp_path_factory)


@pytest.mark.slow
def test_three_process_swarm_on_local_folder(swarm_env, tmp_path):
    model, env = swarm_env
    url = str(tmp_path / "swarm")
    check_swarm(url, run_swarm(url, model, env))


def _heartbeat(store, name: str) -> NodeHeartbeat | None:
    try:
        return decode_json(store.get(layout.swarm_heartbeat(name)), NodeHeartbeat)
    except FileNotFoundError:
        return None


@pytest.mark.slow
def test_killed_node_resumes_from_its_checkpoint(swarm_env, tmp_path):
    from pnyx.swarm.checkpoint import load_node_checkpoint

    model, env = swarm_env
    url = str(tmp_path / "swarm")
    store = open_store(url)
    total = 400  # far more than it can run before the kill
    cmd = node_cmd(url, "solo", model, total, "--swarm.external_groups=0", "--swarm.checkpoint_every=2")
    first = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 180
        delay = 0.2
        while True:  # until a checkpoint beyond round 2 exists
            hb = _heartbeat(store, "solo")
            if hb is not None and hb.checkpoint_round >= 4:
                break
            assert first.poll() is None, f"node exited early:\n{first.stdout.read()[-3000:]}"
            assert time.monotonic() < deadline, "no checkpoint within 180 s"
            time.sleep(delay)
            delay = min(2.0, delay * 1.5)
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == -signal.SIGKILL
    ckpt = load_node_checkpoint(store, "solo")["state"].counters
    assert _heartbeat(store, "solo").status == "running"  # it never stopped cleanly
    uploaded = len(store.list(layout.swarm_dir("solo")))
    assert ckpt["rounds"] >= 4 and ckpt["version"] >= 1

    end = ckpt["rounds"] + 3
    again = subprocess.run(
        node_cmd(url, "solo", model, end, "--swarm.external_groups=0", "--swarm.checkpoint_every=2"),
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    log = again.stdout + again.stderr
    assert again.returncode == 0, log[-4000:]
    assert f"resumed from its checkpoint at round {ckpt['rounds']} (v={ckpt['version']})" in log
    assert log.count(" round=") == 3  # only the rounds after the checkpoint were run again
    hb = _heartbeat(store, "solo")
    assert hb.status == "stopped" and hb.rounds == end and hb.resumed_from == ckpt["rounds"]
    assert hb.version >= ckpt["version"]
    # Its sequence continued right after everything the killed process had uploaded: no key reused or skipped.
    assert hb.next_seq == uploaded + 2 * 3 == len(store.list(layout.swarm_dir("solo")))
