"""Swarm nodes against hostile peers: objects anyone can write in the store must never stop a node, silence a
peer, configure our verifier, or reach the loss in a form this node would not produce itself.

Real `SwarmNode`s with the tiny random model, meeting in a real local-folder store under `tmp_path`.
"""

from __future__ import annotations

import pytest
import torch
from swarm_support import fake_upload, open_test_node, signed, swarm_cfg, text_group, token_group

from pnyx.errors import ConfigError
from pnyx.protocol import layout
from pnyx.store import open_store
from pnyx.swarm import foreign
from pnyx.swarm.records import decode_swarm_group, encode_swarm_group
from pnyx.swarm.share import read_heartbeat

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_a(tmp_path_factory):
    from pnyx_harness.models import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("model_a"), vocab=512, seed=0)


def _arith(store, name, model, **swarm):
    return open_test_node(store, name, swarm_cfg(env="arith", **swarm), model)


def _enc(node, text: str) -> list[int]:
    return list(node.tokenizer(text, add_special_tokens=False)["input_ids"])


# --- nothing in the store stops a node ---------------------------------------------------------------------


def test_malformed_heartbeats_are_skipped_not_fatal(model_a, tmp_path):
    store = open_store(str(tmp_path))
    me = open_test_node(store, "me", swarm_cfg(local_groups=1, external_groups=1), model_a)
    store.put(f"{layout.SWARM_NODES_PREFIX}x y.json", b"{}")  # a key that names no node
    huge = b'{"schema": 1, "node": "mallory", "next_seq": 100000000000, "updated_at": 0.0}'  # past any key
    store.put(layout.swarm_heartbeat("mallory"), huge)
    me.run(2)
    assert read_heartbeat(store, "me").status == "stopped" and me.rounds == 2  # type: ignore[union-attr]
    assert me.drops["bad_heartbeat_key"] == 2 and me.drops["bad_heartbeat"] == 2  # once per refresh


def test_an_error_raised_while_accepting_a_record_is_a_counted_drop(model_a, tmp_path, monkeypatch):
    store = open_store(str(tmp_path))
    me = _arith(store, "me", model_a, local_groups=1, external_groups=1)
    task = me.env.sample("train", 0, 1)[0]
    grade = me.env.grade

    def fragile(t, text):  # a verifier with a bug that one text triggers
        if text == "boom":
            raise TypeError("verifier bug")
        return grade(t, text)

    monkeypatch.setattr(me.env, "grade", fragile)
    fake_upload(store, "mallory", 0, text_group("mallory", 0, task.id, ["boom", "1"], [0.0, 0.0]))
    stats = me.round()
    assert me.drops["accept_error"] == 1 and stats.external_groups == 0


def test_searchqa_record_with_foreign_kwargs_does_not_reach_the_verifier(model_a, tmp_path):
    store = open_store(str(tmp_path))
    cfg = swarm_cfg(env="searchqa", env_kwargs={}, local_groups=1, external_groups=1)
    me = open_test_node(store, "me", cfg, model_a)
    group = text_group(
        "mallory", 0, me.env.sample("train", 0, 1)[0].id, ["<answer>Paris</answer>"] * 2, [0.0, 0.0]
    )
    group.env, group.env_kwargs = "searchqa", {"max_answer_chars": None}  # made our verifier raise TypeError
    fake_upload(store, "mallory", 0, group)
    me.run(1)
    assert me.rounds == 1 and me.drops["env_kwargs_mismatch"] == 1


# --- a peer's prefix: no one can silence it or squat a node's next key --------------------------------------


def test_junk_at_a_high_seq_does_not_silence_the_peer(model_a, tmp_path):
    store = open_store(str(tmp_path))
    alice = open_test_node(store, "alice", swarm_cfg(local_groups=2, external_groups=0), model_a)
    me = open_test_node(store, "me", swarm_cfg(local_groups=1, external_groups=4), model_a)
    alice.round()
    me.heartbeat()
    assert me.refresh() == 2
    store.put(layout.swarm_key("alice", 9_999_999_999), b"junk")
    impostor = decode_swarm_group(store.get(layout.swarm_key("alice", 0)))
    impostor.seq = 9_999_999_998  # a valid record in alice's name, far above what alice announced
    store.put(layout.swarm_key("alice", impostor.seq), signed(impostor, "mallory"))
    alice.round()
    me.heartbeat()
    assert me.refresh() == 2  # alice's new uploads still arrive
    assert me.feed.cursor() == {"alice": alice.seq - 1}
    assert me.drops["ahead_of_heartbeat"] == 2


