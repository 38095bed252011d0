"""Judging a group again under the exact weights it was sampled from, before the step drops it.

The step's checks (`pnyx.security.checks`) read the trainer's own forward, which is not the policy a worker
sampled from: the trainer computes with fp32 masters while workers sample from the published bf16 cast,
and a group `s` versions behind was sampled from a policy `s` steps away. The allowances for that drift
are derived from the run (`pnyx.security.calibration`), but drift is not uniform: a step that trains on a
prompt moves the logprobs of exactly that prompt's completions furthest. Measured on SmolLM2-135M with a
fast (MLX) worker that sampled the same one-digit sum in consecutive versions: groups whose z was -2.1 and
+0.2 under the weights they were sampled from showed -8.2 and -7.8 under the next version, and 6 of 120
honest groups were dropped as `implausible` (docs/security.md, section 4; `benchmarks/bench_rejudge.py`).

`Rejudge` is the exact check those groups get before their verdict takes effect: a second model in fp32
(how CPU and MLX workers compute) loaded with the run's own published weights of the version the group
claims, rebuilt from the store by a `Syncer` that trusts only the run's trainer key, and the same evidence
(`step._Forward` and `step._evidence`) from its forward. There the honest gap is the engines' rounding
(0.000 measured for mlx against torch) and z has no drift in it, so the group is judged as a fresh one
(staleness 0); a group that fails there is dishonest at any staleness. It costs a forward of the failing
group (plus, on a version change, applying the deltas in between) and is paid only for groups the master
forward would reject; a key that sends many failing groups is quarantined by the ledger and then never
reaches the forward. Knows nothing about the loop, the ingestion or the checks' thresholds.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import torch

from pnyx.config import LoraConfig
from pnyx.errors import PnyxError
from pnyx.security.checks import GroupEvidence
from pnyx.security.signing import Verifier
from pnyx.store import Store
from pnyx.train.microbatch import Row, plan_micro_batches
from pnyx.train.step import _add_evidence, _evidence, _Forward
from pnyx.weights import Syncer

log = logging.getLogger("pnyx.trainer")

MICRO_BATCH_TOKENS = 8192


class Rejudge:
    """`judgement.Rejudge` over a run's store: `rejudge(rows, version)` -> {group key: exact evidence}.

    The model and the syncer are built at the first call (most runs never need them). `trust` is the run's
    trainer key (set when the run is created or joined, `trainer_setup.attach_run`); without it nothing is
    re-judged (the groups keep the master forward's verdict)."""

    def __init__(self, store: Store, model_dir: str | Path, lora: LoraConfig | None = None):
        self.store = store
        self.model_dir = model_dir
        self.lora = lora
        """A LoRA run's adapter settings: the judge is the base with the same adapter layers, loaded with the
        published adapter (the trainer's own forward, at the claimed version's adapter)."""
        self.trust: Verifier | None = None
        self.calls = 0
        """Groups judged again so far (each a forward of its rows)."""
        self._model: torch.nn.Module | None = None
        self._syncer: Syncer | None = None
        self._params: dict[str, torch.Tensor] = {}

    def __call__(self, rows: list[Row], version: int) -> Mapping[str, GroupEvidence]:
        if self.trust is None or not rows:
            return {}
        try:
            model = self._at(version)
        except PnyxError as e:  # fail-closed: without the exact weights the master forward's verdict stands
            log.warning("trainer: cannot re-judge against v%d (%s); the group keeps its verdict", version, e)
            return {}
        fwd = _Forward(model, torch.device("cpu"), torch.float32, False)
        out: dict[str, GroupEvidence] = {}
        with torch.no_grad():
            for idx in plan_micro_batches(rows, MICRO_BATCH_TOKENS):
                mb = fwd.run([rows[i] for i in idx], entropy=False, var=True)
                _add_evidence(out, _evidence(mb, version))
        self.calls += 1
        return out

    def _at(self, version: int) -> torch.nn.Module:
        """The judge model holding exactly the published weights of `version` (verified, fail-closed)."""
        from pnyx.models import load_model

        model, syncer = self._model, self._syncer
        if model is None or syncer is None:
            model = self._model = load_model(self.model_dir, dtype="float32")
            params = model.state_dict(keep_vars=True)  # the whole state: published under its own keys
            if self.lora is not None:
                from pnyx.models.lora import attach

                names = attach(model, self.lora)
                params = model.state_dict(keep_vars=True)
                params = {pub: params[key] for key, pub in names.items()}
            self._params = dict(params)
            syncer = self._syncer = Syncer(self.store, trust=self.trust)
        if syncer.version is not None and version < syncer.version:
            # an older version: a syncer moves forward through deltas only, so a fresh one rebuilds it from
            # the newest anchor at or before it (one route, no failing attempts from the newer base first)
            syncer = self._syncer = Syncer(self.store, trust=self.trust)
        if syncer.version != version:
            _, tensors = syncer.sync(to_version=version)  # IntegrityError if it does not verify
            with torch.no_grad():
                for name, t in tensors.items():
                    self._params[name].copy_(t)
            log.info("trainer: re-judging groups under the published weights of v%d", version)
        return model
