"""The vLLM engine: a resident `vllm.LLM` with its own sampling, prefix caching and continuous batching.

Weights: the `LLM` is built once; every PULSE update goes through `collective_rpc` into
`vllm_ext.PnyxWorkerExtension.pnyx_load_weights`, the model's own `load_weights` copying the changed
tensors into the existing (fused, padded) parameters. The engine is never restarted per version. The prefix
cache is reset after each update: its blocks hold keys/values computed by the previous weights. A LoRA run
(`serve_adapter`): the base state is read once from the model folder on the CPU, in float32 (`_base`), and
every update sends it whole with the merged targets in place of theirs (`_write`); the proof is "derived".

Proof: "hashed" where `pnyx_read_weights` can locate every published tensor inside vLLM's fused parameters
(one tensor-parallel rank; Llama/Qwen-style `packed_modules_mapping`), read back and hashed in the published
dtype; otherwise "derived": the digests of the verified bytes handed to `load_weights`. `proof_kind` after
an update says which one was used.

Sampling: `SamplingParams(temperature, top_k, top_p, stop, max_tokens, seed, logprobs=0)` with the engine
started in `logprobs_mode="processed_logprobs"`, so the logprob vLLM returns for each sampled token is
`log_softmax` of the logits after temperature, top-k and top-p: pnyx's sampling distribution. What differs
(docs/engine.md, "vLLM"): the top-p boundary is computed from an ascending cumulative sum (`cumsum <= 1-p`
dropped) instead of pnyx's descending mass-before (`>= p` dropped) — the same set up to float rounding at
the boundary — and greedy (temperature 0) returns the temperature-1 untruncated log-softmax, as pnyx defines
it. Each prompt gets its own seed (`params.seed` and its index), so a batch is reproducible. Stop strings:
the token completing one is the last token kept (vLLM stops on it; the text is re-decoded by pnyx's
tokenizer). Tool turns re-prefill prompt + episode, which vLLM's prefix cache turns into a cache hit.

Knows nothing about the store or the trainer. Imports vllm only when an engine is built.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pnyx.errors import ConfigError, IntegrityError
from pnyx.rollout.engines.base import TensorDigest, WorkerEngine
from pnyx.rollout.sampling import Completion, SamplingParams
from pnyx.weights.bits import BitState, to_torch

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("pnyx.engine")

EXTENSION = "pnyx.rollout.engines.vllm_ext.PnyxWorkerExtension"
SEED_STRIDE = 1_000_003  # per-prompt seeds: params.seed * SEED_STRIDE + index


class VLLMEngine(WorkerEngine):
    """A resident vLLM engine behind the engine interface."""

    name = "vllm"

    def __init__(
        self,
        path: str | Path,
        tokenizer: PreTrainedTokenizerBase,
        dtype: str = "float32",
        device: str = "cpu",
        *,
        gpu_memory_utilization: float = 0.85,
        max_model_len: int | None = None,
        enforce_eager: bool | None = None,
        seed: int = 0,
        **llm_kwargs: Any,
    ):
        from pnyx.models.loading import model_folder

        super().__init__()
        try:
            from vllm import LLM
        except ImportError as e:
            raise ConfigError(f"vllm cannot be imported ({e}): pip install 'pnyx[vllm]'") from None
        self.tokenizer = tokenizer
        self.proof_kind = "hashed"
        folder = str(model_folder(path))
        self.folder = folder
        self._full: dict[str, torch.Tensor] | None = None
        """A LoRA run: the whole state every update sends (float32, CPU): the base, with the merged targets of
        the last update that landed."""
        on_cpu = device == "cpu"
        if on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache on a CPU box
        try:
            self.llm: Any = LLM(
                model=folder,
                tokenizer=folder,
                dtype=dtype,
                seed=seed,
                logprobs_mode="processed_logprobs",
                enable_prefix_caching=True,
                worker_extension_cls=EXTENSION,
                max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization,
                enforce_eager=on_cpu if enforce_eager is None else enforce_eager,
                **llm_kwargs,
            )
        except (ValueError, RuntimeError) as e:
            raise ConfigError(f"vLLM could not start on {folder} ({device}, {dtype}): {e}") from None

    # -- weights --

    def _apply(self, state: BitState, names: list[str], first: bool) -> None:
        if not names:
            return
        # vLLM reloads layer by layer, and a fused layer (qkv, gate/up) given only some of its parts would
        # be rebuilt with the others missing; a PULSE delta touches nearly every tensor anyway, so every
        # update sends the whole state (from memory: the engine is neither rebuilt nor restarted).
        self._send(to_torch(dict(state)))

    def _send(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Load `tensors` (transformers names) into the resident model through a safetensors file in shared
        memory, then drop the prefix cache (its blocks were computed by the previous weights)."""
        from safetensors.torch import save_file

        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        with tempfile.TemporaryDirectory(prefix="pnyx-vllm-", dir=shm) as tmp:
            path = os.path.join(tmp, "update.safetensors")
            save_file(dict(tensors), path)
            self.llm.collective_rpc("pnyx_load_weights", args=(path,))
        self.llm.reset_prefix_cache()  # cached blocks were computed by the previous weights

    def _base(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """The base values of `keys` (a LoRA run's targets), read from the model folder on the CPU: vLLM's
        fused parameters are not read back. The whole base state is loaded once, in float32, and kept
        (`_full`): a fused layer needs all its parts, so every update sends the whole state, as `_apply` does."""
        from pnyx.models.loading import load_model

        model = load_model(self.folder, dtype="float32", device="cpu")
        full: dict[str, torch.Tensor] = {}
        seen: dict[tuple[int, tuple[int, ...]], str] = {}
        tied: set[str] = set()
        for k, v in model.state_dict().items():
            t = v.detach()
            alias = (t.data_ptr(), tuple(t.shape))
            if alias in seen:  # the same tensor under two names (a tied head): a copy of its own for the file
                tied.update((k, seen[alias]))
                t = t.clone()
            else:
                seen[alias] = k
            full[k] = t
        del model
        missing = [k for k in keys if k not in full]
        if missing:
            raise IntegrityError(
                f"the adapter adapts {missing[:3]}, which this model does not have (is it the run's base model?)"
            )
        shared = [k for k in keys if k in tied]
        if shared:
            raise ConfigError(
                f"the adapter adapts {shared[:3]}, which this model ties to another weight (tie_word_embeddings): "
                "vLLM keeps one tensor for both, so the merged weight would change the other too"
            )
        self._full = full
        return {k: full[k] for k in keys}

    def _write(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Send the whole base state with the merged targets `tensors` replacing theirs (see `_base`)."""
        import torch

        if self._full is None:
            raise RuntimeError("_write before _base: the base state is loaded on the first update")
        for n, t in tensors.items():
            own = self._full.get(n)
            if own is None or tuple(own.shape) != tuple(t.shape):
                found = "no such weight" if own is None else f"shape {tuple(own.shape)}"
                raise IntegrityError(f"merged {n} {tuple(t.shape)} does not fit the model ({found})")
        if not tensors:
            return
        # A new dict, never written into: the merge's base shares the base tensors, and a send that fails
        # leaves `_full` as the last state that landed (the next update sends it whole again).
        full = {
            **self._full,
            **{n: t.detach().to("cpu", torch.float32).contiguous() for n, t in tensors.items()},
        }
        self._send(full)
        self._full = full

    def _digests(self, state: BitState, changed: list[str]) -> dict[str, TensorDigest]:
        specs = {n: (tb.dtype, tb.shape) for n, tb in state.items()}
        per_rank = self.llm.collective_rpc("pnyx_read_weights", args=(specs,))
        read = per_rank[0] if per_rank else {}
        if read and all(read.get(n) is not None for n in specs) and all(r == read for r in per_rank):
            self.proof_kind = "hashed"
            return {n: (tb.dtype, tb.shape, read[n]) for n, tb in state.items()}
        missing = [n for n in specs if not read or read.get(n) is None]
        if self.proof_kind == "hashed":
            log.warning(
                "vllm: %d published tensor(s) cannot be read back from the model (first: %s); the weights "
                "proof is derived from the verified bytes loaded instead",
                len(missing), missing[:3],
            )  # fmt: skip
        self.proof_kind = "derived"
        return {n: (tb.dtype, tb.shape, tb.digest()) for n, tb in state.items()}

    # -- sampling --

    def _vllm_params(self, params: SamplingParams, index: int) -> Any:
        from vllm import SamplingParams as VParams

        return VParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else 0,
            max_tokens=params.max_new_tokens,
            stop=list(params.stop) or None,
            seed=params.seed * SEED_STRIDE + index,
            logprobs=0,
            ignore_eos=params.ignore_eos,
            skip_special_tokens=True,
            detokenize=True,
        )

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[Completion]:
        if not prompt_ids:
            return []
        if any(len(p) == 0 for p in prompt_ids):
            raise ConfigError("every prompt needs at least one token")
        if params.draws is not None:
            raise ConfigError(
                "the vllm engine cannot sample seeded draws (its sampler draws its own uniforms): its groups "
                "are unseeded, and a trainer takes them only with security.accept_unseeded (docs/security.md)"
            )
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids]
        outs = self.llm.generate(
            prompts, [self._vllm_params(params, i) for i in range(len(prompts))], use_tqdm=False
        )
        result = []
        for out in outs:
            o = out.outputs[0]
            tokens = list(o.token_ids)
            lps = [float(step[t].logprob) for t, step in zip(tokens, o.logprobs or [], strict=True)]
            stop = o.stop_reason if isinstance(o.stop_reason, str) else None
            reason = "stop" if o.finish_reason == "stop" else "length"
            result.append(
                Completion(
                    tokens, lps, reason, str(self.tokenizer.decode(tokens, skip_special_tokens=True)), stop
                )
            )
        return result

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if callable(shutdown):
                shutdown()
            self.llm = None