def test_a_squatted_next_seq_is_skipped(model_a, tmp_path):
    store = open_store(str(tmp_path))
    alice = open_test_node(store, "alice", swarm_cfg(local_groups=2, external_groups=0), model_a)
    alice.round()
    nxt = alice.seq
    for q in (nxt, nxt + 1):
        store.put(layout.swarm_key("alice", q), b"x", mode="create")
    alice.run(2)
    assert alice.drops["seq_taken"] == 2 and alice.uploaded == 4
    assert read_heartbeat(store, "alice").next_seq == nxt + 4  # type: ignore[union-attr]


def test_a_record_of_ours_at_our_next_seq_still_stops_the_node(model_a, tmp_path):
    """Another process running under our name writes records of ours: only the operator can resolve that."""
    store = open_store(str(tmp_path))
    alice = open_test_node(store, "alice", swarm_cfg(local_groups=1, external_groups=0), model_a)
    alice.round()
    twin = decode_swarm_group(store.get(layout.swarm_key("alice", 0)))
    twin.seq = alice.seq
    store.put(layout.swarm_key("alice", twin.seq), encode_swarm_group(twin, alice.signer), mode="create")
    with pytest.raises(ConfigError, match="another process is running as node"):
        alice.share(alice.generate())


# --- what a foreign group must match to be trained on -------------------------------------------------------


@pytest.mark.parametrize(
    ("over", "reason"),
    [
        ({"temperature": 1e-300}, "sampling_mismatch"),
        ({"temperature": 0.7}, "sampling_mismatch"),
        ({"top_k": 5}, "sampling_mismatch"),
        ({"task_id": "arith/test/0/3"}, "not_train_split"),
    ],
)
def test_foreign_group_not_made_like_ours_is_dropped(model_a, tmp_path, over, reason):
    store = open_store(str(tmp_path))
    me = _arith(store, "me", model_a, local_groups=0, external_groups=1)
    task = me.env.sample("train", 5, 1)[0]
    group = text_group("mallory", 0, task.id, [f"<answer>{task.answer}</answer>", "x"], [1.0, 0.0])
    for k, v in over.items():
        setattr(group, k, v)
    fake_upload(store, "mallory", 0, group)
    me.heartbeat()
    me.refresh()
    assert len(me.pool) == 0 and me.drops[reason] == 1


def test_a_step_with_a_non_finite_gradient_is_skipped(model_a, tmp_path):
    store = open_store(str(tmp_path))
    me = _arith(store, "me", model_a, local_groups=0, external_groups=1)
    task = me.env.sample("train", 5, 1)[0]
    right, wrong = (
        _enc(me, f"<answer>{task.answer}</answer>"),
        _enc(me, f"<answer>{task.answer + 2}</answer>"),
    )
    cand = foreign.make_candidate(
        "k", "mallory", token_group(me, "mallory", 0, task.id, [right, wrong]), me.envs, me.admission
    )
    rows = foreign.to_rows(
        cand, me.envs, me.tokenizer, me.tokenizer_digest, me.eos_id, me.max_foreign_tokens, me.eos_ids
    )
    scored = foreign.scored_group(rows, *foreign.behaviour(rows, None, "gated"), "grpo")
    scored.group.temperature = 1e-300  # what the old admission let through: logits / T overflow
    before = [p.detach().clone() for p in me.model.parameters()]
    assert me.step([scored]) is None
    assert me.drops["nonfinite_step"] == 1 and me.version == 0
    assert all(torch.equal(p, b) for p, b in zip(me.model.parameters(), before, strict=True))
    assert not me.optimizer.state  # AdamW never stepped
    scored.group.temperature = 1.0
    assert me.step([scored]) is not None and me.version == 1


def test_foreign_group_larger_than_ours_is_dropped(model_a, tmp_path):
    store = open_store(str(tmp_path))
    me = _arith(store, "me", model_a, local_groups=0, external_groups=1)
    task = me.env.sample("train", 5, 1)[0]
    comps = [_enc(me, f"<answer>{i}</answer>") for i in range(16)]
    fake_upload(store, "mallory", 0, token_group(me, "mallory", 0, task.id, comps))
    me.heartbeat()
    me.refresh()
    assert len(me.pool) == 0 and me.drops["group_too_large"] == 1


