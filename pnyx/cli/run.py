"""`pnyx run`: the main job — one trainer and N workers on this machine, a live view, a before/after table.

The orchestrator owns processes and the run folder, nothing else: the trainer (`pnyx trainer`) and the
workers (`pnyx worker`) are separate processes that meet only in the store, exactly as they would across
machines. What this module adds on top:

- the run folder `./runs/<name>/` (`pnyx.cli.run_folder`: the default local-folder store root,
  `config.toml`, `logs/<role>.log`, `evals.jsonl`, `learning_curve.png`, `summary.json`);
- held-out evaluation of published versions (v0, every `run.eval_every` versions, the final one) in a
  background thread of this process with one torch thread (`pnyx.eval.runner.EvalLoop`), so it never
  starves the fleet;
- the budgets: the trainer stops itself after `run.steps`; this process stops everything after
  `run.time_budget_s`, on Ctrl-C, or on SIGTERM: SIGINT to every child's process group, a deadline, then
  SIGKILL (`pnyx.cli.run_fleet`). `--resume` continues the newest run (or `--run.name`) with the
  trainer's `--resume`.

Knows nothing about RL internals. Exit status: 0 when the trainer finished or was stopped cleanly, 1 when
it failed (the message names the log to read).
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any

from pnyx.cli.run_fleet import Fleet
from pnyx.cli.run_folder import CURVE_FILE, SUMMARY_FILE, RunPlan, plan_run
from pnyx.config import PnyxConfig
from pnyx.errors import ConfigError
from pnyx.models.source import resolve_model_path
from pnyx.store import Store

if TYPE_CHECKING:
    from pnyx.cli.live import RunWatcher, Snapshot
    from pnyx.eval.runner import EvalLoop, VersionEvaluator

START_DEADLINE_S = 180.0
TICK_S = 1.0


# --- evaluation in the background ---------------------------------------------------------------------------


def _make_evaluator(plan: RunPlan) -> VersionEvaluator:
    import torch

    from pnyx.config import config_from_dict, resolve_env_kwargs
    from pnyx.eval.runner import VersionEvaluator, quiet_transformers
    from pnyx.protocol.runfile import read_run
    from pnyx.store import open_store

    torch.set_num_threads(1)
    quiet_transformers()
    cfg, store = plan.cfg, open_store(plan.store_url)
    manifest = read_run(store)  # written before v0 is published, so present by the first evaluation
    if manifest is None:
        raise ConfigError(f"{store.url} has no run.json to evaluate against")
    # The generation budget the trainer resolved and recorded in run.json, which is what the workers use.
    max_new_tokens = config_from_dict(manifest.config).worker.max_new_tokens
    return VersionEvaluator(
        store,
        resolve_model_path(cfg),
        cfg.env.name,
        resolve_env_kwargs(cfg),
        tasks=cfg.run.eval_tasks,
        samples=1,
        temperature=cfg.worker.temperature,
        top_p=cfg.worker.top_p,
        top_k=cfg.worker.top_k,
        max_new_tokens=max_new_tokens,
        seed=cfg.run.seed,
    )


def _store_eval(store_url: str, version: int, record: dict[str, Any]) -> None:
    """Also publish the eval record into the run (`evals/`), so `pnyx status` shows pass@1 from anywhere."""
    from pnyx.protocol import layout
    from pnyx.store import open_store

    open_store(store_url).put(layout.eval_key(version), json.dumps(record).encode(), mode="overwrite")


# --- the main job ---------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """How the fleet phase ended."""

    reason: str
    trainer_failed: bool = False
    notes: list[str] = field(default_factory=list)


def run_main(cfg: PnyxConfig, workers: int, resume: bool, live: bool) -> None:
    """Start (or resume) a run on this machine, show it live, stop at a budget, print before/after."""
    from pnyx.cli.common import fail

    try:
        plan = plan_run(cfg, resume)
    except ConfigError as e:
        raise fail(str(e)) from None
    from pnyx.errors import ModelNotFoundError
    from pnyx.models.source import resolve_model_source

    try:  # fetch a hub model or convert a GGUF file once, here, before the fleet's processes need it
        resolve_model_source(plan.cfg)
    except (ConfigError, ModelNotFoundError) as e:
        raise fail(f"model: {e}") from None
    import typer

    code = Orchestrator(plan, workers, live).run()
    if code:
        raise typer.Exit(code)


class Orchestrator:
    """Drives one `pnyx run` invocation: start the fleet, watch it, stop it, report."""

    def __init__(self, plan: RunPlan, workers: int, live: bool):
        from rich.console import Console

        self.plan, self.live = plan, live
        self.fleet = Fleet(plan, workers)
        self.console = Console()
        self.observed: dict[int, float] = {}
        self.t_start = time.time()
        self.evals: EvalLoop | None = None  # once the fleet is up
        self.supply: dict[str, Any] | None = None  # groups generated vs consumed, once the fleet stopped

    def say(self, text: str) -> None:
        self.console.print(text, highlight=False)

    def run(self) -> int:
        from pnyx.store import open_store

        previous = signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
        store = open_store(self.plan.store_url)
        self.say(
            f"pnyx run {self.plan.name}: store {store.url}, env {self.plan.cfg.env.name}, "
            f"model {resolve_model_path(self.plan.cfg)}, {self.fleet.n_workers} worker(s)"
            + (" (resumed)" if self.plan.resumed else "")
        )
        self.say(f"logs: {self.plan.logs}/")
        try:
            try:
                outcome = self._fleet_phase(store)
            finally:
                notes = self.fleet.stop()
            outcome.notes.extend(notes)
            # SIGTERM stays an interrupt through the report: a second one skips the final evaluation
            # and still writes summary.json.
            return self._report(store, outcome)
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _fleet_phase(self, store: Store) -> Outcome:
        from pnyx.cli.live import RunWatcher

        self.fleet.start_trainer()
        # The workers start now, not once v0 is out: they load torch and the model while the trainer does,
        # then wait for run.json and v0 themselves (with backoff, under their join deadline), so start-up
        # is paid once, in parallel, rather than trainer then workers.
        self.fleet.start_workers()
        watcher = RunWatcher(store, evals_path=self.plan.evals_path)
        t0 = time.time()
        try:
            if not self._wait_for_v0(store, t0):
                if self.fleet.started_trainer.rc is None:
                    return Outcome(
                        f"the trainer did not publish version 0 within {START_DEADLINE_S:.0f}s; see {self.fleet.started_trainer.log}",
                        trainer_failed=True,
                    )
                return self._trainer_outcome("the trainer exited before publishing version 0")
            plan = self.plan
            from pnyx.eval.runner import EvalLoop

            evals = EvalLoop(
                lambda: _make_evaluator(plan),
                plan.evals_path,
                plan.cfg.env.name,
                plan.cfg.run.eval_every,
                self.observed,
                self._run_t0(watcher),
                publish=lambda v, r: _store_eval(plan.store_url, v, r),
            )
            self.evals = evals
            return self._watch(watcher, evals, t0)
        except KeyboardInterrupt:
            return Outcome(
                "interrupted (Ctrl-C): resume with `pnyx run --resume --run.name=" + self.plan.name + "`"
            )

    def _run_t0(self, watcher: RunWatcher) -> float:
        snap = watcher.snapshot()
        return snap.started_at or self.t_start

    def _wait_for_v0(self, store: Store, t0: float) -> bool:
        from pnyx.protocol.runfile import read_run
        from pnyx.weights import TrustedWeights

        weights = None  # opened once run.json exists: one verifier, so a forgery is reported once
        while time.time() - t0 < START_DEADLINE_S:
            if self.fleet.started_trainer.rc is not None:
                return False
            if weights is None and (run := read_run(store)) is not None:
                weights = TrustedWeights.for_run(store, run)
            v = weights.latest() if weights is not None else None  # only a version the trainer signed
            if v is not None:
                self.observed.setdefault(v, time.time())
                return True
            time.sleep(0.5)
        return False

    def _trainer_outcome(self, reason: str, latest: int | None = None) -> Outcome:
        rc = self.fleet.started_trainer.rc
        steps = self.plan.cfg.run.steps
        if rc == 0 and latest is not None and latest >= steps:
            return Outcome(f"the trainer finished its step budget ({steps} steps)")
        if rc == 0:
            return Outcome(
                f"the trainer stopped at v{latest} before its step budget of {steps}; see {self.fleet.started_trainer.log}"
            )
        return Outcome(
            f"{reason} (exit code {rc}); see {self.fleet.started_trainer.log}", trainer_failed=True
        )

    def _watch(self, watcher: RunWatcher, evals: EvalLoop, t0: float) -> Outcome:
        from rich.live import Live

        from pnyx.cli.live_view import plain_line, render

        budget = self.plan.cfg.run.time_budget_s
        last_line = 0.0
        live_ctx = Live(console=self.console, refresh_per_second=2, transient=False) if self.live else None
        if live_ctx is not None:
            live_ctx.start()
        try:
            while True:
                snap = watcher.snapshot(evals=evals.records)
                if snap.version is not None:
                    for v in range(max(self.observed, default=-1) + 1, snap.version + 1):
                        self.observed[v] = time.time()
                evals.check()
                evals.maybe_start(snap.version)
                if live_ctx is not None:
                    live_ctx.update(render(snap, title=f"pnyx run {self.plan.name}"))
                elif time.time() - last_line >= 5.0:
                    print(plain_line(snap), flush=True)
                    last_line = time.time()
                if self.fleet.started_trainer.rc is not None:
                    return self._trainer_outcome("the trainer exited", watcher.snapshot().version)
                if self.fleet.workers and all(w.rc is not None for w in self.fleet.workers):
                    return Outcome(
                        "every worker exited; see " + ", ".join(str(w.log) for w in self.fleet.workers),
                        trainer_failed=False,
                    )
                if time.time() - t0 >= budget:
                    return Outcome(f"time budget of {budget:.0f}s spent")
                time.sleep(TICK_S)
        finally:
            if live_ctx is not None:
                live_ctx.stop()
                if not self.console.is_terminal:
                    self.console.line()

    # --- the end -------------------------------------------------------------------------------------

    def _report(self, store: Store, outcome: Outcome) -> int:
        from pnyx.cli.live import RunWatcher
        from pnyx.cli.live_view import before_after_table
        from pnyx.eval.runner import read_eval_file
        from pnyx.weights import trusted_latest

        self.say(f"stopped: {outcome.reason}")
        for note in outcome.notes:
            self.say(f"note: {note}")
        interrupted = outcome.reason.startswith("interrupted")
        evals = self.evals
        final_version = trusted_latest(store)  # the newest version the trainer signed, never a forgery
        after: dict | None = None
        not_evaluated: str | None = None
        if final_version is None:
            not_evaluated = "no version was published"
        elif evals is None:
            not_evaluated = "evaluation is off (run.eval_tasks=0)"
        else:
            # The "after" column is always the newest version, on an interrupt too: pairing an older
            # evaluation with the final version would report the wrong weights' numbers.
            which = "newest" if interrupted else "final"
            again = " (interrupt again to skip)" if interrupted else ""
            self.say(
                f"evaluating the {which} version v{final_version} on {self.plan.cfg.run.eval_tasks} held-out tasks{again} ..."
            )
            try:
                after = evals.final(final_version, threads=max(1, (os.cpu_count() or 1) // 2))
            except KeyboardInterrupt:
                not_evaluated = f"the evaluation of v{final_version} was interrupted"
        if after is None and not_evaluated is None:
            not_evaluated = f"the evaluation of v{final_version} gave no record"
        if not_evaluated is not None:
            self.say(f"after: not evaluated ({not_evaluated})")
        records = evals.records if evals is not None else read_eval_file(self.plan.evals_path)
        before = next((r for r in records if r.get("version") == 0), None)
        snap = RunWatcher(store, evals_path=self.plan.evals_path).snapshot(evals=records)
        self.supply = _supply_report(store)
        self._write_outputs(snap, records, before, after, outcome, final_version, not_evaluated)
        self.console.print(before_after_table(before, after, self.plan.cfg.env.name))
        if self.supply is not None:
            from pnyx.train.supply import format_report

            self.say(format_report(self.supply))
        self.say(f"learning curve: {self.plan.folder / CURVE_FILE}")
        self.say(f"summary: {self.plan.folder / SUMMARY_FILE}   logs: {self.plan.logs}/")
        if final_version is not None:
            export = f"pnyx export --store {self.plan.store_url} --out {self.plan.folder / 'export'}"
            self.console.print(
                f"export it: {export}", highlight=False, soft_wrap=True
            )  # one line, copy-pastable
        if outcome.trainer_failed:
            self.say(f"[red]the trainer failed[/red]: read {self.fleet.started_trainer.log}")
            return 1
        return 0

    def _write_outputs(
        self,
        snap: Snapshot,
        records: list[dict[str, Any]],
        before: dict | None,
        after: dict | None,
        outcome: Outcome,
        final_version: int | None,
        not_evaluated: str | None,
    ) -> None:
        """The learning curve PNG and summary.json; `after` is the evaluation of `final_version` or None
        (then `after_not_evaluated` says why), never another version's."""
        from pnyx.cli.live import reward_of
        from pnyx.cli.live_view import pass_ratio
        from pnyx.eval.plot import plot_learning_curve

        t0 = snap.started_at or self.t_start
        train_points = []
        for m in snap.metrics:
            v = m.get("version")
            when = m.get("time") or m.get("timestamp") or (self.observed.get(v) if v is not None else None)
            if v is not None and when is not None:
                train_points.append({"version": v, "elapsed_s": float(when) - t0, "reward": reward_of(m)})
        plot_learning_curve(
            train_points, records, self.plan.folder / CURVE_FILE, title=f"pnyx run {self.plan.name}"
        )
        summary = {
            "run": self.plan.name,
            "store": self.plan.store_url,
            "env": self.plan.cfg.env.name,
            "workers": self.fleet.n_workers,
            "stopped": outcome.reason,
            "trainer_failed": outcome.trainer_failed,
            "final_version": final_version,
            "wall_s": round(time.time() - self.t_start, 1),
            "before": before,
            "after": after,
            "after_not_evaluated": not_evaluated,
            "ratio": pass_ratio(before, after),
            "supply": self.supply,
            "train": train_points,
        }
        (self.plan.folder / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")


def _supply_report(store: Store) -> dict[str, Any] | None:
    """Groups the workers generated vs the trainer consumed (`pnyx.train.supply`); None if unreadable."""
    from pnyx.errors import PnyxError
    from pnyx.train.supply import supply_report

    try:
        return supply_report(store)
    except PnyxError as e:
        print(f"note: supply accounting not available: {e}", flush=True)
        return None


def _sigterm_as_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt
