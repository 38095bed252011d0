"""`pnyx eval`: held-out evaluation of a model folder or of a published version of a run.

Two sources: `--model DIR` (default: the shipped tiny model) evaluates a local folder; `--store URL`
evaluates a published version of that run (default: the newest), loading the run's base model named in
its run.json and syncing the weights through the verified chain. Sampling settings come from the run (or
the config defaults plus dotted overrides such as `--worker.temperature=0.7`). Prints a table and
optionally writes the figures as JSON (`--out`). Knows nothing about the fleet's processes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _run_config(store_url: str, extra: list[str]) -> tuple[Any, Any]:
    """(store, config) of a run: run.json's config with the command line's dotted overrides on top."""
    from pnyx.cli.common import fail
    from pnyx.config import config_from_dict, parse_overrides
    from pnyx.config import merge_dicts as merge_config
    from pnyx.errors import NotFoundError
    from pnyx.protocol import layout
    from pnyx.store import open_store

    store = open_store(store_url)
    try:
        manifest = json.loads(store.get(layout.RUN_MANIFEST))
    except NotFoundError:
        raise fail(f"{store.url} holds no run (no {layout.RUN_MANIFEST}): check the URL") from None
    data = manifest.get("config") or {}
    if extra:
        data = merge_config(data, parse_overrides(extra))
    return store, config_from_dict(data, source=f"{layout.RUN_MANIFEST} + command-line overrides")


def print_report(report: Any, title: str) -> None:
    """A rich table of one `EvalReport`."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title, show_header=False)
    t.add_column(style="bold")
    t.add_column()
    t.add_row("environment", report.env)
    t.add_row("version", "-" if report.version is None else str(report.version))
    t.add_row("tasks × samples", f"{report.tasks} × {report.samples}")
    t.add_row("pass@1 (95% CI)", f"{report.pass_at_1:.3f}  [{report.ci_low:.3f}, {report.ci_high:.3f}]")
    for k, v in sorted(report.pass_at_k.items()):
        t.add_row(f"pass@{k}", f"{v:.3f}")
    t.add_row("format rate", f"{report.format_rate:.3f}")
    if report.search_rate is not None:
        t.add_row("search rate", f"{report.search_rate:.3f}")
    t.add_row("mean completion tokens", f"{report.mean_completion_tokens:.1f}")
    t.add_row("seconds", f"{report.seconds:.1f}")
    Console().print(t)


def eval_main(
    model: str | None,
    store: str | None,
    version: int | None,
    env: str | None,
    tasks: int,
    samples: int,
    out: Path | None,
    extra: list[str],
) -> None:
    """Evaluate a model folder (`model`) or a run's published `version` (`store`) on the held-out split."""
    import torch

    from pnyx.cli.common import fail
    from pnyx.config import load_config, resolve_model_path
    from pnyx.errors import ConfigError, PnyxError
    from pnyx.eval.runner import VersionEvaluator, evaluate_model, heldout_tasks, quiet_transformers

    if model is not None and store is not None:
        raise fail("give either --model (a folder) or --store (a run), not both")
    if version is not None and store is None:
        raise fail("--version needs --store (a version is a published state of a run)")
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    quiet_transformers()
    ks = tuple(k for k in (2, 4, 8, 16) if k <= samples)
    try:
        if store is not None:
            run_store, cfg = _run_config(store, extra)
            if env is not None:
                cfg.env.name = env
            from pnyx.weights import latest_version

            target = latest_version(run_store) if version is None else version
            if target is None:
                raise fail(f"{run_store.url} has no published weights yet")
            from pnyx.models import resolve_run_model
            from pnyx.train.bootstrap import read_run

            info = read_run(run_store).model or {}  # the run's own model (a hub id at the trainer's commit)
            source = resolve_run_model(info, cfg.model.path, cfg.model.revision, check="tokenizer")
            evaluator = VersionEvaluator(
                run_store, source, cfg.env.name, cfg.env.kwargs, tasks=tasks, samples=samples,
                temperature=cfg.worker.temperature, top_p=cfg.worker.top_p, top_k=cfg.worker.top_k,
                max_new_tokens=cfg.worker.max_new_tokens, seed=cfg.run.seed, ks=ks,
            )
            report = evaluator.evaluate(target)
            title = f"pnyx eval — {run_store.url} v{target}"
        else:
            from pnyx.envs import get_env
            from pnyx.models import load_model, load_tokenizer

            cfg = load_config(None, extra)
            if model is not None:
                cfg.model.path = model
            if env is not None:
                cfg.env.name = env
            path = resolve_model_path(cfg)
            environment = get_env(cfg.env.name, **cfg.env.kwargs)
            report = evaluate_model(
                load_model(path, dtype=cfg.model.dtype, device=cfg.model.device), load_tokenizer(path), environment,
                heldout_tasks(environment, tasks, cfg.run.seed), samples=samples,
                temperature=cfg.worker.temperature, top_p=cfg.worker.top_p, top_k=cfg.worker.top_k,
                max_new_tokens=cfg.worker.max_new_tokens, seed=cfg.run.seed, ks=ks,
            )
            title = f"pnyx eval — {cfg.model.path or path}"
    except ConfigError as e:
        raise fail(str(e)) from None
    except PnyxError as e:
        raise fail(f"evaluation failed: {e}", code=1) from None
    print_report(report, title)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
