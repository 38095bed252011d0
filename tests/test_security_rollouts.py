"""Signed rollouts: the trainer checks who signed each group before decoding it, binds worker names to
keys, and counts per key. Real stores (tmp folders), the real ingestor, real Ed25519 keys."""

from __future__ import annotations

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from ingest_support import ENV, RUN, detok, make_group

from pnyx.errors import RecordRejected
from pnyx.protocol import layout
from pnyx.protocol.codec import SIGNED_HEADER_SIZE, decode_group, encode_group, frame_signer
from pnyx.security.keys import fingerprint, load_or_create_key, worker_key_path
from pnyx.security.signing import Signer
from pnyx.store import open_store
from pnyx.train.ingest import Cursor, Ingestor, IngestSettings

HONEST, THIEF = Signer(Ed25519PrivateKey.generate()), Signer(Ed25519PrivateKey.generate())


def _ingestor(store, **kw) -> Ingestor:
    return Ingestor(
        store=store, env=ENV, detokenize=detok, settings=IngestSettings(), run_id=RUN, require_signatures=True,
        sweep_grace_s=0.0, **kw,
    )  # fmt: skip


def _put(store, group, signer: Signer | None, data: bytes | None = None) -> str:
    key = layout.rollout_key(group.policy_version, group.worker_id, group.seq)
    store.put(key, data if data is not None else encode_group(group, signer=signer), mode="create")
    return key


def test_signed_frame_round_trips_and_names_its_signer():
    group = make_group(0, "w1", 0)
    data = encode_group(group, signer=HONEST)
    assert frame_signer(data) == HONEST.public_raw
    assert decode_group(data) == group


def test_tampered_group_is_rejected_as_bad_signature_before_decoding(tmp_path):
    """A worker (or anyone who can write the key) changes a signed group and fixes its xxh3 digest: only
    the signature notices."""
    store = open_store(tmp_path / "s")
    honest = encode_group(make_group(0, "w1", 0), signer=HONEST)
    forged = make_group(0, "w1", 0, answers=["7", "8"], claimed=[1.0, 0.0])
    body = encode_group(forged)  # unsigned frame of the altered record, with a correct digest
    tampered = body[:4] + bytes([2]) + body[5:21] + honest[21:SIGNED_HEADER_SIZE] + body[21:]
    assert decode_group(tampered) == forged  # structurally valid: the digest matches the new payload
    key = _put(store, forged, None, tampered)
    ing = _ingestor(store)
    ing.poll(0)
    assert ing.cursor.rejected == {key: "bad_signature"}
    with pytest.raises(RecordRejected, match="bad_signature"):
        frame_signer(tampered)


def test_unsigned_group_is_rejected(tmp_path):
    store = open_store(tmp_path / "s")
    key = _put(store, make_group(0, "w1", 0), None)
    ing = _ingestor(store)
    ing.poll(0)
    assert ing.cursor.rejected == {key: "unsigned"} and ing.cursor.drops == {"unsigned": 1}


def test_id_thief_claiming_a_bound_name_is_rejected_and_counted_against_its_key(tmp_path):
    store = open_store(tmp_path / "s")
    honest = _put(store, make_group(0, "w1", 0), HONEST)
    ing = _ingestor(store)
    assert ing.poll(0) == 1
    stolen = _put(store, make_group(0, "w1", 1, task_index=1), THIEF)  # the honest worker's name, other key
    own = _put(store, make_group(0, "t1", 0, task_index=2), THIEF)  # the thief under a name of its own: fine
    assert ing.poll(0) == 2
    assert ing.cursor.rejected == {stolen: "id_theft"}
    assert ing.cursor.keys == {"w1": HONEST.fingerprint, "t1": THIEF.fingerprint}
    assert ing.cursor.by_key[THIEF.fingerprint].get("id_theft") == 1
    ing.commit([honest, own])
    assert ing.cursor.by_key[HONEST.fingerprint]["groups"] == 1
    assert ing.cursor.by_key[THIEF.fingerprint]["groups"] == 1


def test_name_bindings_survive_a_restart_in_the_cursor(tmp_path):
    store = open_store(tmp_path / "s")
    ing = _ingestor(store)
    _put(store, make_group(0, "w1", 0), HONEST)
    ing.poll(0)
    saved = Cursor.from_json(ing.cursor_json())
    stolen = _put(store, make_group(0, "w1", 1, task_index=1), THIEF)
    resumed = _ingestor(store, cursor=saved)
    resumed.poll(0)
    assert resumed.cursor.rejected.get(stolen) == "id_theft"


