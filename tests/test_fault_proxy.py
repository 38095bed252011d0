"""The fault-injecting proxy in front of the loopback S3 server: each fault reaches pnyx's store as a real
network failure would, and the store's guarantees hold through it (create-only puts after a lost reply,
retries after 503s and resets)."""

from __future__ import annotations

import os
import time

import pytest
from conftest import make_bucket

from pnyx.errors import ConfigError, StoreUnavailableError
from pnyx.store import RetryPolicy, open_store
from pnyx_harness.proxy import FaultProxy, Faults

pytestmark = pytest.mark.s3

FAST = RetryPolicy(deadline_s=5.0, base_s=0.01, cap_s=0.05)


@pytest.fixture
def proxy(s3_endpoint):
    with FaultProxy(s3_endpoint, seed=0) as p:
        yield p


def _store(proxy, s3_endpoint, retry=FAST):
    bucket = make_bucket(s3_endpoint)
    return open_store(f"s3://{bucket}/run?endpoint={proxy.url}&region=us-east-1", retry)


def test_proxy_forwards_everything_and_counts_requests_by_kind(proxy, s3_endpoint):
    store = _store(proxy, s3_endpoint)
    store.put("a/x", b"1", mode="create")
    store.put("a/y", b"22")
    assert store.get("a/y") == b"22" and store.head("a/x").size == 1
    assert [m.key for m in store.list("a/")] == ["a/x", "a/y"]
    store.delete("a/x")
    assert not store.exists("a/x")
    assert {k: proxy.counts[k] for k in ("PUT", "GET", "LIST")} == {"PUT": 2, "GET": 1, "LIST": 1}
    # exists() is a HEAD; obstore deletes through S3's multi-object delete (a POST)
    assert proxy.counts["HEAD"] == 2 and proxy.counts["DELETE"] + proxy.counts["POST"] == 1


def test_slow_down_errors_are_retried_until_the_store_answers(proxy, s3_endpoint):
    store = _store(proxy, s3_endpoint)
    proxy.inject("error", count=3, methods={"PUT"})
    store.put("k", b"v", mode="create")
    assert store.get("k") == b"v" and proxy.counts["fault:error"] == 3 and proxy.counts["PUT"] == 4


def test_a_reset_before_forwarding_is_retried(proxy, s3_endpoint):
    store = _store(proxy, s3_endpoint)
    proxy.inject("reset", count=2, methods={"GET"})
    store.put("k", b"v")
    assert store.get("k") == b"v" and proxy.counts["fault:reset"] == 2


def test_create_only_put_whose_reply_was_lost_after_landing_succeeds_once(proxy, s3_endpoint):
    store = _store(proxy, s3_endpoint)
    proxy.inject("lost_reply", methods={"PUT"})
    store.put("k", b"mine", mode="create")  # landed, reply lost, retried: 412, then our own bytes are there
    assert store.get("k") == b"mine" and proxy.counts["fault:lost_reply"] == 1 and proxy.counts["PUT"] == 2


def test_multipart_put_whose_completion_reply_was_lost_is_retried_not_reported_missing(proxy, s3_endpoint):
    """A large overwrite goes multipart; if the reply to CompleteMultipartUpload is lost, obstore aborts the
    (already completed) upload and meets NoSuchUpload: the store must retry, not raise NotFoundError."""
    store = _store(proxy, s3_endpoint)
    data = os.urandom(12 << 20)
    proxy.inject("lost_reply", methods={"POST"}, where="uploadId=")
    store.put("big", data)
    assert store.get("big") == data and proxy.counts["fault:lost_reply"] == 1


def test_lost_reply_on_someone_elses_object_is_still_refused(proxy, s3_endpoint):
    from pnyx.errors import AlreadyExistsError

    store = _store(proxy, s3_endpoint)
    store.put("k", b"theirs", mode="create")
    with pytest.raises(AlreadyExistsError):
        store.put("k", b"mine", mode="create")
    assert store.get("k") == b"theirs"


def test_latency_delays_each_request(proxy, s3_endpoint):
    store = _store(proxy, s3_endpoint)
    store.put("k", b"v")
    proxy.faults = Faults(latency_s=(0.3, 0.3))
    t0 = time.monotonic()
    store.get("k")
    assert time.monotonic() - t0 >= 0.3


def test_a_store_behind_a_down_proxy_is_unavailable_after_its_deadline(proxy, s3_endpoint):
    store = _store(proxy, s3_endpoint, RetryPolicy(deadline_s=0.5, base_s=0.01, cap_s=0.05))
    proxy.faults = Faults(down=True)
    with pytest.raises(StoreUnavailableError):
        store.get("k")
    assert proxy.counts["fault:down"] >= 2  # retried, then gave up


def test_fault_rates_are_probabilities():
    with pytest.raises(ConfigError, match="probability"):
        Faults(error_rate=1.5)
