"""The one engine protocol (`WorkerEngine`), and the proof that an engine's weights are the chain's.

Everything in pnyx that samples from a model goes through `WorkerEngine`: the worker's cohorts,
held-out evaluation (`pnyx eval`, `pnyx run`'s evaluator) and swarm nodes. Its implementations are one
file per backend (`torch.py`, `mlx.py`, `vllm.py`), created only by `pnyx.rollout.engines.make_engine`.
An engine owns a model in memory and does four things:
- `update(version, state, plane)`: apply a verified PULSE state (anchor or delta result) **in place**,
  touching only tensors whose bits changed since the last update, then prove that what it now computes
  with is exactly the published version: `WeightsProof`;
- `generate(prompt_ids, params)`: sample completions with the run's settings, recording each token's
  behaviour logprob under the sampling distribution (`pnyx.models.logprobs.sampling_logprobs`: temperature,
  then top-k, then top-p; greedy records the temperature-1, untruncated logprob);
- `run_episodes(...)`: the multi-turn tool loop with tool tokens masked: the shared loop of
  `pnyx.rollout.episodes`, on the KV cache of the engine's `decoder()` where it has one (torch), else
  re-prefilling each turn through `generate`;
- `name`: recorded in every rollout group, so the trainer can report its logprob gap per engine.
Optional, with defaults here: `decoder()` (the decode loop tool turns continue on; None), `reference_logprobs`
(pre-rollout screening; None: cannot score) and `close()` (release processes or memory; nothing).

The proof. The manifest of a version lists every tensor's xxh3-128 digest (of its bits in the published
dtype), the state digest over them, and the chain digest `H(parent || payload || state)`. After an update
the engine reports a digest per published tensor; `prove` checks each against the manifest and recomputes
the state and chain digests from them. How the engine obtains its digests is its `proof` kind:
- "hashed": it hashed its own weights, read back from the arrays it computes with, cast to the published
  dtype (exact: the published values are representable in the compute dtype). This proves the model holds
  the chain's bits;
- "derived": it hashed the exact verified bytes it handed to its loader (an engine that fuses or
  re-lays-out tensors, or runs from a plane it cannot read back). This proves what it was given, and
  trusts the loader to have copied it.

Knows nothing about the store, the trainer or environments. Imports no ML framework at module level.
"""

from __future__ import annotations

import logging
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

from pnyx.errors import ConfigError, IntegrityError
from pnyx.weights.bits import BitState, TensorBits, chain_digest_of, state_digest_of

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from pnyx.config import LoraConfig
    from pnyx.models.lora import AdapterMerge
    from pnyx.rollout.episodes import Decoding, Episode, ToolFn
    from pnyx.rollout.sampling import Completion, SamplingParams
    from pnyx.weights.manifest import PlaneManifest

log = logging.getLogger("pnyx.engine")

EngineName = Literal["torch", "mlx", "vllm"]
ENGINE_NAMES: tuple[str, ...] = ("torch", "mlx", "vllm")
ProofKind = Literal["hashed", "derived"]
TensorDigest = tuple[str, tuple[int, ...], str]
"""(published dtype, shape, xxh3-128 of the bits) of one published tensor."""


@dataclass(frozen=True)
class WeightsProof:
    """What `update` proved: the engine computes with exactly version `version` of the chain."""

    version: int
    chain_digest: str
    state_digest: str
    kind: ProofKind
    tensors: int
    """Published tensors checked."""
    changed: int
    """Tensors written by this update (all of them on the first)."""
    apply_s: float
    """Seconds spent writing the changed tensors into the engine."""
    prove_s: float
    """Seconds spent obtaining and checking the digests."""


def changed_names(previous: Mapping[str, weakref.ref] | None, state: Mapping[str, TensorBits]) -> list[str]:
    """Names whose bits may differ from the previous update: every name whose array is not the very same
    (still living) object as the one applied then.

    The syncer shares the arrays of unchanged tensors between consecutive versions and never writes an
    array it has served, so identity means equal bits. `previous` holds weak references, so the engine
    keeps no second copy of the weights alive; a dead reference just counts as changed."""
    if previous is None:
        return list(state)
    return [n for n, tb in state.items() if n not in previous or previous[n]() is not tb.data]


