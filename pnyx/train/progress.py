"""Never silent: what the trainer is doing, in its log at least every `LOG_EVERY_S` and in the store.

`Progress(store, describe)` runs one daemon thread inside `with progress.running():`. The loop names its phase (`phase("ingesting")`,
`"waiting"`, `"training"`, `"publishing"`, `"checkpointing"`, ...) and calls `noted()` whenever it logs a
line of its own; whenever `LOG_EVERY_S` pass without one, the thread logs a line built from `describe()`:

    trainer v=42 waiting 23s: usable 3/8 backlog waiting=1200 fetched=16 listed=14000 gets=380 consumed=336 drops=stale:100

Every `STATUS_EVERY_S` (and when the block ends) it overwrites `trainer/status.json` with the same facts as JSON,
for `pnyx status` and the live view (backlog, phase, consumption). A status write that fails is logged and
retried at the next period: reporting never stops the trainer.

`format_line` is the dense per-step line; `zero_variance_note` words the warning a user sees when most
groups carry no signal; `starving_note` says why a trainer has waited long for a batch (which key is
quarantined and why, or that no groups arrive) and what to do. Knows nothing about torch or the step; never raises from its thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from pnyx.errors import StoreError
from pnyx.protocol import layout
from pnyx.store import Store

log = logging.getLogger("pnyx.train")

STATUS_KEY = layout.trainer_key("status.json")
LOG_EVERY_S = 8.0
"""Longest silence before the thread logs a progress line (the promise is 10 s; this leaves a margin)."""
STATUS_EVERY_S = 10.0
ZERO_VARIANCE_WARN = 0.5
"""Warn when more than this share of recently scored groups had the same reward for every sample."""


def zero_variance_note(frac: float | None, kind: str | None = None) -> str | None:
    """The warning for a zero-variance share `frac` (None below `ZERO_VARIANCE_WARN`); `kind` is
    "hard" (most such groups scored 0 everywhere), "easy" (1 everywhere) or None."""
    if frac is None or frac <= ZERO_VARIANCE_WARN:
        return None
    why = {
        "hard": "the task is too hard for this model (every sample failed)",
        "easy": "the task is too easy for this model (every sample succeeded)",
    }.get(kind or "", "the task is too hard or too easy for this model")
    return (
        f"{100 * frac:.0f}% of groups had the same reward for every sample, so they carry no learning signal: "
        f"{why}. Try another difficulty (env.kwargs, e.g. arith digits), a reward with partial credit "
        "(a format part), or a larger worker.group_size."
    )


STARVE_AFTER_S = 30.0
"""A trainer waiting this long for a full batch says why (`starving_note`)."""


def starving_note(d: dict[str, Any]) -> str | None:
    """Why a trainer that has waited `STARVE_AFTER_S` for a full batch has none, and what to do; None
    while it is not starving. `d`: a `Progress.snapshot()` (or `trainer/status.json`)."""
    waited = float(d.get("phase_s") or 0.0)
    if d.get("phase") not in ("waiting", "ingesting") or waited < STARVE_AFTER_S:
        return None
    head = f"no full batch for {waited:.0f}s (usable {d.get('have', 0)}/{d.get('need', '?')})"
    quarantined = d.get("quarantined") or {}
    keys = d.get("keys") or {}
    if quarantined:
        parts = []
        for fp, why in sorted(quarantined.items())[:3]:
            names = ",".join((keys.get(fp) or {}).get("names") or []) or "no name"
            parts.append(f"worker key {fp} ({names}) is quarantined: {why}")
        more = f" (+{len(quarantined) - 3} more)" if len(quarantined) > 3 else ""
        return (
            f"{head}: " + "; ".join(parts) + more + ". A quarantined key's groups are rejected unread. "
            "If it is your own worker, add its fingerprint to security.trusted_keys (pnyx run trusts its "
            "local workers itself) and restart the trainer with --resume; else start more workers."
        )
    b = d.get("backlog") or {}
    if not b.get("waiting") and not b.get("fetched"):
        return (
            f"{head}: no groups are waiting. Workers may still be loading or generating; if none is "
            "running or pointed at this store, start one (`pnyx status` lists their heartbeats)."
        )
    zv = d.get("zero_variance") or {}
    hint = (
        "; workers upload only groups whose rewards differ, and most of theirs do not (the zero-variance "
        "warning says why)"
        if (zv.get("frac") or 0.0) > 0.5
        else ""
    )
    probation = int(b.get("probation") or 0)
    behind = int(b.get("held") or 0) - probation
    held = (
        f", {behind} of them held back until a seq their worker committed below them is read (committed "
        "draws: a seq left empty is settled as a gap when its version leaves the window, docs/security.md)"
        if behind > 0
        else ""
    )
    if probation:
        held += (
            f", {probation} of them a new worker's first groups under an untrusted key, never trained "
            "(security.standing_groups; your own workers' keys go in security.trusted_keys)"
        )
    return (
        f"{head}: {b.get('waiting', 0)} groups waiting, {b.get('fetched', 0)} fetched{held}; drops so far "
        f"{fmt_counts(d.get('drops') or {})}{hint} (`pnyx status` shows each key's checks)."
    )


def held_part(backlog: dict[str, int], label: str) -> str:
    """The backlog's `held` count after `label` (committed draws), or nothing where the run holds none back."""
    return f"{label}{backlog['held']}" if "held" in backlog else ""


