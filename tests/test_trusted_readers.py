"""Every reader of a run's weights reads only versions the run's trainer key signed.

A small real run (run.json written by the trainer's `init_run` with its key, v0 and v1 published signed by
the real PULSE publisher, the tiny model), then the forgeries anyone holding a store write token can make
with pnyx's public API and a fresh key: (1) a higher version published under another key, (2) an unsigned
`manifest.json` with other weights beside (or instead of) the trainer's manifest of v1, (3) 4 KiB of random
bytes as a far-future version's `manifest.json`. `pnyx eval --store` (in process), `pnyx run`'s lookups,
its evaluator (`EvalLoop`/`VersionEvaluator`), its live view (`RunWatcher`) and `pnyx status` must read the
trainer's v1 and say what they skipped; asking for a forged version explicitly is an error.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from typer.testing import CliRunner
from worker_support import TinyRun, make_run

from pnyx.errors import UntrustedWeightsError
from pnyx.protocol import RunManifest, encode_json, layout
from pnyx.protocol.runfile import read_run
from pnyx.security.signing import Signer
from pnyx.store import open_store
from pnyx.weights import Publisher, read_manifest

FORGED_STATE = 77  # the seed of the forger's weights (TinyRun.state): not any version the trainer made
FAR = 99_999_999


@pytest.fixture(scope="module")
def signed_run(tmp_path_factory, tiny_model_dir) -> TinyRun:
    """v0 and v1 of a signed tiny run, made once; each test forges a copy of its folder (`run_dir`)."""
    run = make_run(str(tmp_path_factory.mktemp("trusted") / "run"), tiny_model_dir)
    run.publish(1)
    return run


@pytest.fixture
def run_dir(signed_run, tmp_path) -> Path:
    return Path(shutil.copytree(signed_run.store.local_path, tmp_path / "run"))


def _forge_higher_version(store: Any, run: TinyRun, version: int = 2) -> None:
    """(1) `version` published into the run under a fresh key: a valid anchor, a HEAD signed by that key."""
    run_id = read_run(store).run_id
    forger = Publisher(store, signer=Signer(Ed25519PrivateKey.generate(), run_id), nonce="f0f0f0f0")
    forger.publish(version, run.state(FORGED_STATE))


def _forge_unsigned_manifest(store: Any, run: TinyRun, version: int = 1, replace: bool = False) -> None:
    """(2) an unsigned publisher's `manifest.json` (and payload) of other weights at `version`, beside the
    trainer's signed manifest, or instead of it (`replace`: the trainer's manifest deleted)."""
    shadow = open_store("memory://")
    Publisher(shadow, nonce="0badf00d").publish(version, run.state(FORGED_STATE))
    genuine = [m.key for m in store.list(layout.weights_manifest_candidates(version))]
    for meta in shadow.list(layout.weights_dir(version)):
        store.put(meta.key, shadow.get(meta.key))
    if replace:
        for key in genuine:
            store.delete(key)


def _forge_junk(store: Any) -> None:
    """(3) random bytes as a far-future version's manifest."""
    store.put(layout.weights_manifest(FAR), os.urandom(4096))


def _eval(url: Path, *args: str, tmp_path: Path) -> tuple[int, str, dict[str, Any] | None]:
    """`pnyx eval --store URL ARGS --tasks 8` in this process: (exit code, output, the --out JSON)."""
    from pnyx.cli import app

    out = tmp_path / "eval.json"
    result = CliRunner().invoke(app, ["eval", "--store", str(url), "--tasks", "8", "--out", str(out), *args])
    return result.exit_code, result.output, json.loads(out.read_text()) if out.exists() else None


def test_eval_store_evaluates_the_trainers_newest_version_beside_a_higher_forged_one(
    signed_run, run_dir, tmp_path, caplog
):
    _forge_higher_version(open_store(run_dir), signed_run)
    code, output, report = _eval(run_dir, tmp_path=tmp_path)
    assert code == 0, output
    assert report is not None and report["version"] == 1 and report["digest"] == signed_run.digests[1]
    assert "ignoring v2" in caplog.text and "not signed by the trainer key" in caplog.text


def test_eval_store_version_of_a_version_another_key_signed_fails_clearly(signed_run, run_dir, tmp_path):
    _forge_higher_version(open_store(run_dir), signed_run)
    code, output, report = _eval(run_dir, "--version", "2", tmp_path=tmp_path)
    assert code == 1 and report is None
    assert "refusing to evaluate" in output and "not the trainer's" in output
    assert "newest version the trainer signed is v1" in output


def test_eval_store_version_reads_the_trainers_manifest_not_an_unsigned_one_beside_it(
    signed_run, run_dir, tmp_path, caplog
):
    _forge_unsigned_manifest(open_store(run_dir), signed_run)
    code, output, report = _eval(run_dir, "--version", "1", tmp_path=tmp_path)
    assert code == 0, output
    assert report is not None and report["version"] == 1 and report["digest"] == signed_run.digests[1]
    assert "ignoring v1" in caplog.text and "unsigned manifest.json" in caplog.text


