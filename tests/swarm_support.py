"""Helpers for the swarm tests (no tests here): the `swarm_len` test environment, configs, node builders.

A random tiny model never solves arithmetic, so most swarm tests use `swarm_len`, whose verifier rewards
the completion's length modulo 5: random text then gives groups with reward variance, i.e. a GRPO signal.
Importing this module registers it in the importing process; `SITECUSTOMIZE` does the same for node
processes (put on their PYTHONPATH).
"""

from __future__ import annotations

from typing import Any

from pnyx.config import load_config
from pnyx.envs import register
from pnyx.envs.arith import ArithEnv
from pnyx.envs.base import Score


class LengthEnv(ArithEnv):
    """Arithmetic prompts; reward = (len(text) mod 5) / 4, so random completions disagree."""

    name = "swarm_len"

    def grade(self, task, text):
        return Score(reward=(len(text) % 5) / 4, parts={"correct": 0.0, "format": 0.0})


register("swarm_len", LengthEnv)

SITECUSTOMIZE = """
from pnyx.envs import register
from pnyx.envs.arith import ArithEnv
from pnyx.envs.base import Score


class LengthEnv(ArithEnv):
    name = "swarm_len"

    def grade(self, task, text):
        return Score(reward=(len(text) % 5) / 4, parts={"correct": 0.0, "format": 0.0})


register("swarm_len", LengthEnv)
"""


def swarm_cfg(env: str = "swarm_len", **swarm: Any):
    """A small node config: G=4, 10 new tokens, I=2/J=2 unless overridden by `swarm`."""
    sw = {"local_groups": 2, "external_groups": 2, "max_per_peer": 4} | swarm
    return load_config(
        overrides={
            "env": {"name": env, "kwargs": {"digits": 1}},
            "worker": {"group_size": 4, "max_new_tokens": 10},
            "swarm": sw,
        }
    )


def open_test_node(store: Any, name: str, cfg: Any, model_dir: Any, **kwargs: Any):
    from pnyx.swarm.node import open_node

    return open_node(store, name, cfg, model_dir, **kwargs)
