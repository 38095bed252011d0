"""Fleet at scale: the trainer's ingestion against 10, 100 and 1,000 simulated workers and a backlog of
100 to 10,000 waiting groups, on the local folder and on the loopback S3 server (moto, started here).

The workers are a separate process of lightweight uploaders: a few real arith groups are encoded once
(real task ids, prompts rendered by the shipped tokenizer, rewards that vary; `--zero-variance` of them
all wrong), then re-keyed (worker, seq, version) and re-encoded with `pnyx.protocol.encode_group` for each
upload, at `--rate` groups/s in all, round-robin over N worker ids, each uploading at the version it
learnt up to `--lag-s` after it was published. Each worker writes a heartbeat every max(5, N/20) s (so
a thousand of them stay within what one loopback server on 2 shared cores can absorb). Before the trainer
starts, `backlog` groups already wait in the window (versions 0-3, all workers).

The trainer side is the real thing minus the model: `Ingestor` + `Prefetcher` with the trainer's
re-score (arith verifier, tokenizer decode, prompt re-render), `Prefetcher.next_batch` for each step, the
batch record written create-only, then a stand-in step (`--step-s` of sleep) and a "publish" (the
version advances; no weights are written). Every request of the trainer's store is counted by kind (LIST
counts one request per 1,000 keys returned, as S3 pages them), and so are the fleet's.

Printed per case: wait/step (the trainer blocked on ingestion, median), work/step (ingestion
thread-seconds per step: main wait + prefetch thread, mean over all steps but the first), the first batch
(includes the first listing of the whole backlog), requests per consumed group by kind, and the request
cost per 1,000 steps at S3 and R2 prices. Not counted: a real trainer's publish (payload + manifest + HEAD),
metrics and checkpoints (a fixed cost per step, the same whatever the fleet or backlog), and the workers'
weight downloads.

    nice -n 19 python benchmarks/bench_fleet_scale.py                    # both backends, the default grid
    nice -n 19 python benchmarks/bench_fleet_scale.py --backends local --workers 10 --backlogs 100
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
import zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# Request prices, USD per 1,000 requests (list prices; no free tier applied).
S3_PRICE = {"PUT": 0.005, "LIST": 0.005, "GET": 0.0004, "HEAD": 0.0004}
"""AWS S3 Standard, us-east-1: PUT, COPY, POST, LIST $0.005 per 1,000; GET, SELECT and all other (HEAD)
$0.0004 per 1,000. https://aws.amazon.com/s3/pricing/ (list price as of 2026-12; not re-read from this
machine, which has no web access: check before quoting)."""
R2_PRICE = {"PUT": 4.50 / 1000, "LIST": 4.50 / 1000, "GET": 0.36 / 1000, "HEAD": 0.36 / 1000}
"""Cloudflare R2 Standard: Class A (PutObject, ListObjects, ...) $4.50 per million; Class B (GetObject,
HeadObject, ...) $0.36 per million. https://developers.cloudflare.com/r2/pricing/ (read 2026-12-01,
cloudflare-docs commit 07ec87d4)."""
V0 = 3
RUN_ID = "bench-fleet"


# --- counting every request -------------------------------------------------------------------------------


def counting_store(store: Any) -> Any:
    """A Store over the same data whose backend counts requests by kind in `.counts` (thread-safe)."""
    from pnyx.store.base import ObstoreBackend, Store

    inner = store._backend
    counts: Counter[str] = Counter()
    lock = threading.Lock()

    def count(kind: str, n: int = 1) -> None:
        with lock:
            counts[kind] += n

    class Counting(ObstoreBackend):
        def __init__(self) -> None:
            super().__init__(
                inner.raw,
                sorted_listing=inner.sorted_listing,
                supports_cas=inner.supports_cas,
                remote=inner.remote,
            )

        def get(self, key):
            count("GET")
            return inner.get(key)

        def get_range(self, key, start, end):
            count("GET")
            return inner.get_range(key, start, end)

        def head(self, key):
            count("HEAD")
            return inner.head(key)

        def put(self, key, data, mode):
            count("PUT")
            return inner.put(key, data, mode)

        def delete(self, key):
            count("DELETE")
            return inner.delete(key)

        def list(self, prefix, offset):
            n = 0
            try:
                for chunk in inner.list(prefix, offset):
                    n += len(chunk)
                    yield chunk
            finally:
                count("LIST", max(1, math.ceil(n / 1000)))  # S3 returns at most 1,000 keys per LIST request

    out = Store(Counting(), store.url, store.retry, local_path=store.local_path)
    out.counts = counts
    return out


# --- groups -------------------------------------------------------------------------------------------------


def template_groups(group_size: int, zero_variance: float, n: int = 32) -> list[bytes]:
    """`n` encoded arith groups with real task ids and prompts; a `zero_variance` share all wrong."""
    from pnyx.config import shipped_model_path
    from pnyx.envs import get_env
    from pnyx.models import load_tokenizer, render_prompt
    from pnyx.protocol import RolloutGroup, Sample, encode_group

    tok, env = load_tokenizer(shipped_model_path()), get_env("arith")
    out = []
    for i, task in enumerate(env.sample("train", 7, n)):
        right = i >= round(zero_variance * n)
        samples = []
        for j in range(group_size):
            good = right and j <= i % (group_size - 1)  # 1 to G-1 right answers: the rewards vary
            ids = tok.encode(
                f"<answer>{task.answer if good else task.answer + 1}</answer>", add_special_tokens=False
            )
            samples.append(
                Sample(tokens=ids, logprobs=[-0.7] * len(ids), loss_mask=[1] * len(ids), reward=float(good))
            )
        g = RolloutGroup(
            run_id=RUN_ID, worker_id="t", seq=0, policy_version=0, weights_digest="d0", env="arith", task_id=task.id,
            prompt_tokens=render_prompt(tok, task.prompt), samples=samples, temperature=1.0, top_p=1.0, top_k=0,
            created_at=0.0, gen_seconds=0.0, score_seconds=0.0,
        )  # fmt: skip
        out.append(encode_group(g))
    return out


class Rekeyer:
    """Turns the templates into the group `worker` uploads as its `seq`-th at `version`."""

    def __init__(self, templates: list[bytes]):
        from pnyx.protocol import decode_group

        self.templates = [decode_group(t) for t in templates]

    def make(self, worker: str, seq: int, version: int, stamp_ms: int | None = None) -> tuple[str, bytes]:
        import msgspec

        from pnyx.protocol import encode_group, layout

        t = self.templates[(seq * 7 + zlib.crc32(worker.encode())) % len(self.templates)]
        g = msgspec.structs.replace(
            t,
            worker_id=worker,
            seq=seq,
            policy_version=version,
            weights_digest=f"d{version}",
            created_at=time.time(),
        )
        return layout.rollout_key(version, worker, seq, stamp_ms), encode_group(g)


# --- the simulated fleet (its own process) -----------------------------------------------------------------


def fleet_main(url: str, templates: list[bytes], n: int, rate: float, lag_s: float, first_seq: int,
               version: Any, published_at: Any, stop: Any, results: Any) -> None:  # fmt: skip
    from pnyx.protocol import HEARTBEAT_SCHEMA, Heartbeat, encode_json, layout
    from pnyx.store import open_store

    store = counting_store(open_store(url))
    rekey = Rekeyer(templates)
    rng = random.Random(0)
    workers = [f"sim{i:04d}" for i in range(n)]
    lag = {w: rng.uniform(0, lag_s) for w in workers}
    seqs = dict.fromkeys(workers, first_seq)
    uploaded: Counter[str] = Counter()
    lock = threading.Lock()
    heartbeat_s = max(5.0, n / 20)
    t0 = time.monotonic()

    def known_version(w: str) -> int:
        v = version.value
        return v if time.time() - published_at.value >= lag[w] else max(0, v - 1)

    def upload(k: int) -> None:
        w = workers[k % n]
        with lock:
            seqs[w] += 1
            seq = seqs[w]
        key, data = rekey.make(w, seq, known_version(w))
        try:
            store.put(key, data, mode="create")
        except Exception as e:  # noqa: BLE001 - counted and reported: a benchmark must not hide failures
            with lock:
                uploaded["<failed>"] += 1
            print(f"fleet: upload failed: {e}", file=sys.stderr)
            return
        with lock:
            uploaded[w] += 1

    def heartbeats() -> None:
        i = 0
        while not stop.is_set():
            w = workers[i % n]
            hb = Heartbeat(schema=HEARTBEAT_SCHEMA, worker_id=w, version=known_version(w), updated_at=time.time(),
                           groups=uploaded[w], rollouts=0, rollouts_per_s=rate / n, status="generating")  # fmt: skip
            store.put(layout.worker_heartbeat(w), encode_json(hb))
            i += 1
            stop.wait(heartbeat_s / n)

    threading.Thread(target=heartbeats, daemon=True).start()
    pool = ThreadPoolExecutor(8)
    k = 0
    while not stop.is_set():
        due = t0 + k / rate
        if due > time.monotonic():
            stop.wait(due - time.monotonic())
            continue
        pool.submit(upload, k)
        k += 1
    pool.shutdown(wait=True, cancel_futures=True)
    failed = uploaded.pop("<failed>", 0)
    results.put({"counts": dict(store.counts), "uploaded": sum(uploaded.values()), "failed": failed,
                 "seconds": time.monotonic() - t0})  # fmt: skip


# --- one case ------------------------------------------------------------------------------------------------


def fill_backlog(url: str, templates: list[bytes], n: int, backlog: int) -> None:
    """`backlog` groups already waiting at versions 0..V0 from all `n` workers, stamped over the last minute."""
    from pnyx.protocol import layout
    from pnyx.store import open_store

    store, rekey = open_store(url), Rekeyer(templates)
    now = layout.now_ms()

    def put(i: int) -> None:
        key, data = rekey.make(
            f"sim{i % n:04d}", i // n, i % (V0 + 1), stamp_ms=now - 60_000 + i * 60_000 // backlog
        )
        store.put(key, data, mode="create")

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, range(backlog)))


def run_case(
    url: str, templates: list[bytes], args: argparse.Namespace, n: int, backlog: int, staleness: int
) -> dict:
    from pnyx.config import shipped_model_path
    from pnyx.envs import get_env
    from pnyx.models import load_tokenizer, render_prompt
    from pnyx.store import open_store
    from pnyx.train.checkpoint import write_batch_record
    from pnyx.train.ingest import Ingestor, IngestSettings
    from pnyx.train.prefetch import Prefetcher

    fill_backlog(url, templates, n, backlog)
    ctx = mp.get_context("spawn")
    version, published_at, stop, results = (
        ctx.Value("i", V0),
        ctx.Value("d", time.time()),
        ctx.Event(),
        ctx.Queue(),
    )
    fleet = ctx.Process(
        target=fleet_main,
        args=(url, templates, n, args.rate, args.lag_s, backlog, version, published_at, stop, results),
    )
    fleet.start()
    tok, env = load_tokenizer(shipped_model_path()), get_env("arith")
    store = counting_store(open_store(url))
    current = [V0]
    ing = Ingestor(
        store=store, env=env, detokenize=lambda ids: tok.decode(ids, skip_special_tokens=True),
        settings=IngestSettings(max_staleness=staleness, max_groups_per_prompt=2), run_id=RUN_ID,
        vocab_size=json.loads((shipped_model_path() / "config.json").read_text())["vocab_size"],
        render=lambda p: render_prompt(tok, p),
        expected_digest=lambda v: frozenset({f"d{v}"}) if v <= current[0] else None,
    )  # fmt: skip
    pre = Prefetcher(ing, args.groups_per_step)
    pre.ahead(V0)
    pre.start()
    waits, works = [], []
    try:
        for _ in range(args.steps):
            v = current[0]
            busy0, t0 = pre.busy_s, time.perf_counter()
            batch = pre.next_batch(v, args.groups_per_step, stop=lambda: False, deadline_s=300.0)
            wait = time.perf_counter() - t0
            if batch is None:
                raise RuntimeError(f"no full batch at v{v} within 300 s: the fleet is too slow for --step-s")
            keys = [g.key for g in batch]
            write_batch_record(store, v + 1, keys, "bench")
            pre.ahead(v + 1, keys)
            time.sleep(args.step_s)  # the stand-in optimizer step and publish
            current[0] = v + 1
            version.value, published_at.value = v + 1, time.time()
            ing.note_published(v + 1)
            ing.commit(keys, batch)
            pre.ahead(v + 1)
            waits.append(wait)
            works.append(wait + pre.busy_s - busy0)
    finally:
        stop.set()
        pre.close()
        ing.close()
    fleet_out = results.get(timeout=120)
    fleet.join(30)
    consumed = args.steps * args.groups_per_step
    counts = {k: store.counts.get(k, 0) for k in ("LIST", "GET", "PUT", "HEAD")}
    return {
        "workers": n, "backlog": backlog, "max_staleness": staleness, "steps": args.steps, "consumed": consumed,
        "wait_median_s": statistics.median(waits), "work_mean_s": statistics.mean(works[1:]),
        "first_batch_s": works[0], "per_group": {k: c / consumed for k, c in counts.items()},
        "requests": counts, "drops": dict(ing.cursor.drops), "fleet": fleet_out,
    }  # fmt: skip


# --- backends ------------------------------------------------------------------------------------------------


class Moto:
    """moto's S3 server on a free loopback port (as tests/conftest.py starts it)."""

    def __enter__(self) -> Moto:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        exe = shutil.which("moto_server")
        cmd = [exe] if exe else [sys.executable, "-m", "moto.server"]
        self.proc = subprocess.Popen([*cmd, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)  # fmt: skip
        self.endpoint = f"http://127.0.0.1:{port}"
        end = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(self.endpoint + "/", timeout=1).close()
                return self
            except OSError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.2)

    def url(self) -> str:
        import boto3

        bucket = f"bench-{uuid.uuid4().hex[:10]}"
        boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
        return f"s3://{bucket}/run?endpoint={self.endpoint}&region=us-east-1"

    def __exit__(self, *exc: Any) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def cost_per_1000_steps(per_group: dict[str, float], groups_per_step: int, prices: dict[str, float]) -> float:
    """USD for 1,000 steps: (requests per group x groups per step x 1,000 steps) / 1,000 x price per 1,000."""
    return sum(per_group.get(k, 0.0) * groups_per_step * p for k, p in prices.items())


