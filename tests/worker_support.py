"""Helpers for the worker tests (no tests here): a tiny run in a store, versions of its weights, checks.

A tiny run is what a trainer leaves in the store before any worker joins: `run.json` written by the
trainer's own `init_run` (with the trainer's public key), and version 0 published, signed, by the real
PULSE `Publisher`. Each version's weights are
the tiny model's plus seeded noise, so two versions give measurably different logprobs and a test can tell
which weights generated a sample.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NOISE = 0.05
REPO = Path(__file__).resolve().parent.parent


@dataclass
class TinyRun:
    store: Any
    cfg: Any
    model_dir: Path
    base: dict[str, Any]
    publisher: Any
    digests: dict[int, str] = field(default_factory=dict)

    def state(self, version: int) -> dict[str, Any]:
        """The bf16 weights of `version` (base + seeded noise), as the trainer would publish them."""
        import torch

        g = torch.Generator().manual_seed(1000 + version)
        noisy: dict[int, Any] = {}  # per storage: tied tensors (embedding and output head) stay tied
        out = {}
        for k, v in self.base.items():
            if v.data_ptr() not in noisy:
                noisy[v.data_ptr()] = (
                    v + NOISE * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
                )
            out[k] = noisy[v.data_ptr()].to(torch.bfloat16)
        return out

    def publish(self, version: int) -> str:
        m = self.publisher.publish(version, self.state(version))
        self.digests[version] = m.digest
        return m.digest

    def model_at(self, version: int) -> Any:
        """An fp32 copy of the model holding `version`'s weights (the reference for logprob checks)."""
        from pnyx.models import load_model

        model = load_model(self.model_dir)
        model.load_state_dict(self.state(version), strict=True)
        return model


def worker_settings(**over: Any) -> dict[str, Any]:
    base = {
        "group_size": 4,
        "prompts_per_cohort": 2,
        "max_new_tokens": 10,
        "poll_interval_s": 0.05,
        "heartbeat_interval_s": 0.1,
        "spool_max_groups": 64,
        # the random tiny model earns reward 0 almost always: with skipping on, nothing would be uploaded
        "skip_zero_variance": False,
    }
    return base | over


def create_signed_run(store: Any, config: dict[str, Any], info: dict[str, Any]) -> tuple[Any, Any]:
    """run.json written as the trainer writes it (`init_run` with the trainer's public key) and the
    trainer's signer bound to the run: (RunManifest, Signer). Workers refuse runs without a key."""
    from pnyx.train.bootstrap import init_run
    from pnyx.weights.trust import trainer_key_record, trainer_signer

    signer = trainer_signer()  # $PNYX_TRAINER_KEY: a throwaway key (tests/conftest.py)
    manifest = init_run(store, config, info, trainer_key_record(signer))
    return manifest, signer.for_run(manifest.run_id)


def make_run(
    url: str,
    model_dir: Path,
    anchor_every: int = 20,
    trainer: dict[str, Any] | None = None,
    security: dict[str, Any] | None = None,
    **worker: Any,
) -> TinyRun:
    """run.json (via the trainer's init_run) + version 0 in the store at `url` (`trainer`, `security`:
    overrides of those sections of the run, which workers read too). No trainer runs, so no one ticks:
    committed draws (on by default) are off unless `security` sets them (and the test ticks:
    `tests/test_commit_ahead.py`)."""
    import torch

    from pnyx.config import load_config
    from pnyx.models import load_model, tokenizer_digest
    from pnyx.store import open_store
    from pnyx.weights.publisher import Publisher

    torch.set_num_threads(1)
    store = open_store(url)
    cfg = load_config(
        overrides={
            "model": {"path": str(model_dir)},
            "env": {"name": "arith", "kwargs": {"digits": 1}},
            "worker": worker_settings(**worker),
            "trainer": trainer or {},
            "security": {"committed_draws": False, **(security or {})},
        }
    )
    model = load_model(model_dir)
    info = {
        "name": "tiny-test",
        "vocab_size": int(model.config.vocab_size),
        "tokenizer_digest": tokenizer_digest(model_dir),
        "model_type": model.config.model_type,
    }
    _, signer = create_signed_run(store, cfg.model_dump(mode="json"), info)
    clones: dict[int, Any] = {}  # clone per storage, so tied tensors stay one tensor
    base = {k: clones.setdefault(v.data_ptr(), v.detach().clone()) for k, v in model.state_dict().items()}
    run = TinyRun(
        store, cfg, Path(model_dir), base, Publisher(store, anchor_every=anchor_every, signer=signer)
    )
    run.publish(0)
    return run


def on_generate(worker: Any, hook: Any) -> list[int]:
    """Run `hook(call_index)` at the start of every engine generate call of `worker`, then generate for real
    (a test's event inside a cohort: a publish, a corruption, an outage, a stop). Returns the call counter."""
    real = worker.gen.engine.generate
    calls = [0]

    def generate(prompt_ids: Any, params: Any) -> Any:
        hook(calls[0])
        calls[0] += 1
        return real(prompt_ids, params)

    worker.gen.engine.generate = generate
    return calls


def rollout_groups(store: Any, skips: bool = False) -> list[tuple[str, Any]]:
    """Every (key, decoded group) under rollouts/, validated by the protocol's decoder: the groups offered for
    training, or with `skips` the skip records (`layout.is_skip_key`)."""
    from pnyx.protocol import decode_group, layout

    return [
        (m.key, decode_group(store.get(m.key)))
        for m in store.list(layout.ROLLOUTS_PREFIX)
        if layout.is_skip_key(m.key) == skips
    ]


def logprob_error(model: Any, group: Any, sample: Any) -> float:
    """Largest |behaviour logprob - logprob under `model`| over the sample's model tokens."""
    import torch

    from pnyx.models import completion_logprobs

    with torch.no_grad():
        logp, mask, _ = completion_logprobs(
            model, [group.prompt_tokens], [sample.tokens], temperature=group.temperature,
            top_k=group.top_k, top_p=group.top_p,
        )  # fmt: skip
    ref = logp[0, : len(sample.tokens)].tolist()
    return max(abs(a - b) for a, b, m in zip(sample.logprobs, ref, sample.loss_mask, strict=True) if m)


def worker_command(store_url: str, worker_id: str, *extra: str) -> list[str]:
    """A real `pnyx worker` process."""
    return [sys.executable, "-m", "pnyx", "worker", "--store", store_url, "--id", worker_id, *extra]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def start(cmd: list[str], log_path: Path) -> subprocess.Popen:
    log = open(log_path, "wb")  # noqa: SIM115 - closed by the caller through the process's lifetime
    return subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=log, stderr=subprocess.STDOUT)


def wait_for(predicate: Any, timeout_s: float, what: str, interval_s: float = 0.2) -> Any:
    end = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)
