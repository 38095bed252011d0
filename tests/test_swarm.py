"""Swarm mode (SAPO) in one process: the mix, re-scoring, the text path across tokenizers, garbage uploads.

Nodes here are real `SwarmNode`s with tiny random Qwen2 models meeting in a real (memory) store; most
tests use the `swarm_len` environment of `swarm_support` (random text gets a GRPO signal there).
"""

from __future__ import annotations

import math

import pytest
import torch
from swarm_support import open_test_node as _node
from swarm_support import swarm_cfg as _cfg

from pnyx.config import with_fields
from pnyx.errors import ConfigError
from pnyx.protocol import layout
from pnyx.store import open_store
from pnyx.swarm.records import NodeHeartbeat, SwarmGroup, SwarmSample, encode_swarm_group

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_a(tmp_path_factory):
    from pnyx_harness.models import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("model_a"), vocab=512, seed=0)


@pytest.fixture(scope="module")
def model_b(tmp_path_factory):
    """A peer with a different tokenizer (another vocabulary size, so other merges and ids)."""
    from pnyx_harness.models import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("model_b"), vocab=400, seed=1)


def _fake_upload(store, node: str, seq: int, group: SwarmGroup | bytes, next_seq: int | None = None) -> None:
    """What a hand-written (possibly hostile) peer puts in the store: a heartbeat and one object."""
    hb = NodeHeartbeat(node=node, next_seq=next_seq if next_seq is not None else seq + 1, updated_at=0.0)
    from pnyx.protocol.codec import encode_json

    store.put(layout.swarm_heartbeat(node), encode_json(hb))
    data = group if isinstance(group, bytes) else encode_swarm_group(group)
    store.put(layout.swarm_key(node, seq), data)


def _text_group(node: str, seq: int, task_id: str, texts: list[str], claimed: list[float]) -> SwarmGroup:
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
    return SwarmGroup(
        node=node,
        seq=seq,
        policy_version=0,
        model_id="hand-written",
        tokenizer_digest="f" * 32,
        env="arith",
        env_kwargs={"digits": 1},
        task_id=task_id,
        samples=samples,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        created_at=0.0,
    )


# --- the mix -------------------------------------------------------------------------------------------


def test_node_trains_on_exactly_i_local_and_j_external_groups(model_a):
    store = open_store("memory://")
    for peer in ("p1", "p2", "p3"):
        _node(store, peer, _cfg(local_groups=2, external_groups=0), model_a).round()
    me = _node(store, "me", _cfg(local_groups=2, external_groups=3, max_per_peer=1), model_a)

    local = me.generate()
    me.share(local)
    me.refresh()
    picked = me.sample_mix()
    external, paths = me.prepare_external(picked)
    mix = me.local_scored(local) + external

    assert len(local) == 2 and len(external) == 3
    assert sorted(c.peer for c in picked) == ["p1", "p2", "p3"]  # max_per_peer=1: one from each
    assert [g.worker_id for g in mix[:2]] == ["me", "me"]
    assert paths == {"exact": 3}  # same model folder, same tokenizer
    assert me.step(mix) is not None and me.version == 1


def test_round_counts_the_mix_and_takes_a_step(model_a):
    store = open_store("memory://")
    _node(store, "p1", _cfg(local_groups=4, external_groups=0), model_a).round()
    me = _node(store, "me", _cfg(local_groups=3, external_groups=2), model_a)
    stats = me.round()
    assert (stats.local_groups, stats.external_groups) == (3, 2)
    assert stats.trained_groups == 5 - stats.zero_variance
    assert stats.step is not None and stats.version == 1


def test_external_group_is_used_at_most_once(model_a):
    store = open_store("memory://")
    _node(store, "p1", _cfg(local_groups=2, external_groups=0), model_a).round()
    me = _node(store, "me", _cfg(local_groups=1, external_groups=2), model_a)
    me.refresh()
    first = me.sample_mix()
    me.refresh()
    second = me.sample_mix()
    assert len(first) == 2 and second == []
    assert me.drops["short_external"] == 2


