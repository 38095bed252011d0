"""Helpers for the trainer tests (no tests here): the config overrides of a tiny trainer run, a trainer
over a store, and a scripted worker that writes signed groups (one right, one wrong answer each) with
behaviour logprobs from the model itself."""

from __future__ import annotations

from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pnyx.config import load_config, with_fields
from pnyx.protocol import layout
from pnyx.protocol.codec import encode_group
from pnyx.protocol.records import RolloutGroup, Sample
from pnyx.security.signing import Signer
from pnyx.store import open_store
from pnyx.train import checkpoint
from pnyx.train.ingest import ScoredGroup
from pnyx.train.loop import Trainer
from pnyx.weights import read_manifest

STAMP0 = 1_700_000_000_000
WORKER_SIGNER = Signer(Ed25519PrivateKey.from_private_bytes(bytes(range(32))))
"""A fixed worker key: the trainer refuses unsigned groups, and Ed25519 signatures are deterministic, so
two stores prepared alike still hold the same bytes (the kill tests compare them)."""


def overrides(model_dir: Path, **extra) -> dict:
    cfg = {
        "model": {"path": str(model_dir)},
        "env": {"name": "arith"},
        "run": {"steps": 3},
        "worker": {"max_new_tokens": 16, "group_size": 2},
        "trainer": {"groups_per_step": 2, "max_wait_s": 20.0, "lr": 1e-3},
        "algorithm": {"max_staleness": 10, "max_groups_per_prompt": 2},
        # `write_groups` scripts reference answers, not draws of the model: judged by the statistical checks
        "security": {"accept_unseeded": True},
    }
    for dotted, value in extra.items():
        section, field = dotted.split("__")
        cfg.setdefault(section, {})[field] = value
    return cfg


def make_trainer(url: str, model_dir: Path, resume: bool = False, **extra) -> Trainer:
    cfg = load_config(None, overrides(model_dir, **extra))
    cfg = with_fields(cfg, {"store.url": url})
    return Trainer(cfg, open_store(url), resume=resume)


def write_groups(store, model_dir: Path, version: int, n: int, worker: str = "w") -> list[str]:
    """A scripted worker: n groups at `version`, one right and one wrong answer each."""
    from pnyx.envs import get_env
    from pnyx.models import completion_logprobs, load_model, load_tokenizer, render_prompt

    env, tok, model = get_env("arith"), load_tokenizer(model_dir), load_model(model_dir)
    digest = read_manifest(store, version).weights.chain_digest
    keys = []
    for i, task in enumerate(env.sample("train", 0, n)):
        prompt = render_prompt(tok, task.prompt)
        comps = [
            tok.encode(f"<answer>{a}</answer>", add_special_tokens=False)
            for a in (task.answer, task.answer + 1)
        ]
        with torch.no_grad():
            logp, _, _ = completion_logprobs(model, [prompt] * 2, comps)
        samples = [
            Sample(
                tokens=c, logprobs=logp[j, : len(c)].tolist(), loss_mask=[1] * len(c), reward=float(j == 0)
            )
            for j, c in enumerate(comps)
        ]
        g = RolloutGroup(
            run_id=run_id_of(store),
            worker_id=worker,
            seq=i,
            policy_version=version,
            weights_digest=digest,
            env="arith",
            task_id=task.id,
            prompt_tokens=prompt,
            samples=samples,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            created_at=0.0,
            gen_seconds=0.0,
            score_seconds=0.0,
        )
        # A fixed stamp, so two stores prepared alike hold the same keys (the kill tests compare them).
        key = layout.rollout_key(version, worker, i, stamp_ms=STAMP0 + i)
        store.put(key, encode_group(g, signer=WORKER_SIGNER), mode="create")
        keys.append(key)
    return keys


def run_id_of(store) -> str:
    from pnyx.protocol.runfile import read_run

    return read_run(store).run_id


def scored_groups(model, tokenizer, n_groups: int = 2, g: int = 3) -> list[ScoredGroup]:
    """Groups whose behaviour logprobs are the model's own (an on-policy batch), rewards 1/0/0..."""
    from pnyx.models import completion_logprobs

    out = []
    for gi in range(n_groups):
        prompt = tokenizer.encode(f"Compute {gi}+{gi}.")
        comps = [tokenizer.encode(" " + "7" * (k + 1) + f" <answer>{k}</answer>") for k in range(g)]
        with torch.no_grad():
            logp, mask, _ = completion_logprobs(model, [prompt] * g, comps)
        samples = [
            Sample(
                tokens=c, logprobs=logp[i, : len(c)].tolist(), loss_mask=[1] * len(c), reward=float(i == 0)
            )
            for i, c in enumerate(comps)
        ]
        rec = RolloutGroup(
            run_id="r",
            worker_id="w",
            seq=gi,
            policy_version=0,
            weights_digest="d",
            env="arith",
            task_id=f"t{gi}",
            prompt_tokens=prompt,
            samples=samples,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            created_at=0.0,
            gen_seconds=0.0,
            score_seconds=0.0,
        )
        rewards = [s.reward for s in samples]
        adv = [1.0 if r else -1.0 / (g - 1) for r in rewards]
        out.append(ScoredGroup(f"k{gi}", 0, "w", f"t{gi}", rec, rewards, adv, rewards))
    return out


def batches(store, upto: int) -> list[list[str]]:
    return [checkpoint.read_batch_record(store, v).keys for v in range(1, upto + 1)]


def run_toml(model_dir: Path) -> str:
    import tomli_w

    return tomli_w.dumps(overrides(model_dir))


def prepared_run(root: Path, model_dir: Path) -> tuple[str, list[str]]:
    """A bootstrapped run (run.json, v0) holding 6 groups: the subprocesses resume it."""
    url = str(root)
    t = make_trainer(url, model_dir)
    t.start()
    return url, write_groups(t.store, model_dir, 0, 6)
