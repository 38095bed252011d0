"""The trusted versions of a run: the one lookup every reader of a run's published weights goes through.

`TrustedWeights.open(store, trust)` reads run.json and takes the trainer key it names
(`pnyx.weights.trust.run_trust`: with `trust`, the `--trust` fingerprint of a command, the key must have
it); `for_run` does the same for a run.json already read. With that key only, it answers:

- `latest()`: the newest version the trainer signed (HEAD read only when the trainer signed it);
- `manifest(version)`: that version's manifest, read at the trainer's name and checked against its
  signature: `UntrustedWeightsError` when the store holds manifests of that version but none the trainer
  signed, or the one at the trainer's name does not verify (an overwritten object);
- `resolve(version)`: what a reader asked for: that version once its manifest checks out, or by default
  the newest signed one;
- `syncer()`: a weights `Syncer` that follows and verifies only versions the trainer signed;
- `skipped`: every manifest object the lookups passed over, and why (an unsigned `manifest.json`, a name
  another key or nobody signed); each is also logged once as a warning naming the version.

Its readers: `pnyx eval --store`, `pnyx run`'s evaluations (`VersionEvaluator`), its live view and `pnyx
status` (`RunWatcher`), `pnyx export` and `pnyx weights`. Workers pin the key instead (`pin_trainer`, trust
on first use) and hand the verifier to their Syncer themselves. A run whose run.json names no key (an older
pnyx) is refused by the readers that use the weights (`unsigned="refuse"`: eval, export, verify) and read
unchecked by the views (`unsigned="unchecked"`: status, the live view, `pnyx weights inspect|prune`; then
`signed` is False and nothing is verified), so nobody mistakes unsigned weights for the trainer's.

Knows nothing about RL or torch; run.json is read with `pnyx.protocol.runfile.read_run`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pnyx.errors import ConfigError, IntegrityError, NotFoundError, UntrustedWeightsError
from pnyx.protocol import layout
from pnyx.store import Store
from pnyx.weights.manifest import WeightManifest, ignored_reason, latest_version, read_manifest
from pnyx.weights.syncer import Syncer

if TYPE_CHECKING:
    from pnyx.protocol.records import RunManifest
    from pnyx.security.signing import Verifier

Unsigned = Literal["refuse", "unchecked"]
"""What to do with a run whose run.json names no trainer key: refuse it (ConfigError), or read it
unchecked."""


class TrustedWeights:
    """The published weights of one run, as far as its trainer's key vouches for them (module docstring)."""

    def __init__(self, store: Store, run: RunManifest, verifier: Verifier | None):
        """`verifier`: the run's trainer key (None only for an unsigned run read unchecked)."""
        self.store = store
        self.run = run
        self.verifier = verifier

    @classmethod
    def open(cls, store: Store, trust: str | None = None, *, unsigned: Unsigned = "refuse") -> TrustedWeights:
        """The run at `store`. ConfigError if it holds no run.json, if run.json's key does not have the
        fingerprint `trust`, or for an unsigned run unless `unsigned="unchecked"`."""
        from pnyx.protocol.runfile import read_run

        run = read_run(store)
        if run is None:
            raise ConfigError(f"{store.url} holds no run (no {layout.RUN_MANIFEST}): check the URL")
        return cls.for_run(store, run, trust, unsigned=unsigned)

    @classmethod
    def for_run(
        cls, store: Store, run: RunManifest, trust: str | None = None, *, unsigned: Unsigned = "refuse"
    ) -> TrustedWeights:
        """`open` for a run.json already read. With `trust` given, an unsigned run is always refused."""
        from pnyx.weights.trust import run_trust

        if run.trainer_key is None and trust is None and unsigned == "unchecked":
            return cls(store, run, None)
        return cls(store, run, run_trust(run, trust))

    @property
    def signed(self) -> bool:
        """Whether versions are checked against the trainer's key (False: an unsigned run, unchecked)."""
        return self.verifier is not None

    @property
    def fingerprint(self) -> str | None:
        return self.verifier.fingerprint if self.verifier is not None else None

    @property
    def skipped(self) -> dict[str, str]:
        """Manifest key -> why it was ignored, for every manifest object the lookups so far passed over
        (listings see only what they list: `latest()` the versions from HEAD on)."""
        return dict(self.verifier.ignored) if self.verifier is not None else {}

    def latest(self) -> int | None:
        """The newest version the trainer signed, or None if it has signed none yet."""
        return latest_version(self.store, self.verifier)

    def manifest(self, version: int) -> WeightManifest:
        """Version `version`'s manifest, signed by the trainer. NotFoundError if the store holds no manifest
        of it at all; UntrustedWeightsError if it holds only manifests the trainer did not sign, or the one
        at the trainer's name does not verify."""
        if self.verifier is None:
            return read_manifest(self.store, version)
        try:
            return read_manifest(self.store, version, self.verifier)
        except NotFoundError:
            others = self._foreign_manifests(version)
            if not others:
                raise NotFoundError(
                    f"weights v{version} has no manifest in {self.store.url}{self._newest()}"
                ) from None
            raise UntrustedWeightsError(
                f"weights v{version} in {self.store.url} is not the trainer's: none of its manifests is "
                f"signed by the run's trainer key {self.verifier.fingerprint} ({'; '.join(others)})"
                f"{self._newest()}"
            ) from None
        except IntegrityError as e:
            raise UntrustedWeightsError(
                f"weights v{version} in {self.store.url} does not verify under the run's trainer key "
                f"{self.verifier.fingerprint}: {e}{self._newest()}"
            ) from None

    def resolve(self, version: int | None = None) -> int | None:
        """The version a reader asked for: `version` itself once its manifest is the trainer's (else
        NotFoundError or UntrustedWeightsError, as `manifest`), or by default the newest version the
        trainer signed (None if it has signed none yet)."""
        if version is None:
            return self.latest()
        self.manifest(version)
        return version

    def syncer(self, **options: Any) -> Syncer:
        """A `Syncer` following only the versions the trainer signed (`options`: the Syncer's own)."""
        return Syncer(self.store, trust=self.verifier, **options)

    def _foreign_manifests(self, version: int) -> list[str]:
        """`key: why` of each manifest object of `version` (none of them the trainer's, by now)."""
        if self.verifier is None:
            return []
        out = []
        for meta in self.store.list(layout.weights_manifest_candidates(version)):
            parsed = layout.parse_any_weights_manifest(meta.key)
            if parsed is not None and parsed[0] == version:
                out.append(f"{meta.key}: {ignored_reason(parsed[1])}")
        return out

    def _newest(self) -> str:
        latest = self.latest()
        if latest is None:
            return "; the trainer has signed no version yet"
        return f"; the newest version the trainer signed is v{latest}"


def trusted_latest(store: Store, trust: str | None = None) -> int | None:
    """The newest version the run's trainer key signed; None while the store holds no run.json yet or the
    trainer has signed no version (what `pnyx run` polls). ConfigError for an unsigned run."""
    from pnyx.protocol.runfile import read_run

    run = read_run(store)
    return None if run is None else TrustedWeights.for_run(store, run, trust).latest()
