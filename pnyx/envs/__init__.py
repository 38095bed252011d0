"""The gym: environments that sample tasks and verify completions (see `docs/environments.md`).

Knows nothing about models, tokenizers or the store; never imports torch. Built-ins are imported lazily
by name through `get_env`, so importing this package is cheap.
"""

from pnyx.envs.base import Environment, Prompt, Score, Split, Task, stable_hash
from pnyx.envs.registry import ENTRY_POINT_GROUP, get_env, get_factory, list_envs, register

__all__ = [
    "ENTRY_POINT_GROUP",
    "Environment",
    "Prompt",
    "Score",
    "Split",
    "Task",
    "get_env",
    "get_factory",
    "list_envs",
    "register",
    "stable_hash",
]
