"""The worker loop: join a run from its store alone, follow the weights, generate, score, upload groups.

    worker = Worker(open_store(url), WorkerOptions(worker_id="gpu-box-1"))
    summary = worker.run()          # until max_groups, request_stop() (SIGINT/SIGTERM in the CLI), or a fatal error

Life of a worker: read `run.json` (model, env and sampling settings all come from the run, so the worker
needs only the store URL); load the local model folder and tokenizer; cold-join the newest verified
weights (anchor + deltas); then loop over cohorts. At each cohort boundary it swaps to the newest
prefetched version (never inside a cohort, so every group carries the one version that produced it),
samples tasks from its own seeded stream, generates G completions per task, scores them, encodes each
group and hands it to the spool, which uploads create-only under `rollouts/v{V}/{worker}-{seq}`. A
heartbeat (`workers/{worker}.json`) reports status, version, digest and throughput.

Seq numbers are resume-safe: at start the worker lists the rollout prefixes of the newest few versions
for its own id (and its on-disk spool, if any) and continues after the highest seq it finds; a worker
that restarts with the same id cannot write into an older version than the newest at its restart, so
that is enough. A create-only collision with different bytes (two live workers sharing an id) is logged
and the group re-keyed with the next seq. Task streams are seeded by (run seed, worker id, first seq of
the cohort), so workers never duplicate each other and a restarted worker does not replay its tasks.

Store outages: every store call retries under the store's deadline; groups that still fail stay in the
bounded spool and are retried with backoff; while the spool is full the worker waits instead of
generating. Stop (`request_stop`): the current cohort is finished and spooled, the spool flushed under a
deadline, and a final heartbeat with status "stopped" written. Puts are atomic in every backend, so even
SIGKILL never leaves a partial object. Knows nothing about training.
"""

from __future__ import annotations

import logging
import os
import random
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pnyx.errors import ConfigError, IntegrityError, NotFoundError, StoreUnavailableError
from pnyx.protocol import layout
from pnyx.rollout.spool import Spool
from pnyx.store import Store

log = logging.getLogger("pnyx.worker")

Status = Literal["starting", "syncing", "generating", "uploading", "waiting", "stopped", "error"]

SEQ_LOOKBACK_VERSIONS = 4
"""How many versions below the newest a starting worker scans for its own highest seq."""


@dataclass
class WorkerOptions:
    """A worker's own settings: everything else comes from the run's run.json."""

    worker_id: str | None = None
    """Unique id of this worker in the run (default `<hostname>-<pid>`)."""
    device: str = "cpu"
    """Torch device for generation: cpu, cuda, cuda:N, mps or auto."""
    engine: str | None = None
    """Generation engine: torch, mlx or vllm (None: the run's worker.engine). Chosen once, at join."""
    int8: bool = False
    """Run from the int8 actor plane (also on when the run's worker.int8 is set)."""
    max_groups: int | None = None
    """Stop after this many groups are uploaded (None: run until stopped)."""
    spool_dir: str | None = None
    """Optional folder for an on-disk copy of the spool, so a restart still uploads pending groups."""
    model_path: str | None = None
    """This machine's copy of the run's model (folder, .gguf or hub id) instead of what run.json names; its
    files must be the run's (checked at join)."""
    join_timeout_s: float = 600.0
    """How long to wait for run.json and the first verified weights before giving up."""
    flush_deadline_s: float = 30.0
    """How long one flush (and the final flush at stop) may keep uploading."""
    max_backoff_s: float = 30.0
    """Largest wait between retries while the store is unreachable."""


@dataclass
class WorkerSummary:
    """What a worker did, returned by `Worker.run` (and printed by the CLI)."""

    worker_id: str
    groups_uploaded: int
    groups_pending: int
    groups_dropped: int
    rollouts: int
    tokens: int
    versions: list[int] = field(default_factory=list)
    status: Status = "stopped"


def default_worker_id() -> str:
    """`<hostname>-<pid>`, reduced to the characters a key allows (letters, digits, `_.-`, ≤64)."""
    host = socket.gethostname().split(".")[0]
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{host}-{os.getpid()}").strip("-._") or f"worker-{os.getpid()}"
    if not name[0].isalnum():
        name = "w" + name
    return layout.check_name(name[-64:].lstrip("-._") or f"w{os.getpid()}", "worker id")


