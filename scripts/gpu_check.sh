#!/usr/bin/env bash
# Every GPU check of this repository in one run, for a session lent a CUDA machine (15 minutes of device time
# in all): the `gpu`-marked tests, the engine contract on CUDA (the LoRA adapter included), then the GPU
# benchmarks: engine vs transformers `generate` and trainer tokens/s + MFU on a Qwen2.5-0.5B-shaped model,
# checkpoint blocking sync vs async, publish times, and seeded draws sampled on CUDA in each dtype against
# the trainer's exact check on the CPU. Each step has its own time limit and log under $OUT; a failing step
# does not stop the next. Order: what matters most first.
#
#   bash scripts/gpu_check.sh                       # logs to ./gpu-out, or to $OUT when set
#
# What it needs beside the repo, prepared on a CPU machine (both ignored by git, carried to the device):
#   .whl/           pnyx's dependencies the device image lacks (seen 2026-12-04: torch 2.11, transformers 5.17,
#                   no pydantic), as cp312 manylinux wheels of the versions installed here: obstore msgspec
#                   zstandard bm25s math-verify latex2sympy2_extended antlr4-python3-runtime tomli_w
#                   cryptography cffi pycparser pydantic pydantic-core annotated-types typing-inspection
#                   typing-extensions, fetched with `pip download --no-deps --only-binary=:all:
#                   --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64 ...` (17 MB)
#   .gpu/drawtiny/  run.json and weights/ of a tiny run that kept its versions:
#                   pnyx run --run.name drawtiny --run.steps 32 --run.eval_every 0 --trainer.keep_anchors 1000
# Not here: vLLM on CUDA (the device image has no vllm and its wheel is larger than what can be carried),
# FSDP2 over NCCL (needs 2 GPUs; tests/test_train_gpu.py skips it on one), SmolLM2 (its GGUF, 94 MiB, is
# larger than what can be carried).
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing the carried wheels failed"; exit 1; }
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi

step() {  # step NAME LIMIT_S COMMAND...: run COMMAND with a time limit, its output in $OUT/NAME.log
  local name=$1 limit=$2 start rc
  shift 2
  echo "== $name (limit ${limit}s): $*"
  start=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "== $name: rc=$rc in $(($(date +%s) - start))s"
  grep -v -E "Loading weights|it/s\]" "$OUT/$name.log" | tail -n "${TAIL:-18}"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"

step tests 180 python3 -m pytest -o addopts="" -q -p no:cacheprovider -m gpu -rs -s --durations 5 \
  tests/test_gpu.py tests/test_train_gpu.py tests/test_train_step.py tests/test_engine.py tests/test_draws_gpu.py
DRAWS=(python3 benchmarks/bench_draw_check.py --run .gpu/drawtiny --engines torch --versions 10,25 --groups 48 --threads 4 --device cuda)
[ -d .gpu/drawtiny ] && step draws_bf16 70 "${DRAWS[@]}" --dtype bfloat16
step bench_gpu 110 python3 benchmarks/bench_gpu.py --skip-train
step bench_trainer 180 python3 benchmarks/bench_trainer.py --repeats 2 --workdir /tmp
step contract 70 env PNYX_TEST_ENGINE_DEVICE=cuda python3 -m pytest -o addopts="" -q -p no:cacheprovider -rs -k torch tests/test_engine_contract.py
[ -d .gpu/drawtiny ] && TAIL=4 step draws_fp16 50 "${DRAWS[@]}" --dtype float16
[ -d .gpu/drawtiny ] && TAIL=4 step draws_fp32 50 "${DRAWS[@]}" --dtype float32
echo "== done"
