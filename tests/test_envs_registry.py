"""The environment registry: built-ins by name, in-process registration, and the `pnyx.envs` entry point."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from pnyx.envs import ENTRY_POINT_GROUP, Environment, get_env, list_envs, register
from pnyx.errors import ConfigError, EnvironmentNotFound

ENVPKG = Path(__file__).parent / "fixtures" / "envpkg"


def _install_dist_info(site: Path) -> None:
    """Install tests/fixtures/envpkg the way pip would for the metadata: a *.dist-info folder on sys.path
    whose entry_points.txt is the package's declared entry point (the code itself is on sys.path too)."""
    dist = site / "pnyx_envpkg-0.1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: pnyx-envpkg\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\necho_plugin = pnyx_envpkg:EchoEnv\n")


def test_builtins_are_listed():
    assert {"arith", "countdown", "gsm8k", "searchqa", "reasoning_gym"} <= set(list_envs())


def test_unknown_name_raises_environment_not_found_naming_the_alternatives():
    with pytest.raises(EnvironmentNotFound, match="arith"):
        get_env("no_such_env")


def test_entry_point_package_is_found_by_name(tmp_path, monkeypatch):
    assert "echo_plugin" not in list_envs()
    _install_dist_info(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(ENVPKG))
    assert [ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)] == ["echo_plugin"]

    assert "echo_plugin" in list_envs()
    env = get_env("echo_plugin", greeting="Say")
    task = env.sample("train", seed=1, n=1)[0]
    assert task.prompt[0]["content"].startswith("Say ")
    assert env.score(task, env.reference_completion(task)).reward == 1.0
    assert env.task(task.id) == task


@pytest.fixture(autouse=True)
def _isolated_registry(monkeypatch):
    from pnyx.envs import registry

    monkeypatch.setattr(registry, "_registered", {})


def test_registered_factory_must_build_an_environment():
    register("not_an_env_for_test", lambda: object())
    with pytest.raises(ConfigError, match="not a pnyx.envs.Environment"):
        get_env("not_an_env_for_test")


def test_register_in_process_adds_a_name():
    from pnyx.envs.arith import ArithEnv

    register("arith_three_digits_for_test", lambda: ArithEnv(digits=3))
    env = get_env("arith_three_digits_for_test")
    assert isinstance(env, Environment) and env.levels == [3]


def test_bad_kwargs_raise_config_error():
    with pytest.raises(ConfigError, match="digits"):
        get_env("arith", digits=9)
