"""The worker side of PULSE: follow the newest published version, verified, fail-closed.

`sync()` finds the newest manifest (HEAD is only a hint), plans the cheaper of two routes (the deltas from
the version it holds, or the newest anchor at or before the target plus the deltas after it), fetches and
applies them onto a private copy, verifies every tensor, the state digest and the hash chain, and only then
exposes the new state. A digest mismatch, missing object or parent mismatch never changes the served
weights: the route is retried, then the syncer re-anchors, and if that fails too it raises IntegrityError
with every reason (the served state is still the last verified one). `start()` runs the same work in a
background thread so that `swap()` at a cohort boundary never waits on the network.

Given the trainer's `Verifier` (`trust=`, what every worker passes: docs/security.md), the syncer sees only
manifests the trainer named and signed: forged, squatted or unsigned versions are invisible, and a
manifest whose content is not signed by the trainer fails like a broken chain (the served state stays).

Knows nothing about RL or models; torch only when tensors are handed out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

from pnyx.errors import IntegrityError, NotFoundError, PnyxError
from pnyx.store import Store
from pnyx.store.retry import RETRY_FACTOR, Backoff
from pnyx.weights import int8 as q8
from pnyx.weights.bits import BitState, to_torch
from pnyx.weights.manifest import PlaneManifest, WeightManifest, latest_version, read_manifest, verify_plane
from pnyx.weights.payload import read_anchor, read_delta

if TYPE_CHECKING:
    import torch

    from pnyx.security.signing import Verifier

log = logging.getLogger("pnyx.weights")
Plane = Literal["weights", "int8"]


@dataclass(frozen=True)
class Verified:
    """A fully verified state of one plane at one version."""

    version: int
    digest: str  # chain digest
    state: BitState
    digests: dict[str, str] = field(default_factory=dict)  # tensor digests of exactly these arrays
    manifest: PlaneManifest | None = None  # the plane manifest this state verified against


@dataclass
class Route:
    kind: Literal["warm", "cold"]
    steps: list[WeightManifest]  # in apply order; for cold, steps[0] is the anchor
    nbytes: int


class Syncer:
    """Follows one run's weights. `version`, `digest` and `state` are the served (verified) state.

    plane: "weights" (the exact published dtype) or "int8" (the actor plane; `tensors` dequantizes).
    retries: attempts of the chosen route before re-anchoring. backoff_s: first pause between attempts.
    trust: the trainer's public key (None: accept unsigned manifests; only tests and benchmarks on stores
    they publish themselves: a run's readers get it from run.json through `TrustedWeights.syncer`).
    """

    def __init__(
        self,
        store: Store,
        plane: Plane = "weights",
        *,
        retries: int = 2,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        poll_interval_s: float = 2.0,
        sleep: Callable[[float], None] = time.sleep,
        trust: Verifier | None = None,
    ):
        self.store = store
        self.trust = trust
        self.plane: Plane = plane
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.poll_interval_s = poll_interval_s
        self._sleep = sleep
        self._served: Verified | None = None
        self._staged: Verified | None = None
        self._pinned: Verified | None = None  # the staged state `pin` promised the next `swap`
        self._pin_set = False  # `pin` was called since the last `swap` (None pinned: swap installs nothing)
        self._lock = threading.Lock()
        self._tensors: tuple[int, dict[str, torch.Tensor]] | None = None
        self.last_error: str | None = None
        """Why the last failed attempt failed (None after a success)."""
        self.failures: list[str] = []
        """Every failure reason seen, oldest first (bounded to the last 100)."""
        self.last_route: Route | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._fatal: BaseException | None = None

    # -- the served state --
    @property
    def version(self) -> int | None:
        return self._served.version if self._served else None

    @property
    def digest(self) -> str | None:
        return self._served.digest if self._served else None

    @property
    def staged(self) -> tuple[int, str] | None:
        """(version, chain digest) of the newest state fetched and verified but not served yet (None: none
        newer than the served one). A worker under committed draws serves it from its next cohort on."""
        with self._lock:
            s = self._newer_staged()
            return (s.version, s.digest) if s is not None else None

    @property
    def manifest(self) -> PlaneManifest | None:
        """The served version's plane manifest (what an engine proves its weights against)."""
        return self._served.manifest if self._served else None

    @property
    def state(self) -> BitState:
        """The served state as bits (treat as read-only)."""
        return self._served.state if self._served else {}

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The served state as CPU torch tensors for `load_state_dict` (int8 plane: dequantized float32).

        Weights-plane tensors share memory with the syncer's copy: load them, never write into them."""
        served = self._served
        if served is None:
            return {}
        if self._tensors is None or self._tensors[0] != served.version:
            t = to_torch(served.state) if self.plane == "weights" else q8.dequantize_torch(served.state)
            self._tensors = (served.version, t)
        return self._tensors[1]

    # -- polling and syncing --
    def poll(self) -> int | None:
        """The newest version with a manifest (HEAD read as a hint, manifests listed), or None."""
        return latest_version(self.store, self.trust)

    def sync(self, to_version: int | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        """Bring the served state to `to_version` (default: the newest) and return (version, tensors).

        Raises NotFoundError if nothing is published yet, IntegrityError if no route verifies (the served
        state is then unchanged)."""
        target = to_version if to_version is not None else self.poll()
        if target is None:
            raise NotFoundError(f"no weights published yet in {self.store.url}: start the trainer, or wait")
        if self._served is None or self._served.version != target:
            self._install(self._build(self._served, target))
        assert self._served is not None
        return self._served.version, self.tensors

    def _install(self, v: Verified) -> None:
        with self._lock:
            self._served = v
            if self._staged is not None and self._staged.version <= v.version:
                self._staged = None

    def _fail(self, reason: str) -> None:
        self.last_error = reason
        self.failures = [*self.failures[-99:], reason]
        log.warning("weights sync: %s", reason)

    def _build(self, base: Verified | None, target: int) -> Verified:
        """A verified state at `target`, or IntegrityError. Never touches the served state."""
        reasons: list[str] = []
        pause = Backoff(self.backoff_s, self.max_backoff_s)
        # `retries` + 1 attempts of the best route from `base`, then (if we had a base) one re-anchor.
        attempts = [base] * (self.retries + 1) + ([None] if base is not None else [])
        for i, start in enumerate(attempts):
            try:
                route = self._plan(start, target, reasons)
                self.last_route = route
                out = self._run(route, start)
                self.last_error = None
                return out
            except (IntegrityError, NotFoundError) as e:
                how = f"from v{start.version}" if start else "re-anchor"
                reason = f"v{target} attempt {i + 1} ({how}): {e}"
                reasons.append(reason)
                self._fail(reason)
                if i + 1 < len(attempts) and pause.peek() > 0:
                    self._sleep(pause.next())
        raise IntegrityError(
            f"could not sync weights v{target} from {self.store.url}; kept v{self.version}. Reasons: "
            + " | ".join(reasons)
        )

    def _plane(self, m: WeightManifest) -> PlaneManifest:
        return m.plane(self.plane)

    def _plan(self, base: Verified | None, target: int, reasons: list[str]) -> Route:
        """Walk parents back from `target`: warm if we reach `base` more cheaply than the newest anchor."""
        chain: list[WeightManifest] = []
        anchor_at: int | None = None
        warm = False
        m = read_manifest(self.store, target, self.trust)
        while True:
            chain.append(m)
            p = self._plane(m)
            if p.anchor and anchor_at is None:
                anchor_at = len(chain) - 1
            if base is None and anchor_at is not None:
                break
            deltas = sum(self._plane(x).delta_bytes() for x in chain)
            if anchor_at is not None and deltas > self._cold_bytes(chain, anchor_at):
                break
            if not p.has_delta or m.parent_version is None:
                break
            if base is not None and m.parent_version <= base.version:
                if m.parent_version == base.version and p.parent_digest == base.digest:
                    warm = True
                elif m.parent_version == base.version:
                    reasons.append(f"v{m.version}'s parent digest is not our v{base.version}'s: re-anchoring")
                break
            if m.parent_version >= m.version:
                raise IntegrityError(f"v{m.version} names parent v{m.parent_version}: parents must be older")
            m = read_manifest(self.store, m.parent_version, self.trust)
        if warm:
            steps = list(reversed(chain))
            return Route("warm", steps, sum(self._plane(x).delta_bytes() for x in steps))
        if anchor_at is None:
            raise NotFoundError(f"no anchor reachable from v{target} (walked back to v{chain[-1].version})")
        return Route("cold", list(reversed(chain[: anchor_at + 1])), self._cold_bytes(chain, anchor_at))

    def _cold_bytes(self, chain: list[WeightManifest], anchor_at: int) -> int:
        return self._plane(chain[anchor_at]).anchor_bytes() + sum(
            self._plane(x).delta_bytes() for x in chain[:anchor_at]
        )

    def _run(self, route: Route, base: Verified | None) -> Verified:
        cur = base
        # Arrays of the starting state are served (or staged) and never written: the first delta is applied
        # into fresh arrays or `spare` ones. Each intermediate state of a route is private: the next delta
        # patches its arrays in place, and its arrays the next state does not share go to `spare`.
        keep = {id(tb.data) for tb in base.state.values()} if base is not None else set()
        spare: dict[str, np.ndarray] = {}
        for i, m in enumerate(route.steps):
            p = self._plane(m)
            if route.kind == "cold" and i == 0:
                state = read_anchor(self.store, m.version, p)
                digests = {t.name: state[t.name].digest() for t in p.tensors if t.name in state}
            else:
                if cur is None or m.parent_version != cur.version or p.parent_digest != cur.digest:
                    raise IntegrityError(f"v{m.version} does not chain onto v{cur.version if cur else None}")
                # the starting state is served or staged: never written. A later step's base is this route's
                # own intermediate state: its arrays are patched in place (only the changes are written)
                in_place = (
                    None
                    if cur is base
                    else {n: tb.data for n, tb in cur.state.items() if id(tb.data) not in keep}
                )
                state = read_delta(self.store, m.version, p, cur.state, reuse=spare, in_place=in_place)
                digests = {
                    n: cur.digests[n] if n in cur.digests and cur.state.get(n) is tb else tb.digest()
                    for n, tb in state.items()
                }
            verify_plane(p, state, f"weights v{m.version} ({self.plane})", digests)
            if cur is not None:
                live = {id(tb.data) for tb in state.values()} | keep
                spare = {n: tb.data for n, tb in cur.state.items() if id(tb.data) not in live}
            cur = Verified(m.version, p.chain_digest, state, digests, p)
        assert cur is not None
        return cur

    # -- background prefetch --
    def start(self, interval_s: float | None = None) -> None:
        """Poll and prefetch in a background thread; `swap()` installs what it staged."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._fatal = None
        interval = self.poll_interval_s if interval_s is None else interval_s
        self._thread = threading.Thread(
            target=self._loop, args=(interval,), name="pnyx-weights-prefetch", daemon=True
        )
        self._thread.start()

    def _loop(self, interval: float) -> None:
        delay = 0.0
        failing = Backoff(max(interval, 0.01) * RETRY_FACTOR, self.max_backoff_s)
        while not self._stop.wait(delay):
            try:
                self.prefetch_once()
                delay = interval
                failing.reset()
            except PnyxError as e:  # fail-closed: keep serving, back off, try again
                self._fail(f"prefetch: {e}")
                delay = failing.next()
            except BaseException as e:  # a bug: stop and re-raise in the caller's thread on swap()
                self._fatal = e
                return

    def prefetch_once(self) -> int | None:
        """One poll + build onto the newest known state (staged, not served). Returns the staged version."""
        target = self.poll()
        with self._lock:
            base = self._staged or self._served
        if target is None or (base is not None and target <= base.version):
            return self._staged.version if self._staged else None
        v = self._build(base, target)
        with self._lock:
            if self._served is None or v.version > self._served.version:
                self._staged = v
        return v.version

    def pin(self) -> int | None:
        """The version the next `swap` installs, fixed now: the staged state if it is newer than the served
        one (the prefetch thread may stage a newer one meanwhile; the next swap still installs this one), or
        None (nothing newer staged: the next swap installs nothing). A worker committing a cohort ahead names
        this version before it finishes the cohort it is drawing (`pnyx.rollout.worker`)."""
        with self._lock:
            self._pinned, self._pin_set = self._newer_staged(), True
            return self._pinned.version if self._pinned is not None else None

    def _newer_staged(self) -> Verified | None:
        """The staged state if it is newer than the served one (caller holds the lock)."""
        s = self._staged
        return s if s is not None and (self._served is None or s.version > self._served.version) else None

    def swap(self, at: int | None = None) -> tuple[int, dict[str, torch.Tensor]] | None:
        """Install the prefetched state if it is newer (the pinned one after `pin`, whatever was staged
        since); return (version, tensors), or None if nothing new. `at`: install version `at` or nothing (a
        cohort committed to it; nothing when it is served already, as for a cohort whose wait for its tick
        a stop interrupted after its swap, drawn again as the worker stops).

        Re-raises an unexpected error of the prefetch thread."""
        if self._fatal is not None:
            raise self._fatal
        with self._lock:
            staged = self._pinned if self._pin_set else self._staged
            self._pinned, self._pin_set = None, False
        if staged is None or (self._served is not None and staged.version <= self._served.version):
            return None
        if at is not None and staged.version != at:
            return None
        self._install(staged)
        return staged.version, self.tensors

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the prefetch thread (waits up to `timeout_s` for an in-flight fetch)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
