"""`pnyx run` end to end with real processes, plus the orchestrator's pure decisions.

The slow part starts `python -m pnyx run --no-live` (a trainer and two worker processes on the shipped
tiny model) in a scratch folder, plants a corrupt object in the rollout prefix, interrupts the run with
SIGINT (Ctrl-C) once a few versions exist, and continues it with `--resume`. While it runs, a watcher
records every worker heartbeat. One module-scoped fleet run feeds several tests, each asserting one
behaviour: versions published and followed (digests equal), reward rising, the corrupt object rejected
and counted, resume continuing the version sequence, and the run folder's outputs.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pnyx.cli.run_fleet import thread_split
from pnyx.cli.run_folder import newest_run, plan_run
from pnyx.config import PnyxConfig, load_config, overlay_changed, shipped_model_path
from pnyx.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
NAME = "e2e"
WORKERS = ("local-1", "local-2")
PHASE1_MIN_VERSION = 4
# the module's fleet (set up by whichever slow test runs first) took 190 s alone and 370 s on CI's loaded cores
pytestmark = pytest.mark.timeout(1500)


# --- the orchestrator's decisions (fast) -------------------------------------------------------------------


def test_resume_keeps_the_stored_config_but_takes_changed_fields():
    stored = load_config(None, ["--env.name=countdown", "--run.steps=40", "--trainer.lr=0.001"])
    given = load_config(None, ["--run.steps=80"])  # e.g. `pnyx run --resume --run.steps=80`
    merged = overlay_changed(stored, given)
    assert merged.env.name == "countdown" and merged.trainer.lr == 0.001 and merged.run.steps == 80


def test_plan_run_refuses_to_overwrite_an_existing_run_and_resume_picks_the_newest(tmp_path):
    cfg = load_config(None, ["--run.name=first"])
    first = plan_run(cfg, resume=False, root=tmp_path)
    assert first.store_url == str(tmp_path / "first") and (tmp_path / "first" / "config.toml").is_file()
    with pytest.raises(ConfigError, match="--resume"):
        plan_run(cfg, resume=False, root=tmp_path)
    time.sleep(0.01)
    plan_run(load_config(None, ["--run.name=second", "--env.name=countdown"]), resume=False, root=tmp_path)
    assert newest_run(tmp_path) == "second"
    resumed = plan_run(PnyxConfig(), resume=True, root=tmp_path)
    assert resumed.name == "second" and resumed.cfg.env.name == "countdown" and resumed.resumed


def test_plan_run_refuses_a_bad_environment_before_making_a_folder(tmp_path):
    # a recipe's env.kwargs are its environment's: switching --env.name alone keeps options the new one refuses
    recipe = load_config(None, ["--run.name=switched", "--env.name=searchqa", '--env.kwargs={"digits": 1}'])
    with pytest.raises(ConfigError, match=r"'digits'.*its options: world_seed.*pass --env.kwargs '\{\}'"):
        plan_run(recipe, resume=False, root=tmp_path)
    with pytest.raises(ConfigError, match="no environment named 'nosuch'; available: arith"):
        plan_run(load_config(None, ["--run.name=unknown", "--env.name=nosuch"]), resume=False, root=tmp_path)
    with pytest.raises(ConfigError, match="max_turns must be >= 1"):  # the constructor's own checks run too
        plan_run(
            load_config(None, ["--run.name=bad", "--env.name=searchqa", '--env.kwargs={"max_turns": 0}']),
            resume=False,
            root=tmp_path,
        )
    assert list(tmp_path.iterdir()) == []  # no run folder to clash with the corrected command's name


def test_resume_without_any_run_is_an_actionable_error(tmp_path):
    with pytest.raises(ConfigError, match="no run"):
        plan_run(PnyxConfig(), resume=True, root=tmp_path)


def test_threads_never_oversubscribe_the_cores():
    for cores in (1, 2, 4, 16):
        for workers in (1, 2, 3):
            trainer, per_worker = thread_split(workers, cores)
            assert trainer >= 1 and per_worker >= 1
            assert trainer + per_worker * workers <= max(cores, 1 + workers)
    assert thread_split(1, 2) == (1, 1) and thread_split(1, 16) == (8, 8) and thread_split(3, 16) == (4, 4)


def test_eval_schedule_starts_at_v0_and_skips_ahead_to_the_newest_due_version(tmp_path):
    from pnyx.eval.runner import EvalLoop

    loop = EvalLoop(lambda: None, tmp_path / "evals.jsonl", "arith", every=10, observed={}, t0=0.0)
    assert loop.due(None) is None and loop.due(35) == 0
    loop.records.append({"version": 0, "pass@1": 0.3})
    assert loop.due(9) is None and loop.due(35) == 30  # 10 and 20 were missed while busy: skip ahead
    loop.records.append({"version": 30, "pass@1": 0.5})
    assert loop.due(39) is None and loop.due(40) == 40


# --- the fleet (slow, real processes) ----------------------------------------------------------------------


def _pnyx(args: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(log, "ab") as fh:
        return subprocess.Popen(
            [sys.executable, "-m", "pnyx", *args], cwd=cwd, stdout=fh, stderr=subprocess.STDOUT, env=env
        )


def interrupt_at(
    proc: subprocess.Popen, store_dir: Path, version: int, within_s: float
) -> tuple[int | None, int]:
    """SIGINT `proc` (a `pnyx run`) once its store holds `version` (waiting up to `within_s`); returns (the
    version seen when it was interrupted or None, its exit code). Kills it if it has not exited 120 s later."""
    from pnyx.store import open_store
    from pnyx.weights import latest_version

    t0 = time.time()
    seen = None
    try:
        while proc.poll() is None and time.time() - t0 < within_s:
            time.sleep(0.5)
            if (store_dir / "run.json").exists():
                v = latest_version(open_store(store_dir))
                if v is not None and v >= version:
                    seen = v
                    proc.send_signal(signal.SIGINT)
                    break
        return seen, proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()


class Watcher(threading.Thread):
    """Polls the run's store: records worker heartbeats, plants one corrupt rollout object once."""

    def __init__(self, store_dir: Path):
        super().__init__(daemon=True)
        self.store_dir = store_dir
        self.seen: dict[str, set[tuple[int, str]]] = {}
        self.planted = False
        self.chain: dict[int, str] = {}
        """Version -> the chain digest of its manifest, read when a worker first reported it (retention
        deletes old versions' manifests later in the run)."""
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            from pnyx.errors import NotFoundError, RecordRejected
            from pnyx.protocol import Heartbeat, decode_json, layout
            from pnyx.store import open_store
            from pnyx.weights import read_manifest

            while not self.stop.is_set():
                if (self.store_dir / "run.json").exists():
                    store = open_store(self.store_dir)
                    if not self.planted:
                        store.put(
                            layout.rollout_key(0, "evil", 0), b"not a rollout group at all", mode="create"
                        )
                        self.planted = True
                    for meta in store.list(layout.WORKERS_PREFIX):
                        try:
                            hb = decode_json(store.get(meta.key), Heartbeat)
                        except (NotFoundError, RecordRejected):
                            continue
                        # the digest field, or `digest=...` in the detail with an older protocol
                        digest = getattr(hb, "digest", None) or _detail_digest(hb.detail)
                        if hb.version >= 0 and digest:
                            self.seen.setdefault(hb.worker_id, set()).add((hb.version, digest))
                            if hb.version not in self.chain:
                                try:
                                    m = read_manifest(store, hb.version)
                                except NotFoundError:
                                    continue
                                self.chain[hb.version] = m.weights.chain_digest
                self.stop.wait(0.3)
        except BaseException as e:  # noqa: BLE001 - surfaced by the fixture
            self.error = e