def test_eval_store_version_whose_manifest_was_replaced_by_an_unsigned_one_fails(
    signed_run, run_dir, tmp_path
):
    _forge_unsigned_manifest(open_store(run_dir), signed_run, replace=True)
    code, output, report = _eval(run_dir, "--version", "1", tmp_path=tmp_path)
    assert code == 1 and report is None
    assert "refusing to evaluate" in output and "unsigned manifest.json" in output


def test_eval_store_ignores_junk_as_a_far_future_manifest(signed_run, run_dir, tmp_path, caplog):
    _forge_junk(open_store(run_dir))
    code, output, report = _eval(run_dir, tmp_path=tmp_path)
    assert code == 0, output
    assert report is not None and report["version"] == 1 and report["digest"] == signed_run.digests[1]
    assert f"ignoring v{FAR}" in caplog.text


def test_eval_store_refuses_a_trust_fingerprint_that_is_not_the_runs_key(run_dir, tmp_path):
    code, output, report = _eval(run_dir, "--trust", "ab" * 16, tmp_path=tmp_path)
    assert code == 2 and report is None
    assert "--trust" in output and "names trainer key" in output


def test_eval_store_refuses_an_unsigned_run_as_export_does(tmp_path):
    import torch

    store = open_store(tmp_path / "run")
    run = RunManifest(run_id="old", created_at=time.time(), config={"env": {"name": "arith"}}, model={})
    store.put(layout.RUN_MANIFEST, encode_json(run), mode="create")
    Publisher(store).publish(0, {"w": torch.zeros(4, 4, dtype=torch.bfloat16)})
    code, output, report = _eval(tmp_path / "run", tmp_path=tmp_path)
    assert code == 2 and report is None and "unsigned" in output


def test_the_run_watchers_version_ignores_every_forgery(signed_run, run_dir):
    from pnyx.cli.live import RunWatcher
    from pnyx.cli.live_view import ignored_versions, plain_line

    store = open_store(run_dir)
    _forge_higher_version(store, signed_run)
    _forge_unsigned_manifest(store, signed_run)
    _forge_junk(store)
    snap = RunWatcher(store).snapshot()
    assert snap.version == 1
    assert ignored_versions(snap) == [1, 2, FAR]  # the live view lists what it did not read
    assert "v=1 " in plain_line(snap) and f"ignored=v1,v2,v{FAR}" in plain_line(snap)


def test_status_command_shows_the_trainers_version_and_the_ignored_manifests(signed_run, run_dir):
    from pnyx.cli import app

    store = open_store(run_dir)
    _forge_higher_version(store, signed_run)
    _forge_junk(store)
    result = CliRunner().invoke(app, ["status", "--store", str(run_dir)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    version_row = next(line for line in lines if line.strip("│ ").startswith("version"))
    assert version_row.split("│")[2].strip() == "1"
    assert f"2 manifests not signed by the trainer key, never read: v2, v{FAR}" in result.output


def test_status_refuses_a_trust_fingerprint_that_is_not_the_runs_key(run_dir):
    from pnyx.cli import app

    result = CliRunner().invoke(app, ["status", "--store", str(run_dir), "--trust", "ab" * 16])
    assert result.exit_code == 2 and "names trainer key" in result.output


def test_status_of_an_unsigned_run_says_its_versions_are_unchecked(tmp_path):
    import torch

    from pnyx.cli.live import UNSIGNED_NOTE, RunWatcher

    store = open_store(tmp_path / "run")
    run = RunManifest(run_id="old", created_at=time.time(), config={"env": {"name": "arith"}}, model={})
    store.put(layout.RUN_MANIFEST, encode_json(run), mode="create")
    Publisher(store).publish(0, {"w": torch.zeros(4, 4, dtype=torch.bfloat16)})
    snap = RunWatcher(store).snapshot()
    assert snap.version == 0 and snap.note == UNSIGNED_NOTE


def test_pnyx_runs_version_lookup_waits_for_run_json_and_ignores_forgeries(signed_run, run_dir, tmp_path):
    from pnyx.weights import trusted_latest

    assert trusted_latest(open_store(tmp_path / "empty")) is None  # before the trainer creates the run
    store = open_store(run_dir)
    _forge_higher_version(store, signed_run)
    _forge_junk(store)
    assert trusted_latest(store) == 1


def test_the_eval_loop_refuses_a_version_the_trainer_did_not_sign(
    signed_run, run_dir, tmp_path, tiny_model_dir
):
    from pnyx.eval.runner import EvalLoop, VersionEvaluator

    store = open_store(run_dir)
    _forge_higher_version(store, signed_run)
    assert read_manifest(store, 2).version == 2  # a reader without the key would take it
    loop = EvalLoop(
        lambda: VersionEvaluator(store, tiny_model_dir, "arith", tasks=2, max_new_tokens=2),
        tmp_path / "evals.jsonl",
        "arith",
        every=10,
        observed={},
        t0=0.0,
    )
    with pytest.raises(UntrustedWeightsError, match="not the trainer's"):
        loop.final(2, threads=1)
    assert loop.records == [] and not (tmp_path / "evals.jsonl").exists()
