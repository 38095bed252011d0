"""`verifiers` environments as pnyx environments: `--env.name=verifiers:<module | path.py>[:attr]`.

`env.py` is the adapter (`VerifiersEnv`, a pnyx `Environment`); `classic.py` and `v1.py` are the two
verifiers APIs behind it; `protocol.py` is the text of tool calls and replies. pnyx generates, verifiers
supplies rows, tool replies and rewards, and the trainer re-scores every completion from its task id and
text (docs/environments.md, "verifiers environments"). Importing this package does not import verifiers.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from pnyx.envs.verifiers.env import INSTALL_HINT, PREFIX, VerifiersEnv
from pnyx.envs.verifiers.protocol import AdapterOptions


def factory(target: str) -> Callable[..., VerifiersEnv]:
    """What `get_factory("verifiers:<target>")` returns: `factory(target)(pnyx=..., **env_args)`."""
    return partial(VerifiersEnv, target)


__all__ = ["INSTALL_HINT", "PREFIX", "AdapterOptions", "VerifiersEnv", "factory"]
