"""Lazy package exports: a package names its public surface, and each name is imported on first use.

Knows nothing about what the names are. Invariant: importing a package that uses it imports none of the
listed modules (so `import pnyx.models` stays free of torch and transformers); an unknown name raises
`AttributeError` exactly as a missing attribute would.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, tuple[str, ...]]) -> Callable[[str], Any]:
    """A module-level `__getattr__` for `package` that imports `exports[module]` names from their module
    on first access. `exports` maps a module path to the names it provides."""
    where = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__


def export_names(exports: dict[str, tuple[str, ...]]) -> list[str]:
    """The sorted public names of an export table (a package's `__all__`)."""
    return sorted(name for names in exports.values() for name in names)
