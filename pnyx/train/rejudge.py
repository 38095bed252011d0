"""Judging a group again under the exact weights it was sampled from, before the step drops it.

The step's checks (`pnyx.security.checks`) read the trainer's own forward, which is not the policy a worker
sampled from: the trainer computes with fp32 masters while workers sample from the published bf16 cast,
and a group `s` versions behind was sampled from a policy `s` steps away. The allowances for that drift
are derived from the run (`pnyx.security.calibration`), but drift is not uniform: a step that trains on a
prompt moves the logprobs of exactly that prompt's completions furthest. Measured on SmolLM2-135M with a
fast (MLX) worker that sampled the same one-digit sum in consecutive versions: groups whose z was -2.1 and
+0.2 under the weights they were sampled from showed -8.2 and -7.8 under the next version, and 6 of 120
honest groups were dropped as `implausible` (docs/security.md, section 4; `benchmarks/bench_rejudge.py`).

`Rejudge` is the exact check those groups get before their verdict takes effect: a second model in fp32
(how CPU and MLX workers compute) loaded with the run's own published weights of the version the group
claims (`published.PublishedModel`: verified against the run's trainer key only), and the same evidence
(`forward.Forward` and `forward.group_evidence`) from its forward. There the honest gap is the engines' rounding
(0.000 measured for mlx against torch) and z has no drift in it, so the group is judged as a fresh one
(staleness 0); a group that fails there is dishonest at any staleness. It costs a forward of the failing
group (plus, on a version change, applying the deltas in between) and is paid only for groups the master
forward would reject; a key that sends many failing groups is quarantined by the ledger and then never
reaches the forward.

`Rejudge.draws` is the same exact forward for seeded draws (`pnyx.train.drawcheck`): a row whose tokens
the step's forward put over the draw tolerance is measured under the published weights of its version
(on the plane its group records; the rows' prefix tree in one forward, `prefix_tree`, or for models the
tree does not fit each distinct prompt once and the completions on its KV cache), and only that distance can
drop its group. Knows nothing about the loop, the ingestion or the checks'
thresholds.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from pnyx.errors import IntegrityError, PnyxError
from pnyx.security.checks import GroupEvidence
from pnyx.train.forward import Forward, MicroBatch, group_evidence, merge_evidence
from pnyx.train.microbatch import Row, plan_micro_batches
from pnyx.train.published import PublishedModel

log = logging.getLogger("pnyx.trainer")

MICRO_BATCH_TOKENS = 8192
MAX_KNOWN_ROWS = 4096
"""Rows measured ahead (`Rejudge.precheck`) whose per-token distances are remembered at most, the oldest
forgotten first (a few KB each: 128 times the stale rows of the SmolLM2 recipe's batch)."""


class Rejudge:
    """`judgement.Rejudge` over a run's store: `rejudge(rows, version)` -> {group key: exact evidence}.

    Computes with the run's `PublishedModel` (shared with the per-token draw check), built at the first need.
    Without the run's trainer key (`published.trust`, set when the run is created or joined) nothing is
    re-judged (the groups keep the master forward's verdict)."""

    def __init__(self, published: PublishedModel, planes: dict[str, PublishedModel] | None = None):
        self.published = published
        self.planes = planes or {published.plane: published}
        """Every published plane's model ("weights", and "int8" when the run publishes the actor plane): a
        row's draws are measured on the plane whose chain digest its group records."""
        self.calls = 0
        """Groups judged again so far (each a forward of its rows)."""
        self.draw_rows = 0
        """Rows whose draws were measured exactly so far (`draws`, `precheck`)."""
        self.known_rows = 0
        """Rows `draws` answered from an earlier measurement (`precheck`) without a forward."""
        self.prechecked_rows = 0
        """Rows measured ahead of their step (`precheck`)."""
        self._known: dict[tuple[str, int, int, str], _Measured] = {}
        self._turn = threading.Condition()  # guards the counters, `_known` and `_foreground`
        self._foreground = 0  # calls of the trainer's own thread in progress: background checks wait for them

    @contextmanager
    def _turn_of(self, background: bool) -> Iterator[None]:
        """Where a forward may start: a call of the trainer's own thread (the step, its wait) at once, and
        counted while it runs; a background one (`WaitWork.start`) once none is, so the step waits at most
        for the background forward already under way."""
        if background:
            with self._turn:
                self._turn.wait_for(lambda: self._foreground == 0)
            yield
            return
        with self._turn:
            self._foreground += 1
        try:
            yield
        finally:
            with self._turn:
                self._foreground -= 1
                self._turn.notify_all()

    def __call__(self, rows: list[Row], version: int) -> Mapping[str, GroupEvidence]:
        if self.published.trust is None or not rows:
            return {}
        out: dict[str, GroupEvidence] = {}
        with self._turn_of(background=False), self.published.lock:
            try:
                model = self.published.at(version)
            except (
                PnyxError
            ) as e:  # fail-closed: without the exact weights the master forward's verdict stands
                log.warning(
                    "trainer: cannot re-judge against v%d (%s); the group keeps its verdict", version, e
                )
                return {}
            fwd = Forward(model, torch.device("cpu"), torch.float32, False)
            with torch.no_grad():
                for idx in plan_micro_batches(rows, MICRO_BATCH_TOKENS):
                    mb = fwd.run([rows[i] for i in idx], entropy=False, var=True, draws=True)
                    merge_evidence(out, group_evidence(mb, version, _worst(mb)))
        with self._turn:
            self.calls += 1
        return out

    def draws(self, rows: list[Row], background: bool = False) -> list[float]:
        """`judgement.ExactDraws`: per row (each with seeded uniforms), its largest distance from its draws
        under exactly the published weights of its own version, rows of one version in one forward per
        micro-batch; inf for the rows of a version whose weights cannot be obtained or verified (the group
        is then dropped as `draw_unverifiable`, not blamed on its key). A row measured before (`precheck`:
        the same row, or a prefix of it) is answered from that measurement without a forward. `background`:
        a call from the trainer's background check (`WaitWork.start`), which first waits until no call of the
        trainer's own thread is in progress."""
        with self._turn_of(background):
            return self._draws(rows, count_known=not background)

    def _draws(self, rows: list[Row], count_known: bool = True) -> list[float]:
        out = [math.inf] * len(rows)
        missing: list[int] = []
        for i, r in enumerate(rows):
            known = self._recall(r)
            if known is None:
                missing.append(i)
            else:
                out[i] = known
        if count_known:
            with self._turn:
                self.known_rows += len(rows) - len(missing)
        for i, d in zip(missing, self._measure([rows[i] for i in missing]), strict=True):
            out[i] = max(d, default=0.0) if d is not None else math.inf
        return out

    def precheck(self, rows: list[Row], background: bool = False) -> int:
        """Measure `rows` now, whole, for a later `draws` of them (the trainer's wait: `WaitWork.precheck_rows`;
        `background`: as in `draws`); returns how many rows were measured (those measured before are not)."""
        todo = [r for r in rows if r.uniforms is not None and self._recall(r) is None]
        with self._turn_of(background):
            measured = self._measure(todo)
        with self._turn:
            for r, d in zip(todo, measured, strict=True):
                if d is not None:
                    self._known[_row_id(r)] = _Measured.of(r, d)
            while len(self._known) > MAX_KNOWN_ROWS:
                self._known.pop(next(iter(self._known)))
            self.prechecked_rows += len(todo)
        return len(todo)

    def _measure(self, rows: list[Row]) -> list[list[float] | None]:
        """Per row, each completion token's distance from its draw under the published weights of its
        version (`_token_distances`; None where they cannot be obtained or verified: fail-closed, never
        passed unchecked)."""
        out: list[list[float] | None] = [None] * len(rows)
        by_version: dict[tuple[int, str], list[int]] = {}
        for i, r in enumerate(rows):
            by_version.setdefault((r.version, r.weights_digest), []).append(i)
        held = {pm.version for pm in self.planes.values()}  # first the version a model holds: no copy
        for (version, digest), idx in sorted(
            by_version.items(), key=lambda kv: (kv[0][0] not in held, kv[0])
        ):
            mine = [rows[i] for i in idx]
            try:
                for k, d in enumerate(self._exact(mine, version, digest)):
                    out[idx[k]] = d
            except PnyxError as e:  # fail-closed: never passed unchecked
                log.warning("trainer: cannot check draws against v%d (%s)", version, e)
            with self._turn:
                self.draw_rows += len(idx)
        return out

    def _recall(self, row: Row) -> float | None:
        """`row`'s largest distance from a measurement of it or of a longer row it begins (`precheck`: same
        key, sample, version and plane, and the same prompt, sampling and uniforms), else None."""
        with self._turn:
            known = self._known.get(_row_id(row))
        return None if known is None else known.largest(row)

    def prepare(self) -> float:
        """Start-up work of the first check, done before the first step instead of inside it: each plane's
        model loaded with the newest version it keeps (the first load copies the whole state in) and its way
        of sharing work between rows chosen (`sharing_of`: the prefix tree's proof is a few forwards). Nothing
        is fetched: a plane that keeps no version yet (a resumed run before its first publish) is left as
        is. Returns the seconds it took."""
        t0 = time.perf_counter()
        for pm in self.planes.values():
            if pm.trust is None or not pm.kept:
                continue
            with pm.lock:
                try:
                    sharing_of(pm.at(max(pm.kept)))
                except PnyxError as e:  # the first check fails closed on its own; nothing to decide here
                    log.warning("trainer: exact checks not prepared on the %s plane: %s", pm.plane, e)
        return time.perf_counter() - t0

    def _exact(self, rows: list[Row], version: int, digest: str) -> list[list[float] | None]:
        """The rows' per-token distances under the plane of `version` whose chain digest is `digest`."""
        for pm in self.planes.values():
            if pm.trust is None:
                raise IntegrityError("no run key to verify the published weights with")
            with pm.lock:
                model = pm.at(version)
                if pm.digest != digest and len(self.planes) > 1:
                    continue
                return _token_distances(model, rows)
        raise IntegrityError(f"no published plane of v{version} has digest {digest}")


Sharing = Literal["tree", "prompts", "none"]


def sharing_of(model: torch.nn.Module) -> Sharing:
    """How the exact re-check shares work between rows under `model`: one forward of the rows' prefix tree
    (`prefix_tree.packs_prefixes`), else each distinct prompt once and the completions on its KV cache
    (`drawcheck.caches_prompts`), else each row whole."""
    from pnyx.train.drawcheck import caches_prompts
    from pnyx.train.prefix_tree import packs_prefixes

    return "tree" if packs_prefixes(model) else "prompts" if caches_prompts(model) else "none"


def _distances(model: torch.nn.Module, rows: list[Row], sharing: Sharing | None = None) -> list[float]:
    """Per row, its largest distance from its draws under `model` (`_token_distances`; inf: not measured)."""
    return [
        max(d, default=0.0) if d is not None else math.inf for d in _token_distances(model, rows, sharing)
    ]


def _token_distances(
    model: torch.nn.Module, rows: list[Row], sharing: Sharing | None = None
) -> list[list[float] | None]:
    """Per row (each with uniforms and a completion), each completion token's distance from its draw under
    `model` (0 at a tool token, which has no uniform; None: not measured), rows of one sampling setting
    together, shared as `sharing` says (default: `sharing_of(model)`): the rows' prefix tree in one forward
    per call (`prefix_tree.tree_logits`), each distinct prompt forwarded once and the completions on its KV
    cache (`drawcheck.cached_prompt_logits`), or each row whole, rows sorted by length in calls of
    `drawcheck.CHUNK_TOKENS`."""
    from pnyx.models.logprobs import draw_distance, sampling_logprobs
    from pnyx.train.drawcheck import cached_prompt_logits, chunks
    from pnyx.train.prefix_tree import tree_logits

    out: list[list[float] | None] = [None] * len(rows)
    by_setting: dict[tuple[float, int, float], list[int]] = {}
    for i, r in enumerate(rows):
        by_setting.setdefault(r.sampling, []).append(i)
    sharing = sharing or sharing_of(model)
    fwd = Forward(model, torch.device("cpu"), torch.float32, False)
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 1 << 17)
    with torch.no_grad():
        for (temp, top_k, top_p), idx in by_setting.items():
            mine = [rows[i] for i in idx]
            if sharing == "none":
                for part in chunks([len(r.prompt) + len(r.completion) for r in mine], vocab):
                    mb = fwd.run([mine[k] for k in part], entropy=False, var=False, draws=True)
                    if mb.draw is None:
                        continue
                    for j, k in enumerate(part):
                        if mine[k].uniforms is not None:
                            out[idx[k]] = mb.draw[j, : len(mine[k].completion)].tolist()
                continue
            wanted = [[t for t, x in enumerate(r.uniforms or ()) if x == x] for r in mine]  # model tokens
            logits_of = tree_logits if sharing == "tree" else cached_prompt_logits
            calls = logits_of(model, [r.prompt for r in mine], [r.completion for r in mine], wanted)
            for part, logits in calls:
                npos = logits.shape[1]
                targets = torch.zeros((len(part), npos), dtype=torch.long)
                u = torch.full((len(part), npos), math.nan, dtype=torch.float64)
                for j, k in enumerate(part):
                    at, r = wanted[k], mine[k]
                    targets[j, : len(at)] = torch.tensor([r.completion[t] for t in at], dtype=torch.long)
                    u[j, : len(at)] = torch.tensor([(r.uniforms or ())[t] for t in at], dtype=torch.float64)
                d = draw_distance(sampling_logprobs(logits, temp, top_k, top_p), targets.to(logits.device), u)
                for j, k in enumerate(part):
                    per_token = [0.0] * len(mine[k].completion)
                    for t, x in zip(wanted[k], d[j, : len(wanted[k])].tolist(), strict=True):
                        per_token[t] = x
                    out[idx[k]] = per_token
    return out


