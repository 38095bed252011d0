"""Which BLAS libmlx binds `cblas_sgemm` to on Linux (pnyx.rollout.engines.mlx_blas).

The dynamic linker says itself what it bound: each test starts a fresh interpreter with
`LD_DEBUG=bindings`, imports pnyx's MLX engine, multiplies once, and reads the binding line for libmlx's
`cblas_sgemm`.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from pnyx.rollout.engines.mlx_blas import SYSTEM_CANDIDATES

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None, reason="needs pnyx[mlx]"),
    pytest.mark.skipif(
        platform.system() != "Linux", reason="the bundled reference BLAS is mlx-cpu's (Linux)"
    ),
]
SYSTEM_OPENBLAS = next((p for p in SYSTEM_CANDIDATES if Path(p).is_file()), None)
needs_openblas = pytest.mark.skipif(
    SYSTEM_OPENBLAS is None, reason="no system OpenBLAS (apt-get install libopenblas0-pthread)"
)
PROBE = (
    "import pnyx.rollout.engines.mlx as m, mlx.core as mx; "
    "print((mx.ones((4, 4)) @ mx.ones((4, 4))).sum().item())"
)


def sgemm_binding(tmp_path: Path, choice: str | None) -> str:
    """The linker's line binding libmlx's cblas_sgemm, in a fresh process with PNYX_MLX_BLAS=`choice`."""
    env = {k: v for k, v in os.environ.items() if k != "PNYX_MLX_BLAS"}
    if choice is not None:
        env["PNYX_MLX_BLAS"] = choice
    env |= {"LD_DEBUG": "bindings", "LD_DEBUG_OUTPUT": str(tmp_path / "ld")}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "64.0"  # the product is right whichever library computed it
    lines = [
        line
        for f in tmp_path.glob("ld.*")
        for line in f.read_text(errors="replace").splitlines()
        if "libmlx" in line and "`cblas_sgemm'" in line
    ]
    assert len(lines) == 1, lines
    return lines[0]


@needs_openblas
def test_mlx_multiplies_with_the_system_openblas_when_there_is_one(tmp_path):
    line = sgemm_binding(tmp_path, None)
    assert f"to {SYSTEM_OPENBLAS} " in line
    assert "mlx_cpu.libs" not in line


def test_bundled_keeps_mlx_s_own_reference_blas(tmp_path):
    line = sgemm_binding(tmp_path, "bundled")
    assert "mlx_cpu.libs/libblas" in line


@needs_openblas
def test_an_explicit_library_path_is_the_one_bound(tmp_path):
    assert SYSTEM_OPENBLAS is not None
    real = str(Path(SYSTEM_OPENBLAS).resolve())  # another spelling of the same library, chosen by path
    line = sgemm_binding(tmp_path, real)
    assert f"to {real} " in line


def test_a_missing_library_is_a_config_error(monkeypatch):
    from pnyx.errors import ConfigError
    from pnyx.rollout.engines.mlx_blas import find_fast_blas

    monkeypatch.setenv("PNYX_MLX_BLAS", "/nonexistent/libblas.so")
    with pytest.raises(ConfigError, match="no such file"):
        find_fast_blas()
