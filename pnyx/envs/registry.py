"""The environment registry: built-ins by name, plus any package's entry points in group `pnyx.envs`.

A user's package adds an environment by declaring, in its pyproject.toml,

    [project.entry-points."pnyx.envs"]
    myenv = "mypkg.envs:MyEnv"          # an Environment subclass, or any callable returning one

Knows nothing about any particular environment: built-ins are listed as import paths and imported only
when asked for, so `pnyx envs list` stays cheap. A built-in name wins over an entry point of the same name.
`get_env` hands the options every environment has (`system_prompt`, `format_reward`) to
`Environment.configure` and the rest to the environment's constructor. A name `verifiers:<target>` is
not listed: it loads that `verifiers` environment (imported only then).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from pnyx.envs.base import BASE_OPTIONS, Environment
from pnyx.errors import ConfigError, EnvironmentNotFound, EnvOptionsError

ENTRY_POINT_GROUP = "pnyx.envs"
VERIFIERS_PREFIX = "verifiers:"
"""A name `verifiers:<target>` loads a `verifiers` environment (`pnyx.envs.verifiers`)."""

BUILTINS: dict[str, str] = {
    "arith": "pnyx.envs.arith:ArithEnv",
    "countdown": "pnyx.envs.countdown:CountdownEnv",
    "gsm8k": "pnyx.envs.gsm8k:Gsm8kEnv",
    "qa": "pnyx.envs.qa:QAEnv",
    "searchqa": "pnyx.envs.searchqa:SearchQAEnv",
    "reasoning_gym": "pnyx.envs.rgym:ReasoningGymEnv",
}

_registered: dict[str, Callable[..., Environment]] = {}


def register(name: str, factory: Callable[..., Environment]) -> None:
    """Register an environment factory under `name` in this process (tests, notebooks, plugins)."""
    if not name or "/" in name:
        raise ConfigError(f"invalid environment name {name!r}: use a non-empty name without '/'")
    _registered[name] = factory


def _entry_points() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def list_envs() -> list[str]:
    """Every environment name that `get_env` can build: built-ins, registered, and entry points."""
    return sorted(set(BUILTINS) | set(_registered) | set(_entry_points()))


def _load(target: str) -> Callable[..., Environment]:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def get_factory(name: str) -> Callable[..., Environment]:
    """The class (or factory) registered under `name`, without building it. `verifiers:<module | path.py>`
    names a `verifiers` environment (`pnyx.envs.verifiers`)."""
    if name.startswith(VERIFIERS_PREFIX):
        target = name[len(VERIFIERS_PREFIX) :]
        if not target:
            raise ConfigError("verifiers: needs a target: --env.name=verifiers:<module or path.py>[:attr]")
        from pnyx.envs.verifiers import factory

        return factory(target)
    if name in BUILTINS:
        return _load(BUILTINS[name])
    if name in _registered:
        return _registered[name]
    eps = _entry_points()
    if name in eps:
        return eps[name].load()
    raise EnvironmentNotFound(
        f"no environment named {name!r}; available: {', '.join(list_envs())}. A package adds one with an "
        f"entry point in group {ENTRY_POINT_GROUP!r}."
    )


def get_env(name: str, **kwargs: Any) -> Environment:
    """Build the environment registered under `name` with its keyword configuration.

    `system_prompt` and `format_reward` go to `Environment.configure` (every environment has them); the
    other keywords go to the environment's constructor, and one it does not take is a `ConfigError`.
    """
    factory = get_factory(name)
    base = {k: kwargs.pop(k) for k in BASE_OPTIONS if k in kwargs}
    _check_options(name, factory, kwargs)
    env = factory(**kwargs)
    if not isinstance(env, Environment):
        raise ConfigError(
            f"environment {name!r} built a {type(env).__name__}, not a pnyx.envs.Environment subclass"
        )
    return env.configure(**base)


def _check_options(name: str, factory: Callable[..., Environment], kwargs: dict[str, Any]) -> None:
    """Refuse options the environment's constructor does not take, naming the ones it does."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or C callable without a signature: let the call decide
        return
    try:
        signature.bind(**kwargs)
    except TypeError as e:
        accepted = [p for p in signature.parameters if p not in ("self", "args", "kwargs")]
        raise EnvOptionsError(
            f"environment {name!r} does not take these options ({e}); its options: "
            f"{', '.join([*accepted, *BASE_OPTIONS])}"
        ) from None