def resume_seq(store: Store, worker_id: str, newest_version: int, lookback: int = SEQ_LOOKBACK_VERSIONS) -> int:
    """The first unused seq for `worker_id`: one past the highest it wrote in the newest few versions."""
    highest = -1
    for v in range(max(0, newest_version - lookback), newest_version + 1):
        for meta in store.list(layout.rollouts_dir(v)):
            parsed = layout.parse_rollout_key(meta.key)
            if parsed is not None and parsed[1] == worker_id:
                highest = max(highest, parsed[2])
    return highest + 1


def read_run_manifest(store: Store, deadline_s: float, stop: threading.Event) -> Any:
    """The run's RunManifest, waiting (with backoff) for a trainer that has not created the run yet."""
    from pnyx.protocol import RunManifest, decode_json

    end = time.monotonic() + deadline_s
    delay = 0.2
    while True:
        try:
            return decode_json(store.get(layout.RUN_MANIFEST), RunManifest)
        except (NotFoundError, StoreUnavailableError) as e:
            if time.monotonic() + delay > end:
                raise ConfigError(
                    f"{store.url} has no readable {layout.RUN_MANIFEST} after {deadline_s:g}s ({e}). Start the "
                    "trainer on this store first (`pnyx trainer --store ...`) or check the URL."
                ) from e
            log.info("waiting for %s in %s", layout.RUN_MANIFEST, store.url)
        if stop.wait(delay):
            raise InterruptedError("stopped while waiting for run.json")
        delay = min(5.0, delay * 1.5)


def cold_join(syncer: Any, deadline_s: float, poll_s: float, stop: threading.Event) -> tuple[int, dict[str, Any]]:
    """(version, tensors) of the newest verified version, waiting with backoff for the first publish.

    Fail-closed: a version that does not verify is never returned; after `deadline_s` without one this
    raises StoreUnavailableError (the trainer is not publishing, or the store is unreachable).
    """
    end = time.monotonic() + deadline_s
    delay = min(poll_s, 0.5)
    last: BaseException | None = None
    while True:
        try:
            return syncer.sync()
        except (NotFoundError, IntegrityError, StoreUnavailableError) as e:
            last = e
            log.info("cold join: %s; retrying", e)
        if time.monotonic() + delay > end:
            raise StoreUnavailableError(
                f"no verified weights within {deadline_s:g}s (last error: {last}). Is the trainer running and "
                "publishing to this store URL?"
            )
        if stop.wait(delay * (0.5 + random.random() / 2)):
            raise InterruptedError("stopped while waiting for the first weights")
        delay = min(10.0, delay * 1.5)


