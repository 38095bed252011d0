"""`pnyx eval`: held-out evaluation of a model folder or of a published version of a run.

Two sources: `--model DIR` (default: the shipped tiny model) evaluates a local folder; `--store URL` evaluates
a published version of that run (default: the newest the trainer signed), loading the run's base model named
in its run.json and syncing the weights through the verified chain. Only versions signed by run.json's trainer
key (or the `--trust` fingerprint) are read (`pnyx.weights.TrustedWeights`): a forged, unsigned or junk
manifest is ignored with a warning naming it, `--version N` of a version the trainer did not sign exits 1
("refusing to evaluate"), and an unsigned run is refused (exit 2). Settings come from the run (or from the
config defaults and a `--config` TOML), then dotted overrides (`--worker.temperature=0.7`), then the flags
`--env`, `--max-new-tokens`, `--temperature`, `--top-p`, `--top-k`. `--engine torch|mlx|vllm` samples with
that engine of `pnyx.rollout.engines` (the workers' own); a published version is loaded into it and proved
against its manifest before it samples, as a worker does. Prints a table and optionally writes the figures
as JSON (`--out`). Knows nothing about the fleet's processes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from pnyx.config import PnyxConfig
    from pnyx.eval.runner import EvalReport


def _run_config(store_url: str, extra: list[str], trust: str | None) -> tuple[Any, Any]:
    """(the run's `TrustedWeights`, config): run.json's config with the command line's dotted overrides on
    top. ConfigError for a store without run.json, an unsigned run, or a key other than `trust`."""
    from pnyx.config import config_from_dict, parse_overrides
    from pnyx.config import merge_dicts as merge_config
    from pnyx.protocol import layout
    from pnyx.store import open_store
    from pnyx.weights import TrustedWeights

    weights = TrustedWeights.open(open_store(store_url), trust)
    data = weights.run.config or {}
    if extra:
        data = merge_config(data, parse_overrides(extra))
    return weights, config_from_dict(data, source=f"{layout.RUN_MANIFEST} + command-line overrides")


def print_report(report: EvalReport, title: str) -> None:
    """A rich table of one `EvalReport`."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title, show_header=False)
    t.add_column(style="bold")
    t.add_column()
    t.add_row("environment", report.env)
    t.add_row("version", "-" if report.version is None else str(report.version))
    t.add_row("engine", report.engine or "-")
    t.add_row("tasks × samples", f"{report.tasks} × {report.samples}")
    t.add_row("pass@1 (95% CI)", f"{report.pass_at_1:.3f}  [{report.ci_low:.3f}, {report.ci_high:.3f}]")
    for k, v in sorted(report.pass_at_k.items()):
        t.add_row(f"pass@{k}", f"{v:.3f}")
    t.add_row("format rate", f"{report.format_rate:.3f}")
    if report.search_rate is not None:
        t.add_row("search rate", f"{report.search_rate:.3f}")
        for label, value in (
            ("pass when searched", report.correct_when_searched),
            ("pass without search", report.correct_without_search),
        ):
            t.add_row(label, "-" if value is None else f"{value:.3f}")
    t.add_row("mean completion tokens", f"{report.mean_completion_tokens:.1f}")
    if report.max_new_tokens is not None:
        t.add_row("max new tokens per turn", str(report.max_new_tokens))
    t.add_row("seconds", f"{report.seconds:.1f}")
    Console().print(t)


def _sampling(cfg: PnyxConfig, flags: dict[str, Any]) -> dict[str, Any]:
    """Sampling settings: each flag given on the command line, else the config's `worker` value."""
    w = cfg.worker
    defaults = {
        "temperature": w.temperature,
        "top_p": w.top_p,
        "top_k": w.top_k,
        "max_new_tokens": w.max_new_tokens,
    }
    return {k: flags[k] if flags.get(k) is not None else v for k, v in defaults.items()}


def _switch_env(cfg: PnyxConfig, env: str | None) -> PnyxConfig:
    """`cfg` pointed at environment `env`; the config's env options belong to its own env, so they are
    dropped (with a note) when `env` is another one."""
    import typer

    from pnyx.config import with_fields

    if env is None or env == cfg.env.name:
        return cfg
    if cfg.env.kwargs or cfg.env.system_prompt is not None:
        typer.secho(
            f"pnyx: note: --env {env} is not the config's environment ({cfg.env.name}); its env.kwargs and "
            "env.system_prompt are not used (set them with --env.kwargs=... / --env.system_prompt=...)",
            fg=typer.colors.YELLOW,
            err=True,
        )
    return with_fields(cfg, {"env.name": env, "env.kwargs": {}, "env.system_prompt": None})


def eval_main(
    model: str | None,
    store: str | None,
    version: int | None,
    env: str | None,
    tasks: int,
    samples: int,
    out: Path | None,
    extra: list[str],
    config: Path | None = None,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    trust: str | None = None,
    engine: str = "torch",
    device: str | None = None,
) -> None:
    """Evaluate a model folder (`model`) or a run's published `version` (`store`) on the held-out split.

    Settings, lowest to highest priority: the config defaults, the `--config` TOML (model folder only) or
    the run's run.json (`--store`), dotted overrides, then the flags (`--env`, `--max-new-tokens`, ...). An
    unset budget is the environment's own. `engine` samples (`pnyx.rollout.engines.make_engine`) on
    `device` (None: the config's `model.device` for a folder, cpu for a run's version, which is loaded in
    float32 as `pnyx run`'s evaluator does).
    """

    from pnyx.cli.common import fail
    from pnyx.config import load_config, resolve_env_kwargs, with_fields
    from pnyx.errors import ConfigError, PnyxError, UntrustedWeightsError
    from pnyx.eval.runner import VersionEvaluator, evaluate_model, heldout_tasks, quiet_transformers
    from pnyx.models.source import resolve_model_path
    from pnyx.rollout.engines import ENGINE_NAMES, EngineName, check_engine, make_engine

    if model is not None and store is not None:
        raise fail("give either --model (a folder) or --store (a run), not both")
    if version is not None and store is None:
        raise fail("--version needs --store (a version is a published state of a run)")
    if trust is not None and store is None:
        raise fail("--trust needs --store (it pins the trainer key of a run's published weights)")
    if config is not None and store is not None:
        raise fail(
            "--config applies to a model folder; a run's settings come from its run.json. Drop --config, or "
            "change single settings with flags (--max-new-tokens, --temperature) or dotted overrides"
        )
    if engine not in ENGINE_NAMES:
        raise fail(f"unknown engine {engine!r}: choose one of {', '.join(ENGINE_NAMES)}")
    engine_name = cast(EngineName, engine)
    flags = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k}
    ks = tuple(k for k in (2, 4, 8, 16) if k <= samples)
    try:
        if store is not None:
            weights, cfg = _run_config(store, extra, trust)
            cfg = _switch_env(cfg, env)
            from pnyx.models import resolve_run_model

            run_store = weights.store
            target = weights.resolve(version)  # UntrustedWeightsError before the model is even loaded
            if target is None:
                raise fail(
                    f"{run_store.url} has no published weights signed by the trainer key "
                    f"{weights.fingerprint} yet"
                )
            check_engine(engine_name, device or "cpu")  # before the model loads
            quiet_transformers()
            info = weights.run.model or {}  # the run's own model (a hub id at the trainer's commit)
            source = resolve_run_model(info, cfg.model.path, cfg.model.revision, check="tokenizer")
            evaluator = VersionEvaluator(
                weights,
                source,
                cfg.env.name,
                resolve_env_kwargs(cfg),
                tasks=tasks,
                samples=samples,
                seed=cfg.run.seed,
                ks=ks,
                engine=engine_name,
                device=device or "cpu",
                **_sampling(cfg, flags),
            )
            try:
                report = evaluator.evaluate(target)
            finally:
                evaluator.close()
            title = f"pnyx eval — {run_store.url} v{target} ({engine_name})"
        else:
            from pnyx.envs import get_env
            from pnyx.models import load_tokenizer

            cfg = load_config(config, extra)
            if model is not None:
                cfg = with_fields(cfg, {"model.path": model})
            cfg = _switch_env(cfg, env)
            where = device or cfg.model.device
            check_engine(engine_name, where)  # before the model loads
            path = resolve_model_path(cfg)
            environment = get_env(cfg.env.name, **resolve_env_kwargs(cfg))
            quiet_transformers()
            sampler = make_engine(
                engine_name, path, load_tokenizer(path), dtype=cfg.model.dtype, device=where
            )  # the folder's own weights, as its owner made them: nothing published to prove them against
            try:
                report = evaluate_model(
                    sampler,
                    environment,
                    heldout_tasks(environment, tasks, cfg.run.seed),
                    samples=samples,
                    seed=cfg.run.seed,
                    ks=ks,
                    **_sampling(cfg, flags),
                )
            finally:
                sampler.close()
            title = f"pnyx eval — {cfg.model.path or path} ({engine_name})"
    except ConfigError as e:
        raise fail(str(e)) from None
    except UntrustedWeightsError as e:
        raise fail(f"refusing to evaluate: {e}", code=1) from None
    except PnyxError as e:
        raise fail(f"evaluation failed: {e}", code=1) from None
    print_report(report, title)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
