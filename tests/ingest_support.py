"""Helpers for the ingestion tests (no tests here): hand-made rollout groups on arith with a byte-level
'tokenizer', put into a store under the real layout, and an `Ingestor` over them."""

from __future__ import annotations

from pnyx.envs import get_env
from pnyx.protocol import layout
from pnyx.protocol.codec import encode_group
from pnyx.protocol.records import RolloutGroup, Sample
from pnyx.train.ingest import Ingestor, IngestSettings

ENV = get_env("arith")
RUN = "run-test"


def detok(ids: list[int]) -> str:
    """Byte-level 'tokenizer' for tests: token id = byte value."""
    return bytes(ids).decode("utf-8", "replace")


def tok(text: str) -> list[int]:
    return list(text.encode())


def make_group(version: int, worker: str, seq: int, task_index: int = 0, answers=None, claimed=None):
    """A group for task `arith/train/0/{task_index}`; `answers` are the completions' answer strings
    (default: one right, one wrong), `claimed` the rewards the worker reports (default: honest)."""
    task = ENV.sample("train", 0, task_index + 1)[task_index]
    if answers is None:
        answers = [str(task.answer), str(task.answer + 1)]
    samples = []
    for i, a in enumerate(answers):
        ids = tok(f"<answer>{a}</answer>")
        honest = ENV.score(task, detok(ids)).reward
        samples.append(
            Sample(
                tokens=ids,
                logprobs=[-0.5] * len(ids),
                loss_mask=[1] * len(ids),
                reward=claimed[i] if claimed is not None else honest,
            )
        )
    return RolloutGroup(
        run_id=RUN,
        worker_id=worker,
        seq=seq,
        policy_version=version,
        weights_digest="d",
        env="arith",
        task_id=task.id,
        prompt_tokens=[1, 2, 3],
        samples=samples,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        created_at=0.0,
        gen_seconds=0.0,
        score_seconds=0.0,
    )


def put(store, group, stamp_ms: int | None = None) -> str:
    key = layout.rollout_key(group.policy_version, group.worker_id, group.seq, stamp_ms)
    store.put(key, encode_group(group), mode="create")
    return key


def make_ingestor(store, grace_s: float = 0.0, **settings) -> Ingestor:
    return Ingestor(
        store=store,
        env=ENV,
        detokenize=detok,
        settings=IngestSettings(**settings),
        run_id=RUN,
        sweep_grace_s=grace_s,
    )


def signed_ingestor(store, cursor=None, **settings) -> Ingestor:
    """An ingestor that requires signed groups (the trainer's), with `settings` and an optional cursor."""
    from pnyx.train.ingest import Cursor

    return Ingestor(
        store=store, env=ENV, detokenize=detok, settings=IngestSettings(**settings), run_id=RUN,
        require_signatures=True, sweep_grace_s=0.0, cursor=cursor or Cursor(seqs_from_zero=True),
    )  # fmt: skip


def put_signed(store, group, signer) -> str:
    """Upload `group` signed by `signer` (a `pnyx.security.signing.Signer`); its key."""
    key = layout.rollout_key(group.policy_version, group.worker_id, group.seq)
    store.put(key, encode_group(group, signer=signer), mode="create")
    return key
