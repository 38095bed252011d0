"""The trainer across processes: torchrun's environment, process groups, FSDP2 sharding, object collectives.

`pnyx trainer` under `torchrun --nproc-per-node N` (WORLD_SIZE > 1) joins a process group (NCCL on CUDA,
gloo on CPU) and shards the model with FSDP2 (`fully_shard` on every decoder layer, then the root), with
a mixed-precision policy: parameters all-gathered in the compute dtype, gradients reduced in fp32 and
summed (the loss weights are batch-global, so the sum over ranks is the full-batch gradient), master
weights and AdamW state fp32 and sharded. One process (no WORLD_SIZE, or 1) is `Dist.single()`: no process
group, no sharding, nothing changes.

Small Python objects (the batch, partial step statistics, publish parts) travel over a separate gloo
group, so they never need a CUDA tensor; checkpoints get their own gloo group too, because DCP's
asynchronous save runs collectives from a background thread while training continues.
Knows nothing about RL, the store or the run layout.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, TypeVar, cast

import torch

from pnyx.errors import ConfigError, PnyxError

M = TypeVar("M", bound=torch.nn.Module)
T = TypeVar("T")

log = logging.getLogger("pnyx.train")

ComputeDtype = Literal["auto", "bfloat16", "float32"]
TIMEOUT = timedelta(minutes=30)
"""How long a collective waits for a peer before failing (a dead peer ends the job through torchrun)."""


@dataclass
class Dist:
    """This process's place in the trainer: rank in [0, world), its device, and the process groups."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    objects: Any = None  # torch's new_group: ProcessGroup | int | None
    """gloo group for Python objects (None: single process)."""
    checkpoints: Any = None  # as above
    """gloo group for DCP checkpoint collectives (None: single process)."""

    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> Dist:
        return cls(device=torch.device(device))

    @property
    def is_main(self) -> bool:
        """Rank 0: the only process that talks to the store for coordination (batch, manifest, metrics)."""
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.world > 1

    # --- object collectives (the `pnyx.weights.parallel.Collective` protocol) ---------------------------

    def broadcast(self, obj: T) -> T:
        """Rank 0's `obj` on every rank."""
        if not self.sharded:
            return obj
        import torch.distributed as dist

        box: list[object] = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0, group=self.objects)
        return cast(T, box[0])

    def gather(self, obj: T) -> list[T] | None:
        """Every rank's `obj` on rank 0, in rank order (None on the others)."""
        if not self.sharded:
            return [obj]
        import torch.distributed as dist

        out: list[object] | None = [None for _ in range(self.world)] if self.is_main else None
        dist.gather_object(obj, out, dst=0, group=self.objects)
        return cast(list[T] | None, out)

    def all_gather(self, obj: T) -> list[T]:
        """Every rank's `obj` on every rank, in rank order."""
        if not self.sharded:
            return [obj]
        import torch.distributed as dist

        out: list[object] = [None for _ in range(self.world)]
        dist.all_gather_object(out, obj, group=self.objects)
        return cast(list[T], out)

    def on_main(self, fn: Callable[[], T]) -> T:
        """Run `fn()` on rank 0 only and hand its result (or its PnyxError) to every rank, so that every rank
        goes on, or fails, the same way."""
        out: tuple[str, object] = ("ok", None)
        if self.is_main:
            try:
                out = ("ok", fn())
            except PnyxError as e:
                out = ("error", e)
        out = self.broadcast(out)
        if out[0] == "error":
            raise cast(PnyxError, out[1])
        return cast(T, out[1])

    def barrier(self) -> None:
        if self.sharded:
            import torch.distributed as dist

            dist.barrier(group=self.objects)

    def close(self) -> None:
        if self.sharded:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def launched_world() -> int:
    """WORLD_SIZE as torchrun set it (1 when not launched by torchrun)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def init_distributed(device: str, wait_s: float = 0.0) -> Dist:
    """Join torchrun's process group if this process was launched with WORLD_SIZE > 1, else `single`.

    `device` is the configured trainer device (after 'auto' is resolved): `cuda` ranks use
    `cuda:LOCAL_RANK` and NCCL; anything else uses gloo on the CPU. `wait_s`: the longest rank 0 may wait
    for data while the others wait for its batch (their object collectives get at least that, plus margin).
    """
    world = launched_world()
    if world <= 1:
        return Dist.single(device)
    import torch.distributed as dist

    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda"):
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
        backend = "nccl"
    else:
        dev, backend = torch.device(device), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=TIMEOUT)
    objects = dist.new_group(backend="gloo", timeout=max(TIMEOUT, timedelta(seconds=wait_s + 600)))
    checkpoints = dist.new_group(backend="gloo", timeout=TIMEOUT)
    log.info("trainer rank %d/%d on %s (%s)", rank, world, dev, backend)
    return Dist(rank, world, local_rank, dev, objects, checkpoints)


def resolve_compute_dtype(setting: ComputeDtype, device: torch.device) -> torch.dtype:
    """'auto' is bf16 on CUDA and fp32 elsewhere: CPUs without bf16 units run bf16 matmuls several times
    slower than fp32, and fp32 keeps one-process CPU runs exactly as they were."""
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, setting)


def prepare_model(model: M, d: Dist, compute_dtype: torch.dtype, activation_checkpointing: bool) -> M:
    """Activation checkpointing (optional), then FSDP2 sharding when there is more than one rank.

    Sharding: `fully_shard` each decoder layer (the unit of all-gather and reduce-scatter), then the root
    (embeddings, final norm, head). Master weights stay fp32 (the loaded dtype); the policy all-gathers
    parameters in `compute_dtype` and reduce-scatters gradients in fp32, summed rather than averaged.
    """
    if activation_checkpointing:
        # transformers >= 5 names it activation_checkpointing_enable; older ones gradient_checkpointing_enable
        enable: Any = getattr(model, "activation_checkpointing_enable", None)
        older: Any = getattr(model, "gradient_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        elif older is not None:
            older(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            raise ConfigError(
                f"{type(model).__name__} cannot checkpoint activations (not a transformers model)"
            )
    if not d.sharded:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(d.device.type, (d.world,))
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    # Sum, not mean: loss weights are already batch-global (gloo has no pre-multiplied sum, hence the flag).
    # The settings are per FSDP unit, so every unit gets them.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a Hugging Face causal LM (the `ModuleList` holding most parameters)."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    if not lists:
        return []
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


def is_dtensor(t: object) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def to_local_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective: every rank must call it), any other tensor as it is."""
    return t.full_tensor() if is_dtensor(t) else t  # type: ignore[attr-defined]