def prove(
    version: int, digests: Mapping[str, TensorDigest], plane: PlaneManifest, kind: ProofKind
) -> tuple[str, str]:
    """(chain digest, state digest) recomputed from the engine's digests; IntegrityError on any mismatch.

    Every tensor the manifest lists must be present with the manifest's dtype, shape and digest, and no
    other tensor; the chain digest is then `H(parent || payload || state)` from the manifest's parent and
    payload digests and the state digest of the engine's own tensor digests."""
    expected = {t.name: (t.dtype, tuple(t.shape), t.digest) for t in plane.tensors}
    wrong = [n for n in expected if n not in digests or tuple(digests[n]) != expected[n]]
    extra = sorted(set(digests) - set(expected))
    if wrong or extra:
        raise IntegrityError(
            f"v{version}: the engine's weights are not the published ones ({kind} digests): "
            f"{len(wrong)} tensor(s) differ (first: {wrong[:3]}), {len(extra)} unexpected (first: {extra[:3]}). "
            "The update did not land as published; the worker must not generate from these weights."
        )
    state = state_digest_of((n, d, s, g) for n, (d, s, g) in digests.items())
    chain = chain_digest_of(plane.parent_digest, plane.payload_digest, state)
    if state != plane.state_digest or chain != plane.chain_digest:
        raise IntegrityError(
            f"v{version}: recomputed state digest {state} / chain digest {chain} do not match the manifest's "
            f"{plane.state_digest} / {plane.chain_digest}"
        )
    return chain, state


