"""A real trainer process is never silent and stops promptly, whatever it is doing, and resumes exactly.

The run holds a backlog of zero-variance groups (worthless: every sample got the same reward) ranked
before six good ones, and every fetch is slowed by `python -m pnyx_harness.trainer --ingest-delay-s`, so the trainer
spends a long time ingesting before it can step. The first process is SIGTERMed in the middle of that
ingestion; the second resumes, steps three times on the good groups, then waits for data that never comes
and is SIGTERMed while waiting. Throughout, no two of its log lines are more than 10 s apart.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from train_support import STAMP0, WORKER_SIGNER, make_trainer, overrides, run_id_of, write_groups

from pnyx.protocol import layout
from pnyx.protocol.codec import encode_group
from pnyx.protocol.records import RolloutGroup, Sample
from pnyx.store import open_store
from pnyx.train import checkpoint
from pnyx.train.progress import STATUS_KEY

REPO = Path(__file__).resolve().parents[1]
BACKLOG = 240
MAX_GAP_S = 10.0
STOP_WITHIN_S = 10.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from pnyx_harness.models import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-liveness"))


def write_zero_variance_backlog(store, model_dir: Path, n: int) -> None:
    """n valid groups of worker "w" at v0 (seq 1000...) whose two samples are the same wrong answer, stamped
    before the good groups of `write_groups` (worker "w", seq 0-5), so they rank first."""
    from pnyx.envs import get_env
    from pnyx.models import load_tokenizer, render_prompt
    from pnyx.weights import read_manifest

    env, tok = get_env("arith"), load_tokenizer(model_dir)
    digest, run_id = read_manifest(store, 0).weights.chain_digest, run_id_of(store)
    tasks = env.sample("train", 1, 50)
    prompts = {t.id: render_prompt(tok, t.prompt) for t in tasks}
    for seq in range(n):
        task = tasks[seq % len(tasks)]
        wrong = tok.encode(f"<answer>{task.answer + 7}</answer>", add_special_tokens=False)
        samples = [
            Sample(tokens=wrong, logprobs=[-1.0] * len(wrong), loss_mask=[1] * len(wrong), reward=0.0)
        ] * 2
        g = RolloutGroup(
            run_id=run_id, worker_id="w", seq=1000 + seq, policy_version=0, weights_digest=digest, env="arith",
            task_id=task.id, prompt_tokens=prompts[task.id], samples=samples, temperature=1.0, top_p=1.0, top_k=0,
            created_at=0.0, gen_seconds=0.0, score_seconds=0.0,
        )  # fmt: skip
        key = layout.rollout_key(0, "w", 1000 + seq, stamp_ms=STAMP0 - 10 * n + seq)
        store.put(key, encode_group(g, signer=WORKER_SIGNER), mode="create")


class Trainer:
    """`python -m pnyx_harness.trainer --ingest-delay-s X ... --resume` with its stderr lines timestamped as
    they arrive."""

    def __init__(self, url: str, cfg: Path, delay_s: float):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pnyx_harness.trainer", "--ingest-delay-s", str(delay_s), "--store", url,
             "--config", str(cfg), "--resume"],
            env=env, cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append((time.monotonic(), line.rstrip()))

    def wait_for(self, text: str, timeout_s: float = 180.0) -> None:
        end = time.monotonic() + timeout_s
        while not any(text in line for _, line in self.lines):
            if self.proc.poll() is not None or time.monotonic() > end:
                raise AssertionError(f"no line with {text!r}; log:\n" + self.log()[-4000:])
            time.sleep(0.1)

    def stop(self) -> float:
        """SIGTERM; seconds until the process exited (it must exit 0)."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(60)
        took = time.monotonic() - t0
        self._reader.join(5)
        assert rc == 0, self.log()[-4000:]
        return took

    def max_gap(self) -> float:
        """Longest silence between trainer log lines, from its first line to its exit."""
        times = [t for t, line in self.lines if " trainer " in f" {line} "]
        return max(b - a for a, b in zip(times, times[1:], strict=False))

    def log(self) -> str:
        return "\n".join(line for _, line in self.lines)


@pytest.mark.slow
def test_trainer_logs_every_10s_stops_within_10s_of_sigterm_and_resumes_exactly(tmp_path, model_dir):
    import tomli_w

    url = str(tmp_path / "run")
    # the backlog is 240 groups of one worker at v0: a flood by the run's default limit (44 here)
    unlimited = {"security__flood_limit": 1_000_000}
    t = make_trainer(url, model_dir, **unlimited)
    t.start()
    write_zero_variance_backlog(t.store, model_dir, BACKLOG)
    good = write_groups(t.store, model_dir, 0, 6)
    # the scripted groups are reference answers with v0 logprobs, not samples: the random tiny model moves
    # them past the sampling checks' default bounds one or two versions later (this test is about liveness)
    loose = {"security__lp_gap_per_version": 5.0, "security__plausibility_z": 1e6}
    cfg = overrides(model_dir, run__steps=4, trainer__max_wait_s=300.0, **loose, **unlimited)
    (tmp_path / "cfg.toml").write_text(tomli_w.dumps(cfg))
    torch.set_num_threads(1)

    first = Trainer(url, tmp_path / "cfg.toml", delay_s=0.8)
    first.wait_for("ingesting")  # the progress line: it has been ingesting for a while, silently otherwise
    took = first.stop()
    assert took < STOP_WITHIN_S, first.log()[-3000:]
    assert first.max_gap() <= MAX_GAP_S, first.log()[-3000:]
    store = open_store(url)
    from pnyx.train import checkpointer

    rejected_before = len(json.loads(checkpointer.read_commit(store, 0).cursor)["rejected"])
    assert 0 < rejected_before < BACKLOG  # stopped in the middle of the backlog

    second = Trainer(url, tmp_path / "cfg.toml", delay_s=0.8)
    second.wait_for("trainer v=3 groups=2")
    second.wait_for("trainer v=3 waiting")  # no more data: a progress line while waiting
    took = second.stop()
    assert took < STOP_WITHIN_S, second.log()[-3000:]
    assert second.max_gap() <= MAX_GAP_S, second.log()[-3000:]
    assert "had the same reward for every sample" in second.log()  # the zero-variance warning

    assert [checkpoint.read_batch_record(store, v).keys for v in (1, 2, 3)] == [
        good[0:2],
        good[2:4],
        good[4:6],
    ]
    assert checkpoint.read_batch_record(store, 4) is None
    status = json.loads(store.get(STATUS_KEY))  # what `pnyx status` shows: the trainer's last word
    assert status["phase"] == "stopped" and status["version"] == 3 and "waiting" in status["backlog"]
    last = checkpoint.read_metrics(store)[-1]
    assert last["drops"] == {"zero_variance": BACKLOG}  # each worthless group counted once across the stop
    from pnyx.weights import verify_chain

    assert verify_chain(store).ok
