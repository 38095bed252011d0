"""The trainer's ticks: the beacon that reveals committed draws' randomness (`pnyx.protocol.commits`).

`Ticker` runs on rank 0 when `security.committed_draws` is on. Every `tick_interval_s` (and at once after a
publish, `poke`) it lists the commitments waiting for its next tick, reads each one, includes those that are
valid and commit seqs their (name, key) never committed before, and writes the tick: fresh random bytes and
what it included or refused. A tick is written only when something waits for it, so an idle run writes
none; and once more as the trainer stops (`close`), so waiting workers draw what they committed and move on
to the newest weights. Admission asks `check(group, signer)` whether a committed group matches its tick.

What it remembers: every tick of the window (by the version the trainer held when it ticked; a group of an
older version is stale anyway), per (worker name, key) the first and highest seq committed (`seqs`, at
most `MAX_NAMES` pairs, the oldest forgotten first), the window's committed ranges (`ranges`, for the
hold-back) and the seqs it excused (`lost`). On a restart it reads back the ticks of the window and rebuilds
all four from them; a pair last seen in a tick older than the window is forgotten (docs/security.md,
"Committed draws"). Store errors are logged and retried at the next interval: a tick that cannot be written
delays the workers waiting for it, nothing else.

**A restarted worker.** A worker killed between its commitment's tick and the upload of the groups it drew
comes back numbering after the highest seq its store and spool hold, and its first commitment reuses seqs
its earlier life committed: the tick refuses it ("next free seq N") and the worker moves on to N. The seqs
of the earlier cohorts it never drew would be gaps (faults of its key). The tick that refuses it excuses
them instead (`Lost`, in the tick: the seqs of the pair's last two included commitments, the cohort it was
drawing and the one it had committed ahead, from the refused one's first seq on, at most `MAX_EXCUSED`): the settlement counts them `lost`, not `gap`, and the hold-back does
not wait for them. A picker could claim a restart after a draw it did not want, so the excuse is budgeted:
one per (name, key), and one more per `EXCUSE_EVERY` seqs it committed; past that a refused reuse leaves
gaps as before.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from pnyx.errors import AlreadyExistsError, NotFoundError, RecordRejected, StoreUnavailableError
from pnyx.protocol import commits, layout
from pnyx.protocol.commits import Included, Lost, Tick
from pnyx.protocol.draws import SCHEME
from pnyx.protocol.records import RolloutGroup
from pnyx.security.checks import UNCOMMITTED
from pnyx.security.signing import Signer
from pnyx.store import Store
from pnyx.train.rescore import ScoredGroup
from pnyx.train.seq_books import SeqBook

log = logging.getLogger("pnyx.train.ticker")

MAX_NAMES = 200_000
"""(worker name, key) pairs whose committed seqs are remembered at most (oldest forgotten first)."""
MAX_PER_TICK = 4096
"""Commitments one tick reads at most (the rest wait for the next)."""
MAX_TOLD = 1024
"""Keys whose first uncommitted group is logged (one line each)."""
HOLD_RELEASE_S = 30.0
"""Seconds without a publish after which held groups are released (`Ticker.held`)."""
KEEP_VERSIONS_EXTRA = 2
"""Ticks are kept while their version is within max_staleness + this of the trainer's."""
EXCUSE_EVERY = 100
"""A (name, key) may have one restart's undrawn seqs excused, and one more per this many seqs committed."""
MAX_EXCUSED = 64
"""Seqs one excuse covers at most (two cohorts'; the rest of larger commitments stay gaps)."""
EXCUSED_COMMITMENTS = 2
"""A restart's excuse covers the pair's last this many included commitments: the cohort a worker was drawing
and the one it had committed ahead (`security.commit_ahead`)."""