def fmt_counts(d: dict[str, int]) -> str:
    return ",".join(f"{k}:{v}" for k, v in sorted(d.items()) if v) or "0"


def reward_parts(groups: list[Any]) -> dict[str, float]:
    """Mean of each reward part over the samples of a batch (from the trainer's own re-score)."""
    sums: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for g in groups:
        for parts in g.parts:
            for k, v in parts.items():
                sums[k] += v
                counts[k] += 1
    return {k: sums[k] / counts[k] for k in sorted(sums)}


def format_line(m: dict[str, Any]) -> str:
    """The dense greppable per-step line."""
    parts = ",".join(f"{k}:{v:.2f}" for k, v in (m.get("reward_parts") or {}).items()) or "-"
    b = m.get("backlog") or {}
    return (
        f"trainer v={m['version']} groups={m['groups']} reward={m['reward']:.3f} parts={parts} "
        f"stale={m['stale_mean']:.2f} masked={100 * m['masked_frac']:.2f}% clip={100 * m['clip_frac']:.2f}% "
        f"ess={m['ess']:.3f} ent={m['entropy']:.3f} gnorm={m['grad_norm']:.3f} loss={m['loss']:+.4f} "
        f"tok/s={m['tok_s']:.0f} lr={m.get('lr', 0.0):.2e} pub={m['publish_kind']}:{m['publish_s']:.2f}s "
        f"ingest={m.get('ingest_wait_s', 0.0):.2f}s backlog=waiting:{b.get('waiting', 0)},fetched:{b.get('fetched', 0)}"
        f"{held_part(b, ',held:')} "
        f"drops={fmt_counts(m['drops'])} disagree={fmt_counts(m['disagreements'])}"
        + (f" rejudged={fmt_counts(m['rejudged'])}" if m.get("rejudged") else "")
        + (
            f" draws={m['draws']['flagged']}/{m['draws']['rows']}:{m['draws']['exact_s'] + m['draws'].get('forward_s', 0.0):.2f}s"
            if m.get("draws")
            else ""
        )
        + "".join(f" lp_gap[{e}]={g:.2e}" for e, g in sorted((m.get("lp_gap_engine") or {}).items()))
    )


