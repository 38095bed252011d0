"""`pnyx export`: a verified published version as a Hugging Face folder that transformers loads as it is.

Fast tests export version 0 of a run made by the real trainer (`Trainer.start`) on a local-folder store.
The slow test is the Must-show: a real trainer process and a real worker process train the shipped tiny
model for a few steps, `pnyx export` (a real process) writes the final version, and the folder loaded with
`AutoModelForCausalLM.from_pretrained` holds exactly the published weights and scores exactly the same
held-out pass@1 under the pnyx engine as the published version does.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from worker_support import child_env, start, wait_for, worker_command

from pnyx.cli.export import export_run
from pnyx.config import load_config, with_fields
from pnyx.errors import ConfigError, IntegrityError
from pnyx.models.tokenizer import TOKENIZER_FILES
from pnyx.protocol import layout
from pnyx.store import open_store
from pnyx.train.loop import Trainer
from pnyx.weights import Syncer, read_manifest

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parent.parent


def make_run(url: str, model: Path) -> None:
    cfg = load_config(None, {"model": {"path": str(model)}, "env": {"name": "arith"}})
    cfg = with_fields(cfg, {"store.url": url})
    Trainer(cfg, open_store(url)).start()  # run.json + version 0, published in bf16


def published(url: str, version: int) -> dict[str, torch.Tensor]:
    return Syncer(open_store(url)).sync(to_version=version)[1]


@pytest.fixture(scope="module")
def run_url(tmp_path_factory, tiny_model_dir) -> str:
    url = str(tmp_path_factory.mktemp("export-run") / "run")
    make_run(url, tiny_model_dir)
    return url


def test_export_writes_a_folder_transformers_loads_holding_the_published_weights(run_url, tmp_path):
    from transformers import AutoModelForCausalLM

    result = export_run(open_store(run_url), tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    assert result.version == 0 and result.dtype == "bfloat16" and model.dtype == torch.bfloat16
    want, got = published(run_url, 0), model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_export_copies_the_runs_tokenizer_byte_for_byte(run_url, tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    export_run(open_store(run_url), tmp_path / "out")
    names = [n for n in TOKENIZER_FILES if (tiny_model_dir / n).is_file()]
    assert names and all(
        (tmp_path / "out" / n).read_bytes() == (tiny_model_dir / n).read_bytes() for n in names
    )
    assert AutoTokenizer.from_pretrained(tmp_path / "out").encode("12 + 7") == AutoTokenizer.from_pretrained(
        tiny_model_dir
    ).encode("12 + 7")


def test_export_in_a_requested_dtype_keeps_the_published_values(run_url, tmp_path):
    from transformers import AutoModelForCausalLM

    export_run(open_store(run_url), tmp_path / "out", dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    want = published(run_url, 0)
    assert model.dtype == torch.float32
    assert all(torch.equal(want[k].float(), v) for k, v in model.state_dict().items())


def test_export_records_run_version_and_chain_digest_next_to_the_model(run_url, tmp_path):
    export_run(open_store(run_url), tmp_path / "out")
    record = json.loads((tmp_path / "out" / "pnyx_export.json").read_text())
    assert record["version"] == 0
    assert record["chain_digest"] == read_manifest(open_store(run_url), 0).weights.chain_digest


def test_export_refuses_weights_that_do_not_verify_and_writes_nothing(tmp_path, tiny_model_dir):
    url = str(tmp_path / "run")
    make_run(url, tiny_model_dir)
    store = open_store(url)
    (obj,) = read_manifest(store, 0).weights.anchor
    key = layout.weights_payload(0, obj.name)
    data = bytearray(store.get(key))
    data[len(data) // 2] ^= 0x01
    store.put(key, bytes(data))
    with pytest.raises(IntegrityError):
        export_run(store, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out-*"))


def test_export_never_writes_into_a_folder_that_is_not_empty(run_url, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not an empty folder"):
        export_run(open_store(run_url), tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


def test_export_without_the_runs_model_here_is_refused_and_a_copy_can_be_named(tmp_path, tiny_model_dir):
    url = str(tmp_path / "run")
    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    make_run(url, model)
    shutil.move(model, tmp_path / "moved")  # the trainer's folder is not on this machine
    with pytest.raises(ConfigError, match="does not have the run's model"):
        export_run(open_store(url), tmp_path / "out")
    assert export_run(open_store(url), tmp_path / "out", model=str(tmp_path / "moved")).version == 0


def test_export_help_does_not_import_torch():
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from pnyx.cli import app\n"
        "r = CliRunner().invoke(app, ['export', '--help'])\n"
        "assert r.exit_code == 0 and '--out' in r.output, r.output\n"
        "bad = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=child_env())


# --- the Must-show: a finished run, exported, scores exactly as published -----------------------------------

STEPS = 3
RUN_SETTINGS = [
    f"--run.steps={STEPS}",
    "--env.name=arith",
    "--worker.group_size=4",
    "--worker.prompts_per_cohort=2",
    "--worker.poll_interval_s=0.2",
    "--trainer.groups_per_step=2",
    "--trainer.max_wait_s=240",
    "--algorithm.max_staleness=4",
]


@pytest.mark.slow
def test_exported_finished_run_loads_and_scores_exactly_like_the_published_version(tmp_path):
    from transformers import AutoModelForCausalLM

    from pnyx.config import shipped_model_path
    from pnyx.envs import get_env
    from pnyx.eval.runner import VersionEvaluator, evaluate_model, heldout_tasks
    from pnyx.models import load_tokenizer
    from pnyx.rollout.engines import make_engine
    from pnyx.weights.manifest import latest_version

    url, out = str(tmp_path / "run"), tmp_path / "export"
    trainer = start(
        [sys.executable, "-m", "pnyx", "trainer", "--store", url, *RUN_SETTINGS], tmp_path / "trainer.log"
    )
    worker = start(worker_command(url, "w1"), tmp_path / "worker.log")
    try:
        assert trainer.wait(600) == 0, (tmp_path / "trainer.log").read_text(errors="replace")[-3000:]
    finally:
        worker.send_signal(signal.SIGTERM)
        wait_for(lambda: worker.poll() is not None, 120, "the worker to stop")
        if trainer.poll() is None:
            trainer.kill()
    final = latest_version(open_store(url))
    assert final == STEPS

    cmd = [sys.executable, "-m", "pnyx", "export", "--store", url, "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)  # as any user would
    want = published(url, final)
    assert (
        all(torch.equal(want[k], v) for k, v in hf.state_dict().items())
        and want.keys() == hf.state_dict().keys()
    )
    v0 = published(url, 0)
    assert any(not torch.equal(want[k], v0[k]) for k in want)  # the run trained: not version 0's weights

    cfg = load_config(None, RUN_SETTINGS)
    w = cfg.worker
    sampling = dict(temperature=w.temperature, top_p=w.top_p, top_k=w.top_k, max_new_tokens=w.max_new_tokens)
    env = get_env("arith")
    exported = evaluate_model(
        make_engine("torch", out, load_tokenizer(out)),
        env,
        heldout_tasks(env, 64, cfg.run.seed),
        seed=cfg.run.seed,
        **sampling,
    )
    version = VersionEvaluator(
        open_store(url), shipped_model_path(), "arith", tasks=64, seed=cfg.run.seed, **sampling
    ).evaluate(final)
    assert version.pass_at_1 > 0  # equal zeros would prove nothing
    assert exported.pass_at_1 == version.pass_at_1 and exported.format_rate == version.format_rate
