"""Supply control, the worker's side: how many more groups this worker may make, from the trainer's demand.

The trainer rewrites `weights/DEMAND` after every publish (`pnyx.train.supply`): its version V, the groups
one step consumes (B), how many usable groups were waiting when it published (`waiting`), how many workers
are live (N) and its seconds per step. The aim: when the trainer publishes, about `lead × B` usable groups
wait for it: enough for its next step without waiting, few enough that none goes stale under its
freshest-first selection (a group it leaves behind is never picked while fresher ones arrive).

Each worker keeps a *target*: how many groups (uploaded ones: zero-variance skips are free) it should have
made. On each new demand version it
- adds its quota `q` once per step the trainer took (feed-forward: a step consumes B, this worker's part
  starts at B/N);
- adds `gain_p × (lead·B − waiting) / N` once (proportional: refill a short queue, let a long one drain);
- moves `q` by `gain_i × (lead·B − waiting) / N` (integral: a worker faster than its share, or whose peers
  are slow or gone, takes on more);
- forgives debt beyond one step plus one cohort, so a worker that cannot keep up never bursts later;
- near the end of the trainer's step budget (`steps_left`), makes at most its share of what the steps left
  can consume beyond the groups already waiting, and nothing once the last step is taken (no step would
  read it).
It may generate while made < target. The trainer never waits for a worker to *notice* a version: the target
already covers the next step's batch (lead ≥ 1), and the owner polls the demand at an eighth of the
trainer's step time (`poll_interval`).

Liveness: the trainer rewrites its demand only when it publishes, so a trainer waiting for data cannot ask
for more. When the target is reached and no new demand came for two steps, the worker is granted one more
cohort; the wait doubles at each grant (up to a minute) and resets with the next demand. A starving trainer
is therefore always fed; a dead one costs at most a cohort per minute per worker. After a demand that
announced the trainer's last step (`steps_left` 0) the first grant waits the full minute (a trainer resumed
with a larger budget is fed then; a finished one gets nothing made for it). Before the first demand
(the trainer has not stepped yet, or is too old to write one) the target is `(1 + lead) × B`: the batch of
the trainer's first step and the lead that should wait at its first publish (with `lead × B` the queue was
empty at that publish and the proportional term took ~5 versions to build it, each a wait for a whole
batch's generation: 5.6 s of the fleet's 24.7 s in `bench_async.py --arm equal`); then the same grants.

`Throttle` knows nothing about the store, models or threads: its owner feeds it demands, counts and a
clock. `Supply` is a throttle behind a lock, shared by a worker's two threads: the courier feeds it the
demands it reads, the generating thread asks it for an allowance and counts what it made.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from pnyx.errors import ConfigError
from pnyx.protocol.records import Demand

GAIN_P = 0.25
"""Share of the queue's error refilled (or drained) at once, per demand."""
GAIN_I = 0.1
"""Share of the queue's error added to the per-step quota, per demand."""
STALL_CAP_S = 60.0
"""Longest wait between two stall grants."""
MIN_POLL_S = 0.05
"""Shortest demand poll interval."""