def test_exact_path_caps_completion_length(model_a, tmp_path):
    store = open_store(str(tmp_path))
    me = _arith(store, "me", model_a, local_groups=0, external_groups=1)
    task = me.env.sample("train", 5, 1)[0]
    filler = _enc(me, "a b " * 100)[: 4 * me.max_new_tokens + 8]  # the cap of the text path
    comps = [filler + _enc(me, f"<answer>{task.answer + i}</answer>") for i in range(2)]
    fake_upload(store, "mallory", 0, token_group(me, "mallory", 0, task.id, comps))
    me.heartbeat()
    me.refresh()
    external, paths = me.prepare_external(me.sample_mix())
    assert external == [] and me.drops["too_many_tokens"] == 1


def test_special_tokens_inside_a_completion_are_never_trained(model_a, tmp_path):
    """Decoding skips special tokens, so hidden EOS/role ids would match the text; they take the text path."""
    store = open_store(str(tmp_path))
    me = _arith(store, "me", model_a, local_groups=0, external_groups=1)
    tok = me.tokenizer
    special = set(tok.all_special_ids)
    task = me.env.sample("train", 5, 1)[0]
    hidden = _enc(me, "<answer>") + [tok.eos_token_id] + _enc(me, f"{task.answer}</answer>")
    honest = _enc(me, f"<answer>{task.answer + 1}</answer>") + [tok.eos_token_id]
    fake_upload(store, "mallory", 0, token_group(me, "mallory", 0, task.id, [hidden, honest]))
    me.heartbeat()
    me.refresh()
    external, paths = me.prepare_external(me.sample_mix())
    assert paths == {"aligned": 1}
    for s in external[0].group.samples:
        assert special.isdisjoint(s.tokens[:-1])
    cand = foreign.make_candidate(
        "k", "bob", token_group(me, "bob", 0, task.id, [honest, honest]), me.envs, me.admission
    )
    rows = foreign.to_rows(
        cand, me.envs, tok, me.tokenizer_digest, me.eos_id, me.max_foreign_tokens, me.eos_ids
    )
    assert rows.path == "exact"  # a final EOS is what an honest same-tokenizer peer sends


def test_tool_text_in_an_environment_without_tools_is_dropped(model_a, tmp_path):
    """A wrong answer (trained) followed by the right one marked as tool text (scored, never trained)."""
    store = open_store(str(tmp_path))
    me = _arith(store, "me", model_a, local_groups=0, external_groups=1)
    task = me.env.sample("train", 5, 1)[0]
    wrong, right = (
        _enc(me, f"<answer>{task.answer + 3}</answer>"),
        _enc(me, f"<answer>{task.answer}</answer>"),
    )
    group = token_group(me, "mallory", 0, task.id, [wrong + right, wrong])
    injected = group.samples[0]
    injected.loss_mask = [1] * len(wrong) + [0] * len(right)
    injected.logprobs = [
        lp if m else 0.0 for lp, m in zip(injected.logprobs, injected.loss_mask, strict=True)
    ]
    fake_upload(store, "mallory", 0, group)
    me.heartbeat()
    me.refresh()
    assert len(me.pool) == 0 and me.drops["tool_text"] == 1


def test_text_that_runs_on_past_its_stop_string_is_dropped(model_a, tmp_path):
    """An engine stops at the first `</answer>`: a sample that goes on past it (a wrong answer, then the
    right one after the stop, which a lenient verifier would read) was not generated by one. A few
    characters after the stop (the rest of its token) pass."""
    store = open_store(str(tmp_path))
    me = _arith(store, "me", model_a, local_groups=0, external_groups=1)
    task = me.env.sample("train", 5, 1)[0]
    run_on = f"<answer>{task.answer + 3}</answer> wait, no: the answer is <answer>{task.answer}</answer>"
    fake_upload(
        store, "mallory", 0, text_group("mallory", 0, task.id, [run_on, "<answer>0</answer>"], [1.0, 0.0])
    )
    fake_upload(
        store,
        "peer",
        0,
        text_group("peer", 0, task.id, [f"<answer>{task.answer}</answer>\n", "x"], [1.0, 0.0]),
    )
    me.heartbeat()
    me.refresh()
    assert me.drops["run_on"] == 1 and [c.peer for c in me.pool.candidates()] == ["peer"]