class Ticker:
    """Writes the run's ticks and answers admission's question (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        signer: Signer,
        run_id: str,
        interval_s: float,
        version: Callable[[], int],
        max_staleness: int,
    ) -> None:
        self.store, self.signer, self.run_id = store, signer, run_id
        self.interval_s = interval_s
        self.version = version
        self.max_staleness = max_staleness
        self.next_n = 0
        self.ticks: dict[int, Tick] = {}
        self.seqs: OrderedDict[tuple[str, str], tuple[int, int]] = OrderedDict()
        """(worker name, key) -> (the first seq it committed that this trainer saw, the highest), least
        recently committed first (at most `MAX_NAMES`): reuse refusals and standing."""
        self.counts = {"ticks": 0, "included": 0, "refused": 0, "excused": 0}
        self.ranges: dict[tuple[str, str], list[tuple[int, int, int]]] = {}
        """(worker name, key) -> (first seq, count, version) of each commitment the window's ticks included
        (the hold-back: `held`)."""
        self.lost: dict[tuple[str, str], list[tuple[int, int]]] = {}
        """(worker name, key) -> the (first, last) seqs excused for it (`Lost`): a restart's undrawn cohort."""
        self.hold_release_s = HOLD_RELEASE_S
        self.standing = 0
        """`security.standing_groups`: the first this many seqs of an untrusted (name, key) are held for good."""
        self.trusted: frozenset[str] = frozenset()
        self._seen_version = (-1, time.monotonic())  # (the trainer's version, when it was first seen)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- the trainer's side ------------------------------------------------------------------------------

    def restore(self, unswept: int | None = None) -> None:
        """Read back the ticks this run wrote (a restarted trainer): the newest first, down to the first
        whose version left the window, or, when the checkpoint's cursor has versions below the window it
        has not swept yet (`unswept`: its `swept_below`), down to `KEEP_VERSIONS_EXTRA` below those: their
        seqs are settled after the restart, and a killed worker's undrawn cohort among them is a gap unless
        the tick that excused it is read back too."""
        keys = sorted(
            m.key for m in self.store.list(layout.TICKS_PREFIX) if layout.parse_tick_key(m.key) is not None
        )
        low = self.version() - self.max_staleness - KEEP_VERSIONS_EXTRA
        if unswept is not None:
            low = min(low, unswept - KEEP_VERSIONS_EXTRA)
        loaded: list[Tick] = []
        for key in reversed(keys):
            try:
                t = commits.decode_tick(self.store.get(key), self.run_id, self.signer.fingerprint)
            except RecordRejected as e:
                log.warning("ticker: %s is not a tick of this run (%s); ignored", key, e)
                continue
            loaded.append(t)
            if t.version < low:
                break
        with self._lock:
            for t in reversed(loaded):
                self._remember(t)
            if keys:
                self.next_n = max(self.next_n, max(layout.parse_tick_key(k) or 0 for k in keys) + 1)
        if loaded:
            log.info("ticker: %d ticks read back, next tick %d", len(loaded), self.next_n)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pnyx-ticker", daemon=True)
            self._thread.start()

    def poke(self) -> None:
        """Tick now (after a publish: workers waiting on a tick get the new version's draws sooner)."""
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self._try_tick()
            self._wake.wait(self.interval_s)
            self._wake.clear()
        # A last tick as the trainer stops (`close` waits for it at most 10 s): the workers waiting on one draw
        # their committed cohorts, which a resumed trainer can still train on, and then swap to the newest
        # weights; without it they would hold the version they committed to until a trainer ticks again.
        self._try_tick()

    def _try_tick(self) -> None:
        try:
            self.tick()
        except StoreUnavailableError as e:
            log.warning("ticker: store unavailable (%s); next try in %.1fs", e, self.interval_s)
        except Exception:  # never let the beacon die silently: log and go on
            log.exception("ticker: tick %d failed", self.next_n)

    def tick(self) -> Tick | None:
        """One tick: list the waiting commitments, judge them, write `ticks/{n}` and the LATEST hint.
        Returns the tick, or None when nothing waited for it."""
        n = self.next_n
        keys = [m.key for m in self.store.list(layout.commits_dir(n), limit=MAX_PER_TICK)]
        if not keys:
            return None
        included: dict[str, Included] = {}
        refused: dict[str, str] = {}
        claimed: dict[tuple[str, str], int] = {}
        lost: list[Lost] = []
        for key in keys:
            verdict = self._read(key, n)
            if isinstance(verdict, str):
                refused[key] = verdict
                continue
            pair = (verdict.worker_id, verdict.key)
            high = claimed.get(pair, self.seqs.get(pair, (0, -1))[1])
            if verdict.first_seq <= high:
                refused[key] = (
                    f"seq {verdict.first_seq} reuses a seq this name and key committed; next free seq {high + 1}"
                )
                if (
                    pair not in claimed
                    and (excuse := self._excuse(pair, verdict.first_seq, lost)) is not None
                ):
                    lost.append(excuse)
                continue
            claimed[pair] = verdict.first_seq + len(verdict.tasks) - 1
            included[key] = verdict
        tick = Tick(
            run_id=self.run_id, n=n, beacon=commits.new_beacon(), version=self.version(), included=included,
            refused=refused, created_at=time.time(), lost=lost,
        )  # fmt: skip
        with self._lock:  # known before any worker can read it (admission may meet its groups at once)
            self.ticks[n] = tick
        try:
            self.store.put(layout.tick_key(n), commits.encode_tick(tick, self.signer), "create")
        except AlreadyExistsError:
            tick = self._adopt(n)
            if tick is None:
                return None
        except BaseException:
            with self._lock:  # not written: tick n is drawn again (no worker can have read this one)
                self.ticks.pop(n, None)
            raise
        with self._lock:
            self._remember(tick)
            self.next_n = n + 1
            self.counts["ticks"] += 1
            self.counts["included"] += len(tick.included)
            self.counts["refused"] += len(tick.refused)
            self.counts["excused"] += sum(x.last_seq - x.first_seq + 1 for x in tick.lost)
        try:
            self.store.put(layout.TICKS_LATEST, str(n).encode())
        except StoreUnavailableError as e:  # a hint: workers find the next tick by probing too
            log.warning("ticker: could not write %s (%s)", layout.TICKS_LATEST, e)
        if refused:
            log.info(
                "ticker: tick %d refused %d commitment(s): %s", n, len(refused), next(iter(refused.values()))
            )
        return tick

    def _adopt(self, n: int) -> Tick | None:
        """Tick n exists already: ours (an earlier put landed though it reported a failure) is adopted, as
        workers may have drawn with it; anything else is skipped (ticks/ should be the trainer's alone:
        docs/fleet.md)."""
        try:
            tick = commits.decode_tick(
                self.store.get(layout.tick_key(n)), self.run_id, self.signer.fingerprint
            )
        except (RecordRejected, NotFoundError) as e:
            log.error(
                "ticker: %s exists and is not this trainer's tick (%s); skipping it", layout.tick_key(n), e
            )
            with self._lock:
                self.ticks.pop(n, None)
                self.next_n = n + 1
            return None
        with self._lock:
            self.ticks[n] = tick
        return tick

    def _read(self, key: str, n: int) -> Included | str:
        """What commitment `key` commits to, or why it is refused."""
        parsed = layout.parse_commit_key(key)
        if parsed is None or parsed[0] != n:
            return "not a commitment key"
        try:
            data = self.store.get(key)
        except NotFoundError:
            return "deleted before it was read"
        if commits.content_hash(data) != parsed[3]:
            return "its bytes do not match the hash in its key"
        try:
            fp, c = commits.decode_commitment(data, self.run_id)
        except RecordRejected as e:
            return f"{e.reason}: {e}"
        if c.worker_id != parsed[1] or c.first_seq != parsed[2]:
            return "its worker or first seq differs from its key's"
        return Included(
            key=fp, worker_id=c.worker_id, version=c.version, first_seq=c.first_seq, tasks=c.tasks
        )

    def _excuse(self, pair: tuple[str, str], first: int, pending: list[Lost]) -> Lost | None:
        """The seqs a refused reuse from `first` excuses for `pair`: those of its last `EXCUSED_COMMITMENTS`
        included commitments from `first` on (a restarted worker's undrawn cohorts: the one it was drawing
        and the one it had committed ahead), if its budget allows (see the module docstring); None: nothing
        to excuse."""
        with self._lock:
            ranges = self.ranges.get(pair)
            if not ranges or pair not in self.seqs:
                return None
            last = sorted(ranges)[-EXCUSED_COMMITMENTS:]  # the cohort drawn and the one committed ahead
            start, high = last[0][0], max(a + n - 1 for a, n, _ in last)
            lo = max(first, start, high - MAX_EXCUSED + 1)
            done = self.lost.get(pair, []) + [
                (x.first_seq, x.last_seq) for x in pending if (x.worker_id, x.key) == pair
            ]
            if lo > high or any(a <= high <= b for a, b in done):
                return None
            ever, top = self.seqs[pair]
            if len(done) >= 1 + (top - ever + 1) // EXCUSE_EVERY:
                return None
        return Lost(key=pair[1], worker_id=pair[0], first_seq=lo, last_seq=high)

    def excused(self, worker: str, fp: str) -> list[tuple[int, int]]:
        """The (first, last) seq ranges excused for `worker` under key `fp` (the settlement's `lost`)."""
        with self._lock:
            return list(self.lost.get((worker, fp), ()))

    def _remember(self, tick: Tick) -> None:
        self.ticks[tick.n] = tick
        for x in tick.lost:
            got = self.lost.setdefault((x.worker_id, x.key), [])
            if (x.first_seq, x.last_seq) not in got:
                got.append((x.first_seq, x.last_seq))
        for inc in tick.included.values():
            pair, last = (inc.worker_id, inc.key), inc.first_seq + len(inc.tasks) - 1
            first, high = self.seqs.get(pair, (inc.first_seq, last))
            self.seqs[pair] = (min(first, inc.first_seq), max(high, last))
            self.seqs.move_to_end(pair)
            self.ranges.setdefault(pair, []).append((inc.first_seq, len(inc.tasks), inc.version))
        while len(self.seqs) > MAX_NAMES:
            old = self.seqs.popitem(last=False)[0]
            self.ranges.pop(old, None)
            self.lost.pop(old, None)
        low = self.version() - self.max_staleness - KEEP_VERSIONS_EXTRA
        for old in [k for k, t in self.ticks.items() if t.version < low]:
            del self.ticks[old]
        for pair in [p for p, rs in self.ranges.items() if rs[0][2] < low]:
            kept = [r for r in self.ranges[pair] if r[2] >= low]
            if kept:
                self.ranges[pair] = kept
            else:
                del self.ranges[pair]

    # --- admission's side -----------------------------------------------------------------------------

    def get(self, n: int) -> Tick | None:
        with self._lock:
            return self.ticks.get(n)

    def on_probation(self, worker_id: str, fp: str, seq: int) -> bool:
        """Whether seq `seq` of (`worker_id`, key `fp`) is one of the first `standing` seqs that pair
        committed (an untrusted key's: never trained)."""
        if not self.standing or fp in self.trusted:
            return False
        with self._lock:
            return seq < self.seqs.get((worker_id, fp), (0, 0))[0] + self.standing

    def held(self, g: ScoredGroup, book: SeqBook | None) -> tuple[int, int] | None:
        """Whether the planner must pass over committed group `g` for now: a seq its (name, key) committed
        below it, in a tick of the window, is not delivered yet (read and signed: `book.verified`, its name's
        seq book; or settled, below `book.low`). Returns the first such (version, seq), for the planner to
        fetch its record if it is listed; None: not held. So a worker that leaves a committed seq empty gets
        nothing after it trained until the seq is settled as a `gap` at the sweep, when its version, and
        usually the held group's, leave the window. Released for every group when the trainer has published
        nothing for `hold_release_s` (a lone worker that lost a committed seq in a crash must not starve it).
        With `standing`, the first `standing` seqs of an untrusted (name, key) are held for good ((-1, seq):
        never released, they expire)."""
        grp = g.group
        if grp.tick < 0 or not g.signer:
            return None
        if self.on_probation(grp.worker_id, g.signer, grp.seq):
            return -1, grp.seq  # on probation for good (standing): nothing to fetch
        now = time.monotonic()
        with self._lock:
            pair = (grp.worker_id, g.signer)
            ranges = self.ranges.get(pair)
            version = self.version()
            if version != self._seen_version[0]:
                self._seen_version = (version, now)
            if not ranges or now - self._seen_version[1] > self.hold_release_s:
                return None
            low = book.low if book is not None and book.low is not None else 0
            verified = book.verified if book is not None else []
            excused = self.lost.get(pair, ())
            for first, count, committed_at in ranges:
                for seq in range(max(first, low), min(first + count, grp.seq)):
                    i = bisect.bisect_left(verified, seq)
                    missing = i == len(verified) or verified[i] != seq
                    if missing and not any(a <= seq <= b for a, b in excused):
                        return committed_at, seq
        return None

    def policy(self, base: Callable[[ScoredGroup], str | None] | None) -> Callable[[ScoredGroup], str | None]:
        """Admission's check of a group (`Admission.check_draws`): `base`'s verdict first, then
        `UNCOMMITTED` for a seeded group that does not match its tick (logged once per key, with why)."""
        told: set[str] = set()

        def check(g: ScoredGroup) -> str | None:
            if base is not None and (reason := base(g)) is not None:
                return reason
            if g.group.draws != SCHEME:  # unseeded, and let in by `base` (a trusted key, accept_unseeded):
                return None  # a commitment binds a seed, and this group has none
            why = self.check(g.group, g.signer)
            if why is None:
                return None
            if g.signer not in told and len(told) < MAX_TOLD:
                told.add(g.signer)
                log.warning("ticker: %s (key %s) is uncommitted: %s", g.key, g.signer, why)
            return UNCOMMITTED

        return check

    def check(self, group: RolloutGroup, signer: str) -> str | None:
        """Why a group does not stand as a committed draw (None: it does)."""
        if group.tick < 0 or not group.commit:
            return "not committed (the run requires committed draws: security.committed_draws)"
        return commits.check_group(
            self.get(group.tick), signer=signer, worker_id=group.worker_id, seq=group.seq, task_id=group.task_id,
            version=group.policy_version, beacon=group.beacon, commit=group.commit,
        )  # fmt: skip
