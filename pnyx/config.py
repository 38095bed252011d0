"""The configuration tree: one pydantic model, layered defaults → TOML file → dotted CLI flags.

The tree (`PnyxConfig`) and its sections are defined in `pnyx.config_sections`, where each field is
documented once (the docstring under it) and carries its bounds in its type; this module re-exports them
and holds the layering (`load_config`, `parse_overrides`, `config_from_dict`, the resume overlay) and the
derived values. Nothing rewrites a sibling field; derived values (the default store URL of `pnyx run`, the
shipped model's path) are computed in `resolve_*` functions, in one explicit place. Knows nothing about
models or stores; imports torch only inside `resolve_device`, so importing this module is cheap and
`pnyx --help` stays instant.

The resolved config is written into the run (`run.json`) by the trainer when it creates the run; workers
read sampling settings from there, so a worker needs only the store URL.
"""

from __future__ import annotations

import json
import logging
import tomllib
from pathlib import Path
from typing import Any, cast

from pydantic import BaseModel, ValidationError

from pnyx.config_sections import AlgorithmConfig as AlgorithmConfig
from pnyx.config_sections import EnvConfig as EnvConfig
from pnyx.config_sections import LoraConfig as LoraConfig
from pnyx.config_sections import ModelConfig as ModelConfig
from pnyx.config_sections import PnyxConfig
from pnyx.config_sections import RunConfig as RunConfig
from pnyx.config_sections import SecurityConfig as SecurityConfig
from pnyx.config_sections import StoreConfig as StoreConfig
from pnyx.config_sections import SwarmConfig as SwarmConfig
from pnyx.config_sections import TrainerConfig as TrainerConfig
from pnyx.config_sections import WorkerConfig as WorkerConfig
from pnyx.errors import ConfigError

# --- layering -------------------------------------------------------------------------------------

log = logging.getLogger("pnyx.config")


def _format_error(err: ValidationError, source: str) -> ConfigError:
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "(root)"
        got = e.get("input")
        got_s = f" (got {got!r})" if not isinstance(got, dict) else ""
        lines.append(f"  {field}: {e['msg']}{got_s}")
    return ConfigError(f"invalid configuration from {source}:\n" + "\n".join(lines))


def _parse_value(text: str) -> Any:
    """A CLI value: JSON/TOML-like literals (numbers, true/false, null, lists), else the raw string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        low = text.lower()
        if low in {"true", "false"}:
            return low == "true"
        if low in {"none", "null"}:
            return None
        return text


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """Turn `--trainer.lr=1e-4 --env.name arith` into a nested dict. Unknown shapes raise ConfigError."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(
                f"unexpected argument {arg!r}: config overrides look like --section.field=value "
                "(e.g. --trainer.lr=1e-4)"
            )
        if "=" in arg:
            key, raw = arg[2:].split("=", 1)
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override {arg} has no value")
            key, raw = arg[2:], args[i + 1]
            i += 1
        node = out
        parts = key.replace("-", "_").split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key} conflicts with an earlier override")
        node[parts[-1]] = _parse_value(raw)
        i += 1
    return out


