"""The metric trackers (`pnyx.train.sinks`): what each one logged, read back with the tracker's own reader.

TensorBoard through its `EventAccumulator`, W&B in offline mode through its run's transaction log
(`run-<id>.wandb`, records of W&B's own protobuf), trackio through its local SQLite storage. Each unit test
writes two trainer metric dicts shaped like `Trainer.metrics` (nested dicts, lists, None, strings, a metric
present at one version only) and compares everything the tracker holds with the literal scalars expected
per step; the end-to-end test runs `pnyx trainer` in a real process with all three turned on by flags.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from train_support import prepared_run, run_id_of, run_toml

from pnyx.errors import ConfigError
from pnyx.store import open_store
from pnyx.train import checkpoint
from pnyx.train.sinks import TensorBoardSink, TrackioSink, WandbSink, open_sinks, scalars

# Two steps as the trainer passes them to `sink.write` (`Trainer.metrics`, trimmed to one of each kind).
METRICS: list[dict[str, Any]] = [
    {
        "version": 1,
        "time": 1_796_274_635.94,
        "groups": 2,
        "reward": 0.5,
        "loss": 0.030302980914711952,
        "staleness": {"0": 2},
        "publish_kind": "delta",  # a string: not a scalar
        "lp_gap": {"w": 1.3e-07},  # only at v1
        "drops": {},
        "zero_variance": {"frac": None, "kind": None},
        "calibration": {
            "drift": [0.0, 0.0],  # a list: not a scalar
            "groups": {"torch/0": {"n": 2, "z_sum": -7.904592}},
            "probe": {"drift": 0.54297, "held_out": False},
        },
    },
    {
        "version": 2,
        "time": 1_796_274_635.97,
        "groups": 2,
        "reward": 0.75,
        "loss": -0.0125,
        "staleness": {"0": 1, "1": 1},
        "publish_kind": "anchor",
        "lp_gap": {},
        "drops": {"stale": 3},  # only at v2
        "zero_variance": {"frac": 0.25, "kind": "hard"},
        "calibration": None,  # a step without sampling checks
    },
]
EXPECTED: dict[int, dict[str, float]] = {
    1: {
        "trainer/groups": 2.0,
        "trainer/reward": 0.5,
        "trainer/loss": 0.030302980914711952,
        "trainer/staleness/0": 2.0,
        "trainer/lp_gap/w": 1.3e-07,
        "trainer/calibration/groups/torch/0/n": 2.0,
        "trainer/calibration/groups/torch/0/z_sum": -7.904592,
        "trainer/calibration/probe/drift": 0.54297,
        "trainer/calibration/probe/held_out": 0.0,
    },
    2: {
        "trainer/groups": 2.0,
        "trainer/reward": 0.75,
        "trainer/loss": -0.0125,
        "trainer/staleness/0": 1.0,
        "trainer/staleness/1": 1.0,
        "trainer/drops/stale": 3.0,
        "trainer/zero_variance/frac": 0.25,
    },
}


WANDB_OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off"}
"""W&B without a network: the run is written to WANDB_DIR only (and the console is left alone)."""


def _float32(steps: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    """TensorBoard stores a scalar as a float32."""
    import numpy as np

    return {s: {k: float(np.float32(v)) for k, v in m.items()} for s, m in steps.items()}


# --- the trackers' readers -----------------------------------------------------------------------------


def tensorboard_scalars(logdir: Path) -> dict[int, dict[str, float]]:
    """step -> tag -> value, every scalar event under `logdir`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    out: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for ev in acc.Scalars(tag):
            assert tag not in out.get(ev.step, {}), f"{tag} logged twice at step {ev.step}"
            out.setdefault(ev.step, {})[tag] = ev.value
    return out