def _detail_digest(detail: str) -> str | None:
    m = re.search(r"digest=([0-9a-f]{16,})", detail or "")
    return m.group(1) if m else None


@pytest.fixture(scope="module")
def fleet_run(tmp_path_factory):
    """Phase 1: `pnyx run` until PHASE1_MIN_VERSION versions exist, then SIGINT. Phase 2: `--resume`
    to the step budget. Returns what the tests inspect."""
    from pnyx.store import open_store
    from pnyx.weights import latest_version

    # The shipped tiny model by default; PNYX_TEST_BASE_MODEL points at another base model folder.
    model = os.environ.get("PNYX_TEST_BASE_MODEL")
    if model is None and not shipped_model_path().is_dir():
        pytest.skip(f"the shipped base model is missing at {shipped_model_path()}")
    root = tmp_path_factory.mktemp("fleet")
    store_dir = root / "runs" / NAME
    steps = 60
    common = [
        "--no-live",
        "--workers",
        "2",
        f"--run.name={NAME}",
        f"--run.steps={steps}",
        # the step budget must end the run, not the clock: CI's 2 cores took 370 s under the suite's load
        "--run.time_budget_s=900",
        "--run.eval_every=0",
        "--run.eval_tasks=100",
        "--run.seed=0",
        "--worker.heartbeat_interval_s=0.5",
        # every group uploaded: test_training_reward_rises samples the policy's rewards, not only the groups
        # with reward variance (skipping all-0 and all-1 groups pulls early and late means together)
        "--worker.skip_zero_variance=false",
        "--worker.screen=1",  # likewise: screening would pick tasks by their predicted pass rate
    ] + ([f"--model.path={model}"] if model else [])
    watcher = Watcher(store_dir)
    watcher.start()
    phase1_version, phase1_rc = interrupt_at(
        _pnyx(["run", *common], root, root / "phase1.log"), store_dir, PHASE1_MIN_VERSION, 150
    )
    stopped_at = latest_version(open_store(store_dir))
    summary_path = store_dir / "summary.json"
    phase1_summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    second = _pnyx(["run", "--resume", *common], root, root / "phase2.log")
    try:
        phase2_rc = second.wait(timeout=960)
    finally:
        if second.poll() is None:
            second.kill()
        watcher.stop.set()
        watcher.join(5)
    if watcher.error is not None:
        raise watcher.error
    return {
        "root": root,
        "store_dir": store_dir,
        "phase1_version": phase1_version,
        "phase1_rc": phase1_rc,
        "stopped_at": stopped_at,
        "phase1_summary": phase1_summary,
        "phase2_rc": phase2_rc,
        "steps": steps,
        "watcher": watcher,
        "logs": (root / "phase1.log").read_text() + (root / "phase2.log").read_text(),
    }