class Throttle:
    """One worker's allowance under supply control (see the module docstring for the control law)."""

    def __init__(
        self,
        groups_per_step: int,
        lead: float,
        cohort: int,
        *,
        gain_p: float = GAIN_P,
        gain_i: float = GAIN_I,
        clock: Callable[[], float] = time.monotonic,
    ):
        if groups_per_step < 1 or cohort < 1 or lead < 1:
            raise ConfigError(
                f"Throttle needs groups_per_step, cohort >= 1 and lead >= 1, got {groups_per_step}, {cohort}, {lead}"
            )
        self.groups_per_step = groups_per_step
        self.lead = lead
        self.cohort = cohort
        self.gain_p = gain_p
        self.gain_i = gain_i
        self._clock = clock
        self.made = 0
        """Groups made (spooled for upload) since this worker started."""
        self.target = (1 + lead) * groups_per_step
        """Groups this worker should have made by now: before the first demand, the trainer's first batch plus
        the lead that should wait at its first publish."""
        self.quota: float | None = None
        """This worker's groups per trainer step (None before the first demand)."""
        self.version: int | None = None
        """The newest trainer version a demand announced."""
        self.max_staleness: int | None = None
        self.step_s = 0.0
        self.workers = 1
        self.waiting: int | None = None
        self.steps_left: int | None = None
        """Steps the trainer will still take, by its last demand (None: it has no step budget)."""
        self.grants = 0
        """Cohorts granted because the demand stalled (see the module docstring)."""
        self._news_at = clock()
        self._stalls = 0

    # -- inputs --

    def observe(self, demand: Demand) -> bool:
        """Take a demand record (`pnyx.protocol.Demand`); True if it was news (a newer version)."""
        if self.version is not None and demand.version <= self.version:
            return False
        b = max(1, int(demand.groups_per_step))
        workers = max(1, int(demand.workers))
        share = 1.0 / workers
        if self.quota is None:
            self.quota, steps = share * b, 1
            self.target = float(self.made)  # the pre-demand allowance is spent or forgotten
        else:
            if workers != self.workers:
                self.quota *= self.workers / workers  # the fleet's total stays put; the error term adjusts it
            steps = max(1, demand.version - (self.version or 0))
        error = self.lead * b - int(demand.waiting)
        self.target += self.quota * steps + self.gain_p * share * max(
            error, -b * (int(demand.max_staleness) + 1)
        )
        self.quota = min(float(b), max(0.0, self.quota + self.gain_i * share * max(-b, min(b, error))))
        self.target = min(self.target, self.made + self.quota + self.cohort)  # forgive older debt
        self.steps_left = None if demand.steps_left is None else max(0, int(demand.steps_left))
        if self.steps_left is not None:  # the trainer's last steps take this many beyond what waits for them
            self.target = min(
                self.target, self.made + share * max(0, self.steps_left * b - int(demand.waiting))
            )
        self.groups_per_step = b
        self.version = int(demand.version)
        self.max_staleness = int(demand.max_staleness)
        self.step_s = max(0.0, float(demand.step_s))
        self.workers = workers
        self.waiting = int(demand.waiting)
        self._news_at = self._clock()
        self._stalls = 0
        return True

    def note_made(self, groups: int) -> None:
        """Count groups made (spooled for upload); skipped zero-variance groups are not counted."""
        self.made += groups

    # -- outputs --

    def allowance(self) -> int:
        """Groups this worker may make now (0: wait). Grants a stall cohort when one is due."""
        left = self.target - self.made
        if left > 0:
            return math.ceil(left)
        now = self._clock()
        if now - self._news_at >= self.stall_after():
            self.target = self.made + self.cohort
            self.grants += 1
            self._stalls += 1
            self._news_at = now
            return self.cohort
        return 0

    def room(self) -> float:
        """Groups this worker may still make toward its target, read without granting a stall cohort (what a
        cohort committed ahead may take: `pnyx.rollout.worker`)."""
        return self.target - self.made

    def stall_after(self) -> float:
        """Seconds without a new demand after which the next stall cohort is granted."""
        if self.steps_left == 0:  # the trainer took its last step: a resumed one with a larger budget is
            return STALL_CAP_S  # fed within a minute; until then nothing is made for a finished run
        base = max(1.0, 2.0 * self.step_s) if self.step_s > 0 else 2.0
        return min(STALL_CAP_S, base * 2.0**self._stalls)

    def wait_hint(self) -> float:
        """How long to wait before asking `allowance` again (a new demand should wake the owner sooner)."""
        return max(MIN_POLL_S, min(self.stall_after() - (self._clock() - self._news_at), 1.0))

    def poll_interval(self, default_s: float) -> float:
        """How often to read the demand: an eighth of the trainer's step, within [0.05 s, default_s]."""
        if self.step_s <= 0:
            return default_s
        return max(MIN_POLL_S, min(default_s, self.step_s / 8))

    def expired(self, version: int) -> bool:
        """True if a group of `version` can no longer reach a trainer step: the trainer announced a version
        past its staleness window (a group uploaded there is never read)."""
        if self.version is None or self.max_staleness is None:
            return False
        return version < self.version - self.max_staleness

    def describe(self) -> str:
        """One short line for the heartbeat's detail."""
        if self.quota is None:
            return f"supply: made {self.made}/{self.target:.0f} before the trainer's first demand"
        last = f" steps_left={self.steps_left}" if self.steps_left is not None else ""
        return (
            f"supply: made {self.made}/{self.target:.0f} trainer v={self.version} waiting={self.waiting} "
            f"share=1/{self.workers} quota={self.quota:.1f}/step{last}"
        )


class Supply:
    """A `Throttle` behind a lock, for a worker's courier thread (`observe`, `poll_interval`, `expired`) and
    its generating thread (`allowance`, `note_made`)."""

    def __init__(self, throttle: Throttle):
        self.throttle = throttle
        """The control law; read it only for display or tests (its fields change under the lock)."""
        self._lock = threading.Lock()

    def observe(self, demand: Demand) -> bool:
        """`Throttle.observe`: True if `demand` was news (a newer version)."""
        with self._lock:
            return self.throttle.observe(demand)

    def note_made(self, groups: int) -> None:
        with self._lock:
            self.throttle.note_made(groups)

    def allowance(self) -> tuple[int, float, str]:
        """(groups this worker may make now, seconds to wait before asking again when 0, a line for the
        heartbeat's detail), read together."""
        with self._lock:
            return self.throttle.allowance(), self.throttle.wait_hint(), self.throttle.describe()

    def room(self) -> float:
        """`Throttle.room`."""
        with self._lock:
            return self.throttle.room()

    def poll_interval(self, default_s: float) -> float:
        with self._lock:
            return self.throttle.poll_interval(default_s)

    def expired(self, version: int) -> bool:
        with self._lock:
            return self.throttle.expired(version)
