"""Sampling checks on the trainer's own forward pass, and when a worker key is quarantined.

The trainer computes π (the current policy's per-token log-probabilities under each group's sampling
settings) for every token it trains on. From that same forward, per group (`GroupEvidence`):

- **logprob gap**: the mean |claimed behaviour logprob − trainer logprob| over the group's model tokens.
  It is not 0 at the current version in pnyx: workers generate from the published bf16 cast while the
  trainer's forward uses its fp32 master weights, and a group `s` versions behind was sampled from a policy
  `s` optimizer steps away. A group is dropped as `logprob_gap` when its gap exceeds
  `lp_gap_base + lp_gap_per_version · s` (`CheckSettings.gap_bound`).
- **token plausibility** (GRAIL-style, identity-free): with q_t the trainer's sampling distribution at
  position t (temperature, top-k, top-p of the run), H_t its entropy and V_t the variance of log q(X) for
  X ~ q_t, `z = Σ_t (log q_t(x_t) + H_t) / sqrt(Σ_t V_t)`. Under honest sampling at the claimed settings
  z is approximately N(0, 1) (a sum of independent-ish centred terms); a worker that samples colder than
  it claims (a temperature liar) picks likelier tokens than q_t would, z ≫ 0; tokens the model would not
  sample (a poisoner's payload, a copier's reference answer) are unlikely under q_t, z ≪ 0. A group with
  |z| > `plausibility_z` is dropped as `implausible`. A token outside the top-k/top-p support has log q = -inf:
  its z is -inf, always dropped.

Measured with `benchmarks/bench_lp_gap.py --versions 32 --groups 80 --staleness 3` (the shipped tiny model,
env arith, torch engine on the CPU: bf16-cast weights on the worker, fp32 masters on the trainer, the
default algorithm and learning rate; 2,560 honest groups of 8 samples per staleness, ~40 model tokens per
group). Honest group logprob gap, max (p99.9) at staleness 0/1/2/3: 0.0105 (0.0071) / 0.162 (0.125) /
0.243 (0.206) / 0.352 (0.282) nats. Honest z: mean -0.01/-0.09/-0.18/-0.27, sd 1.00-1.08, a heavier
lower tail (p0.1 -4.3 to -4.6, max |z| 4.45 at staleness 0, 4.92 over all 10,240 group x staleness
measurements) and a light upper one (p99.9 +2.2). Defaults:

- `LP_GAP_BASE` = 0.03 (about 3x the honest max at staleness 0) and `LP_GAP_PER_VERSION` = 0.25 (the
  bound is 1.7x / 2.2x / 2.2x the honest max at staleness 1 / 2 / 3): no honest group over it;
- `Z_LIMIT` = 4.5: 7 of 10,240 honest measurements beyond it (0.07%; 0 at staleness 0), against 21
  (0.21%) at 4.0 and 0 at 5.0.

The per-version allowance is wide because a step of the tiny model moves its logprobs a lot: the gap is
a tight check for fresh groups only, and a worker may stamp its group with an older version it can read
(up to `max_staleness`) to get the wider bound; plausibility and the re-score do not depend on staleness.
A temperature liar (samples at 0.3, claims 1.0) that records its true logprobs has a gap of ~0.14 (caught
fresh); one that rewrites its logprobs to the claimed temperature has a gap like an honest worker's and a
per-group z of about +1.7 on ~40-token groups: no single group is implausible, its key is (below).

These constants are the floors and the fallbacks: the allowances a trainer judges with are derived from
its run (`pnyx.security.calibration`: the gap bound widened by the drift the trainer measures itself, z
centred on what honest groups of the same engine and staleness show); `judge` and `add_evidence` take
either.

Per key, the running sum of z (`KeyEvidence`, in the ingestion cursor) catches a liar too subtle for one
group: `key_z = Σ(z − centre) / (Z_SD · sqrt(n))` grows like sqrt(n) when the key's groups are shifted
(the centre: the run's calibration per engine and staleness, Z_MEAN without one).
Quarantine (`quarantine_reason`) triggers on it, and on the share of a key's groups that failed a check
(`FAULTS`).

Pure: no torch, no store. The step (`pnyx.train.step`) computes the evidence; the ingestor (its cursor)
keeps per-key counters and the quarantine list.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

LP_GAP_BASE = 0.03
"""Logprob-gap bound at staleness 0 (nats, mean over a group's model tokens); see the module docstring."""
LP_GAP_PER_VERSION = 0.25
"""Added to the bound per version of staleness."""
Z_LIMIT = 4.5
"""|z| beyond this drops a group as `implausible`."""
Z_MEAN = 0.0
"""The honest per-group z's mean the per-key statistic is centred on (measured -0.04: taken as 0)."""
Z_SD = 1.0
"""The honest per-group z's standard deviation (measured 0.99)."""
KEY_Z_LIMIT = 5.0
"""|key_z| beyond this quarantines a key (with at least `KEY_Z_MIN_GROUPS` groups checked)..."""
KEY_Z_MIN_GROUPS = 8
KEY_Z_MIN_SHIFT = 0.5
"""...and its mean z at least this far from Z_MEAN (a drift of the honest mean over a long run, e.g. from
staleness, must not add up to a quarantine of honest keys)."""
QUARANTINE_RATE = 0.2
"""A key whose faulty groups reach this share of its judged groups is quarantined..."""
QUARANTINE_MIN = 5
"""...once it has at least this many faulty groups."""

DRAW_MISMATCH = "draw_mismatch"
DRAW_UNVERIFIABLE = "draw_unverifiable"

UNCOMMITTED = "uncommitted"
"""A group drawn without a matching commitment (`security.committed_draws`, `pnyx.train.ticker`): a fault
that quarantines its key at once (`quarantine_reason`), like a false skip record, since an honest worker
only draws under commitments the trainer's tick included."""

FAULTS = frozenset(
    {
        "logprob_gap",
        "implausible",
        "reward_lie",
        "malformed",
        "weights_mismatch",
        "env_mismatch",
        "group_too_small",
        "unknown_task",
        "prompt_mismatch",
        "sampling_mismatch",
        "over_budget",
        "draw_mismatch",
        "unseeded",
        "false_skip",
        "gap",
        UNCOMMITTED,
    }
)
"""Per-key counters (`Cursor.by_key`) that count a faulty group of that key. `draw_mismatch`: a token its
seeded uniform did not draw (`pnyx.train.drawcheck`); `unseeded`: no seeded draws where the run requires
them (`draw_unverifiable`, a version whose weights could not be verified, is the trainer's problem, not
blamed); `false_skip`: a skip record (a group its worker says had zero variance) whose re-score has mixed
rewards or whose tokens are not its seeded draws: it quarantines its key at once
(`Ingestor.audit_skips`); `gap`: a seq its worker name never uploaded signed by its key, a group it kept
back (`pnyx.train.seq_books`); `uncommitted`: a group without the commitment its tick should have included
(`security.committed_draws`, `pnyx.train.ticker`).
`reward_lie`: a group with at least one sample whose claimed reward differs from the re-score. Signature failures (`unsigned`,
`bad_signature`) are not in it: the key inside a badly signed frame proves nothing, so it is never blamed
(anyone could frame an honest key); `stale`, `zero_variance`, `unknown_version` and `duplicate` happen to
honest workers. `id_theft` is not in it either: names are first come, first bound, so an attacker who
takes an honest worker's name first makes every group of that worker an `id_theft`; blaming the key
would then quarantine the honest key under all its names. A thief's groups under a stolen name are
rejected one by one anyway (one GET each). `key_mismatch` (a record under another record's name) and
`run_mismatch` (a record of another run) are not in it: a signed record is bytes anyone who read it can copy,
so copies of an honest worker's records put under other names, or brought from another run its key worked
in, would quarantine it (an honest worker never uploads either: they are replays, not its faults)."""
JUDGED = (frozenset({"groups", "zero_variance", "lie_dropped"}) | FAULTS) - {"reward_lie"}
"""Per-key counters whose sum is the number of the key's groups the trainer judged. `reward_lie` is not
one: it is counted beside the group's own outcome (`lie_dropped` when `security.reject_reward_lies` drops
it, else `groups`, `zero_variance` or the step's drop reason), so adding it would count a lying group twice
and halve the key's fault rate."""


class KeyEvidence(msgspec.Struct):
    """Per key: the plausibility statistic summed over its checked groups (kept in the cursor)."""

    n: int = 0
    """Groups checked."""
    z_sum: float = 0.0
    """Σ raw z over them (an implausible group's z is clamped to ±`Z_CLAMP` before it is added)."""
    gap_max: float = 0.0
    """The largest group logprob gap seen from this key (minus its staleness allowance)."""
    buckets: dict[str, list[float]] = {}
    """`engine/staleness` -> [groups, Σ raw z]: what `key_z` re-centres with the run's centres of now."""

    def _centred(self, center: Callable[[str, int], float | None] | None) -> tuple[float, int]:
        """(Σ (z − centre), groups) over the buckets `center` knows (every group, centred on Z_MEAN,
        without `center`). A bucket the run has not calibrated yet (centre None) is left out."""
        if center is None:
            return self.z_sum - Z_MEAN * self.n, self.n
        total, n = 0.0, 0
        for b, (k, z) in self.buckets.items():
            engine, _, s = b.rpartition("/")
            c = center(engine, int(s))
            if c is not None:
                total += z - k * c
                n += int(k)
        return total, n

    def key_z(self, center: Callable[[str, int], float | None] | None = None) -> float:
        """Σ(z − centre) / (Z_SD · sqrt(n)) over the calibrated groups: ~N(0, 1) for an honest key, grows
        like sqrt(n) for a shifted one."""
        total, n = self._centred(center)
        return total / (Z_SD * math.sqrt(n)) if n else 0.0

    def judged_groups(self, center: Callable[[str, int], float | None] | None = None) -> int:
        return self._centred(center)[1]

    def mean_shift(self, center: Callable[[str, int], float | None] | None = None) -> float:
        total, n = self._centred(center)
        return total / n if n else 0.0


Z_CLAMP = 50.0
"""One group moves a key's z sum by at most this much."""


class Limits(Protocol):
    """What a group is judged against: the fixed `CheckSettings`, or the run's derived
    `pnyx.security.calibration.Allowances`."""

    @property
    def plausibility_z(self) -> float | None: ...

    @property
    def draw_tolerance(self) -> float | None: ...

    @property
    def stale_draw_audit(self) -> float: ...

    def gap_bound(self, staleness: int, engine: str = "") -> float: ...

    def z_range(self, ev: GroupEvidence) -> tuple[float, float]: ...


@dataclass(frozen=True)
class CheckSettings:
    """The per-group sampling checks of a step (None switches one off); as `Limits`, the fixed values."""

    lp_gap_base: float | None = LP_GAP_BASE
    lp_gap_per_version: float = LP_GAP_PER_VERSION
    plausibility_z: float | None = Z_LIMIT
    draw_tolerance: float | None = None
    """The largest distance of a model token from the draw of its seeded uniform (`security.draw_tolerance`;
    None: seeded draws are not checked)."""
    stale_draw_audit: float = 0.0
    """Share of the stale rows that pass under the step's own forward measured again under their version's
    exact weights (`security.stale_draw_audit`, `pnyx.train.drawcheck.row_draws`)."""

    def gap_bound(self, staleness: int, engine: str = "") -> float:
        """`lp_gap_base + lp_gap_per_version · staleness` (inf when the check is off), for any engine."""
        if self.lp_gap_base is None:
            return math.inf
        return self.lp_gap_base + self.lp_gap_per_version * max(0, staleness)

    def z_range(self, ev: GroupEvidence) -> tuple[float, float]:
        """±`plausibility_z` around 0 (an exact, fresh sampler's mean)."""
        limit = self.plausibility_z if self.plausibility_z is not None else math.inf
        return -limit, limit


@dataclass(frozen=True)
class QuarantineSettings:
    """When a key is quarantined (None switches a rule off)."""

    quarantine_rate: float | None = QUARANTINE_RATE
    quarantine_min: int = QUARANTINE_MIN
    quarantine_key_z: float | None = KEY_Z_LIMIT
    key_z_min_groups: int = KEY_Z_MIN_GROUPS
    key_z_min_shift: float = KEY_Z_MIN_SHIFT


@dataclass
class GroupEvidence:
    """One group's sums over its model tokens (loss mask 1), from the trainer's forward."""

    staleness: int = 0
    tokens: int = 0
    gap_sum: float = 0.0
    """Σ |claimed − trainer| logprob."""
    dev_sum: float = 0.0
    """Σ (log q(x_t) + H_t)."""
    var_sum: float = 0.0
    """Σ Var_t."""
    rows: int = 0
    """Samples (rows) summed so far."""
    engine: str = ""
    """The engine the group's worker says it sampled with (its calibration bucket)."""
    draw: float | None = None
    """The largest distance of a model token from the draw of its seeded uniform, each token's distance
    from the exact published weights of its version wherever the trainer's own forward put it over the
    tolerance (`pnyx.train.step`); inf: those weights could not be obtained; None: no seeded draws."""

    def add(self, other: GroupEvidence) -> None:
        if other.draw is not None:
            self.draw = other.draw if self.draw is None else max(self.draw, other.draw)
        self.rows += other.rows
        self.tokens += other.tokens
        self.gap_sum += other.gap_sum
        self.dev_sum += other.dev_sum
        self.var_sum += other.var_sum

    @property
    def gap(self) -> float:
        return self.gap_sum / self.tokens if self.tokens else 0.0

    @property
    def z(self) -> float:
        if not math.isfinite(self.dev_sum):
            return self.dev_sum if not math.isnan(self.dev_sum) else -math.inf
        if self.var_sum <= 1e-12:  # a deterministic distribution: honest tokens deviate by ~0
            return 0.0 if abs(self.dev_sum) < 1e-6 else math.copysign(math.inf, self.dev_sum)
        return self.dev_sum / math.sqrt(self.var_sum)


def judge(ev: GroupEvidence, a: Limits) -> str | None:
    """The drop reason of a group with evidence `ev` (`draw_mismatch`, `draw_unverifiable`, `logprob_gap`,
    `implausible`), or None if it passes.
    With `Allowances`, z must lie in the run's honest range (`Allowances.z_range`: centred on what honest
    groups of its engine and staleness show, widened below by the drift the probe measured until that
    bucket is calibrated; `pnyx.security.calibration`). A group whose draws were checked (`ev.draw` set)
    skips z: its tokens are proven to be the draws of uniforms it could not choose, which z only tests
    statistically (honest groups beyond its limit are its false positives, 2 of 800 in a default run)."""
    tol = a.draw_tolerance
    if tol is not None and ev.draw is not None and not ev.draw <= tol:
        return DRAW_UNVERIFIABLE if ev.draw == math.inf else DRAW_MISMATCH
    if ev.tokens == 0:
        return None
    gap = ev.gap
    if math.isnan(gap) or gap > a.gap_bound(ev.staleness, ev.engine):
        return "logprob_gap"
    proven = tol is not None and ev.draw is not None  # a seeded group's tokens are proven draws
    if a.plausibility_z is not None and not proven:
        low, high = a.z_range(ev)
        if not low <= ev.z <= high:
            return "implausible"
    return None


def add_evidence(k: KeyEvidence, ev: GroupEvidence, a: Limits) -> None:
    """Fold one checked group into its key's running evidence (raw z per bucket; centred when judged)."""
    if ev.tokens == 0:
        return
    z = ev.z
    z = -Z_CLAMP if math.isnan(z) else max(-Z_CLAMP, min(Z_CLAMP, z))
    k.n += 1
    k.z_sum += z
    b = k.buckets.setdefault(f"{ev.engine}/{ev.staleness}", [0.0, 0.0])
    b[0] += 1
    b[1] += z
    excess = ev.gap - (a.gap_bound(ev.staleness, ev.engine) - a.gap_bound(0, ev.engine))
    if math.isfinite(excess):
        k.gap_max = max(k.gap_max, excess)


def faults(counts: dict[str, int]) -> int:
    """Faulty groups in a key's counters (`FAULTS`)."""
    return sum(v for k, v in counts.items() if k in FAULTS)


def judged(counts: dict[str, int]) -> int:
    return sum(v for k, v in counts.items() if k in JUDGED)


def quarantine_reason(
    counts: dict[str, int],
    ev: KeyEvidence | None,
    q: QuarantineSettings,
    center: Callable[[str, int], float | None] | None = None,
    upper: Callable[[str, int], float | None] | None = None,
) -> str | None:
    """Why a key with these counters and evidence is quarantined now, or None. `center(engine, staleness)`:
    the run's honest z there, None where the run has not measured it yet (`calibration.Allowances.
    calibrated_center`; without it, 0 everywhere): the key's statistic is judged against what honest drift
    explains, over the groups whose bucket is calibrated. `upper`: the centres its upper side is judged
    against (default `center`), where a bucket without one counts 0, above any honest centre (honest drift
    only lowers z). The key ledger passes the trusted keys' centres only: a crowd of untrusted uploaders
    with low z can pull the population's centre down (to -Z_CENTER_MAX at most), and an honest key would then
    stand above it by as much (an honest key of the attack suite's arena was quarantined so, key z +6.6 over
    170 groups, mean z +0.09 against a population centre of -0.42)."""
    if counts.get(UNCOMMITTED, 0):  # an honest worker draws only under commitments its tick included
        return f"{counts[UNCOMMITTED]} uncommitted group(s): drawn without a commitment the trainer's tick included"
    bad, total = faults(counts), judged(counts)
    if q.quarantine_rate is not None and bad >= q.quarantine_min and bad >= q.quarantine_rate * total:
        which = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if k in FAULTS and v)
        return f"{bad} of {total} groups faulty ({which})"
    if ev is None or q.quarantine_key_z is None:
        return None
    for c, side in ((center, -1), (_or_zero(upper if upper is not None else center), 1)):
        n = ev.judged_groups(c)
        if n < q.key_z_min_groups:
            continue
        kz, shift = ev.key_z(c), ev.mean_shift(c)
        if side * kz > q.quarantine_key_z and side * shift >= q.key_z_min_shift:
            mean = ev.z_sum / ev.n
            return (
                f"implausible sampling over {n} groups (key z {kz:+.1f}: mean z {mean:+.2f} where honest "
                f"groups show {mean - shift:+.2f})"
            )
    return None


def _or_zero(
    center: Callable[[str, int], float | None] | None,
) -> Callable[[str, int], float | None] | None:
    if center is None:
        return None

    def zero(engine: str, staleness: int) -> float:
        c = center(engine, staleness)
        return 0.0 if c is None else c

    return zero


def summary(
    counts: dict[str, int], ev: KeyEvidence | None, center: Callable[[str, int], float | None] | None = None
) -> dict[str, Any]:
    """A key's evidence for reports (`pnyx status`, the attack benchmark): `key_z` re-centred with
    `center` (the run's calibration), `mean_z` raw."""
    return {
        "judged": judged(counts),
        "faults": faults(counts),
        "checked": ev.n if ev is not None else 0,
        "key_z": round(ev.key_z(center), 3) if ev is not None else 0.0,
        "mean_z": round(ev.z_sum / ev.n, 3) if ev is not None and ev.n else 0.0,
    }
