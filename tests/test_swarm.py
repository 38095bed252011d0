"""Swarm mode (SAPO) in one process: the mix, re-scoring, the text path across tokenizers, garbage uploads.

Nodes here are real `SwarmNode`s with tiny random Qwen2 models meeting in a real (memory) store; most
tests use the `swarm_len` environment of `swarm_support` (random text gets a GRPO signal there).
"""

from __future__ import annotations

import math

import pytest
import torch
from swarm_support import fake_upload as _fake_upload
from swarm_support import open_test_node as _node
from swarm_support import signed
from swarm_support import swarm_cfg as _cfg
from swarm_support import text_group as _text_group

from pnyx.config import with_fields
from pnyx.errors import ConfigError
from pnyx.protocol import layout
from pnyx.store import open_store

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


def test_foreign_group_with_other_env_kwargs_is_dropped(model_a):
    """Task ids mean something only with their kwargs, and kwargs configure the verifier: only ours score."""
    store = open_store("memory://")
    me = _node(store, "me", _cfg(env="arith", local_groups=1, external_groups=1), model_a)
    task = me.env.sample("train", 3, 1)[0]
    texts = [f"the answer is {task.answer}", f"<answer>{task.answer + 5}</answer>"]
    hostile = _text_group("peer", 0, task.id, texts, claimed=[1.0, 0.0])
    hostile.env_kwargs = {"digits": 1, "system_prompt": "Always reply 7.", "answer": "lenient"}
    _fake_upload(store, "peer", 0, hostile, next_seq=2)
    store.put(layout.swarm_key("peer", 1), signed(_text_group("peer", 1, task.id, texts, [0.0, 0.0])))
    me.heartbeat()
    me.refresh()
    assert me.drops["env_kwargs_mismatch"] == 1
    [cand] = me.pool.candidates()  # the group made with our kwargs, scored by our own (strict) verifier
    assert cand.group.seq == 1 and cand.rewards == [0.0, 0.0]


def test_a_family_the_operator_lists_in_accept_envs_is_scored_with_exactly_its_kwargs(model_a):
    """Another task family is accepted only as `swarm.accept_envs` lists it (a name and exactly its kwargs),
    and scored by that environment built from the operator's entry: a multiplication peer's right answer
    scores 1 on a node that trains on one-digit sums; the same family with other kwargs stays dropped."""
    from pnyx.envs import get_env

    store = open_store("memory://")
    mul = {"digits": 1, "ops": ["*"]}
    accept = [{"name": "arith", "kwargs": mul}]
    me = _node(store, "me", _cfg(env="arith", local_groups=1, external_groups=1, accept_envs=accept), model_a)
    task = get_env("arith", **mul).sample("train", 3, 1)[0]
    texts = [f"<answer>{task.answer}</answer>", f"<answer>{task.answer + 5}</answer>"]
    theirs = _text_group("peer", 0, task.id, texts, claimed=[0.0, 0.0])
    theirs.env_kwargs = dict(mul)
    _fake_upload(store, "peer", 0, theirs, next_seq=2)
    other = _text_group("peer", 1, task.id, texts, claimed=[1.0, 0.0])
    other.env_kwargs = {"digits": 2, "ops": ["*"]}
    store.put(layout.swarm_key("peer", 1), signed(other))
    me.heartbeat()
    me.refresh()
    assert me.drops["env_kwargs_mismatch"] == 1
    [cand] = me.pool.candidates()
    assert cand.group.seq == 0 and cand.rewards == [1.0, 0.0]  # re-scored by the listed family's verifier


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
    store.put(layout.swarm_key("mallory", 1), signed(impostor, "mallory"))
    flipped = bytearray(signed(good))
    flipped[-1] ^= 0xFF
    store.put(layout.swarm_key("mallory", 2), bytes(flipped))
    bad_reward = _text_group("mallory", 3, good.task_id, ["a", "b"], [0.0, 7.0])
    store.put(layout.swarm_key("mallory", 3), signed(bad_reward))
    store.put(layout.swarm_dir("mallory") + "not-a-seq", b"junk")

    stats = me.round()
    assert me.drops["bad_magic"] == 1
    assert me.drops["node_mismatch"] == 1
    assert me.drops["bad_signature"] == 1  # a flipped byte: the signature is checked before the digest
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
        ("security", "committed_draws", True),
    ],
)
def test_a_swarm_node_refuses_trainer_settings_it_would_ignore(tmp_path, section, field, value):
    from pnyx.swarm.opening import check_swarm_config

    cfg = _cfg()
    check_swarm_config(cfg)  # the defaults pass
    cfg = with_fields(cfg, {f"{section}.{field}": value})
    with pytest.raises(ConfigError, match=rf"swarm mode does not support {section}\.{field}"):
        _node(open_store(str(tmp_path / "s")), "n1", cfg, None)
