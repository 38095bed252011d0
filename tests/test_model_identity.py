"""A worker proves it holds the run's model: the trainer records the model's source in run.json, a real
`Worker.join` resolves the same model (a hub id pinned to the trainer's commit, or the folder) and refuses
a copy whose files, tokenizer or vocabulary differ, with a ConfigError that says what differs.

Runs are created by the real trainer (`Trainer.start`: run.json and version 0) on a local-folder store."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from pnyx.config import load_config, with_fields
from pnyx.errors import ConfigError
from pnyx.protocol.runfile import read_run
from pnyx.rollout.worker import Worker, WorkerOptions
from pnyx.store import open_store
from pnyx.train.loop import Trainer
from pnyx_harness.models import make_hub_cache, make_tiny_model_dir

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def pnyx_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PNYX_CACHE_DIR", str(tmp_path / "pnyx-cache"))
    return tmp_path / "pnyx-cache"


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "hf-home"
    home.mkdir()
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    return home


def start_run(url: str, model: str, **model_fields) -> Trainer:
    cfg = load_config(
        None,
        {
            "model": {"path": model, **model_fields},
            "env": {"name": "arith", "kwargs": {"digits": 1}},
            "worker": {
                "group_size": 2,
                "prompts_per_cohort": 1,
                "max_new_tokens": 8,
                "poll_interval_s": 0.05,
            },
        },
    )
    cfg = with_fields(cfg, {"store.url": url})
    trainer = Trainer(cfg, open_store(url))
    trainer.start()
    return trainer


def join(url: str, model: str | None = None) -> Worker:
    worker = Worker(open_store(url), WorkerOptions(worker_id="w1", model_path=model, join_timeout_s=60))
    try:
        worker.join()
    finally:
        if worker.link.syncer is not None:
            worker.link.syncer.stop()
    return worker


def test_run_json_records_the_hub_id_and_the_commit_it_resolved(tmp_path, hf_home, tiny_model_dir):
    commit = make_hub_cache(hf_home, "org/tiny", tiny_model_dir)
    start_run(str(tmp_path / "run"), "org/tiny")
    source = read_run(open_store(str(tmp_path / "run"))).model["source"]
    assert (source["kind"], source["id"], source["commit"]) == ("hub", "org/tiny", commit)
    assert source["files"]["model.safetensors"] and source["digest"]


def test_worker_with_a_byte_identical_copy_of_the_model_joins(tmp_path, tiny_model_dir):
    url = str(tmp_path / "run")
    start_run(url, str(tiny_model_dir))
    copy = shutil.copytree(tiny_model_dir, tmp_path / "copy")
    assert join(url, str(copy)).progress.version == 0


def test_worker_whose_weights_differ_is_refused_at_join_naming_the_file(tmp_path, tiny_model_dir):
    url = str(tmp_path / "run")
    start_run(url, str(tiny_model_dir))
    other = make_tiny_model_dir(tmp_path / "other", seed=1)  # same tokenizer and shapes, other weights
    with pytest.raises(ConfigError, match=r"not the run's(.|\n)*model.safetensors: different content"):
        join(url, str(other))


def test_worker_whose_tokenizer_and_vocabulary_differ_is_refused_naming_both(tmp_path, tiny_model_dir):
    url = str(tmp_path / "run")
    start_run(url, str(tiny_model_dir))
    other = make_tiny_model_dir(tmp_path / "other", vocab=400)
    with pytest.raises(ConfigError) as err:
        join(url, str(other))
    assert "tokenizer: the run's digest" in str(err.value) and "vocab_size: the run's 512, here 400" in str(
        err.value
    )


def test_worker_resolves_the_runs_commit_even_after_main_moved(tmp_path, hf_home, tiny_model_dir):
    url = str(tmp_path / "run")
    make_hub_cache(hf_home, "org/tiny", tiny_model_dir)
    start_run(url, "org/tiny")
    make_hub_cache(hf_home, "org/tiny", make_tiny_model_dir(tmp_path / "v2", seed=1))  # a new push to main
    assert join(url).progress.version == 0  # resolving main instead of the run's commit would be refused


def test_worker_without_the_runs_hub_model_is_refused_with_how_to_fetch_it(tmp_path, hf_home, tiny_model_dir):
    url = str(tmp_path / "run")
    make_hub_cache(hf_home, "org/tiny", tiny_model_dir)
    start_run(url, "org/tiny")
    shutil.rmtree(hf_home / "hub")  # another machine, with an empty cache
    with pytest.raises(
        ConfigError, match=r"does not have the run's model \(hub model org/tiny(.|\n)*hf download"
    ):
        join(url)
