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
import sys
import time
from pathlib import Path

import pytest
from swarm_support import SITECUSTOMIZE

from pnyx.protocol import layout
from pnyx.protocol.codec import decode_json
from pnyx.store import open_store
from pnyx.swarm.records import NodeHeartbeat

REPO = Path(__file__).resolve().parents[1]
NODES = ("n0", "n1", "n2")
ROUNDS = 4


def make_swarm_env(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """(model dir, environment for the node processes)."""
    from pnyx.models.testing import make_tiny_model_dir

    root = tmp_path_factory.mktemp("swarm-proc")
    model = make_tiny_model_dir(root / "model", vocab=400, seed=3)
    hook = root / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(hook), str(REPO), env.get("PYTHONPATH", "")])
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return model, env


@pytest.fixture(scope="module")
def swarm_env(tmp_path_factory):
    return make_swarm_env(tmp_path_factory)


def node_cmd(url: str, name: str, model: Path, rounds: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "pnyx", "swarm", "--store", url, "--node", name,
        f"--run.steps={rounds}", f"--model.path={model}", "--env.name=swarm_len", '--env.kwargs={"digits": 1}',
        "--worker.group_size=4", "--worker.max_new_tokens=10",
        "--swarm.local_groups=2", "--swarm.external_groups=2", *extra,
    ]  # fmt: skip


def _run_swarm(url: str, model: Path, env: dict[str, str]) -> dict[str, str]:
    """Run the three nodes to the end; returns each node's output (for failure messages)."""
    # Every node waits (under a deadline) until the other two are live, so all of them overlap in time
    # however slowly each process starts on a loaded machine.
    wait = [f"--swarm.wait_peers={len(NODES) - 1}", "--swarm.peer_timeout_s=120"]
    procs = [
        subprocess.Popen(
            node_cmd(url, name, model, ROUNDS, *wait),
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for name in NODES
    ]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=300)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for name, p, out in zip(NODES, procs, outputs, strict=True):
        assert p.returncode == 0, f"node {name} exited {p.returncode}:\n{out[-4000:]}"
    return dict(zip(NODES, outputs, strict=True))


def _check(url: str, outputs: dict[str, str]) -> None:
    store = open_store(url)
    for name in NODES:
        hb = decode_json(store.get(layout.swarm_heartbeat(name)), NodeHeartbeat)
        out = outputs[name][-3000:]
        assert hb.status == "stopped" and hb.rounds == ROUNDS
        assert hb.version >= 1, f"node {name} never took a step"
        assert len(store.list(layout.swarm_dir(name))) == 2 * ROUNDS  # every local group was shared
        assert hb.external_trained >= 1, f"node {name} never trained on a peer's group:\n{out}"
        assert hb.peers_seen == len(NODES) - 1


@pytest.mark.slow
def test_three_process_swarm_on_local_folder(swarm_env, tmp_path):
    model, env = swarm_env
    url = str(tmp_path / "swarm")
    _check(url, _run_swarm(url, model, env))


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