def test_wait_peers_makes_the_first_round_wait_for_a_peer_that_has_not_shared_yet(model_a):
    """A live peer that shares only later (slow to generate) still makes the first round's mix; without
    anyone sharing, the wait ends at its deadline and the node trains alone."""
    import threading
    import time

    store = open_store("memory://")
    peer = _node(store, "p1", _cfg(local_groups=2, external_groups=0), model_a)
    peer.heartbeat("starting")  # live, nothing shared yet
    me = _node(store, "me", _cfg(local_groups=1, external_groups=2, wait_peers=1, peer_timeout_s=30), model_a)
    later = threading.Timer(1.0, peer.round)
    later.start()
    t0 = time.monotonic()
    (stats,) = me.run(1)
    later.join()
    assert stats.external_groups == 2 and me.peers_seen == {"p1"}
    assert 0.9 < time.monotonic() - t0 < 30

    quiet = open_store("memory://")
    _node(quiet, "silent", _cfg(local_groups=1, external_groups=0), model_a).heartbeat("starting")
    me2 = _node(
        quiet, "me2", _cfg(local_groups=1, external_groups=2, wait_peers=1, peer_timeout_s=1.5), model_a
    )
    t0 = time.monotonic()
    (alone,) = me2.run(1)
    assert alone.external_groups == 0 and alone.step is not None  # trained alone after the deadline
    assert 1.4 < time.monotonic() - t0 < 10


def test_variance_preference_and_per_peer_cap():
    import random

    from pnyx.swarm.foreign import Candidate
    from pnyx.swarm.sample import sample_external

    def cand(peer, i, rewards):
        return Candidate(f"swarm/{peer}/{i:010d}", peer, None, rewards, 0.0)  # type: ignore[arg-type]

    flat = [cand("a", i, [0.0, 0.0]) for i in range(6)]
    signal = [cand("b", 0, [0.0, 1.0]), cand("c", 0, [1.0, 0.0])]
    rng = random.Random(0)
    picked = sample_external(flat + signal, 3, "variance", max_per_peer=1, rng=rng)
    assert {c.peer for c in picked} == {"a", "b", "c"}  # both signal groups first, then one flat (cap 1)
    uniform = sample_external(flat, 5, "uniform", max_per_peer=2, rng=rng)
    assert len(uniform) == 2


# --- re-scoring -----------------------------------------------------------------------------------------


def test_forged_foreign_reward_is_overwritten_by_own_verifier(model_a):
    store = open_store("memory://")
    me = _node(store, "me", _cfg(env="arith", local_groups=1, external_groups=1), model_a)
    task = me.env.sample("train", 7, 1)[0]
    texts = [f"<answer>{task.answer}</answer>", f"<answer>{task.answer + 1}</answer>"]
    _fake_upload(store, "mallory", 0, _text_group("mallory", 0, task.id, texts, claimed=[0.0, 1.0]))

    me.heartbeat()
    me.refresh()
    [cand] = me.pool.candidates()
    assert cand.rewards == [1.0, 0.0] and cand.forged == 2
    external, _ = me.prepare_external(me.sample_mix())
    assert external[0].rewards == [1.0, 0.0]
    assert [s.reward for s in external[0].group.samples] == [1.0, 0.0]


def test_foreign_task_is_rebuilt_with_sender_env_kwargs(model_a):
    store = open_store("memory://")
    me = _node(store, "me", _cfg(env="arith", local_groups=1, external_groups=1), model_a)
    from pnyx.envs import get_env

    other = get_env("arith", digits=3)  # a peer with another task distribution
    task = other.sample("train", 3, 1)[0]
    group = _text_group("peer", 0, task.id, [f"<answer>{task.answer}</answer>", "no"], claimed=[1.0, 0.0])
    group.env_kwargs = {"digits": 3}
    _fake_upload(store, "peer", 0, group)
    me.heartbeat()
    me.refresh()
    assert [c.rewards for c in me.pool.candidates()] == [[1.0, 0.0]]


# --- tokenizers -------------------------------------------------------------------------------------------


