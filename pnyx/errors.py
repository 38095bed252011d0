"""The pnyx error hierarchy, named for what the caller can do about each error.

Knows nothing about any backend or model. Every pnyx error subclasses `PnyxError`; store errors also
subclass the builtin the caller would expect (`NotFoundError` is a `FileNotFoundError`, `ConfigError`
and `RecordRejected` are `ValueError`s), so ordinary `except` clauses keep working.
"""

from __future__ import annotations


class PnyxError(Exception):
    """Base class of every error pnyx raises on purpose."""


class ConfigError(PnyxError, ValueError):
    """The configuration is invalid: fix the named field and retry."""


# --- object store ---------------------------------------------------------------------------------


class EnvOptionsError(ConfigError):
    """An environment's constructor does not take an option it was given (the message names those it does)."""


class StoreError(PnyxError):
    """Something went wrong talking to the object store."""


class NotFoundError(StoreError, FileNotFoundError):
    """The object does not exist. Never retried: the caller decides (wait, re-list, re-anchor)."""


class AlreadyExistsError(StoreError):
    """A create-only put found the key already present: another writer won. Never retried."""


class PreconditionError(StoreError):
    """A compare-and-swap put found a different ETag: re-read and decide again. Never retried."""


class UnsupportedError(StoreError):
    """The backend cannot do this operation (e.g. compare-and-swap on a local folder)."""


class StoreUnavailableError(StoreError):
    """Transient errors persisted past the retry deadline: the store is down or throttling. Try later."""


class StorePermissionError(StoreError, PermissionError):
    """Credentials are missing or do not allow this operation: fix credentials or bucket policy."""


# --- records and weights ----------------------------------------------------------------------


class RecordRejected(PnyxError, ValueError):
    """A wire record failed validation (schema, size, ranges, digest). Drop it and count the reason."""

    signer: str = ""
    """Fingerprint of the key that signed the record, when known (the drop counts against that key)."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        super().__init__(f"{reason}: {detail}" if detail else reason)


class IntegrityError(PnyxError):
    """Downloaded weights do not match their manifest or hash chain. Keep the current weights; re-fetch."""


class UntrustedWeightsError(IntegrityError):
    """The weights asked for are not the trainer's: no manifest of that version is signed by the run's
    trainer key (unsigned, another key's, junk, or altered). Never use them: pick a version the trainer
    signed, and check who can write to the store (docs/security.md)."""


class FencedError(PnyxError):
    """Another trainer already published this version: this process does not own the run. Stop."""


class ModelNotFoundError(PnyxError, FileNotFoundError):
    """The model folder does not exist locally (pnyx never downloads at run time)."""


class EnvironmentNotFound(PnyxError, KeyError):
    """No environment is registered under that name."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class PeerFailedError(PnyxError):
    """Another process of a distributed trainer failed during a collective step: its log names the cause.
    Stop this one too and resume the run (`--resume`)."""