def published_state(
    model: torch.nn.Module, names: Mapping[str, str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(published name, tensor) of what a run publishes of `model`, in state-dict order: the whole state dict,
    or with `names` ({state-dict key: published name}, a LoRA run's adapter) only those, renamed."""
    for k, v in model.state_dict().items():
        if names is None:
            yield k, v
        elif k in names:
            yield names[k], v


def state_layout(
    model: torch.nn.Module, dtype: torch.dtype, names: Mapping[str, str] | None = None
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """published name -> (published dtype, global shape) of what `published_state` yields, without moving any
    data."""
    name = str(dtype).removeprefix("torch.")
    return {k: (name, tuple(int(x) for x in v.shape)) for k, v in published_state(model, names)}


def gather_published(
    model: torch.nn.Module, dtype: torch.dtype, keep: set[str], names: Mapping[str, str] | None = None
) -> dict[str, torch.Tensor]:
    """The published cast of the tensors in `keep` (published names), whole, on this rank's CPU.

    Sharded: every tensor is cast where it lives, then all-gathered one at a time (every rank takes part
    in each gather, in state-dict order) and kept only where `keep` names it, so a rank never holds more
    than its share plus one tensor. One process: a plain cast of the tensors kept.
    """
    out: dict[str, torch.Tensor] = {}
    for k, v in published_state(model, names):
        if not is_dtensor(v) and k not in keep:
            continue
        full = to_local_value(v.detach().to(dtype))
        if k in keep:
            out[k] = full.to("cpu")
    return out


def quiet_dcp_warnings() -> None:
    """DCP warns on every call in a single process that it assumes a single process: that is intended."""
    warnings.filterwarnings("ignore", message=".*assuming the intent is to.*single process.*")


class RootForward:
    """What `completion_logprobs` sees of a sharded model: the decoder body run as a forward method of the
    FSDP root (`register_fsdp_forward_method`), then the output head.

    `completion_logprobs` calls the decoder body and the head separately (logits only where completions
    are); on an FSDP2 model that bypasses the root's forward hooks, so the root-level parameters
    (embeddings, final norm, head) would never be all-gathered. Running the body through a registered
    forward method of the root all-gathers them, and the root keeps them unsharded until backward (FSDP2
    never reshards the root after forward), so the head can use them too.
    """

    def __init__(self, model: torch.nn.Module):
        import types

        from torch.distributed.fsdp import register_fsdp_forward_method

        self.model = model
        self._head = model.get_output_embeddings()  # type: ignore[operator]
        if not hasattr(model, "pnyx_hidden"):
            body = model.get_decoder()  # type: ignore[operator]
            # a bound method on the module (not a submodule or tensor): nn.Module's setattr typing is too narrow
            model.pnyx_hidden = types.MethodType(lambda _self, **kw: body(**kw), model)  # pyright: ignore[reportArgumentType]
            register_fsdp_forward_method(model, "pnyx_hidden")

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return self.model.parameters()

    def get_decoder(self) -> Any:
        return self.model.pnyx_hidden

    def get_output_embeddings(self) -> Any:
        return self._head

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)


def forward_view(model: torch.nn.Module) -> Any:  # the Module, or a RootForward duck-typed as one
    """The model as `completion_logprobs` must call it: a `RootForward` for an FSDP2 model, else itself."""
    from torch.distributed.fsdp import FSDPModule

    return RootForward(model) if isinstance(model, FSDPModule) else model