def test_different_tokenizer_peer_trains_through_the_text_path(model_a, model_b):
    store = open_store("memory://")
    a = _node(store, "a", _cfg(local_groups=2, external_groups=0), model_a)
    b = _node(store, "b", _cfg(local_groups=1, external_groups=2), model_b)
    assert a.tokenizer_digest != b.tokenizer_digest
    a.round()

    b.heartbeat()
    b.refresh()
    picked = b.sample_mix()
    external, paths = b.prepare_external(picked)
    assert paths == {"aligned": 2}
    for cand, scored in zip(picked, external, strict=True):
        for sent, got in zip(cand.group.samples, scored.group.samples, strict=True):
            assert b.tokenizer.decode(got.tokens, skip_special_tokens=True) == sent.text
            assert all(0 <= t < len(b.tokenizer) for t in got.tokens)
    stats = b.round()
    assert stats.step is not None and b.version == 1


def test_same_tokenizer_peer_uses_sender_tokens_and_logprobs_when_gated(model_a):
    store = open_store("memory://")
    a = _node(store, "a", _cfg(local_groups=1, external_groups=0), model_a)
    b = _node(store, "b", _cfg(local_groups=1, external_groups=1, foreign="gated"), model_a)
    a.round()
    b.heartbeat()
    b.refresh()
    picked = b.sample_mix()
    external, paths = b.prepare_external(picked)
    assert paths == {"exact": 1}
    for sent, got in zip(picked[0].group.samples, external[0].group.samples, strict=True):
        assert got.tokens == sent.tokens and got.logprobs == sent.logprobs


def test_onpolicy_mode_uses_own_logprobs_for_foreign_text(model_a):
    from pnyx.models.logprobs import completion_logprobs

    store = open_store("memory://")
    a = _node(store, "a", _cfg(local_groups=1, external_groups=0), model_a)
    b = _node(store, "b", _cfg(local_groups=1, external_groups=1, foreign="onpolicy"), model_a)
    a.round()  # a trains, so its recorded logprobs differ from b's untrained policy
    b.heartbeat()
    b.refresh()
    external, _ = b.prepare_external(b.sample_mix())
    rec = external[0].group
    comps = [s.tokens for s in rec.samples]
    with torch.no_grad():
        own, _, _ = completion_logprobs(b.model, [rec.prompt_tokens] * len(comps), comps)
    for i, s in enumerate(rec.samples):
        assert s.logprobs == pytest.approx(own[i, : len(s.tokens)].tolist(), abs=1e-5)


def test_gated_mode_downweights_and_gates_implausible_foreign_tokens():
    """With the sender's μ, a token we find implausible gets weight π/μ, not 1; a moved one is gated."""
    from pnyx.train.losses import LossSettings, policy_terms

    settings = LossSettings(dppo_delta=0.2)
    logp = torch.log(torch.tensor([[0.001, 0.9]])).requires_grad_(True)  # our π of two foreign tokens
    sender = torch.log(torch.tensor([[0.9, 0.3]]))  # the sender's μ (gated) ...
    own = logp.detach()  # ... or our own pre-step π (onpolicy: ratio ≡ 1)
    adv, mask = torch.tensor([1.0]), torch.ones(1, 2)

    grads = {}
    for mode, mu in (("gated", sender), ("onpolicy", own)):
        terms = policy_terms(logp, mu, adv, mask, settings)
        (g,) = torch.autograd.grad(terms.loss.sum(), logp)
        grads[mode] = (g, terms.gate_masked)
    g_gated, gated_mask = grads["gated"]
    g_onpol, onpol_mask = grads["onpolicy"]
    assert math.isclose(float(g_gated[0, 0] / g_onpol[0, 0]), 0.001 / 0.9, rel_tol=1e-4)
    assert gated_mask.tolist() == [[False, True]]  # π - μ = 0.6 > δ with A > 0: already moved, masked
    assert onpol_mask.tolist() == [[False, False]]


# --- robustness -------------------------------------------------------------------------------------------


