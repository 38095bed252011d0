"""A real fleet on an S3 API: one trainer and two workers as separate processes, meeting only in the bucket.

The processes are started exactly as docs/fleet.md tells a user to (`pnyx trainer --store s3://...`,
`pnyx worker --store s3://...`), with credentials from the environment, against the moto S3 server on
loopback. The model is the tiny random test model after a few seconds of supervised training on noisy
one-digit sums (half the shown answers are off by one or two), so it answers in format and is right about
15% of the time: groups have reward variance and the trainer actually steps. A watcher records every
heartbeat it sees.
"""

from __future__ import annotations

import random
import re
import signal
import sys
import threading
from pathlib import Path

import pytest
from worker_support import start, wait_for, worker_command

from pnyx.errors import NotFoundError, RecordRejected
from pnyx.protocol import Heartbeat, decode_json, layout
from pnyx.store import open_store

pytestmark = [pytest.mark.s3, pytest.mark.slow]

STEPS = 200  # a cap: the test stops the trainer (SIGTERM) once it has trained on groups of both workers
WORKERS = ("fleet-a", "fleet-b")
ENV_KWARGS = '{"digits": 1, "ops": ["+"]}'
RUN_SETTINGS = [
    f"--run.steps={STEPS}",
    "--env.name=arith",
    f"--env.kwargs={ENV_KWARGS}",
    "--worker.group_size=4",
    "--worker.prompts_per_cohort=2",
    "--worker.max_new_tokens=16",
    "--worker.poll_interval_s=0.2",
    "--worker.heartbeat_interval_s=0.2",
    "--trainer.groups_per_step=4",
    "--trainer.max_wait_s=150",
    "--algorithm.max_staleness=4",
]


def heartbeat_digest(hb: Heartbeat) -> str:
    digest = getattr(hb, "digest", "")
    if digest:
        return digest
    m = re.search(r"digest=([0-9a-f]+)", hb.detail)
    return m.group(1) if m else ""


class HeartbeatWatcher(threading.Thread):
    """Polls workers/ and records every (version, digest) each worker reported loaded (`seen`) or fetched and
    verified, not loaded yet (`staged`: under committed draws a worker loads it at its next tick)."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.store = open_store(url)
        self.seen: dict[str, set[tuple[int, str]]] = {}
        self.staged: dict[str, set[tuple[int, str]]] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for meta in self.store.list(layout.WORKERS_PREFIX):
                try:
                    hb = decode_json(self.store.get(meta.key), Heartbeat)
                except (NotFoundError, RecordRejected):
                    continue
                if hb.version >= 0:
                    self.seen.setdefault(hb.worker_id, set()).add((hb.version, heartbeat_digest(hb)))
                if hb.staged >= 0:
                    self.staged.setdefault(hb.worker_id, set()).add((hb.staged, hb.staged_digest))
            self.stop.wait(0.2)


@pytest.fixture(scope="module")
def fleet_model(tmp_path_factory) -> Path:
    """A tiny model that is sometimes right on one-digit sums (supervised on noisy answers)."""
    import torch

    from pnyx.envs import get_env
    from pnyx.models import load_model, load_tokenizer, render_prompt
    from pnyx_harness.models import make_tiny_model_dir

    torch.set_num_threads(1)
    path = make_tiny_model_dir(tmp_path_factory.mktemp("fleet-model"))
    model, tok = load_model(path), load_tokenizer(path)
    tasks = get_env("arith", digits=1, ops=["+"]).sample("train", 0, 512)
    rng = random.Random(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(150):
        rows = []
        for t in (rng.choice(tasks) for _ in range(16)):
            shown = t.answer if rng.random() < 0.5 else t.answer + rng.choice([-2, -1, 1, 2])
            answer = tok.encode(f"<answer>{shown}</answer>", add_special_tokens=False) + [tok.eos_token_id]
            rows.append((render_prompt(tok, t.prompt), answer))
        width = max(len(p) + len(c) for p, c in rows)
        ids = torch.full((len(rows), width), tok.pad_token_id)
        labels = torch.full((len(rows), width), -100)
        attn = torch.zeros(len(rows), width, dtype=torch.long)
        for i, (p, c) in enumerate(rows):
            ids[i, : len(p) + len(c)] = torch.tensor(p + c)
            labels[i, len(p) : len(p) + len(c)] = torch.tensor(c)
            attn[i, : len(p) + len(c)] = 1
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval().save_pretrained(path)
    return path


def test_trainer_and_two_workers_meet_only_in_s3(s3_url, fleet_model, tmp_path):
    from pnyx.train.checkpoint import read_batch_record, read_metrics
    from pnyx.weights import read_manifest
    from pnyx.weights.manifest import latest_version

    settings = [*RUN_SETTINGS, f"--model.path={fleet_model}"]
    trainer = start(
        [sys.executable, "-m", "pnyx", "trainer", "--store", s3_url, *settings], tmp_path / "trainer.log"
    )
    workers = [start(worker_command(s3_url, w), tmp_path / f"{w}.log") for w in WORKERS]
    watcher = HeartbeatWatcher(s3_url)
    procs = [trainer, *workers]
    try:
        watcher.start()
        store = open_store(s3_url)

        def trained_on() -> set[str]:
            newest = latest_version(store) or 0
            used: set[str] = set()
            for v in range(1, newest + 1):
                record = read_batch_record(store, v)
                if record is not None:
                    used |= {layout.parse_rollout_key(k)[1] for k in record.keys}
            return used

        # the workers join whenever they are ready (one may start seconds after the other): the trainer
        # steps on what landed, and within a few steps has trained on groups of both (v1 alone may have)
        wait_for(
            lambda: (
                ((latest_version(store) or 0) >= 2 and trained_on() >= set(WORKERS))
                or trainer.poll() is not None
            ),
            240,
            "two versions and groups of both trained",
        )
        trainer.send_signal(signal.SIGTERM)
        code = trainer.wait(120)
        assert code == 0, (tmp_path / "trainer.log").read_text(errors="replace")[-3000:]
        newest = latest_version(store)
        assert newest is not None and newest >= 2
        digest = read_manifest(store, newest).weights.chain_digest
        # both workers follow the trainer to its newest version, fetched and verified: loaded, or (committed
        # draws, the default) staged for their next cohort, whose tick a stopped trainer no longer writes
        # (its last tick, as it stopped, let the cohorts then committed draw and load what they named)
        wait_for(
            lambda: all(
                (newest, digest) in watcher.seen.get(w, set()) | watcher.staged.get(w, set()) for w in WORKERS
            ),
            90,
            "workers at newest",
        )
        for w in workers:
            w.send_signal(signal.SIGTERM)
        for w, name in zip(workers, WORKERS, strict=True):
            assert w.wait(90) == 0, (tmp_path / f"{name}.log").read_text(errors="replace")[-3000:]
        # the trainer ingested (validated and re-scored) groups of both workers, agreeing with their rewards,
        # and trained on both and only on theirs
        final = read_metrics(store)[-1]
        assert all(final["scored"].get(w, 0) > 0 for w in WORKERS), final["scored"]
        assert not any(final["disagreements"].get(w, 0) for w in WORKERS), final["disagreements"]
        assert trained_on() == set(WORKERS)
    finally:
        watcher.stop.set()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