@pytest.mark.slow
def test_interrupted_run_resumes_and_finishes_the_step_budget(fleet_run):
    from pnyx.store import open_store
    from pnyx.weights import latest_version

    assert fleet_run["phase1_version"] is not None, fleet_run["logs"][-3000:]
    assert fleet_run["phase1_rc"] == 0, fleet_run["logs"][-3000:]
    assert fleet_run["phase2_rc"] == 0, fleet_run["logs"][-3000:]
    assert fleet_run["stopped_at"] >= PHASE1_MIN_VERSION
    assert latest_version(open_store(fleet_run["store_dir"])) == fleet_run["steps"]


@pytest.mark.slow
def test_every_worker_follows_the_published_versions_with_equal_digests(fleet_run):
    watcher = fleet_run["watcher"]
    seen, chain = watcher.seen, watcher.chain
    assert set(seen) == set(WORKERS), seen.keys()
    for worker, pairs in seen.items():
        versions = {v for v, _ in pairs}
        assert len(versions) >= 3 and max(versions) >= PHASE1_MIN_VERSION, (worker, sorted(versions))
        checked = [(v, d) for v, d in pairs if v in chain]
        assert len({v for v, _ in checked}) >= 3, (worker, sorted(versions), sorted(chain))
        for version, digest in checked:
            assert digest == chain[version], (worker, version)