class Worker:
    """One rollout worker of one run. Not thread-safe: call `run` from one thread; `request_stop` from any."""

    def __init__(self, store: Store, options: WorkerOptions | None = None):
        self.store = store
        self.opts = options or WorkerOptions()
        self.worker_id = layout.check_name(self.opts.worker_id or default_worker_id(), "worker id")
        self.stop_event = threading.Event()
        self.status: Status = "starting"
        self.detail = ""
        self.version: int | None = None
        self.digest = ""
        self.versions_used: list[int] = []
        self.rollouts = 0
        self.tokens = 0
        self._seq = 0
        self._joined = False
        self._window = (time.monotonic(), 0, 0)  # (start, rollouts, tokens) of the throughput window
        self._rates = (0.0, 0.0)
        self._last_heartbeat = 0.0
        self._stop_reason = ""
        self._waits = 0  # consecutive waits for the store (the backoff exponent)
        self._made: dict[int, int] = {}  # groups generated per policy version (back-pressure)
        self.spool: Spool | None = None
        self.syncer: Any = None

    # -- control --

    def request_stop(self, reason: str = "stop requested") -> None:
        """Ask the loop to stop at the next boundary (signal-safe: only sets an event)."""
        self._stop_reason = reason
        self.stop_event.set()

    @property
    def stopping(self) -> bool:
        return self.stop_event.is_set()

    # -- joining --

    def join(self) -> None:
        """Read run.json, load model + tokenizer + env, cold-join the weights, find the resume seq."""
        from pnyx.config import config_from_dict, resolve_env_kwargs, resolve_max_new_tokens
        from pnyx.envs import get_env
        from pnyx.models import load_tokenizer, resolve_run_model
        from pnyx.rollout.curriculum import Curriculum
        from pnyx.rollout.engines import check_engine, make_engine
        from pnyx.weights.syncer import Syncer

        self._set_status("starting", "reading run.json")
        manifest = read_run_manifest(self.store, self.opts.join_timeout_s, self.stop_event)
        self.run_id = manifest.run_id
        self.cfg = config_from_dict(manifest.config)
        if self.opts.int8 and not self.cfg.worker.int8:
            raise ConfigError(
                "--int8: this run's trainer does not publish the int8 actor plane. Start the run with "
                "--worker.int8=true (the trainer then publishes it next to the bf16 weights), or drop --int8."
            )
        engine = self.opts.engine or self.cfg.worker.engine
        check_engine(engine, self.opts.device)  # fail before loading anything when the engine cannot run here
        self.env = get_env(self.cfg.env.name, **resolve_env_kwargs(self.cfg))
        self.max_new_tokens = resolve_max_new_tokens(self.cfg.worker.max_new_tokens, self.env)  # run.json's
        self.curriculum = Curriculum(self.env) if self.cfg.worker.curriculum else None
        path = resolve_run_model(
            manifest.model or {}, self.cfg.model.path, self.cfg.model.revision, self.opts.model_path
        )  # the run's exact model on this machine, or a ConfigError saying what differs
        self.tokenizer = load_tokenizer(path)
        w = self.cfg.worker
        self.plane = "int8" if (self.opts.int8 or w.int8) else "weights"
        self.engine = make_engine(
            engine, path, self.tokenizer, dtype=self.cfg.model.dtype, device=self.opts.device, plane=self.plane
        )  # fmt: skip
        capacity = max(w.spool_max_groups, w.prompts_per_cohort)  # 0 in config: hold one cohort at most
        self.spool = Spool(capacity, folder=self.opts.spool_dir, rekey=self._rekey)

        self._set_status("syncing", "cold join")
        self._heartbeat(force=True)
        self.syncer = Syncer(
            self.store,
            plane=self.plane,
            max_backoff_s=self.opts.max_backoff_s,
            poll_interval_s=w.poll_interval_s,
        )
        version, tensors = cold_join(self.syncer, self.opts.join_timeout_s, w.poll_interval_s, self.stop_event)
        self._load(version, tensors)
        pending = [layout.parse_rollout_key(k) for k in self.spool.pending_keys()]
        spooled = max((p[2] for p in pending if p and p[1] == self.worker_id), default=-1)
        self._seq = max(resume_seq(self.store, self.worker_id, version), spooled + 1)
        log.info(
            "worker %s joined run %s: engine=%s env=%s v=%d digest=%s (%s proof) seq=%d",
            self.worker_id, self.run_id, self.engine.name, self.env.name, version, self.digest[:12],
            self.engine.proof_kind, self._seq,
        )  # fmt: skip
        self.syncer.start()  # background prefetch; swapped in only at cohort boundaries
        self._window = (time.monotonic(), self.rollouts, self.tokens)
        self._joined = True

    def _load(self, version: int, tensors: dict[str, Any]) -> None:
        """Apply verified version `version` to the engine in place (only ever called between cohorts).

        The engine writes the tensors that changed into its resident model and proves the result against
        the version's manifest (`pnyx.rollout.engines.base`); `tensors` (the syncer's torch view) is not
        needed: engines read the syncer's verified bits, which they never write.
        """
        proof = self.engine.update(version, self.syncer.state, self.syncer.manifest)
        if proof.chain_digest != self.syncer.digest:
            raise IntegrityError(
                f"v{version}: the engine proved {proof.chain_digest}, the syncer holds {self.syncer.digest}"
            )
        self.version, self.digest = version, proof.chain_digest
        self.versions_used.append(version)

    # -- the loop --

    def run(self) -> WorkerSummary:
        """Join (if not yet), then loop until stopped or `max_groups` uploaded; flush and say goodbye."""
        try:
            if not self._joined:
                self.join()
            while not self.stopping and not self._quota_reached():
                self.step()
        except InterruptedError:
            log.info("worker %s stopped before it joined", self.worker_id)
        except BaseException as e:
            self._set_status("error", f"{type(e).__name__}: {e}"[:500])
            self._heartbeat(force=True)
            raise
        finally:
            if self.syncer is not None:
                self.syncer.stop()
            if getattr(self, "engine", None) is not None:
                self.engine.close()
        return self._shutdown()

    def step(self) -> None:
        """One cohort boundary: maybe swap weights, then generate, spool and flush one cohort."""
        from pnyx.envs import stable_hash
        from pnyx.protocol import encode_group
        from pnyx.rollout.cohort import CohortSpec, generate_cohort

        if self.spool is None or self.syncer is None:
            raise RuntimeError("Worker.step() before join(): call run() or join() first")
        fresh = self.syncer.swap()  # re-raises a fatal error of the prefetch thread
        if fresh is not None:
            self._load(*fresh)
            log.info("worker %s swapped to v=%d digest=%s", self.worker_id, self.version, self.digest[:12])
        w = self.cfg.worker
        cap = w.max_groups_per_version
        if cap is not None and self._groups_at_version() >= cap:
            # Back-pressure: groups beyond this would only go stale in the trainer's window; on a shared
            # machine the cycles are better spent by the trainer. Wait for the next version instead.
            self._set_status("waiting", f"v={self.version}: {cap} groups made, waiting for the next version")
            self._heartbeat()
            self.stop_event.wait(w.poll_interval_s)
            return
        if len(self.spool) + w.prompts_per_cohort > self.spool.max_groups:
            self._wait_for_store()  # spool full: never generate what we would have to drop
            return
        n = w.prompts_per_cohort
        if self.opts.max_groups is not None:
            n = min(n, self.opts.max_groups - self.spool.stats.uploaded - len(self.spool))
        if n <= 0:
            self._wait_for_store()
            return
        seed = stable_hash(self.cfg.run.seed, self.worker_id, self._seq) % (2**31)
        if self.curriculum is not None:
            tasks = self.curriculum.sample(seed, n)
        else:
            tasks = self.env.sample("train", seed=seed, n=n)
        spec = CohortSpec(
            run_id=self.run_id, worker_id=self.worker_id, version=self.version, digest=self.digest,
            group_size=w.group_size, temperature=w.temperature, top_p=w.top_p, top_k=w.top_k,
            max_new_tokens=self.max_new_tokens, seed=seed,
        )  # fmt: skip
        self._set_status("generating", f"v={self.version} tasks={n}")
        result = generate_cohort(self.engine, self.tokenizer, self.env, tasks, spec, self._next_seq)
        if self.curriculum is not None:
            self.curriculum.observe(tasks, result.groups)
        self._made[self.version] = self._made.get(self.version, 0) + len(result.groups)
        for group in result.groups:
            self.spool.add(layout.rollout_key(group.policy_version, self.worker_id, group.seq), encode_group(group))
        self.rollouts += sum(len(g.samples) for g in result.groups)
        self.tokens += result.tokens
        self._set_status("uploading", f"v={self.version} pending={len(self.spool)}")
        self.spool.flush(self.store, self.opts.flush_deadline_s)
        self._update_rates()
        rewards = [s.reward for g in result.groups for s in g.samples]
        log.info(
            "worker=%s v=%d groups=%d pending=%d reward=%.3f rollouts/s=%.2f tok/s=%.1f",
            self.worker_id, self.version, self.spool.stats.uploaded, len(self.spool),
            sum(rewards) / max(1, len(rewards)), *self._rates,
        )  # fmt: skip
        if len(self.spool):
            self._wait_for_store()
        else:
            self._waits = 0
        self._heartbeat()

    def _groups_at_version(self) -> int:
        return self._made.get(self.version, 0) if self.version is not None else 0

    def _uploaded(self) -> int:
        return self.spool.stats.uploaded if self.spool is not None else 0

    def _quota_reached(self) -> bool:
        return self.opts.max_groups is not None and self.spool is not None and (
            self.spool.stats.uploaded >= self.opts.max_groups
        )

    def _wait_for_store(self) -> None:
        """Back off while groups are pending, retrying the flush; returns early on stop."""
        if self.spool is None:
            return
        self._set_status("waiting", f"store unreachable, {len(self.spool)} group(s) spooled")
        self._heartbeat()
        self._waits += 1
        delay = min(self.opts.max_backoff_s, 0.25 * 2 ** min(self._waits, 10)) * (0.5 + random.random() / 2)
        if self.stop_event.wait(delay):
            return
        self.spool.flush(self.store, self.opts.flush_deadline_s)

    def _shutdown(self) -> WorkerSummary:
        if self.spool is not None and len(self.spool):
            self._set_status("uploading", f"final flush of {len(self.spool)} group(s)")
            self.spool.flush(self.store, self.opts.flush_deadline_s)
            if len(self.spool):
                where = f"kept in {self.opts.spool_dir}" if self.opts.spool_dir else "lost"
                log.warning("worker %s: %d group(s) not uploaded at stop (%s)", self.worker_id, len(self.spool), where)
        if self.status != "error":
            self._set_status("stopped", self._stop_reason or "done")
            self._heartbeat(force=True)
        stats = self.spool.stats if self.spool is not None else None
        return WorkerSummary(
            worker_id=self.worker_id,
            groups_uploaded=stats.uploaded if stats else 0,
            groups_pending=len(self.spool) if self.spool is not None else 0,
            groups_dropped=stats.dropped if stats else 0,
            rollouts=self.rollouts,
            tokens=self.tokens,
            versions=list(self.versions_used),
            status=self.status,
        )

    # -- seq numbers --

    def _next_seq(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    def _rekey(self, key: str, data: bytes) -> tuple[str, bytes]:
        import msgspec

        from pnyx.protocol import decode_group, encode_group

        group = msgspec.structs.replace(decode_group(data), seq=self._next_seq())
        return layout.rollout_key(group.policy_version, self.worker_id, group.seq), encode_group(group)

    # -- heartbeat --

    def _set_status(self, status: Status, detail: str = "") -> None:
        self.status = status
        self.detail = detail

    def _update_rates(self) -> None:
        """Rollouts/s and tokens/s since the previous cohort, smoothed (EMA 0.5) for the heartbeat."""
        now = time.monotonic()
        start, r0, t0 = self._window
        if now - start <= 0:
            return
        rates = ((self.rollouts - r0) / (now - start), (self.tokens - t0) / (now - start))
        old = self._rates
        self._rates = rates if old == (0.0, 0.0) else tuple(0.5 * a + 0.5 * b for a, b in zip(old, rates, strict=True))
        self._window = (now, self.rollouts, self.tokens)

    def _heartbeat(self, force: bool = False) -> None:
        """Overwrite workers/<id>.json (at most every heartbeat_interval_s unless forced); never fatal."""
        from pnyx.protocol import HEARTBEAT_SCHEMA, Heartbeat, encode_json

        now = time.monotonic()
        interval = self.cfg.worker.heartbeat_interval_s if hasattr(self, "cfg") else 0.0
        if not force and now - self._last_heartbeat < interval:
            return
        fields: dict[str, Any] = dict(
            schema=HEARTBEAT_SCHEMA,
            worker_id=self.worker_id,
            role="worker",
            version=self.version if self.version is not None else -1,
            updated_at=time.time(),
            rollouts=self._uploaded() * (self.cfg.worker.group_size if hasattr(self, "cfg") else 0),
            groups=self._uploaded(),
            tokens_per_s=round(self._rates[1], 3),
            rollouts_per_s=round(self._rates[0], 3),
            status=self.status,
            detail=self.detail,
            digest=self.digest,
        )
        hb = Heartbeat(**fields)
        try:
            self.store.put(layout.worker_heartbeat(self.worker_id), encode_json(hb))
            self._last_heartbeat = now
        except StoreUnavailableError as e:
            log.warning("heartbeat not written (store unavailable): %s", e)
