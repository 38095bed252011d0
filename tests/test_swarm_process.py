"""A swarm of 3 real `pnyx swarm` processes on a local folder: every node's version advances.

(The same swarm on the S3 server is `test_swarm_process_s3.py`; helpers are shared from here.)

The nodes run a tiny random Qwen2 model. A random model never solves arithmetic, so the processes get a
test environment (`swarm_len`: reward = completion length mod 5, which gives random text a GRPO signal)
through a `sitecustomize.py` on their PYTHONPATH; everything else is the shipped command line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pnyx.protocol import layout
from pnyx.protocol.codec import decode_json
from pnyx.store import open_store
from pnyx.swarm.records import NodeHeartbeat

REPO = Path(__file__).resolve().parents[1]
NODES = ("n0", "n1", "n2")
ROUNDS = 3

SITECUSTOMIZE = '''
from pnyx.envs import register
from pnyx.envs.arith import ArithEnv
from pnyx.envs.base import Score


class LengthEnv(ArithEnv):
    name = "swarm_len"

    def grade(self, task, text):
        return Score(reward=(len(text) % 5) / 4, parts={"correct": 0.0, "format": 0.0})


register("swarm_len", LengthEnv)
'''


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


def _run_swarm(url: str, model: Path, env: dict[str, str]) -> None:
    procs = []
    for name in NODES:
        cmd = [
            sys.executable, "-m", "pnyx", "swarm", "--store", url, "--node", name,
            f"--run.steps={ROUNDS}", f"--model.path={model}", "--env.name=swarm_len", '--env.kwargs={"digits": 1}',
            "--worker.group_size=4", "--worker.max_new_tokens=10",
            "--swarm.local_groups=2", "--swarm.external_groups=2",
        ]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=240)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for name, p, out in zip(NODES, procs, outputs, strict=True):
        assert p.returncode == 0, f"node {name} exited {p.returncode}:\n{out[-4000:]}"


def _check(url: str) -> None:
    store = open_store(url)
    for name in NODES:
        hb = decode_json(store.get(layout.swarm_heartbeat(name)), NodeHeartbeat)
        assert hb.status == "stopped" and hb.rounds == ROUNDS
        assert hb.version >= 1, f"node {name} never took a step"
        assert len(store.list(layout.swarm_dir(name))) == 2 * ROUNDS  # every local group was shared


@pytest.mark.slow
def test_three_process_swarm_on_local_folder(swarm_env, tmp_path):
    model, env = swarm_env
    url = str(tmp_path / "swarm")
    _run_swarm(url, model, env)
    _check(url)

