"""The run's model at exactly a published version: what the trainer's exact checks compute with.

Workers sample from the published weights (bf16 by default), not from the trainer's fp32 masters, and a
group `s` versions behind was sampled from a policy `s` steps away. Two checks need the very weights a
group was sampled from: the per-token check of seeded draws (`drawcheck.py`, every seeded group) and the
exact re-check of a group the step's statistical checks would drop (`rejudge.py`). `PublishedModel` is
their one second model: an fp32 copy of the run's model (how CPU and MLX workers compute) that `at(v)`
loads with the published weights of version `v`, rebuilt from the store by a `Syncer` that trusts only the
run's trainer key (fail-closed: a version that does not verify is never computed with).

A group may claim any version in the staleness window, in any order, so the verified states of the
`keep` newest versions used stay in memory (bf16 arrays; a tensor unchanged between versions is one
array). Moving the model between two of them copies only the tensors whose arrays differ. A trainer that
publishes alone hands each version it publishes over as it published it (`remember`), so in a run the
checks never fetch; other versions (published before a restart, or by N ranks together) are synced from
the store: a version older than the syncer's and not kept is rebuilt by a fresh syncer from the newest
anchor at or before it. Both
plane kinds are served: "weights" (the published dtype) and "int8" (the actor plane, dequantized as workers
dequantize it), one model per plane, built at the first need. Calls come from the ingestion threads and
the step: hold `lock` from `at` to the end of the forward. Knows nothing about checks or the loop.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

from pnyx.config import LoraConfig
from pnyx.security.signing import Verifier
from pnyx.store import Store
from pnyx.weights import Syncer
from pnyx.weights.syncer import Plane

log = logging.getLogger("pnyx.trainer")

KEEP = 6
"""Verified states kept per plane by default (the trainer keeps its staleness window, max_staleness + 1
versions: 4 by default; each state of SmolLM2-135M is 270 MB)."""


class PublishedModel:
    """One plane's published weights in a second fp32 model (see the module docstring). `trust` is the run's
    trainer key (set when the run is created or joined); without it nothing is loaded."""

    def __init__(
        self,
        store: Store,
        model_dir: str | Path,
        lora: LoraConfig | None = None,
        plane: Plane = "weights",
        keep: int = KEEP,
    ):
        self.store = store
        self.model_dir = model_dir
        self.lora = lora
        """A LoRA run's adapter settings: the model is the base with the same adapter layers, loaded with
        the published adapter (the trainer's own forward, at the version's adapter)."""
        self.plane: Plane = plane
        self.keep = keep
        self.trust: Verifier | None = None
        self.lock = threading.RLock()
        self.version: int | None = None
        """The version the model holds now (None before the first `at`)."""
        self.digest = ""
        """That version's chain digest on this plane (what a group sampled from it records)."""
        self._model: torch.nn.Module | None = None
        self._syncer: Syncer | None = None
        self._params: dict[str, torch.Tensor] = {}
        self._states: dict[int, tuple[str, dict[str, torch.Tensor]]] = {}
        self._loaded: dict[str, torch.Tensor] = {}  # the state tensors last copied in (kept alive: pointers)

    def at(self, version: int) -> torch.nn.Module:
        """The model holding exactly the published weights of `version` (verified, fail-closed: PnyxError
        when they cannot be obtained). Call with `lock` held."""
        if self.trust is None:
            from pnyx.errors import IntegrityError

            raise IntegrityError("no trainer key pinned yet: published weights cannot be verified")
        model = self._build()
        if self.version == version:
            return model
        digest, state = self._state(version)
        changed = [
            n
            for n, t in state.items()
            if (old := self._loaded.get(n)) is None or old.data_ptr() != t.data_ptr()
        ]
        with torch.no_grad():
            for name in changed:
                self._params[name].copy_(state[name])
        self._loaded = dict(state)
        self.version, self.digest = version, digest
        return model

    @property
    def kept(self) -> list[int]:
        """The versions whose verified states are in memory (moving the model to one of them fetches nothing)."""
        return sorted(self._states)

    def remember(self, version: int, digest: str, tensors: dict[str, torch.Tensor]) -> None:
        """Keep `version`'s state as this trainer has just published it (`Publisher.published_tensors`: the
        very bits it uploaded, chain digest `digest`), so a check of that version neither fetches nor
        verifies it: the trainer trusts its own output. Tensors are kept by reference (never written).
        The first call also builds the model (its load, seconds on a real model, then falls at start-up,
        not in the step that first needs it)."""
        with self.lock:
            self._keep(version, (digest, dict(tensors)))
            self._build()

    def _keep(self, version: int, state: tuple[str, dict[str, torch.Tensor]]) -> None:
        """Keep `state` as `version`'s, then drop the oldest versions past `keep`: a trainer checks the newest
        versions (its staleness window), whatever order it used them in."""
        self._states[version] = state
        while len(self._states) > self.keep:
            del self._states[min(self._states)]

    def _build(self) -> torch.nn.Module:
        if self._model is not None:
            return self._model
        from pnyx.models import load_model

        model = load_model(self.model_dir, dtype="float32")
        params = model.state_dict(keep_vars=True)  # the whole state: published under its own keys
        if self.lora is not None:
            from pnyx.models.lora import attach

            names = attach(model, self.lora)
            params = model.state_dict(keep_vars=True)
            params = {pub: params[key] for key, pub in names.items()}
        model.eval()
        self._params = dict(params)
        self._model = model
        return model

    def _state(self, version: int) -> tuple[str, dict[str, torch.Tensor]]:
        """(chain digest, tensors) of `version`: kept, or synced (forward through deltas, or rebuilt)."""
        kept = self._states.get(version)
        if kept is not None:
            return kept
        syncer = self._syncer
        if syncer is None or (syncer.version is not None and version < syncer.version):
            # a syncer moves forward through deltas only: an older version is rebuilt from the newest anchor
            # at or before it (one route, no failing attempts from the newer base first)
            syncer = self._syncer = Syncer(self.store, self.plane, trust=self.trust)
        _, tensors = syncer.sync(to_version=version)  # IntegrityError if it does not verify
        kept = (syncer.digest or "", dict(tensors))
        self._keep(version, kept)
        log.info(
            "trainer: published weights of v%d (%s plane) loaded for the exact checks", version, self.plane
        )
        return kept