class WorkerEngine(ABC):
    """The one engine protocol: a loaded model that the worker, evaluation and swarm nodes sample from.

    Not thread-safe: one caller at a time."""

    name: ClassVar[str] = ""
    seeded_draws: ClassVar[bool] = False
    """It samples with `SamplingParams.draws` (`pnyx.protocol.draws`), so the trainer can check every token
    it draws (`pnyx.train.drawcheck`). Engines without it refuse seeded draws; their groups are unseeded."""
    proof_kind: ProofKind = "hashed"
    tokenizer: PreTrainedTokenizerBase

    def __init__(self) -> None:
        self._loaded: dict[str, weakref.ref] | None = None  # the arrays of the last state applied (weakly)
        self.version: int | None = None
        self.digest: str = ""
        self.last_proof: WeightsProof | None = None
        self.lora: LoraConfig | None = None
        """A LoRA run's adapter settings (`serve_adapter`): published states are adapters."""
        self._merge: AdapterMerge | None = None

    def serve_adapter(self, lora: LoraConfig) -> None:
        """Serve a LoRA run: every published state is the adapter (`pnyx.models.lora`), merged into this
        engine's own base weights, W = W0 + (alpha / r) · B @ A, where the run publishes full weights. Before
        the first update: the base is read once then (`_base`), and never written back."""
        if self._loaded is not None:
            raise RuntimeError("serve_adapter before the first update: the base is read then")
        self.lora = lora
        self.proof_kind = "derived"

    # -- weights --

    def update(self, version: int, state: BitState, plane: PlaneManifest | None) -> WeightsProof:
        """Apply verified `state` (version `version`, described by `plane`) in place, then prove it.

        Only tensors whose arrays changed since the previous update are written. On a failed proof the
        engine's weights are in an unknown state: IntegrityError, and `version`/`digest` are cleared so
        nothing generates from them until a later update proves."""
        if plane is None:
            raise IntegrityError(f"v{version}: no manifest to prove the update against (sync first)")
        names = changed_names(self._loaded, state)
        t0 = time.perf_counter()
        self.version, self.digest = None, ""
        try:
            if self.lora is None:
                self._apply(state, names, first=self._loaded is None)
            else:
                self._apply_adapter(state, names)
            t1 = time.perf_counter()
            if self.lora is None:
                digests = self._digests(state, names)
            else:  # "derived": the digests of the verified adapter bytes the merge read
                digests = {n: (tb.dtype, tb.shape, tb.digest()) for n, tb in state.items()}
            chain, sdig = prove(version, digests, plane, self.proof_kind)
        except BaseException:
            # part of the state may have been written: the next update rewrites every tensor (a derived
            # proof would not see a tensor this one half-wrote and the next one skipped as unchanged)
            if self._loaded is not None:
                self._loaded = {}
            raise
        t2 = time.perf_counter()
        self._loaded = {n: weakref.ref(tb.data) for n, tb in state.items()}
        self.version, self.digest = version, chain
        self.last_proof = WeightsProof(
            version, chain, sdig, self.proof_kind, len(digests), len(names), t1 - t0, t2 - t1
        )
        return self.last_proof

    def _apply_adapter(self, state: BitState, names: list[str]) -> None:
        """Merge the adapter tensors that changed into the base and write the merged weights (a LoRA run)."""
        import torch

        from pnyx.models.lora import AdapterMerge, targets
        from pnyx.weights.bits import to_torch

        if self.lora is None:
            raise RuntimeError("_apply_adapter outside a LoRA run")
        if self._merge is None:
            self._merge = AdapterMerge(self.lora, self._base(targets(state)))
        adapter = to_torch(dict(state))
        if not all(torch.isfinite(t).all() for t in adapter.values()):
            raise IntegrityError("the adapter holds non-finite values")
        self._write(self._merge.merged(adapter, names))

    def _base(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """The engine's base values (float32, as torch tensors) of the weights `keys`, read before any adapter
        is merged (a LoRA run). Engines that serve adapters implement it with `_write`."""
        raise ConfigError(f"the {self.name} engine cannot serve a LoRA adapter")

    def _write(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write whole weights (float32, by their transformers names) into the model, in place (a LoRA run's
        merged targets)."""
        raise ConfigError(f"the {self.name} engine cannot serve a LoRA adapter")

    @abstractmethod
    def _apply(self, state: BitState, names: list[str], first: bool) -> None:
        """Write `state[n]` for every n in `names` into the model, in place (no rebuild, no reload)."""

    @abstractmethod
    def _digests(self, state: BitState, changed: list[str]) -> dict[str, TensorDigest]:
        """A digest per published tensor of what the engine now computes with (see `proof_kind`)."""

    # -- sampling --

    @abstractmethod
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[Completion]:
        """One completion per prompt, in order, with behaviour logprobs under the sampling distribution."""

    def run_episodes(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        tool: ToolFn | Sequence[ToolFn],
        tool_stops: list[str],
        max_turns: int,
        max_episode_tokens: int = 1024,
        max_tool_tokens: int = 512,
    ) -> list[Episode]:
        """One multi-turn episode per prompt through the shared tool loop (`pnyx.rollout.episodes.run_episodes`,
        which documents the arguments): on the KV cache of `decoder()` where the model allows it, else each
        turn a fresh `generate` over prompt + episode so far."""
        from pnyx.rollout.episodes import run_episodes

        decoder = self.decoder()
        return run_episodes(
            self if decoder is None else decoder,
            prompt_ids, params, tool, tool_stops, max_turns, max_episode_tokens, max_tool_tokens,
        )  # fmt: skip

    def decoder(self) -> Decoding | None:
        """The decode loop whose KV cache tool turns can continue on, or None (the default): tool turns then
        re-prefill through `generate`."""
        return None

    def reference_logprobs(
        self, prompt_ids: list[list[int]], completion_ids: list[list[int]], params: SamplingParams
    ) -> list[float] | None:
        """Total log-probability of each completion given its prompt under the sampling distribution of
        `params` (pre-rollout screening, `pnyx.rollout.screen`), or None when this engine cannot score
        completions (screening is then off). The default cannot."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook: most engines hold nothing to release
        """Release what the engine holds (processes, memory). The default holds nothing to release."""
