"""Signed weights: workers follow only what the trainer's key signed; squatters cannot fence the trainer.

Real stores (tmp folders), the real PULSE publisher and syncer, real Ed25519 keys. A forger here is as
strong as the threat model allows: it can write any key and build a manifest that chains correctly onto
the trainer's history; it lacks only the trainer's private key.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pnyx.errors import ConfigError, FencedError, IntegrityError
from pnyx.protocol import layout
from pnyx.security.signing import Signer, Verifier
from pnyx.store import open_store
from pnyx.train.bootstrap import init_run
from pnyx.weights.manifest import latest_version, read_manifest
from pnyx.weights.publisher import Publisher
from pnyx.weights.syncer import Syncer
from pnyx.weights.trust import check_trainer_key, pin_trainer, trainer_key_record

RUN = "run-sec"


def _state(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {"w": torch.randn(64, 32, generator=g).to(torch.bfloat16), "b": torch.randn(32, generator=g)}


def _signer() -> Signer:
    return Signer(Ed25519PrivateKey.generate(), RUN)


def _same(tensors: dict[str, torch.Tensor], version: int) -> bool:
    want = _state(version)
    return all(torch.equal(tensors[k], want[k]) for k in want)


def _forgery() -> tuple[object, str]:
    """(the forger's own store, its v1 manifest key): v0 and v1 published by another key. Its v0 has the
    trainer's v0 bits, so its v1 chains exactly onto the trainer's v0."""
    shadow = open_store("memory://")
    forger = Publisher(shadow, signer=_signer(), nonce="f0f0f0f0")
    forger.publish(0, _state(0))
    forger.publish(1, _state(1))
    return shadow, next(m.key for m in shadow.list(layout.weights_dir(1)) if "manifest" in m.key)


def _plant_forged_v1(store, trainer: Signer) -> None:
    """Copy the forger's v1 (payload and manifest) into the run."""
    shadow, key = _forgery()
    for meta in shadow.list(layout.weights_dir(1)):
        store.put(meta.key, shadow.get(meta.key))
    assert read_manifest(shadow, 1).weights.parent_digest == read_manifest(store, 0, trainer.verifier).digest


def test_signed_manifests_are_named_by_the_trainer_key_and_followed(tmp_path):
    store = open_store(tmp_path / "s")
    trainer = _signer()
    pub = Publisher(store, anchor_every=2, signer=trainer)
    for v in range(3):
        pub.publish(v, _state(v))
    keys = [m.key for m in store.list(layout.weights_dir(2))]
    assert layout.signed_weights_manifest(2, trainer.manifest_tag(2)) in keys
    version, tensors = Syncer(store, trust=trainer.verifier).sync()
    assert version == 2 and _same(tensors, 2)


def test_forged_chained_manifest_under_another_key_is_never_followed(tmp_path):
    store = open_store(tmp_path / "s")
    trainer = _signer()
    Publisher(store, signer=trainer).publish(0, _state(0))
    syncer = Syncer(store, trust=trainer.verifier, backoff_s=0)
    assert syncer.sync()[0] == 0
    _plant_forged_v1(store, trainer)
    # The forgery is a valid chain: a reader that checks digests only follows it.
    assert Syncer(store).sync()[0] == 1
    # The pinned reader does not even see it, and keeps serving v0.
    assert latest_version(store, trainer.verifier) == 0
    assert syncer.prefetch_once() is None and syncer.swap() is None
    version, tensors = syncer.sync()
    assert version == 0 and _same(tensors, 0)


def test_overwritten_genuine_manifest_fails_closed_and_keeps_the_last_good_version(tmp_path):
    store = open_store(tmp_path / "s")
    trainer = _signer()
    pub = Publisher(store, signer=trainer)
    pub.publish(0, _state(0))
    syncer = Syncer(store, trust=trainer.verifier, backoff_s=0)
    syncer.sync()
    pub.publish(1, _state(1))
    genuine = layout.signed_weights_manifest(1, trainer.manifest_tag(1))
    shadow, forged = _forgery()
    store.put(
        genuine, shadow.get(forged)
    )  # a store where workers can overwrite (R2): the name is right, the content not
    with pytest.raises(IntegrityError, match="wrongly signed"):
        syncer.sync()
    assert syncer.version == 0 and _same(syncer.tensors, 0)


def test_unsigned_manifests_are_refused(tmp_path):
    store = open_store(tmp_path / "s")
    trainer = _signer()
    pub = Publisher(store, signer=trainer)
    pub.publish(0, _state(0))
    syncer = Syncer(store, trust=trainer.verifier, backoff_s=0)
    syncer.sync()
    # an unsigned publisher continuing the same chain at the unsigned name: invisible
    unsigned = Publisher(store)
    unsigned._state, unsigned.version, unsigned.anchor_version = pub._state, 0, 0
    unsigned._digest = pub._digest
    unsigned.publish(1, _state(1))
    assert Syncer(store).sync()[0] == 1  # a digest-only reader follows it
    assert latest_version(store, trainer.verifier) == 0
    # the same unsigned content at the trainer's own name: refused, v0 still served
    pub.publish(1, _state(1))
    store.put(
        layout.signed_weights_manifest(1, trainer.manifest_tag(1)), store.get(layout.weights_manifest(1))
    )
    with pytest.raises(IntegrityError, match="not signed"):
        syncer.sync()
    assert syncer.version == 0 and _same(syncer.tensors, 0)


def _squat(store) -> None:
    junk = b'{"schema": 1, "version": 1}'
    store.put(layout.weights_manifest(1), junk, mode="create")
    store.put(layout.signed_weights_manifest(1, "ab" * 64), junk, mode="create")
    store.put(layout.weights_manifest(99), junk, mode="create")
    store.put(layout.WEIGHTS_HEAD, b'{"version": 99, "digest": "x", "signature": ""}')


def test_squatted_future_versions_do_not_block_the_trainer_or_its_workers(tmp_path):
    store = open_store(tmp_path / "s")
    trainer = _signer()
    pub = Publisher(store, signer=trainer)
    pub.publish(0, _state(0))
    _squat(store)
    pub.publish(1, _state(1))
    pub.publish(2, _state(2))
    version, tensors = Syncer(store, trust=trainer.verifier).sync()
    assert version == 2 and _same(tensors, 2)
    # a restarted trainer (same key) picks up after its own v2, not after the squatter's v99
    again = Publisher(store, signer=trainer)
    again.publish(3, _state(3))
    assert latest_version(store, trainer.verifier) == 3


def test_the_same_squat_fences_an_unsigned_publisher(tmp_path):
    """Why the names are signed: with fixed names the squat above stops the trainer."""
    store = open_store(tmp_path / "s")
    pub = Publisher(store)
    pub.publish(0, _state(0))
    _squat(store)
    with pytest.raises(FencedError):
        pub.publish(1, _state(1))


def test_a_second_trainer_with_the_same_key_is_still_fenced(tmp_path):
    store = open_store(tmp_path / "s")
    trainer = _signer()
    a, b = Publisher(store, signer=trainer), Publisher(store, signer=trainer)
    a.publish(0, _state(0))
    with pytest.raises(FencedError):
        b.publish(0, _state(0))


def test_manifests_signed_for_another_run_are_not_accepted(tmp_path):
    store = open_store(tmp_path / "s")
    key = Ed25519PrivateKey.generate()
    Publisher(store, signer=Signer(key, "other-run")).publish(0, _state(0))
    assert latest_version(store, Signer(key, RUN).verifier) is None


# --- pinning the trainer key ----------------------------------------------------------------------------


def _run_with_key(tmp_path, signer: Signer | None):
    store = open_store(tmp_path / "run")
    record = trainer_key_record(signer) if signer is not None else None
    return store, init_run(store, {"worker": {}, "env": {}}, {"vocab_size": 10}, record)


def test_trust_with_a_wrong_fingerprint_refuses_to_join(tmp_path):
    signer = _signer()
    _, run = _run_with_key(tmp_path, signer)
    with pytest.raises(ConfigError, match="refusing to join.*--trust"):
        pin_trainer(run, "0" * 32, tmp_path / "keys")
    assert pin_trainer(run, signer.fingerprint.upper(), tmp_path / "keys").fingerprint == signer.fingerprint


def test_first_join_pins_the_key_and_a_changed_run_json_is_refused(tmp_path):
    signer = _signer()
    _, run = _run_with_key(tmp_path, signer)
    assert pin_trainer(run, None, tmp_path / "keys").fingerprint == signer.fingerprint
    assert pin_trainer(run, None, tmp_path / "keys").fingerprint == signer.fingerprint  # same key: fine
    import msgspec

    swapped = msgspec.structs.replace(run, trainer_key=trainer_key_record(_signer()))
    with pytest.raises(ConfigError, match="first joined it under key"):
        pin_trainer(swapped, None, tmp_path / "keys")


def test_a_run_without_a_trainer_key_is_refused(tmp_path):
    _, run = _run_with_key(tmp_path, None)
    with pytest.raises(ConfigError, match="unsigned"):
        pin_trainer(run, None, tmp_path / "keys")


def test_a_resumed_trainer_with_another_key_is_refused(tmp_path):
    _, run = _run_with_key(tmp_path, _signer())
    with pytest.raises(ConfigError, match="PNYX_TRAINER_KEY"):
        check_trainer_key(run, _signer(), "here")


def test_worker_command_with_a_wrong_trust_exits_with_a_clear_error(tmp_path):
    from worker_support import child_env

    store, _ = _run_with_key(tmp_path, _signer())
    cmd = [sys.executable, "-m", "pnyx", "worker", "--store", str(tmp_path / "run"), "--trust", "ab" * 16]
    done = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "refusing to join" in done.stderr and "--trust" in done.stderr


def test_weights_verify_reports_forged_manifests_and_export_refuses_unsigned_runs(tmp_path):
    from typer.testing import CliRunner

    from pnyx.cli.export import export_run
    from pnyx.cli.weights import app

    key = _signer()
    store, run = _run_with_key(tmp_path, key)
    trainer = key.for_run(run.run_id)
    Publisher(store, signer=trainer).publish(0, _state(0))
    url = str(tmp_path / "run")
    assert CliRunner().invoke(app, ["verify", "--store", url]).exit_code == 0
    store.put(layout.weights_manifest(1), b"{}")
    r = CliRunner().invoke(app, ["verify", "--store", url])
    assert r.exit_code == 1 and "not signed by the trainer key" in r.output

    unsigned_store, _ = _run_with_key(tmp_path / "u", None)
    Publisher(unsigned_store).publish(0, _state(0))
    with pytest.raises(ConfigError, match="unsigned"):
        export_run(unsigned_store, tmp_path / "out")


def test_name_tags_are_deterministic_and_unforgeable():
    a, b = _signer(), _signer()
    assert a.manifest_tag(5) == a.manifest_tag(5) != a.manifest_tag(6)
    assert a.verifier.check_tag(5, a.manifest_tag(5))
    assert not a.verifier.check_tag(5, b.manifest_tag(5)) and not a.verifier.check_tag(6, a.manifest_tag(5))
    assert np.frombuffer(bytes.fromhex(a.manifest_tag(5)), np.uint8).size == 64


def test_worker_keeps_generating_from_the_last_signed_version_beside_a_forgery(tmp_path, tiny_model_dir):
    from worker_support import make_run, rollout_groups

    from pnyx.rollout.worker import Worker, WorkerOptions

    torch.set_num_threads(1)
    run = make_run(str(tmp_path / "run"), tiny_model_dir)
    worker = Worker(run.store, WorkerOptions(worker_id="w1", max_groups=4, keys_dir=str(tmp_path / "keys")))
    worker.join()
    real = worker.gen.engine.generate
    calls = [0]

    def generate(prompt_ids, params):
        if calls[0] == 0:  # mid-cohort: a forged v1 that chains onto v0 appears, and the syncer polls it
            shadow = open_store("memory://")
            forger = Publisher(shadow, signer=Signer(Ed25519PrivateKey.generate(), worker.link.run_id))
            forger.publish(0, run.state(0))
            forger.publish(1, run.state(1))
            for meta in shadow.list(layout.weights_dir(1)):
                run.store.put(meta.key, shadow.get(meta.key))
            assert Syncer(run.store).poll() == 1  # a reader without the pinned key would take it
            worker.link.syncer.prefetch_once()
        calls[0] += 1
        return real(prompt_ids, params)

    worker.gen.engine.generate = generate
    summary = worker.run()
    groups = [g for _, g in rollout_groups(run.store)]
    assert len(groups) == 4 and calls[0] >= 2
    assert {(g.policy_version, g.weights_digest) for g in groups} == {(0, run.digests[0])}
    assert summary.versions == [0]


def test_a_signed_cold_join_walks_parents_without_listing_each_version(tmp_path):
    store = open_store(tmp_path / "s")
    trainer = _signer()
    pub = Publisher(store, anchor_every=10, signer=trainer)
    for v in range(6):
        pub.publish(v, _state(v))
    prefixes: list[str] = []
    real = store.list

    def counting(prefix, *args, **kwargs):
        prefixes.append(prefix)
        return real(prefix, *args, **kwargs)

    store.list = counting
    syncer = Syncer(store, trust=Verifier(trainer.verifier.public, RUN))  # a worker's: nothing cached
    version, tensors = syncer.sync()
    assert version == 5 and _same(tensors, 5) and syncer.last_route.kind == "cold"
    assert len(syncer.last_route.steps) == 6  # the anchor v0 and five deltas, each manifest read
    assert not [p for p in prefixes if p.startswith(layout.weights_dir(0)[:-2])]  # no per-version LIST