def merge_dicts(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge config dicts (`over` wins); `env.kwargs` is replaced whole, never merged key by key."""
    merged = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(merged.get(k), dict) and k != "kwargs":
            merged[k] = merge_dicts(merged[k], v)
        else:
            merged[k] = v
    return merged


MOVED_TO_SECURITY = tuple(SecurityConfig.model_fields)
"""Settings that were in `[trainer]` before the `[security]` section existed."""


def _moved_to_security(data: dict[str, Any], source: str, warn: bool) -> dict[str, Any]:
    """`data` with `trainer.<check>` settings moved to `security.<check>` (a config written before the
    `security` section: an old run.json, an old run folder's config.toml); where both set one, `security`'s
    wins (a resumed old run with a setting given anew)."""
    trainer = data.get("trainer")
    if not isinstance(trainer, dict) or not any(k in trainer for k in MOVED_TO_SECURITY):
        return data
    moved = {k: v for k, v in trainer.items() if k in MOVED_TO_SECURITY}
    security = dict(data.get("security") or {})
    if warn:
        log.warning(
            "%s: %s moved from [trainer] to [security] (e.g. --security.%s=...); read from there",
            source, ", ".join(sorted(moved)), next(iter(sorted(moved))),
        )  # fmt: skip
    rest = {k: v for k, v in trainer.items() if k not in MOVED_TO_SECURITY}
    return {**data, "trainer": rest, "security": {**moved, **security}}


def load_config(
    path: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None
) -> PnyxConfig:
    """Resolve defaults → TOML file → overrides, validating once at the end; errors name field and bound."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from e
        source = str(p)
    if overrides:
        over = parse_overrides(overrides) if isinstance(overrides, list) else overrides
        data = merge_dicts(data, over)
        source += " + command-line overrides"
    data = _moved_to_security(data, source, warn=True)
    try:
        return PnyxConfig.model_validate(data)
    except ValidationError as e:
        raise _format_error(e, source) from None


def config_from_dict(data: dict[str, Any], source: str = "run.json") -> PnyxConfig:
    """Rebuild a config from its JSON form (as stored in run.json)."""
    data = _moved_to_security(data, source, warn=False)
    try:
        return PnyxConfig.model_validate(data)
    except ValidationError as e:
        raise _format_error(e, source) from None


def given_fields(cfg: BaseModel) -> dict[str, Any]:
    """The fields that were given (in a file, an override or through `with_fields`) as nested JSON values.

    A field counts because it was set, whatever its value: one set back to its default is still given.
    Sections are walked even when the section itself was not set, so a field `with_fields` set on a default
    section counts too.
    """
    out: dict[str, Any] = {}
    for name in type(cfg).model_fields:
        value = getattr(cfg, name)
        if isinstance(value, BaseModel):
            if sub := given_fields(value):
                out[name] = sub
        elif name in cfg.model_fields_set:
            out[name] = cfg.model_dump(mode="json", include={name})[name]
    return out


def with_fields(cfg: PnyxConfig, values: dict[str, Any]) -> PnyxConfig:
    """A copy of `cfg` with the dotted fields of `values` set (`{"store.url": ...}`), validated; they count
    as given (`given_fields`), as do the fields `cfg` was given. The loaded config is immutable: this is how
    a command fills in what it decides (a store URL, a run name)."""
    data = given_fields(cfg)
    for dotted, value in values.items():
        node = data
        *path, name = dotted.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[name] = value  # the value as a whole: a dict given here replaces, it does not merge
    return config_from_dict(data, source=f"setting {', '.join(values)}")


def overlay_changed(base: PnyxConfig | dict[str, Any], given: PnyxConfig) -> PnyxConfig:
    """`base` (a stored run's config) with every field that `given` sets laid on top.

    Resume semantics: the stored config wins, except where this command line or file gave a value (a
    larger step budget, say). A value given explicitly always wins, even when it equals the default.
    """
    data = base.model_dump(mode="json") if isinstance(base, PnyxConfig) else base
    return config_from_dict(
        merge_dicts(data, given_fields(given)), source="stored config + command-line overrides"
    )


def to_toml(cfg: PnyxConfig) -> str:
    """The resolved config as TOML (None values omitted, since TOML has no null)."""
    import tomli_w

    def drop_none(d: object) -> object:
        if isinstance(d, dict):
            return {k: drop_none(v) for k, v in d.items() if v is not None}
        if isinstance(d, tuple | list):
            return [drop_none(v) for v in d]
        return d

    return tomli_w.dumps(cast(dict[str, object], drop_none(cfg.model_dump(mode="json"))))


# --- derived values, computed in one place ----------------------------------------------------------


def shipped_model_path() -> Path:
    """The tiny base model that ships inside the package."""
    return Path(__file__).parent / "assets" / "tiny-base"


def resolve_env_kwargs(cfg: PnyxConfig) -> dict[str, Any]:
    """The keyword configuration of the run's environment: `env.kwargs` plus `env.system_prompt` when set.

    Every process builds the environment from this (`get_env(cfg.env.name, **resolve_env_kwargs(cfg))`), so
    workers, the trainer, evaluation and swarm peers render the same prompts.
    """
    kwargs = dict(cfg.env.kwargs)
    system = cfg.env.system_prompt
    if system is not None:
        if "system_prompt" in kwargs and kwargs["system_prompt"] != system:
            raise ConfigError(
                "env.system_prompt and env.kwargs.system_prompt disagree: set the system prompt in one place"
            )
        kwargs["system_prompt"] = system
    return kwargs


def resolve_max_new_tokens(configured: int | None, env: object) -> int:
    """The generation budget per turn: the configured `worker.max_new_tokens`, else the environment's own
    (`env.max_new_tokens`). The trainer stores the result in run.json, so workers and the trainer's
    Dr.GRPO normaliser use one number."""
    if configured is not None:
        return int(configured)
    budget = getattr(env, "max_new_tokens", None)
    if not isinstance(budget, int) or budget < 1:
        raise ConfigError(
            f"environment {getattr(env, 'name', env)!r} declares no generation budget (max_new_tokens); "
            "set worker.max_new_tokens"
        )
    return budget


def check_worker_dtype(cfg: PnyxConfig) -> None:
    """Refuse a run whose workers would compute in a precision that fails their checks, before it starts.

    - float16 workers under bf16 publishing: a float16 engine cannot hold bf16 values exactly (fewer
      exponent bits), so its weight proof fails and it never generates (seen on an H200).
    - committed draws without seeded draws (nothing to commit to).
    - half precision under seeded draws (`security.seeded_draws`): the trainer checks every seeded token
      under the published weights in float32, and a bfloat16 worker draws another token often enough that
      the check drops its honest groups: on an H200 with the tiny model, 31 of 384 (8%) at
      `draw_tolerance` 1e-3, 12 (3%) at 1e-2; float32 workers on the same GPU: 0, every distance exactly 0
      (BENCHMARKS.md, "Seeded draws", "On a GPU worker")."""
    if cfg.model.dtype == "float16" and cfg.trainer.publish_dtype == "bfloat16":
        raise ConfigError(
            "model.dtype=float16 with trainer.publish_dtype=bfloat16: a float16 engine cannot hold the "
            "published bf16 values exactly, so no worker could prove its weights. Use model.dtype = "
            '"float32" (the default)'
        )
    if cfg.security.seeded_draws and cfg.model.dtype != "float32":
        raise ConfigError(
            f"model.dtype={cfg.model.dtype} with security.seeded_draws: workers would draw tokens in "
            f"{cfg.model.dtype}, and the trainer's float32 check of every seeded token drops a share of their "
            'honest groups (bfloat16 on an H200: 8% at draw_tolerance 1e-3). Keep model.dtype = "float32" '
            "(the default; the trainer's compute precision is trainer.compute_dtype), or set "
            "security.seeded_draws = false (the statistical checks alone)"
        )
    if cfg.security.standing_groups and not cfg.security.committed_draws:
        raise ConfigError(
            "security.standing_groups needs security.committed_draws: a name's first seqs are known from the "
            "trainer's ticks"
        )
    if cfg.security.committed_draws and not cfg.security.seeded_draws:
        raise ConfigError(
            "security.committed_draws needs security.seeded_draws: a commitment binds the seed of a group's "
            "draws, and without seeded draws no token is checked against one"
        )


def resolve_device(device: str) -> str:
    """Map 'auto' to the best available device; anything else is passed through to torch."""
    if device != "auto":
        return device
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"
