"""Helpers for the multi-process tests (no tests here): real gloo process groups on loopback.

`spawn(fn, world, *args)` starts `world` fresh interpreters with the environment torchrun would give them
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT on a free port), so the code under test finds its
peers exactly as under `torchrun`; `fn(rank, *args)` must be a module-level function of this module, and
reports back through files. `torchrun_cmd` is the real launcher for end-to-end tests.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(index: int, fn: Any, world: int, port: int, args: tuple[Any, ...]) -> None:
    os.environ.update(
        RANK=str(index), LOCAL_RANK=str(index), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )  # fmt: skip
    import torch

    torch.set_num_threads(1)
    fn(index, *args)


def spawn(fn: Any, world: int, *args: Any) -> None:
    """Run fn(rank, *args) in `world` new processes joined as one gloo job; raise if any fails."""
    import torch.multiprocessing as mp

    mp.start_processes(
        _entry, args=(fn, world, free_port(), args), nprocs=world, join=True, start_method="spawn"
    )


def torchrun_cmd(nproc: int, *args: str) -> list[str]:
    """`torchrun --nproc-per-node N ...` on a free loopback port (tests may run beside other jobs)."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args,
    ]  # fmt: skip


def child_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR"):
        env.pop(k, None)
    return env | extra


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj))


# --- a deterministic state for publishing tests ---------------------------------------------------------


SHAPES = {
    "emb.weight": (96, 128),
    "layers.0.w": (64, 64),
    "layers.0.norm": (64,),
    "layers.1.w": (128, 64),
    "layers.1.b": (7,),
    "head.weight": (96, 128),
}


def state(version: int) -> dict[str, Any]:
    """bf16 weights of `version`: seeded values, each version a small step from the one before."""
    import torch

    g = torch.Generator().manual_seed(7)
    base = {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}
    for v in range(1, version + 1):
        g = torch.Generator().manual_seed(100 + v)
        base = {k: t + 0.01 * torch.randn(t.shape, generator=g) for k, t in base.items()}
    return {k: t.to(torch.bfloat16) for k, t in base.items()}


def publish_ranks(rank: int, url: str, fenced_url: str, failing_url: str, out: str) -> None:
    """Publish versions 0-2 of `state` from every rank (each given only what it needs), then try a run
    another publisher owns, then a run where rank 1's uploads fail. Reports what each rank saw."""
    from pnyx.errors import FencedError, PeerFailedError, StoreUnavailableError
    from pnyx.store import open_store
    from pnyx.train.distributed import init_distributed
    from pnyx.weights.bits import from_torch
    from pnyx.weights.parallel import layout_of
    from pnyx.weights.publisher import Publisher

    d = init_distributed("cpu")
    full_layout = layout_of(from_torch(state(0)))
    report: dict[str, Any] = {"rank": rank, "world": d.world}
    pub = Publisher(open_store(url), anchor_every=2, int8_plane=True, chunk_bytes=8192, comm=d)
    need = pub.needs(full_layout)
    report["needs"] = sorted(need)
    for v in range(3):
        mine = {k: t for k, t in state(v).items() if k in need}
        pub.publish(v, mine, force_anchor=v == 0, state_layout=full_layout)

    other = Publisher(open_store(fenced_url), chunk_bytes=8192, comm=d)
    try:
        other.publish(0, {k: t for k, t in state(0).items() if k in need}, state_layout=full_layout)
        report["fenced"] = None
    except FencedError as e:
        report["fenced"] = str(e)

    class FailingStore:  # rank 1's uploads fail; everything else is the real store
        def __init__(self, inner: Any):
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def put(self, key: str, data: bytes, mode: Any = "overwrite") -> Any:
            if rank == 1 and "manifest" not in key:
                raise StoreUnavailableError(f"injected: put {key}")
            return self.inner.put(key, data, mode)

    failing = Publisher(FailingStore(open_store(failing_url)), chunk_bytes=8192, comm=d)
    try:
        failing.publish(0, {k: t for k, t in state(0).items() if k in need}, state_layout=full_layout)
        report["failure"] = None
    except (PeerFailedError, StoreUnavailableError) as e:
        report["failure"] = type(e).__name__
    write_json(Path(out) / f"publish-{rank}.json", report)
    d.close()


# --- checkpoints ------------------------------------------------------------------------------------------


def full_state(model: Any, optimizer: Any) -> dict[str, Any]:
    """Model and optimizer state, whole and on the CPU, keyed by parameter name (any number of ranks)."""
    import copy

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return copy.deepcopy({"model": msd, "optim": osd})  # one process: these are the live tensors


def tiny_trainer_state(model_dir: str, d: Any) -> tuple[Any, Any]:
    """The tiny model (sharded when `d` has several ranks) and its AdamW, before any step."""
    import torch

    from pnyx.models import load_model
    from pnyx.train.distributed import prepare_model
    from pnyx.train.step import make_optimizer

    model = prepare_model(load_model(model_dir, dtype="float32"), d, torch.float32, False)
    return model, make_optimizer(model, 1e-3, (0.9, 0.99), 0.0)


def one_step(model: Any, optimizer: Any, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, int(model.config.vocab_size), (2, 12), generator=g)
    model(input_ids=ids).logits.float().pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def checkpoint_ranks(rank: int, model_dir: str, url: str, out: str) -> None:
    """Two ranks: a step, an asynchronous checkpoint of v1 (training goes on while it is written), the
    state at v1 as reference; then a fresh sharded model loads v1 and reports what it holds."""
    import torch

    from pnyx.store import open_store
    from pnyx.train.checkpointer import Checkpointer
    from pnyx.train.distributed import init_distributed

    d = init_distributed("cpu")
    model, opt = tiny_trainer_state(model_dir, d)
    one_step(model, opt, seed=1)
    ck = Checkpointer(open_store(url), d, Path(out) / "local", keep=2, asynchronous=True)
    ref = full_state(model, opt)
    ck.save(1, model, opt, '{"uses": {"k": 1}}', "run-x")
    one_step(model, opt, seed=2)  # training continues while v1 is written
    ck.wait()
    fresh, fresh_opt = tiny_trainer_state(model_dir, d)
    commit = ck.load(1, fresh, fresh_opt)
    loaded = full_state(fresh, fresh_opt)
    if rank == 0:
        torch.save(
            {"ref": ref, "loaded": loaded, "cursor": commit.cursor, "world": commit.world},
            Path(out) / "dcp.pt",
        )
    d.close()


# --- a sharded step -------------------------------------------------------------------------------------


def sharded_step_ranks(rank: int, model_dir: str, out: str) -> None:
    """One `train_step` of the same batch on 2 FSDP2 ranks (SGD, lr 1: the update is the gradient), with a
    micro-batch budget that makes 3 micro-batches (one rank runs a filler); rank 0 reports the result."""
    import torch
    from train_support import scored_groups

    from pnyx.models import load_model, load_tokenizer
    from pnyx.train.distributed import init_distributed, prepare_model
    from pnyx.train.losses import LossSettings
    from pnyx.train.step import train_step

    d = init_distributed("cpu")
    model = load_model(model_dir, dtype="float32")
    groups = scored_groups(model, load_tokenizer(model_dir), n_groups=3, g=3)
    model = prepare_model(model, d, torch.float32, False)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    stats = train_step(
        model, opt, groups, LossSettings(dppo_delta=None), micro_batch_tokens=64, grad_clip=1e9, dist=d
    )
    state = {k: v.full_tensor() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save({"state": state, "stats": stats.__dict__}, Path(out) / "sharded.pt")
    d.close()
