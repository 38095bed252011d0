"""The CLI: `pnyx --help` is cheap (no torch import), --dry-run prints the resolved config, bad config exits 2."""

from __future__ import annotations

import subprocess
import sys

PY = [sys.executable, "-m", "pnyx"]


def test_help_does_not_import_torch():
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from pnyx.cli import app\n"
        "r = CliRunner().invoke(app, ['--help'])\n"
        "assert r.exit_code == 0, r.output\n"
        "for cmd in ['run', 'trainer', 'worker', 'swarm', 'eval', 'status', 'weights', 'envs']:\n"
        "    assert cmd in r.output, cmd\n"
        "bad = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_dry_run_prints_resolved_config():
    out = subprocess.run([*PY, "run", "--dry-run", "--trainer.lr=0.005"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "lr = 0.005" in out.stdout and "[algorithm]" in out.stdout


def test_bad_config_value_exits_2_with_field_name():
    out = subprocess.run([*PY, "config", "--worker.temperature=0"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "worker.temperature" in out.stderr
