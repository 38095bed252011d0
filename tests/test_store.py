"""The store API against every backend (local folder, memory, S3 on loopback), plus retries and URLs."""

from __future__ import annotations

import pickle
import threading

import pytest

from pnyx.errors import (
    AlreadyExistsError,
    ConfigError,
    NotFoundError,
    PreconditionError,
    StorePermissionError,
    StoreUnavailableError,
    UnsupportedError,
)
from pnyx.store import IfMatch, RetryPolicy, Store, open_store
from pnyx.store.retry import call_with_retry
from pnyx_harness.faults import FaultyStore


class FakeClock:
    """A clock that only moves when someone sleeps on it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def __call__(self) -> float:
        return self.now


def fake_policy(deadline_s: float = 30.0, clock: FakeClock | None = None) -> RetryPolicy:
    clock = clock or FakeClock()
    return RetryPolicy(deadline_s=deadline_s, sleep=clock.sleep, clock=clock, rand=lambda: 1.0)


# --- the suite every backend must pass -----------------------------------------------------------------


def test_put_get_round_trip(store_url):
    store = open_store(store_url)
    store.put("a/b.bin", b"\x00\x01payload")
    assert store.get("a/b.bin") == b"\x00\x01payload"


def test_overwrite_replaces_content(store_url):
    store = open_store(store_url)
    store.put("k", b"one")
    store.put("k", b"two", mode="overwrite")
    assert store.get("k") == b"two"


def test_get_range_is_half_open(store_url):
    store = open_store(store_url)
    store.put("r", bytes(range(100)))
    assert store.get_range("r", 10, 20) == bytes(range(10, 20))
    assert store.get_range("r", 5, 5) == b""


def test_head_reports_size_and_etag(store_url):
    store = open_store(store_url)
    result = store.put("h", b"12345")
    meta = store.head("h")
    assert (meta.key, meta.size) == ("h", 5)
    assert meta.etag is not None and meta.etag == result.etag


def test_exists(store_url):
    store = open_store(store_url)
    store.put("yes", b"1")
    assert store.exists("yes") and not store.exists("no")


def test_list_is_sorted_with_start_after_and_limit(store_url):
    store = open_store(store_url)
    keys = [f"rollouts/v{v:08d}/w-{s:010d}" for v in (2, 0, 1) for s in (3, 1, 2)]
    for k in keys:
        store.put(k, b"x")
    assert [m.key for m in store.list("rollouts/")] == sorted(keys)
    after = sorted(keys)[3]
    assert [m.key for m in store.list("rollouts/", start_after=after)] == sorted(keys)[4:]
    assert [m.key for m in store.list("rollouts/", start_after=after, limit=2)] == sorted(keys)[4:6]


def test_list_prefix_is_a_string_prefix_across_nesting(store_url):
    store = open_store(store_url)
    for k in ("a/b/c", "a/b/d/e", "a/bz", "a/c", "run.json"):
        store.put(k, b"x")
    assert [m.key for m in store.list("a/b")] == ["a/b/c", "a/b/d/e", "a/bz"]
    assert [m.key for m in store.list("a/b/")] == ["a/b/c", "a/b/d/e"]
    assert [m.key for m in store.list("")] == ["a/b/c", "a/b/d/e", "a/bz", "a/c", "run.json"]


def test_list_never_returns_the_prefix_itself(store_url):
    store = open_store(store_url)
    if store.local_path is not None:
        pytest.skip("a folder cannot also be a file on the local backend")
    store.put("dir", b"marker")
    store.put("dir/x", b"x")
    assert [m.key for m in store.list("dir")] == ["dir/x"]


def test_create_only_raises_on_second_writer(store_url):
    store = open_store(store_url)
    store.put("run.json", b"first", mode="create")
    with pytest.raises(AlreadyExistsError):
        store.put("run.json", b"second", mode="create")
    assert store.get("run.json") == b"first"


def test_create_only_race_has_exactly_one_winner(store_url):
    store = open_store(store_url)
    barrier = threading.Barrier(16)
    winners: list[int] = []
    losers: list[int] = []
    errors: list[BaseException] = []

    def write(i: int) -> None:
        barrier.wait()
        try:
            store.put("weights/v00000001/manifest.json", f"writer-{i}".encode() * 64, mode="create")
            winners.append(i)
        except AlreadyExistsError:
            losers.append(i)
        except BaseException as exc:  # noqa: BLE001 - surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(winners) == 1 and len(losers) == 15
    assert store.get("weights/v00000001/manifest.json") == f"writer-{winners[0]}".encode() * 64


def test_if_match_swaps_only_on_current_etag(store_url):
    store = open_store(store_url)
    first = store.put("weights/HEAD", b"v1")
    if not store.supports_cas:
        with pytest.raises(UnsupportedError, match="compare-and-swap"):
            store.put("weights/HEAD", b"v2", mode=IfMatch(first.etag))
        return
    second = store.put("weights/HEAD", b"v2", mode=IfMatch(first.etag))
    with pytest.raises(PreconditionError):
        store.put("weights/HEAD", b"v3", mode=IfMatch(first.etag))
    assert store.get("weights/HEAD") == b"v2"
    store.put("weights/HEAD", b"v3", mode=IfMatch(second.etag))
    assert store.get("weights/HEAD") == b"v3"


def test_cas_support_matches_backend(store_url):
    store = open_store(store_url)
    assert store.supports_cas == (store.local_path is None)


def test_missing_key_is_file_not_found_and_not_retried(store_url):
    store = FaultyStore(open_store(store_url), retry=fake_policy())
    with pytest.raises(FileNotFoundError) as info:
        store.get("nope")
    assert isinstance(info.value, NotFoundError)
    assert store.calls["get"] == 1


def test_head_of_missing_key_is_not_found(store_url):
    with pytest.raises(NotFoundError):
        open_store(store_url).head("nope")


def test_delete_removes_and_missing_delete_is_ok(store_url):
    store = open_store(store_url)
    store.put("d", b"1")
    store.delete("d")
    assert not store.exists("d")
    store.delete("d")


def test_transient_errors_are_retried_until_success(store_url):
    clock = FakeClock()
    store = FaultyStore(open_store(store_url), retry=fake_policy(clock=clock), fail_next=3)
    store.put("k", b"v")
    assert store.calls["put"] == 4
    assert store.get("k") == b"v"
    assert clock.sleeps == [0.1, 0.2, 0.4]


def test_already_exists_is_not_retried(store_url):
    store = FaultyStore(open_store(store_url), retry=fake_policy())
    store.put("k", b"v", mode="create")
    with pytest.raises(AlreadyExistsError):
        store.put("k", b"w", mode="create")
    assert store.calls["put"] == 2


def test_create_retried_after_ambiguous_failure_accepts_its_own_bytes(store_url):
    inner = open_store(store_url)
    store = FaultyStore(inner, retry=fake_policy())
    landed = {"done": False}

    def first_put_lands_then_fails(op: str, key: str) -> bool:
        # Simulate a lost response: the write reaches the store, the client sees an error.
        if op == "put" and not landed["done"]:
            landed["done"] = True
            inner.put(key, b"mine", mode="create")
            return True
        return False

    store.fail_when(first_put_lands_then_fails)
    store.put("run.json", b"mine", mode="create")
    assert store.get("run.json") == b"mine"


def test_picklable_store_reopens_same_root(store_url):
    store = open_store(store_url)
    store.put("p", b"shared")
    clone = pickle.loads(pickle.dumps(store))
    assert isinstance(clone, Store) and clone.url == store.url
    assert clone.get("p") == b"shared"


# --- retries: deadline, backoff, classification --------------------------------------------------------


def test_retries_stop_at_deadline_with_store_unavailable():
    clock = FakeClock()
    store = FaultyStore(open_store("memory://"), retry=fake_policy(deadline_s=10.0, clock=clock))
    store.fail_when(lambda op, key: True)
    with pytest.raises(StoreUnavailableError, match="retry deadline 10s"):
        store.get("k")
    # Full-jitter bounds with rand()=1: 0.1, 0.2, 0.4, 0.8, 1.6, 3.2 (total 6.3); the next 5.0 would pass 10.
    assert clock.sleeps == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 3.2])
    assert store.calls["get"] == 7


def test_backoff_is_capped():
    policy = RetryPolicy(base_s=0.1, cap_s=5.0, rand=lambda: 1.0)
    assert policy.backoff(0) == pytest.approx(0.1)
    assert policy.backoff(20) == 5.0


def test_backoff_is_jittered_below_bound():
    policy = RetryPolicy(base_s=0.1, cap_s=5.0, rand=lambda: 0.25)
    assert policy.backoff(3) == pytest.approx(0.2)


def test_permission_errors_are_not_retried():
    store = FaultyStore(open_store("memory://"), retry=fake_policy(), fail_next=1, kind="permission")
    with pytest.raises(StorePermissionError):
        store.get("k")
    assert store.calls["get"] == 1


def test_call_with_retry_reraises_non_transient_unchanged():
    calls = []

    def fn() -> None:
        calls.append(1)
        raise KeyError("boom")

    with pytest.raises(KeyError):
        call_with_retry(fn, fake_policy(), lambda exc: False, "op")
    assert len(calls) == 1


def test_local_generic_errors_are_not_retried(tmp_path):
    store = FaultyStore(open_store(tmp_path / "s"), retry=fake_policy())
    store.put("a/b", b"file")
    # On a folder a key cannot be both a file and a folder: a permanent error, surfaced at once.
    with pytest.raises(Exception) as info:
        store.put("a/b/c", b"x")
    assert not isinstance(info.value, StoreUnavailableError)
    assert store.calls["put"] == 2


def test_fault_predicate_hits_only_matching_keys():
    store = FaultyStore(open_store("memory://"), retry=fake_policy(deadline_s=0.0))
    store.fail_when(lambda op, key: op == "put" and key == "weights/HEAD")
    store.put("weights/v00000001/manifest.json", b"m")
    with pytest.raises(StoreUnavailableError):
        store.put("weights/HEAD", b"h")
    assert store.injected == 1


def test_fault_latency_sleeps_before_each_backend_call():
    clock = FakeClock()
    store = FaultyStore(open_store("memory://"), latency_s=0.25, sleep=clock.sleep)
    store.put("k", b"v")
    store.get("k")
    assert clock.sleeps == [0.25, 0.25]


def test_unreachable_endpoint_becomes_store_unavailable():
    import socket

    with socket.socket() as s:  # a port nobody listens on once this closes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    policy = RetryPolicy(deadline_s=0.2, base_s=0.01, cap_s=0.05)
    store = open_store(f"s3://bucket/p?endpoint=http://127.0.0.1:{port}&region=us-east-1", retry=policy)
    with pytest.raises(StoreUnavailableError, match="attempts"):
        store.get("k")


@pytest.mark.s3
def test_missing_bucket_is_config_error_not_retried(s3_endpoint):
    url = f"s3://no-such-bucket-pnyx/p?endpoint={s3_endpoint}&region=us-east-1"
    store = FaultyStore(open_store(url), retry=fake_policy())
    with pytest.raises(ConfigError, match="bucket does not exist"):
        store.list("")
    assert store.calls["list"] == 1


# --- URLs ----------------------------------------------------------------------------------------------


def test_relative_path_opens_local_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = open_store("runs/x")
    store.put("k", b"v")
    assert (tmp_path / "runs" / "x" / "k").read_bytes() == b"v"
    assert store.local_path == tmp_path / "runs" / "x"


def test_file_url_opens_same_folder_as_path(tmp_path):
    open_store(tmp_path / "r").put("k", b"v")
    assert open_store(f"file://{tmp_path}/r").get("k") == b"v"


def test_named_memory_is_shared_and_anonymous_is_fresh():
    open_store("memory://shared-name-test").put("k", b"v")
    assert open_store("memory://shared-name-test").get("k") == b"v"
    open_store("memory://").put("k", b"v")
    assert not open_store("memory://").exists("k")


def test_anonymous_memory_store_refuses_to_pickle():
    with pytest.raises(UnsupportedError, match="memory://name"):
        pickle.dumps(open_store("memory://"))


def test_s3_url_query_sets_endpoint_and_region():
    store = open_store("s3://bucket/some/prefix?endpoint=http://127.0.0.1:9/&region=auto")
    assert store.url == "s3://bucket/some/prefix?endpoint=http://127.0.0.1:9&region=auto"
    assert store.supports_cas


def test_unknown_scheme_lists_supported_ones():
    with pytest.raises(ConfigError, match="s3://") as info:
        open_store("ftp://host/x")
    assert "memory://" in str(info.value) and "gs://" in str(info.value)


def test_credentials_in_url_are_refused_without_echoing_them():
    with pytest.raises(ConfigError) as info:
        open_store("s3://AKIAXXX:hunter2@bucket/p")
    assert "hunter2" not in str(info.value) and "AKIAXXX" not in str(info.value)
    with pytest.raises(ConfigError) as info:
        open_store("s3://bucket/p?secret_access_key=hunter2")
    assert "hunter2" not in str(info.value)


def test_unknown_s3_option_is_refused():
    with pytest.raises(ConfigError, match="allowed: endpoint, region"):
        open_store("s3://bucket/p?virtual=1")


@pytest.mark.s3
def test_s3_listing_pages_past_one_chunk(s3_url):
    store = open_store(s3_url)
    keys = [f"many/{i:05d}" for i in range(1003)]
    for k in keys:
        store.put(k, b"")
    assert [m.key for m in store.list("many/")] == keys
    assert [m.key for m in store.list("many/", start_after=keys[990], limit=5)] == keys[991:996]