def test_invalid_groups_do_not_bind_a_name(tmp_path):
    """A thief cannot claim a name ahead of its owner with groups the trainer would refuse anyway."""
    store = open_store(tmp_path / "s")
    junk = msgspec.structs.replace(make_group(0, "w1", 0), run_id="another-run")
    _put(store, junk, THIEF)
    ing = _ingestor(store)
    ing.poll(0)
    assert "w1" not in ing.cursor.keys
    assert ing.cursor.by_key[THIEF.fingerprint] == {"run_mismatch": 1}
    _put(store, make_group(0, "w1", 1, task_index=1), HONEST)
    assert ing.poll(0) == 1 and ing.cursor.keys["w1"] == HONEST.fingerprint


def test_worker_key_file_is_created_once_and_reused(tmp_path):
    path = worker_key_path(tmp_path / "keys")
    key, created = load_or_create_key(path)
    again, created_again = load_or_create_key(path)
    assert created and not created_again
    assert fingerprint(key) == fingerprint(again) and oct(path.stat().st_mode & 0o777) == "0o600"


def test_worker_signs_every_group_it_uploads(tmp_path, tiny_model_dir):
    import torch
    from worker_support import make_run

    from pnyx.rollout.worker import Worker, WorkerOptions

    torch.set_num_threads(1)
    run = make_run(str(tmp_path / "run"), tiny_model_dir)
    keys = tmp_path / "keys"
    Worker(run.store, WorkerOptions(worker_id="w1", max_groups=2, keys_dir=str(keys))).run()
    expected = fingerprint(load_or_create_key(worker_key_path(keys))[0])
    frames = [run.store.get(m.key) for m in run.store.list(layout.ROLLOUTS_PREFIX)]
    assert len(frames) == 2 and {fingerprint(frame_signer(d)) for d in frames} == {expected}
    hb = msgspec.json.decode(run.store.get(layout.worker_heartbeat("w1")))
    assert hb["key"] == expected


# --- sampling settings and budget against run.json ------------------------------------------------------


def _sampling_ingestor(store, **sampling) -> Ingestor:
    settings = IngestSettings(
        **({"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 32} | sampling)
    )
    return Ingestor(store=store, env=ENV, detokenize=detok, settings=settings, run_id=RUN, sweep_grace_s=0.0)


def test_groups_claiming_other_sampling_settings_are_dropped_as_sampling_mismatch(tmp_path):
    store = open_store(tmp_path / "s")
    honest = _put(store, make_group(0, "w1", 0), None)
    liar = _put(store, msgspec.structs.replace(make_group(0, "w2", 0, task_index=1), temperature=0.3), None)
    top_k = _put(store, msgspec.structs.replace(make_group(0, "w3", 0, task_index=2), top_k=20), None)
    ing = _sampling_ingestor(store)
    assert ing.poll(0) == 1
    assert ing.cursor.rejected == {liar: "sampling_mismatch", top_k: "sampling_mismatch"}
    assert honest not in ing.cursor.rejected


def test_a_model_turn_longer_than_the_budget_is_dropped_but_tool_tokens_split_turns(tmp_path):
    store = open_store(tmp_path / "s")
    long = _put(store, make_group(0, "w1", 0), None)
    split = make_group(0, "w2", 0)  # the same completions, as two model turns around one tool token
    for s in split.samples:
        half = len(s.tokens) // 2
        s.loss_mask = [1] * half + [0] + [1] * (len(s.tokens) - half - 1)
        s.logprobs = [lp if m else 0.0 for lp, m in zip(s.logprobs, s.loss_mask, strict=True)]
    two_turns = _put(store, split, None)
    longest = max(len(s.tokens) for s in split.samples)
    budget = longest - 2  # below one whole completion, above each of its halves
    assert (longest + 1) // 2 <= budget < longest - 1  # counting all model tokens would drop both groups
    ing = _sampling_ingestor(store, max_new_tokens=budget)
    ing.poll(0)
    assert ing.cursor.rejected == {long: "over_budget"}
    assert two_turns not in ing.cursor.rejected


def test_the_trainer_checks_the_sampling_settings_of_its_run(tmp_path):
    from pnyx.config import load_config
    from pnyx.train.settings import ingest_settings

    cfg = load_config(
        overrides={"worker": {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "max_new_tokens": 64}}
    )
    s = ingest_settings(cfg)
    assert (s.temperature, s.top_p, s.top_k, s.max_new_tokens) == (0.7, 0.9, 40, 64)
