"""A worker's side of committed draws (`security.committed_draws`, `pnyx.protocol.commits`).

    committer = Committer(store, signer, run_id, "gpu-box-1", trainer_fingerprint)
    ticket = committer.commit(version, seqs, task_ids)      # the signed commitment for the next tick
    outcome = committer.wait(ticket, stop)                  # that tick: its beacon, or why it refused
    ahead = committer.ahead(version, task_ids, reserve)     # a cohort committed ahead (seqs reserved)
    drawn, seqs = committer.draw(ahead, reserve, skip_to, stop)   # later: its tick (recommitted if refused)

`commit` reads the `ticks/LATEST` hint, writes the commitment under the next tick's prefix and returns a
`Ticket`. `wait` polls for that tick, verifies the trainer's signature and returns a `Drawn` (the tick
included the commitment: draw with its beacon) or a `Refused` (it refused it; `next_seq` when the reason
is a seq this name and key already committed, as after a restart). A tick written before the commitment
landed does not include it: `wait` then commits again for the next tick, with the same seqs and tasks.
The generating thread calls both between cohorts (the only store I/O it does itself; the courier does the
rest); store errors are retried with backoff until `stop` is set.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pnyx.errors import AlreadyExistsError, NotFoundError, RecordRejected, StoreUnavailableError
from pnyx.protocol import commits, layout
from pnyx.protocol.commits import Commitment
from pnyx.security.signing import Signer
from pnyx.store import Store

log = logging.getLogger("pnyx.worker")

POLL_S = 0.02
"""Seconds between two reads of the awaited tick for the first `FAST_POLL_S` (then doubling up to
`MAX_POLL_S`): the trainer ticks every `security.tick_interval_s` (0.1 s by default)."""
FAST_POLL_S = 1.0
MAX_POLL_S = 0.25
LOG_WAIT_S = 30.0
"""A wait for a tick longer than this is logged (the trainer may be down or not ticking)."""
_NEXT_FREE = re.compile(r"next free seq (\d+)")


@dataclass(frozen=True)
class Ticket:
    """A commitment written for tick `n`."""

    n: int
    key: str
    data: bytes
    first_seq: int


@dataclass(frozen=True)
class Ahead:
    """A commitment written and not yet drawn: its ticket, its seqs, the version and tasks it names."""

    ticket: Ticket
    seqs: list[int]
    version: int
    task_ids: list[str]


@dataclass(frozen=True)
class Drawn:
    """Tick `n` included commitment `key`: draw with `beacon`."""

    n: int
    beacon: str
    key: str


@dataclass(frozen=True)
class Refused:
    """The trainer refused the commitment (`reason`); `next_seq`: the first seq it would take."""

    reason: str
    next_seq: int | None


class Committer:
    """Writes one worker's commitments and reads the trainer's ticks (see the module docstring)."""

    def __init__(self, store: Store, signer: Signer, run_id: str, worker_id: str, trainer_fp: str):
        self.store, self.run_id, self.worker_id, self.trainer_fp = store, run_id, worker_id, trainer_fp
        self.signer = signer.for_run(run_id)
        self.wait_s = 0.0
        """Seconds spent waiting for ticks so far (the cost of committed draws, in the heartbeat's terms)."""

    def latest(self) -> int:
        """The newest tick's number by the LATEST hint (-1: none yet or unreadable)."""
        try:
            return int(self.store.get(layout.TICKS_LATEST).decode().strip())
        except (NotFoundError, ValueError, UnicodeDecodeError):
            return -1

    def commit(self, version: int, seqs: list[int], task_ids: list[str], n: int | None = None) -> Ticket:
        """Write the commitment to `seqs` (contiguous), one task each, drawn at `version`, for tick `n`
        (default: the one after the newest)."""
        if not seqs or seqs != list(range(seqs[0], seqs[0] + len(seqs))) or len(seqs) != len(task_ids):
            raise ValueError(
                f"a commitment needs contiguous seqs, one task each: {seqs}, {len(task_ids)} tasks"
            )
        n = self.latest() + 1 if n is None else n
        c = Commitment(
            run_id=self.run_id, worker_id=self.worker_id, version=version, first_seq=seqs[0], tasks=list(task_ids),
            created_at=time.time(),
        )  # fmt: skip
        data = commits.encode_commitment(c, self.signer)
        key = commits.commit_key(n, self.worker_id, seqs[0], data)
        self.store.put(key, data, "create")
        return Ticket(n=n, key=key, data=data, first_seq=seqs[0])

    def read_tick(self, n: int) -> commits.Tick | None:
        """Tick `n` as the trainer signed it; None while it does not exist. RecordRejected: an object there
        that is not the trainer's tick."""
        try:
            data = self.store.get(layout.tick_key(n))
        except NotFoundError:
            return None
        return commits.decode_tick(data, self.run_id, self.trainer_fp)

    def outcome(self, ticket: Ticket, tick: commits.Tick) -> Drawn | Refused | None:
        """What `tick` says of `ticket` (None: it did not see it)."""
        if ticket.key in tick.included:
            return Drawn(n=tick.n, beacon=tick.beacon, key=ticket.key)
        reason = tick.refused.get(ticket.key)
        if reason is None:
            return None
        m = _NEXT_FREE.search(reason)
        return Refused(reason=reason, next_seq=int(m.group(1)) if m else None)

    def wait(self, ticket: Ticket, stop: threading.Event) -> Drawn | Refused | None:
        """Wait for the tick that judges `ticket` (re-committing for a later tick when one passed it by).
        None: `stop` was set first."""
        t0 = time.monotonic()
        poll, logged = POLL_S, False
        try:
            while not stop.is_set():
                try:
                    tick = self.read_tick(ticket.n)
                except RecordRejected as e:  # not the trainer's: ticks/ should be its alone (docs/fleet.md)
                    log.warning("worker %s: %s is not the trainer's tick (%s); committing for the next", self.worker_id,
                                layout.tick_key(ticket.n), e)  # fmt: skip
                    ticket = self._recommit(ticket, ticket.n + 1)
                    continue
                except StoreUnavailableError as e:
                    log.warning(
                        "worker %s: store unavailable while waiting for tick %d (%s)",
                        self.worker_id,
                        ticket.n,
                        e,
                    )
                    stop.wait(min(5.0, poll * 4))
                    continue
                if tick is not None:
                    got = self.outcome(ticket, tick)
                    if got is not None:
                        return got
                    ticket = self._recommit(ticket, max(ticket.n + 1, self.latest() + 1))
                    continue
                if not logged and time.monotonic() - t0 > LOG_WAIT_S:
                    logged = True
                    log.warning(
                        "worker %s: no tick %d after %.0fs: is the trainer running with committed draws?",
                        self.worker_id, ticket.n, LOG_WAIT_S,
                    )  # fmt: skip
                stop.wait(poll)
                if (
                    time.monotonic() - t0 > FAST_POLL_S
                ):  # a tick is due every tick_interval_s: poll fast at first
                    poll = min(MAX_POLL_S, poll * 2)
            return None
        finally:
            self.wait_s += time.monotonic() - t0

    def ahead(self, version: int, task_ids: list[str], reserve: Callable[[], int]) -> Ahead:
        """Reserve one seq per task (`reserve`) and commit to them, drawn at `version`, without waiting for
        the tick: a worker commits its next cohort while it draws the one before (`draw` later)."""
        seqs = [reserve() for _ in task_ids]
        return Ahead(self.commit(version, seqs, task_ids), seqs, version, list(task_ids))

    def draw(
        self, ahead: Ahead, reserve: Callable[[], int], skip_to: Callable[[int], None], stop: threading.Event
    ) -> tuple[Drawn | None, list[int]]:
        """Wait for the tick of commitment `ahead`. Returns (how to draw, the seqs); (None, []) when `stop` came
        first. A commitment refused because its seqs were committed before (a restarted worker) moves the
        numbering on (`skip_to(next free seq)`) and commits the same tasks again under new seqs; any other
        refusal raises RuntimeError (an honest worker never meets one)."""
        while True:
            got = self.wait(ahead.ticket, stop)
            if got is None or isinstance(got, Drawn):
                return got, ahead.seqs if got is not None else []
            log.warning("worker %s: commitment refused: %s", self.worker_id, got.reason)
            if got.next_seq is None:
                raise RuntimeError(f"the trainer refused worker {self.worker_id}'s commitment: {got.reason}")
            skip_to(got.next_seq)
            ahead = self.ahead(ahead.version, ahead.task_ids, reserve)

    def _recommit(self, ticket: Ticket, n: int) -> Ticket:
        """The same commitment (same bytes) for tick `n`."""
        key = commits.commit_key(n, self.worker_id, ticket.first_seq, ticket.data)
        with contextlib.suppress(AlreadyExistsError):  # the key names its bytes' hash: they are there
            self.store.put(key, ticket.data, "create")
        return Ticket(n=n, key=key, data=ticket.data, first_seq=ticket.first_seq)