def wandb_records(path: Path) -> list[Any]:
    """The records of a W&B transaction log (`run-<id>.wandb`): a LevelDB-style log of 32 KiB blocks,
    after a 7-byte file header, each chunk `crc32 u32 | length u16 | type u8 | data`, type 1 a whole record,
    2/3/4 its first/middle/last part; each record one `wandb_internal_pb2.Record`."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, part, out = 7, b"", []
    while len(data) - pos >= 7:
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + n]
        if kind == 0 or len(chunk) < n:  # the end, or a chunk still being written
            break
        assert zlib.crc32(bytes([kind]) + chunk) == crc, f"corrupt chunk at byte {pos}"
        pos, part = pos + 7 + n, part + chunk
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()  # pyright: ignore[reportAttributeAccessIssue]  (generated)
            rec.ParseFromString(part)
            out.append(rec)
            part = b""
    return out


def wandb_history(wandb_dir: Path, run_id: str, deadline_s: float = 30.0) -> dict[int, dict[str, float]]:
    """step -> key -> value of the finished offline run `run_id` under `wandb_dir` (W&B's own `_step`,
    `_runtime`, `_timestamp` left out). W&B's service process writes the log: `run.finish()` can return a
    few milliseconds before it is on disk, so this waits up to `deadline_s` for the run's exit record."""
    deadline, pause = time.monotonic() + deadline_s, 0.01
    while True:
        logs = list(wandb_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))
        assert len(logs) <= 1, logs
        records = wandb_records(logs[0]) if logs else []
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        assert time.monotonic() < deadline, (
            f"no finished W&B run {run_id} under {wandb_dir} in {deadline_s} s"
        )
        time.sleep(pause)
        pause = min(2 * pause, 0.5)
    out: dict[int, dict[str, float]] = {}
    for rec in records:
        if rec.WhichOneof("record_type") != "history":
            continue
        items = {i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
        assert rec.history.step.num not in out, f"step {rec.history.step.num} logged twice"
        out[rec.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    return out


def trackio_logs(project: str, run: str) -> dict[int, dict[str, float]]:
    from trackio.sqlite_storage import SQLiteStorage

    out: dict[int, dict[str, float]] = {}
    for row in SQLiteStorage.get_logs(project, run):
        step = row.pop("step")
        row.pop("timestamp")
        assert step not in out, f"step {step} logged twice"
        out[step] = row
    return out


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch) -> Iterator[Path]:
    """W&B runs in offline mode, written under the returned folder."""
    d = tmp_path / "wandb-dir"
    d.mkdir()
    for k, v in {**WANDB_OFFLINE, "WANDB_DIR": str(d)}.items():
        monkeypatch.setenv(k, v)
    import wandb

    wandb.teardown()  # W&B reads its settings once per process, at its first run: start afresh
    yield d
    wandb.teardown()  # and stop its service process


@pytest.fixture
def trackio_dir(tmp_path, monkeypatch) -> Path:
    """trackio's local storage in tmp_path. trackio reads TRACKIO_DIR once, at import, into module
    constants, so those are pointed there too (the readers check the database is there)."""
    import trackio
    import trackio.sqlite_storage
    import trackio.utils

    d = tmp_path / "trackio"
    monkeypatch.setenv("TRACKIO_DIR", str(d))
    for module in (trackio, trackio.utils, trackio.sqlite_storage):
        monkeypatch.setattr(module, "TRACKIO_DIR", d)
    return d


# --- each tracker alone ----------------------------------------------------------------------------------


def test_scalars_are_the_flattened_numbers_without_version_and_time():
    assert {m["version"]: scalars(m) for m in METRICS} == EXPECTED


def test_tensorboard_event_files_hold_every_scalar_at_its_version(tmp_path):
    sink = TensorBoardSink(tmp_path / "tb")
    for m in METRICS:
        sink.write(m)
    sink.close()
    assert tensorboard_scalars(tmp_path / "tb") == _float32(EXPECTED)


def test_wandb_offline_run_holds_every_scalar_at_its_version(wandb_offline):
    sink = WandbSink("pnyx-test", "20260101-000000-abcdef", {"trainer": {"lr": 0.001}})
    for m in METRICS:
        sink.write(m)
    sink.close()
    assert wandb_history(wandb_offline, "20260101-000000-abcdef") == EXPECTED


def test_trackio_database_holds_every_scalar_at_its_version_and_the_config(trackio_dir):
    from trackio.sqlite_storage import SQLiteStorage

    sink = TrackioSink("pnyx-test", "20260101-000000-abcdef", {"trainer": {"lr": 0.001}})
    for m in METRICS:
        sink.write(m)
    sink.close()
    assert (trackio_dir / "pnyx-test.db").is_file()
    assert trackio_logs("pnyx-test", "20260101-000000-abcdef") == EXPECTED
    config = SQLiteStorage.get_run_config("pnyx-test", "20260101-000000-abcdef")
    assert config is not None and config["trainer"] == {"lr": 0.001}


@pytest.mark.parametrize(
    ("field", "value", "modules"),
    [
        ("tensorboard", True, ("tensorboard", "torch.utils.tensorboard")),
        ("wandb_project", "p", ("wandb",)),
        ("trackio_project", "p", ("trackio",)),
    ],
)
def test_a_missing_tracker_package_is_a_config_error_naming_its_extra(
    tmp_path, monkeypatch, field, value, modules
):
    # None in sys.modules makes `import X` raise ImportError, as when X is not installed; torch's
    # tensorboard module (imported by an earlier test maybe) is dropped so that it imports `tensorboard` again.
    monkeypatch.setitem(sys.modules, modules[0], None)
    for name in modules[1:]:
        monkeypatch.delitem(sys.modules, name, raising=False)
    asked = {"tensorboard": False, "wandb_project": None, "trackio_project": None, field: value}
    extra = modules[0]
    with pytest.raises(ConfigError, match=rf"trainer\.{field} is set .* pip install 'pnyx\[{extra}\]'"):
        open_sinks(**asked, logdir=tmp_path / "tb", run_id="r", config={})


def test_trackers_opened_before_one_that_fails_are_finished(tmp_path, monkeypatch, wandb_offline):
    monkeypatch.setitem(sys.modules, "trackio", None)
    with pytest.raises(ConfigError, match="trackio"):
        open_sinks(
            tensorboard=False,
            wandb_project="pnyx-test",
            trackio_project="p",
            logdir=tmp_path / "tb",
            run_id="20260101-000000-abcdef",
            config={},
        )
    # the W&B run opened first was finished (its log ends with the exit record) and logged nothing
    assert wandb_history(wandb_offline, "20260101-000000-abcdef", deadline_s=5.0) == {}


def test_a_tracker_failing_with_any_error_closes_those_opened_before_it(tmp_path, monkeypatch):
    """wandb.init failing with its own error (not a ConfigError) still closes the TensorBoard writer."""
    import types

    class InitFailed(RuntimeError):
        pass

    def init(**kwargs: Any) -> None:
        raise InitFailed("wandb.init: no network")

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    closed: list[TensorBoardSink] = []
    close = TensorBoardSink.close
    monkeypatch.setattr(TensorBoardSink, "close", lambda self: (closed.append(self), close(self)))
    with pytest.raises(InitFailed):
        open_sinks(
            tensorboard=True,
            wandb_project="pnyx-test",
            trackio_project=None,
            logdir=tmp_path / "tb",
            run_id="20260101-000000-abcdef",
            config={},
        )
    assert len(closed) == 1 and closed[0].writer.all_writers is None  # the event file writer was closed


# --- the trainer end to end ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from pnyx_harness.models import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-sinks"))


def test_pnyx_trainer_logs_every_published_version_to_each_tracker(tmp_path, model_dir, trackio_dir):
    url, _ = prepared_run(tmp_path / "run", model_dir)  # run.json, v0 and 6 groups: 3 steps of 2
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(run_toml(model_dir))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        **WANDB_OFFLINE,
        "WANDB_DIR": str(tmp_path),
        "TRACKIO_DIR": str(trackio_dir),
    }
    trackers = ["--trainer.tensorboard=true", "--trainer.wandb_project=e2e", "--trainer.trackio_project=e2e"]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pnyx",
            "trainer",
            "--store",
            url,
            "--config",
            str(cfg),
            "--resume",
            *trackers,
        ],
        cwd=tmp_path,  # TensorBoard writes to ./tensorboard/<run_id>
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    store = open_store(url)
    run_id = run_id_of(store)
    published = {m["version"]: scalars(m) for m in checkpoint.read_metrics(store)}
    assert sorted(published) == [1, 2, 3]
    assert all("trainer/reward" in s and "trainer/loss" in s for s in published.values())
    assert tensorboard_scalars(tmp_path / "tensorboard" / run_id) == _float32(published)
    assert wandb_history(tmp_path, run_id) == published
    assert trackio_logs("e2e", run_id) == published
