"""Which BLAS mlx's CPU build multiplies with on Linux: an optimized one when the machine has it.

mlx's Linux CPU wheel (`mlx-cpu`) bundles the netlib *reference* BLAS (`mlx_cpu.libs/libblas-*.so.3`), and
every matmul goes through its `cblas_sgemm`: SmolLM2-135M then decodes 13x slower than with the
system's OpenBLAS on this machine (BENCHMARKS.md, "MLX on Linux: which BLAS"). `use_fast_blas` loads an
optimized BLAS into the process's global symbol scope *before* `mlx.core` is first imported; the dynamic
linker then binds libmlx's `cblas_*` symbols to it, because the global scope is searched before a
library's own dependencies. Results are the same
products computed by other kernels (float32 rounding may differ in the last bits, as between any two BLAS
builds); the behaviour logprobs the worker records are those of the kernels it ran, so the trainer's checks
see them as they are.

Which library: `PNYX_MLX_BLAS` (a path to a shared library exporting `cblas_sgemm`, or `bundled` to keep
mlx's own), else the system's OpenBLAS (Debian/Ubuntu: `apt-get install libopenblas0-pthread`), else
mlx's bundled one with a one-time note saying how to get the fast path. macOS: nothing to do (mlx uses
Accelerate and Metal). Importing this module makes the choice (the engine modules import it before
`mlx.core`); `use_fast_blas` is idempotent. Knows nothing about models or pnyx's engines; imports no
ML framework.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
import sys
from pathlib import Path

from pnyx.errors import ConfigError

log = logging.getLogger("pnyx.engine")

ENV = "PNYX_MLX_BLAS"
SYSTEM_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
)

_chosen: str | None = None
_decided = False


def find_fast_blas() -> str | None:
    """The optimized BLAS to load (see the module docstring), or None for mlx's bundled reference BLAS."""
    wanted = os.environ.get(ENV, "").strip()
    if wanted.lower() == "bundled":
        return None
    if wanted:
        if not Path(wanted).is_file():
            raise ConfigError(
                f"{ENV}={wanted!r}: no such file (a shared library exporting cblas_sgemm, or 'bundled')"
            )
        return wanted
    for path in SYSTEM_CANDIDATES:
        if Path(path).is_file():
            return path
    return ctypes.util.find_library("openblas")


def use_fast_blas() -> str | None:
    """Load the BLAS `find_fast_blas` names into the global scope, once, before mlx is imported.

    Returns the library's path, or None where mlx keeps its own (macOS, none found, `bundled`, or mlx was
    imported before this call, when it is too late to choose)."""
    global _chosen, _decided
    if _decided:
        return _chosen
    _decided = True
    if platform.system() != "Linux":
        return None
    path = find_fast_blas()
    if path is None:
        if os.environ.get(ENV, "").strip().lower() != "bundled":
            log.info(
                "mlx on Linux multiplies with its bundled reference BLAS (~13x slower decoding); "
                "apt-get install libopenblas0-pthread, or set %s to an optimized libblas",
                ENV,
            )
        return None
    if "mlx.core" in sys.modules:
        log.warning("mlx was imported before pnyx chose its BLAS; it keeps its bundled reference BLAS")
        return None
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        log.warning("cannot load %s for mlx (%s); mlx keeps its bundled reference BLAS", path, e)
        return None
    _chosen = path
    log.info("mlx multiplies with %s", path)
    return path


use_fast_blas()
