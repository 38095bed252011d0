"""Runs inside vLLM's worker process: load pnyx weights into the resident model, read them back for the proof.

vLLM is started with `worker_extension_cls="pnyx.rollout.engines.vllm_ext.PnyxWorkerExtension"`, which mixes
these methods into its GPU/CPU worker; the engine calls them through `LLM.collective_rpc`.

- `pnyx_load_weights(path)`: reads the safetensors file the engine wrote (tensors do not survive vLLM's RPC
  encoding intact; a file in shared memory works for every executor and rank), then `model.load_weights`
  with (transformers name, tensor) pairs, the model's own
  loader (it knows how q/k/v land in the fused `qkv_proj`, gate/up in `gate_up_proj`, and pads the vocab).
  It copies into the existing parameters: no re-allocation, no restart, CUDA graphs stay valid.
- `pnyx_read_weights(specs)`: for each published tensor (name → (dtype, shape)), the slice of the fused
  parameter that holds it (vLLM's `packed_modules_mapping`: the rows of a packed module are its parts, in
  order, with their published row counts; a padded vocabulary is cut back), cast to the published dtype and
  hashed with xxh3-128. A tensor that cannot be located is reported as None, and the engine then falls back
  to a derived proof. Correct for one tensor-parallel rank (the whole tensor lives there); with
  tensor parallelism each rank holds a shard, so the method reports None for everything.

Knows nothing about pnyx's store or manifests; imports only torch, numpy and xxhash.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import xxhash

_SIGNED = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_digest(t: torch.Tensor, dtype: str) -> str:
    """xxh3-128 of `t` cast to `dtype`, as raw little-endian C-order bytes (pnyx's tensor digest)."""
    t = t.detach().to("cpu", getattr(torch, dtype)).contiguous()
    raw = t.view(_SIGNED[t.element_size()]) if t.dtype != torch.bool else t.view(torch.uint8)
    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(raw.numpy()).reshape(-1).data.cast("B"))


def locate(
    name: str,
    shapes: dict[str, tuple[int, ...]],
    params: dict[str, torch.Tensor],
    packed: dict[str, list[str]],
) -> torch.Tensor | None:
    """The part of vLLM's parameters holding published tensor `name` (shape `shapes[name]`), or None."""
    shape = tuple(shapes[name])
    if name in params:
        p = params[name]
        if tuple(p.shape) == shape:
            return p
        if len(shape) >= 1 and tuple(p.shape[1:]) == shape[1:] and p.shape[0] >= shape[0]:
            return p[: shape[0]]  # a padded vocabulary (embedding / output head)
        return None
    if name == "lm_head.weight" and "model.embed_tokens.weight" in params:  # tied head: vLLM keeps one
        return locate("model.embed_tokens.weight", {"model.embed_tokens.weight": shape}, params, packed)
    parts = name.split(".")
    for i, part in enumerate(parts):
        for fused, members in packed.items():
            if part not in members:
                continue
            prefix, suffix = ".".join(parts[:i]), ".".join(parts[i + 1 :])
            fused_name = ".".join(x for x in (prefix, fused, suffix) if x)
            if fused_name not in params:
                continue
            offset = 0
            for m in members[: members.index(part)]:
                sibling = ".".join(x for x in (prefix, m, suffix) if x)
                if sibling not in shapes:
                    return None
                offset += shapes[sibling][0]
            p = params[fused_name]
            if tuple(p.shape[1:]) != shape[1:] or offset + shape[0] > p.shape[0]:
                return None
            return p[offset : offset + shape[0]]
    return None


class PnyxWorkerExtension:
    """Methods vLLM mixes into its worker (`self.model_runner.model` is the resident model)."""

    def _pnyx_model(self) -> Any:
        runner: Any = self.model_runner  # type: ignore[attr-defined]
        return runner.model if hasattr(runner, "model") else runner.get_model()

    def pnyx_load_weights(self, path: str) -> int:
        """Copy the tensors of safetensors file `path` (transformers names) into the resident model with its
        own loader; returns the count."""
        from safetensors.torch import load_file

        tensors = load_file(path)
        # vLLM's in-place reload: layers are restored to checkpoint layout, loaded with the model's own
        # loaders, re-processed (repacking for CPU GEMMs, quantization) and copied back into the same
        # storage, so CUDA graphs and the KV cache stay valid.
        self.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)  # type: ignore[attr-defined]
        return len(tensors)

    def pnyx_read_weights(self, specs: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, str | None]:
        """Digest per published tensor (name → (dtype, shape)) of what the model holds, None where unknown."""
        model = self._pnyx_model()
        tp = getattr(getattr(self, "parallel_config", None), "tensor_parallel_size", 1)
        if tp != 1:
            return {n: None for n in specs}
        params = dict(model.named_parameters(remove_duplicate=False))
        packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
        shapes = {n: tuple(s) for n, (_, s) in specs.items()}
        out: dict[str, str | None] = {}
        for name, (dtype, _shape) in specs.items():
            part = locate(name, shapes, params, packed)
            out[name] = None if part is None else tensor_digest(part, dtype)
        return out
