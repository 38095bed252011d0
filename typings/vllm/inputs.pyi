# vLLM is an optional extra (`pnyx[vllm]`) installed in its own environment (scripts/test_vllm_cpu.sh), not
# where pyright runs. Without a stub pyright resolves `import vllm` to pnyx/rollout/engines/vllm.py itself.
# Every name is Any: the engine is checked against the real vLLM by its contract tests (`pytest -m vllm`).
from typing import Any

def __getattr__(name: str) -> Any: ...
