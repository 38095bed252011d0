"""Whose signatures count: the trainer's key recorded in run.json, pinned by each worker.

- The trainer loads (or creates) its key (`trainer_signer`), records the public half in run.json when it
  creates the run (`trainer_key_record`), and on resume refuses to continue with a key that is not the
  run's (`check_trainer_key`): its manifests would be invisible to every worker.
- A worker pins the trainer's key (`pin_trainer`): with `--trust <fingerprint>` run.json's key must have
  that fingerprint; without it, the first join of a run on this machine trusts run.json's key (trust on
  first use: the fingerprint is logged and remembered in `<keys dir>/trusted/<run id>`), and every later
  join of that run must see the same key. A run whose run.json names no key is refused: its weights are
  unsigned.

Knows nothing about the store or weights; run manifests are passed in.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from pnyx.errors import ConfigError
from pnyx.protocol import layout
from pnyx.protocol.records import RunManifest, TrainerKey
from pnyx.security.keys import (
    default_keys_dir,
    default_trainer_key_path,
    load_or_create_key,
    normalize_fingerprint,
)
from pnyx.security.signing import Signer, Verifier

log = logging.getLogger("pnyx.security")

TRUSTED_DIR = "trusted"
"""Folder under the keys dir holding one pinned trainer fingerprint per run id."""


def trainer_signer(path: str | Path | None = None) -> Signer:
    """The trainer's signer from its key file (`keys.default_trainer_key_path()` unless given), created on
    first use. Not yet bound to a run (`Signer.for_run`)."""
    path = Path(path) if path is not None else default_trainer_key_path()
    key, created = load_or_create_key(path)
    signer = Signer(key)
    if created:
        log.info(
            "trainer: created signing key %s (fingerprint %s); keep it to resume", path, signer.fingerprint
        )
    return signer


def trainer_key_record(signer: Signer) -> TrainerKey:
    """The `TrainerKey` run.json records for `signer`."""
    return TrainerKey(public=signer.public_hex, fingerprint=signer.fingerprint)


def run_verifier(run: RunManifest) -> Verifier:
    """The verifier of the key named in run manifest `run`, bound to its run id. ConfigError if run.json
    names no key (an unsigned run) or a malformed one."""
    key = getattr(run, "trainer_key", None)
    if key is None:
        raise ConfigError(
            f"run {run.run_id} names no trainer key in run.json: its weights are unsigned and a worker "
            "cannot tell them from forged ones. Start a new run with this version of pnyx."
        )
    try:
        verifier = Verifier.from_hex(key.public, run.run_id)
    except ValueError as e:
        raise ConfigError(
            f"run {run.run_id}: run.json's trainer_key.public is not an Ed25519 key ({e})"
        ) from None
    if key.algorithm != "ed25519" or verifier.fingerprint != key.fingerprint:
        raise ConfigError(
            f"run {run.run_id}: run.json's trainer key is inconsistent (algorithm {key.algorithm!r}, "
            f"fingerprint {key.fingerprint!r} for a key whose fingerprint is {verifier.fingerprint})"
        )
    return verifier


def check_trainer_key(run: RunManifest, signer: Signer, where: str) -> None:
    """ConfigError unless `signer` holds the key run.json names (a resumed or second trainer)."""
    verifier = run_verifier(run)
    if verifier.fingerprint != signer.fingerprint:
        raise ConfigError(
            f"the run at {where} is signed by trainer key {verifier.fingerprint}, but this trainer's key is "
            f"{signer.fingerprint} ({default_trainer_key_path()}). Workers follow only the run's key: copy "
            "the original key file here, or point PNYX_TRAINER_KEY at it."
        )


def pin_trainer(run: RunManifest, trust: str | None = None, keys_dir: str | Path | None = None) -> Verifier:
    """The trainer key a worker follows (see the module docstring). ConfigError on a mismatch."""
    verifier = run_verifier(run)
    fp = verifier.fingerprint
    if trust is not None:
        want = normalize_fingerprint(trust)
        if want != fp:
            raise ConfigError(
                f"refusing to join run {run.run_id}: --trust {want} was given, but its run.json names trainer "
                f"key {fp}. Either the store URL is not the run you meant, or someone replaced run.json."
            )
        log.info("worker: trainer key %s pinned by --trust", fp)
        return verifier
    pin = Path(keys_dir).expanduser() if keys_dir is not None else default_keys_dir()
    pin = pin / TRUSTED_DIR / layout.check_name(run.run_id, "run id")
    try:
        known = pin.read_text().strip()
    except FileNotFoundError:
        known = None
    if known is None:
        pin.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = pin.with_name(f".{pin.name}.{os.getpid()}")
        tmp.write_text(fp + "\n")
        os.replace(tmp, pin)
        log.warning(
            "worker: trusting trainer key %s of run %s on first use (from run.json); pin it with --trust %s",
            fp, run.run_id, fp,
        )  # fmt: skip
        return verifier
    if known != fp:
        raise ConfigError(
            f"refusing to join run {run.run_id}: its run.json now names trainer key {fp}, but this machine "
            f"first joined it under key {known} ({pin}). Someone may have replaced run.json. If the trainer "
            f"really changed keys, check with its operator, then delete {pin} or pass --trust."
        )
    log.info("worker: trainer key %s (pinned at first join, %s)", fp, pin)
    return verifier


def run_trust(run: RunManifest, trust: str | None = None) -> Verifier:
    """For tools an operator runs (`pnyx weights`, `pnyx export`): run.json's key, which must have the
    fingerprint `trust` when given. Pins nothing. ConfigError for an unsigned run or a mismatch."""
    verifier = run_verifier(run)
    if trust is not None and normalize_fingerprint(trust) != verifier.fingerprint:
        raise ConfigError(
            f"run {run.run_id}'s run.json names trainer key {verifier.fingerprint}, not the "
            f"{normalize_fingerprint(trust)} given with --trust: refusing to treat its weights as the trainer's"
        )
    return verifier