@pytest.mark.slow
def test_training_reward_rises(fleet_run):
    """Mean reward of the first vs the last 256 training completions (by policy version), one-sided
    two-proportion z-test: z > 3 means p < 0.0014 that the rise is sampling noise."""
    from pnyx.protocol import decode_group, layout
    from pnyx.store import open_store

    store = open_store(fleet_run["store_dir"])
    groups = []
    for meta in store.list(layout.ROLLOUTS_PREFIX):
        parsed = layout.parse_rollout_key(meta.key)
        if parsed is None or parsed[1] == "evil":
            continue
        groups.append(decode_group(store.get(meta.key)))
    groups.sort(key=lambda g: (g.policy_version, g.created_at))
    rewards = [s.reward for g in groups for s in g.samples]
    n = 256
    assert len(rewards) >= 2 * n, len(rewards)
    early, late = rewards[:n], rewards[-n:]
    p1, p2 = sum(early) / n, sum(late) / n
    pooled = (p1 + p2) / 2
    z = (p2 - p1) / math.sqrt(2 * pooled * (1 - pooled) / n)
    assert z > 3, f"reward early={p1:.3f} late={p2:.3f} z={z:.2f}"
    print(f"reward early={p1:.3f} late={p2:.3f} z={z:.2f}")


@pytest.mark.slow
def test_corrupt_rollout_object_is_rejected_and_counted_not_fatal(fleet_run):
    from pnyx.store import open_store
    from pnyx.train.checkpoint import read_metrics

    assert fleet_run["watcher"].planted
    metrics = read_metrics(open_store(fleet_run["store_dir"]))
    drops = metrics[-1]["drops"]
    rejected = {
        k: v
        for k, v in drops.items()
        if k in ("bad_magic", "digest_mismatch", "decode_error", "oversize_bytes")
    }
    assert sum(rejected.values()) >= 1, drops
    assert fleet_run["phase2_rc"] == 0


@pytest.mark.slow
def test_run_folder_has_evals_curve_and_summary(fleet_run):
    folder = fleet_run["store_dir"]
    assert (folder / "learning_curve.png").read_bytes()[:4] == b"\x89PNG"
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["before"]["version"] == 0 and summary["after"]["version"] == fleet_run["steps"]
    evals = [json.loads(line) for line in (folder / "evals.jsonl").read_text().splitlines()]
    assert [e["version"] for e in evals].count(0) == 1  # the resumed run reused the stored v0 evaluation
    for role in ("trainer", "worker-1", "worker-2"):
        assert (folder / "logs" / f"{role}.log").is_file()


@pytest.mark.slow
def test_an_interrupted_run_reports_its_newest_version_as_after(fleet_run):
    """Phase 1 is interrupted at v4+ with no periodic evaluation (eval_every=0): its summary pairs the
    final version with that version's own evaluation, never with v0's numbers."""
    summary = fleet_run["phase1_summary"]
    assert summary is not None, fleet_run["logs"][-3000:]
    assert summary["final_version"] == fleet_run["stopped_at"] >= PHASE1_MIN_VERSION
    assert summary["after"] is not None, summary["after_not_evaluated"]
    assert summary["after"]["version"] == summary["final_version"]
    assert summary["before"]["version"] == 0


@pytest.mark.slow
def test_run_ends_by_printing_the_export_command_of_its_store(fleet_run):
    assert f"export it: pnyx export --store {fleet_run['store_dir']} --out " in fleet_run["logs"]


@pytest.mark.slow
def test_the_stale_drops_account_matches_the_runs_supply_report(fleet_run):
    """`benchmarks/stale_drops.py` (how the last-chance share was chosen: BENCHMARKS.md) reads the same run
    as `pnyx run`'s supply report: every uploaded group counted once, the consumed ones at a staleness
    inside the window."""
    folder = fleet_run["store_dir"]
    supply = json.loads((folder / "summary.json").read_text())["supply"]
    out = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "stale_drops.py"), str(folder)],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    head = re.search(r"(\d+) groups uploaded, (\d+) consumed by (\d+) steps", out)
    assert head is not None, out
    assert (int(head[1]), int(head[2]), int(head[3])) == (
        supply["uploaded"],
        supply["consumed"],
        fleet_run["steps"],
    )
    staleness = re.search(r"consumed at staleness: (\{.*\})", out)
    assert staleness is not None, out
    counts = {int(k): int(v) for k, v in re.findall(r"(-?\d+): (\d+)", staleness[1])}
    assert sum(counts.values()) == supply["consumed"]
    assert 0 <= min(counts) <= max(counts) <= 3  # algorithm.max_staleness
