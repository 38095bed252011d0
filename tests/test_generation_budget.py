"""The generation budget is resolved once: unset means the environment's, the trainer records the number in
run.json, workers and `pnyx run`'s evaluator use the recorded number."""

from __future__ import annotations

import pytest
import torch
from worker_support import make_run, rollout_groups

from pnyx.config import load_config
from pnyx.protocol.runfile import read_run
from pnyx.store import open_store
from pnyx.train.loop import Trainer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.mark.parametrize(("env", "want"), [("arith", 64), ("gsm8k", 384)])
def test_trainer_records_the_environments_budget_in_run_json(tmp_path, tiny_model_dir, env, want):
    cfg = load_config(overrides={"model": {"path": str(tiny_model_dir)}, "env": {"name": env}})
    assert cfg.worker.max_new_tokens is None
    store = open_store(tmp_path / "run")
    trainer = Trainer(cfg, store)
    trainer.start()
    assert read_run(store).config["worker"]["max_new_tokens"] == want
    assert trainer.cfg.worker.max_new_tokens == want  # what the Dr.GRPO normaliser reads


def test_trainer_records_an_explicit_budget_unchanged(tmp_path, tiny_model_dir):
    cfg = load_config(overrides={"model": {"path": str(tiny_model_dir)}, "worker": {"max_new_tokens": 9}})
    store = open_store(tmp_path / "run")
    Trainer(cfg, store).start()
    assert read_run(store).config["worker"]["max_new_tokens"] == 9


def test_a_resumed_trainer_keeps_the_recorded_budget(tmp_path, tiny_model_dir):
    over = {"model": {"path": str(tiny_model_dir)}, "env": {"name": "arith"}}
    store = open_store(tmp_path / "run")
    Trainer(load_config(overrides=over), store).start()
    resumed = Trainer(load_config(overrides=over), store, resume=True)
    resumed.start()
    assert resumed.cfg.worker.max_new_tokens == 64


def test_worker_generates_with_the_budget_recorded_in_run_json(tmp_path, tiny_model_dir):
    from pnyx.rollout.worker import Worker, WorkerOptions

    run = make_run(str(tmp_path / "run"), tiny_model_dir, max_new_tokens=3)  # arith's own budget is 64
    worker = Worker(run.store, WorkerOptions(worker_id="w1", max_groups=2))
    worker.run()
    assert worker.gen.max_new_tokens == 3
    lengths = [len(s.tokens) for _, g in rollout_groups(run.store) for s in g.samples]
    assert lengths and max(lengths) <= 3


def test_pnyx_run_evaluator_uses_the_budget_recorded_in_run_json(tmp_path, tiny_model_dir):
    from pnyx.cli.run import _make_evaluator

    over = {"model": {"path": str(tiny_model_dir)}, "run": {"eval_tasks": 2}}
    store = open_store(tmp_path / "run")
    Trainer(load_config(overrides=over | {"worker": {"max_new_tokens": 5}}), store).start()
    plan = type("Plan", (), {"cfg": load_config(overrides=over), "store_url": str(tmp_path / "run")})()
    evaluator = _make_evaluator(plan)  # the plan's own config leaves the budget unset
    assert evaluator.sampling["max_new_tokens"] == 5
    assert evaluator.evaluate(0).max_new_tokens == 5