def test_copies_of_one_group_under_many_names_fill_one_slot(model_a, tmp_path):
    store = open_store(str(tmp_path))
    me = _arith(store, "me", model_a, local_groups=0, external_groups=4, max_per_peer=2)
    task = me.env.sample("train", 5, 1)[0]
    texts = [f"<answer>{task.answer}</answer>", "<answer>0</answer> nope"]
    for name in ("m0", "m1", "m2", "m3"):
        for seq in range(2):
            fake_upload(store, name, seq, text_group(name, seq, task.id, texts, [0.0, 0.0]), next_seq=2)
    me.heartbeat()
    me.refresh()
    assert len(me.sample_mix()) == 1 and me.drops["duplicate_content"] == 7
    fake_upload(store, "m4", 0, text_group("m4", 0, task.id, texts, [0.0, 0.0]))
    me.heartbeat()
    me.refresh()  # a copy of a group already used is not added either
    assert len(me.pool) == 0 and me.drops["duplicate_content"] == 8


def test_a_flood_of_invented_names_costs_bounded_reads_and_keeps_the_known_peers(model_a, tmp_path):
    """Names are free: 12 fresh heartbeats where a node reads at most 4 per look. The peer that has
    delivered a valid record is read every round, the other 3 places are a random draw of the junk names
    (groups sampled at another temperature: never valid), the rest are counted, never read."""
    store = open_store(str(tmp_path))
    me = _arith(store, "me", model_a, local_groups=0, external_groups=1)
    me.feed.max_peers = 4
    task = me.env.sample("train", 5, 1)[0]
    texts = [f"<answer>{task.answer}</answer>", "<answer>0</answer>"]
    fake_upload(store, "friend", 0, text_group("friend", 0, task.id, texts, [1.0, 0.0]))
    me.heartbeat()
    me.refresh()
    assert "friend" in me.feed.peers
    for k in range(11):
        junk = text_group(f"sybil{k}", 0, task.id, [f"{k}", "x"], [0.0, 0.0])
        junk.temperature = 0.5
        fake_upload(store, f"sybil{k}", 0, junk)
    for _ in range(3):
        me.heartbeat()
        me.refresh()
        assert "friend" in me.feed.peers and len(me.feed.peers) == 4
    assert me.drops["peers_not_read"] == 3 * 8
    assert 3 <= me.drops["sampling_mismatch"] <= 9  # each junk name drawn is read once (3 per round)


def test_the_pool_keeps_at_most_its_cap_of_the_newest_uploads():
    from pnyx.swarm.sample import Pool

    pool = Pool(window_s=1e9, recent_per_peer=100, max_items=3)
    cands = []
    for k in range(5):
        g = text_group(f"p{k}", 0, "arith/train/0/1", [f"{k}", "x"], [0.0, 0.0])
        cands.append(foreign.Candidate(f"swarm/p{k}/0", f"p{k}", g, [0.0, 0.0], float(k), 0))
    pool.add(cands)
    assert [c.peer for c in pool.candidates()] == ["p2", "p3", "p4"]


def test_a_record_under_a_bound_name_signed_by_another_key_is_id_theft(model_a, tmp_path):
    """A node's records are signed by its key and a peer's name is bound to the key of the first record
    taken from it (kept across a resume): a valid record under alice's name signed by another key is
    `id_theft`, an unsigned one `unsigned`, and neither reaches the pool; at alice's own next seq, such a
    record is skipped by alice (`seq_taken`), not taken for a twin of hers."""
    store = open_store(str(tmp_path))
    alice = open_test_node(store, "alice", swarm_cfg(local_groups=2, external_groups=0), model_a)
    me = open_test_node(store, "me", swarm_cfg(local_groups=1, external_groups=4), model_a)
    alice.round()
    me.heartbeat()
    assert me.refresh() == 2 and me.feed.keys == {"alice": alice.signer.fingerprint}
    forged = decode_swarm_group(store.get(layout.swarm_key("alice", 0)))
    forged.seq = alice.seq
    store.put(layout.swarm_key("alice", alice.seq), signed(forged, "mallory"), mode="create")
    forged.seq = alice.seq + 1
    store.put(layout.swarm_key("alice", alice.seq + 1), encode_swarm_group(forged), mode="create")
    alice.round()  # skips both taken seqs, uploads its two groups after them
    assert alice.drops["seq_taken"] == 2 and alice.uploaded == 4
    me.heartbeat()
    assert me.refresh() == 2  # alice's own new groups
    assert me.drops["id_theft"] == 1 and me.drops["unsigned"] == 1
    assert {c.group.node for c in me.pool.candidates()} == {"alice"}
    me.checkpoint()
    again = open_test_node(store, "me", swarm_cfg(local_groups=1, external_groups=4), model_a)
    assert again.feed.keys == {"alice": alice.signer.fingerprint}
