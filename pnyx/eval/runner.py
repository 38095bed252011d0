"""Held-out evaluation of a model folder or of a published version: pass@k with a confidence interval.

`evaluate_model` samples `samples` completions per held-out task with an engine of the engine protocol
(`pnyx.rollout.engines`: torch, mlx or vllm, the same samplers and settings the workers use), runs the
environment's tool loop when it has one, scores every completion with the environment's own verifier,
and reduces to an `EvalReport` (pass@1 with a 95% interval, pass@k with the unbiased estimator, format
rate; for tool environments the search rate and the pass rate with and without a search). It is the one
evaluation path: `pnyx eval`, `pnyx run` and the tiny model's build script all use it. `VersionEvaluator`
keeps one engine in memory and moves it between published versions through the weights Syncer, reading
only versions the run's trainer key signed (`pnyx.weights.TrustedWeights`: an unsigned run, or a version
the trainer did not sign, is refused, never evaluated), and the engine proves every version it loads
against that version's manifest before it samples (`WorkerEngine.update`, fail-closed); `EvalLoop`
schedules those evaluations (v0, every N versions, the final one) in a background thread, which is how
`pnyx run` evaluates as it trains.

Knows nothing about processes, the live view or the trainer; the loop's thread hands its errors back to
the caller (`EvalLoop.check`). Heavy imports (torch, the engines, the weights plane) happen inside
functions. Invariant: the held-out tasks and the sampling seed depend only
on the arguments, so two versions evaluated with the same settings see the same tasks and the same random
stream (common random numbers: the before/after difference is not blurred by task sampling).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pnyx.envs.base import Environment, Score, Task
from pnyx.errors import ConfigError, IntegrityError
from pnyx.eval.metrics import pass_at_k
from pnyx.store import Store

if TYPE_CHECKING:
    from pnyx.rollout.engines import EngineName, WorkerEngine
    from pnyx.rollout.episodes import Episode
    from pnyx.rollout.sampling import Completion
    from pnyx.weights.trusted import TrustedWeights

Z95 = 1.959963984540054


@dataclass
class EvalReport:
    """Figures of one held-out evaluation (one model or one published version, one environment)."""

    env: str
    tasks: int
    samples: int
    pass_at_1: float
    ci_low: float
    ci_high: float
    pass_at_k: dict[int, float] = field(default_factory=dict)
    format_rate: float = 0.0
    search_rate: float | None = None
    correct_when_searched: float | None = None
    """Tool environments: the pass rate of completions that called the tool at least once."""
    correct_without_search: float | None = None
    """Tool environments: the pass rate of completions that never called the tool."""
    mean_completion_tokens: float = 0.0
    max_new_tokens: int | None = None
    """The generation budget per turn that was used."""
    version: int | None = None
    digest: str | None = None
    engine: str | None = None
    """The engine that sampled (`pnyx.rollout.engines`: torch, mlx, vllm)."""
    seconds: float = 0.0
    created_at: float = 0.0
    examples: list[str] = field(default_factory=list)
    """The first few completion texts (only when asked for; left out of `to_dict` when empty)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (pass@k keys spelled `pass@K`, as in the printed tables and evals.jsonl)."""
        d = asdict(self)
        d.pop("pass_at_1")
        d.pop("pass_at_k")
        if not d["examples"]:
            d.pop("examples")
        d["pass@1"] = self.pass_at_1
        for k, v in self.pass_at_k.items():
            d[f"pass@{k}"] = v
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EvalReport:
        """Inverse of `to_dict` (unknown keys are ignored, so older/newer records still load)."""
        pk = {int(k[5:]): float(v) for k, v in d.items() if k.startswith("pass@") and k != "pass@1"}
        known = {f for f in cls.__dataclass_fields__} - {"pass_at_1", "pass_at_k"}
        return cls(pass_at_1=float(d["pass@1"]), pass_at_k=pk, **{k: v for k, v in d.items() if k in known})


# --- statistics ----------------------------------------------------------------------------------


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (95% by default); (0, 1) when n == 0."""
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= successes <= n:
        raise ValueError(f"wilson_interval: successes={successes} must be within [0, n={n}]")
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap_interval(
    values: Sequence[float], resamples: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values` (per-task pass rates), seeded."""
    import numpy as np

    if len(values) == 0:
        return 0.0, 1.0
    rng = np.random.default_rng(seed)
    arr = np.asarray(values, dtype=np.float64)
    means = arr[rng.integers(0, len(arr), size=(resamples, len(arr)))].mean(axis=1)
    alpha = (1 - level) / 2
    return float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha))


def pass_at_1_interval(correct_per_task: Sequence[int], samples: int) -> tuple[float, float]:
    """95% interval of pass@1: Wilson with one sample per task (tasks are independent Bernoulli trials),
    else a bootstrap over tasks (samples of one task are correlated, so they are resampled together)."""
    if samples == 1:
        return wilson_interval(sum(correct_per_task), len(correct_per_task))
    return bootstrap_interval([c / samples for c in correct_per_task])


# --- sampling ------------------------------------------------------------------------------------


def heldout_tasks(env: Environment, n: int, seed: int = 0) -> list[Task]:
    """The first `n` tasks of the environment's test split for `seed` (the same every call)."""
    if n < 1:
        raise ConfigError(f"held-out evaluation needs at least one task, got {n}")
    return env.sample("test", seed, n)


def is_correct(score: Score) -> bool:
    """Full marks: the verifier's `correct` part when it reports one, else reward == 1."""
    if "correct" in score.parts:
        return score.parts["correct"] >= 1.0 - 1e-9
    return score.reward >= 1.0 - 1e-9


def _has_format(score: Score) -> bool:
    return score.parts.get("format", float(score.reward > 0)) > 0


def evaluate_model(
    engine: WorkerEngine,
    env: Environment,
    tasks: Sequence[Task],
    samples: int = 1,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int | None = None,
    seed: int = 0,
    batch_size: int = 64,
    ks: Sequence[int] = (),
    examples: int = 0,
) -> EvalReport:
    """Sample `samples` completions per task with `engine`, score them with `env`, and reduce to an `EvalReport`.

    pass@k uses the unbiased estimator over the `samples` draws (k ≤ samples). Tool environments
    (`env.tool_stops` non-empty) run the engine's multi-turn loop; their `search_rate` is the fraction of
    completions with at least one tool call (None for single-turn environments), and
    `correct_when_searched` / `correct_without_search` split the pass rate by it. `max_new_tokens` None
    means the environment's budget. The first `examples` completion texts are kept in the report.
    """
    from pnyx.config import resolve_max_new_tokens

    if samples < 1:
        raise ConfigError(f"samples per task must be >= 1, got {samples}")
    bad = [k for k in ks if not 1 <= k <= samples]
    if bad:
        raise ConfigError(f"pass@k needs 1 <= k <= samples ({samples}); got k={bad}")
    budget = resolve_max_new_tokens(max_new_tokens, env)
    t0 = time.perf_counter()
    multi_turn = bool(getattr(env, "tool_stops", []))
    correct = [0] * len(tasks)
    formatted = ntokens = 0
    by_search = {True: [0, 0], False: [0, 0]}  # searched? -> [correct, total]
    kept: list[str] = []
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "max_new_tokens": budget}
    for i, out, score in scored_samples(engine, env, tasks, samples, sampling, seed, batch_size):
        ok = is_correct(score)
        correct[i] += ok
        formatted += _has_format(score)
        tally = by_search[getattr(out, "num_tool_calls", 0) > 0]
        tally[0] += ok
        tally[1] += 1
        ntokens += len(out.tokens)
        if len(kept) < examples:
            kept.append(out.text)
    total = len(tasks) * samples
    searched = by_search[True][1]
    lo, hi = pass_at_1_interval(correct, samples)
    return EvalReport(
        env=env.name,
        tasks=len(tasks),
        samples=samples,
        pass_at_1=sum(correct) / total if total else 0.0,
        ci_low=lo,
        ci_high=hi,
        pass_at_k={k: sum(pass_at_k(samples, c, k) for c in correct) / len(tasks) for k in ks if k > 1},
        format_rate=formatted / total if total else 0.0,
        search_rate=(searched / total if total else 0.0) if multi_turn else None,
        correct_when_searched=_rate(*by_search[True]) if multi_turn else None,
        correct_without_search=_rate(*by_search[False]) if multi_turn else None,
        mean_completion_tokens=ntokens / total if total else 0.0,
        max_new_tokens=budget,
        engine=engine.name,
        seconds=time.perf_counter() - t0,
        created_at=time.time(),
        examples=kept,
    )


def scored_samples(
    engine: WorkerEngine,
    env: Environment,
    tasks: Sequence[Task],
    samples: int,
    sampling: Mapping[str, Any],
    seed: int = 0,
    batch_size: int = 64,
) -> Iterator[tuple[int, Completion | Episode, Score]]:
    """(task index, completion, score) of `samples` completions per task, task by task (a task's samples
    come one after another), generated in batches of `batch_size` with `sampling` (`SamplingParams`' fields
    but `stop` and `seed`: the env's stop strings, a seed per batch derived from `seed`)."""
    from pnyx.models import render_prompt
    from pnyx.rollout.cohort import sample_env
    from pnyx.rollout.sampling import SamplingParams

    prompts = [render_prompt(engine.tokenizer, t.prompt) for t in tasks]
    flat = [i for i in range(len(tasks)) for _ in range(samples)]
    for b, start in enumerate(range(0, len(flat), batch_size)):
        chunk = flat[start : start + batch_size]
        params = SamplingParams(**sampling, stop=list(env.stop_strings), seed=seed * 1_000_003 + b)
        outs = sample_env(engine, env, [prompts[i] for i in chunk], [tasks[i] for i in chunk], params)
        for i, out in zip(chunk, outs, strict=True):
            yield i, out, env.score(tasks[i], out.text)


def _rate(hits: int, n: int) -> float | None:
    return hits / n if n else None


def quiet_transformers() -> None:
    """No progress bars or info chatter from transformers (they would tear a live terminal view)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def read_eval_file(path: str | Path) -> list[dict[str, Any]]:
    """Eval records from a JSON-lines file (one `EvalReport.to_dict()` per line); [] if it is missing."""
    p = Path(path)
    if not p.is_file():
        return []
    rows = []
    for line in p.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line being appended right now; the next refresh reads it whole
    return rows


# --- published versions ---------------------------------------------------------------------------


class VersionEvaluator:
    """Evaluates published versions of one run with one engine moved along by a weights Syncer.

    Built once (engine, tokenizer, environment, held-out tasks); `evaluate(version)` syncs to exactly that
    version (signed by the run's trainer key, verified digest chain), loads it into the engine, which
    proves what it computes with against the version's manifest (fail-closed), and evaluates it with fixed
    tasks and seed.
    """

    def __init__(
        self,
        store: Store | TrustedWeights,
        model_path: str | Path,
        env_name: str,
        env_kwargs: dict[str, Any] | None = None,
        tasks: int = 200,
        samples: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        max_new_tokens: int | None = None,
        seed: int = 0,
        ks: Sequence[int] = (),
        trust: str | None = None,
        engine: EngineName = "torch",
        dtype: str = "float32",
        device: str = "cpu",
    ):
        """`store` is the run's store (its trainer key is read from run.json, with `trust` the fingerprint
        that key must have), or the run's `TrustedWeights` already opened. ConfigError for a store
        without run.json, an unsigned run or another key, or an `engine` that cannot run here.
        `env_kwargs` is the run's resolved environment configuration (`resolve_env_kwargs`);
        `max_new_tokens` None means the environment's budget. `engine` (`pnyx.rollout.engines`) loads the
        run's base model `model_path` in `dtype` on `device`, then each evaluated version on top of it."""
        from pnyx.envs import get_env
        from pnyx.models import load_tokenizer
        from pnyx.models.lora import lora_from_run
        from pnyx.rollout.engines import check_engine, make_engine
        from pnyx.weights.trusted import TrustedWeights

        # before the model loads: a run whose weights nobody signed, or an engine missing here, fails fast
        self.weights = store if isinstance(store, TrustedWeights) else TrustedWeights.open(store, trust)
        self.store = self.weights.store
        check_engine(engine, device)
        self.env = get_env(env_name, **(env_kwargs or {}))
        self.tasks = heldout_tasks(self.env, tasks, seed)
        self.tokenizer = load_tokenizer(model_path)
        lora = lora_from_run(self.weights.run.config)  # a LoRA run publishes adapters of the base
        self.engine = make_engine(engine, model_path, self.tokenizer, dtype=dtype, device=device, lora=lora)
        self.samples, self.seed, self.ks = samples, seed, tuple(ks)
        self.sampling = {
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "max_new_tokens": max_new_tokens,
        }
        self.syncer = self.weights.syncer()

    def evaluate(self, version: int) -> EvalReport:
        """Load exactly `version` from the store into the engine and evaluate it on the held-out tasks.

        UntrustedWeightsError (nothing loaded) unless the run's trainer key signed `version`;
        IntegrityError (nothing sampled) unless the engine proves it computes with exactly that version,
        as a worker does before it generates (`pnyx.rollout.engines.base`)."""
        digest = self.load(version)
        report = evaluate_model(
            self.engine,
            self.env,
            self.tasks,
            samples=self.samples,
            seed=self.seed,
            ks=self.ks,
            **self.sampling,
        )
        report.version = version
        report.digest = digest
        return report

    def load(self, version: int) -> str:
        """Load exactly `version` into the engine (see `evaluate`); returns the chain digest it proved."""
        self.weights.manifest(version)  # refuses a version the trainer did not sign, before any download
        got, _ = self.syncer.sync(to_version=version)
        if got != version:
            raise ConfigError(f"asked to evaluate version {version} but the store served version {got}")
        proof = self.engine.update(version, self.syncer.state, self.syncer.manifest)
        if proof.chain_digest != self.syncer.digest:
            raise IntegrityError(
                f"v{version}: the {self.engine.name} engine proved {proof.chain_digest}, the syncer holds "
                f"{self.syncer.digest}; refusing to evaluate"
            )
        return proof.chain_digest

    def close(self) -> None:
        """Release what the engine holds (a vLLM engine's processes, for one)."""
        self.engine.close()


class EvalLoop:
    """Evaluates published versions one at a time in a daemon thread; errors re-raise in the main loop.

    Which versions: 0, every `every` versions (skipping ahead when evaluation is slower than training:
    only the newest due version is evaluated), and whatever `final()` asks for at the end. A version the
    run's trainer key did not sign is never evaluated: its UntrustedWeightsError re-raises in `check()`.
    """

    def __init__(
        self,
        make_evaluator: Callable[[], VersionEvaluator],
        records_path: str | Path,
        env_name: str,
        every: int,
        observed: dict[int, float],
        t0: float,
        publish: Callable[[int, dict[str, Any]], None] | None = None,
    ):
        """`make_evaluator` builds the evaluator on first use (in the eval thread: model loading is slow);
        records are appended to `records_path` (JSON lines) and handed to `publish`; `observed[v]` is when
        version v was first seen (its record's `elapsed_s` counts from `t0`)."""
        self.make_evaluator, self.records_path, self.publish = make_evaluator, Path(records_path), publish
        self.every, self.observed, self.t0 = every, observed, t0
        self.records: list[dict[str, Any]] = [
            r for r in read_eval_file(self.records_path) if r.get("env") == env_name
        ]
        self._evaluator: VersionEvaluator | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    @property
    def done_versions(self) -> set[int]:
        return {int(r["version"]) for r in self.records if r.get("version") is not None}

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def check(self) -> None:
        """Re-raise an evaluation error in the caller's thread."""
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def due(self, latest: int | None) -> int | None:
        """The version to evaluate next, or None."""
        if latest is None:
            return None
        done = self.done_versions
        if 0 not in done:
            return 0
        if self.every <= 0:
            return None
        target = latest - latest % self.every
        return target if target > 0 and target not in done else None

    def maybe_start(self, latest: int | None) -> None:
        if self.busy:
            return
        v = self.due(latest)
        if v is not None:
            self._thread = threading.Thread(target=self._run, args=(v,), name=f"eval-v{v}", daemon=True)
            self._thread.start()

    def final(self, version: int, threads: int) -> dict[str, Any] | None:
        """Evaluate `version` now (in this thread, with `threads` torch threads) unless already done."""
        self.join()
        self.check()
        if version in self.done_versions:
            return next(r for r in reversed(self.records) if r.get("version") == version)
        import torch

        torch.set_num_threads(threads)
        self._run(version)
        self.check()
        return next((r for r in reversed(self.records) if r.get("version") == version), None)

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self, version: int) -> None:
        try:
            if self._evaluator is None:
                self._evaluator = self.make_evaluator()
            report = self._evaluator.evaluate(version)
            record = report.to_dict()
            published = self.observed.get(version)
            record["elapsed_s"] = round((published if published is not None else time.time()) - self.t0, 2)
            with self._lock:
                self.records.append(record)
                with open(self.records_path, "a") as fh:
                    fh.write(json.dumps(record) + "\n")
            if self.publish is not None:
                self.publish(version, record)
        except BaseException as e:  # noqa: BLE001 - handed to the main loop, which re-raises it
            self._error = e
