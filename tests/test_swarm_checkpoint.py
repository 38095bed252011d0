"""Swarm node checkpoints in one process: what a resumed node restores, and that it then continues exactly
as if it had never stopped. (The SIGKILL test with real processes is in `test_swarm_process.py`.)"""

from __future__ import annotations

import pytest
import torch
from swarm_support import open_test_node as _node
from swarm_support import swarm_cfg as _cfg

from pnyx.errors import ConfigError
from pnyx.protocol import layout
from pnyx.store import open_store

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_a(tmp_path_factory):
    from pnyx_harness.models import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("model_a"), vocab=512, seed=0)


def _state(node) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in node.model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resumed_node_restores_weights_optimizer_and_counters(model_a):
    store = open_store("memory://")
    cfg = _cfg(local_groups=2, external_groups=0, checkpoint_every=2)
    node = _node(store, "n", cfg, model_a)
    node.round()
    node.round()  # checkpoint here (round 2)
    saved, saved_version = _state(node), node.version
    saved_adam = {k: v.clone() for k, v in node.optimizer.state[next(node.model.parameters())].items()}
    node.round()  # not checkpointed: lost by a crash now
    assert saved_version >= 1 and not _same(saved, _state(node))

    again = _node(store, "n", cfg, model_a)
    assert again.rounds == 2 and again.version == saved_version and again.resumed_from == 2
    assert _same(saved, _state(again))
    adam = again.optimizer.state[next(again.model.parameters())]
    assert all(torch.equal(adam[k], v) for k, v in saved_adam.items())
    assert again.seq == 6  # after all three rounds' uploads, including the one the checkpoint does not know


def test_resumed_node_continues_exactly_like_an_uninterrupted_one(model_a):
    cfg = _cfg(local_groups=2, external_groups=0, checkpoint_every=2)
    straight = _node(open_store("memory://"), "n", cfg, model_a)
    straight_rewards = [straight.round().local_reward for _ in range(4)]

    store = open_store("memory://")
    first = _node(store, "n", cfg, model_a)
    rewards = [first.round().local_reward for _ in range(2)]
    del first  # "killed" right after its checkpoint at round 2
    resumed = _node(store, "n", cfg, model_a)
    rewards += [resumed.round().local_reward for _ in range(2)]

    assert rewards == straight_rewards  # same tasks, same samples: task cursor and RNGs were restored
    assert resumed.version == straight.version
    assert _same(_state(resumed), _state(straight))  # and the same updates: weights and AdamW state


def test_resume_refetches_pending_foreign_groups_and_skips_used_ones(model_a):
    store = open_store("memory://")
    peer = _node(store, "peer", _cfg(local_groups=3, external_groups=0), model_a)
    me = _node(store, "me", _cfg(local_groups=1, external_groups=1, max_per_peer=1), model_a)
    peer.round()
    me.round()  # fetched peer's 3 groups, trained on one
    used = set(me.pool._used)
    pending = {c.key for c in me.pool.candidates()}
    assert len(used) == 1 and len(pending) == 2
    me.checkpoint()

    again = _node(store, "me", _cfg(local_groups=1, external_groups=1, max_per_peer=1), model_a)
    assert {c.key for c in again.pool.candidates()} == pending
    again.heartbeat()
    assert again.refresh() == 0  # nothing new: the used group is not fetched again
    assert not used & {c.key for c in again.pool.candidates()}


def test_checkpoint_of_another_model_is_refused_with_a_way_out(model_a, tmp_path):
    from pnyx_harness.models import make_tiny_model_dir

    other = make_tiny_model_dir(tmp_path / "other", vocab=400, seed=1)
    store = open_store("memory://")
    node = _node(store, "n", _cfg(local_groups=1, external_groups=0), model_a)
    node.round()
    node.checkpoint()
    with pytest.raises(ConfigError, match="another tokenizer.*--swarm.resume=false"):
        _node(store, "n", _cfg(local_groups=1, external_groups=0), other)
    fresh = _node(store, "n", _cfg(local_groups=1, external_groups=0, resume=False), other)
    assert fresh.rounds == 0 and fresh.resumed_from == -1 and fresh.seq == 1  # its sequence still continues


@pytest.mark.parametrize("forgery", ["unsigned", "another_key", "tampered"])
def test_a_checkpoint_this_machines_node_key_did_not_sign_is_never_resumed(
    model_a, forgery, monkeypatch, tmp_path
):
    """Anyone who can write to the store can put an object at `swarm/ckpt/{node}.pt` (the red-team review of
    2026-12-05 resumed a node from such an object: every weight 0.0123, a million rounds done). A node
    resumes only from a checkpoint its own key (on its machine) signed; anything else is refused with the
    way out, and `--swarm.resume=false` starts from the model."""
    from pnyx.swarm import checkpoint as ck

    monkeypatch.setenv("PNYX_KEYS_DIR", str(tmp_path / "keys"))
    store = open_store("memory://")
    node = _node(store, "n", _cfg(local_groups=1, external_groups=0), model_a)
    node.round()
    node.checkpoint()
    key = layout.swarm_checkpoint("n")
    signed = store.get(key)
    blob = signed[len(ck.SIGNED_MAGIC) + 96 :]
    if forgery == "unsigned":
        forged = blob
    elif forgery == "another_key":
        monkeypatch.setenv("PNYX_KEYS_DIR", str(tmp_path / "attacker"))
        ck.save_node_checkpoint(store, ck.capture(node), node.model, node.optimizer)
        monkeypatch.setenv("PNYX_KEYS_DIR", str(tmp_path / "keys"))
        forged = store.get(key)
    else:
        forged = signed[:-1] + bytes([signed[-1] ^ 1])
    store.put(key, forged, mode="overwrite")
    with pytest.raises(ConfigError, match="refusing to resume|does not verify") as err:
        _node(store, "n", _cfg(local_groups=1, external_groups=0), model_a)
    assert "--swarm.resume=false" in str(err.value) and str(ck.node_key_path("n")) in str(err.value)
    fresh = _node(store, "n", _cfg(local_groups=1, external_groups=0, resume=False), model_a)
    assert fresh.rounds == 0 and fresh.resumed_from == -1
    store.put(key, signed, mode="overwrite")  # its own checkpoint again: resumed
    assert _node(store, "n", _cfg(local_groups=1, external_groups=0), model_a).resumed_from == 1


def test_run_counts_restored_rounds_and_checkpoints_at_a_clean_stop(model_a):
    store = open_store("memory://")
    cfg = _cfg(local_groups=1, external_groups=0, checkpoint_every=0)
    assert len(_node(store, "n", cfg, model_a).run(3)) == 3
    assert store.exists(layout.swarm_checkpoint("n"))  # checkpoint_every=0: only at the end
    again = _node(store, "n", cfg, model_a)
    assert len(again.run(5)) == 2 and again.rounds == 5  # run.steps is the node's total, not "more"


def test_heartbeat_reports_groups_used_and_peers_seen(model_a):
    from pnyx.protocol.codec import decode_json
    from pnyx.swarm.records import NodeHeartbeat

    store = open_store("memory://")
    a = _node(store, "a", _cfg(local_groups=2, external_groups=2), model_a)
    b = _node(store, "b", _cfg(local_groups=2, external_groups=2), model_a)
    for _ in range(3):
        a.round()
        b.round()
    hb = decode_json(store.get(layout.swarm_heartbeat("b")), NodeHeartbeat)
    assert hb.peers == ["a"] and hb.peers_seen == 1
    assert hb.local_trained == b.local_trained >= 1 and hb.external_trained == b.external_trained >= 1
    assert hb.version == b.version and hb.rounds == 3 and hb.groups == 6


def test_swarm_node_does_not_import_the_trainer_loop():
    import subprocess
    import sys

    code = "import sys, pnyx.swarm.node; print('pnyx.train.loop' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
