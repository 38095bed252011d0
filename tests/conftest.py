"""Shared fixtures: store URLs for every backend (a real moto S3 server on loopback), the tiny model.

The S3 server: `.ci/run` starts `moto_server` and exports PNYX_TEST_S3_ENDPOINT; when that variable is
unset (a developer running plain `pytest`), the session starts its own server on a free loopback port and
stops it at the end, so `pip install -e '.[test]' && pytest` works on a fresh machine either way.
"""

from __future__ import annotations

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


@pytest.fixture(scope="session", autouse=True)
def _remove_own_spool_root():
    yield
    if _OWN_SPOOL_ROOT is not None:
        shutil.rmtree(_OWN_SPOOL_ROOT, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
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
    """The loopback S3 API endpoint (moto's standalone server)."""
    env = os.environ.get("PNYX_TEST_S3_ENDPOINT")
    if env:
        yield env.rstrip("/")
        return
    exe = shutil.which("moto_server")
    cmd = [exe] if exe else [sys.executable, "-m", "moto.server"]
    port = _free_port()
    proc = subprocess.Popen(
        [*cmd, "-H", "127.0.0.1", "-p", str(port)],
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
    from pnyx.models.testing import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))