def progress_line(d: dict[str, Any]) -> str:
    """The periodic line for a `describe()` dict."""
    b = d.get("backlog") or {}
    return (
        f"trainer v={d.get('version')} {d.get('phase')} {d.get('phase_s', 0):.0f}s: "
        f"usable {d.get('have', 0)}/{d.get('need', 0)} backlog waiting={b.get('waiting', 0)} "
        f"fetched={b.get('fetched', 0)}{held_part(b, ' held=')} listed={b.get('listed', 0)} gets={b.get('gets', 0)} "
        f"consumed={d.get('consumed', 0)} drops={fmt_counts(d.get('drops') or {})}"
    )


class Progress:
    """The reporter thread (see the module docstring)."""

    def __init__(
        self, store: Store, describe: Callable[[], dict[str, Any]], log_every_s: float = LOG_EVERY_S
    ):
        self.store = store
        self.describe = describe
        self.log_every_s = log_every_s
        self.phase_name = "starting"
        self.phase_since = time.monotonic()
        self.detail: dict[str, Any] = {}
        self._last_line = time.monotonic()
        self._last_status = float("-inf")
        self._last_warn = float("-inf")
        self._last_starve = float("-inf")

    @contextlib.contextmanager
    def running(self, status: bool = True) -> Iterator[None]:
        """Run the reporter thread for the duration of the block; with `status`, also write
        `trainer/status.json` every `STATUS_EVERY_S` and once more at the end."""
        stop = threading.Event()
        thread = threading.Thread(target=self._run, args=(stop, status), name="pnyx-progress", daemon=True)
        self._last_line = time.monotonic()
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(2.0)
            if status:
                self.write_status()

    def phase(self, name: str, **detail: object) -> None:
        """Enter phase `name` (the clock restarts only when the name changes); `detail` adds to the report."""
        if name != self.phase_name:
            self.phase_name, self.phase_since = name, time.monotonic()
        self.detail = detail

    def noted(self) -> None:
        """The loop just logged a line."""
        self._last_line = time.monotonic()

    def snapshot(self) -> dict[str, Any]:
        d = dict(self.describe())
        d.update(self.detail)
        d["phase"] = self.phase_name
        d["phase_s"] = round(time.monotonic() - self.phase_since, 1)
        d["updated_at"] = time.time()
        note = starving_note(d)
        if note is not None:
            d["starving"] = note
        return d

    def warn_zero_variance(self, frac: float | None, kind: str | None) -> None:
        """Log the zero-variance warning (at most once a minute)."""
        note = zero_variance_note(frac, kind)
        if note is not None and time.monotonic() - self._last_warn >= 60.0:
            self._last_warn = time.monotonic()
            log.warning("trainer: %s", note)
            self.noted()

    def warn_starving(self, note: str | None) -> None:
        """Log why the trainer is starving (at most once every 30 s)."""
        if note is not None and time.monotonic() - self._last_starve >= STARVE_AFTER_S:
            self._last_starve = time.monotonic()
            log.warning("trainer: %s", note)
            self.noted()

    def write_status(self) -> None:
        try:
            self.store.put(STATUS_KEY, json.dumps(self.snapshot(), sort_keys=True).encode())
        except StoreError as e:
            log.warning("trainer: status not written (%s)", e)
        self._last_status = time.monotonic()

    def _run(self, stop: threading.Event, status: bool) -> None:
        while not stop.wait(0.5):
            try:
                now = time.monotonic()
                if now - self._last_line >= self.log_every_s:
                    d = self.snapshot()
                    log.info(progress_line(d))
                    self.noted()
                    zv = d.get("zero_variance") or {}
                    self.warn_zero_variance(zv.get("frac"), zv.get("kind"))
                    self.warn_starving(d.get("starving"))
                if status and now - self._last_status >= STATUS_EVERY_S:
                    self.write_status()
            except Exception as e:  # noqa: BLE001 - a report must never kill the trainer; say why instead
                log.warning("trainer: progress report failed: %s: %s", type(e).__name__, e)
                self.noted()
