"""Helpers for the swarm tests (no tests here): the `swarm_len` test environment, configs, node builders.

A random tiny model never solves arithmetic, so most swarm tests use `swarm_len`, whose verifier rewards
the completion's length modulo 5: random text then gives groups with reward variance, i.e. a GRPO signal.
Importing this module registers it in the importing process; `SITECUSTOMIZE` does the same for node
processes (put on their PYTHONPATH).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from pnyx.config import load_config
from pnyx.envs import register
from pnyx.envs.arith import ArithEnv
from pnyx.envs.base import Score
from pnyx.protocol import layout
from pnyx.protocol.codec import decode_json, encode_json
from pnyx.security.signing import Signer
from pnyx.store import open_store
from pnyx.swarm.records import NodeHeartbeat, SwarmGroup, SwarmSample, encode_swarm_group

_PEER_KEYS: dict[str, Signer] = {}


def peer_signer(name: str) -> Signer:
    """The key a hand-written peer `name` signs its records with (one per name, per test process)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    if name not in _PEER_KEYS:
        _PEER_KEYS[name] = Signer(Ed25519PrivateKey.generate())
    return _PEER_KEYS[name]


def signed(group: SwarmGroup, by: str | None = None) -> bytes:
    """`group`'s wire bytes signed by peer `by`'s key (default: the node the group names)."""
    return encode_swarm_group(group, peer_signer(by or group.node))


class LengthEnv(ArithEnv):
    """Arithmetic prompts; reward = (len(text) mod 5) / 4, so random completions disagree."""

    name = "swarm_len"

    def grade(self, task, text):
        return Score(reward=(len(text) % 5) / 4, parts={"correct": 0.0, "format": 0.0})


register("swarm_len", LengthEnv)

SITECUSTOMIZE = """
from pnyx.envs import register
from pnyx.envs.arith import ArithEnv
from pnyx.envs.base import Score


class LengthEnv(ArithEnv):
    name = "swarm_len"

    def grade(self, task, text):
        return Score(reward=(len(text) % 5) / 4, parts={"correct": 0.0, "format": 0.0})


register("swarm_len", LengthEnv)
"""


def swarm_cfg(env: str = "swarm_len", env_kwargs: dict[str, Any] | None = None, **swarm: Any):
    """A small node config: G=4, 10 new tokens, I=2/J=2 unless overridden by `swarm`; env kwargs
    `{"digits": 1}` unless given."""
    sw = {"local_groups": 2, "external_groups": 2, "max_per_peer": 4} | swarm
    return load_config(
        overrides={
            "env": {"name": env, "kwargs": {"digits": 1} if env_kwargs is None else env_kwargs},
            "worker": {"group_size": 4, "max_new_tokens": 10},
            "swarm": sw,
        }
    )


def open_test_node(store: Any, name: str, cfg: Any, model_dir: Any, **kwargs: Any):
    from pnyx.swarm.opening import open_node

    return open_node(store, name, cfg, model_dir, **kwargs)


# --- a hand-written (possibly hostile) peer ----------------------------------------------------------


def fake_upload(
    store: Any, node: str, seq: int, group: SwarmGroup | bytes, next_seq: int | None = None
) -> None:
    """What a hand-written (possibly hostile) peer puts in the store: a heartbeat and one object (a group is
    signed by the peer's own key, `peer_signer(node)`)."""
    hb = NodeHeartbeat(node=node, next_seq=next_seq if next_seq is not None else seq + 1, updated_at=0.0)
    store.put(layout.swarm_heartbeat(node), encode_json(hb))
    data = group if isinstance(group, bytes) else signed(group, node)
    store.put(layout.swarm_key(node, seq), data)


def text_group(node: str, seq: int, task_id: str, texts: list[str], claimed: list[float]) -> SwarmGroup:
    """An `arith` (digits 1) group of `texts` as a peer with a one-character-per-token tokenizer shares it."""
    samples = [
        SwarmSample(
            text=t,
            tokens=[ord(ch) for ch in t],
            logprobs=[-1.0] * len(t),
            loss_mask=[1] * len(t),
            token_ends=list(range(1, len(t) + 1)),
            reward=r,
        )
        for t, r in zip(texts, claimed, strict=True)
    ]
    return _arith_group(node, seq, "hand-written", "f" * 32, task_id, samples)


def _arith_group(
    node: str, seq: int, model_id: str, digest: str, task_id: str, samples: list[SwarmSample]
) -> SwarmGroup:
    """An `arith` (digits 1) group at version 0, sampled at temperature 1 without truncation."""
    return SwarmGroup(
        node=node, seq=seq, policy_version=0, model_id=model_id, tokenizer_digest=digest, env="arith",
        env_kwargs={"digits": 1}, task_id=task_id, samples=samples, temperature=1.0, top_p=1.0, top_k=0,
        created_at=0.0,
    )  # fmt: skip


def token_group(node: Any, peer: str, seq: int, task_id: str, completions: list[list[int]]) -> SwarmGroup:
    """A group of `completions` in `node`'s own token ids, as a same-tokenizer peer shares it."""
    from pnyx.swarm.align import char_ends

    tok = node.tokenizer
    samples = [
        SwarmSample(
            text=tok.decode(ids, skip_special_tokens=True),
            tokens=list(ids),
            logprobs=[-0.5] * len(ids),
            loss_mask=[1] * len(ids),
            token_ends=char_ends(tok, ids),
            reward=0.0,
        )
        for ids in completions
    ]
    return _arith_group(peer, seq, "peer", node.tokenizer_digest, task_id, samples)


# --- three node processes (test_swarm_process*.py) ---------------------------------------------------

REPO = Path(__file__).resolve().parents[1]
NODES = ("n0", "n1", "n2")
ROUNDS = 4


def make_swarm_env(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """(model dir, environment for the node processes): a tiny model, and the `swarm_len` hook on the path."""
    from pnyx_harness.models import make_tiny_model_dir

    root = tmp_path_factory.mktemp("swarm-proc")
    model = make_tiny_model_dir(root / "model", vocab=400, seed=3)
    hook = root / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(hook), str(REPO), env.get("PYTHONPATH", "")])
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return model, env


def node_cmd(url: str, name: str, model: Path, rounds: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "pnyx", "swarm", "--store", url, "--node", name,
        f"--run.steps={rounds}", f"--model.path={model}", "--env.name=swarm_len", '--env.kwargs={"digits": 1}',
        "--worker.group_size=4", "--worker.max_new_tokens=10",
        "--swarm.local_groups=2", "--swarm.external_groups=2", *extra,
    ]  # fmt: skip


def run_swarm(url: str, model: Path, env: dict[str, str]) -> dict[str, str]:
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


def check_swarm(url: str, outputs: dict[str, str]) -> None:
    store = open_store(url)
    for name in NODES:
        hb = decode_json(store.get(layout.swarm_heartbeat(name)), NodeHeartbeat)
        out = outputs[name][-3000:]
        assert hb.status == "stopped" and hb.rounds == ROUNDS
        assert hb.version >= 1, f"node {name} never took a step"
        assert len(store.list(layout.swarm_dir(name))) == 2 * ROUNDS  # every local group was shared
        assert hb.external_trained >= 1, f"node {name} never trained on a peer's group:\n{out}"
        assert hb.peers_seen == len(NODES) - 1
