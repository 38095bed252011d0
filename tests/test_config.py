"""Config: layering, bounds with field-naming errors, every example TOML parses, the CLI's dry run."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from pnyx.config import (
    PnyxConfig,
    config_from_dict,
    load_config,
    overlay_changed,
    parse_overrides,
    to_toml,
    with_fields,
)
from pnyx.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.toml"))


def test_examples_exist():
    assert len(EXAMPLES) >= 3


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_toml_parses(path):
    cfg = load_config(path)
    assert isinstance(cfg, PnyxConfig)


def test_layering_defaults_then_file_then_flags(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[trainer]\nlr = 0.001\ngroups_per_step = 4\n[env]\nname = "countdown"\n')
    cfg = load_config(f, ["--trainer.lr=0.01", "--worker.group_size", "4"])
    assert cfg.trainer.lr == 0.01  # flag beats file
    assert cfg.trainer.groups_per_step == 4  # file beats default
    assert cfg.env.name == "countdown"
    assert cfg.worker.group_size == 4
    assert cfg.algorithm.max_staleness == PnyxConfig().algorithm.max_staleness  # default kept


def test_bad_value_names_field_and_bound():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--trainer.lr=-1"])
    assert "trainer.lr" in str(e.value) and "greater than 0" in str(e.value)


def test_out_of_range_int_names_the_bound(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[worker]\ngroup_size = 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert "worker.group_size" in str(e.value) and "greater than or equal to 2" in str(e.value)


def test_unknown_field_is_rejected():
    with pytest.raises(ConfigError, match="trainer.lrr"):
        load_config(None, ["--trainer.lrr=1"])


def test_bad_toml_is_a_config_error(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[trainer\nlr=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(f)


def test_override_values_parse_as_literals():
    assert parse_overrides(["--a.b=1e-4", "--a.c=true", "--a.d=null", "--a.e=text"]) == {
        "a": {"b": 1e-4, "c": True, "d": None, "e": "text"}
    }
    with pytest.raises(ConfigError, match="section.field"):
        parse_overrides(["lr=1"])


def test_resolved_config_round_trips_through_toml(tmp_path):
    cfg = load_config(None, ["--env.name=searchqa", '--env.kwargs={"top_k": 2}'])
    f = tmp_path / "resolved.toml"
    f.write_text(to_toml(cfg))
    again = load_config(f)
    assert again == cfg
    assert again.env.kwargs == {"top_k": 2}


def test_every_field_has_a_docstring():
    def walk(model):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no docstring"
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, PnyxConfig.__mro__[1]):
                walk(ann)

    walk(PnyxConfig)


def test_resume_overlay_takes_a_field_given_back_at_its_default_value():
    stored = load_config(None, ["--run.steps=40", "--trainer.lr=0.001"])
    default_lr = PnyxConfig().trainer.lr
    given = load_config(None, [f"--trainer.lr={default_lr}"])  # `pnyx run --resume --trainer.lr=<default>`
    merged = overlay_changed(stored, given)
    assert merged.trainer.lr == default_lr and merged.run.steps == 40


def test_resume_overlay_takes_a_field_set_on_a_default_section():
    stored = load_config(None, ["--store.url=/old", "--run.steps=40"])
    given = with_fields(PnyxConfig(), {"store.url": "/new"})  # as `--store` does on the command line
    merged = overlay_changed(stored, given)
    assert merged.store.url == "/new" and merged.run.steps == 40


def test_the_loaded_config_is_immutable_and_with_fields_makes_a_validated_copy():
    cfg = load_config(None, ["--env.kwargs.digits=2"])
    with pytest.raises(ValidationError, match="frozen"):
        cfg.trainer.lr = 1e-3  # type: ignore[misc]
    other = with_fields(cfg, {"trainer.lr": 1e-3, "env.kwargs": {}})
    assert other.trainer.lr == 1e-3 and other.env.kwargs == {} and cfg.env.kwargs == {"digits": 2}
    with pytest.raises(ConfigError, match="lr"):
        with_fields(cfg, {"trainer.lr": -1.0})


def test_checks_set_under_trainer_move_to_security_with_a_warning(caplog):
    cfg = load_config(None, ["--trainer.plausibility_z=6", "--trainer.lr=0.001"])
    assert cfg.security.plausibility_z == 6.0 and cfg.trainer.lr == 0.001
    assert "moved from [trainer] to [security]" in caplog.text
    old_run = PnyxConfig().model_dump(mode="json")
    old_run.pop("security")
    old_run["trainer"]["quarantine_min"] = 7  # a run.json written before the security section
    assert config_from_dict(old_run).security.quarantine_min == 7


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_workers_are_refused_under_seeded_draws_before_anything_starts(tmp_path, dtype):
    """A worker computing in half precision would draw tokens the trainer's float32 check of seeded draws
    rejects (bf16 on an H200: 8% of honest groups), and a float16 one cannot hold bf16-published weights,
    so such a run is refused with what to do instead, by `pnyx run` before it makes a folder, by the
    trainer and by a worker joining an older run.json."""
    from pnyx.cli.run_folder import plan_run
    from pnyx.config import check_worker_dtype

    cfg = load_config(overrides=[f"--model.dtype={dtype}"])
    with pytest.raises(ConfigError, match=rf"model.dtype={dtype} with .*float32"):
        check_worker_dtype(cfg)
    with pytest.raises(ConfigError, match=rf"model.dtype={dtype} with"):
        plan_run(cfg, resume=False, root=tmp_path)
    assert list(tmp_path.iterdir()) == []
    unseeded = [f"--model.dtype={dtype}", "--security.seeded_draws=false"]
    if dtype == "bfloat16":
        check_worker_dtype(load_config(overrides=unseeded))
    else:  # float16 cannot hold bf16-published weights, seeded draws or not; fp16 publishing it can
        with pytest.raises(ConfigError, match="cannot hold the published bf16 values"):
            check_worker_dtype(load_config(overrides=unseeded))
        check_worker_dtype(load_config(overrides=[*unseeded, "--trainer.publish_dtype=float16"]))
    check_worker_dtype(load_config())  # float32, the default
