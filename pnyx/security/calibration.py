"""The sampling checks' allowances, derived from the run itself (issue #23).

An honest group's evidence (`checks.GroupEvidence`) is away from the values of an exact, fresh sampler for
two reasons; the trainer measures both, from sources an attacker does not control where it can:

1. **The policy moved** between the version the group was sampled at and the version that judges it
   (staleness s). The trainer measures its own movement: after each optimizer step v -> v+1 the step
   re-forwards a few completions it did not train on (the **drift probe**: rows of a recent batch that
   passed the checks, trusted keys' first, `choose_probe`, kept for `PROBE_STEPS` steps) and records
   `a_v`, the mean |log q_{v+1}(x) - log q_v(x)| per model token. Per token, a group's gap is at most the engine's noise
   plus the sum of the one-step moves since it was sampled (triangle inequality), so the gap bound is
   `base(engine) + GAP_MARGIN · A(s)`, A(s) = Σ a_j over those s steps. The probe's rows are older than
   a fresh group's, and a policy that is abandoning a pattern moves old samples of it most, so A errs wide.
2. **The worker's engine, precision, and the same drift seen by z.** The plausibility z of an honest
   group is biased (SmolLM2 one version behind: mean -1.2, against 0 for a fresh exact sampler; on the
   mlx engine early in a run, -3.5). z is centred on what honest groups of the same engine and staleness
   show: the median raw z of **trusted keys'** groups (`pnyx run`'s own workers, `security.trusted_keys`)
   in that bucket, else the median of all checked groups at that staleness, clamped to
   [-Z_CENTER_MAX, 0] (honest drift only lowers z, and a crowd of liars cannot shift the centre above 0 or
   below -Z_CENTER_MAX; a key's running statistic judges its upper side against the trusted centres only,
   else 0, so a crowd that pulls the population's centre down frames no honest key:
   `checks.quarantine_reason`). Untrusted keys never widen the gap bound.
   Until a bucket (engine, staleness s > 0) has its own centre, a group there is judged against the
   centre of the nearest lower staleness measured, and its **lower** limit is widened by what the drift
   since then can do to its z: Z_DRIFT_MARGIN · (A(s) − A(s')) · tokens / sqrt(Σ Var), the probe's mean
   |Δ log q| per token summed over the steps in between, over the group's tokens, in units of its z.
   (Measured on SmolLM2 with the mlx engine, v1-v4: honest groups one version behind fell by 0.3 to 2.6
   in z from their own version to the judging one, and by up to 1.5 more under the trainer's fp32
   masters; the probe's mean change of log q + H predicted a tenth of the largest fall, so the bound is
   taken on |Δ log q|.) the upper side keeps the borrowed centre (temperature liars are still caught from their first groups).

The fixed settings (`CheckSettings`: `lp_gap_base`, `lp_gap_per_version`, `plausibility_z`) are **floors**: the
gap bound is never below `lp_gap_base + lp_gap_per_version · s`; the z limit applies to the centred z.
A key is quarantined on its running z (`checks.KeyEvidence`) re-centred with the centres of now, so a
key whose groups arrived before the run had calibrated is judged by the calibration, not by the lag.

State (`Calibration`) lives in the ingestion cursor (checkpointed; a replayed step folds in the same
values); `Allowances` (a frozen snapshot) is what one step judges with: rank 0 derives it before the
step and sends it to every rank with the batch. Pure: no torch, no store.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import msgspec

from pnyx.security.checks import CheckSettings, GroupEvidence

GAP_MARGIN = 3.0
"""A group's mean |Δ| over its own tokens against the probe's mean over its tokens: measured on the tiny
model and SmolLM2 (docs/security.md, "Honest drift"), the honest max stays under this multiple."""
BASE_MARGIN = 4.0
"""The staleness-0 gap bound of an engine is at least this multiple of its trusted groups' largest recent
gap (SmolLM2's fresh gap grew from 0.008 to 0.065 over its first 7 versions, as the policy sharpened)."""
Z_DRIFT_MARGIN = 2.0
"""The lower z limit of a bucket not calibrated yet widens by this multiple of the drift since the
nearest measured staleness, in units of the group's z (module docstring, point 2)."""
MIN_TRUSTED_GAP = 4
"""Trusted fresh groups of an engine needed before they set its gap base."""
NOISE_PER_DRIFT = 0.5
"""The staleness-0 gap base is also at least this share of the largest held-out probe drift the run has
kept (the last `DRIFT_KEEP` versions). A fresh group's gap is the engine's rounding noise alone, and it
grows as the policy sharpens (larger logits, rarer sampled tokens) and stays when the learning rate
decays: SmolLM2's went from 0.008 at v1 to 0.065-0.106 later, when its probe had read up to 0.3, so
trusted groups seen early under-state it and the newest drift (0.01 at the end of a cosine schedule)
does too."""
WINDOW = 64
"""Values kept per bucket (the newest): gaps and raw z. Short, so the centre follows a run whose drift
shrinks as its learning rate decays."""
MIN_TRUSTED = 8
"""Trusted groups in a bucket (engine, staleness) needed before they set its centre (the median of 8 honest
z has a standard error of ~0.45: small against the 4.5 limit of a single group's check)."""
MIN_ALL = 32
"""Checked groups at one staleness needed before the population sets the centre (no trusted bucket)."""
Z_CENTER_MAX = 3.0
"""A centre is clamped to [-Z_CENTER_MAX, +Z_CENTER_MAX] from trusted groups, [-Z_CENTER_MAX, 0] from the
population."""
DRIFT_KEEP = 32
"""Probe values kept (versions); a group more than this far behind uses the largest kept."""


PROBE_ROWS = 4
"""Completions in the drift probe (one per group where it can): two extra forwards of these per step."""
PROBE_TOKENS = 4096
"""The probe's padded size (rows x longest prompt+completion) stays within this."""
PROBE_STEPS = 4
"""Steps a probe's rows measure before new ones are chosen (without replay, `max_reuse` 1: no later step
trains on them). The forward after one step is the forward before the next, so the trainer keeps it and a
kept probe costs one forward per step, not two (the SmolLM2 recipe's probe was 5.3% of step time). Older
rows err wide, as above."""


class Drift(NamedTuple):
    """What one step's drift probe measured, per model token of its rows."""

    a: float
    """Mean |log q_new − log q_old|."""
    tokens: int
    held_out: bool
    """The rows were held out from the step (else they are its own rows, which the update moves further)."""


class _Sample(Protocol):
    @property
    def tokens(self) -> Sequence[int]: ...
    @property
    def loss_mask(self) -> Sequence[int]: ...


class _Group(Protocol):
    """What the probe reads of a rollout group (`pnyx.protocol.records.RolloutGroup`)."""

    @property
    def prompt_tokens(self) -> Sequence[int]: ...
    @property
    def samples(self) -> Sequence[_Sample]: ...
    @property
    def temperature(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def top_p(self) -> float: ...


class _Scored(Protocol):
    """A group of the step's batch (`pnyx.train.ingest.ScoredGroup`)."""

    @property
    def key(self) -> str: ...
    @property
    def signer(self) -> str: ...
    @property
    def group(self) -> _Group: ...


class ProbeRow(msgspec.Struct, array_like=True):
    """One completion the drift probe re-forwards: held out from the step it measures."""

    prompt: list[int]
    completion: list[int]
    mask: list[int]
    sampling: tuple[float, int, float]
    """(temperature, top_k, top_p) it was sampled under."""


def choose_probe(
    groups: Iterable[_Scored], rejected: Mapping[str, str], trusted: frozenset[str]
) -> list[ProbeRow]:
    """The next step's probe: completions of `groups` (scored groups of the step just taken) that passed
    its checks, trusted signers' first, one per group before a second, under one sampling setting and
    `PROBE_TOKENS`. The next step did not train on them, so how far it moves them is how far it moves
    any fresh sample."""
    ok = sorted((g for g in groups if g.key not in rejected), key=lambda g: (g.signer not in trusted, g.key))
    if not ok:
        return []
    first = ok[0].group
    sampling = (float(first.temperature), int(first.top_k), float(first.top_p))
    out: list[ProbeRow] = []
    width = 0
    for i in range(max(len(g.group.samples) for g in ok)):
        for g in ok:
            rec = g.group
            if (float(rec.temperature), int(rec.top_k), float(rec.top_p)) != sampling or i >= len(
                rec.samples
            ):
                continue
            smp = rec.samples[i]
            if not smp.tokens or not any(smp.loss_mask):
                continue
            w = max(width, len(rec.prompt_tokens) + len(smp.tokens))
            if len(out) >= PROBE_ROWS or (out and w * (len(out) + 1) > PROBE_TOKENS):
                return out
            out.append(ProbeRow(list(rec.prompt_tokens), list(smp.tokens), list(smp.loss_mask), sampling))
            width = w
    return out


class Calibration(msgspec.Struct):
    """What the run measured (persisted with the ingestion cursor)."""

    probe: list[ProbeRow] = []
    """The rows the next step's drift probe re-forwards (chosen from a recent step's batch)."""
    probe_steps: int = 0
    """Steps `probe` has measured so far (new rows after `PROBE_STEPS`)."""

    drift: dict[str, list[float]] = {}
    """Version v (as text) -> [a_v, probe tokens, held out (1) or the step's own rows (0)] measured by the
    step v -> v+1 (`Drift`)."""
    gap0: dict[str, list[float]] = {}
    """Engine -> trusted keys' staleness-0 group gaps (the newest `WINDOW`)."""
    zt: dict[str, list[float]] = {}
    """`engine/staleness` -> trusted keys' raw z (the newest `WINDOW`)."""
    zall: dict[str, list[float]] = {}
    """Staleness -> every checked group's raw z (the newest `WINDOW`)."""

    def note_drift(self, version: int, drift: Drift | None) -> None:
        """Record the probe of step `version` -> `version`+1; None: no probe. A probe on the step's own
        rows (the run's first step: nothing held out yet) errs wide."""
        if drift is None:
            return
        d = Drift(*drift)
        self.drift[str(version)] = [float(d.a), float(d.tokens), float(bool(d.held_out))]
        if len(self.drift) > DRIFT_KEEP:
            for k in sorted(self.drift, key=int)[: len(self.drift) - DRIFT_KEEP]:
                del self.drift[k]

    def note_group(self, engine: str, staleness: int, gap: float, z: float, trusted: bool) -> None:
        """Fold in one checked group (its raw z; its gap too if a trusted key's, fresh)."""
        if not math.isfinite(z):
            return  # an implausible token (z = -inf) says nothing about honest drift
        _push(self.zall.setdefault(str(staleness), []), z)
        if trusted:
            _push(self.zt.setdefault(f"{engine}/{staleness}", []), z)
            if staleness == 0 and math.isfinite(gap):
                _push(self.gap0.setdefault(engine, []), gap)


def _push(xs: list[float], x: float) -> None:
    xs.append(round(x, 6))
    if len(xs) > WINDOW:
        del xs[: len(xs) - WINDOW]


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


@dataclass(frozen=True)
class Allowances:
    """What one step judges its groups with (a snapshot; see the module docstring)."""

    floors: CheckSettings = field(default_factory=CheckSettings)
    drift_a: tuple[float, ...] = ()
    """A(s) for s = 1, 2, ...: the summed probe drift over the s steps before the judging version."""
    base: dict[str, float] = field(default_factory=dict)
    """Engine -> staleness-0 gap bound from its trusted groups (absent: the floor)."""
    z_center: dict[str, float] = field(default_factory=dict)
    """`engine/staleness` (trusted keys' groups) or `staleness` (every group) -> centre of raw z."""
    noise: float = 0.0
    """The staleness-0 base any engine gets from the run's largest probe drift (`NOISE_PER_DRIFT`)."""

    @property
    def plausibility_z(self) -> float | None:
        return self.floors.plausibility_z

    @property
    def draw_tolerance(self) -> float | None:
        return self.floors.draw_tolerance

    @property
    def stale_draw_audit(self) -> float:
        return self.floors.stale_draw_audit

    def _cum(self, staleness: int) -> float:
        xs = self.drift_a
        if staleness <= 0 or not xs:
            return 0.0
        if staleness <= len(xs):
            return xs[staleness - 1]
        step = max(b - a for a, b in zip((0.0, *xs), xs, strict=False))
        return xs[-1] + step * (staleness - len(xs))

    def gap_bound(self, staleness: int, engine: str = "") -> float:
        """The largest honest logprob gap of a group `staleness` versions behind (inf when off)."""
        f = self.floors
        if f.lp_gap_base is None:
            return math.inf
        s = max(0, staleness)
        floor = f.lp_gap_base + f.lp_gap_per_version * s
        derived = max(f.lp_gap_base, self.base.get(engine, 0.0), self.noise) + GAP_MARGIN * self._cum(s)
        return max(floor, derived)

    def calibrated_center(self, engine: str, staleness: int) -> float | None:
        """The honest raw z of a group of `engine`, `staleness` versions behind, as the run measured it
        (None: not measured yet)."""
        c = self.z_center
        return c.get(f"{engine}/{staleness}", c.get(str(staleness)))

    def _borrowed(self, engine: str, staleness: int) -> tuple[float, int]:
        """(centre, the staleness it was measured at): `calibrated_center`, else that of the nearest lower
        staleness the run has measured, else (0, 0)."""
        for s in range(staleness, -1, -1):
            c = self.calibrated_center(engine, s)
            if c is not None:
                return c, s
        return 0.0, 0

    def center(self, engine: str, staleness: int) -> float:
        """The centre a single group is judged against: `calibrated_center`, else that of the nearest lower
        staleness the run has measured (honest z only falls with staleness, so the borrowed centre errs
        towards 0), else 0."""
        return self._borrowed(engine, staleness)[0]

    def z_adj(self, ev: GroupEvidence) -> float:
        """A group's z centred on what honest groups of its engine and staleness show."""
        return ev.z - self.center(ev.engine, ev.staleness)

    def z_range(self, ev: GroupEvidence) -> tuple[float, float]:
        """The raw z an honest group with evidence `ev` shows, limit included: [centre − limit − drift,
        centre + limit], where drift is what the steps between the centre's staleness and the group's can
        do to its z (0 once its bucket is calibrated; module docstring, point 2)."""
        limit = self.plausibility_z if self.plausibility_z is not None else math.inf
        c, measured_at = self._borrowed(ev.engine, ev.staleness)
        drift = 0.0
        if ev.staleness > measured_at and ev.var_sum > 1e-12:
            moved = self._cum(ev.staleness) - self._cum(measured_at)
            drift = Z_DRIFT_MARGIN * moved * ev.tokens / math.sqrt(ev.var_sum)
        return c - drift - limit, c + limit

    def to_metrics(self, max_staleness: int) -> dict[str, Any]:
        """The allowances in force, for the step's metrics (`calibration`)."""
        engines = sorted(self.base) + [""]
        return {
            "drift": [round(self._cum(s), 5) for s in range(1, max_staleness + 1)],
            "lp_gap_bound": {
                e or "any": [round(self.gap_bound(s, e), 4) for s in range(max_staleness + 1)]
                for e in engines
            },
            "z_center": {k: round(c, 3) for k, c in sorted(self.z_center.items())},
        }


def derive(floors: CheckSettings, calib: Calibration | None, version: int, max_staleness: int) -> Allowances:
    """The allowances for judging groups at `version` (staleness 0..`max_staleness`) from what the run
    measured (`calib`; None: the floors alone)."""
    if calib is None:
        return Allowances(floors)
    known = {int(k): v[0] for k, v in calib.drift.items()}
    fallback = max(known.values(), default=0.0)  # a step without a probe: the widest drift known
    a_cum: list[float] = []
    total = 0.0
    for s in range(1, max(1, max_staleness) + 1):
        total += known.get(version - s, fallback)
        a_cum.append(total)
    base = {e: BASE_MARGIN * max(g) for e, g in calib.gap0.items() if len(g) >= MIN_TRUSTED_GAP}
    held = [v[0] for v in calib.drift.values() if len(v) < 3 or v[2]]
    largest = max(held or list(known.values()) or [0.0])
    return Allowances(floors, tuple(a_cum), base, centers(calib), NOISE_PER_DRIFT * largest)


def centers(calib: Calibration, population: bool = True) -> dict[str, float]:
    """The z centres of the run (`Allowances.z_center`): trusted buckets, then (with `population`) the
    population's."""
    out = {
        k: max(-Z_CENTER_MAX, min(Z_CENTER_MAX, _median(z)))
        for k, z in calib.zt.items()
        if len(z) >= MIN_TRUSTED
    }
    for s, z in calib.zall.items() if population else ():
        if len(z) >= MIN_ALL:
            out[s] = max(-Z_CENTER_MAX, min(0.0, _median(z)))
    return out


def evidence_summary(
    evidence: Mapping[str, Any],
    a: Allowances,
    rejected: Mapping[str, str] | None = None,
    rejudged: Mapping[str, str] | None = None,
) -> dict[str, dict[str, float]]:
    """One step's checked groups summed per `engine/staleness` (for the metrics, and the honest-drift
    tables of `benchmarks/bench_honest_drift.py`): groups, gap sum and max, raw z and z_adj sums, squares
    and extremes, and how many the derived allowances (`rejects`) and the fixed floors alone
    (`fixed_rejects`) reject, and how many the derived allowances failed but the exact re-check under the
    published weights kept (`rejudged`; such a group is not in `rejects`)."""
    from pnyx.security.checks import Z_CLAMP, judge

    rejected = rejected or {}
    rejudged = rejudged or {}
    out: dict[str, dict[str, float]] = {}
    for key, ev in sorted(evidence.items()):
        if not ev.tokens:
            continue
        b = out.setdefault(
            f"{ev.engine or '?'}/{ev.staleness}",
            {
                "n": 0, "tokens": 0, "gap_sum": 0.0, "gap_max": 0.0, "z_sum": 0.0, "z_sq": 0.0,
                "z_min": Z_CLAMP, "z_max": -Z_CLAMP, "za_sum": 0.0, "za_sq": 0.0, "za_min": Z_CLAMP,
                "za_max": -Z_CLAMP, "rejects": 0, "fixed_rejects": 0, "rejudged": 0,
            },
        )  # fmt: skip
        z = _clamp(ev.z)
        za = _clamp(a.z_adj(ev))
        b["n"] += 1
        b["tokens"] += ev.tokens
        b["gap_sum"] += ev.gap
        b["gap_max"] = max(b["gap_max"], ev.gap)
        b["z_sum"] += z
        b["z_sq"] += z * z
        b["z_min"], b["z_max"] = min(b["z_min"], z), max(b["z_max"], z)
        b["za_sum"] += za
        b["za_sq"] += za * za
        b["za_min"], b["za_max"] = min(b["za_min"], za), max(b["za_max"], za)
        b["rejects"] += key in rejected
        b["rejudged"] += key in rejudged
        b["fixed_rejects"] += judge(ev, a.floors) is not None
    return {k: {f: round(v, 6) for f, v in b.items()} for k, b in out.items()}


def _clamp(z: float) -> float:
    from pnyx.security.checks import Z_CLAMP

    return -Z_CLAMP if math.isnan(z) else max(-Z_CLAMP, min(Z_CLAMP, z))