def report(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"\ngroups/step={args.groups_per_step} step={args.step_s}s rate={args.rate} groups/s lag<={args.lag_s}s "
          f"zero-variance={args.zero_variance:.0%} steps={args.steps}")  # fmt: skip
    head = (f"{'backend':7} {'N':>5} {'backlog':>7} {'S':>4} {'wait/step':>9} {'work/step':>9} {'1st batch':>9} "
            f"{'LIST/g':>6} {'GET/g':>6} {'PUT/g':>6} {'HEAD/g':>6} {'total/g':>7} {'$S3/1k':>7} {'$R2/1k':>7} "
            f"{'fleet PUT/g':>11}  drops")  # fmt: skip
    print(head)
    for r in rows:
        pg = r["per_group"]
        fleet_put = r["fleet"]["counts"].get("PUT", 0) / r["consumed"]
        print(
            f"{r['backend']:7} {r['workers']:>5} {r['backlog']:>7} {r['max_staleness']:>4} "
            f"{1000 * r['wait_median_s']:>7.1f}ms {1000 * r['work_mean_s']:>7.1f}ms {r['first_batch_s']:>8.2f}s "
            f"{pg['LIST']:>6.3f} {pg['GET']:>6.3f} {pg['PUT']:>6.3f} {pg['HEAD']:>6.3f} {sum(pg.values()):>7.3f} "
            f"{cost_per_1000_steps(pg, args.groups_per_step, S3_PRICE):>7.4f} "
            f"{cost_per_1000_steps(pg, args.groups_per_step, R2_PRICE):>7.4f} {fleet_put:>11.2f}  "
            + ",".join(f"{k}:{v}" for k, v in sorted(r["drops"].items()))
        )
    for backend in sorted({r["backend"] for r in rows}):
        by_backlog = {
            r["backlog"]: r for r in rows if r["backend"] == backend and r["workers"] == args.backlog_workers
        }
        if len(by_backlog) >= 2:
            lo, hi = by_backlog[min(by_backlog)], by_backlog[max(by_backlog)]
            print(f"{backend}: work/step at backlog {hi['backlog']} / at {lo['backlog']} = "
                  f"{hi['work_mean_s'] / lo['work_mean_s']:.2f}x (wait/step {hi['wait_median_s'] / lo['wait_median_s']:.2f}x)")  # fmt: skip
        for r in rows:
            if r["backend"] == backend and r["workers"] == max(args.workers):
                print(
                    f"{backend}: N={r['workers']} trainer requests per consumed group = {sum(r['per_group'].values()):.3f}"
                )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="local,s3")
    p.add_argument("--workers", default="10,100,1000", help="N of the N sweep (at --backlog-for-n)")
    p.add_argument(
        "--backlogs", default="100,1000,10000", help="backlogs of the backlog sweep (at --backlog-workers)"
    )
    p.add_argument("--backlog-for-n", type=int, default=1000)
    p.add_argument("--backlog-workers", type=int, default=100)
    p.add_argument("--backlog-staleness", type=int, default=1000,
                   help="max_staleness of the backlog sweep: the whole backlog stays waiting in the window")  # fmt: skip
    p.add_argument(
        "--staleness", type=int, default=3, help="max_staleness of the N sweep (the default config)"
    )
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--groups-per-step", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--step-s", type=float, default=0.5, help="the stand-in step (sleep) per version")
    p.add_argument("--rate", type=float, default=32.0, help="groups uploaded per second by the whole fleet")
    p.add_argument("--lag-s", type=float, default=0.5, help="a worker learns a new version up to this late")
    p.add_argument("--zero-variance", type=float, default=0.0, help="share of groups whose samples all fail")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    args.workers = [int(x) for x in args.workers.split(",")]
    backlogs = [int(x) for x in args.backlogs.split(",")]
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    templates = template_groups(args.group_size, args.zero_variance)
    cases = [(n, args.backlog_for_n, args.staleness) for n in args.workers]
    cases += [(args.backlog_workers, b, args.backlog_staleness) for b in backlogs]
    rows = []
    for backend in args.backends.split(","):
        with tempfile.TemporaryDirectory() as tmp, Moto() if backend == "s3" else _Null() as moto:
            for i, (n, backlog, staleness) in enumerate(cases):
                url = moto.url() if backend == "s3" else str(Path(tmp) / f"run{i}")
                t0 = time.monotonic()
                row = run_case(url, templates, args, n, backlog, staleness)
                row["backend"] = backend
                rows.append(row)
                print(f"[{backend} N={n} backlog={backlog} S={staleness}: {time.monotonic() - t0:.0f}s] "
                      f"work/step {1000 * row['work_mean_s']:.1f}ms, {sum(row['per_group'].values()):.3f} req/group",
                      flush=True)  # fmt: skip
    report(rows, args)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


class _Null:
    def __enter__(self) -> _Null:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


if __name__ == "__main__":
    main()
