"""`pnyx eval --engine mlx` samples with the MLX engine (mlx's CPU build here) and agrees with torch.

Both commands a user runs are exercised as real processes: a model folder (the shipped tiny model) and a
published version of a run, which the MLX engine loads through PULSE and proves against the version's
manifest before it samples. Greedy decoding makes the comparison tight: both engines compute in float32
from the same weights, so they pick the same tokens up to near-ties, and pass@1 must agree within a few
tasks (sampled at temperature 1 the two engines draw from different random streams, so only the
distribution would agree).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.slow,  # each command loads torch, transformers and mlx: ~30-60 s on the shared cores
    pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None, reason="needs pnyx[mlx]"),
]

TASKS = 40
AGREE = 3 / TASKS  # greedy pass@1 of the two engines may differ by a near-tie on a few tasks


def _pnyx_eval(*args: str, out) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "pnyx", "eval", "--env", "arith", "--tasks", str(TASKS), "--temperature", "0",
         "--out", str(out), *args],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pass@1" in proc.stdout
    return json.loads(out.read_text())


def test_pnyx_eval_with_mlx_on_the_shipped_model_agrees_with_torch(tmp_path):
    mlx = _pnyx_eval("--engine", "mlx", out=tmp_path / "mlx.json")
    torch = _pnyx_eval(out=tmp_path / "torch.json")  # --engine torch is the default
    assert (mlx["engine"], torch["engine"]) == ("mlx", "torch")
    assert mlx["tasks"] == TASKS and 0.3 <= torch["pass@1"] <= 1.0  # the shipped model solves many greedily
    assert abs(mlx["pass@1"] - torch["pass@1"]) <= AGREE, (mlx["pass@1"], torch["pass@1"])


def test_pnyx_eval_with_mlx_on_a_published_version_proves_it_and_agrees_with_torch(tmp_path):
    import torch
    from worker_support import make_run

    from pnyx.config import shipped_model_path

    url = str(tmp_path / "run")
    run = make_run(url, shipped_model_path())  # v0: the shipped weights plus noise
    exact = run.publisher.publish(1, {k: v.to(torch.bfloat16) for k, v in run.base.items()}).digest
    # the run's arith has 1-digit tasks, which the shipped model (built on 2-digit ones) mostly gets wrong
    version = ("--store", url, "--version", "1", "--env.kwargs.digits=2")
    mlx = _pnyx_eval(*version, "--engine", "mlx", out=tmp_path / "mlx.json")
    ref = _pnyx_eval(*version, out=tmp_path / "torch.json")
    assert (mlx["engine"], mlx["version"], mlx["digest"]) == ("mlx", 1, exact)  # the engine's own proof
    assert ref["digest"] == exact and 0.3 <= ref["pass@1"] <= 1.0
    assert abs(mlx["pass@1"] - ref["pass@1"]) <= AGREE, (mlx["pass@1"], ref["pass@1"])
