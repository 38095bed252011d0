"""`pnyx envs list` and `pnyx envs show NAME` (the typer sub-app the lead mounts)."""

from __future__ import annotations

import subprocess
import sys

from typer.testing import CliRunner

from pnyx.cli.envs import app


def test_list_names_every_builtin():
    result = CliRunner().invoke(app, ["list"])
    assert result.exit_code == 0, result.output
    for name in ["arith", "countdown", "gsm8k", "searchqa", "reasoning_gym"]:
        assert name in result.output


def test_show_prints_sample_tasks_and_a_correct_answer_scoring_one():
    result = CliRunner().invoke(app, ["show", "arith", "--n", "2", "--kw", "digits=3"])
    assert result.exit_code == 0, result.output
    assert "arith/train/0/0" in result.output and "arith/train/0/1" in result.output
    assert "Compute " in result.output and "reward=1" in result.output


def test_show_unknown_environment_exits_2_with_the_available_names():
    result = CliRunner().invoke(app, ["show", "nope"])
    assert result.exit_code == 2 and "arith" in result.output


def test_envs_cli_never_imports_torch():
    code = (
        "import sys; from typer.testing import CliRunner; from pnyx.cli.envs import app; "
        "r = CliRunner().invoke(app, ['show', 'searchqa', '--n', '1']); assert r.exit_code == 0, r.output; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