def _row_id(row: Row) -> tuple[str, int, int, str]:
    """Where `Rejudge` files a row's measurement: its group, sample, version and plane."""
    return (row.key, row.index, row.version, row.weights_digest)


@dataclass(frozen=True)
class _Measured:
    """A row measured by `Rejudge.precheck`, compact (a prompt can be long): what identifies it and each
    completion token's distance from its draw."""

    prompt: bytes
    """A digest of the prompt's tokens (`_digest`)."""
    sampling: tuple[float, int, float]
    completion: np.ndarray
    uniforms: np.ndarray
    distances: np.ndarray

    @classmethod
    def of(cls, row: Row, distances: list[float]) -> _Measured:
        return cls(
            _digest(row.prompt), row.sampling, np.asarray(row.completion, dtype=np.int64),
            np.asarray(row.uniforms, dtype=np.float64), np.asarray(distances, dtype=np.float32),
        )  # fmt: skip

    def largest(self, row: Row) -> float | None:
        """`row`'s largest distance if `row` is this one or a prefix of it (else None)."""
        n = len(row.completion)
        if row.uniforms is None or n > len(self.completion) or len(row.uniforms) != n:
            return None
        same = (
            row.sampling == self.sampling
            and np.array_equal(self.completion[:n], np.asarray(row.completion, dtype=np.int64))
            and np.array_equal(self.uniforms[:n], np.asarray(row.uniforms, dtype=np.float64), equal_nan=True)
            and _digest(row.prompt) == self.prompt
        )
        return float(self.distances[:n].max(initial=0.0)) if same else None


def _digest(tokens: list[int]) -> bytes:
    """A collision-resistant digest of a token sequence."""
    return hashlib.blake2b(np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


def _worst(mb: MicroBatch) -> list[float | None]:
    """Per row of `mb`, its largest distance from its seeded draws (None: a row without uniforms)."""
    if mb.draw is None:
        return [None] * len(mb.rows)
    worst = mb.draw.amax(1).tolist()
    return [w if r.uniforms is not None else None for w, r in zip(worst, mb.rows, strict=True)]
