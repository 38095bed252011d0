"""Held-out evaluation: the interval maths, the per-task bookkeeping of pass@k, evaluating an exact
published version, the eval record format, the learning-curve PNG and the `pnyx eval` command."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from pnyx.envs.base import Environment, Score, Task, user_prompt
from pnyx.eval.runner import (
    EvalReport,
    bootstrap_interval,
    evaluate_model,
    pass_at_1_interval,
    wilson_interval,
)


class ParityEnv(Environment):
    """Task i is 'correct' iff i is even, whatever the completion: the model cannot change the score."""

    name = "parity"
    stop_strings = ["."]

    def sample(self, split, seed, n, start=0):
        return [
            Task(id=f"parity/{split}/{seed}/{i}", prompt=user_prompt(f"say {i}"), answer=i)
            for i in range(start, start + n)
        ]

    def task(self, task_id):
        i = int(task_id.rsplit("/", 1)[1])
        return Task(id=task_id, prompt=user_prompt(f"say {i}"), answer=i)

    def grade(self, task, text):
        ok = float(task.answer % 2 == 0)
        return Score(reward=ok, parts={"correct": ok, "format": 1.0})

    def score(self, task, completion_text):  # the model may emit nothing at all; the parity rule still holds
        return self.grade(task, completion_text)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    """The torch engine over the tiny model."""
    import torch

    from pnyx.models import load_tokenizer
    from pnyx.rollout.engines import make_engine

    torch.set_num_threads(1)
    return make_engine("torch", tiny_model_dir, load_tokenizer(tiny_model_dir))


def test_wilson_interval_matches_hand_computed_value():
    lo, hi = wilson_interval(30, 100)
    assert lo == pytest.approx(0.21895, abs=1e-4)
    assert hi == pytest.approx(0.39586, abs=1e-4)


def test_wilson_interval_at_zero_successes_is_not_degenerate():
    lo, hi = wilson_interval(0, 50)
    assert (
        lo == pytest.approx(0.0, abs=1e-12) and 0.05 < hi < 0.1
    )  # the normal approximation would give [0, 0]


def test_pass_at_1_interval_resamples_tasks_when_several_samples_per_task():
    # 10 tasks, 4 samples each, tasks either always or never right: the bootstrap over tasks is wide;
    # treating the 40 samples as independent (Wilson on 20/40) would be much narrower.
    correct = [4] * 5 + [0] * 5
    lo, hi = pass_at_1_interval(correct, samples=4)
    wlo, whi = wilson_interval(20, 40)
    assert hi - lo > whi - wlo
    assert bootstrap_interval([1.0] * 5 + [0.0] * 5, seed=1) == bootstrap_interval(
        [1.0] * 5 + [0.0] * 5, seed=1
    )


def test_evaluate_model_counts_correct_per_task(tiny):
    env = ParityEnv()
    tasks = env.sample("test", 0, 10)
    report = evaluate_model(tiny, env, tasks, samples=3, max_new_tokens=4, ks=(2,), batch_size=7)
    assert report.tasks == 10 and report.samples == 3
    assert report.pass_at_1 == pytest.approx(0.5)
    assert report.pass_at_k[2] == pytest.approx(0.5)  # each task is all-right or all-wrong
    assert report.search_rate is None  # single-turn environment
    assert 0.0 <= report.ci_low < 0.5 < report.ci_high <= 1.0


def test_evaluate_model_is_reproducible_with_the_same_seed(tiny):
    from pnyx.envs import get_env

    env = get_env("arith")
    tasks = env.sample("test", 0, 8)
    a = evaluate_model(tiny, env, tasks, max_new_tokens=6, seed=3)
    b = evaluate_model(tiny, env, tasks, max_new_tokens=6, seed=3)
    assert a.mean_completion_tokens == b.mean_completion_tokens and a.format_rate == b.format_rate


def test_eval_report_round_trips_through_its_json_form():
    r = EvalReport(
        env="arith",
        tasks=200,
        samples=4,
        pass_at_1=0.31,
        ci_low=0.25,
        ci_high=0.37,
        pass_at_k={4: 0.6},
        search_rate=0.2,
        version=7,
        digest="ab",
        seconds=1.5,
    )
    d = json.loads(json.dumps(r.to_dict()))
    assert d["pass@1"] == 0.31 and d["pass@4"] == 0.6
    assert EvalReport.from_dict(d) == r


def test_version_evaluator_loads_exactly_the_requested_version(tiny_model_dir, tmp_path):
    import torch
    from worker_support import create_signed_run

    from pnyx.envs import registry
    from pnyx.eval.runner import VersionEvaluator
    from pnyx.models import load_model
    from pnyx.store import open_store
    from pnyx.weights import Publisher

    registry.register("parity", ParityEnv)
    store = open_store(tmp_path / "run")
    _, signer = create_signed_run(store, {"worker": {}, "env": {}}, {"vocab_size": 10})
    base = load_model(tiny_model_dir)
    state0 = {k: v.detach().to(torch.bfloat16).clone() for k, v in base.state_dict().items()}
    state1 = {k: (v.float() * 1.5).to(torch.bfloat16) for k, v in state0.items()}
    pub = Publisher(store, anchor_every=20, signer=signer)
    pub.publish(0, state0)
    pub.publish(1, state1)
    ev = VersionEvaluator(store, tiny_model_dir, "parity", tasks=6, max_new_tokens=3)
    report = ev.evaluate(1)
    assert report.version == 1 and report.pass_at_1 == pytest.approx(0.5)
    assert report.engine == "torch" and report.digest == ev.syncer.digest == ev.engine.digest
    got = ev.engine.model.state_dict()
    for name, want in state1.items():
        assert torch.equal(got[name], want.float()), name
    ev.evaluate(0)
    model = ev.engine.model
    assert torch.equal(model.state_dict()["model.norm.weight"], state0["model.norm.weight"].float())


def test_version_evaluator_refuses_to_sample_from_weights_its_engine_cannot_prove(
    tiny_model_dir, tmp_path, monkeypatch
):
    import torch
    from worker_support import create_signed_run

    from pnyx.errors import IntegrityError
    from pnyx.eval import runner
    from pnyx.models import load_model
    from pnyx.store import open_store
    from pnyx.weights import Publisher

    store = open_store(tmp_path / "run")
    _, signer = create_signed_run(store, {"worker": {}, "env": {}}, {"vocab_size": 10})
    state = {
        k: v.detach().to(torch.bfloat16).clone() for k, v in load_model(tiny_model_dir).state_dict().items()
    }
    Publisher(store, anchor_every=20, signer=signer).publish(0, state)
    ev = runner.VersionEvaluator(store, tiny_model_dir, "arith", tasks=2, max_new_tokens=2)
    landed = ev.engine._apply

    def lossy(state, names, first):  # a loader that does not copy what it was given exactly
        landed(state, names, first)
        with torch.no_grad():
            ev.engine.model.state_dict()["model.norm.weight"].add_(1.0)

    sampled = []
    monkeypatch.setattr(ev.engine, "_apply", lossy)
    monkeypatch.setattr(runner, "evaluate_model", lambda *a, **k: sampled.append(1))
    with pytest.raises(IntegrityError, match="not the published ones"):
        ev.evaluate(0)
    assert not sampled and ev.engine.version is None


def test_eval_command_refuses_an_unknown_engine():
    proc = _eval_cli("--engine", "jax")
    assert proc.returncode == 2 and "unknown engine 'jax'" in proc.stderr


def test_learning_curve_is_a_png_with_and_without_data(tmp_path):
    from pnyx.eval.plot import plot_learning_curve

    empty = plot_learning_curve([], [], tmp_path / "empty.png")
    full = plot_learning_curve(
        [{"elapsed_s": t, "reward": 0.3 + 0.01 * t} for t in range(20)],
        [
            {"elapsed_s": 0, "pass@1": 0.3, "ci_low": 0.25, "ci_high": 0.35, "version": 0},
            {"elapsed_s": 19, "pass@1": 0.6, "ci_low": 0.55, "ci_high": 0.65, "version": 10},
        ],
        tmp_path / "full.png",
    )
    for p in (empty, full):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert full.stat().st_size > empty.stat().st_size


def test_eval_command_writes_json_for_a_model_folder(tiny_model_dir, tmp_path):
    out = tmp_path / "eval.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pnyx",
            "eval",
            "--model",
            str(tiny_model_dir),
            "--env",
            "arith",
            "--tasks",
            "6",
            "--samples",
            "2",
            "--out",
            str(out),
            "--worker.max_new_tokens=4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    d = json.loads(out.read_text())
    assert d["tasks"] == 6 and d["samples"] == 2 and "pass@2" in d and 0.0 <= d["pass@1"] <= 1.0


def test_evaluate_model_uses_the_environments_budget_unless_given(tiny):
    from pnyx.envs import get_env

    env = get_env("arith")
    tasks = env.sample("test", 0, 2)
    assert evaluate_model(tiny, env, tasks).max_new_tokens == 64
    assert evaluate_model(tiny, env, tasks, max_new_tokens=3).mean_completion_tokens <= 3


def _eval_cli(*args: str):
    """`pnyx eval ARGS` in this process (the command itself is tested as a subprocess above): (code, stderr)."""
    from typer.testing import CliRunner

    from pnyx.cli import app

    result = CliRunner().invoke(app, ["eval", *args])
    return SimpleNamespace(returncode=result.exit_code, stderr=result.output)  # output holds stderr too


def test_eval_command_takes_defaults_from_a_config_file_and_flags_over_them(tiny_model_dir, tmp_path):
    config = tmp_path / "eval.toml"
    config.write_text(
        f'[model]\npath = "{tiny_model_dir}"\n[env]\nname = "arith"\nsystem_prompt = ""\n'
        "[env.kwargs]\ndigits = 1\n[worker]\nmax_new_tokens = 2\ntemperature = 0.5\n"
    )
    out = tmp_path / "a.json"
    proc = _eval_cli("--config", str(config), "--tasks", "3", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["max_new_tokens"] == 2
    proc = _eval_cli("--config", str(config), "--tasks", "3", "--max-new-tokens", "5", "--temperature", "0",
                     "--top-k", "3", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["max_new_tokens"] == 5


def test_eval_command_errors_are_clear(tmp_path):
    proc = _eval_cli("--store", str(tmp_path), "--config", str(tmp_path / "x.toml"))
    assert proc.returncode == 2 and "--config applies to a model folder" in proc.stderr
    proc = _eval_cli("--config", str(tmp_path / "missing.toml"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    proc = _eval_cli("--max-new-tokens", "0")
    assert proc.returncode == 2 and "max-new-tokens" in proc.stderr


def test_eval_command_env_flag_drops_the_other_environments_options(tiny_model_dir, tmp_path):
    config = tmp_path / "eval.toml"
    config.write_text(
        f'[model]\npath = "{tiny_model_dir}"\n[env]\nname = "arith"\n[env.kwargs]\ndigits = 1\n'
    )
    out = tmp_path / "g.json"
    proc = _eval_cli("--config", str(config), "--env", "gsm8k", "--tasks", "2", "--max-new-tokens", "2",
                     "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr  # arith's `digits` would be refused by gsm8k
    assert "not the config's environment" in proc.stderr
    assert json.loads(out.read_text())["env"] == "gsm8k"