def test_garbage_uploads_are_rejected_and_counted(model_a):
    store = open_store("memory://")
    me = _node(store, "me", _cfg(local_groups=1, external_groups=2), model_a)
    good = _text_group(
        "mallory", 1, me.env.sample("train", 0, 1)[0].id, ["<answer>1</answer>", "x"], [0.0, 0.0]
    )
    _fake_upload(store, "mallory", 0, b"\x00garbage" * 10, next_seq=4)
    impostor = _text_group("eve", 1, good.task_id, ["a", "b"], [0.0, 0.0])  # stored under mallory's prefix
    store.put(layout.swarm_key("mallory", 1), encode_swarm_group(impostor))
    flipped = bytearray(encode_swarm_group(good))
    flipped[-1] ^= 0xFF
    store.put(layout.swarm_key("mallory", 2), bytes(flipped))
    bad_reward = _text_group("mallory", 3, good.task_id, ["a", "b"], [0.0, 7.0])
    store.put(layout.swarm_key("mallory", 3), encode_swarm_group(bad_reward))
    store.put(layout.swarm_dir("mallory") + "not-a-seq", b"junk")

    stats = me.round()
    assert me.drops["bad_magic"] == 1
    assert me.drops["node_mismatch"] == 1
    assert me.drops["digest_mismatch"] == 1
    assert me.drops["bad_reward"] == 1
    assert me.drops["bad_key"] == 1
    assert stats.external_groups == 0 and stats.version == me.version  # the round completed anyway


def test_peer_with_stale_heartbeat_is_ignored(model_a):
    store = open_store("memory://")
    me = _node(store, "me", _cfg(env="arith", local_groups=1, external_groups=1), model_a)
    me.feed.peer_timeout_s = 0.05
    task = me.env.sample("train", 0, 1)[0]
    _fake_upload(store, "gone", 0, _text_group("gone", 0, task.id, ["1", "2"], [0.0, 0.0]))
    import time

    time.sleep(0.3)
    me.heartbeat()
    assert me.refresh() == 0 and "gone" not in me.feed.peers


def test_late_joiner_fetches_only_the_newest_uploads(model_a):
    store = open_store("memory://")
    early = _node(store, "early", _cfg(local_groups=2, external_groups=0), model_a)
    for _ in range(4):
        early.round()  # 8 uploads
    late = _node(store, "late", _cfg(local_groups=1, external_groups=1, recent_per_peer=3), model_a)
    late.heartbeat()
    late.refresh()
    assert [layout.parse_swarm_key(c.key)[1] for c in late.pool.candidates()] == [5, 6, 7]


def test_node_named_nodes_is_rejected(model_a):
    from pnyx.swarm.share import check_node_name

    with pytest.raises(ConfigError, match="reserved"):
        check_node_name("nodes")
    with pytest.raises(ConfigError):
        _node(open_store("memory://"), "nodes", _cfg(), model_a)


def test_restarted_node_continues_its_sequence(model_a):
    store = open_store("memory://")
    first = _node(store, "n", _cfg(local_groups=2, external_groups=0), model_a)
    first.round()
    again = _node(store, "n", _cfg(local_groups=2, external_groups=0), model_a)
    assert again.seq == 2
    again.round()  # no AlreadyExistsError
    assert store.exists(layout.swarm_key("n", 3))


def test_cli_refuses_reserved_node_name_before_loading_a_model(tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "pnyx", "swarm", "--store", str(tmp_path / "s"), "--node", "nodes"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "reserved" in out.stderr


@pytest.mark.parametrize(
    ("section", "field", "value"),
    [
        ("algorithm", "kl_coef", 0.1),
        ("trainer", "lr_schedule", "cosine"),
        ("trainer", "warmup_steps", 5),
        ("trainer", "compute_dtype", "bfloat16"),
        ("trainer", "activation_checkpointing", True),
        ("worker", "engine", "mlx"),
    ],
)
def test_a_swarm_node_refuses_trainer_settings_it_would_ignore(tmp_path, section, field, value):
    from pnyx.swarm.node import check_swarm_config

    cfg = _cfg()
    check_swarm_config(cfg)  # the defaults pass
    cfg = with_fields(cfg, {f"{section}.{field}": value})
    with pytest.raises(ConfigError, match=rf"swarm mode does not support {section}\.{field}"):
        _node(open_store(str(tmp_path / "s")), "n1", cfg, None)
